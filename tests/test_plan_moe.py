"""The layout planner on Mixture-of-Experts models (commpipe.plan.moe, plan.moe_costs): the EP
all-to-alls against the hand-derived formula, expert gradients reduced over edp, expert states
divided by ep, ep searched over the values training accepts, a Mixtral plan, clear errors.
No process is launched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from commpipe.cli import main
from commpipe.models import moe_spec as M
from commpipe.models.family import resolve
from commpipe.plan.cli_inputs import check_experts
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import default_efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout, enumerate_layouts
from commpipe.plan.memory import GIB, stage_memory
from commpipe.plan.search import search
from commpipe.plan.timing import stage_costs

# 2 MoE layers of 8 experts, top-2; hidden 256, expert width 512
SMALL = "arch=moe,layers=2,hidden=256,heads=4,kv_heads=4,vocab=1024,experts=8,top_k=2,expert_ffn=512"
H, F, E, K = 256, 512, 8, 2


def _setup(ep, dp=8, per_node=8, imbalance=1.0, mbs=2, seq=128, **job):
    spec = resolve(SMALL)
    cluster = default_cluster(resolve_gpu("h100"), dp, per_node)
    layout = Layout(tp=1, cp=1, pp=1, dp=dp, micro_batch_size=mbs, zero=1, ep=ep)
    return spec, layout, Job(global_batch=4 * dp * mbs, seq_len=seq, expert_imbalance=imbalance,
                             **job), cluster


@pytest.mark.parametrize("ep,per_node,imbalance", [(4, 8, 1.0), (4, 8, 1.5), (8, 2, 1.0)])
def test_all_to_all_time_matches_the_hand_formula(ep, per_node, imbalance):
    spec, layout, job, cluster = _setup(ep, per_node=per_node, imbalance=imbalance)
    costs = stage_costs(spec, layout, job, cluster, default_efficiency(cluster.gpu))
    # one dispatch (or combine): each rank's b*s*top_k token copies of h bf16 values, the busiest
    # rank receiving `imbalance` times its share; (ep-1)/ep of them leave the rank
    copies = layout.micro_batch_size * job.seq_len * K * imbalance
    nbytes = copies * H * 2
    nvlink = cluster.intra.bandwidth_gbps * 1e9
    if per_node >= ep:      # the EP group sits inside a node
        one = (ep - 1) / ep * nbytes / nvlink + cluster.intra.latency_s
    else:                   # peers on this node over NVLink, the rest over this GPU's NIC
        local = (per_node - 1) / ep * nbytes / nvlink
        remote = (ep - per_node) / ep * nbytes / (cluster.inter.bandwidth_gbps * 1e9)
        one = max(local, remote) + cluster.inter.latency_s
    layers = 2
    # dispatch + combine in the forward, their transposes in the backward
    assert costs.ep_f[0] == pytest.approx(layers * 2 * one, rel=1e-12)
    assert costs.ep_b[0] == pytest.approx(layers * 2 * one, rel=1e-12)
    est = estimate(spec, layout, job, cluster)
    m = est.microbatches
    assert est.breakdown["ep"] == pytest.approx(m * layers * 4 * one, rel=1e-12)
    assert est.moe["a2a_bytes_per_call"] == pytest.approx(nbytes)
    assert est.to_dict()["ep"] == ep


def test_all_to_alls_share_a_node_with_fewer_nics_than_gpus():
    """One NIC per node of 2 GPUs: both ranks of a node dispatch across it at the same layer,
    so each sends its remote share at half the NIC's rate (Cluster.node_links); with a NIC per
    GPU each has one of its own."""
    from commpipe.plan.moe_costs import all_to_all

    spec, layout, job, cluster = _setup(8, per_node=2)
    nbytes, nvlink, nic = 1e6, cluster.intra.bandwidth_gbps * 1e9, cluster.inter.bandwidth_gbps * 1e9
    local = 1 / 8 * nbytes / nvlink
    own = max(local, 6 / 8 * nbytes / nic) + cluster.inter.latency_s
    shared = max(local, 6 / 8 * nbytes / (nic / 2)) + cluster.inter.latency_s
    assert all_to_all(cluster, nbytes, 8, 1) == pytest.approx(own, rel=1e-12)
    assert all_to_all(replace(cluster, nics_per_node=1), nbytes, 8, 1) == pytest.approx(
        shared, rel=1e-12)
    assert all_to_all(replace(cluster, nics_per_node=2), nbytes, 8, 1) == pytest.approx(
        own, rel=1e-12)
    # EP groups of stride 2 (tp2 inside them): one member per node, yet the node's other rank
    # dispatches in the other EP group through the same NIC at the same time
    alone = 3 / 4 * nbytes / nic + cluster.inter.latency_s
    assert all_to_all(cluster, nbytes, 4, 2) == pytest.approx(alone, rel=1e-12)
    assert all_to_all(replace(cluster, nics_per_node=1), nbytes, 4, 2) == pytest.approx(
        3 / 4 * nbytes / (nic / 2) + cluster.inter.latency_s, rel=1e-12)
    # dp6's EP groups of 3 on nodes of 2 fill them unevenly: rank 2, alone on its node, sends
    # 2/3 of its bytes across, the slowest member
    six = default_cluster(resolve_gpu("h100"), 6, 2)
    assert six.node_counts(3, 1) == [2, 1]
    assert all_to_all(six, nbytes, 3, 1) == pytest.approx(
        2 / 3 * nbytes / nic + six.inter.latency_s, rel=1e-12)


def test_expert_gradients_reduce_over_edp_and_the_rest_over_dp():
    spec, layout, job, cluster = _setup(4)
    costs = stage_costs(spec, layout, job, cluster, default_efficiency(cluster.gpu))
    # commpipe.models.moe_spec's counts, by hand: the routed experts of both layers on this rank
    experts = 2 * (E // 4) * 3 * H * F
    replicated = M.param_count(spec) - 2 * E * 3 * H * F
    g = 4 if job.grad_fp32 else 2
    # ZeRO-1 with overlap: gradients reduce-scattered, bf16 weights all-gathered; experts over
    # edp = 8/4 = 2 ranks, every 4th (stride ep*tp), the rest over all 8
    want = (cluster.reduce_scatter(replicated * g, 8, 1) + cluster.all_gather(replicated * 2, 8, 1)
            + cluster.reduce_scatter(experts * g, 2, 4) + cluster.all_gather(experts * 2, 2, 4))
    assert costs.dp_total[0] == pytest.approx(want, rel=1e-9)


def test_expert_states_are_divided_by_ep():
    spec, base, job, cluster = _setup(1)
    mem = {ep: stage_memory(spec, Layout(tp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=ep), job,
                            [1.0])[0] for ep in (1, 2, 4, 8)}
    expert_params = 2 * E * 3 * H * F             # both MoE layers' routed experts
    for ep, m in mem.items():
        gone = expert_params * (1 - 1 / ep)
        assert (mem[1].weights_gb - m.weights_gb) * GIB == pytest.approx(gone * 2, rel=1e-9)
        assert (mem[1].grads_gb - m.grads_gb) * GIB == pytest.approx(gone * (4 if job.grad_fp32 else 2),
                                                                    rel=1e-9)
        # Adam's 12 bytes sharded over the ranks holding the same experts (edp = 8/ep)
        assert m.optimizer_gb * GIB == pytest.approx(
            (M.param_count(spec) - expert_params) * 12 / 8 + expert_params / ep * 12 / (8 // ep),
            rel=1e-9)


def test_expert_activations_count_the_routed_token_copies():
    spec, layout, job, cluster = _setup(2, imbalance=1.0)
    one = stage_memory(spec, layout, job, [1.0])[0].activations_gb
    more = stage_memory(spec, layout, Job(job.global_batch, job.seq_len, expert_imbalance=2.0),
                        [1.0])[0].activations_gb
    tokens = layout.micro_batch_size * job.seq_len
    # twice the copies: each keeps its dispatched input, gate, up, product and expert output
    per_copy = (2 * H + 3 * F) * 2
    assert (more - one) * GIB == pytest.approx(2 * tokens * K * per_copy, rel=1e-9)


def test_ep_is_searched_over_the_values_training_accepts():
    spec = resolve("moe-tiny")                       # 4 experts
    job = Job(global_batch=16, seq_len=128)
    layouts = enumerate_layouts(spec, job, 8)
    seen = {(lay.dp * lay.cp, lay.ep) for lay in layouts}
    for group, ep in seen:
        assert group % ep == 0 and 4 % ep == 0
    assert {ep for group, ep in seen if group == 8} == {1, 2, 4}
    assert {lay.ep for lay in enumerate_layouts(spec, job, 8, {"ep": 2})} == {2}
    # dense models keep one layout per combination, ep 1
    dense = enumerate_layouts(resolve("tiny"), job, 8)
    assert {lay.ep for lay in dense} == {1} and "ep" not in estimate(
        resolve("tiny"), dense[0], job, default_cluster(resolve_gpu("h100"), 8, 8)).to_dict()


def test_mixtral_plan_on_64_h100_is_feasible():
    spec = resolve("mixtral-8x7b")
    cluster = default_cluster(resolve_gpu("h100"), 64, 8)
    result = search(spec, Job(256, 4096), cluster, None, {"tp": 1, "pp": 4}, top=3)
    best = result.top[0]
    assert best.feasible and best.memory_gb_per_gpu <= 80
    assert best.layout.ep in (1, 2, 4, 8) and (best.layout.dp * best.layout.cp) % best.layout.ep == 0
    # model FLOPs are the family's: active experts only
    tokens = 256 * 4096
    assert best.tflops_per_gpu * 1e12 * best.step_time_s * 64 == pytest.approx(
        M.flops_per_token(spec, 4096) * tokens, rel=1e-9)
    assert best.to_dict()["ep"] == best.layout.ep


def test_plan_cli_on_mixtral_prints_a_feasible_layout(capsys):
    rc = main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--global-batch",
               "256", "--seq-len", "4096", "--tp", "1", "--pp", "4", "--schedule", "interleaved",
               "--micro-batch-size", "1", "--top", "1", "--json"])
    import json

    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out[0]["feasible"] and out[0]["ep"] == 8


@pytest.mark.parametrize("argv,message", [
    (["--model", "moe-tiny", "--ep", "3"], "--ep 3 does not divide dp*cp = 8*1 = 8"),
    (["--model", "moe-tiny", "--ep", "8"],
     "--ep 8 does not divide the model's 4 experts; use --ep in [1, 2, 4]"),
    (["--model", "tiny", "--ep", "2"], "--ep 2 shards routed experts"),
])
def test_estimate_refuses_what_it_cannot_price(argv, message, capsys):
    rc = main(["estimate", *argv, "--gpu", "h100", "--gpus", "8", "--global-batch", "8",
               "--seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    if "dp*cp" in message:
        assert "use --ep in [1, 2, 4]" in err


def test_plan_refuses_an_ep_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the model's 8 experts; "
                                         r"use --ep in \[1, 2, 4, 8\]"):
        check_experts(resolve("mixtral-8x7b"), Job(8, 512), 3)


def test_a_braided_schedule_hides_the_all_to_alls_its_braids_cover():
    # 1f1b exposes every all-to-all; dualpipev runs them on the simulator's EP stream, where
    # its plain (unbraided) warm-up and cool-down passes still expose theirs in full and its
    # braids hide part of the rest (commpipe/sim/units.py; estimate.braided_ep)
    from commpipe.plan.pipeline import generated_program

    spec = resolve(SMALL.replace("layers=2", "layers=4"))
    cluster = default_cluster(resolve_gpu("h100"), 8, 8)
    job = Job(global_batch=16, seq_len=256)
    ests = {s: estimate(spec, Layout(tp=2, pp=2, dp=2, schedule=s, ep=2), job, cluster)
            for s in ("1f1b", "dualpipev")}
    one = ests["1f1b"].moe["a2a_s_per_call"]
    m = ests["1f1b"].microbatches
    # each pipeline rank holds 2 of the 4 MoE layers (dualpipev: two chunks of one layer), and
    # each of its m forwards and m backwards runs 2 all-to-alls per layer
    full = m * 2 * 4 * one
    assert ests["1f1b"].breakdown["ep"] == pytest.approx(full, rel=1e-12)
    assert not ests["1f1b"].moe["a2a_braided"] and ests["dualpipev"].moe["a2a_braided"]
    prog = generated_program("dualpipev", 2, m, 2)
    plain = min(sum(1 for a in acts if a.pair is None and a.op in "FBI") for acts in prog.actions)
    exposed = ests["dualpipev"].breakdown["ep"]
    assert plain * 2 * one <= exposed + 1e-12       # one layer per chunk: 2 calls a pass
    assert exposed < 0.8 * full


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_the_priced_gemms_are_the_familys_flops(ep):
    # one FLOPs definition: at imbalance 1 the MLP GEMMs priced for a layer (router, shared and
    # routed experts, or the dense MLP) carry exactly moe_spec's forward FLOPs minus attention's
    from commpipe.plan.moe_costs import mlp_gemms

    spec = resolve(SMALL + ",shared_experts=2,dense_layers=1,dense_ffn=1024")
    layout = Layout(dp=8, micro_batch_size=2, ep=ep)
    job = Job(global_batch=16, seq_len=128, expert_imbalance=1.0)
    tokens = 2 * 128
    for fused in (True, False):
        for i in range(spec.layers):
            flops = sum(2 * m * k * n for m, k, n in mlp_gemms(spec, i, layout, job, fused))
            want = M.layer_flops_per_token(spec, 128, i) - M.attention_flops_per_token(spec, 128)
            assert flops / tokens == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_splits_every_expert_and_leaves_the_all_to_all(tp):
    """Expert tensor parallelism (commpipe.parallel.tensor_moe): each TP rank runs its f/tp
    columns of every routed and shared expert and of the dense MLP, the router whole; so the
    priced MLP GEMMs carry the family's FLOPs over tp (the router's whole), expert and shared
    weights are divided by tp (and routed ones by ep), the routed copies keep h-wide inputs and
    outputs and f/tp-wide intermediates, and the all-to-all moves what it moved at tp 1."""
    from commpipe.plan.moe import expert_params, mlp_activation_bytes, replicated_mlp_params
    from commpipe.plan.moe_costs import a2a_bytes, mlp_gemms

    spec = resolve(SMALL + ",shared_experts=2,dense_layers=1,dense_ffn=1024")
    ep, seq, mbs = 2, 128, 2
    layout = Layout(tp=tp, dp=8, micro_batch_size=mbs, ep=ep)
    job = Job(global_batch=16, seq_len=seq, expert_imbalance=1.0)
    tokens = mbs * seq
    router = 2 * H * E                                  # forward FLOPs per token
    for i in range(spec.layers):
        flops = sum(2 * m * k * n for m, k, n in mlp_gemms(spec, i, layout, job, fused=True))
        mlp = M.layer_flops_per_token(spec, seq, i) - M.attention_flops_per_token(spec, seq)
        want = mlp / tp if i == 0 else router + (mlp - router) / tp
        assert flops / tokens == pytest.approx(want, rel=1e-12), i
    # parameters on one rank, by hand: layer 1's 8/ep routed experts and 2 shared experts of
    # width F, each 3 H F, split over tp; its router H x E whole; layer 0's dense MLP over tp
    assert expert_params(spec, layout, 0) == pytest.approx(E / ep * 3 * H * F / tp, rel=1e-12)
    assert replicated_mlp_params(spec, [0, 1], tp) == pytest.approx(
        3 * H * 1024 / tp + H * E + 2 * 3 * H * F / tp, rel=1e-12)
    # activations of layer 1 (no recompute, fused SwiGLU keeps gate, up and product): fp32
    # router scores, each copy's input and output h wide and 3 f/tp, the shared experts' 3 S f/tp
    a = job.activation_bytes
    copies = tokens * K
    assert mlp_activation_bytes(spec, 1, layout, job) == pytest.approx(
        4 * tokens * E + copies * (2 * H + 3 * F / tp) * a + tokens * 2 * F * 3 / tp * a,
        rel=1e-12)
    assert a2a_bytes(spec, layout, job) == pytest.approx(copies * H * a, rel=1e-12)


def test_fp8_prices_expert_gemms_in_fp8_the_router_in_bf16_and_the_casts():
    """--precision fp8 on a MoE model: each MoE layer's forward MLP compute is its router GEMM at
    the bf16 rate plus every shared and routed expert GEMM at the FP8 rate (kernels.fp8_gemm_time)
    plus the HBM-bound work, which gains the FP8 casts of those GEMMs' inputs (4 bytes per M*K
    element); the dense layer likewise without a router. Worked against bf16 on the same layout."""
    from commpipe.plan.compute import gemm_time
    from commpipe.plan.kernels import fp8_gemm_time, hbm_rate
    from commpipe.plan.moe import mlp_activation_bytes
    from commpipe.plan.moe_costs import mlp_gemms

    spec = resolve(SMALL + ",shared_experts=1,dense_layers=1,dense_ffn=1024")
    cluster = default_cluster(resolve_gpu("h100"), 8, 8)
    gpu, eff = cluster.gpu, default_efficiency(cluster.gpu)
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=2)
    # the MoE layers' host operations are test_moe_host_ops_*'s business
    bf16, fp8 = (Job(global_batch=32, seq_len=128, precision=p, expert_imbalance=1.0,
                     moe_host_ops=False) for p in ("bf16", "fp8"))
    peak, ridge, hbm = gpu.achievable_tflops("bf16") * 1e12, gpu.ridge_flop_per_byte, hbm_rate(gpu)

    def bf16_gemms(shapes):
        return sum(gemm_time(2 * m * k * n, m, k, n, peak, eff, ridge) for m, k, n in shapes)

    def by_hand(job, i):
        shapes = mlp_gemms(spec, i, layout, job, fused=True)
        router = shapes[:1] if i >= 1 else []
        rest = shapes[len(router):]
        gemm = bf16_gemms(router) + (sum(fp8_gemm_time(*s, gpu, eff) for s in rest)
                                     if job.precision == "fp8" else bf16_gemms(rest))
        elem = eff.elementwise * mlp_activation_bytes(spec, i, layout, job, "none") / hbm
        if job.precision == "fp8":
            elem += 4.0 * sum(m * k for m, k, _ in rest) / hbm
        return gemm, elem

    for job in (bf16, fp8):
        on = stage_costs(spec, layout, job, cluster, eff)
        (g0, e0), (g1, e1) = by_hand(job, 0), by_hand(job, 1)
        mlp_f = g0 + e0 + g1 + e1
        # the MLP part of the stage's forward: the stage priced with these MLPs, minus the layer
        # machinery's (attention) part, which is the same in both precisions' own terms
        attention_only = _attention_forward(spec, layout, job, cluster, eff)
        assert on.comp_f[0] - attention_only == pytest.approx(mlp_f, rel=1e-9), job.precision
    # FP8 makes the expert GEMMs faster, not the whole MLP twice as fast
    assert by_hand(fp8, 1)[0] < by_hand(bf16, 1)[0] < 2 * by_hand(fp8, 1)[0]


def _attention_forward(spec, layout, job, cluster, eff):
    """The stage's forward compute without the MoE MLPs (what add_routed_costs adds to)."""
    from unittest import mock

    with mock.patch("commpipe.plan.timing.add_routed_costs"):
        return stage_costs(spec, layout, job, cluster, eff).comp_f[0]


def test_fp8_memory_keeps_fp8_inputs_and_caches_weight_copies_without_fp8_params():
    """Under fp8 the routed rows' fc1 inputs and products are saved as FP8 (1 byte instead of 2),
    and without FP8 parameters TE caches an FP8 weight and its transpose (2 bytes) beside every
    routed, shared and dense MLP weight; the router has none. With FP8 parameters: no copy."""
    from commpipe.plan.moe import mlp_activation_bytes, mlp_fp8_copy_bytes

    spec = resolve(SMALL + ",shared_experts=1,dense_layers=1,dense_ffn=1024")
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=2)
    bf16 = Job(global_batch=32, seq_len=128, expert_imbalance=1.0)
    cached = Job(global_batch=32, seq_len=128, precision="fp8", fp8_params=False, expert_imbalance=1.0)
    fp8w = Job(global_batch=32, seq_len=128, precision="fp8", fp8_params=True, expert_imbalance=1.0)
    tokens = 2 * 128
    rows = tokens * K
    # fused SwiGLU keeps gate, up and the product; the fc1 input and the product lose a byte
    assert mlp_activation_bytes(spec, 1, layout, bf16) - mlp_activation_bytes(spec, 1, layout, cached) \
        == pytest.approx(rows * (H + F) + tokens * F, rel=1e-12)
    assert mlp_activation_bytes(spec, 0, layout, bf16) - mlp_activation_bytes(spec, 0, layout, cached) \
        == pytest.approx(tokens * 1024, rel=1e-12)
    experts = E / 2 * 3 * H * F                    # layer 1's routed experts on this EP rank
    linears = experts + 3 * H * F + 3 * H * 1024   # + its shared expert + layer 0's dense MLP
    assert mlp_fp8_copy_bytes(spec, layout, cached, 0) == pytest.approx(2 * linears, rel=1e-12)
    assert mlp_fp8_copy_bytes(spec, layout, fp8w, 0) == 0.0
    assert mlp_fp8_copy_bytes(spec, layout, bf16, 0) == 0.0
    mem = {j.fp8_params: stage_memory(spec, layout, j, [1.0])[0].weights_gb for j in (cached, fp8w)}
    assert (mem[False] - mem[True]) * GIB == pytest.approx(
        2 * linears + _attention_linear_copies(spec, layout, cached), rel=1e-9)


def _attention_linear_copies(spec, layout, job):
    from commpipe.plan.memory import linear_params_per_layer

    return 2.0 * spec.layers * linear_params_per_layer(spec, layout.tp)


def test_mixtral_fp8_is_priced_and_faster_than_bf16_by_less_than_twice():
    cluster = default_cluster(resolve_gpu("h100"), 64, 8)
    spec = resolve("mixtral-8x7b")
    layout = Layout(tp=1, cp=1, pp=4, dp=16, vpp=8, micro_batch_size=1, schedule="interleaved",
                    zero=1, ep=8)
    steps = {p: estimate(spec, layout, Job(256, 4096, precision=p, expert_imbalance=1.0),
                         cluster).step_time_s for p in ("bf16", "fp8")}
    assert steps["fp8"] < steps["bf16"] < 2 * steps["fp8"]


@pytest.mark.parametrize("fused", [True, False])
def test_wide_heads_are_priced_at_their_width(fused):
    """A head_dim set apart from hidden / heads (Qwen3-MoE: 128 at hidden 2048, 32 heads): the
    attention GEMMs the layer machinery prices carry the family's projection FLOPs, and the Q and
    O the layer keeps for backward are heads * head_dim wide."""
    from commpipe.plan.kernels import layer_gemms
    from commpipe.plan.memory import layer_activation_bytes

    narrow = resolve(SMALL)
    wide = resolve(SMALL + ",head_dim=128")                # q width 512 at hidden 256
    layout = Layout(tp=2, dp=4, micro_batch_size=2, ep=2)
    job = Job(global_batch=16, seq_len=128, expert_imbalance=1.0)
    tokens = 2 * 128
    for spec in (narrow, wide):
        attention = layer_gemms(spec, layout, job, fused=fused)
        flops = sum(2 * m * k * n for m, k, n in attention) * layout.tp / tokens
        projections = M.attention_flops_per_token(spec, 128) - 2 * 128 * spec.heads * 2 * spec.head_dim
        assert flops == pytest.approx(projections, rel=1e-12)
    assert wide.q_width == 2 * H and narrow.q_width == H
    # Q and O (2 bytes each per q-width element), K and V, split by TP: only Q and O widen
    grow = layer_activation_bytes(wide, layout, job) - layer_activation_bytes(narrow, layout, job)
    kv_grow = 4 * tokens * (wide.kv_dim - narrow.kv_dim) / layout.tp
    assert grow == pytest.approx(4 * tokens * (wide.q_width - narrow.q_width) / layout.tp + kv_grow,
                                 rel=1e-12)


def test_wide_heads_under_fp8_cast_and_keep_their_output_at_its_width():
    """Under fp8 the output projection's input is cast at heads * head_dim (kernels.fp8_cast_time)
    and its FP8 copy kept at that width: both grow with the head width, not the hidden size. MLA
    casts and keeps heads * v_head_dim (DeepSeek-V3: 16,384 at hidden 7,168)."""
    from commpipe.plan.kernels import fp8_cast_time, hbm_rate
    from commpipe.plan.memory import layer_activation_bytes

    narrow, wide = resolve(SMALL), resolve(SMALL + ",head_dim=128")
    layout = Layout(tp=2, dp=4, micro_batch_size=2, ep=2)
    bf16 = Job(global_batch=16, seq_len=128, expert_imbalance=1.0)
    fp8 = Job(global_batch=16, seq_len=128, precision="fp8", expert_imbalance=1.0)
    gpu = resolve_gpu("h100")
    tokens, o_grow = 2 * 128, (wide.o_width - narrow.o_width) / layout.tp
    assert (fp8_cast_time(wide, layout, fp8, gpu) - fp8_cast_time(narrow, layout, fp8, gpu)) \
        * hbm_rate(gpu) == pytest.approx(4.0 * tokens * o_grow, rel=1e-12)

    def fp8_extra(spec):    # what fp8 changes in the saved bytes of one layer
        return layer_activation_bytes(spec, layout, fp8) - layer_activation_bytes(spec, layout, bf16)
    # the FP8 copy of O (1 byte per element) widens with it
    assert fp8_extra(wide) - fp8_extra(narrow) == pytest.approx(tokens * o_grow, rel=1e-12)
    v3 = resolve("deepseek-v3")
    assert (v3.q_width, v3.o_width) == (7168, 128 * 128)


def test_fp8_optimizer_casts_every_mlp_weight_once_per_step():
    """The per-step FP8 cast of new weights covers routed experts (sharded over edp), shared
    experts and dense MLPs (over the ZeRO group), not the router: 4 bytes of HBM traffic each."""
    from commpipe.plan.kernels import hbm_rate
    from commpipe.plan.moe_costs import expert_optimizer_seconds

    spec = resolve(SMALL + ",shared_experts=1,dense_layers=1,dense_ffn=1024")
    cluster = default_cluster(resolve_gpu("h100"), 8, 8)
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=2)
    bf16 = Job(global_batch=32, seq_len=128, expert_imbalance=1.0)
    fp8 = Job(global_batch=32, seq_len=128, precision="fp8", expert_imbalance=1.0)
    extra = (expert_optimizer_seconds(spec, layout, fp8, cluster, 0, 1)
             - expert_optimizer_seconds(spec, layout, bf16, cluster, 0, 1)) * hbm_rate(cluster.gpu)
    experts = E / 2 * 3 * H * F                   # layer 1's routed experts on this EP rank
    linears = 3 * H * F + 3 * H * 1024            # its shared expert + layer 0's dense MLP
    assert extra == pytest.approx(4.0 * (experts / (8 // 2) + linears / 8), rel=1e-12)
    # split over two stages, the first holds only the dense layer: its MLP is cast all the same
    pp2 = Layout(tp=1, cp=1, pp=2, dp=4, micro_batch_size=2, zero=1, ep=2)
    first = (expert_optimizer_seconds(spec, pp2, fp8, cluster, 0, 1)
             - expert_optimizer_seconds(spec, pp2, bf16, cluster, 0, 1)) * hbm_rate(cluster.gpu)
    assert first == pytest.approx(4.0 * 3 * H * 1024 / 4, rel=1e-12)


def test_estimate_says_ep1_has_no_all_to_all(capsys):
    argv = ["estimate", "--model", "moe-tiny", "--gpu", "h100", "--gpus", "8", "--global-batch",
            "8", "--seq-len", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no all-to-all (ep 1)" in out and "per MoE layer" not in out
    assert main(argv + ["--ep", "4"]) == 0
    assert "4 per MoE layer and micro-batch, exposed" in capsys.readouterr().out
