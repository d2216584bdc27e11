"""`commpipe report DIR`: results.csv, report.md, figures/ and a self-contained report.html.

    commpipe sweep --grid demo8 --out runs/demo
    commpipe report runs/demo                 # -> runs/demo/report.html
    commpipe report runs/study --study ../shared/data/study_perlmutter_llama8b.csv

DIR is a sweep folder (sweep.jsonl + one run folder per layout), any folder of `commpipe
train --out` run folders, or one run folder (its monitor, links and timeline summarised alone).
Times are medians over the steps after --warmup. The report opens with findings written from
the measurements (commpipe.report.findings), then the tables, figures and every column.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from commpipe.report.links import CLASS_HEADER, class_table
from commpipe.report.tables import (
    collect,
    flops_unit,
    fmt,
    main_cells,
    main_header,
    markdown_rows,
    markdown_table,
    md_escape,
    read_jsonl,
    terminal_table,
    write_csv,
)


def add_arguments(p) -> None:
    p.add_argument("dir", help="sweep folder, folder of run folders, or one run folder")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians (default 1)")
    p.add_argument("--study", default=None, help="the study's CSV: adds its TFLOP/s beside layouts "
                   "of the same degrees and compares the rankings")
    p.add_argument("--title", default=None)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman rank correlation (no ties assumed beyond average ranks)."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else None


def compare_study(rows: list[dict], study_csv) -> list[str]:
    """Attach the study's TFLOP/s to rows with the same (tp, cp, pp, dp); a note on rankings."""
    with open(study_csv) as f:
        study = {(int(r["tp"]), int(r["cp"]), int(r["pp"]), int(r["dp"])): float(r["tflops_per_gpu"])
                 for r in csv.DictReader(f)}
    pairs = []
    for r in rows:
        key = tuple(int(r.get(k) or 1) for k in ("tp", "cp", "pp", "dp"))
        if key in study:
            r["study_tflops_per_gpu"] = study[key]
            if r["status"] == "ok" and r.get("tflops_per_gpu"):
                pairs.append((r["tflops_per_gpu"], study[key]))
    if not pairs:
        return ["No layout of this sweep matches a study layout."]
    rho = spearman([p[0] for p in pairs], [p[1] for p in pairs])
    return [f"{len(pairs)} layouts match the study's grid; Spearman rank correlation of TFLOP/s/GPU "
            f"with the study: {fmt(rho)} (1 = same ranking)."]


def describe_sweep(root: Path) -> list[str]:
    recs = read_jsonl(root / "sweep.jsonl")
    if not recs:
        return []
    last = recs[-1]
    cluster = last.get("cluster") or {}
    text = f"Cluster: {cluster.get('kind', '?')}"
    if cluster.get("nodes"):
        text += f", {cluster['nodes']} nodes x {cluster.get('ranks_per_node')} ranks"
        rates = cluster.get("inter_node_mbit")
        if rates and any(rates):
            text += f", inter-node links {', '.join(fmt(r) for r in rates)} Mbit/s"
    train = last.get("train") or {}
    return [text + ".", "Training: " + ", ".join(f"{k}={v}" for k, v in train.items()) + "."]


BREAKDOWN_HEADER = ["Layout", "Traced step (ms)", "Compute", "Bubble: wait for stage", "Bubble: idle",
                    "PP exposed", "TP exposed", "CP exposed", "DP exposed", "EP exposed", "Other exposed"]


def breakdown_table(rows: list[dict]) -> list[list[str]]:
    """ms per traced step of each part (commpipe.report.breakdown), with its share."""
    out = []
    for r in rows:
        b = r.get("breakdown")
        if r["status"] != "ok" or not b:
            continue
        w = b["window_ms"] or 1.0
        out.append([r.get("label") or r["name"], fmt(b["window_ms"]),
                    *(f"{fmt(b[k])} ({b[k] / w:.0%})"
                      for k in ("compute", "pp_wait", "idle", "pp", "tp", "cp", "dp", "ep", "other"))])
    return out


DEFINITIONS = [
    "Times are medians over the steps after the first {warmup}; efficiency is throughput relative to the "
    "best layout. PP lat. is transfer time per pipeline call (waiting for the peer excluded), PP wait the "
    "time blocked on the neighbour stage, PP raw their sum, as a timer around the whole call sees it (all "
    "three per call over the same timed calls). Collective bandwidth is nccl-tests bus bandwidth; EP is "
    "expert parallelism's all-to-all (token dispatch and combine), DP includes the expert gradients' "
    "reduction over the ranks holding the same experts. "
    "Bandwidth counts only timed calls of at least 4 KiB: smaller ones (scalar reductions such as the "
    "loss) time the per-call latency, not the link.",
    "Where the time goes: each rank's traced step cut at every event boundary; a piece is compute when an "
    "action runs, exposed communication of a dimension when only that dimension's calls move data or wait "
    "for a late member, bubble when a pipeline call waits for its neighbour stage or nothing runs; mean "
    "over ranks and over the traced steps after the first.",
]


def write_report(sweep_dir, warmup: int = 1, study: str | None = None, title: str | None = None,
                 notes: list[str] = ()) -> dict:
    """Write every report file; returns their paths and the markdown table. notes: statements of
    the caller's own (the adaptive demo's summary), shown in the Notes section."""
    from commpipe.report.adaptive import compare_figure, oracle_figure
    from commpipe.report.adaptive_findings import adaptive_findings
    from commpipe.report.figures import make_figures
    from commpipe.report.findings import findings, loss_finding
    from commpipe.report.html import write_html

    root = Path(sweep_dir)
    rows = collect(root, warmup)
    single = len(rows) == 1 and rows[0].get("dir")
    meta = describe_sweep(root)
    notes = list(notes) + (compare_study(rows, study) if study else [])
    failed = [r for r in rows if r["status"] != "ok"]
    csv_path = write_csv(rows, root / "results.csv")
    table = markdown_table(rows)
    figures = make_figures(root, rows)
    if any(r.get("role") == "adaptive" for r in rows):   # adaptive, static and oracle side by side
        figures = [f for f in (compare_figure(root), oracle_figure(root)) if f] + figures
    title = title or f"commpipe {'run' if single else 'sweep'}: {root.resolve().name}"
    found = adaptive_findings(root, rows) + findings(root, rows, warmup)
    loss = loss_finding(root, rows)
    found += [loss] if loss else []
    definitions = [d.format(warmup=warmup) for d in DEFINITIONS]
    sections = []
    spent = breakdown_table(rows)
    if spent:
        sections.append(("Where the time goes", BREAKDOWN_HEADER, spent))
    classes = class_table(root, rows, warmup)
    if classes:
        sections.append(("Bandwidth by link class", CLASS_HEADER, classes))
    scale, _ = flops_unit(rows)
    # every text from the grid, the logs or the runs is escaped: report.md shows it, never runs it
    md = [f"# {md_escape(title)}", "", *[md_escape(m) + "\n" for m in meta], "## Findings", "",
          *[f"- {md_escape(f)}" for f in found], "",
          "## Layouts", "", markdown_table(rows, main_header(rows), lambda r: main_cells(r, scale)), ""]
    for heading, header, cells in sections:
        md += [f"## {heading}", "", markdown_rows(header, cells), ""]
    if notes:
        md += ["## Notes", "", *map(md_escape, notes), ""]
    if failed:
        md += ["## Failed layouts", ""]
        md += [f"- {md_escape(r.get('label') or r['name'])}: {r['status']}: {md_escape(r.get('reason'))}"
               for r in failed] + [""]
    md += ["## Figures", ""] + [f"![{md_escape(cap).replace('[', '(').replace(']', ')')}]"
                                f"(figures/{Path(p).name})" for p, cap in figures] + [""]
    md += ["## Every column", "", table, "", *[d + "\n" for d in definitions]]
    md_path = root / "report.md"
    md_path.write_text("\n".join(md) + "\n")
    html_path = write_html(root / "report.html", title, rows, figures, notes, sections, findings=found,
                           meta=meta, definitions=definitions)
    (root / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    return {"csv": str(csv_path), "markdown_path": str(md_path), "html": str(html_path),
            "figures": [str(p) for p, _ in figures], "markdown": table, "rows": rows, "findings": found,
            "terminal": terminal_table(rows, report=str(html_path))}


def run(args) -> int:
    out = write_report(args.dir, args.warmup, args.study, args.title)
    print(out["terminal"])
    print(f"\nwrote {out['csv']}, {out['markdown_path']}, {out['html']} ({len(out['figures'])} figures)")
    return 0
