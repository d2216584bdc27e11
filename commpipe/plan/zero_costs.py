"""Data-parallel and ZeRO costs of a stage (timing.py): FSDP's exposed per-layer parameter
all-gathers and gradient reduce-scatters, FSDP2's buffer copies on the compute stream
(kernels.py), and the step's gradient reduction (and the distributed optimizer's parameter
all-gather) with Megatron's per-chunk overlap."""

from __future__ import annotations

from commpipe.models.spec import ModelSpec
from commpipe.plan.cluster import Cluster
from commpipe.plan.kernels import fsdp_copy_bytes, nccl_sm_share
from commpipe.plan.layout import Job, Layout, zero_stage
from commpipe.plan.memory import embedding_params, layer_params_per_rank, linear_params_per_layer


def zero_exposed(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster, layers: int,
                  layer_f: float, layer_b: float) -> tuple[float, float, float, float]:
    """Seconds per micro-batch of a stage's per-layer ZeRO traffic: exposed (forward, backward),
    then the compute it hides behind loses to the SMs its NCCL kernels hold (forward, backward;
    kernels.nccl_sm_share of the hidden traffic's duration).

    ZeRO-3 / FSDP without a pipeline (PyTorch FSDP2, Megatron-FSDP): each layer's parameters are
    all-gathered before its forward and again before its backward, and its gradients are
    reduce-scattered after it; the next layer's all-gather is prefetched during the current
    layer's compute, so a layer exposes max(0, traffic - compute), plus the first all-gather of
    each pass and the last reduce-scatter, which have nothing to hide behind. Gradients are
    reduce-scattered every micro-batch (FSDP2's default under gradient accumulation).
    ZeRO-2 (DeepSpeed): the gradients' reduce-scatter per micro-batch, hidden behind the backward.
    With pp > 1 a ZeRO-3 stage keeps its weights gathered through the step (torchtitan with
    pipelining) and prices as ZeRO-1."""
    z = zero_stage(layout, job)
    n = layout.shard_size
    if z < 2 or n == 1 or layers == 0 or (z == 3 and layout.pp > 1):
        return 0.0, 0.0, 0.0, 0.0
    share = nccl_sm_share(cluster, n, layout.tp)
    per_layer = layer_params_per_rank(spec, layout.tp)
    lin = linear_params_per_layer(spec, layout.tp)
    grad_b = 4 if (not job.mixed or job.grad_fp32) else 2
    rs = cluster.reduce_scatter(per_layer * grad_b, n, layout.tp)
    if z == 2:
        return 0.0, layers * max(0.0, rs - layer_b), 0.0, share * layers * min(rs, layer_b)
    # FP8 parameters are gathered as FP8 (Megatron --fp8-param-gather, torchao float8 all-gather)
    w_bytes = (per_layer - lin) * 2 + lin * (1 if job.precision == "fp8" and job.fp8_params else 2)
    if not job.mixed:
        w_bytes = per_layer * 4
    ag = cluster.all_gather(w_bytes, n, layout.tp)
    fwd = ag + layers * max(0.0, ag - layer_f)
    bwd = ag + rs + layers * max(0.0, ag + rs - layer_b)
    # the prefetched traffic hides behind each layer's compute for min(traffic, compute)
    return fwd, bwd, share * layers * min(ag, layer_f), share * layers * min(ag + rs, layer_b)


def fsdp_copies(spec: ModelSpec, layout: Layout, job: Job, hbm: float) -> tuple[float, float]:
    """Forward, backward seconds of FSDP2's copy-out / copy-in per layer (kernels.py)."""
    if not (job.fsdp_copies and zero_stage(layout, job) == 3 and layout.pp == 1 and layout.shard_size > 1):
        return 0.0, 0.0
    w_b = 2 if job.mixed else 4
    g_b = 4 if (not job.mixed or job.grad_fp32) else 2
    f, b = fsdp_copy_bytes(layer_params_per_rank(spec, layout.tp), w_b, g_b)
    return f / hbm, b / hbm


# Megatron-LM's DDP (megatron/core/distributed) buckets a model chunk's gradients (40M parameters
# by default) and, with --overlap-grad-reduce, launches a bucket's reduction (all-reduce, or the
# distributed optimizer's reduce-scatter) when the last micro-batch's backward has produced it;
# in an interleaved pipeline every chunk has its own buffers and its reduction starts when that
# chunk's last backward ends (the schedule's grad_sync_func per chunk). With
# --overlap-param-gather the distributed optimizer's parameter all-gather runs in the next step's
# forward, each bucket waited for by the forward pre-hook of its first layer. Megatron-Core 0.9 and
# later launch a chunk's whole gather one chunk ahead (the schedule's param_sync_func per chunk);
# Megatron-LM before it (f2e5db4, the README's scaling runs; without --delay-param-gather) chains
# the buckets: the first at the end of the step (zero_grad), each next one only when the forward
# pre-hook has waited on the one before (distrib_optimizer.py, _finish_param_sync_helper: so that
# communication kernels do not block compute under CUDA_DEVICE_MAX_CONNECTIONS=1), across every
# chunk's buckets in order (`Job.param_gather_chained`).
# Buckets are filled in reverse parameter order (roughly the backward's) and closed once they
# reach the bucket size, so the last bucket to reduce, which is the first to gather, holds the
# word embedding: the first parameter of the forward, whose gradient the backward produces
# last (param_and_grad_buffer.py, the bucketing loop over `params[::-1]`; a shared embedding
# gets a bucket of its own). On the rank holding the embedding that bucket is the embedding's
# size when that is larger: vocabulary x hidden / tp, 537M parameters for a 131,072-word
# vocabulary at hidden 4,096 and tp 1, thirteen default buckets.
BUCKET_PARAMS = 40e6


def last_bucket_params(spec: ModelSpec, layout: Layout, job: Job, mine: tuple) -> float:
    """Parameters in the rank's last bucket to reduce (first to gather): the default bucket, or
    the word embedding (with a learned position table) on the rank holding stage 0."""
    if 0 not in mine:
        return BUCKET_PARAMS
    return max(BUCKET_PARAMS, embedding_params(spec, layout, job))


def overlapped_dp_exposed(reduce_s: float, gather_s: float, params: float, f: list[float],
                          b: list[float], pp: int, chained: bool = False,
                          last_bucket: float = BUCKET_PARAMS) -> float:
    """Exposed seconds per step of one pipeline rank's data-parallel traffic under Megatron's
    overlap (comment above). `f`, `b`: one micro-batch's forward and backward per chunk of the
    rank, in stage order. The rank's last backward is its first chunk's; before it the cooldown
    runs pp backwards of that chunk (interleaved 1F1B), which hide the other chunks' reductions;
    the first chunk's own reduction hides behind its last backward except the last bucket. The
    all-gather mirrors this in the forward: the first chunk's behind its first forward except
    the first bucket, the others behind the pp forwards of the first chunk that precede them.
    `chained` (Megatron-LM before Megatron-Core 0.9, comment above): a bucket's gather hides only
    behind the previous bucket's layers, so in each chunk's first forward (1 - bucket) of
    max(0, gather - forward) shows, plus the step's first bucket; a later chunk's first bucket is
    launched when the previous chunk's last one is waited on and hides behind the forwards
    between. `last_bucket`: the parameters of the last bucket (`last_bucket_params`)."""
    v = len(b)
    share = 1.0 / v
    bucket = min(1.0, last_bucket / max(params * share, 1.0))
    red0, gat0 = reduce_s * share, gather_s * share
    hide_b = (v - 1) * pp * b[0]
    hide_f = (v - 1) * pp * f[0]
    red = max(0.0, reduce_s - red0 - hide_b) + max(red0 - b[0], red0 * bucket)
    if not gather_s:
        gat = 0.0
    elif chained:
        gat = gat0 * bucket + sum(max(0.0, gat0 - fk) * (1 - bucket) for fk in f)
    else:
        gat = max(0.0, gather_s - gat0 - hide_f) + max(gat0 - f[0], gat0 * bucket)
    return red + gat


def dp_cost(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster, f: list[float],
            b: list[float], groups: dict, eff, mine: tuple, layers: int, params: float,
            prices: dict, experts: tuple | None = None) -> tuple[float, float]:
    """(total, exposed) seconds per step of one pipeline rank's data-parallel traffic. `f`, `b`:
    one micro-batch's forward and backward per stage; `mine`: the rank's stages; `prices`: a
    cache of the collectives' prices by parameter count (they do not depend on the rank).
    `experts`: (parameters, layout, (size, stride) of their group) of a MoE rank's routed
    experts (moe_costs.expert_reduction), reduced over their own group on the same stream, so
    their time joins the rest before the overlap is priced."""
    if params not in prices:
        prices[params] = _dp_prices(spec, layout, job, cluster, groups, eff, layers, params)
    kind, red, ag = prices[params]
    if experts is not None and experts[0]:
        n, lay, group = experts
        if ("experts", n) not in prices:
            prices["experts", n] = _dp_prices(spec, lay, job, cluster, dict(groups, dp_cp=group),
                                              eff, 0, n)
        _, red_e, ag_e = prices["experts", n]
        red, ag, params = red + red_e, ag + ag_e, params + n
    if kind == "overlap":
        # commpipe's own runtime gathers the updated parameters after the step (parallel/data.py),
        # Megatron during the next step's forward
        later = job.runtime == "commpipe"
        exposed = overlapped_dp_exposed(red, 0.0 if later else ag, params, [f[s] for s in mine],
                                        [b[s] for s in mine], layout.pp, job.param_gather_chained,
                                        last_bucket_params(spec, layout, job, mine))
        return red + ag, exposed + (ag if later else 0.0)
    window = sum(b[s] for s in mine) if job.dp_overlap else 0.0
    # the last bucket can never hide (comment above BUCKET_PARAMS)
    tail = red * min(1.0, last_bucket_params(spec, layout, job, mine) / max(params, 1.0))
    return red, max(red - window, tail if job.dp_overlap else red)


def _dp_prices(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster, groups: dict, eff,
               layers: int, params: float) -> tuple[str, float, float]:
    """("overlap", reduction, all-gather) under Megatron's overlap, else ("after", total, 0)."""
    grad_b = 2 if job.mixed and not job.grad_fp32 else 4
    z = zero_stage(layout, job)
    group, stride = groups["dp_cp"]
    shard = layout.shard_size if z >= 1 else 1
    call = eff.coll_overhead_s
    if z == 3 and layout.pp == 1 and shard > 1:
        # gradients already reduce-scattered per layer; HSDP all-reduces the shards across
        # the group's replicas once per step
        replicas = group // shard
        ar = cluster.all_reduce(params / shard * grad_b, replicas, stride * shard)
        return "after", ar + (call if replicas > 1 else 0.0), 0.0
    if z == 2 and shard > 1:
        # gradients reduce-scattered per micro-batch (in the backward): the updated weights'
        # all-gather is what is left
        return "after", cluster.all_gather(params * (2 if job.mixed else 4), group, stride), 0.0
    if job.dp_overlap and group > 1 and shard in (1, group):
        # Megatron's DDP with --overlap-grad-reduce / --overlap-param-gather (comment above
        # overlapped_dp_exposed): each chunk's reduction starts after its last backward, the
        # distributed optimizer's parameter all-gather overlaps the next step's forward
        if shard > 1:
            red = cluster.reduce_scatter(params * grad_b, group, stride) + call
            w_b = gather_bytes(spec, layout, job, params, layers)
            return "overlap", red, cluster.all_gather(params * w_b, group, stride) + call
        return "overlap", cluster.all_reduce(params * grad_b, group, stride) + call, 0.0
    # all-reduce over dp*cp (ZeRO-1: reduce-scatter + all-gather, the same traffic)
    ar = cluster.all_reduce(params * grad_b, group, stride)
    return "after", ar + (call if group > 1 else 0.0), 0.0


def gather_bytes(spec: ModelSpec, layout: Layout, job: Job, params: float, layers: int) -> float:
    """Bytes per parameter of the distributed optimizer's parameter all-gather: bf16 (fp32 without
    mixed precision); FP8 parameters gather their linear weights as FP8 (--fp8-param-gather)."""
    if not job.mixed:
        return 4.0
    if job.precision == "fp8" and job.fp8_params:
        lin = layers * linear_params_per_layer(spec, layout.tp)
        return (2 * (params - lin) + lin) / max(params, 1.0)
    return 2.0
