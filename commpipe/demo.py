"""`commpipe demo`: train the tiny preset under a handful of layouts as local CPU processes and
print a table of layout, loss and step time.

    commpipe demo --out runs/demo
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = [  # (tp, cp, pp, dp, schedule)
    (1, 1, 1, 1, "1f1b"),
    (2, 1, 1, 1, "1f1b"),
    (1, 2, 1, 1, "1f1b"),
    (1, 1, 2, 1, "1f1b"),
    (1, 1, 1, 2, "1f1b"),
    (2, 1, 2, 1, "gpipe"),
    (1, 1, 4, 1, "1f1b"),
    (2, 1, 1, 2, "1f1b"),
]


def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/demo", help="folder for the runs (default runs/demo)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)


def run_layout(layout, out: Path, args) -> dict:
    tp, cp, pp, dp, schedule = layout
    world = tp * cp * pp * dp
    name = f"tp{tp}-cp{cp}-pp{pp}-dp{dp}-{schedule}"
    run_dir = out / name
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "commpipe", "train", "--preset", "tiny",
           "--tp", str(tp), "--cp", str(cp), "--pp", str(pp), "--dp", str(dp),
           "--schedule", schedule, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
           "--global-batch", str(args.global_batch), "--out", str(run_dir), "--log-every", "1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"layout": name, "ranks": world, "error": " | ".join(tail)}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = sorted(r["step_time_s"] for r in rows[1:]) or [rows[0]["step_time_s"]]
    return {"layout": name, "ranks": world, "loss": rows[-1]["loss"],
            "step_ms": 1e3 * times[len(times) // 2], "wall_s": wall}


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"commpipe demo: tiny preset, {len(LAYOUTS)} layouts, {args.steps} steps each, "
          f"local CPU processes -> {out}")
    results = []
    for i, layout in enumerate(LAYOUTS, 1):
        res = run_layout(layout, out, args)
        status = f"loss {res['loss']:.5f}" if "loss" in res else f"FAILED: {res['error']}"
        print(f"[{i}/{len(LAYOUTS)}] {res['layout']:<24} {status}", flush=True)
        results.append(res)
    print()
    print(f"| {'layout':<24} | ranks | final loss | median step (ms) |")
    print(f"|{'-' * 26}|-------|------------|------------------|")
    for r in results:
        if "loss" in r:
            print(f"| {r['layout']:<24} | {r['ranks']:>5} | {r['loss']:>10.5f} | {r['step_ms']:>16.1f} |")
        else:
            print(f"| {r['layout']:<24} | {r['ranks']:>5} | {'failed':>10} | {'-':>16} |")
    (out / "demo.json").write_text(json.dumps(results, indent=2))
    return 0 if all("loss" in r for r in results) else 1
