"""`--comm-monitor off|sample=F|all` parsing (no torch import, so CLIs can validate early)."""

from __future__ import annotations


def parse_monitor_flag(text: str) -> float | None:
    """The sampled fraction of calls the monitor times, or None when the monitor is off.

    "off" (also "none") -> None; "all" -> 1.0; "sample=F" (or a bare F) with 0 < F <= 1 -> F.
    Counts and bytes of every call are tallied whatever the fraction; F only sets how many
    calls are timed.
    """
    raw = str(text)
    t = raw.strip().lower()
    if t in ("off", "none"):
        return None
    if t == "all":
        return 1.0
    value = t.split("=", 1)[1] if t.startswith("sample=") else t
    try:
        frac = float(value)
    except ValueError:
        frac = float("nan")
    if 0.0 < frac <= 1.0:
        return frac
    raise ValueError(f"--comm-monitor {raw!r}: use off, all, or sample=F with 0 < F <= 1 "
                     "(e.g. sample=0.1 times one call in ten)")
