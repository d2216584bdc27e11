"""The step-time figure of an elastic run marks the loss, the recovery and the regrowth.

    python -m pytest tests/test_elastic_marks.py -q

The run folder is written the way a training run writes it (commpipe.train.run_files.
open_metrics at each start, one record per step): 4 ranks for steps 0-7, lost during step 8 and
resumed from the checkpoint of step 4 on 2 ranks, steps 4-11; then a node returns, the job stops
at its step boundary with a checkpoint at 12 and resumes there on 4 ranks.
"""

from __future__ import annotations

import json

from commpipe.report.adaptive import step_time_figure
from commpipe.report.elastic import elastic_marks
from commpipe.train.run_files import open_metrics


def write_steps(path, steps, pp, dp):
    with open_metrics(path, steps[0], restart=True) as f:
        for s in steps:
            f.write(json.dumps({"step": s, "tp": 1, "cp": 1, "pp": pp, "dp": dp,
                                "layout": f"pp{pp}-dp{dp}", "step_time_s": 0.1}) + "\n")


def test_marks_sit_at_the_loss_the_recovery_and_the_regrowth(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, range(0, 8), pp=2, dp=2)
    write_steps(path, range(4, 12), pp=2, dp=2)      # restarted on the same 4 ranks (a hang)
    marks = elastic_marks(tmp_path)
    assert marks == [(8, "lost", "lost at step 8, steps 4-7 run again"),
                     (4, "resumed", "resumed on 4 ranks (pp2-dp2)")]


def test_shrink_then_regrow(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, range(0, 8), pp=2, dp=2)       # 4 ranks
    write_steps(path, range(4, 12), pp=1, dp=2)      # lost in step 8: 2 ranks from step 4
    write_steps(path, range(12, 16), pp=2, dp=2)     # a node joined: 4 ranks from step 12
    restarts = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["replaced"], r["world_before"]) for r in restarts] == \
        [(4, [4, 7], 4), (12, None, 2)]
    kinds = [(s, k) for s, k, _ in elastic_marks(tmp_path)]
    assert kinds == [(8, "lost"), (4, "resumed"), (12, "stopped"), (12, "regrown")]
    made = step_time_figure(tmp_path, tmp_path / "fig.png")
    assert made is not None and made[0].stat().st_size > 0 and "resumed" in made[1]


def test_a_run_that_never_restarted_has_no_marks(tmp_path):
    write_steps(tmp_path / "metrics.jsonl", range(0, 5), pp=2, dp=2)
    assert elastic_marks(tmp_path) == []
    assert step_time_figure(tmp_path, tmp_path / "fig.png") is None
