"""Executes schedule Programs on real stage modules (see executor.py)."""
