"""One self-contained report.html: findings first, a table of contents, a short table of the
layouts, then the breakdowns, links, figures and every column, with each figure embedded as a
base64 data URI (no external files, scripts or styles), so it can be mailed or attached as it is."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from commpipe.report.tables import HEADER, flops_unit, main_cells, main_header, table_cells

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222;
       padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.meta { font-size: 13px; color: #666; margin: 0 0 1em 0; }
.findings { background: #f6f9fd; border-left: 4px solid #3a5a98; padding: 0.6em 1.2em; }
.findings li { margin: 0.35em 0; line-height: 1.4; }
nav { font-size: 14px; margin: 1em 0; } nav a { margin-right: 1.2em; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; } td:first-child { text-align: left; }
td.text { text-align: left; white-space: normal; max-width: 28em; }
tr.failed td { color: #b00; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
.notes { font-size: 13px; color: #444; }
"""


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _row_html(cells: list[str], failed: bool = False, text_last: bool = False) -> str:
    tds = []
    for i, c in enumerate(cells):
        cls = " class='text'" if text_last and i == len(cells) - 1 else ""
        tds.append(f"<td{cls}>{html.escape(c)}</td>")
    return ("<tr class='failed'>" if failed else "<tr>") + "".join(tds) + "</tr>"


def cells_table(header: list[str], cells: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(_row_html(row) for row in cells)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def html_table(rows: list[dict]) -> str:
    """Every column of every layout (the details table; scrolls sideways)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join(_row_html(table_cells(r), r["status"] != "ok", True) for r in rows)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def main_table(rows: list[dict]) -> str:
    scale, _ = flops_unit(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in main_header(rows))
    body = "".join(_row_html(main_cells(r, scale), r["status"] != "ok", True) for r in rows)
    return f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _anchor(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def layouts_caption(rows: list[dict], anchors: set[str]) -> str:
    """The note under the layouts table, linking only to sections the page has."""
    spent = _anchor("Where the time goes")
    text = ("Compute, bubble and exposed communication: shares of the traced step (see "
            f"<a href='#{spent}'>where the time goes</a>)" if spent in anchors else
            "Compute, bubble and exposed communication: shares of the traced step (none here: train "
            "with --trace to record a timeline)")
    text += "; every measured column is in <a href='#details'>every column</a>."
    if any(r.get("role") for r in rows):
        text += (" Step (ms) is a median over each whole run: the adaptive and static runs span the "
                 "fault and the adaptive one several layouts, so the findings compare them over the "
                 "faulty steps.")
    return text


def write_html(path, title: str, rows: list[dict], figures: list[tuple[Path, str]], notes: list[str],
               sections: list[tuple[str, list[str], list[list[str]]]] = (), findings: list[str] | None = None,
               meta: list[str] = (), definitions: list[str] = ()) -> Path:
    """findings: the opening statements (computed from the folder of `path` when None);
    meta: one-line configuration under the title; notes: a section of further statements;
    sections: extra (heading, header, cells) tables after the layouts table;
    definitions: how the columns are measured, under the details table."""
    path = Path(path)
    if findings is None:
        from commpipe.report.adaptive_findings import adaptive_findings
        from commpipe.report.findings import findings as compute_findings
        from commpipe.report.findings import loss_finding

        findings = adaptive_findings(path.parent, rows) + compute_findings(path.parent, rows)
        loss = loss_finding(path.parent, rows)
        findings += [loss] if loss else []
    toc = [("Findings", "findings"), ("Layouts", "layouts")]
    toc += [(h, _anchor(h)) for h, _, _ in sections]
    if notes:
        toc.append(("Notes", "notes"))
    toc += [("Figures", "figures"), ("Every column", "details")]
    parts = [
        "<!doctype html>", "<html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *(f"<p class='meta'>{html.escape(m)}</p>" for m in meta),
        "<h2 id='findings'>Findings</h2>",
        "<ul class='findings'>" + "".join(f"<li>{html.escape(f)}</li>" for f in findings) + "</ul>",
        "<nav>Contents: " + "".join(f"<a href='#{a}'>{html.escape(t)}</a>" for t, a in toc) + "</nav>",
        "<h2 id='layouts'>Layouts</h2>", main_table(rows),
        f"<p class='notes'>{layouts_caption(rows, {a for _, a in toc})}</p>",
    ]
    for heading, header, cells in sections:
        parts += [f"<h2 id='{_anchor(heading)}'>{html.escape(heading)}</h2>", cells_table(header, cells)]
    if notes:
        parts += ["<h2 id='notes'>Notes</h2>",
                  "<div class='notes'>" + "".join(f"<p>{html.escape(n)}</p>" for n in notes) + "</div>"]
    parts.append("<h2 id='figures'>Figures</h2>")
    for fig_path, caption in figures:
        name = Path(fig_path).name
        parts.append(f"<figure id='{html.escape(Path(name).stem)}'><img alt='{html.escape(name)}' "
                     f"src='{data_uri(fig_path)}'><figcaption>{html.escape(caption)}</figcaption></figure>")
    parts += ["<h2 id='details'>Every column</h2>", html_table(rows),
              "<div class='notes'>" + "".join(f"<p>{html.escape(d)}</p>" for d in definitions) + "</div>",
              "</body></html>"]
    path.write_text("\n".join(parts))
    return path
