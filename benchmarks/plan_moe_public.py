"""The planner on a published Mixture-of-Experts run it was never fitted on (docs/moe.md,
"Planning").

    python benchmarks/plan_moe_public.py          # a few seconds, no GPU
    python benchmarks/plan_moe_public.py --write-interval   # and store the range plan prints

Published runs: Mixtral 8x7B in bf16 on 64 H100 (below), and the MoE rows of Megatron-Bridge
25.11's and 26.02's performance summaries the planner can express, all FP8
(`megatron_bridge_rows`; the 26.02 rows held out: priced only after the last change).

NVIDIA's Megatron-Core MoE README (megatron/core/transformer/moe/README.md in NVIDIA/Megatron-LM)
gives, for dropless Mixtral 8x7B in bf16 with the all-to-all token dispatcher on 64 H100 80GB
(8 per node, NVLink 4, InfiniBand 8x400 Gbit/s, PyTorch 24.04 with TransformerEngine 1.9), the
reference parallel mapping of MCore v0.8: sequence length 4096, TP1 EP8 PP4 VP8, micro-batch 1,
global batch 256 (its "Reference Best Parallel Mapping" table), and its headline throughput:
"This boosts Mixtral 8X7B bf16 training to achieve 438 TFLOPS as of MCore v0.8" (README of the
core_r0.8.0 branch); later versions of the same README state "With MCore v0.9, we've achieved
remarkable performance of 468 TFLOPS for Mixtral 8X7B bf16 training", still listing the v0.8
mapping table and no other mapping for that figure. The README names no global throughput and
no per-layer timing, so only the TFLOP/s per GPU are compared, and the mapping the 468 figure
was measured with is the table's by assumption.

Inputs: the model (mixtral-8x7b), the GPU and cluster, the stated layout (the distributed
optimizer: ZeRO-1; overlapped gradient reduction), the framework preset megatron. Nothing is
fitted here: the efficiency constants are the planner's GPU defaults (efficiency.MEASURED_GPU,
fitted on dense vTrain A100 runs), the MoE layers' host operations counted in Megatron-Core's
code (commpipe.plan.moe_host), the expert imbalance its default 1.25 and, to show how much
rides on it, 1.0 (perfect balance) and 1.1. Error = predicted / published TFLOP/s - 1.
"""

from __future__ import annotations

from dataclasses import replace

from commpipe.models.family import resolve
from commpipe.plan.cluster import default_cluster
from commpipe.plan.estimate import estimate
from commpipe.plan.frameworks import framework_job_fields
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout
from commpipe.plan.search import search

SOURCE = ("NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md: 'Reference Best Parallel "
          "Mapping' (MCore v0.8) and the headline TFLOPS")
URL = "https://github.com/NVIDIA/Megatron-LM/blob/core_r0.8.0/megatron/core/transformer/moe/README.md"
PUBLISHED = [("MCore v0.8", 438.0), ("MCore v0.9", 468.0)]
LAYOUT = Layout(tp=1, cp=1, pp=4, dp=16, vpp=8, micro_batch_size=1, schedule="interleaved",
                recompute="none", zero=1, ep=8)
IMBALANCES = (1.0, 1.1, 1.25)


def main() -> float:
    """Print the Mixtral comparison; return measured / predicted at the default imbalance against
    the published mapping's own figure (MCore v0.8)."""
    spec = resolve("mixtral-8x7b")
    cluster = default_cluster(resolve_gpu("h100"), 64, 8)
    fields = framework_job_fields("megatron", "bf16")
    print(f"source: {SOURCE}\n        {URL}")
    print(f"run:    mixtral-8x7b, 64 x H100 (8 per node), seq 4096, global batch 256, bf16, "
          f"{LAYOUT.short()}\n")
    print(f"{'imbalance':>9} {'pred TFLOP/s':>12} {'step s':>7} {'ep a2a s':>9} {'mem GB':>7}   "
          + "   ".join(f"vs {name} {tf:.0f}" for name, tf in PUBLISHED))
    for imb in IMBALANCES:
        job = Job(256, 4096, expert_imbalance=imb, **fields)
        e = estimate(spec, LAYOUT, job, cluster)
        errs = "   ".join(f"{e.tflops_per_gpu / tf - 1:>+14.1%}" for _, tf in PUBLISHED)
        print(f"{imb:>9.2f} {e.tflops_per_gpu:>12.1f} {e.step_time_s:>7.3f} "
              f"{e.breakdown['ep']:>9.3f} {e.memory_gb_per_gpu:>7.1f}   {errs}"
              + ("" if e.feasible else f"   ({e.reason})"))
    # where the published layout sits among what the planner itself would pick (tp, pp as published)
    job = Job(256, 4096, **fields)
    result = search(spec, job, cluster, None, {"tp": 1, "pp": 4, "micro_batch_size": 1}, top=3)
    print("\nplanner's best with tp=1, pp=4, mbs=1 (imbalance 1.25):")
    for e in result.top:
        print(f"  {e.layout.short():<60} {e.tflops_per_gpu:6.1f} TFLOP/s  {e.memory_gb_per_gpu:5.1f} GB")
    default = estimate(spec, LAYOUT, Job(256, 4096, **fields), cluster)
    return PUBLISHED[0][1] / default.tflops_per_gpu



# Megatron-Bridge 25.11's performance summary (NVIDIA-NeMo/Megatron-Bridge@00b7660,
# docs/performance-summary.md, "25.11 NeMo Container"): the MoE rows on GPUs the planner knows
# (DGX-H100, DGX-B200), compared in tokens/s per GPU (its "Model TFLOP/s" use its own FLOP
# count). "In MoE training benchmarks, we force-balance the token distribution among experts":
# expert imbalance 1.0. FP8-CS is FP8 with current scaling, FP8-MX MXFP8 (32-element blocks);
# both price as --precision fp8. Recompute is not stated, so none is priced. Left out: the
# DGX-H100 Qwen3_235B_a22B row (one column short: "| 256 | FP8-CS | 1 | 4096 | 0 | 2 | 8 | ...",
# so its batch and layout cannot be read), GPT OSS 120B (sliding-window attention on every
# other layer, attention sinks, biases: not a shape commpipe's MoE decoder has), GB200/GB300
# (no such --gpu entry). Qwen3-MoE by its config.json fields (head_dim 128); its per-head q/k
# RMSNorms are not priced.
MB_SOURCE = ("NVIDIA-NeMo/Megatron-Bridge@00b7660 docs/performance-summary.md, 25.11 NeMo "
             "Container")
QWEN3_30B = ("arch=moe,name=qwen3-30b-a3b,layers=48,hidden=2048,heads=32,kv_heads=4,head_dim=128,"
             "vocab=151936,experts=128,top_k=8,expert_ffn=768,rope_theta=1000000")
QWEN3_235B = ("arch=moe,name=qwen3-235b-a22b,layers=94,hidden=4096,heads=64,kv_heads=4,"
              "head_dim=128,vocab=151936,experts=128,top_k=8,expert_ffn=1536,rope_theta=1000000")
# (row, model, gpu, gpus, precision as published, global batch, mbs, seq, tp, pp, vpp, ep,
#  published tokens/s per GPU)
MB_ROWS = [
    ("DGX-H100 Qwen3_30B_a3B", QWEN3_30B, "h100", 16, "FP8-CS", 512, 2, 4096, 1, 2, 24, 8, 5275),
    ("DGX-B200 Qwen3_30B_a3B", QWEN3_30B, "b200", 8, "FP8-MX", 512, 1, 4096, 1, 1, 1, 8, 9299),
    ("DGX-B200 Qwen3_235B_a22B", QWEN3_235B, "b200", 64, "FP8-MX", 1024, 1, 4096, 1, 8, 2, 8, 3269),
    ("DGX-B200 DeepSeekV3", "deepseek-v3", "b200", 256, "FP8-MX", 2048, 1, 4096, 1, 16, 1, 8, 2139),
]

# Megatron-Bridge 26.02's rows of the same summary (NVIDIA-NeMo/Megatron-Bridge@c0b9a00,
# docs/performance-summary.md, "26.02 NeMo Container"; its note: force-balanced and dropless),
# priced only after the MoE host operations (commpipe.plan.moe_host) were counted on
# Megatron-Core 0.15 and nothing adjusted after: the held-out rows, on a later Megatron-Core.
# The same selection: DGX-B200 and DGX-H100, TP1. Left out besides GPT OSS: the H100
# Qwen3_235B_a22B row (TP2 with EP32: its recipe keeps the experts whole,
# expert_tensor_parallel_size=1, where the planner splits experts over TP); GB200, GB300, B300.
# "FP8" on the H100 rows is priced as current scaling, as moe_host does on Hopper.
MB_2602_SOURCE = ("NVIDIA-NeMo/Megatron-Bridge@c0b9a00 docs/performance-summary.md, 26.02 NeMo "
                  "Container")
MB_2602_ROWS = [
    ("DGX-B200 DeepSeekV3", "deepseek-v3", "b200", 256, "MXFP8", 4096, 1, 4096, 1, 16, 1, 8, 2689),
    ("DGX-B200 Qwen3_30B_a3B", QWEN3_30B, "b200", 8, "MXFP8", 512, 1, 4096, 1, 1, 1, 8, 9691),
    ("DGX-B200 Qwen3_235B_a22B", QWEN3_235B, "b200", 256, "MXFP8", 8192, 1, 4096, 1, 8, 1, 8, 3805),
    ("DGX-H100 Qwen3_30B_a3B", QWEN3_30B, "h100", 16, "FP8", 1024, 1, 4096, 1, 2, 12, 8, 5113),
]


def megatron_bridge_rows(rows=MB_ROWS, source=MB_SOURCE) -> list[float]:
    """Print the rows; return measured / predicted of each."""
    print(f"\nsource: {source}, the MoE rows (force-balanced experts: imbalance 1.0)\n")
    print(f"{'row':<26} {'prec':<7} {'layout':<44} {'published':>9} {'predicted':>9} "
          f"{'error':>7} {'no host ops':>11} {'error':>7}  memory")
    errors, bare_errors = [], []
    for row, model, gpu, gpus, prec, gbs, mbs, seq, tp, pp, vpp, ep, published in rows:
        spec = resolve(model)
        cluster = default_cluster(resolve_gpu(gpu), gpus, 8)
        job = Job(gbs, seq, precision="fp8", expert_imbalance=1.0,
                  **framework_job_fields("megatron", "fp8"))
        layout = Layout(tp=tp, cp=1, pp=pp, dp=gpus // (tp * pp), vpp=vpp, micro_batch_size=mbs,
                        schedule="interleaved" if vpp > 1 else "1f1b", recompute="none", zero=1,
                        ep=ep)
        e = estimate(spec, layout, job, cluster)
        tokens = gbs * seq / e.step_time_s / gpus
        errors.append(tokens / published - 1)
        # side by side: the same row without the MoE layers' host operations (moe_host.py)
        bare = estimate(spec, layout, replace(job, moe_host_ops=False), cluster)
        bare_tokens = gbs * seq / bare.step_time_s / gpus
        bare_errors.append(bare_tokens / published - 1)
        fit = "fits" if e.feasible else "over"
        print(f"{row:<26} {prec:<7} {layout.short():<44} {published:>9.0f} {tokens:>9.0f} "
              f"{errors[-1]:>+7.1%} {bare_tokens:>11.0f} {bare_errors[-1]:>+7.1%}  "
              f"{e.memory_gb_per_gpu:.0f} GB ({fit})")
    for name, errs in (("", errors), (" without host operations", bare_errors)):
        mape = sum(abs(x) for x in errs) / len(errs)
        print(f"{'' if name else chr(10)}{len(errs)} rows{name}: MAPE {mape:.1%}, "
              f"bias {sum(errs) / len(errs):+.1%}")
    return [1 / (1 + x) for x in errors]


def write_interval(ratios: list[float]) -> None:
    """Store the range of measured / predicted in commpipe/plan/interval.py: what `plan` and
    `estimate` print beside a MoE prediction."""
    from _interval_file import write_block

    path = write_block("plan_moe_public.py",
                       f"MOE_RATIO_RANGE = ({min(ratios):.4f}, {max(ratios):.4f})\n"
                       f"MOE_ROWS = {len(ratios)}")
    print(f"wrote {path}: measured/predicted {min(ratios):.4f}-{max(ratios):.4f} over "
          f"{len(ratios)} runs")


if __name__ == "__main__":
    import sys

    ratios = [main(), *megatron_bridge_rows(), *megatron_bridge_rows(MB_2602_ROWS, MB_2602_SOURCE)]
    if "--write-interval" in sys.argv[1:]:
        write_interval(ratios)
