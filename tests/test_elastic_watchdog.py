"""The hang watchdog's timing, in one process: two ranks' watchdogs on one store.

    python -m pytest tests/test_elastic_watchdog.py -q

Rank 1 published one record and went silent (as a SIGSTOPped rank does); rank 0's watchdog
must fire once no step finished for the timeout, and when rank 0 is inside a checkpoint save
only after the longer allowance between steps (BETWEEN_STEPS_FACTOR timeouts) - not never, as
when saves were not timed at all (a rank frozen during one was left to the process group's
timeout). The whole path on real jobs: tests/test_elastic_hang.py.
"""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore

from commpipe.elastic.watchdog import BETWEEN_STEPS_FACTOR, HANG_EXIT_CODE, Watchdog

TIMEOUT_S, TICK_S = 0.3, 0.03


def two_ranks():
    store = HashStore()
    exits: list[tuple[float, int]] = []
    err = io.StringIO()
    dogs = [Watchdog(SimpleNamespace(rank=r, waiting=None, last_call=None), 2, TIMEOUT_S, store,
                     tick_s=TICK_S, err=err, exit_fn=lambda code: exits.append((time.monotonic(), code)))
            for r in range(2)]
    dogs[1]._pid = -1          # never a real process: ending the "frozen" worker is a no-op
    dogs[1]._publish()          # rank 1 reported once, then froze (its thread never runs)
    return dogs[0], err, exits


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


def test_a_rank_silent_during_a_save_is_reported_after_the_longer_allowance():
    dog, err, exits = two_ranks()
    dog.progress(3)
    dog.start()
    try:
        with dog.between_steps("checkpoint save"):
            t0 = time.monotonic()
            allowance = TIMEOUT_S * BETWEEN_STEPS_FACTOR
            assert wait_exit(exits, allowance * 0.8) is None, err.getvalue()   # not at 1 timeout
            fired = wait_exit(exits, 30)
    finally:
        dog.stop()
    assert fired is not None, "a hang during a checkpoint save was never reported"
    assert fired[0] - t0 >= allowance
    text = err.getvalue()
    assert text.startswith("commpipe: hang: the checkpoint save after 3 steps did not finish"), text
    assert f"--hang-timeout-s {TIMEOUT_S:g} x {BETWEEN_STEPS_FACTOR} between steps" in text


@pytest.mark.parametrize("where", ["step", "save"])
def test_progress_keeps_it_quiet(where):
    dog, err, exits = two_ranks()
    dog.start()
    try:
        end = time.monotonic() + 3 * TIMEOUT_S * (BETWEEN_STEPS_FACTOR if where == "save" else 1)
        step = 0
        while time.monotonic() < end:
            if where == "save":
                with dog.between_steps("checkpoint save"):
                    time.sleep(TIMEOUT_S * 2)       # longer than a step may take, within the allowance
            else:
                time.sleep(TIMEOUT_S / 3)
            step += 1
            dog.progress(step)
    finally:
        dog.stop()
    assert not exits, err.getvalue()
