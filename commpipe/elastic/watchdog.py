"""The hang watchdog: a thread on every rank that names the rank a stuck step waits on.

Every tick (a tenth of the timeout, at most 2 s) the thread publishes this rank's record: its
step, a tick counter, and its last communication call as `Comm` holds it (`waiting`, else
`last_call`; commpipe.parallel.comm) into a key-value store outside the training process
group, which may be the thing that is stuck: the job's rendezvous store (torchrun's agent
serves it at MASTER_ADDR:MASTER_PORT), reached through a client connection of its own and keys
under this attempt's prefix (commpipe.elastic.restart), so a restarted job never reads the
records of the attempt before it.

When the step has not advanced for `timeout_s`, the thread reads every rank's record twice, two
ticks apart: a rank whose tick did not move is stopped or frozen (SIGSTOP, a lost node).
commpipe.elastic.hang names the rank the others wait on. The first rank to confirm the hang
claims the report in the store: it prints it, writes it into torchrun's failure summary and the
store, and ends the frozen workers of its host (SIGKILL, after checking that the pid is still
that worker); every other rank follows that verdict at its next tick, whatever it was doing (a
rank inside a save would otherwise wait out its longer allowance), ends the frozen workers of
its own host and leaves after the reporter. Every rank leaves with HANG_EXIT_CODE: the job is
lost as after a crash, and an elastic torchrun restarts it (see commpipe.elastic.restart).

Work between steps that may rightly take longer than a step (evaluation, a checkpoint save, a
layout switch) runs inside `between_steps(what)`: it is timed too, against BETWEEN_STEPS_FACTOR
times the timeout from its start, so a rank lost in the middle of a save still ends the job.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

from commpipe.elastic.hang import diagnose

HANG_EXIT_CODE = 4
STORE_TIMEOUT_S = 10.0
QUIET_EXIT_DELAY_S = 2.0   # the reporting rank leaves first: torchrun names it the root cause
BETWEEN_STEPS_FACTOR = 10  # saves, evaluation, layout switches: allowed this many timeouts
CLAIM_KEY, VERDICT_KEY = "reporter", "verdict"
FIRST_STEP = "first step"


def store_prefix(world: int) -> str:
    """Keys of this attempt: torchrun keeps one store across restarts and membership changes
    (commpipe.parallel.attempt.attempt_prefix)."""
    from commpipe.parallel.attempt import current_prefix

    return f"{current_prefix()}watchdog/{world}/"


def open_store(world: int, timeout_s: float = STORE_TIMEOUT_S):
    """A client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT), keys of this attempt."""
    from torch.distributed import PrefixStore, TCPStore

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = TCPStore(addr, int(port), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(store_prefix(world), store)


def call_record(comm, now: float | None = None) -> dict | None:
    """This rank's last communication call, as the watchdog publishes it."""
    call = comm.waiting
    state = "waiting"
    if call is None:
        call = comm.last_call
        if call is None:
            return None
        state = "completed" if call.t_done else "posted"
    now = time.perf_counter() if now is None else now
    return {"dim": call.dim, "op": call.op, "peer": call.peer, "group": list(call.group),
            "seq": call.seq, "tag": call.tag, "state": state, "age_s": round(now - call.t_post, 3)}


class Watchdog:
    """Start with `start()`; the loop calls `progress(step)` after every step."""

    def __init__(self, comm, world: int, timeout_s: float, store, tick_s: float | None = None,
                 err=None, exit_fn=os._exit):
        self.comm, self.rank, self.world = comm, comm.rank, world
        self.timeout_s = timeout_s
        self.tick_s = tick_s or min(max(timeout_s / 10, 0.05), 2.0)
        self.store = store
        self.err = err or sys.stderr
        self.exit_fn = exit_fn
        self.step = 0
        self.tick = 0
        self.fired: tuple[str, list[str]] | None = None
        self._t_progress = time.monotonic()
        # the work between steps under way, if any; the first step of a process also sets up
        # connections and buffers (a slow, loaded host takes seconds): the same allowance
        self._phase: str | None = FIRST_STEP
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commpipe-hang-watchdog",
                                        daemon=True)
        self._host, self._pid = socket.gethostname(), os.getpid()

    # -- the training thread's side ---------------------------------------------------------------
    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        self.step = step
        if self._phase == FIRST_STEP:
            self._phase = None
        self._t_progress = time.monotonic()

    @contextmanager
    def between_steps(self, what: str):
        """Evaluation, a checkpoint save, a layout switch: timed from their start against
        BETWEEN_STEPS_FACTOR times the timeout (nested calls keep the outer one)."""
        if self._phase is not None:
            yield
            return
        self._phase, self._t_progress = what, time.monotonic()
        try:
            yield
        finally:
            self._phase, self._t_progress = None, time.monotonic()

    def limit_s(self) -> float:
        """How long the current step, or work between steps, may go without progress."""
        return self.timeout_s * (BETWEEN_STEPS_FACTOR if self._phase is not None else 1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.tick_s + STORE_TIMEOUT_S)

    # -- the watchdog thread ----------------------------------------------------------------------
    def record(self) -> dict:
        return {"rank": self.rank, "step": self.step, "tick": self.tick, "host": self._host,
                "pid": self._pid, "time": time.time(), "call": call_record(self.comm)}

    def _publish(self) -> None:
        self.tick += 1
        self.store.set(f"rank{self.rank}", json.dumps(self.record()))

    def _read_all(self) -> dict[int, dict | None]:
        out = {}
        for r in range(self.world):
            key = f"rank{r}"
            out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.tick_s):
                self._publish()
                verdict = self._verdict()
                if verdict is not None:       # another rank found the hang and reported it
                    self._follow(verdict)
                    return
                if time.monotonic() - self._t_progress < self.limit_s():
                    continue
                found = self._examine()
                if found is None:
                    continue
                if self.store.add(CLAIM_KEY, 1) == 1:   # the first rank to confirm it reports
                    self._report(*found)
                else:
                    self._follow(self._wait_verdict() or {"headline": found[0], "host": None,
                                                           "frozen": found[2]})
                return
        except Exception as exc:  # noqa: BLE001 - the store gone means the job is gone
            if not self._stop.is_set():
                print(f"commpipe: rank {self.rank}: hang watchdog stopped: "
                      f"{type(exc).__name__}: {exc}", file=self.err, flush=True)

    def _examine(self):
        """(headline, lines, {frozen rank: its record}) once a hang is confirmed; None if
        this rank made progress meanwhile."""
        since = self._t_progress
        first = self._read_all()
        t0 = time.monotonic()
        for _ in range(2):                 # two ticks: a live rank's tick moves meanwhile
            if self._stop.wait(self.tick_s):
                return None
            self._publish()
        if self._t_progress != since:   # a step finished, or work between steps began or ended
            return None
        second = self._read_all()
        waited = time.monotonic() - t0
        stale = {r for r in range(self.world)
                 if second[r] is None or (first[r] is not None
                                          and first[r]["tick"] == second[r]["tick"])}
        # silent since its last record (clocks of other hosts may differ: at least the wait here)
        now = time.time()
        silent = {r: max(waited, now - second[r]["time"]) if second[r] else waited for r in stale}
        headline, lines = diagnose(second, stale, self.world, silent)
        frozen = {r: second[r] for r in stale if second[r] is not None}
        return headline, lines, frozen

    def _verdict(self) -> dict | None:
        if not self.store.check([VERDICT_KEY]):
            return None
        return json.loads(self.store.get(VERDICT_KEY))

    def _wait_verdict(self) -> dict | None:
        """The reporter's verdict: it claimed the report a moment ago and is printing it."""
        end = time.monotonic() + STORE_TIMEOUT_S
        while time.monotonic() < end:
            verdict = self._verdict()
            if verdict is not None:
                return verdict
            time.sleep(self.tick_s)
        return None

    def _report(self, headline: str, lines: list[str], frozen: dict) -> None:
        """This rank confirmed the hang first: print it, put it into torchrun's failure summary
        and the store (the other ranks follow it), end the frozen workers of this host, leave."""
        self.fired = (headline, lines)
        stuck = time.monotonic() - self._t_progress
        where = "no step finished" if self._phase is None else \
            f"the {self._phase} did not finish" if self._phase == FIRST_STEP else \
            f"the {self._phase} after {self.step} steps did not finish"
        allowed = "" if self._phase is None else f" x {BETWEEN_STEPS_FACTOR} between steps"
        text = (f"commpipe: hang: {where} for {stuck:.0f} s (--hang-timeout-s "
                f"{self.timeout_s:g}{allowed}): {headline}")
        print("\n".join([text, *("  " + x for x in lines)]), file=self.err, flush=True)
        from commpipe.errors import report

        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            report(text)
        self.store.set(VERDICT_KEY, json.dumps({"headline": headline, "rank": self.rank,
                                                "host": self._host, "frozen": frozen}))
        self._end_frozen(frozen)
        self._leave()

    def _follow(self, verdict: dict) -> None:
        """Another rank reported the hang: end the frozen workers of this host (when the
        reporter runs on another one), then leave after it, so torchrun names its report."""
        self.fired = (verdict["headline"], [])
        # a frozen rank cannot leave by itself, and torchrun would SIGKILL it only after its
        # 30 s shutdown wait: the ranks of each host end those of theirs, so a restart follows
        if verdict.get("host") != self._host:
            self._end_frozen({int(r): rec for r, rec in verdict["frozen"].items()})
        time.sleep(QUIET_EXIT_DELAY_S)
        self._leave()

    def _end_frozen(self, frozen: dict) -> None:
        for r, rec in frozen.items():
            if rec.get("host") == self._host:
                end_frozen_worker(r, rec.get("pid"))

    def _leave(self) -> None:
        if self.exit_fn is not None:
            self.err.flush()
            sys.stdout.flush()
            self.exit_fn(HANG_EXIT_CODE)


def end_frozen_worker(rank: int, pid) -> bool:
    """SIGKILL the frozen worker `pid` of this host when it is this job's worker of `rank`
    (its environment says so: a recycled pid is left alone)."""
    import signal

    try:
        env = open(f"/proc/{int(pid)}/environ", "rb").read().split(b"\0")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if f"RANK={rank}".encode() not in env or \
                f"TORCHELASTIC_RUN_ID={run_id}".encode() not in env:
            return False
        os.kill(int(pid), signal.SIGKILL)
        return True
    except (OSError, TypeError, ValueError):
        return False


def start_watchdog(comm, timeout_s: float):
    """A started Watchdog for this rank, or None (one process, the timeout 0, no store)."""
    world = comm.dims.world_size
    if timeout_s <= 0 or world == 1 or not comm.initialized:
        return None
    try:
        store = open_store(world)
    except (RuntimeError, OSError, ValueError) as exc:   # training goes on, unwatched
        if comm.rank == 0:
            print(f"commpipe: hang watchdog off: the rendezvous store at "
                  f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} cannot be "
                  f"reached ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None
    if store is None:
        return None
    return Watchdog(comm, world, timeout_s, store).start()
