"""`commpipe demo --adaptive --out DIR`: the controller on an emulated 2-node x 2-rank cluster.

The story: data parallelism across the nodes is the fastest layout while the inter-node link is
fast; a short blip of that link must be ignored; then the link degrades for good, the gradient
all-reduce across it dominates, and the controller switches (in memory) to a layout that sends
far less across it. Three runs of the same training:
    DIR/adaptive/  the scenario with `--adapt`
    DIR/static/    the same scenario, controller off
    DIR/oracle/    the layout the controller chose, static, under the degraded link from step 0
plus DIR/scenario.json (degrade_step, link, rates, blip steps as they happened), report.html
and a printed summary. Link rates change live with `EmulatedCluster.set_rate` while the run
trains, at step boundaries read from the run's metrics.jsonl. Needs root and iproute2.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL = "arch=llama,layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=512,vocab=256"


@dataclass
class Scenario:
    steps: int = 60
    fast_mbit: float = 1000.0
    slow_mbit: float = 20.0
    blip: tuple[int, int] = (12, 13)     # [start, end) steps of the short degrade
    degrade_step: int = 26               # lasting degrade from here on
    node: int = 1                        # the node whose link is throttled
    start: dict = field(default_factory=lambda: {"dp": 4})
    train: dict = field(default_factory=lambda: {
        "model": MODEL, "seq_len": 32, "global_batch": 8, "seed": 0, "log_every": 10})


class RateDriver(threading.Thread):
    """Sets the node's link rate when the run's metrics reach given steps; records when."""

    def __init__(self, cluster, run_dir: Path, node: int, changes: list[tuple[int, float]]):
        super().__init__(daemon=True)
        self.cluster, self.path, self.node = cluster, run_dir / "metrics.jsonl", node
        self.changes = sorted(changes)
        self.applied: list[tuple[int, float]] = []   # (first step under the rate, Mbit/s)
        self.stop = threading.Event()

    def last_step(self) -> int:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return -1
        for line in reversed(lines):
            try:
                return json.loads(line)["step"]
            except (ValueError, KeyError):
                continue
        return -1

    def run(self) -> None:
        pending = list(self.changes)
        while pending and not self.stop.is_set():
            done = self.last_step()
            if done + 1 >= pending[0][0]:
                step, mbit = pending.pop(0)
                self.cluster.set_rate(self.node, mbit)
                self.applied.append((self.last_step() + 1, mbit))
            time.sleep(0.02)


def _run(cluster, sc: Scenario, run_dir: Path, layout: dict, adapt: bool, changes, port: int):
    from commpipe.cluster.grids import Layout
    from commpipe.cluster.launch import plan_commands, run_commands

    train = dict(sc.train, steps=sc.steps, adapt=adapt or None)
    lay = Layout(**layout)
    cmds = plan_commands(lay, train, run_dir.resolve(), nodes=cluster.nodes,
                         ranks_per_node=cluster.ranks_per_node, master_addr=cluster.node_ip(0),
                         master_port=port, ifname=cluster.ifname)
    driver = RateDriver(cluster, run_dir, sc.node, changes)
    driver.start()
    try:
        result = run_commands(cmds, run_dir, cluster=cluster, timeout_s=300)
    finally:
        driver.stop.set()
        driver.join()
    if not result.ok:
        raise RuntimeError(f"{run_dir.name} run {result.status}: {result.reason}")
    return driver.applied


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _median_ms(rows: list[dict], lo: int, hi: int | None = None) -> float | None:
    vals = [r["step_time_s"] * 1e3 for r in rows if r["step"] >= lo and (hi is None or r["step"] < hi)]
    return statistics.median(vals) if vals else None


def summarize(out: Path, sc: Scenario, applied: list, oracle_layout: dict) -> dict:
    adaptive, static, oracle = (_metrics(out / n) for n in ("adaptive", "static", "oracle"))
    decisions = [json.loads(x) for x in (out / "adaptive" / "adapt.jsonl").read_text().splitlines()
                 if x.strip()] if (out / "adaptive" / "adapt.jsonl").exists() else []
    degrade = next((s for s, mbit in applied if mbit == sc.slow_mbit and s >= sc.blip[1]),
                   sc.degrade_step)
    switches = [d for d in decisions if d["action"] == "switch"]
    first = switches[0] if switches else None
    detected = [d for d in decisions if d["step"] >= degrade]
    after = first["step"] + 2 if first else None
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(adaptive, static))
    s = {
        "degrade_step": degrade,
        "switches_before_degrade": sum(d["step"] < degrade for d in switches),
        "detection_delay_steps": detected[0]["step"] - degrade if detected else None,
        "first_switch_step": first["step"] if first else None,
        "switch_delay_steps": first["step"] - degrade if first else None,
        "switch_to": first["to"]["name"] if first else None,
        "switch_time_s": first.get("switch_time_s") if first else None,
        "step_ms_before": _median_ms(adaptive, 2, sc.blip[0]),
        "step_ms_degraded_static": _median_ms(static, degrade + 1),
        "step_ms_after_switch": _median_ms(adaptive, after) if after else None,
        "step_ms_oracle": _median_ms(oracle, 2),
        "oracle_layout": oracle_layout,
        "max_loss_diff_adaptive_vs_static": loss_diff,
    }
    o = s["step_ms_oracle"]
    if o:
        s["static_vs_oracle"] = s["step_ms_degraded_static"] / o - 1
        if s["step_ms_after_switch"]:
            s["after_switch_vs_oracle"] = s["step_ms_after_switch"] / o - 1
    return s


def run_adaptive_demo(out, sc: Scenario | None = None, log=print) -> dict:
    from commpipe.cluster.netns import EmulatedCluster, available

    ok, why = available()
    if not ok:
        raise RuntimeError(f"the adaptive demo needs the emulated cluster: {why}")
    sc = sc or Scenario()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=sc.fast_mbit,
                         prefix="cpad") as cluster:
        plan = [(sc.blip[0], sc.slow_mbit), (sc.blip[1], sc.fast_mbit),
                (sc.degrade_step, sc.slow_mbit)]
        blip = f"step {sc.blip[0]}" if sc.blip[1] - sc.blip[0] == 1 else \
            f"steps {sc.blip[0]}-{sc.blip[1] - 1}"
        log(f"adaptive: {sc.start} with --adapt; link of node {sc.node} {sc.fast_mbit:g} Mbit/s, "
            f"blip to {sc.slow_mbit:g} at {blip}, lasting from step {sc.degrade_step}")
        applied = _run(cluster, sc, out / "adaptive", sc.start, True, plan, 29611)
        cluster.set_rate(sc.node, sc.fast_mbit)
        log("static: the same scenario, controller off")
        _run(cluster, sc, out / "static", sc.start, False, plan, 29612)
        decisions = [json.loads(x) for x in (out / "adaptive" / "adapt.jsonl").read_text()
                     .splitlines() if x.strip()]
        chosen = next((d["to"] for d in decisions if d["action"] == "switch"), None)
        oracle = ({k: chosen[k] for k in ("tp", "cp", "pp", "dp")} if chosen
                  else {"pp": 2, "dp": 2})
        log(f"oracle: {oracle} under the degraded link from step 0")
        cluster.set_rate(sc.node, sc.slow_mbit)
        _run(cluster, sc, out / "oracle", oracle, False, [], 29613)
    scenario = {"degrade_step": next((s for s, m in applied if m == sc.slow_mbit
                                      and s >= sc.blip[1]), sc.degrade_step),
                "link": f"node {sc.node}",
                "rates_mbit": {"fast": sc.fast_mbit, "slow": sc.slow_mbit},
                "blip_steps": list(range(applied[0][0], applied[1][0])) if len(applied) >= 2
                else [],
                "rate_changes": applied, "scenario": asdict(sc)}
    (out / "scenario.json").write_text(json.dumps(scenario, indent=2))
    summary = summarize(out, sc, applied, oracle)
    summary["elapsed_s"] = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    summary["report"] = write_demo_report(out, summary)
    return summary


def write_demo_report(out: Path, summary: dict) -> str:
    """The sweep report of the three runs, with the comparison figure and the summary first."""
    from commpipe.report.adaptive import compare_figure
    from commpipe.report.cli import write_report
    from commpipe.report.figures import make_figures
    from commpipe.report.html import write_html
    from commpipe.report.tables import collect

    write_report(out, warmup=2, title="commpipe adaptive demo")   # csv, markdown, figures
    rows = collect(out, 2)
    figures = [f for f in [compare_figure(out)] if f] + make_figures(out, rows)
    notes = format_summary(summary).splitlines()
    return str(write_html(out / "report.html", "commpipe adaptive demo", rows, figures, notes))


def format_summary(s: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.0f} ms"

    lines = [
        f"degrade at step {s['degrade_step']}; switches before it: {s['switches_before_degrade']}",
        f"detection delay: {s['detection_delay_steps']} steps; first switch at step "
        f"{s['first_switch_step']} ({s['switch_delay_steps']} steps after) to {s['switch_to']}, "
        f"switch time {s['switch_time_s'] or 0:.2f} s",
        f"step time: before {ms(s['step_ms_before'])}, degraded (static) "
        f"{ms(s['step_ms_degraded_static'])}, after the switch {ms(s['step_ms_after_switch'])}, "
        f"oracle {ms(s['step_ms_oracle'])} ({s['oracle_layout']})",
    ]
    if "static_vs_oracle" in s:
        lines.append(f"static is {s['static_vs_oracle']:+.0%} vs the oracle after the degrade; "
                     f"adaptive after the switch {s.get('after_switch_vs_oracle', 0):+.0%}")
    lines.append(f"largest loss difference adaptive vs static: "
                 f"{s['max_loss_diff_adaptive_vs_static']:.2e}; took {s['elapsed_s']:.0f} s")
    return "\n".join(lines)
