"""What `commpipe train` prints: a start banner, one line per logged step, an end summary.

    commpipe: tp1-cp1-pp2-dp1 1f1b m4x1 layers 2,2 on 2 ranks (2 per node), gloo, cpu
    commpipe: model tiny: 1.23M parameters, 7.9 MFLOP per token (forward + backward), fp32
    commpipe: schedule 1f1b, pp 2 x 4 micro-batches: bubble 20% (f=1, b=2 per stage)
    step     0 | loss 5.5452 |    31.0 ms |   8265 tok/s | 0.0321 GFLOP/s/GPU | lr 1.50e-03
    ...
    commpipe: 10 steps, median 30.1 ms: 8503 tok/s, 0.0331 GFLOP/s/GPU; final loss 5.3120
    commpipe: files in runs/t: metrics.jsonl, config.json, checkpoints/

The numbers come from the definitions the rest of commpipe uses: parameters and FLOPs from
commpipe.models.spec (blip_spec for BLIP), the bubble from the simulator (commpipe.sim) on unit
costs, link bandwidths from the report's link summary (commpipe.report.links).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

# what a run folder may hold, in the order the summary names them
RUN_FILES = ("metrics.jsonl", "config.json", "adapt.jsonl", "checkpoints", "monitor", "trace",
             "tensorboard")


def format_count(n: float, unit: str = "") -> str:
    """Three significant digits and a prefix: 1234567 -> '1.23M', (7.9e6, 'FLOP') -> '7.9 MFLOP'."""
    prefixes = ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "k"), (1, ""))
    div, prefix = next(((d, p) for d, p in prefixes if abs(n) >= d), (1, ""))
    return f"{n / div:.3g}" + (f" {prefix}{unit}" if unit else prefix)


def sig3(x: float) -> str:
    """Three significant digits, trailing zeros kept: 0.6 -> '0.600', 668.6 -> '669'."""
    return f"{x:#.3g}".rstrip(".")


def format_flops(flops_per_s: float) -> str:
    """A FLOP rate in the unit that shows three significant digits: '312 TFLOP/s',
    '0.473 GFLOP/s' (never a run of zeros)."""
    for div, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if abs(flops_per_s) >= div:
            return f"{sig3(flops_per_s / div)} {unit}"
    return f"{sig3(flops_per_s / 1e9)} GFLOP/s"


def format_rate(gbps: float) -> str:
    """Decimal GB/s, or MB/s below 1 GB/s: '12.5 GB/s', '1.72 MB/s'."""
    return f"{sig3(gbps)} GB/s" if gbps >= 1 else f"{sig3(gbps * 1e3)} MB/s"


def format_ms(ms: float) -> str:
    """Milliseconds without exponents: '0.227 ms', '31.0 ms', '5906 ms', '23,590 ms'."""
    if abs(ms) >= 10_000:
        return f"{ms:,.0f} ms"
    if abs(ms) >= 100:
        return f"{ms:.0f} ms"
    return f"{sig3(ms)} ms" if abs(ms) >= 1e-3 or ms == 0 else f"{sig3(ms * 1e3)} us"


def format_step(rec: dict, start_layout: str | None = None) -> str:
    """The console line of one step's metrics record; it names the layout when that is not
    `start_layout`, the one the run started with (after an adaptive switch)."""
    layout = rec.get("layout") if rec.get("layout") != start_layout else None
    flops = format_flops(rec["tflops_per_gpu"] * 1e12)
    line = (f"step {rec['step']:>5} | loss {rec['loss']:.4f} | {rec['step_time_s'] * 1e3:8.1f} ms"
            f" | {rec['tokens_per_s']:9.0f} tok/s | {flops}/GPU | lr {rec['lr']:.2e}")
    if "val_loss" in rec:
        line += f" | val {rec['val_loss']:.4f}"
    return line + (f" | {layout}" if layout else "")


def format_balance(b: dict) -> str:
    """--stage-layers auto: the chosen split and the predicted stage costs, beside the even
    split's (costs in b["unit"], shares of the total in brackets)."""
    total = sum(b["predicted_stage_costs"]) or 1.0

    def costs(xs):
        return ", ".join(f"{x:.3g} ({x / total:.0%})" for x in xs)

    return (f"stage layers auto (by {b['from']}): split {b['split']}, predicted stage costs "
            f"[{costs(b['predicted_stage_costs'])}] {b['unit']}; even split {b['even_split']}: "
            f"[{costs(b['even_stage_costs'])}]")


def model_size(cfg) -> tuple[int, float, str]:
    """(parameters, training FLOPs per unit, unit): per token, per image-caption sample (BLIP)."""
    from commpipe.models.family import family_of

    spec = cfg.spec
    family = family_of(spec)
    return (family.param_count(spec, cfg.seq_len), family.flops_per_unit(spec, cfg.seq_len),
            family.unit)


def schedule_bubble(cfg) -> float | None:
    """The schedule's idle share on unit costs (f=1, b=2 per stage), as `commpipe simulate`
    gives it; None when it cannot be simulated."""
    if cfg.dims.pp == 1:
        return 0.0
    try:
        from commpipe.sim.engine import simulate

        return simulate(cfg.program(), record=False).bubble_fraction
    except Exception:   # noqa: BLE001 - the banner must never stop a run
        return None


def ranks_per_node(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)


def banner(cfg, comm, device) -> list[str]:
    """The start banner: resolved layout, ranks, backend, model size, precision, schedule."""
    from commpipe.train.config import layout_label

    world = cfg.dims.world_size
    params, flops, unit = model_size(cfg)
    backend = comm.backend if comm.backend != "none" else "single process"
    lines = [f"commpipe: {layout_label(cfg)} on {world} rank{'s' if world > 1 else ''} "
             f"({ranks_per_node(world)} per node), {backend}, {device.type}",
             f"commpipe: model {cfg.spec.name}: {format_count(params)} parameters, "
             f"{format_count(flops, 'FLOP')} per {unit} (forward + backward), {cfg.precision}, "
             f"global batch {cfg.global_batch} "
             + (f"x {cfg.seq_len} tokens" if unit == "token" else "image-caption samples")]
    if cfg.dims.pp == 1:
        lines.append(f"commpipe: no pipeline (pp 1), {cfg.microbatches} micro-batch"
                     f"{'es' if cfg.microbatches > 1 else ''} of {cfg.micro_batch_size}")
    else:
        bubble = schedule_bubble(cfg)
        b = "unknown" if bubble is None else f"{bubble:.0%}"
        vpp = f", vpp {cfg.vpp}" if cfg.vpp > 1 else ""
        lines.append(f"commpipe: schedule {cfg.schedule}, pp {cfg.dims.pp}{vpp} x "
                     f"{cfg.microbatches} micro-batches of {cfg.micro_batch_size}: bubble {b} "
                     f"(simulated with f=1, b=2 per stage)")
    if cfg.emulate_device > 1.0:
        lines.append(f"commpipe: --emulate-device {cfg.emulate_device:g}: every compute operator "
                     f"takes {cfg.emulate_device:g}x its host time, the host idle for the extra "
                     "(step times are an emulated device's, not this CPU's)")
    return lines


def summary(cfg, history: list[dict], out: Path | None, warmup: int = 1) -> list[str]:
    """The end summary: median step time (after the first `warmup` steps when there are more),
    tokens/s, FLOP/s per GPU, final losses and what the run folder holds."""
    if not history:
        return []
    steady = history[warmup:] if len(history) > warmup else history
    med = statistics.median(r["step_time_s"] for r in steady)
    last = history[-1]
    tokens = last["tokens_per_s"] * last["step_time_s"]          # tokens of one step
    flops = last["tflops_per_gpu"] * 1e12 * last["step_time_s"]   # FLOPs per GPU of one step
    val = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
    lines = [f"commpipe: {len(history)} steps, median {format_ms(med * 1e3)} per step"
             + (f" (steps {steady[0]['step']}-{steady[-1]['step']})" if steady is not history
                else "")
             + f": {tokens / med:,.0f} tok/s, {format_flops(flops / med)}/GPU; final loss "
             f"{last['loss']:.4f}" + (f", val {val:.4f}" if val is not None else "")]
    if out is not None and out.is_dir():
        files = [f + ("/" if (out / f).is_dir() else "") for f in RUN_FILES if (out / f).exists()]
        lines.append(f"commpipe: files in {out}: {', '.join(files)}")
        lines += link_summary(out)
    if cfg.monitor is not None and out is not None:
        lines.append(f"commpipe: full report: commpipe report {out}")
    return lines


def link_summary(out: Path) -> list[str]:
    """--comm-monitor: measured bandwidth per dimension and link class, one line each (the
    report's link-class table in short)."""
    if not (out / "monitor" / "links.jsonl").exists():
        return []
    from commpipe.report.links import class_summary, link_rows

    rows = class_summary(link_rows(out, warmup=1))
    if not rows:
        return ["commpipe: communication monitor: no timed transfers after the first step"]
    cells = [f"{r['dim'].upper()} {r['link_class'].replace('_', '-')} {format_rate(r['gbps'])} "
             f"({format_ms(r['transfer_ms'])} per call, {r['links']} link"
             f"{'s' if r['links'] > 1 else ''})" for r in rows]
    return ["commpipe: measured bandwidth (median): " + "; ".join(cells)]
