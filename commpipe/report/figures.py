"""Figures of a sweep (matplotlib, Agg backend, PNG): each function writes one file and returns
(path, caption), or None when the sweep has no data for it."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from commpipe.report.tables import DIMS, read_jsonl  # noqa: E402

DPI = 100
DIM_COLORS = {"pp": "#1f77b4", "tp": "#ff7f0e", "cp": "#2ca02c", "dp": "#9467bd"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _names(rows):
    return [r.get("label") or r["name"] for r in rows]


def throughput(rows, out: Path):
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = _names(rows)[::-1]
    values = [r.get("tflops_per_gpu") or 0.0 for r in rows][::-1]
    bars = ax.barh(names, values, color="#1f77b4")
    for bar, r in zip(bars, rows[::-1]):
        if r["status"] != "ok":
            bar.set_color("#d62728")
            ax.text(0, bar.get_y() + bar.get_height() / 2, f"  {r['status']}", va="center", color="#d62728")
    ax.set_xlabel("model TFLOP/s per GPU (median after warm-up)")
    ax.set_title("Throughput per layout")
    return _save(fig, out / "throughput.png"), "Model TFLOP/s per GPU of each layout (failed layouts in red)."


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
    dims = [d for d in ("tp", "cp", "dp") if any(r.get(f"{d}_latency_ms") is not None for r in ok)]
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
            "TP, CP and DP collectives: time per call once every member posted (transfer) and skew (wait).")


def throughput_vs_latency(rows, out: Path):
    ok = [r for r in rows if r["status"] == "ok" and r.get("tflops_per_gpu") and r.get("pp_latency_ms")]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in ok:
        x = r["pp_latency_ms"] + (r.get("pp_wait_ms") or 0)
        ax.scatter(x, r["tflops_per_gpu"], color="#1f77b4")
        ax.annotate(r.get("label") or r["name"], (x, r["tflops_per_gpu"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("pipeline ms per call (transfer + wait)")
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_title("Throughput against pipeline latency")
    return _save(fig, out / "throughput_vs_latency.png"), "Throughput against pipeline time per call."


def loss_curves(sweep_dir: Path, rows, out: Path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for r in rows:
        m = sorted(read_jsonl(sweep_dir / r["name"] / "metrics.jsonl"), key=lambda x: x.get("step", 0))
        if m:
            ax.plot([x["step"] for x in m], [x["loss"] for x in m], marker=".",
                    label=r.get("label") or r["name"])
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    return (_save(fig, out / "loss.png"),
            "Training loss of every layout (same data and seed: the curves should agree).")


LINK_DIMS = {"pp": "pp", "tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp"}
LINE_STYLES = {"pp": "-", "tp": "--", "cp": ":", "dp": "-."}


def _link_label(rec: dict) -> str | None:
    """Label of a p2p link or of a TP/CP/DP collective group; None for what is not a link
    (the pipeline group's loss all-reduce, world-wide calls)."""
    dim = LINK_DIMS.get(rec.get("dim"))
    if dim is None:
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
    series = _link_series(sweep_dir / row["name"])
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
            "group, per step (line style = dimension: PP solid, TP dashed, CP dotted, DP dash-dot).")


def load_events(run_dir: Path) -> list[dict]:
    """Timeline events (commpipe.timeline schema) of a run: the monitor's Chrome traces
    (trace/rank*.json: compute and the timed calls of every dimension) when present, else the
    runtime's action timeline (trace/*.jsonl: compute and pipeline transfers of the last step),
    else any Chrome trace in trace/."""
    trace_dir = run_dir / "trace"
    chrome = sorted(trace_dir.glob("rank*.json"))
    if not chrome:
        events = [e for path in sorted(trace_dir.glob("*.jsonl")) for e in read_jsonl(path)]
        if events:
            return events
        chrome = sorted(trace_dir.glob("*.json"))
    events = []
    for path in chrome:
        try:
            trace = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        items = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in items
                   if e.get("ph") == "M" and e.get("name") == "thread_name"}
        for e in items:
            # the host thread (step marks, annotations, launches) repeats the device tracks
            if e.get("ph") == "X" and threads.get((e["pid"], e.get("tid"))) != "host":
                start = e["ts"] / 1000.0
                events.append({"rank": e["pid"], "stream": threads.get((e["pid"], e.get("tid")), "compute"),
                               "name": e.get("name", ""), "start_ms": start,
                               "end_ms": start + e.get("dur", 0) / 1000.0,
                               "step": (e.get("args") or {}).get("step", 0), "args": e.get("args") or {}})
    return events


def _event_color(e: dict) -> str:
    if e["stream"] != "compute":
        return DIM_COLORS.get(LINK_DIMS.get(e["stream"], e["stream"]), "#7f7f7f")
    name = e["name"].lstrip("0123456789")
    return {"F": "#4c72b0", "B": "#55a868", "I": "#8fbc8f", "W": "#c7e9c0"}.get(name[:1], "#bbbbbb")


def timeline(sweep_dir: Path, row, out: Path):
    # the monitor nests a "wait" child slice in each call; the call's own args carry the same split
    events = [e for e in load_events(sweep_dir / row["name"])
              if isinstance(e.get("rank"), int)
              and not (e["stream"] != "compute" and e.get("name") == "wait")]
    if not events:
        return None
    step = max(e.get("step", 0) for e in events)
    events = [e for e in events if e.get("step", 0) == step]
    t0 = min(e["start_ms"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(ranks) + 1.5))
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
    handles = [Patch(color=c, label=lab) for lab, c in
               (("forward", "#4c72b0"), ("backward", "#55a868"), ("weight grad", "#c7e9c0"),
                *((f"{d.upper()} comm", DIM_COLORS[d]) for d in DIMS))]
    handles.append(Patch(color="#1f77b4", alpha=0.3, label="waiting for peer"))
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(f"{row.get('label') or row['name']}: measured timeline of step {step}")
    return (_save(fig, out / f"timeline_{row['name']}.png"),
            f"{row.get('label') or row['name']}: what each rank did during step {step} (compute above, "
            "communication below; gaps are idle time).")


def link_heatmap(sweep_dir: Path, row, out: Path):
    """Per dimension, the rank x rank matrix of measured bandwidth (log colour scale), with the
    node boundaries drawn, so a slow link or a slow node stands out."""
    from commpipe.report.links import link_rows, node_of_rank, rank_matrices

    run_dir = sweep_dir / row["name"]
    links = link_rows(run_dir)
    nodes = node_of_rank(run_dir)
    world = len(nodes) if nodes else 1 + max((max(lk.get("src", 0), lk.get("dst", 0), *lk.get("group", []))
                                              for lk in links), default=0)
    mats = {d: m for d, m in rank_matrices(links, world).items() if any(v for r in m for v in r)}
    if not mats:
        return None
    values = [v for m in mats.values() for r in m for v in r if v]
    norm = matplotlib.colors.LogNorm(vmin=min(values), vmax=max(max(values), min(values) * 1.01))
    fig, axes = plt.subplots(1, len(mats), figsize=(4.2 * len(mats) + 1.2, 4.0), squeeze=False)
    for ax, (dim, m) in zip(axes[0], mats.items()):
        grid = [[v if v else float("nan") for v in r] for r in m]
        img = ax.imshow(grid, cmap="viridis", norm=norm)
        for i, r in enumerate(m):
            for j, v in enumerate(r):
                if v:
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7,
                            color="white" if norm(v) < 0.5 else "black")
        if nodes:   # lines between nodes
            for b in (k for k in range(1, world) if nodes[k] != nodes[k - 1]):
                ax.axhline(b - 0.5, color="#d62728", lw=1)
                ax.axvline(b - 0.5, color="#d62728", lw=1)
        ax.set_xticks(range(world))
        ax.set_yticks(range(world))
        ax.set_xlabel("to rank" if dim == "pp" else "rank")
        ax.set_ylabel("from rank" if dim == "pp" else "rank")
        ax.set_title(f"{dim.upper()} GB/s" + (" (per message)" if dim == "pp" else " (bus bw)"))
    fig.colorbar(img, ax=axes[0].tolist(), shrink=0.8, label="GB/s")
    name = row.get("label") or row["name"]
    path = out / f"heatmap_{row['name']}.png"
    fig.suptitle(f"{name}: measured bandwidth, rank x rank")
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return (path, f"{name}: measured bandwidth between every pair of ranks, per dimension, over the steps "
            "after warm-up (red lines separate nodes: cells inside a block are intra-node links).")


def make_figures(sweep_dir, rows: list[dict], out_dir=None) -> list[tuple[Path, str]]:
    from commpipe.report.adaptive import adaptive_figure

    sweep_dir = Path(sweep_dir)
    out = Path(out_dir or sweep_dir / "figures")
    out.mkdir(parents=True, exist_ok=True)
    made = [throughput(rows, out), bandwidth(rows, out), pp_latency(rows, out), collective_latency(rows, out),
            throughput_vs_latency(rows, out), loss_curves(sweep_dir, rows, out)]
    for r in rows:
        if r["status"] == "ok":
            made.append(link_heatmap(sweep_dir, r, out))
            made.append(links_over_steps(sweep_dir, r, out))
            made.append(timeline(sweep_dir, r, out))
            made.append(adaptive_figure(sweep_dir, r, out))
    return [m for m in made if m is not None]

