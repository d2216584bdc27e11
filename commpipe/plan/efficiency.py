"""The compute-efficiency constants the planner prices with, and their defaults per device.

`Efficiency` holds the calibratable constants (commpipe.plan.compute says what each prices;
commpipe.plan.calibrate fits them); `MEASURED_GPU` is the GPU default measured on vTrain's runs;
`default_efficiency` picks the default for a GPU or a CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Efficiency:
    """Calibratable compute-efficiency parameters (see module docstring)."""

    e_max: float = 0.92           # fraction of the GPU's achievable matmul rate (MAMF, gpus.py) a
                                  # large GEMM of the model reaches: 0.8 of the A100's peak, the
                                  # former default, is 0.92 of its MAMF (0.869); at most 1
    ai_half_ridge: float = 0.5    # intensity at half efficiency, in units of the ridge point
    attn_rel: float = 0.8         # flash-attention efficiency relative to e_max
    elementwise: float = 1.0      # HBM bytes of non-GEMM ops per stored activation byte
    overhead_s: float = 20e-6     # per layer and pass (tens of kernel launches at ~1 us)
    coll_overhead_s: float = 0.0  # host time per collective call
    optimizer_overhead_s: float = 0.0   # host time per layer held, per optimizer step
    wake_s: float = 0.0           # per blocking wait per unit of host contention (plan.host)
    fp8_rel: float = 1.0          # FP8 GEMM efficiency relative to e_max (see FP8 below)
    op_s: float = 0.0             # host seconds per eager op of commpipe's own runtime, measured
                                  # (plan.cpu.measure_op_seconds; runtime_ops.py); 0: not priced
    work_s: float = 0.0           # a CPU's seconds of a layer's forward and backward per unit of
                                  # its forward FLOPs, measured on the model's own first layer
                                  # (plan.pass_split.with_measured_pass); 0: the GEMM curve

    def to_dict(self) -> dict:
        return asdict(self)


# The GPU defaults: the four constants `plan --calibrate` fits (calibrate.fit, trust-region least
# squares on log step time) on vTrain's 109 measured iteration times (GPT 3.6B-175B, 64-512 A100,
# Megatron-DeepSpeed, full recompute; MICRO 2024, data/ground_truth_multi.csv), no public run
# among them; in-sample MAPE 16.5% untuned -> 8.6%. Reproduce: benchmarks/plan_public.py prints
# the refit beside these. The GEMM curve reaches half its e_max at 2.74x the ridge intensity, not
# 0.5x: an H100 GEMM of M=4096, K=2048, N=6144 (intensity 4.7x the ridge) runs at 0.63 of MAMF,
# not 0.83 (docs/planner.md, "Validation on public runs"). `overhead_s` (0.67 ms per layer and
# pass) is the measured fixed cost of a layer beyond its GEMM, attention and HBM-bound bytes:
# far more than launching its kernels (microseconds each, issued ahead of the GPU), and added to
# the pass, since a fit that overlaps it with the kernels instead (max of the two) fits vTrain no
# better (8.5% against 8.6%) and only with non-GEMM traffic at 0.29 of the stored bytes.
# The Efficiency() field values stay the untuned starting point of every fit, and the default
# of a CPU (`--gpu cpu`), whose rates are measured on the machine and whose host terms are
# fitted on its own runs (commpipe.plan.host).
MEASURED_GPU = Efficiency(e_max=0.9912, ai_half_ridge=2.742, elementwise=1.160, overhead_s=674.9e-6)


def default_efficiency(gpu) -> Efficiency:
    """The Efficiency `plan` and `estimate` use without a --profile: MEASURED_GPU on GPUs; on a
    CPU the untuned Efficiency() with its host terms measured instead of the 20 us per layer
    pass: each pass's eager ops at this host's measured time per op (runtime_ops.py). Where the
    model is known (`plan`, `estimate`, and `estimate()`/`search()` called without an
    Efficiency), plan.pass_split.with_measured_pass then measures a CPU pass on the model's own
    first layer: its time per op and per unit of work replace the micro-benchmark's op time and
    the GEMM curve."""
    if gpu.name != "cpu":
        return MEASURED_GPU
    from commpipe.plan.cpu import host_op_seconds

    return Efficiency(overhead_s=0.0, op_s=host_op_seconds())
