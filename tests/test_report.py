"""`commpipe report` on a sweep folder written by hand, with values whose medians are derived in
the comments (the report is a function of the folder)."""

from __future__ import annotations

import base64
import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from commpipe.report.cli import compare_study, spearman, write_report
from commpipe.report.figures import load_events
from commpipe.timeline import Event, write_chrome_trace

# the reference data lives beside the repository, in ../shared/data
STUDY_CSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "study_perlmutter_llama8b.csv"


def _jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics(times, tflops, losses, **layout):
    return [{"step": s, "loss": loss, "step_time_s": t, "tokens_per_s": 64 / t, "tflops_per_gpu": f, **layout}
            for s, (t, f, loss) in enumerate(zip(times, tflops, losses))]


def _p2p(step, rank, op, peer, bw, transfer, wait_total):
    return {"step": step, "rank": rank, "dim": "pp", "op": op, "peer": peer, "group": None, "calls": 4,
            "sampled": 2, "matched": 2, "bytes": 4096, "wait_ms_total": wait_total, "wait_ms": wait_total / 2,
            "transfer_ms": transfer, "latency_ms": transfer, "raw_ms": transfer + wait_total / 2,
            "bandwidth_gbps": bw, "busbw_gbps": bw, "ema_bandwidth_gbps": bw, "ema_latency_ms": transfer}


def _coll(step, rank, busbw, transfer):
    return {"step": step, "rank": rank, "dim": "tp", "op": "all_reduce", "peer": None, "group": [0, 1],
            "calls": 10, "sampled": 1, "matched": 1, "bytes": 1024, "wait_ms_total": 0.5, "wait_ms": 0.5,
            "transfer_ms": transfer, "raw_ms": transfer + 0.5, "bandwidth_gbps": busbw, "busbw_gbps": busbw}


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "sw"
    status = [
        {"name": "a", "label": "TP2/CP1/PP2", "tp": 2, "cp": 1, "pp": 2, "dp": 1, "status": "ok",
         "reason": "",
         "cluster": {"kind": "emulated", "nodes": 2, "ranks_per_node": 2, "inter_node_mbit": [100, 100]},
         "train": {"model": "tiny", "steps": 4}},
        {"name": "b", "label": "TP1/CP1/PP4", "tp": 1, "cp": 1, "pp": 4, "dp": 1, "status": "ok",
         "reason": ""},
        {"name": "c", "label": "TP1/CP4/PP1", "tp": 1, "cp": 4, "pp": 1, "dp": 1, "status": "failed",
         "reason": "out of memory: CUDA out of memory"},
    ]
    _jsonl(root / "sweep.jsonl", status)
    # a: step 0 is the warm-up; medians over steps 1-3: time (0.2, 0.4, 0.3) -> 0.3 s, TFLOP/s 1.5
    _jsonl(root / "a" / "metrics.jsonl", _metrics([1.0, 0.2, 0.4, 0.3], [0.1, 2.0, 1.0, 1.5], [5, 4, 3, 2.5],
                                                   tp=2, cp=1, pp=2, dp=1))
    # b: TFLOP/s 0.5 -> efficiency 0.5 / 1.5
    _jsonl(root / "b" / "metrics.jsonl",
           _metrics([1.0, 0.6, 0.6, 0.6], [0.1, 0.5, 0.5, 0.5], [5, 4.5, 4, 3.5]))
    # a's pipeline: per step, the send (rank 0) and recv (rank 2) records. Timing comes from the
    # receiver: bandwidth 3, 4, 5 over steps 1-3 -> median 4 GB/s (step 0's 100 is the warm-up);
    # transfer per call likewise -> 4 ms; wait per call = 6 ms / 2 matched calls = 3 ms;
    # calls per step = sends summed over ranks = 4
    rank0, rank2 = [], []
    for step, (bs, br) in enumerate([(100, 100), (1, 3), (2, 4), (3, 5)]):
        rank0.append(_p2p(step, 0, "send", 2, bs, float(bs), 0.0))
        rank2.append(_p2p(step, 2, "recv", 0, br, float(br), 99.0 if step == 0 else 6.0))
        rank0.append(_coll(step, 0, 0.2 * step, 0.1 * step))
    _jsonl(root / "a" / "monitor" / "rank0.jsonl", rank0)
    _jsonl(root / "a" / "monitor" / "rank2.jsonl", rank2)
    events = [Event(r, "compute", f"0F{m}", 10.0 * m + r, 10.0 * m + r + 8, step=3)
              for r in (0, 1) for m in range(3)]
    events += [Event(0, "pp", "send", 8.0, 9.0, step=3), Event(0, "compute", "0F0", 0, 5, step=2)]
    for r in (0, 1):
        write_chrome_trace(events, root / "a" / "trace" / f"rank{r}.json", rank=r, world_size=2)
    _jsonl(root / "b" / "monitor" / "links.jsonl",
           [{"step": s, "kind": "p2p", "dim": "pp", "src": 0, "dst": 1, "bandwidth_gbps": 1.0 + s,
             "transfer_ms": 2.0} for s in range(4)])
    return root


def test_report_values_and_files(sweep):
    out = write_report(sweep)
    rows = {r["name"]: r for r in csv.DictReader(open(sweep / "results.csv"))}
    assert list(rows) == ["a", "b", "c"]                         # best first, failures last
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert float(a["step_time_ms"]) == pytest.approx(300.0)
    assert float(a["tflops_per_gpu"]) == pytest.approx(1.5)
    assert float(a["final_loss"]) == 2.5
    assert float(a["pp_bw_gbps"]) == pytest.approx(4.0)
    assert float(a["pp_latency_ms"]) == pytest.approx(4.0)
    assert float(a["pp_wait_ms"]) == pytest.approx(3.0)
    assert float(a["pp_calls"]) == 4
    assert float(a["tp_bw_gbps"]) == pytest.approx(0.4)           # busbw 0.2, 0.4, 0.6 -> 0.4
    assert float(a["efficiency"]) == 1.0 and float(b["efficiency"]) == pytest.approx(1 / 3)
    assert c["status"] == "failed" and "out of memory" in c["reason"]
    md = (sweep / "report.md").read_text()
    # (no micro-batch count in these metrics, no trace: m and bubble are unknown)
    assert "| TP2/CP1/PP2 | 2 | 1 | 2 | 1 | – | 1.5 | 300 | – | 4 | 4 | 4 | 3 |" in md
    assert "failed: out of memory: CUDA out of memory" in md and "33%" in md
    names = {Path(p).name for p in out["figures"]}
    assert {"throughput.png", "pp_bandwidth.png", "pp_latency.png", "throughput_vs_latency.png", "loss.png",
            "links_a.png", "links_b.png", "timeline_a.png", "collective_latency.png"} <= names


def test_html_is_self_contained_and_embeds_every_figure(sweep):
    out = write_report(sweep)
    html = Path(out["html"]).read_text()
    assert html.count("<img ") == len(out["figures"]) >= 9
    for path in out["figures"]:
        assert base64.b64encode(Path(path).read_bytes()).decode() in html, path
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "src='http" not in html and "src='figures" not in html and "<script" not in html
    assert "out of memory" in html


def test_timeline_reads_the_last_step_of_chrome_traces(sweep):
    events = load_events(sweep / "a")
    assert {e["rank"] for e in events} == {0, 1}
    assert max(e["step"] for e in events) == 3
    send = [e for e in events if e["stream"] == "pp"]
    assert send and send[0]["end_ms"] - send[0]["start_ms"] == pytest.approx(1.0)


def test_report_needs_a_sweep_or_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no sweep.jsonl"):
        write_report(tmp_path)


def test_report_of_one_run_folder(sweep):
    """A run folder itself is summarised alone: its row, links, timeline and findings, the
    files written inside it."""
    run = sweep / "a"
    out = write_report(run)
    (row,) = out["rows"]
    assert row["name"] == "a" and row["status"] == "ok"
    assert row["step_time_ms"] == pytest.approx(300.0) and row["pp_bw_gbps"] == pytest.approx(4.0)
    names = {Path(p).name for p in out["figures"]}
    assert {"timeline_a.png", "links_a.png", "loss.png"} <= names
    assert "throughput.png" not in names           # nothing to compare one layout with
    html = (run / "report.html").read_text()
    assert "<title>commpipe run: a</title>" in html
    assert out["findings"][0].startswith("TP2/CP1/PP2: 300 ms per step")
    assert (run / "results.csv").exists() and (run / "report.md").exists()


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # sum d^2 = 2 -> 1 - 6*2 / (4 * (16 - 1)) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_compare_with_the_study():
    if not STUDY_CSV.exists():
        pytest.skip(f"{STUDY_CSV} not present")
    # measured numbers in the study's own order -> perfect agreement
    rows = [{"tp": tp, "cp": cp, "pp": pp, "dp": dp, "status": "ok", "tflops_per_gpu": 10.0 - i}
            for i, (tp, cp, pp, dp) in enumerate([(4, 1, 4, 1), (2, 2, 4, 1), (1, 4, 4, 1), (1, 1, 16, 1)])]
    (note,) = compare_study(rows, STUDY_CSV)
    assert "4 layouts match" in note and "with the study: 1 " in note
    assert rows[0]["study_tflops_per_gpu"] == 30.0 and rows[3]["study_tflops_per_gpu"] == 11.4


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_html_renders_with_visible_figures(sweep, tmp_path):
    """Headless Chromium draws report.html; the screenshot must hold the figures' colours."""
    out = write_report(sweep)
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1300,6000", f"file://{out['html']}"], capture_output=True, timeout=120)
    assert shot.exists()
    from matplotlib.image import imread

    img = imread(shot)[..., :3]
    # the throughput bars' blue (#1f77b4 = 0.12, 0.47, 0.71) must be on the page
    blue = ((abs(img[..., 0] - 0.12) < 0.05) & (abs(img[..., 1] - 0.47) < 0.05)
            & (abs(img[..., 2] - 0.71) < 0.05))
    assert blue.sum() > 2000


def test_link_classes_matrix_and_terminal_table(tmp_path):
    from commpipe.report.links import class_summary, link_rows, rank_matrices
    from commpipe.report.tables import collect, terminal_table

    run = tmp_path / "sw" / "pp"
    _jsonl(tmp_path / "sw" / "sweep.jsonl", [{"name": "pp", "label": "TP2/CP1/PP2 on two nodes", "tp": 2,
                                               "cp": 1, "pp": 2, "dp": 1, "status": "ok", "reason": ""}])
    _jsonl(run / "metrics.jsonl", _metrics([1.0, 0.5, 0.5, 0.5], [0.1, 1, 1, 1], [5, 4, 3.5, 3]))
    (run / "monitor").mkdir()
    (run / "monitor" / "nodes.json").write_text(json.dumps({"node_of_rank": [0, 0, 1, 1]}))

    def p2p(step, src, dst, cls, n, ms, bw):
        return {"step": step, "kind": "p2p", "dim": "pp", "src": src, "dst": dst, "link_class": cls,
                "matched": n, "transfer_ms": ms, "bandwidth_gbps": bw}

    # 0->1 after warm-up (step 0 is left out): steps at 2, 1 and 1.5 GB/s -> median 1.5 GB/s,
    # 4 timed calls; 1->2 one call of 10 ms at 0.01 GB/s
    links = [p2p(0, 0, 1, "intra_node", 1, 1.0, 100.0), p2p(1, 0, 1, "intra_node", 2, 1.0, 2.0),
             p2p(2, 0, 1, "intra_node", 1, 4.0, 1.0), p2p(3, 0, 1, "intra_node", 1, 2.0, 1.5),
             p2p(1, 1, 2, "inter_node", 1, 10.0, 0.01),
             {"step": 1, "kind": "collective", "dim": "tp", "op": "all_reduce", "group": [2, 3],
              "link_class": "intra_node", "sampled": 1, "transfer_ms": 1.0, "busbw_gbps": 3.0},
             {"step": 1, "kind": "collective", "dim": "pp", "op": "all_reduce", "group": [0, 1, 2, 3],
              "link_class": "inter_node", "sampled": 1, "transfer_ms": 1.0, "busbw_gbps": 9.0}]
    _jsonl(run / "monitor" / "links.jsonl", links)
    rows = link_rows(run)
    summary = {(s["dim"], s["link_class"]): s for s in class_summary(rows)}
    assert set(summary) == {("pp", "intra_node"), ("pp", "inter_node"), ("tp", "intra_node")}
    assert summary[("pp", "intra_node")]["gbps"] == pytest.approx(1.5)
    assert summary[("pp", "intra_node")]["transfer_ms"] == pytest.approx(2.0)
    assert summary[("pp", "intra_node")]["timed"] == 4
    assert summary[("pp", "inter_node")]["gbps"] == pytest.approx(0.01)
    mats = rank_matrices(rows, 4)
    assert mats["pp"][0][1] == pytest.approx(1.5) and mats["pp"][1][2] == pytest.approx(0.01)
    assert mats["pp"][1][0] is None and mats["tp"][2][3] == mats["tp"][3][2] == 3.0
    out = write_report(tmp_path / "sw")
    assert any(Path(p).name == "heatmap_pp.png" for p in out["figures"])
    html = Path(out["html"]).read_text()
    assert "Bandwidth by link class" in html and "inter-node" in html
    table = terminal_table(collect(tmp_path / "sw"), report="runs/x/report.html")
    lines = table.splitlines()
    assert all(len(line) <= 100 for line in lines) and lines[-1].endswith("runs/x/report.html")
    assert lines[0].split() == ["Layout", "m", "Step", "ms", "Bubble", "PP", "intra", "PP", "inter",
                                "TP", "intra", "TP", "inter", "Loss"]
    # m, step ms, bubble, PP intra, PP inter, TP intra, TP inter, loss
    assert lines[2].split()[-8:] == ["–", "500", "–", "1.5", "0.01", "3", "–", "3"]
    # a failed layout's reason is wrapped within the width, not cut before the fix it names
    reason = ("interleaved needs vpp >= 2 model chunks per rank, got vpp=1; use --vpp 2 (or more), "
              "or --schedule 1f1b for one chunk per rank")
    lines = terminal_table([{"name": "x", "label": "TP1/CP1/PP4", "status": "invalid",
                             "reason": reason}]).splitlines()
    failed = [line for line in lines if line.startswith(("TP1/CP1/PP4", "  "))]
    assert len(failed) == 2 and all(len(line) <= 100 for line in failed)
    assert " ".join(line.strip() for line in failed) == f"TP1/CP1/PP4: invalid: {reason}"


def test_layouts_that_differ_only_in_schedule_are_told_apart(tmp_path):
    from commpipe.report.tables import collect

    root = tmp_path / "sw"
    _jsonl(root / "sweep.jsonl", [
        {"name": n, "label": "TP2/CP1/PP2", "tp": 2, "cp": 1, "pp": 2, "dp": 1, "status": "ok",
         "reason": ""} for n in ("s", "z")] + [
        {"name": "o", "label": "TP1/CP1/PP4", "tp": 1, "cp": 1, "pp": 4, "dp": 1, "status": "ok",
         "reason": ""}])
    for name, schedule in (("s", "stp"), ("z", "zbv"), ("o", "1f1b")):
        _jsonl(root / name / "metrics.jsonl",
               _metrics([1.0, 0.5, 0.5], [0.1, 1.0, 1.0], [5, 4, 3], schedule=schedule, vpp=1))
    labels = {r["name"]: r["label"] for r in collect(root)}
    assert labels == {"s": "TP2/CP1/PP2 stp", "z": "TP2/CP1/PP2 zbv", "o": "TP1/CP1/PP4"}


def test_pp_raw_is_wait_plus_transfer_over_the_same_calls(tmp_path):
    """Three receivers per step: one waited 30 ms for its single timed call, two did not wait.
    Per call over the 3 matched calls: wait 30/3 = 10 ms, transfer 1 ms, raw 11 ms (a median of
    the records' raw_ms, 1 ms, would read below the wait)."""
    from commpipe.report.tables import collect

    root = tmp_path / "sw"
    _jsonl(root / "sweep.jsonl", [{"name": "p", "label": "TP1/CP1/PP4", "tp": 1, "cp": 1, "pp": 4, "dp": 1,
                                   "status": "ok", "reason": ""}])
    _jsonl(root / "p" / "metrics.jsonl", _metrics([1.0, 0.5, 0.5, 0.5], [0.1, 1, 1, 1], [5, 4, 3.5, 3]))
    recs = []
    for step in range(4):
        for rank, wait in ((1, 30.0), (2, 0.0), (3, 0.0)):
            r = _p2p(step, rank, "recv", rank - 1, 1.0, 1.0, wait)
            r.update(matched=1, sampled=1, raw_ms=1.0 + wait)
            recs.append(r)
    _jsonl(root / "p" / "monitor" / "rank1.jsonl", recs)
    rows = collect(root)
    for r in rows:
        assert r["pp_raw_ms"] >= r["pp_wait_ms"] and r["pp_raw_ms"] >= r["pp_latency_ms"]
    (p,) = rows
    assert (p["pp_wait_ms"], p["pp_latency_ms"], p["pp_raw_ms"]) == pytest.approx((10.0, 1.0, 11.0))


def test_grid_text_stays_text_in_report_md_and_results_csv(tmp_path):
    """Names, reasons and flags come from the grid and the logs: report.md shows them escaped
    (no raw HTML, no cell that splits its table row), results.csv keeps them as data and defuses
    a cell a spreadsheet would run as a formula."""
    script, formula = "<script>alert(1)</script>", "=cmd|' /C calc'!A0"
    root = tmp_path / "sw"
    _jsonl(root / "sweep.jsonl", [
        {"name": "a", "label": script, "tp": 1, "cp": 1, "pp": 2, "dp": 1, "status": "ok", "reason": "",
         "cluster": {"kind": "local"}, "train": {"model": "tiny", "data": script}},
        {"name": "b", "label": formula, "tp": 1, "cp": 1, "pp": 1, "dp": 2, "status": "failed",
         "reason": "ValueError: <img src=x onerror=alert(1)> | & more"}])
    _jsonl(root / "a" / "metrics.jsonl", _metrics([1.0, 0.5, 0.5], [0.1, 1.0, 1.0], [5, 4, 3]))
    write_report(root)

    md = (root / "report.md").read_text()
    assert "<script" not in md and "<img" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md
    assert "&lt;img src=x onerror=alert(1)&gt; \\| &amp; more" in md
    for table in ("## Layouts", "## Every column"):
        lines = md.split(table)[1].strip().splitlines()
        header, rows = lines[0], [x for x in lines[2:] if x.startswith("|")][:2]
        unescaped = [line.replace("\\|", "").count("|") for line in rows]
        assert len(rows) == 2 and unescaped == [header.count("|")] * 2, rows

    with open(root / "results.csv", newline="") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert rows["a"]["label"] == script                       # data, read back as written
    assert rows["b"]["label"] == "'" + formula                 # text, not a formula
    assert rows["b"]["reason"] == "ValueError: <img src=x onerror=alert(1)> | & more"
    raw = (root / "results.csv").read_text()
    assert not any(cell.startswith(("=", "+", "@")) for line in raw.splitlines()
                   for cell in next(csv.reader([line])))


def test_a_link_class_measured_only_with_small_messages_says_so(tmp_path):
    """A pipeline whose every message is under MIN_BANDWIDTH_BYTES (2,000 bytes: 0.002 GB/s over
    1 ms) has no bandwidth to show; the terminal table says "small" there, with a legend, where
    a class never measured keeps "–"; a class with one large enough step gives its rate."""
    from commpipe.report.links import class_columns
    from commpipe.report.tables import collect, terminal_table

    def p2p(step, src, dst, cls, ms, bw):
        return {"step": step, "kind": "p2p", "dim": "pp", "src": src, "dst": dst,
                "link_class": cls, "matched": 4, "transfer_ms": ms, "bandwidth_gbps": bw}

    _jsonl(tmp_path / "sw" / "sweep.jsonl", [{"name": "pp", "label": "TP1/CP1/PP2", "tp": 1,
                                               "cp": 1, "pp": 2, "dp": 1, "status": "ok",
                                               "reason": ""}])
    run = tmp_path / "sw" / "pp"
    _jsonl(run / "metrics.jsonl", _metrics([1.0, 0.5, 0.5], [0.1, 1, 1], [5, 4, 3]))
    (run / "monitor").mkdir()
    small = [p2p(s, 0, 1, "intra_node", 1.0, 0.002) for s in range(3)]
    _jsonl(run / "monitor" / "links.jsonl", small)
    assert class_columns(run)["small_messages"] == ["pp_intra"]
    lines = terminal_table(collect(tmp_path / "sw")).splitlines()
    # m, step ms, bubble, PP intra, PP inter, TP intra, TP inter, loss
    assert lines[2].split()[-8:] == ["–", "500", "–", "small", "–", "–", "–", "3"]
    assert any(line.startswith("small: every message under 4 KiB") for line in lines)
    # one step of 1 MB messages: a rate, and no legend
    _jsonl(run / "monitor" / "links.jsonl", small + [p2p(2, 0, 1, "intra_node", 1.0, 1.0)])
    assert class_columns(run)["small_messages"] == []
    lines = terminal_table(collect(tmp_path / "sw")).splitlines()
    assert lines[2].split()[-5] == "1" and not any(line.startswith("small:") for line in lines)
    # small messages only in a dimension the table does not show: no legend for it
    row = collect(tmp_path / "sw")[0] | {"small_messages": ["cp_intra"]}
    assert "small" not in terminal_table([row])
