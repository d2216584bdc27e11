"""How a micro-batch's pass splits into a part fixed per micro-batch and a part that grows with it.

An eager pass issues its ops one at a time whatever the micro-batch holds; on a CPU the rank's
one thread issues them and also computes, so a stage's F + B for a micro-batch of b samples is

    ops * op_ms  +  b * work * work_ms        (ops: commpipe.plan.runtime_ops.stage_ops;
                                              work: the family's forward FLOPs per sample)

At small shapes the first term dominates: the adaptive controller's demo model spends ~70% of a
micro-batch's time on it, so a candidate with four times fewer, four times larger micro-batches
runs in well under its FLOPs' share of the time. Neither term is assumed: `measure` times a
real first stage of the model (its embedding and first layer, built by the model's family,
under the trainer's activation meter) forward and backward at two micro-batch sizes, and
solves the two-point line. What the cost model needs is their ratio, `op_work` (the work one
op's issue costs as much time as): contention for the host's cores stretches both terms alike,
so the ratio measured in one process holds in a run whose ranks share cores, where the absolute
times do not.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from functools import lru_cache

from commpipe.monitor.host_load import Span, busy_warning, other_cores

BATCHES = (1, 4)          # the two micro-batch sizes timed
# the probe builds an embedding and a layer: above this many parameters (~200 MB in fp32) it is
# not built. The fixed part is a few hundred ops of a few microseconds a layer; at such sizes a
# layer's GEMMs take 10-100x longer (hidden 2048, 128 tokens: ~13 GFLOP forward), and the
# FLOPs alone price a pass within a few percent.
MAX_PROBE_PARAMS = 5e7
MAX_PASSES_PER_S = 200    # passes of each size per second of budget at most (a tiny model's take
#                           a few ms: the budget, not the count, sets how long the reading spans)
# How long the planner reads the pass. On a 2-vCPU VM the host's speed changes from one second
# to the next: readings of 0.5 s in a row varied by 28% (standard deviation over the mean of the
# pass time they price), of 1.5 s by 12%; a step of a few seconds, or a layout's median over
# several, sees the average of those states, which a longer reading approaches.
PLAN_BUDGET_S = 2.0


@dataclass(frozen=True)
class PassSplit:
    op_ms: float          # ms per counted op (the part of a pass fixed per micro-batch)
    work_ms: float        # ms per unit of forward FLOP work (the part that grows with it)
    other_cores: float | None = None    # cores other processes kept busy meanwhile
    #                                     (commpipe.monitor.host_load; None: not read)

    @property
    def op_work(self) -> float:
        """Units of work one op's issue costs as much time as."""
        return self.op_ms / self.work_ms


def probe_work(spec, seq_len: int, split: tuple[int, ...]) -> float:
    """Forward FLOP work of one sample through stage 0 of `split` (the family's layer costs;
    the head charged to the last layer)."""
    from commpipe.models.family import family_of

    return sum(family_of(spec).layer_costs(spec, seq_len)[:split[0]]) * seq_len


def solve(t_small: float, t_large: float, small: int, large: int, ops: int,
          work: float) -> PassSplit:
    """The two-point line through (small, t_small) and (large, t_large) (ms per pass), as ms
    per op and per unit of work. A slope or intercept that noise drove below zero is kept to a
    hundredth of the pass: each part costs something."""
    slope = (t_large - t_small) / (large - small)
    fixed = t_small - slope * small
    floor = 0.01 * t_small
    return PassSplit(op_ms=max(fixed, floor) / ops, work_ms=max(slope, floor / small) / work)


def probe_params(spec) -> float:
    """Parameters of the probed stage, roughly: the embedding and one layer (attention ~4 h^2,
    a gated MLP ~8 h^2 at the usual widths)."""
    vocab = getattr(spec, "vocab", None) or getattr(spec, "vocab_size", 0)
    return (vocab + 12 * spec.hidden) * spec.hidden


def worth_probing(spec) -> bool:
    """Whether `measure` builds the probe: a shape small enough that its fixed part matters and
    its stage is cheap to build (MAX_PROBE_PARAMS)."""
    return probe_params(spec) <= MAX_PROBE_PARAMS


@lru_cache(maxsize=8)
def measure(spec, seq_len: int, device: str = "cpu", budget_s: float = 0.5,
            threads: int | None = None) -> PassSplit:
    """Time stage 0 (the embedding and first layer) of `spec` forward and backward at micro-
    batches of BATCHES samples of `seq_len` tokens, alternately, for about `budget_s` (at least
    three passes each after one warm-up), and solve for the split. Runs with `threads` threads
    (None: the caller's count) and leaves the global random state as it was."""
    import torch

    if threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure.__wrapped__(spec, seq_len, device, budget_s)
        finally:
            torch.set_num_threads(previous)

    from commpipe.plan.runtime_ops import stage_ops

    split = (1, spec.layers - 1) if spec.layers > 1 else (1,)
    dev = torch.device(device)
    passes = first_stage_pass(spec, seq_len, BATCHES, device)

    def one(b: int) -> float:
        start = time.perf_counter()
        passes(b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - start) * 1e3

    for b in BATCHES:
        one(b)                                    # warm-up: allocations, first dispatch
    span = Span.start()
    times = {b: [] for b in BATCHES}
    end = time.perf_counter() + budget_s
    while min(len(v) for v in times.values()) < 3 or time.perf_counter() < end:
        for b in BATCHES:
            times[b].append(one(b))
        if len(times[BATCHES[0]]) >= max(3, MAX_PASSES_PER_S * budget_s):
            break
    small, large = BATCHES
    found = solve(statistics.median(times[small]), statistics.median(times[large]), small, large,
                  sum(stage_ops(split, 0, "fp32")), probe_work(spec, seq_len, split))
    return replace(found, other_cores=other_cores([span.stop().to_dict()]))


def first_stage_pass(spec, seq_len: int, batches=BATCHES, device: str = "cpu"):
    """A function of a micro-batch size that runs stage 0 of `spec` (its embedding and first
    layer, built by the model's family) forward and backward under the trainer's activation
    meter on a micro-batch of that many samples of `seq_len` tokens (one of `batches`), as a
    rank's pass does. Leaves the global random state as it was."""
    import torch

    from commpipe.models.family import family_of
    from commpipe.runtime.recompute import ActivationMeter

    ranges = [range(0, 1)] + ([range(1, spec.layers)] if spec.layers > 1 else [])
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(0)
        stage = family_of(spec).build_stages(spec, ranges, 0, dev)[0]
        vocab = getattr(spec, "vocab", None) or getattr(spec, "vocab_size", 2)
        inputs = {b: torch.randint(0, vocab, (b, seq_len), device=dev) for b in batches}
    meter = ActivationMeter(list(stage.parameters()), dev)

    def run(b: int) -> None:
        with meter:
            out = stage(inputs[b])
            if isinstance(out, dict):             # a family whose stages pass named tensors
                out = sum(v.float().sum() for v in out.values() if torch.is_tensor(v))
            out.float().sum().backward()

    return run


def measures_pass(spec, job, gpu) -> bool:
    """Whether `with_measured_pass` measures a pass for this model, job and device: a CPU,
    commpipe's runtime in fp32, a family the layer planner prices, a shape worth probing."""
    from commpipe.models.family import layout_planned

    return gpu.name == "cpu" and job.runtime == "commpipe" and job.precision == "fp32" \
        and layout_planned(spec) and worth_probing(spec)


def with_measured_pass(eff, spec, job, gpu):
    """`eff` (commpipe.plan.efficiency.Efficiency) with a CPU's pass of commpipe's runtime measured
    on `spec` itself: `op_s` and `work_s` from `measure` on one thread (a CPU rank's one), the
    seconds per counted op and per unit of forward FLOP work of the model's own first layer.
    The matmul peak and copy rate of `plan.cpu` price a layer as if its GEMMs ran at a large
    square GEMM's rate and its elementwise ops at a large copy's; at the shapes a CPU trains they
    run at a fraction of both, and the micro-benchmark's time per op leaves out the work the
    runtime does around each op of a real layer (the activation meter's hooks on real tensors,
    autograd's graph). Unchanged: a GPU, another framework's runtime, a precision other than
    the probe's fp32, a family the layer planner does not price as commpipe runs it, a shape
    too large to probe (its FLOPs dominate), or an `eff` whose `work_s` is already set."""
    if eff.work_s > 0 or not measures_pass(spec, job, gpu):
        return eff
    split = planned_measure(spec, job.seq_len)
    return replace(eff, op_s=split.op_ms / 1e3, work_s=split.work_ms / 1e3)


def planned_measure(spec, seq_len: int) -> PassSplit:
    """The pass as the planner reads it: on one thread (a CPU rank's one) for PLAN_BUDGET_S;
    cached, so `plan`, its warning and a second estimate in one process share one reading."""
    return measure(spec, seq_len, "cpu", PLAN_BUDGET_S, threads=1)


def describe(eff) -> str | None:
    """The console line of a measured CPU pass (None when `eff` has none): what `plan` and
    `estimate` priced each pass of commpipe's runtime with."""
    if eff.work_s <= 0:
        return None
    return (f"CPU pass measured on the model's first layer (one thread): {eff.op_s * 1e6:.1f} us "
            f"per eager op, its FLOPs at {3 / eff.work_s / 1e9:.1f} GFLOP/s (forward and "
            "backward); a --profile with work_s replaces both")


def busy_note(spec, job, gpu) -> str | None:
    """A warning when `with_measured_pass` measured this model's pass (the cached measurement)
    while other processes kept more than a tenth of the host's cores busy: its rates then read
    slow (commpipe.monitor.host_load). None otherwise, and where no pass is measured."""
    if not measures_pass(spec, job, gpu):
        return None
    split = planned_measure(spec, job.seq_len)
    return busy_warning(split.other_cores, os.cpu_count() or 1, "the CPU pass was measured")
