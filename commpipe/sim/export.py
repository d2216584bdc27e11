"""Views of a SimResult: Chrome/Perfetto trace, Gantt PNG, and a text timeline.

matplotlib is imported only inside `gantt_png` (Agg backend), so `commpipe simulate --json`
stays light.
"""

from __future__ import annotations

from pathlib import Path

from commpipe.sim.engine import SimResult
from commpipe.timeline import write_chrome_trace

# F/B/I/W colours: forward blue, full backward green, input-grad orange, weight-grad purple
COLOURS = {"F": "#4c78a8", "B": "#54a24b", "I": "#f58518", "W": "#b279a2"}


def to_chrome_trace(result: SimResult, path) -> Path:
    """Write the predicted timeline as Chrome/Perfetto JSON (same writer as measured runs)."""
    return write_chrome_trace(result.events, path)


def gantt_png(result: SimResult, path, title: str | None = None) -> Path:
    """One row per rank; F/B/I/W coloured; micro-batch numbers where the boxes are wide enough.

    Chunks of interleaved/V schedules are told apart by shade (later chunks lighter). Braided
    and unit actions are drawn unit by unit (a braid's two passes alternate, each in its own
    colour), and TP collectives, when there are any, as a thin black bar under the row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    prog = result.program
    chunk_of = {s: i for r in range(prog.pp) for i, s in enumerate(prog.stages_of(r))}
    fig_w = min(max(8.0, result.makespan * 0.25), 24.0)
    fig, ax = plt.subplots(figsize=(fig_w, 0.45 * prog.pp + 1.4))
    span = result.makespan or 1.0
    min_label = span / (fig_w * 12)            # a box narrower than ~1/12 inch gets no label
    boxes = [(r, prog.actions[r][k], start, end) for r, k, start, end in result._compute
             if not (prog.actions[r][k].is_braid or prog.actions[r][k].unit)]
    boxes += [(r, prog.actions[r][k].parts[j], start, end)
              for r, k, j, _, start, end in result._units]
    for r, a, start, end in boxes:
        alpha = 1.0 - 0.45 * chunk_of.get(a.stage, 0) / max(prog.vpp, 1)
        ax.barh(r, end - start, left=start, height=0.8, color=COLOURS[a.op], alpha=alpha,
                edgecolor="white", linewidth=0.3)
        if end - start >= min_label * len(str(a.microbatch)):
            ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center",
                    fontsize=6, color="white")
    for r, _, start, end in result._tp:
        ax.barh(r + 0.47, end - start, left=start, height=0.12, color="black")
    ax.set_yticks(range(prog.pp), [f"rank {r}" for r in range(prog.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ops = sorted({a.op for _, a, _, _ in boxes}, key="FBIW".index)
    ax.legend(handles=[Patch(color=COLOURS[o], label=o) for o in ops], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(ops), frameon=False)
    ax.set_title(title or f"{prog.name}: pp={prog.pp} m={prog.microbatches} "
                 f"stages={prog.num_stages}  makespan={result.makespan:.3g} "
                 f"bubble={result.bubble_fraction:.1%}"
                 + (f"  tp_bubble={sum(result.tp_bubble) / prog.pp:.3g}" if result._tp else "")
                 + (f"  ep_exposed={sum(result.ep_exposed) / prog.pp:.3g}" if result._ep else ""),
                 fontsize=9, loc="left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def text_timeline(result: SimResult, max_cols: int = 160) -> str | None:
    """Time-aligned rank x action grid (one cell per shortest compute time), or None when it
    would be wider than `max_cols` characters."""
    durs = [e - s for _, _, s, e in result._compute if e > s]
    if not durs:
        return None
    quantum = min(durs)
    prog = result.program
    width = max(len(str(a)) for acts in prog.actions for a in acts if a.is_compute) + 1
    cols = round(result.makespan / quantum)
    if cols * width > max_cols:
        return None
    rows = [["." * width for _ in range(cols)] for _ in range(prog.pp)]
    for r, k, start, end in result._compute:
        c0, c1 = round(start / quantum), round(end / quantum)
        label = str(prog.actions[r][k])
        for c in range(c0, min(c1, cols)):
            rows[r][c] = (label.ljust(width - 1) + " ") if c == c0 else "-" * (width - 1) + " "
    head = f"time unit = {quantum:.3g} ms; '.' = idle, '-' = the action to the left continues"
    return head + "\n" + "\n".join(f"rank {r:<3}" + "".join(row) for r, row in enumerate(rows))
