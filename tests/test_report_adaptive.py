"""The report of an adaptive demo folder (adaptive, static and oracle runs): which row is which,
the recovered share over the faulty steps, in-page links, and bandwidth from calls big enough to
measure it. Synthetic folders with hand-computed values; no training runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from commpipe.monitor.records import build_links, build_records


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics(times_s, tp=1, cp=1, pp=1, dp=4):
    return [{"step": s, "loss": 5.0 - 0.01 * s, "step_time_s": t, "tokens_per_s": 256 / t,
             "tflops_per_gpu": 1e-6 / t, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "microbatches": 2}
            for s, t in enumerate(times_s)]


START = {"tp": 1, "cp": 1, "pp": 1, "dp": 4, "stage_layers": [4], "name": "tp1-cp1-pp1-dp4"}
BEST = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "stage_layers": [2, 2], "name": "tp1-cp1-pp2-dp2-1f1b"}


def _demo(root: Path) -> Path:
    """10 steps, a one-step blip at 3 and the link degraded from step 5 on. Static: 100 ms, then
    1000 ms from step 5. Adaptive: 1000 ms at steps 5 and 6, switched, 200 ms from step 7.
    Oracle: 200 ms (its sweep's median). Over steps 5-9: static mean 1000 ms, adaptive
    (2 * 1000 + 3 * 200) / 5 = 520 ms, so (1000 - 520) / (1000 - 200) = 60% recovered."""
    (root).mkdir(parents=True)
    (root / "scenario.json").write_text(json.dumps({"degrade_step": 5, "link": "node 1", "blip_steps": [3]}))
    _jsonl(root / "static" / "metrics.jsonl", _metrics([0.1] * 5 + [1.0] * 5))
    _jsonl(root / "adaptive" / "metrics.jsonl", _metrics([0.1] * 5 + [1.0] * 2 + [0.2] * 3, pp=2, dp=2))
    _jsonl(root / "adaptive" / "adapt.jsonl",
           [{"step": 6, "action": "switch", "from": START, "to": BEST, "measured_step_ms": 1000.0,
             "predicted_best_ms": 210.0, "detections": [{"key": "dp_cp [0, 1, 2, 3] all_reduce"}]}])
    _jsonl(root / "oracle" / "metrics.jsonl", _metrics([0.2] * 6, pp=2, dp=2))
    (root / "oracle" / "candidates.json").write_text(json.dumps(
        {"best": dict(BEST, median_ms=200.0), "steps": 6, "warmup": 2, "min_steps": 4,
         "candidates": [dict(BEST, median_ms=200.0), dict(START, median_ms=1000.0)]}))
    return root


def test_adaptive_report_names_each_run_and_leads_with_the_recovered_share(tmp_path):
    from commpipe.report.cli import write_report

    out = write_report(_demo(tmp_path / "demo"), warmup=2)
    labels = {r["name"]: r["label"] for r in out["rows"]}
    assert labels == {"static": "static: TP1/CP1/PP1/DP4",
                      "oracle": "best static (oracle): TP1/CP1/PP2/DP2",
                      "adaptive": "adaptive: TP1/CP1/PP1/DP4 → TP1/CP1/PP2/DP2 [2,2]"}
    found = out["findings"]
    assert found[0] == ("Over steps 5–9 (degrade node 1 to the end of the run, 5 steps) the "
                        "adaptive run took 520 ms per step on average, the static run (static: "
                        "TP1/CP1/PP1/DP4) 1000 ms and the best static layout (oracle) 200 ms: the "
                        "controller recovered 60% of the time the fault cost the static run "
                        "((T_static − T_adaptive) / (T_static − T_oracle), step-time means).")
    # the three runs are not ranked as if they were three layouts of one sweep
    assert not any("fastest layout" in f for f in found)
    assert "Injected: blip (1 step) at step 3, degrade node 1 at step 5." in found
    html = Path(out["html"]).read_text()
    table = html[html.index("<h2 id='layouts'>"):]
    table = table[:table.index("</table>")]
    for label in labels.values():
        assert f"<td>{label}</td>" in table


def test_a_plain_sweep_keeps_its_ranking_and_no_roles(tmp_path):
    from commpipe.report.cli import write_report

    root = tmp_path / "sw"
    _jsonl(root / "static" / "metrics.jsonl", _metrics([0.3] * 4))
    _jsonl(root / "oracle" / "metrics.jsonl", _metrics([0.1] * 4, pp=2, dp=2))
    out = write_report(root)
    assert {r["label"] for r in out["rows"]} == {"TP1/CP1/PP1/DP4", "TP1/CP1/PP2/DP2"}
    assert out["findings"][0].startswith("TP1/CP1/PP2/DP2 is the fastest layout: 100 ms per step")


def _trace_sweep(root: Path) -> Path:
    """Two layouts with a recorded timeline: the report has a 'where the time goes' section."""
    _jsonl(root / "sweep.jsonl", [{"name": n, "label": n, "status": "ok", "reason": ""} for n in ("a", "b")])
    for name, t in (("a", 0.1), ("b", 0.3)):
        _jsonl(root / name / "metrics.jsonl", _metrics([t] * 3, pp=2, dp=1))
        _jsonl(root / name / "trace" / "actions_rank0.jsonl",
               [{"rank": 0, "stream": "compute", "name": "0F0", "start_ms": 0.0, "end_ms": 60.0, "step": s,
                 "args": {}}
                for s in (1, 2)])
    return root


@pytest.mark.parametrize("traced", [True, False])
def test_every_in_page_link_of_the_report_resolves(tmp_path, traced):
    from commpipe.report.cli import write_report

    root = _trace_sweep(tmp_path / "t") if traced else _demo(tmp_path / "demo")
    html = Path(write_report(root)["html"]).read_text()
    assert ("id='where-the-time-goes'" in html) == traced
    anchors = re.findall(r"href=['\"]#([^'\"]+)['\"]", html)
    assert "details" in anchors
    ids = set(re.findall(r"id=['\"]([^'\"]+)['\"]", html))
    assert [a for a in anchors if a not in ids] == []


DP = ("dp_cp", "all_reduce", None, (0, 1, 2, 3))


def _dp_step(step: int, nbytes: int, transfer_s: float) -> list[dict]:
    """Every rank's record of one step whose one timed DP call moved `nbytes` in `transfer_s`
    (all members posted at 0), as the monitor builds it, with the gradient all-reduce and the
    8-byte gradient-norm all-reduce counted on the stream."""
    per_rank = {}
    for rank in range(4):
        per_rank[rank] = build_records(rank, step, [(DP, 2, 4_000_000 + 8)],
                                       [(DP, step, 0.0, transfer_s, nbytes)],
                                       lambda key, mid: [0.0] * 4, {}, 0.1, nodes=[0, 0, 1, 1])
    return per_rank


def test_bandwidth_leaves_out_calls_too_small_to_measure_it(tmp_path):
    """Steps 1 and 2 timed only the 8-byte reduction (10 ms: 8e-7 GB/s), step 3 the 4 MB
    gradient all-reduce in 1 s: 0.004 GB/s algbw, 0.006 GB/s bus bandwidth (factor 2 * 3/4).
    Only step 3 says anything about the link; the median over all three would be 1.2e-6."""
    from commpipe.report.links import bytes_per_timed_call, class_summary, link_rows
    from commpipe.report.tables import summarize_run

    run = tmp_path / "run"
    steps = {0: (4_000_000, 1.0), 1: (8, 0.01), 2: (8, 0.01), 3: (4_000_000, 1.0)}
    ranks: dict = {r: [] for r in range(4)}
    links = []
    for step, (nbytes, secs) in steps.items():
        per_rank = _dp_step(step, nbytes, secs)
        for r, recs in per_rank.items():
            ranks[r] += recs
        links += build_links(step, per_rank)
    assert bytes_per_timed_call(ranks[0][1]) == pytest.approx(8)
    assert bytes_per_timed_call(links[3]) == pytest.approx(4_000_000)
    for r, recs in ranks.items():
        _jsonl(run / "monitor" / f"rank{r}.jsonl", recs)
    _jsonl(run / "monitor" / "links.jsonl", links)
    _jsonl(run / "metrics.jsonl", _metrics([1.0] * 4))
    (summary,) = class_summary(link_rows(run))
    assert (summary["dim"], summary["link_class"]) == ("dp", "inter_node")
    assert summary["gbps"] == pytest.approx(0.006) and summary["timed"] == 1
    row = summarize_run(run)
    assert row["dp_inter_gbps"] == pytest.approx(0.006)
    assert row["dp_bw_gbps"] == pytest.approx(0.006)


def test_a_runs_story_and_figure_tell_the_dropped_candidates_and_the_re_check(tmp_path):
    """A switch that starts two trials, the first of which rules a third candidate out untried,
    a settle, and the re-check of the settled plan on its own baselines (which stays)."""
    from commpipe.report.adaptive import step_time_figure
    from commpipe.report.adaptive_findings import run_story

    run = tmp_path / "adaptive"
    _jsonl(run / "metrics.jsonl", _metrics([0.1] * 5 + [1.0] * 2 + [0.2] * 13, pp=2, dp=2))
    third = dict(BEST, pp=4, dp=1, stage_layers=[1, 1, 1, 1], name="tp1-cp1-pp4-dp1-1f1b")
    _jsonl(run / "adapt.jsonl", [
        {"step": 6, "action": "switch", "from": START, "to": BEST, "measured_step_ms": 1000.0,
         "predicted_best_ms": 210.0, "trial_plans": [BEST, third], "switch_time_s": 0.4,
         "detections": [{"key": "dp_cp [0, 1, 2, 3] all_reduce"}],
         "probed": {"seconds": 0.05, "links": {"0->2": {"latency_ms": 0.1, "gbps": 0.1177}},
                    "call_ms": 0.83, "calls_seconds": 0.3}},
        {"step": 10, "action": "trial", "plan": BEST["name"], "predicted_ms": 210.0,
         "measured_ms": 200.0, "dropped": [third["name"]]},
        {"step": 10, "action": "settle", "to": BEST, "measured_ms": 200.0, "kind": None,
         "reason": "fastest measured"},
        {"step": 17, "action": "stay", "from": BEST, "recheck": True, "reason": "no gain",
         "detections": []}])
    story = run_story(run)
    assert ("Trials (predicted → measured ms per step): tp1-cp1-pp2-dp2-1f1b 210 → 200. Dropped "
            "untried, as the measured trials ruled them out: tp1-cp1-pp4-dp1-1f1b.") in story
    assert story[-1] == "Re-checked on its own baselines: TP1/CP1/PP2/DP2 [2,2] at step 17, stayed."
    assert story[-3] == ("Measured before planning, as nothing the run sent had given their rate: "
                         "link 0->2 at step 6, 0.118 GB/s.")
    assert story[-2] == ("A gloo collective call, timed after compute, cost 0.83 ms beyond its "
                         "link (priced at step 6); each TP and CP call of a candidate was priced "
                         "with it.")
    png, caption = step_time_figure(run, tmp_path / "steps.png")
    assert png.stat().st_size > 0 and "re-checks of a plan on its own baselines (1)" in caption
