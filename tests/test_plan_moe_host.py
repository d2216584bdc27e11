"""The host operations a Megatron-Core MoE layer adds to its pass (commpipe.plan.moe_host),
against the counts of its docstring worked by hand: per local expert, per FP8 recipe, with
shared experts, under full recompute; none on a CPU, under commpipe's runtime or torchtitan.
No process is launched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from commpipe.models.family import resolve
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import MEASURED_GPU
from commpipe.plan.estimate import estimate
from commpipe.plan.frameworks import framework_job_fields
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout
from commpipe.plan.timing import stage_costs

# 2 MoE layers of 16 experts, top-2; hidden 256, expert width 512
SMALL = "arch=moe,layers=2,hidden=256,heads=4,kv_heads=4,vocab=1024,experts=16,top_k=2,expert_ffn=512"
# one op: twice the fitted per-layer-pass cost over Megatron-DeepSpeed's 19 + 19 + 32 operations
# of a full-recompute layer (forward, replay, backward)
OP_S = 2 * MEASURED_GPU.overhead_s / 70


def _costs(spec, layout, job, gpu="h100"):
    cluster = default_cluster(resolve_gpu(gpu), layout.gpus, 8)
    return stage_costs(spec, layout, job, cluster, MEASURED_GPU)


def _added(spec, layout, job, gpu="h100"):
    """(forward, input-gradient) seconds the host term adds to stage 0's passes per
    micro-batch."""
    on = _costs(spec, layout, job, gpu)
    off = _costs(spec, layout, replace(job, moe_host_ops=False), gpu)
    return on.comp_f[0] - off.comp_f[0], on.comp_i[0] - off.comp_i[0]


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_bf16_adds_the_moe_blocks_ops_beyond_a_dense_mlp_per_local_expert(ep):
    """bf16, L = 16/ep local experts: forward 32 + 2L - 3, backward 19 + 4L - 5 operations a
    MoE layer, at OP_S each, on both MoE layers of the stage."""
    spec = resolve(SMALL)
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=ep)
    job = Job(global_batch=32, seq_len=128, expert_imbalance=1.0)
    local = 16 // ep
    f, i = _added(spec, layout, job)
    assert f == pytest.approx(2 * (29 + 2 * local) * OP_S, rel=1e-9)
    assert i == pytest.approx(2 * (14 + 4 * local) * OP_S, rel=1e-9)


@pytest.mark.parametrize("gpu,per_expert", [("h100", (10, 12)), ("b200", (4, 6))])
def test_fp8_counts_the_recipe_megatron_bridge_runs_on_the_gpu(gpu, per_expert):
    """FP8: per-tensor current scaling on Hopper (35 + 10L, 22 + 12L against a dense MLP's 10,
    13), MXFP8 on Blackwell (39 + 4L, 30 + 6L against 9, 15)."""
    spec = resolve(SMALL)
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=4)
    job = Job(global_batch=32, seq_len=128, precision="fp8", expert_imbalance=1.0)
    fixed = {"h100": (35 - 10, 22 - 13), "b200": (39 - 9, 30 - 15)}[gpu]
    f, i = _added(spec, layout, job, gpu)
    assert f == pytest.approx(2 * (fixed[0] + per_expert[0] * 4) * OP_S, rel=1e-9)
    assert i == pytest.approx(2 * (fixed[1] + per_expert[1] * 4) * OP_S, rel=1e-9)


def test_shared_experts_keep_the_dense_mlps_ops_and_full_recompute_replays_the_forward():
    """With shared experts the dense MLP's operations are not taken off (the shared MLP issues
    them); full recompute replays the forward's operations in the backward."""
    spec = resolve(SMALL + ",shared_experts=1")
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=8,
                    recompute="full")
    job = Job(global_batch=32, seq_len=128, expert_imbalance=1.0)
    f, i = _added(spec, layout, job)
    fwd, bwd = 32 + 2 * 2, 19 + 4 * 2
    assert f == pytest.approx(2 * fwd * OP_S, rel=1e-9)
    assert i == pytest.approx(2 * (bwd + fwd) * OP_S, rel=1e-9)


def test_nothing_is_added_on_a_cpu_under_commpipes_runtime_or_torchtitan():
    spec = resolve(SMALL)
    layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=2, zero=1, ep=2)
    titan = Job(global_batch=32, seq_len=128, **framework_job_fields("torchtitan", "bf16"))
    assert _added(spec, layout, titan) == (0.0, 0.0)
    own = Job(global_batch=32, seq_len=128, runtime="commpipe")
    assert _added(spec, layout, own) == (0.0, 0.0)
    cpu = Job(global_batch=32, seq_len=128)
    assert _added(spec, layout, cpu, gpu="cpu") == (0.0, 0.0)


def test_more_local_experts_cost_more_host_time_at_a_fixed_token_count():
    """Qwen3-30B-A3B's shape on 8 H100 (bf16): ep 2 leaves 64 local experts a rank, ep 8 16;
    the same tokens and FLOPs per rank, but ep 2's step carries 4x the per-expert calls."""
    spec = resolve("arch=moe,name=q,layers=4,hidden=2048,heads=32,kv_heads=4,head_dim=128,"
                   "vocab=151936,experts=128,top_k=8,expert_ffn=768")
    cluster = default_cluster(resolve_gpu("h100"), 8, 8)
    job = Job(global_batch=64, seq_len=4096, expert_imbalance=1.0)
    steps = {}
    for ep in (2, 8):
        layout = Layout(tp=1, cp=1, pp=1, dp=8, micro_batch_size=1, zero=1, ep=ep)
        on = estimate(spec, layout, job, cluster).step_time_s
        off = estimate(spec, layout, replace(job, moe_host_ops=False), cluster).step_time_s
        steps[ep] = on - off
    # 8 micro-batches x 4 layers, the per-expert operations (2 + 4 per expert) at OP_S
    assert steps[2] - steps[8] == pytest.approx(8 * 4 * 6 * (64 - 16) * OP_S, rel=0.02)


def test_estimate_reports_the_counted_operations_and_their_time(capsys):
    """`estimate --json` carries a MoE layer's added operations and seconds (moe.host_*), and
    the text report prints them: Mixtral 8x7B at ep 8 (one local expert), bf16: 29 + 2 forward,
    14 + 4 backward."""
    import json

    from commpipe.cli import main

    argv = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--tp", "1",
            "--pp", "4", "--ep", "8", "--zero", "1", "--global-batch", "256", "--seq-len", "4096"]
    main(argv + ["--json"])
    moe = json.loads(capsys.readouterr().out)["moe"]
    assert moe["host_ops_per_layer"] == {"forward": 31, "backward": 18}
    assert moe["host_s_per_layer"]["forward"] == pytest.approx(31 * OP_S, rel=1e-9)
    assert moe["host_s_per_layer"]["backward"] == pytest.approx(18 * OP_S, rel=1e-9)
    main(argv)
    assert "issues 31 + 18 operations" in capsys.readouterr().out


def test_no_moe_host_ops_leaves_the_term_out_and_only_it(capsys):
    """--no-moe-host-ops (MoE layers captured in CUDA graphs): no operations counted or printed,
    and the step shorter by the term alone (a few percent for Mixtral at ep 8, bf16)."""
    import json

    from commpipe.cli import main

    argv = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--tp", "1",
            "--pp", "4", "--ep", "8", "--zero", "1", "--global-batch", "256", "--seq-len", "4096",
            "--json"]
    main(argv)
    on = json.loads(capsys.readouterr().out)
    main(argv + ["--no-moe-host-ops"])
    off = json.loads(capsys.readouterr().out)
    assert off["moe"]["host_ops_per_layer"] == {"forward": 0, "backward": 0}
    assert off["moe"]["host_s_per_layer"] == {"forward": 0.0, "backward": 0.0}
    assert 0 < on["step_time_s"] - off["step_time_s"] < 0.1 * on["step_time_s"]
    main(argv[:-1] + ["--no-moe-host-ops"])
    assert "a MoE layer issues" not in capsys.readouterr().out


def test_a_layout_that_loses_on_its_all_to_alls_is_not_blamed_on_compute():
    """`plan`'s "why common alternatives lose" names the exposed EP all-to-alls when they are
    the term that grew most (full recompute replays them), not the compute, which shrank."""
    from commpipe.plan.search import explain_loss

    spec = resolve("arch=moe,name=q,layers=4,hidden=2048,heads=32,kv_heads=4,head_dim=128,"
                   "vocab=151936,experts=128,top_k=8,expert_ffn=768")
    cluster = default_cluster(resolve_gpu("b200"), 8, 8)
    job = Job(global_batch=128, seq_len=4096, precision="fp8", expert_imbalance=1.0)

    def est(**kw):
        return estimate(spec, Layout(tp=1, cp=1, pp=1, dp=8, zero=1, ep=8, **kw), job, cluster)

    best, alt = est(micro_batch_size=4), est(micro_batch_size=16, recompute="full")
    assert alt.breakdown["ep"] - best.breakdown["ep"] > alt.breakdown["compute"] - best.breakdown["compute"]
    line = explain_loss(alt, best, cluster)
    assert "EP8 all-to-alls inside a node expose" in line and "compute" not in line


@pytest.mark.parametrize("name,key", [("b200", "mxfp8"), ("gb300", "mxfp8"), ("h100", "current"),
                                      ("bigchip", "current")])
def test_the_fp8_recipe_follows_the_gpu_generation_not_a_first_letter(name, key):
    from commpipe.plan.moe_host import recipe

    gpu = replace(resolve_gpu("h100"), name=name)
    assert recipe(Job(8, 128, precision="fp8"), gpu) == key
    assert recipe(Job(8, 128), gpu) == "bf16"
