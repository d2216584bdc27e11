"""Mixture-of-Experts layers in the layout planner: which expert-parallel sizes a layout may take,
what a rank holds and keeps of its MoE layers. Their time (GEMMs, all-to-alls, the expert
gradients' reduction) is `commpipe.plan.moe_costs`.

A MoE decoder reaches the planner as its family describes it (commpipe.models.moe_family):
`layer_form(spec).routed` is its MoESpec, whose `ffn_hidden` is 0, so the layer machinery
(compute.py, timing.py, memory.py) prices attention, norms, embedding and head as for LLaMA, and this module
adds each layer's MLP: a dense SwiGLU of `dense_ffn` in the first `dense_layers` (split by TP
like LLaMA's), else the router (h x E), `shared_experts` SwiGLUs that see every token, and the
routed experts. Parameter counts come from the family's own definitions (moe_spec.py).

Expert parallelism (commpipe.parallel.expert): `ep` consecutive ranks of the dp*cp group hold
E/ep experts each; attention, router, shared experts and dense MLPs stay replicated over ep. So
    replicated parameters   gradients reduced over dp*cp, optimizer states sharded over it
    expert parameters       E/ep per MoE layer on a rank, 1/tp of each; gradients reduced
                            over edp = dp*cp/ep (the ranks holding the same experts),
                            optimizer states sharded over edp (Megatron's distributed
                            optimizer does)
Tensor parallelism splits every expert (routed and shared) and dense MLP by its width, as
Megatron-Core's expert tensor parallelism at its default size (tp) and commpipe's runtime
(commpipe.parallel.tensor_moe) do; only the router is whole on every TP rank. Each TP rank
still runs all of its micro-batch's token copies, through its f/tp columns of each expert.

Activations kept per MoE layer and micro-batch, T = b*s/cp tokens, R = T*top_k*imbalance token
copies on the busiest rank (the one the step waits for), a bytes per activation element:
    router scores (fp32)                  4*T*E
    routed experts                        R*(h [dispatched input] + (2 f [gate, up] + f
                                          [product] (+ f [SiLU output] unfused)) / tp + h
                                          [expert output, for the combine's weight gradient]) * a
    shared experts                        T*S*f*(2 + 1 (+1)) * a / tp
    dense MLP layers                      T*F*(2 + 1 (+1)) * a / tp
selective recompute keeps only gate and up (SiLU and the product are recomputed, as memory.py
prices LLaMA's MLP); full recompute keeps only the layer input, which the layer machinery counts.

`Job.expert_imbalance` (default 1.25): tokens routed to the busiest rank over the mean. Dropless
routing gives no bound; the auxiliary balancing loss (Switch Transformer, Fedus et al. 2022,
Sec. 2.2; Mixtral's released config weighs the same loss, router_aux_loss_coef 0.02) keeps loads
near uniform. Switch benchmarks expert capacity factors (the capacity an expert is provisioned
with over the mean load) of 1.0 to 2.0 and finds "Switch Transformers perform better at lower
capacity factors (1.0, 1.25)" (their Table 1): 1.25 is the larger of the headrooms a balanced run
needs there. It is taken here as the busiest rank's load: conservative for a rank holding several
experts, whose loads average out, and an assumption for a dropless run, which has no capacity.
"""

from __future__ import annotations

from functools import lru_cache

from commpipe.models import moe_spec as M
from commpipe.models.family import layer_form
from commpipe.models.spec import divisors
from commpipe.parallel.dims import split_layers
from commpipe.schedules.registry import info


def routed_spec(spec):
    """The MoE spec of a routed-expert decoder, or None for dense layers."""
    return layer_form(spec).routed


def ep_choices(spec, group: int) -> list[int]:
    """Expert-parallel sizes a dp*cp group of `group` ranks can take: divisors of the group that
    divide the expert count (commpipe.parallel.expert.check_ep); [1] for a dense model."""
    moe = routed_spec(spec)
    if moe is None:
        return [1]
    return [e for e in divisors(group) if moe.experts % e == 0]


def ep_options(spec, group: int, fixed: dict) -> list[int]:
    """The ep values the search tries: every choice, or the one `--ep` fixes if valid."""
    choices = ep_choices(spec, group)
    if "ep" in fixed:
        return [fixed["ep"]] if fixed["ep"] in choices else []
    return choices


def model_problem(spec, job) -> str | None:
    """Why the planner cannot price this MoE model under `job` at all, or None (and None for
    any dense model): said before a search starts."""
    moe = routed_spec(spec)
    if moe is None:
        return None
    if job.runtime == "commpipe":
        return ("MoE layers are priced for GPU frameworks (--framework megatron, the default on "
                "GPUs); commpipe's own runtime's MoE tensors are not counted yet (drop "
                "--framework commpipe, use a GPU for --gpu)")
    if job.expert_imbalance < 1:
        return f"--expert-imbalance {job.expert_imbalance} must be >= 1 (busiest rank over the mean)"
    return None


def layout_problem(spec, layout, zero: int) -> str | None:
    """Why `layout` cannot run this model's experts (ep, ZeRO, recompute), or None."""
    moe = routed_spec(spec)
    if moe is None:
        if layout.ep != 1:
            return (f"--ep {layout.ep} shards routed experts; this model (arch={spec.arch}) has "
                    "none: drop --ep")
        return None
    group = layout.dp * layout.cp
    if layout.ep < 1 or group % layout.ep or moe.experts % layout.ep:
        ok = ep_choices(spec, group)
        why = (f"does not divide dp*cp = {layout.dp}*{layout.cp} = {group} (expert-parallel groups "
               "are carved from the data-parallel ranks)" if layout.ep < 1 or group % layout.ep
               else f"does not divide the model's {moe.experts} experts")
        return f"--ep {layout.ep} {why}; use --ep in {ok}"
    if layout.tp > 1 and M.tp_problem(moe, layout.tp):
        return M.tp_problem(moe, layout.tp)
    if zero > 1:
        return (f"--zero {zero} with routed experts is not priced (expert states shard over edp); "
                "use --zero 0 or 1")
    if layout.recompute == "op":
        return "per-op recompute (--recompute op) of MoE layers is not priced; use none, selective or full"
    return None


@lru_cache(maxsize=4096)
def rank_layer_ids(layers: int, schedule: str, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """The layer indices each pipeline rank holds, chunks placed as the schedule places them."""
    ranges = split_layers(layers, pp * vpp)
    return tuple(tuple(i for s in chunks for i in ranges[s])
                 for chunks in info(schedule).rank_chunks(pp, vpp))


def replicated_mlp_params(moe, layer_ids, tp: int) -> float:
    """Parameters of the MLPs of `layer_ids` that every EP rank holds, on one TP rank: dense MLPs
    and shared experts (split by TP), routers (replicated over TP)."""
    total = 0.0
    shared = M.swiglu_params(moe.hidden, moe.shared_experts * moe.expert_ffn)
    for i in layer_ids:
        if moe.is_moe_layer(i):
            total += M.router_param_count(moe) + shared / tp
        else:             # the dense MLP: the layer less its attention and two norms
            total += (M.layer_param_count(moe, i) - M.attention_param_count(moe) - 2 * moe.hidden) / tp
    return total


def expert_params(spec, layout, rank: int) -> float:
    """Routed-expert parameters pipeline rank `rank` holds: E/ep experts per MoE layer, 1/tp of
    each."""
    moe = routed_spec(spec)
    if moe is None:
        return 0.0
    ids = rank_layer_ids(moe.layers, layout.schedule, layout.pp, layout.vpp)[rank]
    moe_layers = sum(1 for i in ids if moe.is_moe_layer(i))
    return (moe_layers * moe.experts / layout.ep
            * M.swiglu_params(moe.hidden, moe.expert_ffn) / layout.tp)


def edp_size(layout) -> int:
    """Ranks holding the same experts: the dp*cp group over ep."""
    return layout.dp * layout.cp // layout.ep


def expert_state_bytes(spec, layout, job, rank: int, zero: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of the routed experts on pipeline rank `rank`:
    memory.py's bytes per parameter, the optimizer part sharded over edp under ZeRO-1."""
    n = expert_params(spec, layout, rank)
    if not n:
        return 0.0, 0.0, 0.0
    w_b, g_b, o_b = (2, (4 if job.grad_fp32 else 2), 12) if job.mixed else (4, 4, 8)
    return n * w_b, n * g_b, n * o_b / (edp_size(layout) if zero >= 1 else 1)


def mlp_fp8_copy_bytes(spec, layout, job, rank: int) -> float:
    """Bytes of the FP8 weight copies (FP8 and its transpose, 2 bytes per parameter) Transformer
    Engine caches beside bf16 weights for the MLPs of pipeline rank `rank` under --precision fp8
    without FP8 parameters (memory.state_bytes does the same for the attention's linears): routed
    experts, shared experts and dense MLPs; the router runs in bf16. 0 for a dense model, other
    precisions, or FP8 parameters (which replace the bf16 weight)."""
    if job.precision != "fp8" or job.fp8_params:
        return 0.0
    return 2.0 * sum(mlp_fp8_params(spec, layout, rank))


def mlp_fp8_params(spec, layout, rank: int) -> tuple[float, float]:
    """(routed-expert parameters, shared-expert and dense-MLP parameters) of pipeline rank
    `rank` on one TP rank: the MLP weights FP8 runs in FP8 (the routers stay bf16); (0, 0) for a
    dense model."""
    moe = routed_spec(spec)
    if moe is None:
        return 0.0, 0.0
    ids = rank_layer_ids(moe.layers, layout.schedule, layout.pp, layout.vpp)[rank]
    routers = M.router_param_count(moe) * sum(1 for i in ids if moe.is_moe_layer(i))
    return expert_params(spec, layout, rank), replicated_mlp_params(moe, ids, layout.tp) - routers


def routed_rows(layout, job, moe) -> float:
    """Token copies the busiest rank's experts process per micro-batch and MoE layer: its
    T = b*s/cp tokens times top_k (each rank sends T*top_k copies and, balanced, receives as
    many), times the expert imbalance."""
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    return tokens * moe.top_k * job.expert_imbalance


def mlp_activation_bytes(moe, i: int, layout, job, recompute: str | None = None) -> float:
    """Bytes layer i's MLP keeps for backward per micro-batch (module docstring); the MLP's
    input is the layer machinery's."""
    rc = layout.recompute if recompute is None else recompute
    if rc == "full":
        return 0.0
    a = job.activation_bytes
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    # intermediates of f columns kept per row: gate and up, the product (fc2's input), SiLU's
    # output when plain autograd keeps it; selective recompute keeps gate and up only
    per_f = 2 if rc == "selective" else (3 if job.fused_swiglu else 4)
    # under fp8 TE keeps the GEMM inputs it saves as FP8 (1 byte): fc1's routed rows and, when
    # kept, the product fc2 reads (memory.py does the same for the dense layers)
    fp8 = a - 1 if job.precision == "fp8" else 0.0
    prod = fp8 if per_f > 2 else 0.0
    if not moe.is_moe_layer(i):
        return tokens * moe.dense_ffn * (per_f * a - prod) / layout.tp
    rows = routed_rows(layout, job, moe)
    f = moe.expert_ffn / layout.tp                        # this TP rank's columns of an expert
    routed = rows * (2 * moe.hidden * a - moe.hidden * fp8 + f * (per_f * a - prod))
    shared = tokens * moe.shared_experts * f * (per_f * a - prod)
    return 4 * tokens * moe.experts + routed + shared


def rank_activation_bytes(spec, layout, job, rank: int) -> tuple[float, float]:
    """(all MLPs of pipeline rank `rank` for one micro-batch, the largest one MLP) in bytes."""
    moe = routed_spec(spec)
    if moe is None:
        return 0.0, 0.0
    ids = rank_layer_ids(moe.layers, layout.schedule, layout.pp, layout.vpp)[rank]
    kept = [mlp_activation_bytes(moe, i, layout, job) for i in ids]
    full = max((mlp_activation_bytes(moe, i, layout, job, "none") for i in ids), default=0.0)
    return sum(kept), full


def hardware_flops_per_token(moe, seq_len: int, recompute: str) -> float:
    """FLOPs the GPUs execute per token (moe_spec's count; full recompute runs the layers'
    forward twice; flash attention makes selective recompute replay no matmul)."""
    return M.flops_per_token(moe, seq_len, recompute=recompute == "full")
