"""Per-step monitor records from sampled calls (commpipe.monitor.records), single-process
against hand-derived values: which sampled calls a record's bandwidth is computed from.

    python -m pytest tests/test_monitor_records.py -q
"""

from __future__ import annotations

import pytest

from commpipe.monitor.records import build_records


@pytest.mark.parametrize("op", ["recv", "all_gather"])
def test_bandwidth_counts_only_matched_samples(op):
    # two sampled calls on one stream: 1e6 B matched (peers posted at 1.0 with it, done at 1.1:
    # transfer 100 ms) and 3e6 B whose counterpart's post time never arrived (2.0 to 2.5).
    # Bandwidth and transfer come from the matched call alone: 1e6 B / 0.1 s = 0.01 GB/s (an
    # all-gather's S is the n=2 output, 2e6 B: 0.02); the raw figures take both calls:
    # (100 + 500) / 2 = 300 ms, 4e6 B / 0.6 s (8e6 B for the all-gather)
    key = ("pp", "recv", 0, ()) if op == "recv" else ("tp", "all_gather", None, (0, 1))
    posts = {0: 1.0 if op == "recv" else [1.0, 1.0], 1: None}
    rec, = build_records(1, 0, [(key, 2, 4_000_000)],
                         [(key, 0, 1.0, 1.1, 1_000_000), (key, 1, 2.0, 2.5, 3_000_000)],
                         lambda k, mid: posts[mid], {}, 0.3)
    s = 2 if op == "all_gather" else 1
    assert (rec["calls"], rec["sampled"], rec["matched"]) == (2, 2, 1)
    assert rec["transfer_ms"] == pytest.approx(100) and rec["wait_ms"] == pytest.approx(0)
    assert rec["bandwidth_gbps"] == pytest.approx(0.01 * s)
    assert rec["raw_ms"] == pytest.approx(300)
    assert rec["raw_bandwidth_gbps"] == pytest.approx(4e6 * s / 0.6 / 1e9)
    assert rec["ema_bandwidth_gbps"] == pytest.approx(0.01 * s)
