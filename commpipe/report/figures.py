"""Figures of a sweep (matplotlib, Agg backend, PNG): each function writes one file and returns
(path, caption), or None when the sweep has no data for it. The figures of one run folder
(links, heatmaps, timeline) are in commpipe.report.run_figures."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from commpipe.report.breakdown import DIM_ORDER  # noqa: E402
from commpipe.report.run_figures import (  # noqa: E402,F401  (load_events: commpipe.timeline)
    COMPUTE_COLORS,
    DIM_COLORS,
    _save,
    link_heatmap,
    links_over_steps,
    load_events,
    timeline,
)
from commpipe.report.tables import DIMS, flops_unit, read_jsonl, run_path  # noqa: E402


def _names(rows):
    return [r.get("label") or r["name"] for r in rows]


def throughput(rows, out: Path):
    scale, unit = flops_unit(rows)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    names = _names(rows)[::-1]
    values = [(r.get("tflops_per_gpu") or 0.0) * scale for r in rows][::-1]
    bars = ax.barh(names, values, color="#1f77b4")
    for bar, r, v in zip(bars, rows[::-1], values):
        y = bar.get_y() + bar.get_height() / 2
        if r["status"] != "ok":
            bar.set_color("#d62728")
            ax.text(0, y, f"  {r['status']}", va="center", color="#d62728")
        elif v:
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
    ax.set_xlim(right=max(values + [0]) * 1.12 or 1)
    ax.set_xlabel(f"model {unit} per GPU (median after warm-up)")
    ax.set_title("Throughput per layout")
    return (_save(fig, out / "throughput.png"),
            f"Model {unit} per GPU of each layout (failed layouts in red).")


def bandwidth(rows, out: Path):
    ok = [r for r in rows if r["status"] == "ok"]
    dims = [d for d in DIMS if any(r.get(f"{d}_bw_gbps") for r in ok)]
    if not dims:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4))
    width = 0.8 / len(dims)
    for j, d in enumerate(dims):
        xs = [i + j * width for i in range(len(ok))]
        ax.bar(xs, [r.get(f"{d}_bw_gbps") or 0 for r in ok], width, label=d.upper(), color=DIM_COLORS[d])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ok))], _names(ok), rotation=30, ha="right")
    values = [r[f"{d}_bw_gbps"] for r in ok for d in dims if r.get(f"{d}_bw_gbps")]
    if max(values) > 30 * min(values):     # dimensions differ by orders of magnitude
        ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title("Link bandwidth by dimension")
    ax.legend()
    return (_save(fig, out / "pp_bandwidth.png"),
            "Bandwidth per dimension: pipeline (PP) point-to-point bandwidth and the TP/CP/DP collectives' "
            "bus bandwidth, transfer time only (waiting for the peer excluded).")


def pp_latency(rows, out: Path):
    ok = [r for r in rows if r["status"] == "ok" and r.get("pp_latency_ms") is not None]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4))
    xs = range(len(ok))
    transfer = [r.get("pp_latency_ms") or 0 for r in ok]
    wait = [r.get("pp_wait_ms") or 0 for r in ok]
    ax.bar(xs, transfer, label="transfer", color="#1f77b4")
    ax.bar(xs, wait, bottom=transfer, label="wait for peer", color="#aec7e8")
    raw = [r.get("pp_raw_ms") for r in ok]
    if any(v is not None for v in raw):
        ax.scatter([x for x, v in zip(xs, raw) if v is not None], [v for v in raw if v is not None],
                   marker="_", s=400, color="k", label="post-to-done (study's latency)", zorder=3)
    ax.set_xticks(list(xs), _names(ok), rotation=30, ha="right")
    ax.set_ylabel("ms per pipeline call")
    ax.set_title("Pipeline latency: transfer vs wait")
    ax.legend()
    return (_save(fig, out / "pp_latency.png"),
            "Pipeline point-to-point time per call split into transfer and waiting for the neighbour stage; "
            "the black mark is the post-to-done time a timer around the whole call reports.")


def collective_latency(rows, out: Path):
    ok = [r for r in rows if r["status"] == "ok"]
    dims = [d for d in ("tp", "cp", "dp", "ep") if any(r.get(f"{d}_latency_ms") is not None for r in ok)]
    if not dims:
        return None
    fig, axes = plt.subplots(1, len(dims), figsize=(4.2 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        sel = [r for r in ok if r.get(f"{d}_latency_ms") is not None]
        xs = range(len(sel))
        tr = [r[f"{d}_latency_ms"] for r in sel]
        ax.bar(xs, tr, color=DIM_COLORS[d], label="transfer")
        ax.bar(xs, [r.get(f"{d}_wait_ms") or 0 for r in sel], bottom=tr, color="#dddddd", label="wait")
        ax.set_xticks(list(xs), _names(sel), rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{d.upper()} collectives")
        ax.set_ylabel("ms per call")
        ax.legend(fontsize=8)
    return (_save(fig, out / "collective_latency.png"),
            "TP, CP, DP and EP collectives: time per call once every member posted (transfer) and skew "
            "(wait).")


MARKERS = "osD^v<>ph*"


def throughput_vs_latency(rows, out: Path):
    ok = [r for r in rows if r["status"] == "ok" and r.get("tflops_per_gpu") and r.get("pp_latency_ms")]
    if not ok:
        return None
    scale, unit = flops_unit(rows)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    colors = plt.get_cmap("tab10").colors
    # a legend instead of labels beside the points: nearby layouts' labels overlapped
    for i, r in enumerate(ok):
        ax.scatter(r["pp_latency_ms"] + (r.get("pp_wait_ms") or 0), r["tflops_per_gpu"] * scale, s=50,
                   color=colors[i % len(colors)], marker=MARKERS[i % len(MARKERS)],
                   label=r.get("label") or r["name"])
    ax.set_xlabel("pipeline ms per call (transfer + wait)")
    ax.set_ylabel(f"{unit} per GPU")
    ax.set_title("Throughput against pipeline latency")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, out / "throughput_vs_latency.png"), "Throughput against pipeline time per call."


def loss_spread(curves: dict[str, dict[int, float]]) -> tuple[float, int | None]:
    """(largest difference between any two layouts' losses at the same step, that step)."""
    best = (0.0, None)
    steps = set().union(*curves.values()) if curves else set()
    for s in sorted(steps):
        vals = [c[s] for c in curves.values() if s in c]
        if len(vals) > 1 and max(vals) - min(vals) > best[0]:
            best = (max(vals) - min(vals), s)
    return best


def loss_curves(sweep_dir: Path, rows, out: Path):
    curves = {}
    for r in rows:
        m = read_jsonl(run_path(sweep_dir, r) / "metrics.jsonl")
        if m:
            curves[r.get("label") or r["name"]] = {x["step"]: x["loss"] for x in m if "loss" in x}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    styles = ("-", "--", ":", "-.")
    for i, (label, c) in enumerate(curves.items()):
        steps = sorted(c)
        # identical curves would hide each other: a line style per layout
        ax.plot(steps, [c[s] for s in steps], marker=".", label=label, linestyle=styles[i % len(styles)])
    spread, at = loss_spread(curves)
    text = ("one layout" if len(curves) == 1 else
            f"largest difference between layouts: {spread:.2g}" + (f" (step {at})" if at is not None else ""))
    ax.text(0.99, 0.97, text, transform=ax.transAxes, ha="right", va="top", fontsize=9,
            bbox=dict(facecolor="white", edgecolor="#cccccc"))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return (_save(fig, out / "loss.png"),
            f"Training loss of every layout (same data and seed: the curves should agree); {text}.")


PART_COLORS = {"compute": COMPUTE_COLORS["F"][1], **{d: DIM_COLORS[d] for d in DIM_ORDER},
               "pp_wait": "#f2b6b6", "idle": "#e0e0e0"}
PART_LABELS = {"compute": "compute", **{d: f"{d.upper()} comm (exposed)" for d in DIMS},
               "other": "other comm (exposed)", "pp_wait": "bubble: waiting for a stage",
               "idle": "bubble: idle"}


def time_breakdown(rows, out: Path):
    """Stacked bars: ms per step in compute, exposed communication per dimension and bubble."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("breakdown")]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(ok) + 1.6))
    names = _names(ok)[::-1]
    left = [0.0] * len(ok)
    for part, color in PART_COLORS.items():
        vals = [r["breakdown"][part] for r in ok][::-1]
        if not any(v > 0 for v in vals):
            continue
        ax.barh(names, vals, left=left, color=color, label=PART_LABELS[part], edgecolor="white", lw=0.5)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per traced step (mean over ranks)")
    ax.set_title("Where the time goes")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return (_save(fig, out / "time_breakdown.png"),
            "Each layout's traced step split into compute, communication that no compute hid "
            "(per dimension) and the bubble (waiting for a neighbour stage, or idle), mean over ranks.")


def make_figures(sweep_dir, rows: list[dict], out_dir=None) -> list[tuple[Path, str]]:
    from commpipe.report.adaptive import adaptive_figure

    sweep_dir = Path(sweep_dir)
    out = Path(out_dir or sweep_dir / "figures")
    out.mkdir(parents=True, exist_ok=True)
    several = len(rows) > 1
    made = [time_breakdown(rows, out)]
    if several:
        made += [throughput(rows, out), bandwidth(rows, out), pp_latency(rows, out),
                 collective_latency(rows, out), throughput_vs_latency(rows, out)]
    made.append(loss_curves(sweep_dir, rows, out))
    for r in rows:
        if r["status"] == "ok":
            made.append(link_heatmap(sweep_dir, r, out))
            made.append(links_over_steps(sweep_dir, r, out))
            made.append(timeline(sweep_dir, r, out))
            made.append(adaptive_figure(sweep_dir, r, out))
    return [m for m in made if m is not None]
