"""What the benchmarks on the emulated cluster share (stp_emulated.py, overlap_emulated.py,
moe_ep_emulated.py).

Their common flags, the checks before a run, two emulated nodes (network namespaces on a bridge,
commpipe.cluster.netns) with layouts trained on them, and the step times of a run. Not a
benchmark itself: the scripts import it as a sibling module (`sudo python benchmarks/<name>.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parser(doc: str, *, mbit: float, steps: int, microbatches: int) -> argparse.ArgumentParser:
    """An argument parser described by the first line of `doc`, with the flags every emulated
    benchmark takes first (--mbit, --steps, --microbatches; defaults as given). The script adds
    its own, and --out with `add_out`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--mbit", type=float, default=mbit, help=f"inter-node rate, Mbit/s (default {mbit:g})")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--microbatches", type=int, default=microbatches)
    return p


def add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp folder)")


def runs_dir(tag: str, out: str | None) -> Path | None:
    """Ready to run, or None: puts this checkout's commpipe first on sys.path (sudo's Python may
    not have it installed); where network namespaces cannot be made here (no root or no
    iproute2) prints `<tag>: skipped: <why>` and returns None; otherwise the folder for the
    runs, `out` or a new temporary one."""
    sys.path.insert(0, str(REPO))
    from commpipe.cluster.netns import available

    ok, why = available()
    if not ok:
        print(f"{tag}: skipped: {why}")
        return None
    return Path(out or tempfile.mkdtemp(prefix=f"{tag}_"))


@contextmanager
def emulated_runner(mbit: float, ranks_per_node: int, prefix: str) -> Iterator[Callable[..., bool]]:
    """Two emulated nodes of `ranks_per_node` ranks, the links between them shaped to `mbit`
    Mbit/s (interfaces named after `prefix`). Yields `run(layout, flags, run_dir) -> bool`, which
    trains one Layout there with these train flags (900 s at most) into run_dir and, when that
    fails, prints `<run_dir name>: <status>: <reason>` and returns False."""
    from commpipe.cluster.netns import EmulatedCluster
    from commpipe.cluster.sweep import EmulatedRunner

    with EmulatedCluster(nodes=2, ranks_per_node=ranks_per_node, inter_node_mbit=mbit,
                         prefix=prefix) as cluster:
        runner = EmulatedRunner(cluster, timeout_s=900)

        def run(layout, flags: dict, run_dir: Path) -> bool:
            res = runner(layout, flags, run_dir)
            if not res.ok:
                print(f"{run_dir.name}: {res.status}: {res.reason}")
            return res.ok

        yield run


def step_times(run_dir: Path) -> list[float]:
    """Step times of steps 1.. (the first connects and warms up)."""
    from commpipe.report.tables import read_jsonl

    return [r["step_time_s"] for r in read_jsonl(run_dir / "metrics.jsonl")[1:]]


def exposure_per_step(run_dir: Path, dim: str) -> dict[str, float]:
    """Median over steps 1.. of the per-rank mean exposure of one dimension's communication
    (`blocked_ms_total`: host time the compute spent waiting for it) and its transfer time
    (sampled calls) per step, from the run's monitor records."""
    per = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))      # step -> rank -> [w, t]
    for f in (run_dir / "monitor").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("dim") == dim and r.get("step", 0) >= 1:
                cell = per[r["step"]][r["rank"]]
                cell[0] += r.get("blocked_ms_total") or 0.0
                cell[1] += r.get("transfer_ms_total") or 0.0
    waits = [statistics.mean(c[0] for c in ranks.values()) for ranks in per.values()]
    transfers = [statistics.mean(c[1] for c in ranks.values()) for ranks in per.values()]
    return {"exposed_ms": statistics.median(waits) if waits else 0.0,
            "transfer_ms": statistics.median(transfers) if transfers else 0.0}
