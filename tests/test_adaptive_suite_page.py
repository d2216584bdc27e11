"""The adaptive suite's page (benchmarks/_suite_figure.py): the outcome figure and one step-time
figure per adaptive run, from synthetic results and runs; no training.

    python -m pytest tests/test_adaptive_suite_page.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(folder: Path, switch_at: int | None) -> None:
    _jsonl(folder / "metrics.jsonl",
           [{"step": s, "loss": 5.0, "step_time_s": 0.1 if switch_at is None or s < 12 else 0.3,
             "layout": "dp2"} for s in range(20)])
    start = {"tp": 1, "cp": 1, "pp": 1, "dp": 2, "stage_layers": [4], "name": "dp2"}
    pp2 = {"tp": 1, "cp": 1, "pp": 2, "dp": 1, "stage_layers": [2, 2], "name": "pp2"}
    _jsonl(folder / "adapt.jsonl", [] if switch_at is None else
           [{"step": switch_at, "action": "switch", "from": start, "to": pp2, "switch_time_s": 0.1},
            {"step": switch_at + 8, "action": "stay", "from": pp2, "recheck": True}])


def test_the_suite_page_shows_the_table_the_outcome_and_every_adaptive_run(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from _adaptive_metrics import table
        from _suite_figure import adaptive_runs, write_suite_page
    finally:
        sys.path.remove(str(BENCH))
    for i in (1, 2):
        _run(tmp_path / "healthy" / f"adaptive-{i}", None)
    _run(tmp_path / "link-2x" / "adaptive", 16)
    _run(tmp_path / "link-2x" / "static", None)          # not an adaptive run: not drawn
    results = [
        {"scenario": "healthy", "what": "dp2", "false_switches": 0, "switches": 0, "repeat": 1,
         "final_layout": "dp2", "max_loss_diff": 0.0, "overhead": 0.01},
        {"scenario": "healthy", "what": "dp2", "false_switches": 1, "switches": 1, "repeat": 2,
         "final_layout": "pp2", "max_loss_diff": 0.0, "overhead": -0.1},
        {"scenario": "link-2x", "what": "dp2, slow link", "false_switches": 0, "switches": 1,
         "final_layout": "pp2", "max_loss_diff": 1e-6, "fault_steps": [12, 20], "severity": 2.0,
         "t_static_ms": 300.0, "t_adaptive_ms": 150.0, "t_best_ms": 100.0, "recovered": 0.75,
         "recovered_settled": 0.9, "detect_steps": 4, "detect_s": 1.0}]
    assert [p.relative_to(tmp_path).as_posix() for p in adaptive_runs(tmp_path)] == \
        ["healthy/adaptive-1", "healthy/adaptive-2", "link-2x/adaptive"]
    page = write_suite_page(results, table(results), tmp_path)
    text = page.read_text()
    assert table(results) in text and "![outcome](suite.png)" in text
    assert (tmp_path / "suite.png").stat().st_size > 0
    # each adaptive run drawn once under its own heading, with the figure's caption
    for name in ("healthy-adaptive-1", "healthy-adaptive-2", "link-2x-adaptive"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0 and f"]({name}.png)" in text
    assert "link-2x-static.png" not in text
    assert "re-checks of a plan on its own baselines (1)" in text
    # a run with nothing to act on keeps the adaptive caption (no switch), not a restart's
    assert text.count("green: switches (0)") == 2 and "where the job stopped" not in text
