"""How many eager ops commpipe's own runtime dispatches, and what issuing them costs the host
(`Job.runtime == "commpipe"`; runtime_kernels.py prices the bytes those ops move).

commpipe.models.llama runs in eager PyTorch: every op goes through the dispatcher (autograd,
autocast, the backend) one at a time, on the rank's one host thread. Counted as the ops of one
training step of one rank dispatch them (tests/test_plan_runtime_kernels.py recounts them with a
TorchDispatchMode on a shape they were not counted on; views, detaches and in-place updates count
like any op: each is a trip through the dispatcher), with layers L and micro-batches m the
step's ops are

    L * m * (forward + backward per layer)       LAYER_OPS: attention, MLP, two norms, rotary
  + m * (forward + backward per micro-batch)     MICROBATCH_OPS: embedding, final norm, head, loss
  + tensors * TENSOR_STEP_OPS                    per parameter tensor a step: the gradient-norm
                                                 clip (6: square, sum, add; scale) and AdamW's
                                                 per-tensor loop on a CPU (10, foreach=None)
  + casts * linear weights (bf16)                autocast's one cast of each weight a step
  + STEP_OPS                                     the step's own (loss, norm reduction, counters)

with 9 parameter tensors per layer (two norm weights, seven linear maps) and 3 outside them
(embedding, final norm, head). Context and tensor parallelism add ops to every layer
(CP_LAYER_OPS, TP_LAYER_OPS: counted on ranks of cp=2 and 4 and of tp=2 the same way): under
CP the forward attends its own chunk and the others' gathered K and V apart and merges the two
(inside an autograd Function, so without grad), and the backward recomputes attention over the
gathered K and V; under TP with sequence parallelism the gathers and scatters reshape their
inputs and outputs. The collective calls themselves are priced per call
(`Efficiency.coll_overhead_s`), not here, and so are pipeline messages.

The host time of a pass is its ops times `Efficiency.op_s`, the host seconds one op takes,
measured on the planning host (commpipe.plan.cpu.measure_op_seconds: a few layers' forward,
backward, clip and AdamW step on tiny tensors, timed and divided by their counted ops). How it
combines with the device time depends on who runs the ops:
  - on a CPU the host thread also computes, so a pass takes device + host time;
  - on a GPU the kernels run asynchronously, so a pass cannot finish before the host has issued
    its kernels nor before the GPU has run them: max(device, host) (`host_bound`).
"""

from __future__ import annotations

from commpipe.models.spec import ModelSpec

# per layer and micro-batch: (forward, backward) ops, tp = cp = 1 (module docstring)
LAYER_OPS = {"fp32": (102, 179), "bf16": (113, 199)}
# per micro-batch outside the layers: embedding, final norm, head, cross-entropy, loss scaling
MICROBATCH_OPS = {"fp32": (21, 42), "bf16": (23, 45)}
# added per layer and micro-batch under cp > 1 (commpipe.parallel.context's default, overlapped
# exchange; its forward also builds one index per CP rank: + cp) and under tp > 1 with sequence
# parallelism (commpipe.parallel.tensor); ranks of cp=2 and cp=4, tp=2 counted
CP_LAYER_OPS = {"fp32": (84, 39), "bf16": (84, 39)}
TP_LAYER_OPS = {"fp32": (25, 12), "bf16": (40, 17)}
TENSOR_STEP_OPS = 16        # per parameter tensor a step: clip 6 + single-tensor AdamW 10
WEIGHT_CAST_OPS = 1         # bf16: per linear weight a step (autocast's cache holds the cast)
STEP_OPS = 18               # per step, whatever the model
LAYER_TENSORS = 9           # LLaMA: attention and MLP norms, wq, wk, wv, wo, w1, w2, w3
LAYER_LINEARS = 7
OUTER_TENSORS = 3           # embedding, final norm, head (one linear)


def _key(precision: str) -> str:
    return "fp32" if precision == "fp32" else "bf16"


def layer_ops(precision: str, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """(forward, backward) ops of one layer for one micro-batch on a rank of a `tp` x `cp`
    group."""
    key = _key(precision)
    f, b = LAYER_OPS[key]
    if cp > 1:
        f, b = f + CP_LAYER_OPS[key][0] + cp, b + CP_LAYER_OPS[key][1]
    if tp > 1:
        f, b = f + TP_LAYER_OPS[key][0], b + TP_LAYER_OPS[key][1]
    return f, b


def microbatch_ops(precision: str) -> tuple[int, int]:
    """(forward, backward) ops of one micro-batch outside the layers (embedding, head, loss)."""
    return MICROBATCH_OPS[_key(precision)]


def stage_ops(stage_layers, s: int, precision: str, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """(forward, backward) ops stage s of the split `stage_layers` dispatches per micro-batch:
    its layers', and on the last stage the ones outside the layers (MICROBATCH_OPS: embedding,
    head and loss, counted together there)."""
    f, b = (n * stage_layers[s] for n in layer_ops(precision, tp, cp))
    if s == len(stage_layers) - 1:
        mf, mb = microbatch_ops(precision)
        f, b = f + mf, b + mb
    return f, b


def step_ops(layers: int, precision: str, embedding: bool = True, head: bool = True) -> int:
    """Ops of one rank's per-step work outside the passes (clip, optimizer, weight casts, the
    step's own) for a rank holding `layers` layers, and the embedding and/or the head."""
    tensors = layers * LAYER_TENSORS + embedding + 2 * head      # the head: final norm + matrix
    ops = tensors * TENSOR_STEP_OPS + STEP_OPS
    if _key(precision) == "bf16":
        ops += WEIGHT_CAST_OPS * (layers * LAYER_LINEARS + head)
    return ops


def total_step_ops(spec: ModelSpec, microbatches: int, precision: str) -> int:
    """Every op of one step of a single rank holding the whole model (the count the tests check
    against a TorchDispatchMode)."""
    f, b = layer_ops(precision)
    mf, mb = microbatch_ops(precision)
    return (spec.layers * microbatches * (f + b) + microbatches * (mf + mb)
            + step_ops(spec.layers, precision))


def host_bound(device_s: float, ops: float, op_s: float, on_cpu: bool) -> float:
    """Seconds of a pass that runs `device_s` on the device and dispatches `ops` eager ops at
    `op_s` host seconds each: one thread does both on a CPU (the sum); on a GPU the kernels run
    behind the host that issues them (the larger)."""
    host = ops * op_s
    return device_s + host if on_cpu else max(device_s, host)


class HostOps:
    """The host terms of one job's passes (timing.stage_costs): the ops of commpipe's own runtime
    at `eff.op_s` each, composed with the device time by `host_bound`. Inert (device time plus
    `eff.overhead_s`) for another framework's runtime or without a measured `op_s`. On a GPU the
    counted ops replace the per-layer `overhead_s` fitted on Megatron's runs; on a CPU that term
    stays, added (0 by default: a --profile may fit it)."""

    def __init__(self, job, gpu, eff, tp: int = 1, cp: int = 1):
        self.on = job.runtime == "commpipe" and eff.op_s > 0
        self.cpu = gpu.name == "cpu"
        self.op_s = eff.op_s
        self.precision = job.precision
        # a layer's ops on a rank of a tp x cp group (TP's without sequence parallelism are
        # not counted: commpipe's runtime runs TP with it)
        self.tp = tp if job.sequence_parallel else 1
        self.cp = cp
        self.fixed = 0.0 if self.on and not self.cpu else eff.overhead_s

    def forward(self, device_s: float, outer: bool = False) -> float:
        """A layer's forward (`outer`: the head, loss and embedding's) of one micro-batch."""
        if not self.on:
            return device_s
        ops = (microbatch_ops(self.precision) if outer
               else layer_ops(self.precision, self.tp, self.cp))[0]
        return host_bound(device_s, ops, self.op_s, self.cpu)

    def backward(self, device_i: float, device_w: float, outer: bool = False) -> float:
        """The input-gradient part I of a backward whose weight-gradient part W takes `device_w`:
        the host issues the whole backward's ops, so on a GPU B = I + W = max(I + W, host),
        i.e. I = max(I, host - W)."""
        if not self.on:
            return device_i
        ops = (microbatch_ops(self.precision) if outer
               else layer_ops(self.precision, self.tp, self.cp))[1]
        if self.cpu:
            return device_i + ops * self.op_s
        return max(device_i, ops * self.op_s - device_w)

    def step(self, layers: int, embedding: bool, head: bool) -> float:
        """Host seconds a rank's step spends outside the passes (clip, AdamW, weight casts) on a
        CPU; on a GPU AdamW runs torch's multi-tensor kernels, left to the device time."""
        if not (self.on and self.cpu):
            return 0.0
        return step_ops(layers, self.precision, embedding, head) * self.op_s


def with_host_ops(eff, job, gpu):
    """`eff` with `op_s` measured on this host for commpipe's own runtime on a GPU, when this host
    drives a CUDA device (a one-GPU job is planned where it runs): the tiny step of
    commpipe.plan.cpu.op_step on the GPU, dispatch and kernel launch together. A CPU's `op_s` is
    measured already (efficiency.default_efficiency); a planning host without a GPU, another framework
    or an `op_s` given (a --profile) leave `eff` as it is: the GPU passes then keep the per-layer
    overhead fitted on Megatron's runs."""
    if eff.op_s > 0 or job.runtime != "commpipe" or gpu.name == "cpu":
        return eff
    import torch

    if not torch.cuda.is_available():
        return eff
    from dataclasses import replace

    from commpipe.plan.cpu import host_op_seconds

    return replace(eff, op_s=host_op_seconds("cuda"))
