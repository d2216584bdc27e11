"""One GPU: measured training step time of a ~1B LLaMA at several micro-batch sizes against
`commpipe estimate` for that GPU (--framework commpipe: this runtime's own kernels).

    python benchmarks/gpu_step_vs_estimate.py                 # on a CUDA machine
    python benchmarks/gpu_step_vs_estimate.py --device cpu --model tiny --seq-len 64 \
        --global-batch 4 --mbs 1,2 --gpu cpu                  # the same path on CPU

Per micro-batch size: the median step time over --steps timed steps (after --warmup), each
bracketed by CUDA synchronisation, its spread, the prediction with its 80% interval, the signed
error (estimate / measured - 1), model TFLOP/s and MFU as measured, and the peak memory torch
allocated against the planner's per-GPU memory without its allocator reserve (and the allocator's
reserved peak against the planned total). On CUDA it prints the host time per eager op that
`estimate`, run on the same host, measures and prices the passes with (max of GPU and host
time). --trace DIR writes a torch.profiler trace of one step at the largest micro-batch size and
prints the share of the step the GPU ran kernels;
--memory-at-peak lists what holds memory at the step's peak, by source line. Results on an H200
are in docs/planner.md ("One GPU: measured against estimate").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

DEFAULT_MODEL = "arch=llama,layers=22,hidden=2048,heads=32,kv_heads=4,ffn_hidden=5632,vocab=32000"


GIB = 2**30


def plan_tensors_gb(est: dict) -> float:
    """The planner's per-GPU memory without its allocator reserve, in GB (1e9), the units of
    torch.cuda.max_memory_allocated."""
    return (est["memory_gb_per_gpu"] - est["reserve_gb_per_gpu"]) * GIB / 1e9


def gpu_table_name(device: torch.device) -> str:
    """The planner's table entry for this device ("NVIDIA H100 80GB HBM3" -> h100)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "b200", "a100", "l40s"):
        if key in name:
            return key
    raise SystemExit(f"no planner table entry for {name!r}; pass --gpu")


def estimate(args, mbs: int) -> dict:
    cmd = [sys.executable, "-m", "commpipe", "estimate", "--gpu", args.gpu, "--gpus", "1",
           "--model", args.model, "--framework", "commpipe", "--precision", args.precision,
           "--micro-batch-size", str(mbs), "--global-batch", str(args.global_batch),
           "--seq-len", str(args.seq_len), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, mbs: int, device: torch.device):
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.loop import Trainer

    cfg = TrainConfig(model=args.model, seq_len=args.seq_len, global_batch=args.global_batch,
                      micro_batch_size=mbs, steps=args.warmup + args.steps, device=device.type,
                      precision=args.precision, seed=0)
    cfg.resolve(1)
    return cfg, Trainer.build(cfg, Comm(ParallelDims(), 0, device=device))


def measure(args, mbs: int, device: torch.device) -> dict:
    from commpipe.train.loop import step_flops

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cfg, trainer = build(args, mbs, device)
    for _ in range(args.warmup):
        trainer.train_step()
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        record = trainer.train_step()
        sync(device)
        times.append(time.perf_counter() - t0)
    cuda = device.type == "cuda"
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None
    reserved_gb = torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None
    busy = trace_step(trainer, device, args.trace) if args.trace and mbs == args.mbs[-1] else None
    if args.memory_at_peak and cuda and mbs == args.mbs[-1]:
        try:
            for where, gb in memory_at_peak(trainer, device):
                print(f"     at peak {gb:7.2f} GB  {where}")
        except Exception as e:               # a diagnostic: never lose the timings for it
            print(f"     memory history unavailable: {e!r}")
    flops = step_flops(cfg)
    del trainer
    return {"times": times, "flops": flops, "peak_gb": peak_gb, "reserved_gb": reserved_gb,
            "kernel_busy": busy,
            "saved_gb": record["activation_mb"] * 2**20 / 1e9}


def memory_at_peak(trainer, device: torch.device, top: int = 14) -> list[tuple[str, float]]:
    """One step with CUDA's allocator history on: the blocks alive at the step's peak, summed by
    the innermost commpipe source line that allocated them (GB), largest first."""
    from collections import Counter

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        trainer.train_step()
        sync(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict = {}
    for seg in snap["segments"]:             # blocks already allocated when recording began
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                live[blk["address"]] = (blk["size"], "before the step")
    best, best_live = sum(v[0] for v in live.values()), dict(live)
    total = best
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            where = next((f"{f['filename'].split('commpipe/')[-1]}:{f['line']}"
                          for f in ev.get("frames", []) if "commpipe/" in f["filename"]), "torch")
            live[ev["addr"]] = (ev["size"], where)
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    by = Counter()
    for size, where in best_live.values():
        by[where] += size / 1e9
    return [("peak", best / 1e9)] + by.most_common(top)


def trace_step(trainer, device: torch.device, out_dir: str) -> float | None:
    """One step under torch.profiler; the share of its wall time the GPU ran kernels."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        trainer.train_step()
        sync(device)
    wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(Path(out_dir) / "gpu_step_trace.json"))
    if device.type != "cuda":
        return None
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:            # union of kernel intervals (us)
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6 / wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--mbs", default="1,2,4", help="micro-batch sizes, comma-separated")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu", default=None, help="planner table entry (default: from the device)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trace", default=None, help="write a profiler trace of one step here")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--memory-at-peak", action="store_true",
                   help="CUDA: list what holds memory at the peak of one step (largest mbs)")
    args = p.parse_args(argv)
    args.mbs = [int(m) for m in args.mbs.split(",")]
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    args.gpu = args.gpu or gpu_table_name(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name} (planner entry {args.gpu}), torch {torch.__version__}, {args.precision}, "
          f"model {args.model}, seq {args.seq_len}, global batch {args.global_batch}")
    if device.type == "cuda":
        from commpipe.plan.cpu import host_op_seconds

        # what `estimate`, run on this host, prices each of a pass's eager ops at
        # (commpipe.plan.runtime_ops: a pass takes max(GPU time, ops x this))
        print(f"host time per eager op on this GPU: {host_op_seconds('cuda') * 1e6:.1f} us")
    head = (f"{'mbs':>4} {'measured ms':>12} {'spread':>13} {'estimate ms':>12} {'80% interval':>15}"
            f" {'error':>7} {'TFLOP/s':>8} {'MFU':>6} {'alloc GB':>9} {'plan GB':>8}")
    print(head)
    rows = []
    for mbs in args.mbs:
        est = estimate(args, mbs)
        got = measure(args, mbs, device)
        med = statistics.median(got["times"])
        tflops = got["flops"] / med / 1e12
        iv = est.get("interval")                # in TFLOP/s -> step time (none on --gpu cpu)
        scale = est["step_time_s"] * est["tflops_per_gpu"] * 1e3
        interval = [scale / iv["tflops_per_gpu_high"], scale / iv["tflops_per_gpu_low"]] if iv else None
        err = est["step_time_s"] / med - 1
        mfu = tflops / est["tflops_per_gpu"] * est["mfu"] if est["mfu"] else float("nan")
        row = {"mbs": mbs, "measured_ms": med * 1e3,
               "min_ms": min(got["times"]) * 1e3, "max_ms": max(got["times"]) * 1e3,
               "estimate_ms": est["step_time_s"] * 1e3, "interval_ms": interval,
               "error": err, "measured_tflops": tflops, "measured_mfu": mfu,
               "peak_gb": got["peak_gb"], "reserved_gb": got["reserved_gb"],
               "plan_gb": est["memory_gb_per_gpu"] * GIB / 1e9,
               "plan_tensors_gb": plan_tensors_gb(est),
               "saved_gb": got["saved_gb"], "plan_saved_gb": est["activation_gb_per_gpu"] * 2**30 / 1e9,
               "breakdown_s": est["breakdown_s"], "kernel_busy": got["kernel_busy"]}
        rows.append(row)
        peak = f"{got['peak_gb']:9.1f}" if got["peak_gb"] is not None else f"{'-':>9}"
        span = f"{interval[0]:7.1f}-{interval[1]:<7.1f}" if interval else f"{'-':^15}"
        print(f"{mbs:>4} {med * 1e3:12.1f} {row['min_ms']:6.1f}-{row['max_ms']:<6.1f} "
              f"{row['estimate_ms']:12.1f} {span} {err:+7.1%} "
              f"{tflops:8.1f} {mfu:6.1%} {peak} {row['plan_tensors_gb']:8.1f}", flush=True)
        if got["reserved_gb"] is not None:
            print(f"     memory: {got['reserved_gb']:.1f} GB reserved by the allocator, "
                  f"{row['plan_gb']:.1f} GB planned with its reserve")
        if device.type != "cuda":   # on CUDA activation_mb is the step's allocator growth
            print(f"     saved for backward: {row['saved_gb']:.2f} GB measured (activation_mb), "
                  f"{row['plan_saved_gb']:.2f} GB planned")
        if got["kernel_busy"] is not None:
            print(f"     traced step: GPU kernels busy {got['kernel_busy']:.0%} of its wall time")
    errs = [abs(r["error"]) for r in rows]
    spans = [r for r in rows if r["interval_ms"]]
    inside = (f"{sum(r['interval_ms'][0] <= r['measured_ms'] <= r['interval_ms'][1] for r in spans)}"
              f"/{len(spans)}" if spans else "- (no interval for --gpu cpu)")
    print(f"median |error| {statistics.median(errs):.1%}; inside the 80% interval: {inside}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "gpu": args.gpu, "torch": torch.__version__,
                       "model": args.model, "seq_len": args.seq_len,
                       "global_batch": args.global_batch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
