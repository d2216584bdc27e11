"""One self-contained report.html: the table and every figure embedded as a base64 data URI
(no external files, scripts or styles), so it can be mailed or attached as it is."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from commpipe.report.tables import HEADER, table_cells

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; } td:first-child, td:last-child { text-align: left; }
tr.failed td { color: #b00; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
.notes { font-size: 13px; color: #444; }
"""


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def html_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = []
    for r in rows:
        cls = "" if r["status"] == "ok" else ' class="failed"'
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in table_cells(r)) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def cells_table(header: list[str], cells: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_html(path, title: str, rows: list[dict], figures: list[tuple[Path, str]], notes: list[str],
               sections: list[tuple[str, list[str], list[list[str]]]] = ()) -> Path:
    """sections: extra (heading, header, cells) tables after the layouts table."""
    parts = [
        "<!doctype html>", "<html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<div class='notes'>" + "".join(f"<p>{html.escape(n)}</p>" for n in notes) + "</div>",
        "<h2>Layouts</h2>", html_table(rows),
    ]
    for heading, header, cells in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", cells_table(header, cells)]
    parts.append("<h2>Figures</h2>")
    for fig_path, caption in figures:
        name = Path(fig_path).name
        parts.append(f"<figure id='{html.escape(Path(name).stem)}'><img alt='{html.escape(name)}' "
                     f"src='{data_uri(fig_path)}'><figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    path = Path(path)
    path.write_text("\n".join(parts))
    return path
