"""Host time a Megatron-Core MoE layer adds to a layer's fixed cost: the operations its router,
token dispatcher and grouped experts issue beyond a dense MLP's, each at the host time one
operation of a Megatron layer costs.

The GPU's per-layer fixed cost `Efficiency.overhead_s` (efficiency.py, 0.67 ms per layer and pass)
was fitted on vTrain's Megatron-DeepSpeed GPT runs, added to the pass. Counted in that code
(microsoft/Megatron-DeepSpeed@d6c9d841, megatron/model/transformer.py, tp > 1 as in 101 of the
109 runs) a layer issues, as kernels + GEMMs + NCCL calls + memory copies,
    forward 19: 15 kernels (6 GEMMs), 2 all-reduces, 2 host-to-device copies of a scalar
                (torch.tensor(0.0, device=...) in ParallelTransformerLayer.forward, each a
                blocking stream synchronisation: the host cannot run ahead of the layer)
    backward 32: 30 kernels (12 GEMMs), 2 all-reduces
and under the full recompute of those runs the backward replays the forward: 19 + 51 = 70 per
layer and micro-batch for the fitted 2 x overhead_s, so one operation costs
    op_s = 2 * overhead_s / 70  (19.3 us at the GPU default),
the host time of an operation issued from Python through autograd and its library wrapper.

A Megatron-Core MoE MLP (core_r0.15 as NeMo 25.11 ships it, TransformerEngine 2.9/2.10;
the all-to-all token dispatcher, grouped GEMM, fused permutation and router, dropless, TP 1)
issues, with L = experts / ep local experts, against the dense MLP it replaces:
                   MoE block forward, backward     dense MLP forward, backward
    bf16           32 + 2 L,  19 + 4 L             3,  5
    fp8 (MXFP8)    39 + 4 L,  30 + 6 L             9, 15
    fp8 (current)  35 + 10 L, 22 + 12 L            10, 13
(megatron/core/transformer/moe/{router,token_dispatcher,experts}.py and TE's GroupedLinear:
the router GEMM, fused top-k and aux-loss kernels; the dispatcher's token counts, an
all-gather of them, four device-to-host copies and one blocking synchronisation before the
token all-to-all, permutation and chunk-sort kernels, three all-to-alls; each grouped GEMM one
cuBLAS call per local expert (fc1, fc2; backward: data and weight gradients), FP8 quantisation
per expert: one MXFP8 kernel, four for per-tensor current scaling (amax, scale, cast)). The MoE
layer's extra operations are the difference, or the whole block where the model has shared
experts (their dense MLP issues the dense MLP's operations); full recompute replays the
forward's in the backward (an independent recount of the forward: 34 + 2 L and 41 + 4 L, the
same per-expert terms). Added to the pass as overhead_s is: every MoE forward blocks the host on
the GPU once (the all-to-all's split sizes), so its operations after that point are not issued
ahead of the GPU. The counts are TP 1's, applied at every tp and ep; the backward's,
weight-gradient GEMMs included, go to the input-gradient pass (zero-bubble schedules issue the
weight-gradient GEMMs later: the step's total is the same, their placement approximate).

Which FP8 recipe: Megatron-Bridge 25.11's performance runs use per-tensor current scaling on
Hopper and MXFP8 on Blackwell (docs/performance-summary.md, "FP8-CS", "FP8-MX"); GPUs named
b<digit> or gb<digit> (b200, gb200) are taken as Blackwell. Not counted: stream and event calls
(~37 forward, ~55 backward, constant), Python hooks per expert weight, torchtitan's MoE (its
presets set `Job.moe_host_ops` False) and commpipe's own runtime (runtime_ops.py prices its
host).
"""

from __future__ import annotations

import re

# Megatron-DeepSpeed's dense GPT layer (module docstring): forward, backward operations
MDS_LAYER_OPS = (19, 32)
# Megatron-Core MoE block and the dense MLP it replaces: (forward a, b), (backward a, b) with
# a + b * local experts operations, per FP8 recipe (module docstring)
MOE_BLOCK_OPS = {"bf16": ((32, 2), (19, 4)), "mxfp8": ((39, 4), (30, 6)),
                 "current": ((35, 10), (22, 12))}
DENSE_MLP_OPS = {"bf16": (3, 5), "mxfp8": (9, 15), "current": (10, 13)}


def op_seconds(overhead_s: float) -> float:
    """Host seconds of one operation of a Megatron layer: the fitted per-layer-pass cost of
    vTrain's full-recompute runs over the operations of a layer's forward and backward."""
    f, b = MDS_LAYER_OPS
    return 2 * overhead_s / (f + f + b)


def recipe(job, gpu) -> str:
    """The operation counts' key: bf16, or the FP8 recipe Megatron-Bridge runs on this GPU."""
    if job.precision != "fp8":
        return "bf16"
    return "mxfp8" if re.match(r"g?b\d", gpu.name.lower()) else "current"


def moe_layer_ops(moe, layout, job, gpu) -> tuple[int, int]:
    """(forward, backward) operations one MoE layer issues beyond a dense MLP's, per
    micro-batch, on one rank (module docstring); full recompute replays the forward's."""
    key = recipe(job, gpu)
    (fa, fb), (ba, bb) = MOE_BLOCK_OPS[key]
    local = moe.experts // layout.ep
    fwd, bwd = fa + fb * local, ba + bb * local
    if not moe.shared_experts:
        df, db = DENSE_MLP_OPS[key]
        fwd, bwd = fwd - df, bwd - db
    if layout.recompute == "full":
        bwd += fwd
    return fwd, bwd


NONE = (0, 0, 0.0, 0.0)


def moe_host(moe, layout, job, gpu, eff) -> tuple[int, int, float, float]:
    """(forward, backward) operations and (forward, backward) host seconds one MoE layer adds
    per micro-batch (StageCosts.moe_host): NONE on a CPU, under commpipe's own runtime and where
    `job.moe_host_ops` is off."""
    if gpu.name == "cpu" or job.runtime == "commpipe" or not job.moe_host_ops:
        return NONE
    op = op_seconds(eff.overhead_s)
    f, b = moe_layer_ops(moe, layout, job, gpu)
    return f, b, f * op, b * op
