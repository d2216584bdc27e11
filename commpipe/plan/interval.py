"""The prediction interval `plan` and `estimate` print: how far published runs the planner
never saw landed from its predictions.

The quantiles are of measured / predicted throughput over every row of
benchmarks/data/public_runs.csv, each source held out (the GPU defaults, efficiency.MEASURED_GPU,
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
RATIO_QUANTILES = {10: 0.8883, 50: 0.9423, 90: 1.0704}
ROWS = 42
SOURCES = 6
# -- end


# Measured over predicted *step time* of commpipe on CPU ranks: every tp x cp x pp x dp layout of 4
# and 8 ranks of a 2-core machine, local and on the emulated cluster at 50 and 500 Mbit/s, priced
# by `estimate` from a probe, the cores left to the ranks, and each pass at the rates measured on
# the model's first layer, each set's gloo calls from its own probe (docs/planner.md, "The
# prediction interval"; the runs: benchmarks/results/planner_runs.md, "Ninth session": three runs
# of every set, hours apart, pooled, so that
# how far one reading of the pass rates lands from the speed the runs see is inside the interval).
# Regenerate:
#     python benchmarks/planner_rank.py --reuse --write-interval --pool EARLIER_OUT
# -- begin: written by benchmarks/planner_rank.py --write-interval
CPU_STEP_QUANTILES = {10: 0.9028, 50: 1.1487, 90: 1.5255}
CPU_LAYOUTS = 225
# -- end


def step_time_factors(on_cpu: bool) -> tuple[float, float]:
    """(low, high): the 80% interval of measured over predicted step time, as factors; a step
    predicted at t takes between t * low and t * high four times in five. On GPUs from the
    throughput quantiles above (step time is its inverse), on CPU ranks from CPU_STEP_QUANTILES.

    >>> low, high = step_time_factors(on_cpu=False)
    >>> round(low * RATIO_QUANTILES[90], 9) == 1.0
    True
    """
    if on_cpu:
        return CPU_STEP_QUANTILES[10], CPU_STEP_QUANTILES[90]
    return 1.0 / RATIO_QUANTILES[90], 1.0 / RATIO_QUANTILES[10]


def interval(value: float) -> tuple[float, float]:
    """(low, high) of a predicted throughput (TFLOP/s, tokens/s: anything proportional)."""
    return value * RATIO_QUANTILES[10], value * RATIO_QUANTILES[90]


# Measured over predicted throughput on published Mixture-of-Experts runs (Megatron-Core's Mixtral
# 8x7B in bf16, Megatron-Bridge 25.11's FP8 MoE rows: docs/moe.md), too few for quantiles: a MoE
# estimate carries their whole range instead of the dense runs' 80% interval. Regenerate:
#     python benchmarks/plan_moe_public.py --write-interval
# -- begin: written by benchmarks/plan_moe_public.py --write-interval
MOE_RATIO_RANGE = (0.6369, 1.1083)
MOE_ROWS = 9
# -- end


def interval_dict(tflops: float, moe: bool = False) -> dict:
    """What --json carries: the interval of TFLOP/s per GPU, and where it comes from. For a MoE
    model: the whole range measured/predicted took on the published MoE runs (no `level`;
    `range_of_published_moe_runs` true), which the dense runs' interval does not describe."""
    if moe:
        lo, hi = MOE_RATIO_RANGE
        return {"range_of_published_moe_runs": True, "tflops_per_gpu_low": tflops * lo,
                "tflops_per_gpu_high": tflops * hi, "from_public_rows": MOE_ROWS}
    lo, hi = interval(tflops)
    return {"level": LEVEL / 100, "tflops_per_gpu_low": lo, "tflops_per_gpu_high": hi,
            "from_public_rows": ROWS}


def describe(tflops: float) -> str:
    lo, hi = interval(tflops)
    return f"{tflops:.0f} TFLOP/s, {LEVEL}% interval {lo:.0f}-{hi:.0f}"


# Measured over predicted step time of the adaptive controller's candidates, relative to the
# other candidates of the same trial phase (each trial's ratio over the phase's median ratio):
# the model is calibrated on the run itself, so what ranks candidates is this relative error,
# not the planner's error from scratch. From the trial records of a full adaptive suite run on
# a CPU (docs/adaptive.md). Regenerate after a change to commpipe.adapt.model:
#     python benchmarks/adaptive_suite.py --out DIR --write-interval
# -- begin: written by benchmarks/adaptive_suite.py --write-interval
TRIAL_QUANTILES = {10: 0.8894, 50: 1.0, 90: 1.1094}
TRIALS = 25
# -- end


def trial_factors(on_cpu: bool) -> tuple[float, float]:
    """(low, high): the 80% interval of a candidate's measured over predicted step time relative
    to the other candidates the adaptive controller trials with it. On CPU ranks from the
    suite's trials (TRIAL_QUANTILES); on GPUs, where no suite has run, the planner's interval
    of measured over predicted step time (`step_time_factors`), which is wider.

    >>> trial_factors(on_cpu=False) == step_time_factors(on_cpu=False)
    True
    """
    if on_cpu:
        return TRIAL_QUANTILES[10], TRIAL_QUANTILES[90]
    return step_time_factors(on_cpu=False)
