"""What a training run writes into its folder besides checkpoints: the metrics file (continued
without repeated steps after a resume) and on GPU the profiler timeline (commpipe.train.loop
calls these; the console lines are commpipe.train.console's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

TRACE_STEPS = 5   # --trace keeps the timeline of the last five steps (bounded in long runs)


def open_metrics(path: Path, step: int, restart: bool = False, source: str | None = None):
    """metrics.jsonl opened to append from `step` on. Records of steps >= `step` (written after
    the checkpoint a resumed run starts from, or a torn last line; all of them when a requeued
    `--resume` finds no checkpoint and starts at 0) move to metrics.replaced.jsonl, so the file
    holds each step once and nothing is thrown away. A run that starts (`restart`: not an
    in-memory layout switch) and resumes (step > 0 or records moved) appends its restart
    record to restarts.jsonl beside it (`restart_record`; `source`: what the state came from,
    "checkpoint" or "peer copies", None for a start at step 0)."""
    if path.exists():
        keep, moved = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                ok = json.loads(line)["step"] < step
            except (ValueError, KeyError, TypeError):
                ok = False
            (keep if ok else moved).append(line if line.endswith("\n") else line + "\n")
        if restart and (moved or step > 0):
            with open(path.with_name("restarts.jsonl"), "a") as f:
                f.write(json.dumps({**restart_record(step, keep, moved), "from": source}) + "\n")
        if moved:
            with open(path.with_name("metrics.replaced.jsonl"), "a") as f:
                f.writelines(moved)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(keep))
            tmp.replace(path)
    return open(path, "a")


def _records(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in out if isinstance(r, dict) and "step" in r]


def restart_record(step: int, kept: list[str], moved: list[str]) -> dict:
    """What the report marks for a resume at `step`: the steps run again (`replaced`, first and
    last, None when the checkpoint was the last step), and the world and layout the run had
    before it stopped (its last record)."""
    kept_recs, moved_recs = _records(kept), _records(moved)
    replaced = [moved_recs[0]["step"], moved_recs[-1]["step"]] if moved_recs else None
    before = (moved_recs or kept_recs or [{}])[-1]
    world = 1
    for k in ("tp", "cp", "pp", "dp"):
        world *= before.get(k, 1)
    return {"step": step, "replaced": replaced, "world_before": world if before else None,
            "layout_before": before.get("layout"), "time": round(time.time(), 3)}


def kineto_trace(trainer):
    """--trace on CUDA: torch.profiler (Kineto) records the last TRACE_STEPS steps with real
    kernels (NCCL's included) on one device clock, commpipe's action names as annotations
    (record_function in the runtime) and ProfilerStep#N marks, into OUT/trace/rank{r}.json,
    a file HTA reads as it is. On CPU the monitor writes that file instead."""
    cfg = trainer.cfg
    if not (cfg.trace and cfg.out and trainer.device.type == "cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    remaining = max(cfg.steps - trainer.step, 1)
    active = min(TRACE_STEPS, remaining)
    skip = remaining - active
    path = Path(cfg.out) / "trace" / f"rank{trainer.comm.rank}.json"

    def export(prof) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=max(skip - 1, 0), warmup=min(skip, 1), active=active,
                                     repeat=1),
                   on_trace_ready=export)
