"""Where an elastic run stopped, resumed and grew back, for the step-time figure.

A run folder's restarts.jsonl holds one record per resume (commpipe.train.run_files): the step
it resumed at, the steps run again (moved to metrics.replaced.jsonl) and the world before it
stopped; metrics.jsonl holds the world each step ran on. From these:

    lost        at the step in flight when the job stopped (the last step run again + 1, else
                the resumed step): the world after is not larger
    resumed     at the resumed step, on a world not larger than before (a lost node, a hung
                rank ended and restarted)
    stopped     the step in flight when a returning node stopped the job (world after larger)
    regrown     at the resumed step, on the larger world
"""

from __future__ import annotations

import re
from pathlib import Path

from commpipe.report.tables import read_jsonl

COLORS = {"lost": "#d62728", "resumed": "#ff7f0e", "stopped": "#7f7f7f", "regrown": "#2ca02c"}


def world_of(rec: dict) -> int:
    return rec.get("tp", 1) * rec.get("cp", 1) * rec.get("pp", 1) * rec.get("dp", 1)


def elastic_marks(run) -> list[tuple[int, str, str]]:
    """[(step, kind, label)] of the run's restarts, in the order they happened; kind is one of
    COLORS. Empty for a run that never resumed."""
    run = Path(run)
    by_step = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "step" in r}
    marks = []
    for rec in read_jsonl(run / "restarts.jsonl"):
        step, replaced = rec["step"], rec.get("replaced")
        after = by_step.get(step)
        if after is None:                      # resumed and ended without a step
            continue
        world, before = world_of(after), rec.get("world_before")
        grew = before is not None and world > before
        stop = replaced[1] + 1 if replaced else step
        again = "" if not replaced else (f", step {replaced[0]} run again" if replaced[0] ==
                                         replaced[1] else f", steps {replaced[0]}-{replaced[1]} run again")
        if grew:
            marks.append((stop, "stopped", f"node joined at step {stop}"))
            marks.append((step, "regrown", f"{world} ranks ({after.get('layout')})"))
        else:
            marks.append((stop, "lost", f"lost at step {stop}{again}"))
            marks.append((step, "resumed", f"resumed on {world} ranks ({after.get('layout')})"))
    return marks


SHORT = {"lost": "lost", "stopped": "node joins"}


def draw_marks(ax, marks) -> None:
    """Vertical lines with short labels on a step axis: dashed where the job stopped, solid
    where it resumed (the world it resumed on); labels step down so neighbours do not overlap."""
    for i, (step, kind, label) in enumerate(marks):
        stopped = kind in ("lost", "stopped")
        ranks = re.search(r"(\d+) ranks", label)
        text = SHORT.get(kind) or (f"{ranks.group(1)} ranks" if ranks else kind)
        ax.axvline(step, color=COLORS[kind], ls="--" if stopped else "-", lw=1.3, zorder=3)
        ax.text(step, 0.97 - 0.09 * (i % 4), " " + text, color=COLORS[kind], fontsize=8,
                va="top", transform=ax.get_xaxis_transform(), zorder=4)
