"""What a sweep leaves in its folder, and how it stops on a signal.

OUT/sweep.jsonl holds one status line per finished layout (the latest line of a layout wins),
with the fingerprint of the layout and flags it ran with: a rerun skips a layout whose record
stands (`already_done`) and builds no cluster when every one does (`nothing_to_run`);
OUT/cluster.json names the emulated cluster a sweep built, so `commpipe cluster down --sweep OUT`
finds its namespaces after the sweep was killed. SIGTERM and SIGINT raise `Interrupted` in the
main thread, so the `finally` blocks under it stop the running layout's process group and tear
the cluster down before the sweep records the layout as interrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from commpipe.files import read_text

if TYPE_CHECKING:
    from commpipe.cluster.grids import Grid, Layout

STATUS_FILE = "sweep.jsonl"
CLUSTER_FILE = "cluster.json"     # the emulated cluster's prefix, for `commpipe cluster down --sweep`


def fingerprint(layout: Layout, train: dict) -> str:
    flags = {**train, **layout.extra}
    if flags.get("config"):     # a job config file: its content, not only its name
        try:
            flags["config_sha1"] = hashlib.sha1(Path(flags["config"]).read_bytes()).hexdigest()
        except OSError:
            pass
    blob = json.dumps({"layout": layout.grid_dict(), "train": flags}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def already_done(prev: dict | None, fp: str, run_dir: Path, force: bool, retry_failed: bool) -> bool:
    """Whether a layout's record from an earlier run of the sweep stands: the same layout and
    flags (fingerprint), not interrupted, and ok with its metrics, or failed and not retried."""
    if not prev or prev.get("fingerprint") != fp or force or prev["status"] == "interrupted":
        return False
    finished = prev["status"] == "ok" and (run_dir / "metrics.jsonl").exists()
    return finished or (prev["status"] != "ok" and not retry_failed)


def nothing_to_run(grid: Grid, out, train: dict, force: bool = False, retry_failed: bool = False) -> bool:
    """Every layout of the grid already done in OUT (a rerun of a finished sweep): no cluster
    needs to be built."""
    done = read_status(out, warn=lambda _: None)
    train = {**grid.train, **train}         # as run_sweep takes them
    return all(already_done(done.get(lay.name), fingerprint(lay, train), Path(out) / lay.name,
                            force, retry_failed) for lay in grid.layouts)


def read_status(out_dir, warn=None) -> dict[str, dict]:
    """Latest status line per layout name. A torn last line (a sweep killed while writing it)
    is skipped with a warning, so its layout runs again; any other unreadable line is an error
    naming it."""
    path = Path(out_dir) / STATUS_FILE
    latest = {}
    if not path.exists():
        return latest
    lines = read_text(path, "sweep status").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("name"), str):
                raise ValueError("no layout name")
        except ValueError as e:
            if i == len(lines):
                (warn or _warn)(f"warning: {path}:{i}: ignoring a torn last line (a sweep was "
                                "stopped while writing it); its layout runs again")
                continue
            raise ValueError(f"{path}:{i}: not a status record ({e}); each line must be one "
                             "JSON object with the layout's name: fix or delete that line") from None
        latest[rec["name"]] = rec
    return latest


def _drop_torn_tail(path: Path) -> None:
    """Appends must start on a line of their own: a last line without its newline is cut off
    when it is not a record (a torn write), else completed."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except ValueError:
        with open(path, "r+b") as f:
            f.truncate(cut)
        return
    with open(path, "ab") as f:
        f.write(b"\n")


def _warn(text: str) -> None:
    print(text, file=sys.stderr)


def last_step(run_dir: Path) -> int | None:
    """The step of the last complete line of run_dir/metrics.jsonl (read from the tail)."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def record_status(out: Path, layout, result, runner, train: dict, fp: str) -> dict:
    """Append one layout's status line (a launch.RunResult) to sweep.jsonl."""
    rec = {"name": layout.name, "label": layout.label, **{k: v for k, v in layout.grid_dict().items()
                                                           if k not in ("name", "extra")},
           "status": result.status, "reason": result.reason, "elapsed_s": round(result.elapsed_s, 2),
           "cluster": runner.describe() if hasattr(runner, "describe") else {},
           "train": {**train, **layout.extra}, "fingerprint": fp, "finished_at": time.time()}
    with open(out / STATUS_FILE, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return rec


# -- signals ----------------------------------------------------------------------------------------
class Interrupted(Exception):
    """SIGTERM or SIGINT reached the sweep. Raised in the main thread, so the `finally` blocks
    below it stop the layout's process group and tear the emulated cluster down."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def signals_interrupt():
    """While inside, the first SIGTERM or SIGINT raises Interrupted; later ones are ignored so
    the clean-up they started (a few seconds at most) is not cut short."""
    if threading.current_thread() is not threading.main_thread():   # signals reach the main one
        yield
        return
    seen = []

    def handler(signum, frame):
        if not seen:
            seen.append(signum)
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)
