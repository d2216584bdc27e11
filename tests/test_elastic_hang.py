"""The hang watchdog names the rank a stuck step waits on.

    python -m pytest tests/test_elastic_hang.py -x -q

The diagnosis is checked on hand-written records (who waits on whom is known by construction);
the whole path on a real job: `torchrun --nproc-per-node 3 -m commpipe train --pp 3` with one
worker stopped by SIGSTOP, and a healthy run with a short timeout that must not fire.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from commpipe.elastic.hang import diagnose, ranks_text
from tests.test_failures import metric_lines, worker_pid

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seq-len", "16", "--global-batch", "4"]


def rec(rank, call=None, step=41):
    return {"rank": rank, "step": step, "tick": 7, "host": "h", "pid": 100 + rank, "call": call}


def p2p(op, peer, seq, state="waiting"):
    return {"dim": "pp", "op": op, "peer": peer, "group": [], "seq": seq, "tag": 0,
            "state": state, "age_s": 50.0}


def coll(dim, op, group, seq, state="waiting"):
    return {"dim": dim, "op": op, "peer": None, "group": group, "seq": seq, "tag": 0,
            "state": state, "age_s": 50.0}


def test_ranks_text():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1]) == "ranks 0-2"
    assert ranks_text([0, 2, 5, 6, 7]) == "ranks 0, 2, 5-7"


def test_pipeline_chain_names_the_stopped_last_stage():
    # 0 -> 1 -> 2 -> 3 pipeline: rank 3 froze after its last completed call; rank 2's send of
    # seq 812 has no matching recv; ranks 0 and 1 wait behind it
    records = {0: rec(0, p2p("recv", 1, 300)), 1: rec(1, p2p("recv", 2, 500)),
               2: rec(2, p2p("send", 3, 812)), 3: rec(3, p2p("send", 2, 811, "completed"))}
    head, lines = diagnose(records, stale={3}, world=4, silent_s={3: 45.0})
    assert head == ("rank 3 has not posted pp recv from rank 2 (step 41, seq 812); "
                    "ranks 0-2 wait on it")
    assert "silent for 45 s: stopped or frozen" in lines[3]
    assert lines[2].startswith("rank 2 (step 41, host h, pid 102): waiting pp send to rank 3")


def test_collective_laggard_is_the_rank_not_in_the_call():
    # dp all-reduce over 0-3: ranks 0, 1, 3 are in call seq 9; rank 2 is alive, outside any call
    group = [0, 1, 2, 3]
    records = {r: rec(r, coll("dp", "all_reduce", group, 9)) for r in (0, 1, 3)}
    records[2] = rec(2, coll("dp", "all_reduce", group, 8, "completed"))
    head, _ = diagnose(records, stale=set(), world=4)
    assert head == ("rank 2 has not posted dp all_reduce over ranks 0-3 (step 41, seq 9); "
                    "ranks 0-1, 3 wait on it")


def test_collectives_that_cannot_pair_are_a_deadlock():
    # both ranks blocked in the same group's all-gather, one call apart: no rank is free
    records = {0: rec(0, coll("tp", "all_gather", [0, 1], 9)),
               1: rec(1, coll("tp", "all_gather", [0, 1], 10))}
    head, _ = diagnose(records, stale=set(), world=2)
    assert "wait on each other" in head         # both blocked, in calls that cannot pair


def test_stale_rank_with_no_waiters_and_compute_hang():
    records = {0: rec(0, p2p("recv", 1, 3, "completed")), 1: rec(1, None)}
    head, _ = diagnose(records, stale={1}, world=2)
    assert head.startswith("rank 1 stopped answering")
    head, _ = diagnose(records, stale=set(), world=2)
    assert head.startswith("no rank is blocked in a communication call")


def test_missing_record_counts_as_silent():
    records = {0: rec(0, p2p("recv", 1, 0)), 1: None}
    head, lines = diagnose(records, stale={1}, world=2)
    assert head == "rank 1 has not posted pp send to rank 0 (step 41, seq 0); rank 0 waits on it"
    assert "never reported" in lines[1]


# -- a real job ------------------------------------------------------------------------------------
HANG_S = 8.0


class Job:
    """`torchrun --nproc-per-node N -m commpipe train --pp N`, its stderr read line by line."""

    def __init__(self, out: Path, nproc: int, *flags: str, torchrun: tuple = ()):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), *torchrun, "-m", "--", "commpipe", "train", "--pp", str(nproc), *TINY,
               "--out", str(out), *flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.stdout = ""
        self.stdout_lines: list[str] = []
        # both pipes drained all along: a full pipe would block the workers' prints
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_stdout, daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)

    def wait_line(self, text: str, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if text in line:
                return line
        return None

    def wait_for_step(self, out: Path, step: int, timeout: float = 120, after_save: int = 0) -> None:
        """Until step `step` is done; with `after_save` (the --save-every), until the last step
        done is one of the first three after a save: a rank stopped then freezes mid-step, not
        in a save (which the watchdog allows ten timeouts)."""
        def reached(recs):
            if not after_save:
                return any(r["step"] >= step for r in recs)
            return bool(recs) and recs[-1]["step"] >= step and recs[-1]["step"] % after_save < 3

        end = time.monotonic() + timeout
        while not reached(metric_lines(out)):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                time.sleep(0.5)
                raise AssertionError(f"training did not reach step {step}:\n"
                                     + "".join(self.stderr)[-3000:])
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"job still running after {timeout} s") from None
        for t in self._readers:
            t.join(timeout=10)
        self.stdout = "".join(self.stdout_lines)
        return self.proc.returncode


def test_sigstopped_rank_is_named_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    job = Job(out, 3, "--steps", "5000", "--hang-timeout-s", str(HANG_S))
    job.wait_for_step(out, 2)
    pid = worker_pid(job.proc.pid, 2)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        line = job.wait_line("commpipe: hang:", HANG_S + 10)
        elapsed = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):   # ended by the watchdog, else by torchrun
            os.kill(pid, signal.SIGCONT)
    assert line, f"no hang message within {HANG_S + 10} s:\n{''.join(job.stderr)[-3000:]}"
    assert elapsed < HANG_S + 10
    # the last stage froze: rank 1 waits on it (a pp send or recv, or a collective with it),
    # rank 0 waits on rank 1 or in a collective with rank 2
    m = re.search(r"rank 2 has not posted (pp|world|dp_cp) (\w+) (from|to|with|over) "
                  r"(rank \d|ranks [\d, -]+) \(step (\d+), seq (\d+)\); ranks 0-1 wait on it",
                  line)
    assert m, line
    assert int(m.group(5)) >= 2
    code = job.finish(150)
    assert code != 0
    stopped_at = max(r["step"] for r in metric_lines(out))
    assert stopped_at < 4999


@pytest.mark.filterwarnings("ignore")
def test_watchdog_stays_quiet_on_a_healthy_run(tmp_path):
    out = tmp_path / "run"
    # a short timeout, with checkpoint saves (paused) between steps
    job = Job(out, 2, "--steps", "12", "--hang-timeout-s", "3", "--save-every", "4")
    code = job.finish(300)
    stderr = "".join(job.stderr)
    assert code == 0, stderr[-3000:]
    assert "hang" not in stderr and "hang" not in job.stdout
    assert [r["step"] for r in metric_lines(out)] == list(range(12))


def test_hung_rank_is_lost_and_an_elastic_job_restarts_and_finishes(tmp_path):
    out = tmp_path / "run"
    steps = 16
    job = Job(out, 3, "--steps", str(steps), "--hang-timeout-s", str(HANG_S), "--save-every", "6",
              "--elastic", torchrun=("--max-restarts", "1"))
    job.wait_for_step(out, 4, after_save=6)
    pid = worker_pid(job.proc.pid, 2)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    assert job.wait_line("commpipe: hang:", HANG_S + 10), "".join(job.stderr)[-3000:]
    # the frozen worker was ended by its host's ranks: torchrun restarts without its 30 s wait
    end = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] \
            != "Z" and time.monotonic() < end:
        time.sleep(0.1)
    assert time.monotonic() < end, "the stopped worker is still there"
    code = job.finish(300)
    log = "".join(job.stderr) + job.stdout
    assert code == 0, log[-4000:]
    assert time.monotonic() - t0 < 200
    resumed = [x for x in log.splitlines() if "resumed from" in x]
    assert len(resumed) == 1 and "commpipe: elastic:" not in log   # same world: same layout
    assert [r["step"] for r in metric_lines(out)] == list(range(steps))
