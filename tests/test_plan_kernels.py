"""Framework kernels in the planner (commpipe/plan/kernels.py): torchtitan's per-op selective
checkpointing, eager non-GEMM ops and FSDP2's buffer copies. Expectations worked by hand.

    python -m pytest -q tests/test_plan_kernels.py
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from commpipe.models.spec import resolve_model
from commpipe.plan.cluster import default_cluster
from commpipe.plan.compute import gemm_time, layer_compute
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.frameworks import framework_job_fields
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.kernels import HBM_EFFICIENCY
from commpipe.plan.layout import Job, Layout, enumerate_layouts
from commpipe.plan.memory import GIB, layer_activation_bytes
from commpipe.plan.timing import stage_costs

A100 = resolve_gpu("a100-80gb")
# h=1024, 16 heads, 4 KV heads (kv 256), f=4096: tests/test_plan_coverage.py's small Llama
SPEC = resolve_model("arch=llama,layers=4,hidden=1024,heads=16,kv_heads=4,ffn_hidden=4096,vocab=32000")
T = 2048                                       # tokens of one micro-batch (mbs 1, seq 2048)
HBM = 2039e9 * HBM_EFFICIENCY                  # A100-80GB, bytes/s at the STREAM-like fraction


def test_op_sac_keeps_every_other_matmul_output_by_hand():
    # per token, bf16: block input 2h, wq out 2h, wv out 2kv, attention out 2h, w1 out 2f,
    # w2 out 2h = 8*1024 + 512 + 8192 = 16,896 B; x 2048 tokens = 34,603,008
    # + fp32 log-sum-exp 4 x 16 heads x 2048 = 131,072 -> 34,734,080
    job = Job(1, 2048)
    got = layer_activation_bytes(SPEC, Layout(recompute="op"), job)
    assert got == pytest.approx(34_734_080, rel=1e-12)
    # fewer bytes than Korthikanti's selective (12 + 1 + 16 = 29 T h here) and more than full (2 T h)
    assert layer_activation_bytes(SPEC, Layout(recompute="full"), job) < got \
        < layer_activation_bytes(SPEC, Layout(recompute="selective"), job)
    # with tp 2 and SP everything halves, the log-sum-exp too
    assert layer_activation_bytes(SPEC, Layout(tp=2, recompute="op"), job) == pytest.approx(got / 2)


def test_op_sac_recomputes_wk_wo_w3_and_the_elementwise_ops():
    # the backward replays wk [T,1024]x[1024,256], wo [T,1024]x[1024,1024], w3 [T,1024]x[1024,4096]
    # and the forward's non-GEMM work; nothing else changes against no recompute
    eff, job = Efficiency(), Job(1, 2048)
    cluster = default_cluster(A100, 1, 8)
    base = stage_costs(SPEC, Layout(recompute="none"), job, cluster, eff)
    op = stage_costs(SPEC, Layout(recompute="op"), job, cluster, eff)
    peak, ridge = A100.achievable_tflops("bf16") * 1e12, A100.ridge_flop_per_byte
    gemms = sum(gemm_time(2 * T * k * n, T, k, n, peak, eff, ridge) for k, n in ((1024, 256), (1024, 1024),
                                                                                  (1024, 4096)))
    elem = layer_compute(SPEC, Layout(), job, cluster, eff)["elem"]
    # 4 layers per stage (one stage); forward and weight-gradient work unchanged
    assert op.comp_i[0] - base.comp_i[0] == pytest.approx(4 * (gemms + elem), rel=1e-12)
    assert op.comp_f == base.comp_f and op.comp_w == base.comp_w


def test_op_is_searched_only_when_fixed():
    job = Job(8, 2048)
    free = enumerate_layouts(SPEC, job, 8)
    assert {lay.recompute for lay in free} == {"none", "selective", "full"}
    fixed = enumerate_layouts(SPEC, job, 8, {"recompute": "op"})
    assert fixed and {lay.recompute for lay in fixed} == {"op"}


def test_eager_elementwise_bytes_by_hand():
    # forward bytes per token (kernels.py): norms 8h + residual adds 12h = 20,480; RoPE 20(h+kv)
    # = 25,600; repeat_kv 2(2kv + 2h) = 5,120; output copy 4h = 4,096; SwiGLU 10f = 40,960
    # -> 96,256 B/token x 2048 = 197,132,288 B; backward 2 x that + 5 adds x 6h (30,720 B/token)
    # = 2 x 197,132,288 + 62,914,560 = 457,179,136 B
    eff, job = Efficiency(), Job(1, 2048, eager_ops=True)
    cluster = default_cluster(A100, 1, 8)
    lc = layer_compute(SPEC, Layout(), job, cluster, eff)
    assert lc["elem"] == pytest.approx(197_132_288 / HBM, rel=1e-12)
    assert lc["elem_b"] == pytest.approx(457_179_136 / HBM, rel=1e-12)
    # the fused default prices elementwise x the stored bytes, backward twice the forward
    fused = layer_compute(SPEC, Layout(), Job(1, 2048), cluster, eff)
    assert fused["elem_b"] == pytest.approx(2 * fused["elem"])
    # eager runs one GEMM per matrix: wq, wk, wv, wo, w1, w3, w2
    peak, ridge = A100.achievable_tflops("bf16") * 1e12, A100.ridge_flop_per_byte
    shapes = [(1024, 1024), (1024, 256), (1024, 256), (1024, 1024), (1024, 4096), (1024, 4096), (4096, 1024)]
    assert lc["gemm"] == pytest.approx(sum(gemm_time(2 * T * k * n, T, k, n, peak, eff, ridge)
                                           for k, n in shapes), rel=1e-12)


def test_fsdp2_copies_by_hand():
    # ZeRO-3 over 8 GPUs with FSDP2's copies: a layer has 15,206,400 parameters; forward copy-out
    # reads and writes its bf16 weights: 2 x 2 x 15,206,400 = 60,825,600 B; backward the same plus
    # the gradients read in bf16 and written in fp32 (grad_fp32): 6 x 15,206,400 -> 152,064,000 B
    eff = Efficiency()
    cluster = default_cluster(A100, 8, 8)
    job = Job(8, 2048, grad_fp32=True)
    lay = Layout(dp=8, zero=3)
    plain = stage_costs(SPEC, lay, job, cluster, eff)
    copies = stage_costs(SPEC, lay, replace(job, fsdp_copies=True), cluster, eff)
    assert copies.comp_f[0] - plain.comp_f[0] == pytest.approx(4 * 60_825_600 / HBM, rel=1e-9)
    assert copies.comp_i[0] - plain.comp_i[0] == pytest.approx(4 * 152_064_000 / HBM, rel=1e-9)
    # nothing without FSDP (ZeRO-1 keeps whole weights: no gathers to copy out of)
    z1 = Layout(dp=8, zero=1)
    assert stage_costs(SPEC, z1, replace(job, fsdp_copies=True), cluster, eff).comp_f == \
        stage_costs(SPEC, z1, job, cluster, eff).comp_f


def test_torchtitan_70b_selective_op_fits_at_batch_1_not_2():
    # torchtitan@0413364 docs/performance.md: Llama 2 70B with selective op AC ran with local
    # batch 1 on 64 A100-80GB; "local batch size 2 will cause an OOM error" (its footnote 1)
    spec = resolve_model("arch=llama,layers=80,hidden=8192,heads=64,kv_heads=8,ffn_hidden=28672,vocab=32000")
    job = Job(64, 4096, grad_fp32=True, eager_ops=True, fused_swiglu=False, fsdp_copies=True)
    cluster = default_cluster(A100, 64, 8)
    one = estimate(spec, Layout(dp=64, recompute="op", zero=3), job, cluster, simulate=False)
    two = estimate(spec, Layout(dp=64, micro_batch_size=2, recompute="op", zero=3),
                   replace(job, global_batch=128), cluster, simulate=False)
    assert one.feasible and one.memory_gb_per_gpu < 80
    assert not two.feasible and two.memory_gb_per_gpu * GIB > 80 * GIB


def test_megatron_overlap_of_the_dp_reduction_by_hand():
    from commpipe.plan.zero_costs import overlapped_dp_exposed

    # 2 chunks per rank, pp 4, 400M parameters (200M per chunk: the last 40M bucket is 0.2 of a
    # chunk's traffic); reduce-scatter 1.0 s, all-gather 0.6 s in all
    # reduction: chunk 1's 0.5 s behind the 4 cooldown backwards of chunk 0 (4 x 0.02): 0.42 left;
    #   chunk 0's 0.5 s behind its last backward (0.02): 0.48 -> 0.90
    # all-gather: chunk 1's 0.3 s behind 4 forwards of chunk 0 (0.04): 0.26; chunk 0's 0.3 s
    #   behind its first forward (0.01): 0.29 -> 0.55
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.01, 0.01], [0.02, 0.02], 4) == pytest.approx(1.45)
    # long passes hide all but the last (first) bucket: 0.2 x 0.5 + 0.2 x 0.3
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.5, 0.5], [1.0, 1.0], 4) == pytest.approx(0.16)
    # one chunk and a plain all-reduce: the former rule, max(ar - last backward, last bucket)
    assert overlapped_dp_exposed(1.0, 0.0, 400e6, [0.25], [0.5], 4) == pytest.approx(0.5)
    assert overlapped_dp_exposed(1.0, 0.0, 400e6, [2.0], [4.0], 4) == pytest.approx(0.1)


def test_megatron_lm_chained_parameter_gather_by_hand():
    from commpipe.plan.zero_costs import overlapped_dp_exposed

    # Megatron-LM at f2e5db4 chains the buckets' all-gathers: each chunk's 0.3 s gather (5 buckets
    # of 40M) hides only behind its own first forward, bucket by bucket: the step's first bucket
    # (0.3 x 0.2 = 0.06) plus, per chunk, 0.8 x max(0, 0.3 - forward); the reduction as before
    # short forwards (0.01): 0.06 + 2 x 0.8 x 0.29 = 0.524, + 0.90 reduction
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.01, 0.01], [0.02, 0.02], 4, chained=True) == \
        pytest.approx(1.424)
    # forwards of 0.1 s: launched a chunk ahead (Megatron-Core 0.9+), chunk 1's gather hides behind
    # the 4 forwards of chunk 0 and only chunk 0's 0.3 - 0.1 shows; chained, both chunks show 0.8 x
    # 0.2 after the first bucket: 0.06 + 0.32 = 0.38 (reduction 0.1: the last bucket)
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.1, 0.1], [1.0, 1.0], 4) == pytest.approx(0.3)
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.1, 0.1], [1.0, 1.0], 4, chained=True) == \
        pytest.approx(0.48)
    # long forwards hide every bucket but the first either way
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [0.5, 0.5], [1.0, 1.0], 4, chained=True) == \
        pytest.approx(0.16)
    assert framework_job_fields("megatron-lm", "bf16")["param_gather_chained"] is True
    assert "param_gather_chained" not in framework_job_fields("megatron", "bf16")
    # and the job's flag reaches the step: ZeRO-1 over 8 H100, 256-token micro-batches whose
    # forward is shorter than the 126,362,624 parameters' gather
    h100, params = resolve_gpu("h100"), 126_362_624
    cluster, lay, eff = default_cluster(h100, 8, 8), Layout(dp=8, zero=1), Efficiency()
    red, ag = cluster.reduce_scatter(4 * params, 8, 1), cluster.all_gather(2 * params, 8, 1)
    for chained in (False, True):
        c = stage_costs(SPEC, lay, Job(8, 256, grad_fp32=True, param_gather_chained=chained), cluster, eff)
        assert c.f[0] < ag / 2
        assert c.dp_exposed[0] == pytest.approx(
            overlapped_dp_exposed(red, ag, params, c.f, c.b, 1, chained=chained), rel=1e-9)


def test_the_last_bucket_to_reduce_holds_the_word_embedding_by_hand():
    from commpipe.plan.zero_costs import BUCKET_PARAMS, last_bucket_params, overlapped_dp_exposed

    # one chunk of 400M parameters whose passes hide everything but the last bucket: reduction
    # 1.0 s, all-gather 0.6 s; a 40M bucket shows 0.1 of each, a 100M embedding's 0.25
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [5.0], [10.0], 1) == pytest.approx(0.16)
    assert overlapped_dp_exposed(1.0, 0.6, 400e6, [5.0], [10.0], 1, last_bucket=100e6) == \
        pytest.approx(0.40)
    # the embedding's bucket is the last only on the rank holding stage 0, and only when it is
    # larger than a default bucket: 65,536 x 2,048 / tp 2 = 67,108,864 parameters
    big = resolve_model("arch=llama,layers=4,hidden=2048,heads=16,kv_heads=4,ffn_hidden=4096,vocab=65536")
    lay, job = Layout(tp=2, pp=2, zero=1), Job(8, 2048)
    assert last_bucket_params(big, lay, job, (0,)) == 67_108_864
    assert last_bucket_params(big, lay, job, (1,)) == BUCKET_PARAMS
    assert last_bucket_params(SPEC, lay, job, (0,)) == BUCKET_PARAMS     # 32,000 x 1,024 / 2
    # and the step prices it: ZeRO-1 over 8 H100 of a node, the reduction after the last
    # backward shows the embedding's share on stage 0, a default bucket's on stage 1
    h100 = resolve_gpu("h100")
    cluster, lay = default_cluster(h100, 16, 8), Layout(tp=2, pp=2, dp=4, zero=1)
    job = Job(64, 2048, grad_fp32=True)
    c = stage_costs(big, lay, job, cluster, Efficiency())
    from commpipe.plan.memory import stage_params

    for rank, (_, params) in enumerate(stage_params(big, lay, job)):
        red = cluster.reduce_scatter(4 * params, 4, 2)
        ag = cluster.all_gather(2 * params, 4, 2)
        last = 67_108_864 if rank == 0 else BUCKET_PARAMS
        assert c.dp_exposed[rank] == pytest.approx(overlapped_dp_exposed(
            red, ag, params, [c.f[rank]], [c.b[rank]], 2, last_bucket=last), rel=1e-9)


def test_op_sac_counts_the_replayed_matmuls_as_executed_flops():
    from commpipe.models.spec import flops_per_token
    from commpipe.plan.estimate import hardware_flops_per_token

    # 4 layers x 2 x (1024 x 256 + 1024 x 1024 + 1024 x 4096) = 4 x 2 x 5,505,024 = 44,040,192
    extra = hardware_flops_per_token(SPEC, 2048, "op", True) - flops_per_token(SPEC, 2048)
    assert extra == pytest.approx(44_040_192)


def test_commpipe_runtime_gathers_parameters_after_the_step():
    # ZeRO-1 over 8 GPUs of one node: Megatron hides the parameter all-gather in the next forward
    # (all but one 40M bucket of a 126M-parameter rank), commpipe's runtime runs it after the step
    eff = Efficiency()
    cluster = default_cluster(A100, 8, 8)
    lay = Layout(dp=8, zero=1)
    mega = stage_costs(SPEC, lay, Job(8, 2048), cluster, eff)
    own = stage_costs(SPEC, lay, Job(8, 2048, runtime="commpipe"), cluster, eff)
    params = 126_362_624
    ag = cluster.all_gather(params * 2, 8, 1)
    assert own.dp_total == mega.dp_total
    # forward of one micro-batch (4 layers + head) is far longer than the gather here, so only the
    # first bucket shows under Megatron
    assert mega.dp_exposed[0] < own.dp_exposed[0]
    assert own.dp_exposed[0] - mega.dp_exposed[0] == pytest.approx(ag - ag * 40e6 / params, rel=1e-9)


def test_eager_ops_and_fsdp_copies_flags_reach_the_job(capsys):
    from commpipe.cli import main

    model = "arch=llama,layers=4,hidden=1024,heads=16,kv_heads=4,ffn_hidden=4096,vocab=32000"
    base = ["estimate", "--model", model, "--gpu", "a100-80gb", "--gpus", "8", "--dp", "8",
            "--global-batch", "8", "--seq-len", "2048", "--zero", "3", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--eager-ops", "--fsdp-copies"]) == 0
    flagged = json.loads(capsys.readouterr().out)
    # the same as the library with those Job fields (eager autograd keeps SiLU's output: +2f/h)
    # on top of the default framework's (megatron on GPUs: fp32 gradient reduction under bf16)
    job = Job(8, 2048, **{**framework_job_fields("megatron", "bf16"), "eager_ops": True,
                          "fused_swiglu": False, "fsdp_copies": True})
    ref = estimate(SPEC, Layout(dp=8, zero=3), job, default_cluster(A100, 8, 8))
    assert flagged["step_time_s"] == pytest.approx(ref.step_time_s, rel=1e-12)
    assert flagged["activation_gb_per_gpu"] == pytest.approx(ref.activation_gb_per_gpu, rel=1e-12)
    # one micro-batch through 4 layers, no pipeline: FSDP2's copies come on top of the step, per
    # layer 60,825,600 B forward and 60,825,600 + 15,206,400 x (2 + 2) = 121,651,200 B backward
    # with bf16 gradients (test_fsdp2_copies_by_hand), and the eager ops' extra traffic besides
    copies = 4 * (60_825_600 + 121_651_200) / HBM
    assert flagged["step_time_s"] - plain["step_time_s"] > copies
    # SiLU's output kept: 2 bytes x f per token and layer more activations (4 layers, 2048 tokens)
    assert (flagged["activation_gb_per_gpu"] - plain["activation_gb_per_gpu"]) * GIB == \
        pytest.approx(4 * 2 * 4096 * 2048, rel=1e-9)
    # bad combinations fail early and say what to change
    assert main([*base[:-3], "--zero", "1", "--fsdp-copies"]) == 2
    assert "--fsdp-copies" in capsys.readouterr().err
    gpt = ["plan", "--model", "arch=gpt,layers=2,hidden=256,heads=4,vocab=1024", "--gpus", "2",
           "--global-batch", "2", "--seq-len", "128", "--eager-ops"]
    assert main(gpt) == 2
    assert "arch=gpt" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "2",
                 "--seq-len", "64", "--fsdp-copies"]) == 2
    assert "--gpu cpu" in capsys.readouterr().err


def test_te_userbuffers_take_sms_from_the_reduce_scatter_gemms_by_hand():
    # tp 2, 2048 tokens, the small Llama: QKV (2048, 1024, 768), projection (2048, 512, 1024),
    # fc1 (2048, 1024, 4096), fc2 (2048, 2048, 1024). Under TE's userbuffers the projection and
    # fc2 run beside their pipelined reduce-scatter on 132 - 16 of the H100's SMs: x 132/116
    h100 = resolve_gpu("h100")
    eff, cluster = Efficiency(), default_cluster(h100, 2, 8)
    peak, ridge = h100.achievable_tflops("bf16") * 1e12, h100.ridge_flop_per_byte

    def g(m, k, n):
        return gemm_time(2 * m * k * n, m, k, n, peak, eff, ridge)
    lay = Layout(tp=2, dp=1)
    on = layer_compute(SPEC, lay, Job(1, 2048, tp_overlap=True), cluster, eff)
    whole = g(2048, 1024, 768) + g(2048, 512, 1024) + g(2048, 1024, 4096) + g(2048, 2048, 1024)
    want_f = g(2048, 1024, 768) + g(2048, 1024, 4096) + (g(2048, 512, 1024) + g(2048, 2048, 1024)) * 132 / 116
    assert on["gemm_f"] == pytest.approx(want_f, rel=1e-12)
    assert on["gemm"] == pytest.approx(whole, rel=1e-12)        # backward GEMMs keep every SM
    costs = stage_costs(SPEC, lay, Job(1, 2048, tp_overlap=True), cluster, eff)
    nosm = default_cluster(resolve_gpu("h100,sms=0"), 2, 8)
    plain = stage_costs(SPEC, lay, Job(1, 2048, tp_overlap=True), nosm, eff)
    # 4 layers' forward GEMMs slower, the backward unchanged; an unknown SM count prices no margin
    assert costs.comp_f[0] - plain.comp_f[0] == pytest.approx(4 * (want_f - whole), rel=1e-9)
    assert costs.comp_i[0] == pytest.approx(plain.comp_i[0], rel=1e-12)
    off = layer_compute(SPEC, lay, Job(1, 2048), cluster, eff)
    assert off["gemm_f"] == off["gemm"] == pytest.approx(whole, rel=1e-12)


def test_cp_ring_merges_by_hand():
    # the small Llama, 2 H100s, sequences of 8192: CP2 with micro-batch 2 and DP2 with micro-batch 1
    # put the same 8192 tokens and the same attention FLOPs through a rank; CP2's ring adds the
    # merges: forward 6 B x cp 2 x 8192 tokens x 1024 (16 heads x 64) = 100,663,296 B per layer,
    # backward 6 x 2 x 8192 x (1024 + 2 x 256) = 150,994,944 B
    h100 = resolve_gpu("h100")
    hbm = 3350e9 * HBM_EFFICIENCY
    eff, cluster = Efficiency(), default_cluster(h100, 2, 8)
    job = Job(2, 8192)
    cp2 = stage_costs(SPEC, Layout(cp=2, dp=1, micro_batch_size=2), job, cluster, eff)
    dp2 = stage_costs(SPEC, Layout(dp=2), job, cluster, eff)
    assert cp2.comp_f[0] - dp2.comp_f[0] == pytest.approx(4 * 100_663_296 / hbm, rel=1e-9)
    assert cp2.comp_i[0] - dp2.comp_i[0] == pytest.approx(4 * 150_994_944 / hbm, rel=1e-9)
    assert cp2.cp_f[0] == 0.0                  # the ring itself hides behind attention
    # the all-gather form runs one attention call over the gathered K/V: no merges
    ag = stage_costs(SPEC, Layout(cp=2, dp=1, micro_batch_size=2), replace(job, cp_comm="allgather"),
                     cluster, eff)
    assert ag.comp_f[0] == pytest.approx(dp2.comp_f[0], rel=1e-12)


def test_megatron_unfused_cross_entropy_by_hand():
    # Megatron-LM's vocab_parallel_cross_entropy op by op (kernels.CE_BYTES): 38 bytes per logit
    # forward, 14 backward, against the fused rule's 10 and 10. The small Llama's head on one
    # H100, 2048 tokens x 32,000 logits = 65,536,000: forward +28, backward +4 bytes per logit
    h100 = resolve_gpu("h100")
    hbm, cluster, eff = 3350e9 * HBM_EFFICIENCY, default_cluster(h100, 1, 8), Efficiency()
    lay = Layout(dp=1)
    fused = stage_costs(SPEC, lay, Job(1, 2048), cluster, eff)
    mlm = stage_costs(SPEC, lay, Job(1, 2048, ce_kernel="megatron-unfused"), cluster, eff)
    assert mlm.comp_f[0] - fused.comp_f[0] == pytest.approx(28 * 65_536_000 / hbm, rel=1e-9)
    assert mlm.comp_i[0] - fused.comp_i[0] == pytest.approx(4 * 65_536_000 / hbm, rel=1e-9)
    # tp 2 holds half the vocabulary: half the logits per rank
    lay2, c2 = Layout(tp=2, dp=1), default_cluster(h100, 2, 8)
    d2 = (stage_costs(SPEC, lay2, Job(1, 2048, ce_kernel="megatron-unfused"), c2, eff).comp_f[0]
          - stage_costs(SPEC, lay2, Job(1, 2048), c2, eff).comp_f[0])
    assert d2 == pytest.approx(14 * 65_536_000 / hbm, rel=1e-9)
    # Megatron-LM's own script runs it (--cross-entropy-loss-fusion is opt-in); the other presets
    # keep the fused rule; an unknown kernel says what to use
    assert framework_job_fields("megatron-lm", "bf16")["ce_kernel"] == "megatron-unfused"
    assert "ce_kernel" not in framework_job_fields("megatron", "bf16")
    with pytest.raises(ValueError, match="megatron-unfused"):
        Job(1, 2048, ce_kernel="unfused")
