"""Rewrite one generated block of commpipe/plan/interval.py: the quantiles a benchmark measured.

Each block sits between "# -- begin: written by benchmarks/<script> --write-interval" and the
next "# -- end"; everything outside it stays as it is.
"""

from __future__ import annotations

from pathlib import Path

INTERVAL_PY = Path(__file__).resolve().parents[1] / "commpipe" / "plan" / "interval.py"
END = "# -- end"


def write_block(script: str, body: str) -> Path:
    """Replace the block `script` (e.g. "plan_public.py") writes with `body` (Python lines)."""
    begin = f"# -- begin: written by benchmarks/{script} --write-interval"
    text = INTERVAL_PY.read_text()
    start = text.index(begin) + len(begin)
    end = text.index(END, start)
    INTERVAL_PY.write_text(f"{text[:start]}\n{body.rstrip()}\n{text[end:]}")
    return INTERVAL_PY
