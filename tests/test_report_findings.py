"""The report's opening and its measured breakdowns, against values derived by hand from small
synthetic run folders: where a step's time goes, the findings written from the rows, and the
layout an adaptive report marks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from commpipe.report.breakdown import split_window, step_breakdown


def _ev(rank, stream, name, start, end, wait=None, step=1):
    return {"rank": rank, "stream": stream, "name": name, "start_ms": start, "end_ms": end, "step": step,
            "args": {} if wait is None else {"wait_ms": wait}}


def test_step_split_into_compute_exposed_comm_and_bubble():
    # rank 0 over [0, 20]: compute 0-4; a recv 4-12 whose first 5 ms wait for the peer
    # (bubble), then 3 ms transfer; an all-reduce 10-16 overlapping the recv's transfer by
    # 2 ms (the pipeline wins the overlap: 10-12 is PP) with 1 ms skew (10-11, hidden under
    # PP) -> DP 12-16 = 4 ms; compute 15-17 hides 15-16 of it -> DP 3 ms; idle 17-20 = 3 ms
    events = [_ev(0, "compute", "0F0", 0, 4), _ev(0, "pp.1", "recv", 4, 12, wait=5),
              _ev(0, "pp", "wait", 4, 9), _ev(0, "dp_cp", "all_reduce", 10, 16, wait=1),
              _ev(0, "compute", "0B0", 15, 17)]
    got = split_window(events, 0.0, 20.0)
    assert got == pytest.approx({"compute": 6.0, "pp": 3.0, "tp": 0.0, "cp": 0.0, "dp": 3.0, "ep": 0.0,
                                 "other": 0.0, "pp_wait": 5.0, "idle": 3.0})
    assert sum(got.values()) == pytest.approx(20.0)
    # expert parallelism: the all-to-all's stream is EP, the experts' gradient all-reduce DP
    moe = split_window([_ev(0, "ep", "all_to_all", 0, 2), _ev(0, "edp", "all_reduce", 2, 5)], 0.0, 5.0)
    assert (moe["ep"], moe["dp"], moe["other"]) == (2.0, 3.0, 0.0)
    # EP is the payload's time: the row counts before it (and on a second lane) are not
    moe = split_window([_ev(0, "ep", "all_to_all_counts", 0, 1), _ev(0, "ep", "all_to_all", 1, 3),
                        _ev(0, "ep.1", "all_to_all_counts", 3, 4)], 0.0, 4.0)
    assert (moe["ep"], moe["other"]) == (2.0, 2.0)
    # rank 0 alone: the window is its first event to its last, 0-17
    assert split_window(events, 0.0, 17.0)["idle"] == 0.0
    # a second rank computing 0-10 and 18-20: the common window is 0-20; rank 0 idles 17-20,
    # rank 1 10-18
    b = step_breakdown(events + [_ev(1, "compute", "1F0", 0, 10), _ev(1, "compute", "1B0", 18, 20)])
    assert b["window_ms"] == 20.0
    assert b["compute"] == pytest.approx((6 + 12) / 2) and b["idle"] == pytest.approx((3 + 8) / 2)


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(root, name, step_s, trace, tp=1, pp=2, dp=1):
    """A run with 3 steps of `step_s` and a Chrome-like timeline of steps 1 and 2 per rank."""
    _jsonl(root / name / "metrics.jsonl",
           [{"step": s, "loss": 5.0 - s * 0.1, "step_time_s": step_s, "tokens_per_s": 256 / step_s,
             "tflops_per_gpu": 1e-4 / step_s, "tp": tp, "cp": 1, "pp": pp, "dp": dp} for s in range(3)])
    events = [dict(e, step=s) for s in (1, 2) for e in trace]
    _jsonl(root / name / "trace" / "actions_rank0.jsonl", events)


def _sweep(tmp_path, fast_first: bool):
    root = tmp_path / ("a" if fast_first else "b")
    names = ["pp2", "pp2-dp2"]
    times = (0.1, 0.3) if fast_first else (0.3, 0.1)
    _jsonl(root / "sweep.jsonl", [{"name": n, "label": lab, "status": "ok", "reason": ""}
                                  for n, lab in zip(names, ("TP1/CP1/PP2", "TP1/CP1/PP2/DP2"))])
    # pp2: 60 ms compute, 40 ms waiting for the previous stage; pp2-dp2: 60 ms compute, 240 ms of DP
    _run(root, names[0], times[0], [_ev(0, "compute", "0F0", 0, 60), _ev(0, "pp", "recv", 60, 100, wait=40)])
    _run(root, names[1], times[1], [_ev(0, "compute", "0F0", 0, 60), _ev(0, "dp", "all_reduce", 60, 300)],
         dp=2)
    if not fast_first:   # the same layouts, the other one faster: the text follows the data
        _run(root, names[1], 0.1, [_ev(0, "compute", "0F0", 0, 60), _ev(0, "dp", "all_reduce", 60, 100)],
             dp=2)
        _run(root, names[0], 0.3, [_ev(0, "compute", "0F0", 0, 60), _ev(0, "pp", "recv", 60, 300, wait=240)])
    return root


@pytest.mark.parametrize("fast_first", [True, False])
def test_findings_name_the_winner_and_why_from_the_data(tmp_path, fast_first):
    from commpipe.report.cli import write_report

    out = write_report(_sweep(tmp_path, fast_first))
    winner, loser = ("TP1/CP1/PP2", "TP1/CP1/PP2/DP2") if fast_first else ("TP1/CP1/PP2/DP2", "TP1/CP1/PP2")
    first, why, worst = out["findings"][:3]
    assert first == (f"{winner} is the fastest layout: 100 ms per step, 3.00x faster than the next, "
                     f"{loser} (300 ms).")
    if fast_first:
        assert why == (f"Why {winner} leads: it spends 0 ms per step on exposed DP communication against "
                       f"240 ms in {loser}.")
        assert worst == (f"{loser} loses most to exposed DP communication: 240 ms of its 300 ms traced step "
                         "(80%).")
    else:
        assert why == (f"Why {winner} leads: it spends 0 ms per step on pipeline bubble against 240 ms "
                       f"in {loser}.")
        assert worst == f"{loser} loses most to pipeline bubble: 240 ms of its 300 ms traced step (80%)."
    # a CPU-sized throughput is named as such, in a unit with digits before the point
    assert any("1 GFLOP/s per GPU at best these runs are on CPU" in f for f in out["findings"])


def test_html_opens_with_findings_contents_and_a_short_table(tmp_path):
    from commpipe.report.cli import write_report
    from commpipe.report.tables import HEADER

    out = write_report(_sweep(tmp_path, True))
    html = Path(out["html"]).read_text()
    body = html[html.index("<body>"):]
    order = [body.index(x) for x in ("<h2 id='findings'>", "<nav>", "<h2 id='layouts'>", "<h2 id='figures'>",
                                     "<h2 id='details'>")]
    assert order == sorted(order)
    assert out["findings"][0] in html
    for anchor in re.findall(r"<a href='#([^']+)'>", body):
        assert f"id='{anchor}'" in html, anchor
    main = body[body.index("<h2 id='layouts'>"):body.index("</table>")]
    assert main.count("<th>") == 14 and "Efficiency" not in main and "GFLOP/s/GPU" in main
    details = body[body.index("<h2 id='details'>"):]
    assert details.count("<th>") == len(HEADER) and "<div class='scroll'>" in details


def test_the_adaptive_report_marks_the_settled_layout():
    from commpipe.report.adaptive import CHOSEN, candidate_colors, plan_label, settled_layout

    def plan(tp, pp, dp, layers):
        return {"tp": tp, "cp": 1, "pp": pp, "dp": dp, "stage_layers": layers, "name": f"{tp}{pp}{dp}"}

    start, a, b = plan(1, 2, 1, [2, 2]), plan(2, 2, 1, [2, 2]), plan(1, 2, 2, [2, 2])
    # the switch starts a trial of a then b; the phase settles on b, the second tried
    log = [{"step": 5, "action": "stay", "from": start},
           {"step": 12, "action": "switch", "from": start, "to": a, "trial_plans": [a, b]},
           {"step": 15, "action": "trial", "plan": "a", "to": b},
           {"step": 18, "action": "trial", "plan": "b"},
           {"step": 18, "action": "settle", "to": b, "reason": "fastest measured"}]
    assert settled_layout(log) == b
    cands = [plan(1, 1, 4, [4]), a, b, start]
    assert candidate_colors(cands, settled_layout(log)).index(CHOSEN) == 2
    assert candidate_colors(cands, settled_layout(log)).count(CHOSEN) == 1
    # a trial phase the run's end cut short settles on nothing new
    assert settled_layout(log[:3]) is None
    assert settled_layout(log + [{"step": 30, "action": "switch", "to": start}]) == start
    assert plan_label(b) == "TP1/CP1/PP2/DP2 [2,2]"


def test_adaptive_run_row_names_both_layouts(tmp_path):
    from commpipe.report.tables import collect

    root = tmp_path / "demo"
    start = {"tp": 1, "cp": 1, "pp": 2, "dp": 1, "stage_layers": [2, 2]}
    to = {"tp": 1, "cp": 1, "pp": 2, "dp": 1, "stage_layers": [3, 1]}
    _jsonl(root / "adaptive" / "metrics.jsonl",
           [{"step": s, "loss": 5.0, "step_time_s": 0.1, "tp": 1, "cp": 1, "pp": 2, "dp": 1}
            for s in range(4)])
    _jsonl(root / "adaptive" / "adapt.jsonl",
           [{"step": 2, "action": "switch", "from": start, "to": to, "measured_step_ms": 300.0,
             "predicted_best_ms": 120.0, "detections": [{"key": "pp 0->1"}]}])
    (row,) = collect(root)
    assert row["label"] == "adaptive: TP1/CP1/PP2 [2,2] → TP1/CP1/PP2 [3,1]"


def test_timeline_legend_has_every_colour_drawn():
    from commpipe.report.run_figures import COMPUTE_COLORS, DIM_COLORS, _event_color, timeline_legend

    events = [_ev(0, "compute", "0F0", 0, 1), _ev(0, "compute", "0B0", 1, 2),
              _ev(0, "pp.1", "send", 2, 3, 0.5), _ev(0, "dp_cp", "all_reduce", 3, 4),
              _ev(0, "world", "all_reduce", 4, 5)]
    legend = {c for _, c, _ in timeline_legend(events)}
    assert {_event_color(e) for e in events} <= legend
    assert _event_color(events[2]) == DIM_COLORS["pp"] and _event_color(events[3]) == DIM_COLORS["dp"]
    # communication colours stay apart from compute colours (RGB distance)
    def rgb(h):
        return [int(h[i:i + 2], 16) for i in (1, 3, 5)]
    for _, comp in COMPUTE_COLORS.values():
        for comm in DIM_COLORS.values():
            assert sum((x - y) ** 2 for x, y in zip(rgb(comp), rgb(comm))) ** 0.5 > 60, (comp, comm)


def test_loss_spread_is_the_largest_gap_at_one_step():
    from commpipe.report.figures import loss_spread

    curves = {"a": {0: 5.0, 1: 4.0, 2: 3.0}, "b": {0: 5.0, 1: 4.25, 2: 3.125}, "c": {0: 5.5}}
    assert loss_spread(curves) == (0.5, 0)
    assert loss_spread({"a": {0: 1.0, 1: 2.0}, "b": {0: 1.0, 1: 2.25}}) == (0.25, 1)
