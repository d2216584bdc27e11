"""The prediction interval `plan` and `estimate` print: how far published runs the planner
never saw landed from its predictions.

The quantiles are of measured / predicted throughput over every row of
benchmarks/data/public_runs.csv, each source held out (the GPU defaults, timing.MEASURED_GPU,
are fitted on vTrain's measured A100 runs, none of them a public row), priced from user-level
inputs and the source's --framework preset. Regenerate after a change to the cost model:

    python benchmarks/plan_public.py --no-free --write-interval

    >>> lo, hi = interval(100.0)
    >>> lo < hi
    True
"""

from __future__ import annotations

LEVEL = 80      # the interval spans the 10th to the 90th percentile

# -- begin: written by benchmarks/plan_public.py --write-interval
RATIO_QUANTILES = {10: 0.8618, 50: 0.9207, 90: 1.0444}
ROWS = 32
SOURCES = 5
# -- end


def interval(value: float) -> tuple[float, float]:
    """(low, high) of a predicted throughput (TFLOP/s, tokens/s: anything proportional)."""
    return value * RATIO_QUANTILES[10], value * RATIO_QUANTILES[90]


def interval_dict(tflops: float) -> dict:
    """What --json carries: the interval of TFLOP/s per GPU, and where it comes from."""
    lo, hi = interval(tflops)
    return {"level": LEVEL / 100, "tflops_per_gpu_low": lo, "tflops_per_gpu_high": hi,
            "from_public_rows": ROWS}


def describe(tflops: float) -> str:
    lo, hi = interval(tflops)
    return f"{tflops:.0f} TFLOP/s, {LEVEL}% interval {lo:.0f}-{hi:.0f}"
