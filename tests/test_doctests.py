"""The examples in commpipe's docstrings run and print what they show (a docstring's number
that drifted from the code is a wrong statement to a reader)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for p in (ROOT / "commpipe").rglob("*.py") if ">>> " in p.read_text())


def test_some_docstrings_have_examples():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
