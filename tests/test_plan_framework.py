"""--framework presets and the prediction interval of `plan` / `estimate`."""

import json

import pytest

from commpipe.cli import main
from commpipe.plan import interval as iv
from commpipe.plan.frameworks import FRAMEWORKS, framework_job_fields

EST = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "2", "--dp", "4",
       "--global-batch", "32", "--seq-len", "4096", "--zero", "1"]


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_prints_and_carries_the_interval(capsys):
    d = _json(capsys, EST)
    # the interval is the prediction scaled by the stored held-out quantiles of measured/predicted
    tflops = d["tflops_per_gpu"]
    want_lo, want_hi = tflops * iv.RATIO_QUANTILES[10], tflops * iv.RATIO_QUANTILES[90]
    assert d["interval"]["level"] == 0.8
    assert d["interval"]["tflops_per_gpu_low"] == pytest.approx(want_lo)
    assert d["interval"]["tflops_per_gpu_high"] == pytest.approx(want_hi)
    assert main(EST) == 0
    out = capsys.readouterr().out
    assert f"{d['tflops_per_gpu']:.0f} TFLOP/s, 80% interval {want_lo:.0f}-{want_hi:.0f}" in out


def test_plan_prints_and_carries_the_interval(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "32",
            "--seq-len", "4096", "--top", "2", "--tp", "2", "--pp", "1", "--micro-batch-size", "1"]
    top = _json(capsys, argv)
    assert all(e["interval"]["tflops_per_gpu_high"] > e["interval"]["tflops_per_gpu_low"] for e in top)
    assert main(argv) == 0
    assert "80% interval" in capsys.readouterr().out


def test_moe_estimate_carries_the_range_of_published_moe_runs(capsys):
    """A MoE model's prediction is not covered by the dense runs' interval: it carries the range
    measured/predicted took on the published MoE runs (benchmarks/plan_moe_public.py)."""
    argv = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--tp", "1",
            "--pp", "4", "--vpp", "8", "--schedule", "interleaved", "--ep", "8", "--zero", "1",
            "--global-batch", "256", "--seq-len", "4096"]
    d = _json(capsys, argv)
    lo, hi = iv.MOE_RATIO_RANGE
    assert d["interval"]["range_of_published_moe_runs"] and "level" not in d["interval"]
    assert d["interval"]["from_public_rows"] == iv.MOE_ROWS
    assert d["interval"]["tflops_per_gpu_low"] == pytest.approx(d["tflops_per_gpu"] * lo)
    assert d["interval"]["tflops_per_gpu_high"] == pytest.approx(d["tflops_per_gpu"] * hi)
    assert lo < 1 < hi       # the published runs fall on both sides of their predictions
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "published MoE runs" in out and "80% interval" not in out
    assert "range_of_published_moe_runs" not in _json(capsys, EST)["interval"]   # dense: the 80%


def test_cpu_estimate_has_no_interval_from_gpu_runs(capsys):
    d = _json(capsys, ["estimate", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--pp", "2",
                       "--global-batch", "4", "--seq-len", "64"])
    assert "interval" not in d


def test_framework_presets_set_internals():
    assert framework_job_fields("megatron", "fp8")["fp8_params"] is True
    assert framework_job_fields("nemo", "fp8")["fp8_params"] is False
    assert framework_job_fields("megatron", "bf16")["grad_fp32"] is True
    assert framework_job_fields("megatron", "fp8")["grad_fp32"] is False
    assert framework_job_fields("torchtitan", "bf16")["eager_ops"] is True
    assert {"megatron", "nemo", "torchtitan", "commpipe"} <= set(FRAMEWORKS)


def test_default_framework_on_gpus_is_megatron(capsys):
    """Without --framework a GPU estimate is Megatron's: TP overlap on (TE userbuffers hide the
    TP collectives), unlike torchtitan's, which exposes them."""
    default = _json(capsys, EST)
    megatron = _json(capsys, EST + ["--framework", "megatron"])
    titan = _json(capsys, EST + ["--framework", "torchtitan"])
    assert default["step_time_s"] == megatron["step_time_s"]
    assert megatron["breakdown_s"]["tp"] < titan["breakdown_s"]["tp"]


def test_nemo_fp8_keeps_bf16_weights_beside_fp8_copies(capsys):
    fp8 = EST + ["--precision", "fp8"]
    nemo = _json(capsys, fp8 + ["--framework", "nemo"])
    megatron = _json(capsys, fp8 + ["--framework", "megatron"])
    assert nemo["memory_gb_per_gpu"] > megatron["memory_gb_per_gpu"]


def test_gpu_framework_on_cpu_fails_early(capsys):
    assert main(["estimate", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--pp", "2",
                 "--global-batch", "4", "--seq-len", "64", "--framework", "megatron"]) == 2
    assert "--gpu cpu prices commpipe's own runtime" in capsys.readouterr().err


def test_fa2_attention_runs_at_its_hopper_share_by_hand():
    """FlashAttention-2 (torchtitan's SDPA default, the llama3 preset) on an H100 runs attention
    at 35% of the bf16 peak (FlashAttention-3 paper): the layer's attention term is the causal half
    of 2*s*s*(qk+v) per head at that rate; on an A100, and under the fused kernel, the rate is
    attn_rel of a large GEMM's, as before."""
    from commpipe.models.family import resolve
    from commpipe.plan.cluster import default_cluster
    from commpipe.plan.compute import layer_compute
    from commpipe.plan.efficiency import MEASURED_GPU
    from commpipe.plan.gpus import resolve_gpu
    from commpipe.plan.layout import Job, Layout

    spec = resolve("llama3-8b")                         # 32 heads of 128
    layout = Layout(tp=2, cp=1, pp=1, dp=4, micro_batch_size=1)
    s = 8192
    flops = 2 * s * s * (128 + 128) * 32 / 2            # per micro-batch on one TP rank, full s x s
    for gpu, fa2_rate in (("h100", 0.35 * 989e12), ("a100-80gb", None)):
        cluster = default_cluster(resolve_gpu(gpu), 8, 8)
        g = cluster.gpu
        fused = layer_compute(spec, layout, Job(8, s), cluster, MEASURED_GPU)["attn"]
        fa2 = layer_compute(spec, layout, Job(8, s, attn_kernel="fa2"), cluster, MEASURED_GPU)["attn"]
        gemm_rate = g.tflops * 1e12 * g.mamf * MEASURED_GPU.e_max * MEASURED_GPU.attn_rel
        assert fused == pytest.approx(0.5 * flops / gemm_rate, rel=1e-12)
        assert fa2 == pytest.approx(0.5 * flops / (fa2_rate or gemm_rate), rel=1e-12)
    assert framework_job_fields("torchtitan", "bf16")["attn_kernel"] == "fa2"
    assert framework_job_fields("llama3", "bf16")["attn_kernel"] == "fa2"
    assert framework_job_fields("megatron", "bf16")["attn_kernel"] == "fused"
    assert framework_job_fields("nemo", "fp8")["attn_kernel"] == "fused"


def test_attention_kernel_flag_overrides_the_preset(capsys):
    argv = EST + ["--seq-len", "32768", "--global-batch", "8", "--recompute", "full"]
    fused = _json(capsys, argv)
    fa2 = _json(capsys, argv + ["--attention-kernel", "fa2"])
    titan = _json(capsys, argv + ["--framework", "torchtitan"])
    titan_fused = _json(capsys, argv + ["--framework", "torchtitan", "--attention-kernel", "fused"])
    assert fa2["step_time_s"] > 1.2 * fused["step_time_s"]       # attention-heavy at 32K tokens
    assert titan["step_time_s"] > titan_fused["step_time_s"]
    with pytest.raises(SystemExit):
        main(argv + ["--attention-kernel", "fa3"])
    assert "invalid choice: 'fa3'" in capsys.readouterr().err


def test_2021_preset_turns_off_what_its_stack_lacked_and_flags_still_apply(capsys):
    """megatron-lm-2021 prices attention without flash (the s x s scores kept and moved), TP without
    sequence parallelism and the DP all-reduce after the backward; --flash-attention on puts the
    kernel back on top of the preset, and the preset's job equals the flags given by hand."""
    from commpipe.plan.cli_inputs import job_from_args
    from commpipe.plan.layout import Job

    fields = framework_job_fields("megatron-lm-2021", "bf16")
    assert fields["flash_attention"] is False and fields["sequence_parallel"] is False
    assert fields["dp_overlap"] is False and fields["grad_fp32"] is False
    gpt = ["estimate", "--model", "arch=gpt,layers=24,hidden=2304,heads=24,vocab=51200", "--gpu",
           "a100-80gb", "--gpus", "32", "--tp", "2", "--dp", "16", "--global-batch", "512",
           "--seq-len", "2048", "--zero", "0", "--recompute", "full", "--micro-batch-size", "4"]
    era = _json(capsys, gpt + ["--framework", "megatron-lm-2021"])
    flash = _json(capsys, gpt + ["--framework", "megatron-lm-2021", "--flash-attention", "on"])
    sp = _json(capsys, gpt + ["--framework", "megatron-lm-2021", "--sequence-parallel"])
    overlap = _json(capsys, gpt + ["--framework", "megatron-lm-2021", "--dp-overlap"])
    by_hand = _json(capsys, gpt + ["--framework", "megatron-lm", "--flash-attention", "off",
                                   "--no-dp-overlap", "--no-sequence-parallel"])
    assert flash["step_time_s"] < 0.9 * era["step_time_s"]
    assert era["memory_gb_per_gpu"] > flash["memory_gb_per_gpu"]      # the s x s scores
    assert sp["memory_gb_per_gpu"] < era["memory_gb_per_gpu"]         # norms' inputs sharded
    assert overlap["breakdown_s"]["dp"] < era["breakdown_s"]["dp"]    # hidden behind the backward
    # megatron-lm's remaining differences: fp32 gradient reduction and TP overlap
    assert era["breakdown_s"]["dp"] < by_hand["breakdown_s"]["dp"]     # fp16 vs fp32 all-reduce
    both = _json(capsys, gpt + ["--framework", "megatron-lm-2021", "--tp-overlap", "--grad-fp32"])
    assert both["step_time_s"] == pytest.approx(by_hand["step_time_s"], rel=1e-12)
    assert both["memory_gb_per_gpu"] == pytest.approx(by_hand["memory_gb_per_gpu"], rel=1e-12)
    assert main(gpt + ["--sequence-parallel", "--no-sequence-parallel"]) == 2
    assert "contradict each other" in capsys.readouterr().err

    # `plan` searches only what that stack had: no CP, no ZeRO, 1F1B or interleaved pipelines,
    # full recompute or none (selective recompute came with sequence parallelism, 2022)
    top = _json(capsys, ["plan", "--model", "llama3-70b", "--gpu", "a100-80gb", "--gpus", "64",
                         "--global-batch", "64", "--seq-len", "8192", "--top", "5",
                         "--framework", "megatron-lm-2021"])
    assert top and all(e["cp"] == 1 and e["zero"] == 0 for e in top)
    assert {e["schedule"] for e in top} <= {"1f1b", "interleaved"}
    assert {e["recompute"] for e in top} <= {"none", "full"}

    class Args:     # what argparse gives `estimate` without those flags
        global_batch, seq_len, precision, framework, gpu = 8, 2048, "bf16", "megatron-lm-2021", "a100"
        flash_attention, no_dp_overlap, no_sequence_parallel = "auto", False, False
        grad_fp32 = tp_overlap = eager_ops = fsdp_copies = dp_overlap = sequence_parallel = False
        expert_imbalance, attention_kernel = 1.25, None
    job = job_from_args(Args)
    assert (job.flash_attention, job.sequence_parallel, job.dp_overlap) == (False, False, False)
    Args.framework = "megatron"
    assert job_from_args(Args) == Job(8, 2048, **framework_job_fields("megatron", "bf16"))


def test_fsdp_copies_without_zero3_names_the_stage_it_contradicts(capsys):
    """estimate's ZeRO stage is 0 unless --zero is given: the refusal says so and how to fix it,
    rather than naming a --zero 0 the user never typed."""
    argv = [a for a in EST if a not in ("--zero", "1")] + ["--fsdp-copies"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ZeRO stage 0 (--zero, 0 unless given to estimate): add --zero 3" in err
    assert main(EST[:-1] + ["3", "--fsdp-copies", "--json"]) == 0


def test_zero_beyond_one_is_refused_for_commpipes_runtime(capsys):
    """commpipe's runtime shards only the optimizer states (--zero1): --zero 2 or 3 on --gpu cpu
    (its runtime) fails with the reason and the fix, not an empty search."""
    from commpipe.cli import main

    for verb, extra in (("plan", []), ("estimate", ["--dp", "4"])):
        assert main([verb, "--model", "tiny", "--gpu", "cpu", "--gpus", "4", "--zero", "3",
                     "--global-batch", "8", "--seq-len", "32", *extra]) == 2
        err = capsys.readouterr().err
        assert "commpipe's runtime shards the optimizer states only" in err and "--zero 0 or 1" in err
