"""The hang watchdog's timing, in one process: two ranks' watchdogs on one store.

    python -m pytest tests/test_elastic_watchdog.py -q

Rank 1 published one record and went silent (as a SIGSTOPped rank does); rank 0's watchdog
must fire once no step finished for the timeout, and when rank 0 is inside a checkpoint save
only after the longer allowance between steps (BETWEEN_STEPS_FACTOR timeouts) - not never, as
when saves were not timed at all (a rank frozen during one was left to the process group's
timeout). The whole path on real jobs: tests/test_elastic_hang.py.
"""

from __future__ import annotations

import contextlib
import io
import time
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore

from commpipe.elastic import watchdog
from commpipe.elastic.watchdog import BETWEEN_STEPS_FACTOR, HANG_EXIT_CODE, Watchdog

TIMEOUT_S, TICK_S = 0.3, 0.03


def ranks(world=2, frozen=1, timeout_s=TIMEOUT_S):
    """Watchdogs of `world` ranks on one store, rank `frozen` silent after one record; the
    others' exits as (time, code) lists, their output in one StringIO."""
    store = HashStore()
    err = io.StringIO()
    exits: dict[int, list] = {r: [] for r in range(world)}
    dogs = [Watchdog(SimpleNamespace(rank=r, waiting=None, last_call=None), world, timeout_s,
                     store, tick_s=TICK_S, err=err,
                     exit_fn=lambda code, r=r: exits[r].append((time.monotonic(), code)))
            for r in range(world)]
    dogs[frozen]._pid = -1      # never a real process: ending the "frozen" worker is a no-op
    dogs[frozen]._publish()     # it reported once, then froze (its thread never runs)
    return dogs, err, exits


def two_ranks(timeout_s=TIMEOUT_S):
    dogs, err, exits = ranks(timeout_s=timeout_s)
    return dogs[0], err, exits[0]


def wait_exit(exits, within_s):
    end = time.monotonic() + within_s
    while not exits and time.monotonic() < end:
        time.sleep(0.01)
    return exits[0] if exits else None


def test_a_rank_silent_mid_step_is_reported_after_the_timeout():
    dog, err, exits = two_ranks()
    dog.progress(5)
    t0 = time.monotonic()
    dog.start()
    try:
        fired = wait_exit(exits, 30)
    finally:
        dog.stop()
    assert fired is not None, err.getvalue()
    assert fired[1] == HANG_EXIT_CODE
    assert fired[0] - t0 >= TIMEOUT_S
    text = err.getvalue()
    assert text.startswith("commpipe: hang: no step finished for"), text
    assert "rank 1 stopped answering" in text


@pytest.mark.parametrize("phase", ["checkpoint save", "first step"])
def test_a_rank_silent_during_a_save_is_reported_after_the_longer_allowance(phase):
    # a save after 3 steps, or the first step of the process (connections, warm-up)
    dog, err, exits = two_ranks()
    saving = phase == "checkpoint save"
    if saving:
        dog.progress(3)
    dog.start()
    try:
        with dog.between_steps(phase) if saving else contextlib.nullcontext():
            t0 = time.monotonic()
            allowance = TIMEOUT_S * BETWEEN_STEPS_FACTOR
            assert wait_exit(exits, allowance * 0.8) is None, err.getvalue()   # not at 1 timeout
            fired = wait_exit(exits, 30)
    finally:
        dog.stop()
    assert fired is not None, f"a hang during the {phase} was never reported"
    assert fired[0] - t0 >= allowance * 0.95
    text = err.getvalue()
    head = "the checkpoint save after 3 steps" if saving else "the first step"
    assert text.startswith(f"commpipe: hang: {head} did not finish"), text
    assert f"--hang-timeout-s {TIMEOUT_S:g} x {BETWEEN_STEPS_FACTOR} between steps" in text


@pytest.mark.parametrize("where", ["step", "save"])
def test_progress_keeps_it_quiet(where):
    # steps well inside a 1 s timeout; saves twice a 0.3 s timeout, well inside 10 of them
    timeout_s = 1.0 if where == "step" else TIMEOUT_S
    dog, err, exits = two_ranks(timeout_s)
    dog.start()
    try:
        end = time.monotonic() + 3 * (timeout_s if where == "step" else 2 * timeout_s * 3)
        step = 0
        while time.monotonic() < end:
            if where == "save":
                with dog.between_steps("checkpoint save"):
                    time.sleep(timeout_s * 2)       # longer than a step may take
            else:
                time.sleep(0.05)
            step += 1
            dog.progress(step)
    finally:
        dog.stop()
    assert not exits, err.getvalue()


def test_a_rank_inside_a_save_follows_the_rank_that_reported(monkeypatch):
    # rank 0 saves (its own allowance: 10 timeouts), rank 1 froze, rank 2 is mid-step: rank 2
    # reports after one timeout and rank 0 leaves on its verdict, long before its own allowance
    monkeypatch.setattr(watchdog, "QUIET_EXIT_DELAY_S", 0.1)
    dogs, err, exits = ranks(world=3, frozen=1)
    for d in (dogs[0], dogs[2]):
        d.progress(7)
    with dogs[0].between_steps("checkpoint save"):
        t0 = time.monotonic()
        dogs[0].start()
        dogs[2].start()
        try:
            fired = [wait_exit(exits[r], 30) for r in (0, 2)]
        finally:
            for d in (dogs[0], dogs[2]):
                d.stop()
    assert None not in fired, err.getvalue()
    text = err.getvalue()
    assert text.count("commpipe: hang:") == 1, text            # one report, by rank 2
    assert text.startswith("commpipe: hang: no step finished"), text
    assert dogs[0].fired is not None and dogs[0].fired[0] == dogs[2].fired[0]
    assert fired[0][0] > fired[1][0]                              # the reporter leaves first
    assert fired[0][0] - t0 < TIMEOUT_S * BETWEEN_STEPS_FACTOR, "rank 0 waited out its save"
