"""Pipeline simulator: runs the same Program as the runtime on a cost table (pure Python)."""

from commpipe.sim.costs import CostTable, parse_costs
from commpipe.sim.engine import SimResult, simulate
from commpipe.sim.export import gantt_png, to_chrome_trace

__all__ = ["CostTable", "SimResult", "simulate", "parse_costs", "to_chrome_trace", "gantt_png"]
