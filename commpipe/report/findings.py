"""The report's opening: what a researcher would state after reading the tables, written from
the measured rows (commpipe.report.tables.collect), their time breakdowns
(commpipe.report.breakdown) and link measurements (commpipe.report.links). Nothing here is
fixed text about a particular sweep: every name and number comes from the data."""

from __future__ import annotations

import statistics
from pathlib import Path

from commpipe.report.breakdown import DIM_ORDER
from commpipe.report.tables import flops_unit, fmt, run_path

TIE = 0.05          # step times closer than this are within a shared host's run-to-run noise
CPU_TFLOPS = 0.01   # below this per GPU, the run is on CPU or the model is tiny


def rate(gbps: float | None) -> str:
    if gbps is None:
        return "–"
    return f"{fmt(gbps * 1e3)} MB/s" if gbps < 1 else f"{fmt(gbps)} GB/s"


def _name(r: dict) -> str:
    return r.get("label") or r["name"]


PART_WORDS = {"compute": "compute", "bubble_ms": "pipeline bubble", "pp": "exposed PP communication",
              "tp": "exposed TP communication", "cp": "exposed CP communication",
              "dp": "exposed DP communication", "ep": "exposed EP communication",
              "other": "other exposed communication"}


def where_time_goes(b: dict) -> str:
    """"compute 45%, bubble 30% (waiting for a stage 25%, idle 5%), exposed PP 15%, DP 10%"."""
    w = b["window_ms"] or 1.0
    text = f"compute {b['compute'] / w:.0%}, bubble {b['bubble_ms'] / w:.0%}"
    if b["pp_wait"] / w >= 0.01 and b["idle"] / w >= 0.01:
        text += f" (waiting for a neighbour stage {b['pp_wait'] / w:.0%}, idle {b['idle'] / w:.0%})"
    comm = [f"{d.upper() if d != 'other' else 'other'} {b[d] / w:.0%}" for d in DIM_ORDER if b[d] / w >= 0.01]
    return text + (", exposed communication: " + ", ".join(comm) if comm else ", no exposed communication")


def _why(best: dict, other: dict) -> str | None:
    """The part of the step in which `best` saves the most time against `other`."""
    a, b = best.get("breakdown"), other.get("breakdown")
    if not a or not b:
        return None
    parts = ("compute", "bubble_ms", *DIM_ORDER)
    part = max(parts, key=lambda p: b[p] - a[p])
    if b[part] - a[part] <= 0:
        return None
    return (f"it spends {fmt(a[part])} ms per step on {PART_WORDS[part]} against {fmt(b[part])} ms "
            f"in {_name(other)}")


def ranking(ok: list[dict]) -> list[str]:
    timed = sorted((r for r in ok if r.get("step_time_ms")), key=lambda r: r["step_time_ms"])
    if len(timed) < 2:
        return []
    best, second, worst = timed[0], timed[1], timed[-1]
    gap = second["step_time_ms"] / best["step_time_ms"]
    if gap - 1 < TIE:
        head = (f"{_name(best)} and {_name(second)} are the fastest layouts, within {gap - 1:.0%} of each "
                f"other ({fmt(best['step_time_ms'])} and {fmt(second['step_time_ms'])} ms per step): "
                "closer than one run can tell apart on a shared host")
    else:
        head = (f"{_name(best)} is the fastest layout: {fmt(best['step_time_ms'])} ms per step, "
                f"{gap:.2f}x faster than the next, {_name(second)} ({fmt(second['step_time_ms'])} ms)")
    if worst is not second:
        head += (f", and {worst['step_time_ms'] / best['step_time_ms']:.1f}x faster than the slowest, "
                 f"{_name(worst)} ({fmt(worst['step_time_ms'])} ms)")
    out = [head + "."]
    why = _why(best, second)
    if why:
        out.append(f"{'Where the two differ' if gap - 1 < TIE else f'Why {_name(best)} leads'}: {why}.")
    b = worst.get("breakdown")
    if b and worst is not best:
        part = max(("bubble_ms", *DIM_ORDER), key=lambda p: b[p])
        out.append(f"{_name(worst)} loses most to {PART_WORDS[part]}: {fmt(b[part])} ms of its "
                   f"{fmt(b['window_ms'])} ms traced step ({b[part] / b['window_ms']:.0%}).")
    return out


def time_findings(ok: list[dict]) -> list[str]:
    with_b = [r for r in ok if r.get("breakdown")]
    if not with_b:
        return ["No timeline was recorded (train with --trace) so the step is not split into compute, "
                "bubble and exposed communication."]
    out = [f"Where the time goes in {_name(r)}: {where_time_goes(r['breakdown'])}." for r in with_b[:1]]
    if len(with_b) > 1:
        def sh(r, k):
            return r["breakdown"][k] / r["breakdown"]["window_ms"]
        bub = max(with_b, key=lambda r: sh(r, "bubble_ms"))
        exp = max(with_b, key=lambda r: sh(r, "exposed_ms"))
        dim = max(DIM_ORDER, key=lambda d: exp["breakdown"][d])
        out.append(f"The largest bubble is in {_name(bub)} ({sh(bub, 'bubble_ms'):.0%} of its step); "
                   "the most "
                   f"exposed communication in {_name(exp)} ({sh(exp, 'exposed_ms'):.0%}, mostly "
                   f"{dim.upper() if dim != 'other' else 'other'}).")
    return out


def link_findings(sweep_dir, ok: list[dict], warmup: int) -> list[str]:
    from commpipe.report.links import class_summary, link_rows

    by_class: dict = {}
    outlier = None                      # (ratio, text) of the link furthest below its peers
    for r in ok:
        links = link_rows(run_path(sweep_dir, r), warmup)
        for c in class_summary(links):
            by_class.setdefault((c["dim"], c["link_class"]), []).append(c["gbps"])
        for dim in {lk["dim"] for lk in links}:
            same = [lk for lk in links if lk["dim"] == dim and lk["gbps"]]
            if len(same) < 3:
                continue
            med = statistics.median(lk["gbps"] for lk in same)
            slow = min(same, key=lambda lk: lk["gbps"])
            ratio = med / slow["gbps"]
            if ratio >= 2 and (outlier is None or ratio > outlier[0]):
                where = (f"{slow['src']}→{slow['dst']}" if slow["kind"] == "p2p"
                         else f"group {slow['group']}")
                outlier = (ratio, f"The slowest single link: {dim.upper()} {where} in {_name(r)}, "
                           f"{rate(slow['gbps'])}, {ratio:.1f}x below the median of that layout's "
                           f"{dim.upper()} links ({rate(med)}).")
    out, pairs = [], []
    for dim in ("pp", "tp", "cp", "dp", "ep"):
        intra, inter = by_class.get((dim, "intra_node")), by_class.get((dim, "inter_node"))
        if intra and inter:
            a, b = statistics.median(intra), statistics.median(inter)
            ratio = a / b
            verdict = ("about the same" if 1 / 1.3 < ratio < 1.3 else f"{ratio:.1f}x slower across nodes"
                       if ratio > 1 else f"{1 / ratio:.1f}x faster across nodes")
            pairs.append(f"{dim.upper()} {rate(b)} against {rate(a)} ({verdict})")
    if pairs:
        out.append("Inter-node against intra-node links (median over layouts; PP per message, TP/CP/DP bus "
                   "bandwidth): " + "; ".join(pairs) + ".")
    dims = {d: statistics.median(v for (dd, _), vs in by_class.items() if dd == d for v in vs)
            for d in {d for d, _ in by_class}}
    if len(dims) > 1:
        order = sorted(dims, key=dims.get)
        out.append("By dimension (median over links and layouts): " + ", ".join(
            f"{d.upper()} {rate(dims[d])}" for d in order) + f"; {order[0].upper()} is the slowest, "
            f"{dims[order[-1]] / dims[order[0]]:.1f}x below {order[-1].upper()}.")
    if outlier:
        out.append(outlier[1])
    return out


def findings(sweep_dir, rows: list[dict], warmup: int = 1) -> list[str]:
    """The opening statements of a report, most important first."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    if len(rows) == 1 and ok:
        r = ok[0]
        scale, unit = flops_unit(rows)
        tf = r.get("tflops_per_gpu")
        out.append(f"{_name(r)}: {fmt(r.get('step_time_ms'))} ms per step, {fmt(r.get('tokens_per_s'))} "
                   f"tokens/s, {fmt(None if tf is None else tf * scale)} {unit} per GPU (medians after "
                   f"{warmup} warm-up step{'s' if warmup != 1 else ''}).")
    else:
        # the adaptive run and its static and oracle runs are compared over the faulty period
        # (commpipe.report.adaptive_findings), not ranked as layouts: their medians span
        # different layouts and network states
        out += ranking([r for r in ok if not r.get("role")])
    out += time_findings(ok)
    out += link_findings(sweep_dir, ok, warmup)
    best = max((r.get("tflops_per_gpu") or 0.0 for r in ok), default=0.0)
    if ok and 0 < best < CPU_TFLOPS:
        scale, unit = flops_unit(rows)
        out.append(f"At {fmt(best * scale)} {unit} per GPU at best these runs are on CPU or the model is "
                   "tiny: processes sharing cores and per-message overheads, not the network, set the order "
                   "of the layouts; the communication and bubble measurements carry over to GPUs, the "
                   "ranking does not (`commpipe plan` predicts the GPU ranking).")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        def why(r):
            reason = (r.get("reason") or "").strip()
            return f"{r['status']}: {reason.splitlines()[0][:120]}" if reason else r["status"]
        out.append(f"{len(failed)} layout{'s' if len(failed) > 1 else ''} did not run: "
                   + "; ".join(f"{_name(r)} ({why(r)})" for r in failed) + ".")
    return out


def loss_finding(sweep_dir, rows: list[dict]) -> str | None:
    from commpipe.report.figures import loss_spread
    from commpipe.report.tables import read_jsonl

    curves = {}
    for r in rows:
        m = read_jsonl(Path(run_path(sweep_dir, r)) / "metrics.jsonl")
        if m and r["status"] == "ok":
            curves[_name(r)] = {x["step"]: x["loss"] for x in m if "loss" in x}
    if len(curves) < 2:
        return None
    spread, step = loss_spread(curves)
    verdict = "agree" if spread <= 1e-3 else "differ"
    return (f"Training losses {verdict} across layouts: the largest difference at any step is "
            f"{spread:.2g}" + (f" (step {step})." if step is not None else "."))
