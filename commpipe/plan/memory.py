"""Memory per pipeline rank: weights, gradients, optimizer states, activations, reserve.

States (bytes per parameter held by a rank):
    bf16 mixed precision: bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m 4 + v 4 = 16
    fp32:                 fp32 weights 4 + fp32 grads 4 + Adam m 4 + v 4                  = 16
ZeRO-1 shards the optimizer part (12 resp. 8 bytes) over the dp*cp ranks that hold the same
weights (Megatron's distributed optimizer shards over the data-parallel group *with* CP, since CP
ranks reduce gradients together). Megatron-LM by default accumulates gradients in fp32
(18 bytes/param, `Job.grad_fp32`); commpipe reduces them in the parameter dtype, hence 16.

Activations per transformer layer and micro-batch, with T = b*s/cp tokens on the rank, t = tp,
a = heads, 2-byte activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 4):
    GPT, no flash attention:  T*h*(34 + 5*a*s/h) / t  with SP     [their sbh(34 + 5as/h)/t]
                              T*h*(10 + 24/t + 5*a*s/(h*t))  without SP (tp > 1)
    LLaMA with flash attention (no dropout, SwiGLU, GQA), derived the same way:
        attention: norm input 2 + QKV input 2 + Q 2 + K,V 4*kv/h + output O 2   = 8 + 4kv/h
        MLP:       norm input 2 + MLP input 2 + gate, up 4f/h + SiLU out 2f/h
                   + product 2f/h                                             = 4 + 8f/h
        total T*h*(12 + 4*kv/h + 8*f/h) / t with SP (41 T h for llama3-8b); the flash
        log-sum-exp (4 bytes per head and token) is added; without flash the softmax output
        (2*a*T*s bytes, no dropout) is stored instead.
Recompute: "selective" recomputes what is cheap and large: the attention core (Korthikanti's
choice: drops the a*s terms) and, for SwiGLU, the SiLU output and the product (drops 4f/h);
"full" keeps only each layer's input, 2*T*h/t bytes (SP-sharded), plus one layer's full
activations while that layer's backward runs.
"op" (torchtitan's per-op selective checkpointing, kernels.py) keeps the block input, flash
attention's output and every other matmul's output, plus one layer's full activations.
A rank holds `inflight` micro-batches' worth of its layers at its peak: the simulator's
`peak_activations`, in units of one micro-batch through the rank's whole share of the model
(for 1F1B rank r holds p - r; a chunk of an interleaved schedule counts 1/vpp). The last stage
also holds the fp32 softmax of the vocabulary-parallel cross-entropy (4*T*V/t per micro-batch
whose loss backward has not run: m for GPipe, 1 for the 1F1B family, which runs the loss
backward right after its forward) plus the transient bf16 logits (2*T*V/t): Megatron-core's
vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py) makes one fp32 copy of the bf16
logits and then subtracts, exponentiates and normalises it in place, 6 bytes per logit. It also
keeps the final norm's input and the output layer's input (2*T*h/t each: TENorm and
ColumnParallelLinear each save their input for backward).

Reserve: 1.5 GiB fixed (CUDA context ~0.5-0.8 GiB, cuBLAS workspaces, NCCL communicator
buffers; `Job.rank_reserve_gb`, which `plan --gpu cpu` sets to what a CPU rank's process holds,
plan.fits) plus 10% of the *transient* tensors for caching-allocator fragmentation. Fragmentation
is free space left between cached blocks when tensors of different life spans are freed and
reallocated (PyTorch's CUDA memory notes; arXiv:2507.16274 measures it growing with virtual
pipelines and recomputation, i.e. with activations). States allocated once and never freed take
none of it: Megatron-core's DDP puts all bf16 weights and all gradients of a model chunk in
one contiguous `torch.zeros` buffer each (distributed/param_and_grad_buffer.py; NeMo's configs:
"Allocate gradients in a contiguous bucket to save memory (less fragmentation ...)"), TE's FP8
weight copies are cached workspaces updated in place, and the optimizer's shards live for the
whole run. So the 10% applies to activations, logits and, under ZeRO-3, the gathered weights
and unsharded gradients, which come and go every step (`persistent_state_bytes`).
GB in this module means GiB (2**30 bytes), as torch.cuda reports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from commpipe.models.family import layer_form
from commpipe.models.spec import ModelSpec
from commpipe.parallel.dims import split_layers
from commpipe.plan.attention import layer_params, mla, mla_activation_bytes, replicated_attention_params
from commpipe.plan.kernels import op_sac_activation_bytes
from commpipe.plan.layout import Job, Layout, zero_stage
from commpipe.plan.moe import (
    expert_state_bytes,
    mlp_fp8_copy_bytes,
    rank_activation_bytes,
    rank_layer_ids,
    replicated_mlp_params,
    routed_spec,
)
from commpipe.plan.runtime_memory import stage_activation_bytes
from commpipe.schedules.registry import info

GIB = 2**30
FRAGMENTATION = 0.10
FSDP_LAYERS_GATHERED = 2     # FSDP2 / Megatron-FSDP: the current layer and the prefetched next


@dataclass
class StageMemory:
    rank: int               # pipeline rank
    layers: int             # transformer layers held (all chunks)
    params: float           # parameters held (count)
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    logits_gb: float
    reserve_gb: float
    inflight: float         # peak micro-batches in flight (units of the rank's share)
    # commpipe's runtime: gradients that exist only while the loss backward runs (beside the
    # saved softmax), part of the peak but not held for backward
    loss_transient_gb: float = 0.0

    @property
    def total_gb(self) -> float:
        return (self.weights_gb + self.grads_gb + self.optimizer_gb + self.activations_gb
                + self.logits_gb + self.loss_transient_gb + self.reserve_gb)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_gb"] = self.total_gb
        return d


def _replicated_layer_params(spec: ModelSpec) -> int:
    """Per-layer parameters TP does not split: norm weights (and GPT's LN biases and the biases
    of the row-parallel output and second MLP matrix, which are added after the reduction)."""
    h = spec.hidden
    return (4 * h + 2 * h if layer_form(spec).biases else 2 * h) + replicated_attention_params(spec)


def layer_params_per_rank(spec: ModelSpec, tp: int) -> float:
    rep = _replicated_layer_params(spec)
    return (layer_params(spec) - rep) / tp + rep


def stage_params(spec: ModelSpec, layout: Layout, job: Job) -> list[tuple[int, float]]:
    """(layers, parameters) per pipeline rank, chunks placed as the schedule places them."""
    seq = job.seq_len if layer_form(spec).learned_positions else 0   # the position table
    return list(_stage_params(spec, layout.schedule, layout.pp, layout.vpp, layout.tp, seq))


def embedding_params(spec: ModelSpec, layout: Layout, job: Job) -> float:
    """Parameters of the embedding on the rank holding stage 0: its vocabulary-parallel slice
    of the word embedding, and a learned position table whole."""
    seq = job.seq_len if layer_form(spec).learned_positions else 0
    return spec.vocab * spec.hidden / layout.tp + seq * spec.hidden


@lru_cache(maxsize=4096)
def _stage_params(spec: ModelSpec, schedule: str, pp: int, vpp: int, tp: int,
                  seq_len: int) -> tuple[tuple[int, float], ...]:
    stages = pp * vpp
    counts = stage_layer_counts(spec.layers, stages)
    per_layer = layer_params_per_rank(spec, tp)
    h, v, t = spec.hidden, spec.vocab, tp
    form = layer_form(spec)
    moe = routed_spec(spec)
    out = []
    for rank, chunks in enumerate(rank_chunks(schedule, pp, vpp)):
        layers = sum(counts[s] for s in chunks)
        params = layers * per_layer
        if moe is not None:     # routers, shared experts, dense MLPs: replicated over EP (moe.py)
            params += replicated_mlp_params(moe, rank_layer_ids(spec.layers, schedule, pp, vpp)[rank], tp)
        if 0 in chunks:
            params += v * h / t + seq_len * h
        if stages - 1 in chunks:
            # the head (a tied one: a copy of the embedding when pp > 1) and the final norm
            head = v * h / t if not form.tied_head or pp > 1 else 0
            params += head + (2 * h if form.biases else h)
        out.append((layers, params))
    return tuple(out)


def chunk_stages(layout: Layout, rank: int) -> tuple[int, ...]:
    """Virtual stages held by a pipeline rank: looped for interleaved, V-shaped for zbv, stp
    and dualpipev."""
    return rank_chunks(layout.schedule, layout.pp, layout.vpp)[rank]


@lru_cache(maxsize=4096)
def rank_chunks(schedule: str, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's virtual stages, placed as the schedule places them (looped or V)."""
    return info(schedule).rank_chunks(pp, vpp)


@lru_cache(maxsize=4096)
def stage_layer_counts(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage, split as `commpipe.parallel.dims.split_layers` splits them."""
    return tuple(len(r) for r in split_layers(layers, stages))


def layer_activation_bytes(spec: ModelSpec, layout: Layout, job: Job, recompute: str | None = None) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch (see module docstring)."""
    rc = layout.recompute if recompute is None else recompute
    t, s = layout.tp, job.seq_len
    tokens = layout.micro_batch_size * s / layout.cp
    h, a = spec.hidden, spec.heads
    sp = job.sequence_parallel or t == 1
    flash = job.uses_flash(spec)
    if rc == "full":
        return 2 * tokens * h / (t if sp else 1)
    if rc == "op":
        return op_sac_activation_bytes(spec, layout, job)
    if not layer_form(spec).gated_mlp:
        # under fp8 TE keeps FP8 copies of the GEMM inputs: QKV and fc1 inputs 2 -> 1, fc2's
        # input 8 -> 4, plus an FP8 copy of the attention output (1): 34 -> 29
        per_h = 29.0 if job.precision == "fp8" else 34.0
        # Korthikanti Table 2: without SP, norms, dropouts and the first GEMM's input (10 sbh)
        # are replicated; everything else is split
        base = tokens * h * (per_h / t if sp else 10 + 24 / t)
        score = 0.0 if (flash or rc == "selective") else 5 * a * tokens * s / t
        lse = 4 * a * tokens / t if flash else 0.0
        return base + score + lse
    kv, f = spec.kv_dim, spec.ffn_hidden
    fp8 = job.precision == "fp8"
    if rc == "selective":
        mlp_act = 4 * f / h                 # gate and up; SiLU and the product recomputed
    elif job.fused_swiglu:
        # gate, up (SwiGLU's input) + the product (fc2's input, an FP8 copy under fp8)
        mlp_act = 4 * f / h + (1 if fp8 else 2) * f / h
    else:
        mlp_act = 8 * f / h                 # + SiLU's output, kept by plain autograd
    # Q, O, K/V, MLP intermediates: split by TP; under fp8 TE also keeps an FP8 copy of O for the
    # output projection's weight gradient (flash attention's backward needs O in bf16)
    # (multi-head latent attention: its own Q, K, V, O and latents, plan/attention.py)
    latent = mla_activation_bytes(spec, tokens, t) if mla(spec) else None
    # Q and O widths over h: 1 unless a MoE shape sets head_dim apart (MLA: its O, heads * v)
    q, o = spec.q_width / h, spec.o_width / h
    split = (0.0 if latent else 2 * q + 2 * o + 4 * kv / h) + mlp_act + (o if fp8 else 0)
    # norm inputs 2 + 2 and the QKV and MLP inputs, split only by SP: the GEMM inputs are kept as
    # FP8 copies (1 byte) under fp8
    repl = 6.0 if fp8 else 8.0
    base = tokens * h * ((split + repl) / t if sp else repl + split / t)
    if latent:
        base += sum(latent)
    if flash:
        score = 4 * a * tokens / t          # fp32 log-sum-exp per head and token
    else:
        score = 0.0 if rc == "selective" else 2 * a * tokens * s / t
    return base + score


def linear_params_per_layer(spec: ModelSpec, tp: int) -> float:
    """Parameters of a layer's four linear maps on one TP rank (the ones FP8 runs in FP8)."""
    return (layer_params(spec) - _replicated_layer_params(spec)) / tp


def _bytes_per_param(job: Job) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter before any sharding."""
    return (2, (4 if job.grad_fp32 else 2), 12) if job.mixed else (4, 4, 8)


def state_bytes(spec: ModelSpec, layout: Layout, job: Job, layers: int, params: float) -> tuple:
    """(weights, gradients, optimizer) bytes of a rank holding `layers` layers and `params`
    parameters, for the job's precision and the layout's ZeRO stage (module docstring)."""
    w_b, g_b, o_b = _bytes_per_param(job)
    n = layout.shard_size
    z = zero_stage(layout, job)
    # FP8 (Transformer Engine on Hopper/Blackwell): every linear weight as FP8 plus its transpose
    # (the dgrad GEMM's layout), 2 bytes. With FP8 parameters (Megatron --fp8-param-gather) they
    # replace the bf16 weight; otherwise TE caches them beside it for the step: 2 bytes more.
    fp8_copy = 2.0 if job.precision == "fp8" and not job.fp8_params else 0.0
    lin = linear_params_per_layer(spec, layout.tp)
    if z >= 3 and layout.pp == 1:
        # FSDP: everything sharded; the layer being computed and the one prefetched are gathered
        # (bf16 weights, unsharded gradients until their reduce-scatter, FP8 copies)
        per_layer = layer_params_per_rank(spec, layout.tp)
        work = min(FSDP_LAYERS_GATHERED, layers)
        w = params * w_b / n + work * (per_layer * w_b + lin * fp8_copy)
        g = params * g_b / n + work * per_layer * g_b
        return w, g, params * o_b / n
    w = params * w_b + layers * lin * fp8_copy
    g = params * g_b / (n if z == 2 else 1)
    o = params * o_b / (n if z >= 1 else 1)
    return w, g, o


def persistent_state_bytes(layout: Layout, job: Job, params: float, states: float) -> float:
    """Of a rank's `states` bytes (the sum of its `state_bytes` for `params` parameters), the part
    allocated once and kept all run (no fragmentation share; module docstring): all of them below
    ZeRO-3; under ZeRO-3 only each rank's shards, since the gathered weights and the unsharded
    gradients (and their FP8 copies) are allocated and freed every step (per layer without a
    pipeline, per stage and step with one)."""
    if zero_stage(layout, job) < 3:
        return states
    return params * sum(_bytes_per_param(job)) / layout.shard_size


def gb_text(x: float) -> str:
    """A capacity in GB as people write it, without an exponent:

    >>> gb_text(80.0), gb_text(141.0), gb_text(2.93), gb_text(1024.0)
    ('80', '141', '2.93', '1024')
    """
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _reserve_bytes(job: Job, tensors: float, persistent: float) -> float:
    return job.rank_reserve_gb * GIB + FRAGMENTATION * (tensors - persistent)


def stage_memory(spec: ModelSpec, layout: Layout, job: Job, inflight: list[float]) -> list[StageMemory]:
    """Memory of every pipeline rank. `inflight[r]`: rank r's peak micro-batches in flight."""
    if len(inflight) != layout.pp:
        raise ValueError(f"need one in-flight count per pipeline rank ({layout.pp}), got {len(inflight)}")
    stages = layout.pp * layout.vpp
    act_layer = layer_activation_bytes(spec, layout, job)
    full_layer = layer_activation_bytes(spec, layout, job, recompute="none")
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    out = []
    all_chunks = rank_chunks(layout.schedule, layout.pp, layout.vpp)
    states: dict = {}
    for rank, (layers, params) in enumerate(stage_params(spec, layout, job)):
        chunks = all_chunks[rank]
        act = inflight[rank] * layers * act_layer
        mlp_act, mlp_full = rank_activation_bytes(spec, layout, job, rank)   # MoE MLPs (moe.py)
        act += inflight[rank] * mlp_act
        if layout.recompute in ("full", "op"):
            act += full_layer + mlp_full        # one layer rematerialised during its backward
        logits = transient = 0.0
        if job.runtime == "commpipe":           # this runtime's own saved tensors
            last_inflight = layout.microbatches_for(job) if layout.schedule == "gpipe" else 1
            act, logits, transient = stage_activation_bytes(
                spec, layout.tp, tokens, job.sequence_parallel, layout.recompute, layers,
                inflight[rank], stages - 1 in chunks, last_inflight, job.mixed)
        elif stages - 1 in chunks:
            # fp32 softmax saved per micro-batch whose backward has not run yet, plus the
            # transient bf16 logits of the one being computed; the final norm's input too
            last_inflight = layout.microbatches_for(job) if layout.schedule == "gpipe" else 1
            logits = (4 * last_inflight + 2) * tokens * spec.vocab / layout.tp
            act += last_inflight * 4 * tokens * spec.hidden / layout.tp     # norm and head inputs
        if (layers, params) not in states:
            states[layers, params] = state_bytes(spec, layout, job, layers, params)
        w, g, o = states[layers, params]
        # a MoE rank's routed experts: E/ep per layer, optimizer sharded over edp (moe.py)
        ew, eg, eo = expert_state_bytes(spec, layout, job, rank, zero_stage(layout, job))
        w, g, o = w + ew + mlp_fp8_copy_bytes(spec, layout, job, rank), g + eg, o + eo
        tensors = w + g + o + act + logits + transient
        reserve = _reserve_bytes(job, tensors, persistent_state_bytes(layout, job, params, w + g + o))
        out.append(StageMemory(rank, layers, params, w / GIB, g / GIB, o / GIB, act / GIB,
                               logits / GIB, reserve / GIB, inflight[rank], transient / GIB))
    return out


def static_memory_gb(spec: ModelSpec, layout: Layout, job: Job) -> float:
    """Weights, gradients and optimizer states of the heaviest rank plus the reserve: a lower
    bound on its memory that needs no schedule walk (the search prunes with it first)."""
    def bound(n, p, experts):
        states = sum(state_bytes(spec, layout, job, n, p)) + experts
        return states + _reserve_bytes(job, states, persistent_state_bytes(layout, job, p, states))
    z = zero_stage(layout, job)
    experts = [sum(expert_state_bytes(spec, layout, job, r, z)) + mlp_fp8_copy_bytes(spec, layout, job, r)
               for r in range(layout.pp)]
    return max(bound(n, p, e) for (n, p), e in set(zip(stage_params(spec, layout, job), experts))) / GIB


def memory_problem(stages: list[StageMemory], capacity_gb: float) -> str | None:
    """Why the layout does not fit, naming the worst stage and its largest part, or None."""
    worst = max(stages, key=lambda s: s.total_gb)
    if worst.total_gb <= capacity_gb:
        return None
    parts = {"weights": worst.weights_gb, "gradients": worst.grads_gb,
             "optimizer states": worst.optimizer_gb, "activations": worst.activations_gb,
             "logits": worst.logits_gb}
    big = max(parts, key=parts.get)
    return (f"out of memory: pipeline rank {worst.rank} needs {worst.total_gb:.1f} GB > "
            f"{gb_text(capacity_gb)} GB ({big} {parts[big]:.1f} GB, {worst.inflight:g} micro-batches "
            f"in flight); use more tp/pp, a higher --zero stage or activation recompute")
