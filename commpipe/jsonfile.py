"""Reading user-given JSON files with errors that say which file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

from commpipe.files import read_text


def read_json_object(path: str | Path, what: str, example: str = "") -> dict:
    """The JSON object in `path`; `what` names the file in errors ("probe", "cost")."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} file {p} does not exist")
    try:
        data = json.loads(read_text(p, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {p} must hold a JSON object{' like ' + example if example else ''}")
    return data
