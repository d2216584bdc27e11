"""Figures of one run folder (matplotlib, Agg backend, PNG): the bandwidth of each link over the
steps, the rank x rank bandwidth matrices and the measured timeline. Each function writes one
file and returns (path, caption), or None when the run has no data for it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from commpipe.report.breakdown import stream_dim  # noqa: E402
from commpipe.report.tables import read_jsonl, run_path  # noqa: E402
from commpipe.timeline import load_events  # noqa: E402,F401  (re-exported: commpipe.report.figures)

DPI = 100
# communication in warm colours, compute in blues, so the two never read alike
DIM_COLORS = {"pp": "#d62728", "tp": "#ff7f0e", "cp": "#e377c2", "dp": "#8c564b", "ep": "#bcbd22",
              "other": "#7f7f7f"}
COMPUTE_COLORS = {"F": ("forward", "#3a5a98"), "B": ("backward", "#7ea6d8"),
                  "I": ("input grad", "#7ea6d8"), "W": ("weight grad", "#c5d8ef")}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


LINE_STYLES = {"pp": "-", "tp": "--", "cp": ":", "dp": "-.", "ep": (0, (3, 1, 1, 1, 1, 1))}


def _link_label(rec: dict) -> str | None:
    """Label of a p2p link or of a TP/CP/DP/EP collective group; None for what is not a link
    (the pipeline group's loss all-reduce, world-wide calls, an EP group's scalar sum)."""
    from commpipe.report.links import LINK_DIMS, is_link

    dim = LINK_DIMS.get(rec.get("dim"))
    if dim is None or not is_link(rec):
        return None
    if rec.get("kind") == "p2p" or rec.get("op") in ("send", "recv"):
        return f"pp {rec['src']}→{rec['dst']}" if dim == "pp" else None
    if dim == "pp":
        return None
    return f"{dim} {rec.get('op', '')} {rec.get('group')}"


def _link_series(run_dir: Path) -> dict[str, list[tuple]]:
    """{link label: [(step, GB/s, transfer ms), ...]} from monitor/links.jsonl, else the ranks' records."""
    series: dict[str, list[tuple]] = {}
    links = read_jsonl(run_dir / "monitor" / "links.jsonl")
    if not links:   # the receiver's view of each link, the lowest member's view of each group
        for path in sorted((run_dir / "monitor").glob("rank*.jsonl")):
            for rec in read_jsonl(path):
                if rec.get("op") == "recv":
                    links.append({**rec, "src": rec["peer"], "dst": rec["rank"]})
                elif rec.get("op") != "send" and rec.get("rank") == min(rec.get("group") or [-1]):
                    links.append(rec)
    for rec in links:
        label = _link_label(rec)
        if label is not None:
            bw = rec.get("bandwidth_gbps") if label.startswith("pp") else rec.get("busbw_gbps")
            series.setdefault(label, []).append((rec["step"], bw, rec.get("transfer_ms")))
    return series


def links_over_steps(sweep_dir: Path, row, out: Path, max_lines: int = 14):
    series = _link_series(run_path(sweep_dir, row))
    series = {k: sorted(v) for k, v in series.items() if any(p[1] is not None for p in v)}
    if not series:
        return None
    # pipeline links first, then the busiest collectives
    labels = sorted(series, key=lambda k: (not k.startswith("pp"), k))[:max_lines]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.get_cmap("tab20").colors
    for i, label in enumerate(labels):
        pts = [p for p in series[label] if p[1] is not None]
        style = dict(marker=".", label=label, alpha=0.85, color=colors[i % len(colors)],
                     linestyle=LINE_STYLES[label.split()[0]])
        a1.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], **style)
    for ax in (a1, a2):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a1.set_title(f"{row.get('label') or row['name']}: bandwidth per link")
    a1.set_xlabel("step")
    a1.set_ylabel("GB/s")
    a2.set_title("transfer time per call")
    a2.set_xlabel("step")
    a2.set_ylabel("ms")
    a2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return (_save(fig, out / f"links_{row['name']}.png"),
            f"{row.get('label') or row['name']}: bandwidth and transfer time of each link and collective "
            "group, per step (line style = dimension: PP solid, TP dashed, CP dotted, DP dash-dot, EP "
            "dash-dot-dot).")


def _event_color(e: dict) -> str:
    if e["stream"] != "compute":
        return DIM_COLORS[stream_dim(e["stream"])]
    name = e["name"].lstrip("0123456789")
    return COMPUTE_COLORS.get(name[:1], ("other", "#bbbbbb"))[1]


def timeline_legend(events: list[dict]) -> list[tuple[str, str, float]]:
    """(label, colour, alpha) of every kind of bar the events draw, compute first."""
    out = []
    ops = {e["name"].lstrip("0123456789")[:1] for e in events if e["stream"] == "compute"}
    seen = set()
    for op, (label, color) in COMPUTE_COLORS.items():
        if op in ops and color not in seen:
            seen.add(color)
            out.append((label if op != "B" or "I" not in ops else "backward / input grad", color, 1.0))
    if ops - set(COMPUTE_COLORS):
        out.append(("other compute", "#bbbbbb", 1.0))
    dims = {stream_dim(e["stream"]) for e in events if e["stream"] != "compute"}
    for d in DIM_COLORS:
        if d in dims:
            out.append((f"{d.upper() if d != 'other' else 'other'} comm", DIM_COLORS[d], 1.0))
    if any((e.get("args") or {}).get("wait_ms") for e in events if e["stream"] != "compute"):
        out.append(("waiting for peer (pale)", "#7f7f7f", 0.3))
    return out


def timeline(sweep_dir: Path, row, out: Path):
    # the monitor nests a "wait" child slice in each call; the call's own args carry the same split
    events = [e for e in load_events(run_path(sweep_dir, row))
              if isinstance(e.get("rank"), int)
              and not (e["stream"] != "compute" and e.get("name") == "wait")]
    if not events:
        return None
    step = max(e.get("step", 0) for e in events)
    events = [e for e in events if e.get("step", 0) == step]
    t0 = min(e["start_ms"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(ranks) + 1.6))
    for e in events:
        y = ranks.index(e["rank"]) + (0.0 if e["stream"] == "compute" else 0.42)
        h = 0.4 if e["stream"] == "compute" else 0.18
        start, dur = e["start_ms"] - t0, max(e["end_ms"] - e["start_ms"], 1e-3)
        # the monitor splits a call into waiting for the peer (first) and transfer: wait is pale
        wait = min((e.get("args") or {}).get("wait_ms") or 0.0, dur)
        if wait > 0:
            ax.broken_barh([(start, wait)], (y, h), color=_event_color(e), alpha=0.3, edgecolor="none")
        ax.broken_barh([(start + wait, dur - wait)], (y, h), color=_event_color(e), edgecolor="none")
    ax.set_yticks([i + 0.3 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    handles = [Patch(color=c, alpha=a, label=lab) for lab, c, a in timeline_legend(events)]
    ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    name = row.get("label") or row["name"]
    ax.set_title(f"{name}: measured timeline of step {step}")
    return (_save(fig, out / f"timeline_{row['name']}.png"),
            f"{name}: what each rank did during step {step}: compute (blues) in the upper half of each "
            "row, communication (warm colours, one per dimension; pale = waiting for the peer) in "
            "the lower half; gaps are idle time.")


def link_heatmap(sweep_dir: Path, row, out: Path):
    """Per dimension, the rank x rank matrix of measured bandwidth (log colour scale), with the
    node boundaries drawn, so a slow link or a slow node stands out."""
    from commpipe.report.links import link_rows, node_of_rank, rank_matrices

    run_dir = run_path(sweep_dir, row)
    links = link_rows(run_dir)
    nodes = node_of_rank(run_dir)
    world = len(nodes) if nodes else 1 + max((max(lk.get("src", 0), lk.get("dst", 0), *lk.get("group", []))
                                              for lk in links), default=0)
    mats = {d: m for d, m in rank_matrices(links, world).items() if any(v for r in m for v in r)}
    if not mats:
        return None
    values = [v for m in mats.values() for r in m for v in r if v]
    # one unit for the figure, so a cell reads "5.3" rather than "0.0053"
    scale, unit = (1e3, "MB/s") if max(values) < 1 else (1.0, "GB/s")
    norm = matplotlib.colors.LogNorm(vmin=min(values) * scale,
                                     vmax=max(max(values), min(values) * 1.01) * scale)
    cols = 1 if len(mats) == 1 else 2
    rows_n = -(-len(mats) // cols)
    side = max(4.5, 0.55 * world + 1.5)       # cells large enough for their labels
    fig, axes = plt.subplots(rows_n, cols, figsize=(side * cols + 1.4, side * rows_n + 0.6),
                             squeeze=False)
    font = 9 if world <= 4 else 8 if world <= 8 else 6
    for ax, (dim, m) in zip(axes.flat, mats.items()):
        grid = [[v * scale if v else float("nan") for v in r] for r in m]
        img = ax.imshow(grid, cmap="viridis", norm=norm)
        if world <= 16:
            for i, r in enumerate(m):
                for j, v in enumerate(r):
                    if v:
                        ax.text(j, i, f"{v * scale:.2g}", ha="center", va="center", fontsize=font,
                                color="white" if norm(v * scale) < 0.5 else "black")
        if nodes:   # lines between nodes
            for b in (k for k in range(1, world) if nodes[k] != nodes[k - 1]):
                ax.axhline(b - 0.5, color="#d62728", lw=1.5)
                ax.axvline(b - 0.5, color="#d62728", lw=1.5)
        ax.set_xticks(range(world))
        ax.set_yticks(range(world))
        ax.set_xlabel("to rank" if dim == "pp" else "rank")
        ax.set_ylabel("from rank" if dim == "pp" else "rank")
        ax.set_title(f"{dim.upper()} {unit}" + (" (per message)" if dim == "pp" else " (bus bandwidth)"))
    for ax in list(axes.flat)[len(mats):]:
        ax.axis("off")
    fig.colorbar(img, ax=axes.ravel().tolist(), shrink=0.8, label=unit)
    name = row.get("label") or row["name"]
    path = out / f"heatmap_{row['name']}.png"
    fig.suptitle(f"{name}: measured bandwidth, rank x rank ({unit})")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return (path, f"{name}: measured bandwidth between every pair of ranks, per dimension, over the steps "
            "after warm-up (red lines separate nodes: cells inside a block are intra-node links).")


