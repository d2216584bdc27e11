"""Stopping on request and failing loudly.

Stop requests: SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) only sets a flag;
the training loop finishes the current step, and every rank learns whether *any* rank was
signalled through one all-reduce of the flag per step (through Comm), so all ranks stop after
the same step, save one checkpoint and exit 0. A second signal of the same kind kills at once.

Failures: a rank whose code raises reports one line, `commpipe: rank R failed: <error>` (after
its traceback, none for commpipe's own ValueError messages) and leaves at once with a non-zero
code. Under torchrun the line goes into the worker's error file (commpipe.errors), which
torchrun prints in its failure summary, the last thing the job prints; else to stderr.
Its peers then see their connection to it closed inside a collective; that error is a
consequence, not a cause, so they leave with code 1 without printing, 2 s later, so that
torchrun sees the failed rank exit first. torchrun terminates the remaining workers (SIGTERM,
then SIGKILL after 30 s) and names the first failed rank as the root cause in its summary,
which is also the only report for a rank that was killed outright (SIGKILL, out of memory).
A rank that hangs without dying is named by the hang watchdog (commpipe.elastic.watchdog,
`--hang-timeout-s`, 60 s by default): every rank leaves with exit code 4 after the report, and
an elastic torchrun restarts the job; the process-group timeout (`--timeout-s`) remains the
backstop when the watchdog is off or has no store to publish to.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

# Messages gloo and NCCL raise in a rank whose peer died (the peer's own report is the cause).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote worker crashing", "NCCL communicator was aborted")
PEER_LOST_EXIT_DELAY_S = 2.0


class TrainingDiverged(RuntimeError):
    """Loss, gradient norm or parameters became NaN or inf. Every rank decides this from the
    same all-reduced values, so all of them raise it together; rank 0 reports it."""


class StopSignals:
    """SIGTERM / SIGINT set `requested`; installed only in the main thread of a process."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested == name:  # asked twice: stop now, the default way
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.requested = name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, comm) -> bool:
        """True on every rank when any rank was signalled (one world all-reduce of the flag)."""
        flag = comm.all_reduce_scalars([1.0 if self.requested else 0.0], "world", op="max")
        return flag[0] > 0


def check_finite_params(params, comm) -> bool:
    """True when every parameter on every rank is finite (checked before saving)."""
    bad = sum(0 if torch.isfinite(p.detach()).all() else 1 for p in params)
    return comm.all_reduce_scalars([float(bad)], "world", op="max")[0] == 0


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def parse_fail_at(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--fail-at {text!r}: write RANK:STEP, e.g. 1:2") from None
    return rank, step


def peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return any(marker in text for marker in PEER_LOST)


def exit_code_for(rank: int, world: int, exc: BaseException, err=None) -> int:
    """Report `exc` as this rank's failure (or stay quiet when a peer's death caused it) and
    return the process exit code."""
    from commpipe.errors import report

    say = report if err is None else (lambda text: print(text, file=err, flush=True))
    err = err or sys.stderr
    if isinstance(exc, TrainingDiverged):
        if rank == 0:
            say(f"commpipe train: error: {exc}")
        return 3
    if getattr(exc, "relaunch", False):   # --adapt-relaunch: the job is to be run again
        if rank == 0:
            print(f"commpipe: {exc}", file=err, flush=True)
        return 75
    if isinstance(exc, KeyboardInterrupt):
        print(f"commpipe: rank {rank} interrupted", file=err, flush=True)
        return 130
    if world > 1 and peer_lost(exc):
        # leave after the failed rank: torchrun (polling every 0.1 s) then records that rank
        # alone as the first failure and names it as the root cause in its summary
        time.sleep(PEER_LOST_EXIT_DELAY_S)
        return 1
    if isinstance(exc, (ValueError, FileNotFoundError)):   # commpipe's own message says it all
        say(f"commpipe: rank {rank} failed: {exc}")
        return 2
    traceback.print_exception(exc, file=err)
    hint = " (a peer stopped answering within --timeout-s)" if "Timed out" in str(exc) else ""
    say(f"commpipe: rank {rank} failed: {type(exc).__name__}: {exc}{hint}")
    return 1


def run_rank(fn, rank: int, world: int) -> int:
    """Run `fn()` (the whole training job of this rank); 0 on success. In a multi-process job a
    failure leaves the process at once (os._exit): waiting in interpreter shutdown for a process
    group whose peers are gone would hold the whole job up."""
    try:
        fn()
        return 0
    except (ValueError, FileNotFoundError) as exc:
        if world == 1:
            raise  # one process: the CLI prints the clean one-line message
        code = exit_code_for(rank, world, exc)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the job loudly
        code = exit_code_for(rank, world, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    if world > 1 and code != 3:
        os._exit(code)
    return code


def last_good(ckpt_root: Path | None) -> str:
    """Where a diverged run can go back to."""
    from commpipe.train import checkpoint

    last = checkpoint.latest_in(ckpt_root) if ckpt_root is not None and ckpt_root.is_dir() else None
    if last is None:
        return "There is no checkpoint to go back to."
    return f"The last good checkpoint is {last}; resume from it with a lower --lr or more --warmup."


def diverged_message(rec: dict, ckpt_root: Path | None) -> str:
    return (f"loss is {rec['loss']} (gradient norm {rec['grad_norm']}) at step {rec['step']}; "
            f"training stopped without applying that step. " + last_good(ckpt_root))
