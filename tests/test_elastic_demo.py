"""`commpipe demo --elastic`: a node lost, a rank frozen, the node back.

    python -m pytest tests/test_elastic_demo.py -q

The drill's flags are checked before anything starts; one run on local processes (the same
story the emulated cluster runs as root) loses node 1, has the watchdog name the frozen rank,
grows back to 4 ranks, and its report marks each at the steps the run records.
"""

from __future__ import annotations

import pytest

from commpipe.cli import main
from commpipe.elastic_demo import parse_at, run_elastic_demo
from commpipe.report.elastic import world_of


@pytest.mark.parametrize("flags, said", [
    (["--kill-node", "1"], "--kill-node '1': write WHO@STEP, like 1@10"),
    (["--kill-node", "0@10"], "the demo's nodes are 0 (it hosts the rendezvous) and 1"),
    (["--stop-rank", "1@5"], "--stop-rank step 5 must come after the --kill-node step 10"),
    (["--kill-node", "1@3"], "--kill-node step 3 comes before the first checkpoint (step 8)"),
])
def test_bad_drill_flags_are_refused_before_anything_starts(tmp_path, capsys, flags, said):
    assert main(["demo", "--elastic", "--out", str(tmp_path / "d"), *flags]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_parse_at():
    assert parse_at("1@12", "--kill-node") == (1, 12)


@pytest.mark.slow
def test_the_demo_loses_a_node_names_a_hang_and_grows_back(tmp_path):
    s = run_elastic_demo(tmp_path / "d", kill=(1, 9), stop=(1, 14), hang_timeout_s=8,
                         cluster_kind="local", log=lambda *_: None)
    assert [e[0] for e in s["events"]] == ["node lost", "rank stopped", "node back"]
    assert [k for _, k, _ in s["marks"]] == ["lost", "resumed", "lost", "resumed", "stopped",
                                             "regrown"], s["marks"]
    assert s["hang"] and "rank 1 has not posted" in s["hang"][0], s["hang"]
    recs = s["records"]
    assert [r["step"] for r in recs] == list(range(len(recs)))   # every step once
    by_step = {r["step"]: world_of(r) for r in recs}
    resumed = [r["step"] for r in s["restarts"]]
    assert [by_step[x] for x in resumed] == [2, 2, 4]
    assert [m[0] for m in s["marks"] if m[1] in ("resumed", "regrown")] == resumed
    # the frozen rank was named at the step it was stopped in, and that step was run again
    lost_hang = s["marks"][2][0]
    assert f"(step {lost_hang}," in s["hang"][0]
    assert (tmp_path / "d" / "run" / "figures" / "adapt_run.png").exists()
