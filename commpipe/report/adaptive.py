"""Figures of adaptive runs (`commpipe train --adapt`): step time over steps with the degrade,
the detections and the switches marked, and the layout in use shaded.

A run folder is adaptive when it holds adapt.jsonl. The degrade step is read from the run's
--slow-rank drill (config.json) or from a scenario.json beside or above the run folder
(`commpipe demo --adaptive`).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from commpipe.report.tables import read_jsonl, run_path  # noqa: E402

SHADES = ("#f2f2f2", "#dfeaf5", "#fbe9d7", "#e3f1e0", "#efe3f3")


def degrade_steps(run: Path) -> list[tuple[int, str]]:
    """(step, label) of the injected faults this run knows about."""
    marks = []
    cfg_path = run / "config.json"
    if cfg_path.exists():
        slow = json.loads(cfg_path.read_text()).get("slow_rank")
        if isinstance(slow, dict):
            marks.append((slow["step"], f"rank {slow['rank']} x{slow['factor']:g} slower"))
    for path in (run / "scenario.json", run.parent / "scenario.json"):
        if path.exists():
            sc = json.loads(path.read_text())
            if sc.get("degrade_step") is not None:
                marks.append((sc["degrade_step"], f"degrade {sc.get('link', '')}".strip()))
            blip = sc.get("blip_steps") or []
            if blip:
                marks.append((blip[0], f"blip ({len(blip)} step{'s' if len(blip) != 1 else ''})"))
            break
    return marks


def step_time_figure(run, out_png, title: str | None = None):
    """Step time over steps of one adaptive or elastic run (the restarts marked:
    commpipe.report.elastic); returns (path, caption) or None."""
    from commpipe.report.elastic import draw_marks, elastic_marks

    run = Path(run)
    metrics = read_jsonl(run / "metrics.jsonl")
    decisions = read_jsonl(run / "adapt.jsonl")
    restarts = elastic_marks(run)
    if not metrics or not ((run / "adapt.jsonl").exists() or restarts):
        return None
    steps = [m["step"] for m in metrics]
    ms = [m["step_time_s"] * 1e3 for m in metrics]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    # the layout in use: shaded spans, labelled once
    spans, start = [], 0
    for i in range(1, len(metrics) + 1):
        if i == len(metrics) or metrics[i].get("layout") != metrics[start].get("layout"):
            spans.append((steps[start], steps[i - 1], metrics[start].get("layout") or "?"))
            start = i
    for j, (a, b, label) in enumerate(spans):
        ax.axvspan(a - 0.5, b + 0.5, color=SHADES[j % len(SHADES)], zorder=0, label=label)
    ax.plot(steps, ms, color="#1f77b4", lw=1.2, zorder=2)
    for step, label in degrade_steps(run):
        ax.axvline(step, color="#d62728", ls="--", lw=1, zorder=3)
        ax.text(step, 0.98, " " + label, transform=ax.get_xaxis_transform(), color="#d62728",
                fontsize=8, va="top")
    for d in decisions:
        if d.get("action") == "trial":
            if d.get("dropped"):       # candidates the trial's measurement ruled out untried
                ax.text(d["step"], 0.90, f" dropped {len(d['dropped'])}",
                        transform=ax.get_xaxis_transform(), color="#7f7f7f", fontsize=7)
            continue
        if d.get("action") not in ("stay", "switch"):
            continue
        color = "#2ca02c" if d["action"] == "switch" else "#7f7f7f"
        ax.axvline(d["step"], color=color, lw=1.5 if d["action"] == "switch" else 0.8,
                   ls="-." if d.get("recheck") else "-" if d["action"] == "switch" else ":",
                   zorder=3)
        if d["action"] == "switch" or d.get("recheck"):
            text = ", ".join((["re-check"] if d.get("recheck") else [])
                             + ([f"switch ({d.get('switch_time_s', 0):.2f} s)"]
                                if d["action"] == "switch" else []))
            ax.text(d["step"], 0.02 if d["action"] == "switch" else 0.08, " " + text,
                    transform=ax.get_xaxis_transform(), color=color, fontsize=8)
    draw_marks(ax, restarts)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    adaptive = (run / "adapt.jsonl").exists()
    ax.set_title(title or (f"{run.name}: step time, detections (dotted: stay, green: switch, "
                           "dash-dot: re-check)"
                           if adaptive else f"{run.name}: step time, restarts"))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=7, frameon=False,
              title="layout in use", title_fontsize=7)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    n_switch = sum(d.get("action") == "switch" for d in decisions)
    n_recheck = sum(bool(d.get("recheck")) for d in decisions)
    if not adaptive:
        return out_png, (f"{run.name}: step time over steps; dashed: where the job stopped (red: "
                         "a lost node or rank, grey: a node joining), solid: where it resumed "
                         "(orange: on the ranks that remain, green: grown back); steps after a "
                         "dashed line that a solid one precedes were run again; shading: layout.")
    return out_png, (f"{run.name}: step time over steps; red dashed: injected degrade, dotted: "
                     f"evaluations that stayed, green: switches ({n_switch}); dash-dotted: re-checks of a "
                     f"plan on its own baselines ({n_recheck}); \"dropped N\": candidates a trial "
                     "ruled out untried; shading: layout in use.")


def adaptive_figure(sweep_dir, row: dict, out: Path):
    """make_figures hook: the figure of one run of a report folder, if it is adaptive."""
    run = run_path(sweep_dir, row)
    return step_time_figure(run, Path(out) / f"adapt_{row['name']}.png")


def compare_figure(out_dir, runs=("adaptive", "static", "oracle"), out_png=None):
    """Step time over steps of several runs of one scenario on one axis (the adaptive demo)."""
    out_dir = Path(out_dir)
    found = [(name, read_jsonl(out_dir / name / "metrics.jsonl")) for name in runs]
    found = [(n, m) for n, m in found if m]
    if not found:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.8))
    colors = {"adaptive": "#2ca02c", "static": "#d62728", "oracle": "#7f7f7f"}
    oracle = _read_json(out_dir / "oracle" / "candidates.json")
    for name, rows in found:
        label = name
        if name == "oracle" and oracle:
            label = f"oracle ({oracle['best']['name']}, from step 0)"
        ax.plot([r["step"] for r in rows], [r["step_time_s"] * 1e3 for r in rows], lw=1.3,
                label=label, color=colors.get(name))
    if oracle:   # its median, across the whole run for comparison
        ax.axhline(oracle["best"]["median_ms"], color=colors["oracle"], ls=":", lw=1,
                   label=f"oracle median {oracle['best']['median_ms']:.0f} ms")
    for step, label in degrade_steps(out_dir / found[0][0]):
        ax.axvline(step, color="#d62728", ls="--", lw=1)
        ax.text(step, 0.98, " " + label, transform=ax.get_xaxis_transform(), color="#d62728",
                fontsize=8, va="top")
    for d in read_jsonl(out_dir / "adaptive" / "adapt.jsonl"):
        if d.get("action") == "switch":
            ax.axvline(d["step"], color="#2ca02c", lw=1.5)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, log)")
    ax.set_title("adaptive vs static vs oracle")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png or out_dir / "figures" / "adaptive_vs_static.png")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png, ("Step time of the adaptive run, the same scenario without the controller "
                     "(static) and the oracle (the fastest static layout measured under the "
                     "degraded link from step 0; dotted: its median); red dashed: injected blip "
                     "and degrade, green: switch.")


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def plan_key(plan: dict) -> tuple:
    return tuple(plan[k] for k in ("tp", "cp", "pp", "dp")) + (tuple(plan["stage_layers"]),)


def settled_layout(decisions: list[dict]) -> dict | None:
    """The plan the decision log ends on: the `to` of the last `settle`, or of the last switch
    that started no trial phase (a trial target is not a choice; a trial phase the run's end cut
    short leaves the plan before it). None when the controller never switched."""
    settled = None
    for d in decisions:
        if d.get("action") == "settle" or (d.get("action") == "switch" and not d.get("trial_plans")):
            settled = d.get("to") or settled
    return settled


CHOSEN, ORACLE, OTHER = "#2ca02c", "#7f7f7f", "#9ecae1"


def candidate_colors(cands: list[dict], chosen: dict | None) -> list[str]:
    """Bar colours of the oracle figure: the settled layout green, the oracle (first) grey."""
    key = plan_key(chosen) if chosen else None
    return [CHOSEN if key is not None and plan_key(c) == key else ORACLE if i == 0 else OTHER
            for i, c in enumerate(cands)]


def plan_label(plan: dict) -> str:
    """TP1/CP1/PP2/DP2 [2,2]: a plan as the report's tables name layouts, with its layer split."""
    text = f"TP{plan['tp']}/CP{plan['cp']}/PP{plan['pp']}" + (f"/DP{plan['dp']}" if plan["dp"] > 1 else "")
    layers = plan.get("stage_layers")
    return text + (f" [{','.join(map(str, layers))}]" if layers and plan["pp"] > 1 else "")


def adaptive_label(run: Path, name: str) -> str | None:
    """The row label of an adaptive run: the layout it started with and the one it settled on."""
    decisions = read_jsonl(run / "adapt.jsonl")
    first = next((d["from"] for d in decisions if d.get("from")), None)
    settled = settled_layout(decisions)
    if first is None or settled is None:
        return None if first is None else f"{name}: {plan_label(first)}, no switch"
    return f"{name}: {plan_label(first)} → {plan_label(settled)}"


# The runs of an adaptive demo folder (`commpipe demo --adaptive`) beside the adaptive one: the
# start layout kept through the fault, and the best static layout under the degraded network.
ROLES = {"static": "static", "oracle": "best static (oracle)"}


def mark_roles(root, rows: list[dict]) -> None:
    """Give each row of a folder with an adaptive run its role ("adaptive", "static", "oracle"),
    and the static and oracle rows labels that say so ("static: TP1/CP1/PP1/DP4"). A folder
    without an adaptive run keeps its rows as they are: every row is one more layout."""
    adaptive = [r for r in rows if (run_path(root, r) / "adapt.jsonl").exists()]
    if not adaptive:
        return
    for r in adaptive:
        r["role"] = "adaptive"
    for r in rows:
        if r["name"] in ROLES and r not in adaptive:
            r["role"] = r["name"]
            r["label"] = f"{ROLES[r['name']]}: {r.get('label') or r['name']}"


def oracle_figure(out_dir, out_png=None):
    """Median step time of every static layout the oracle sweep measured (candidates.json),
    the controller's choice marked; returns (path, caption) or None."""
    out_dir = Path(out_dir)
    rec = _read_json(out_dir / "oracle" / "candidates.json")
    if not rec or not rec.get("candidates"):
        return None
    cands = rec["candidates"]
    chosen = settled_layout(read_jsonl(out_dir / "adaptive" / "adapt.jsonl"))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(cands) + 1.2))
    names = [f"{c['name']} [{','.join(map(str, c['stage_layers']))}]" for c in cands]
    colors = candidate_colors(cands, chosen)
    ax.barh(names, [c["median_ms"] for c in cands], color=colors)
    for i, c in enumerate(cands):
        note = " (stopped early)" if c.get("stopped_early") else ""
        ax.text(c["median_ms"], i, f" {c['median_ms']:.0f} ms{note}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("median step time under the degraded link (ms, log)")
    ax.set_title("oracle sweep: every static layout, degraded network from step 0")
    fig.tight_layout()
    out_png = Path(out_png or out_dir / "figures" / "oracle_candidates.png")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png, (f"Oracle sweep: median step time of each static layout ({rec['steps']} steps "
                     f"from step 0, the first {rec['warmup']} left out) under the degraded link; "
                     "the fastest (top, grey) is the oracle; green: the layout the controller settled on. A "
                     "layout clearly slower than the best so far stopped after "
                     f"{rec['min_steps']} steps.")
