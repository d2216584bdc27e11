"""The adaptive suite drawn: one figure of every scenario's outcome against the suite's goals,
each adaptive run's step time with its detections, switches and re-checks
(commpipe.report.adaptive.step_time_figure), and OUT/suite.md that shows them with the table.

    python benchmarks/adaptive_suite.py --out DIR --json F            # draws after the run
    python benchmarks/adaptive_suite.py --out DIR --json F --reuse    # draws F's results again
"""

from __future__ import annotations

from pathlib import Path

# the suite's goals (issue text in docs/adaptive.md, "The scenario suite")
RECOVER_GOAL = {"link-2x": 0.7, "link-5x": 0.7, "slow-1.5x": 0.6}
DETECT_GOAL = 5


def outcome_figure(results: list[dict], out_png: Path) -> Path:
    """Left: the recovered share of each fault scenario, over the faulty period and after the
    reaction settled, with the goals marked. Right: steps from the fault to its detection
    (goal: 5) and the false switches of each scenario (goal: none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [r for r in results if r.get("fault_steps")]
    names = [r["scenario"] for r in faults]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    y = range(len(faults))
    whole = [r.get("recovered") or 0.0 for r in faults]
    settled = [r.get("recovered_settled") or 0.0 for r in faults]
    left.barh([i + 0.2 for i in y], whole, height=0.4, color="#1f77b4", label="faulty period")
    left.barh([i - 0.2 for i in y], settled, height=0.4, color="#aec7e8", label="after settling")
    for i, r in enumerate(faults):
        goal = RECOVER_GOAL.get(r["scenario"])
        if goal is not None:
            left.plot([goal, goal], [i - 0.45, i + 0.45], color="#d62728", lw=2)
    left.axvline(1.0, color="#7f7f7f", lw=0.8, ls=":")
    left.set_yticks(list(y), names)
    left.invert_yaxis()
    left.set_xlabel("recovered share (T_static - T_adaptive) / (T_static - T_best)")
    left.set_title("recovered (red: goal)", fontsize=10)
    left.legend(fontsize=7, loc="lower right")
    everyone = [r for r in results if "false_switches" in r]
    labels = [r["scenario"] + (f" #{r['repeat']}" if r.get("repeat") else "") for r in everyone]
    detect = [r.get("detect_steps") for r in everyone]
    yy = range(len(everyone))
    right.barh(list(yy), [d or 0 for d in detect], color="#2ca02c", height=0.6)
    right.axvline(DETECT_GOAL, color="#d62728", lw=1.5, ls="--")
    for i, r in enumerate(everyone):
        if r["false_switches"]:
            right.text(0.2, i, f"{r['false_switches']} false switch"
                       f"{'es' if r['false_switches'] > 1 else ''}", va="center", color="#d62728",
                       fontsize=8)
        elif detect[i] is None:
            right.text(0.2, i, "no switch (none due)" if not r.get("fault_steps") else "not detected",
                       va="center", color="#7f7f7f", fontsize=8)
    right.set_yticks(list(yy), labels)
    right.invert_yaxis()
    right.set_xlabel("steps from the fault to its detection")
    right.set_title(f"detection (red dashed: goal {DETECT_GOAL}) and false switches", fontsize=10)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def adaptive_runs(out: Path) -> list[Path]:
    """Every adaptive run folder of a suite's output (one per scenario, three for the repeated
    ones)."""
    return sorted(p for p in out.glob("*/adaptive*") if (p / "metrics.jsonl").exists())


def write_suite_page(results: list[dict], table: str, out: Path) -> Path:
    """OUT/suite.md: the table, the outcome figure, and each adaptive run's step-time figure."""
    from commpipe.report.adaptive import step_time_figure

    lines = ["# Adaptive suite", "", "```", table, "```", "",
             f"![outcome]({outcome_figure(results, out / 'suite.png').name})", ""]
    for run in adaptive_runs(out):
        drawn = step_time_figure(run, out / f"{run.parent.name}-{run.name}.png",
                                 title=f"{run.parent.name} ({run.name})")
        if drawn:
            png, caption = drawn
            lines += [f"## {run.parent.name}, {run.name}", "", f"![{run.parent.name}]({png.name})",
                      "", caption, ""]
    page = out / "suite.md"
    page.write_text("\n".join(lines))
    return page
