"""`--framework`: the internals a training framework uses by default, so a user types only the
model, the cluster, the layout, the precision (and ZeRO stage, recompute, micro-batch size).

Each preset names the `Job` fields that describe how the framework runs a step, with the version
whose documented defaults they are. What stays with the user: --precision, --zero, --recompute,
--micro-batch-size, the degrees. Explicit flags (--tp-overlap, --grad-fp32, --eager-ops,
--fsdp-copies, --bf16-weights-with-fp8, --attention-kernel, --flash-attention,
--no-sequence-parallel, --no-dp-overlap) still apply on top of a preset; a preset of a stack
that predates flash attention, sequence parallelism or overlapped gradient reduction
(megatron-lm-2021) turns them off itself.

    >>> framework_job_fields("nemo", "fp8")["fp8_params"]
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Framework:
    name: str
    version: str
    fields: dict = field(default_factory=dict)       # Job fields, any precision
    bf16_grad_fp32: bool = True     # gradients reduced in fp32 under bf16 ...
    fp8_grad_fp32: bool = False     # ... and under fp8
    limits: dict = field(default_factory=dict)  # what `plan` may search: dimensions the stack
    #                                             cannot vary, pinned unless the user fixes them
    #                                             (a tuple: the values it has)


FRAMEWORKS: dict[str, Framework] = {
    # Megatron-Core as NVIDIA's performance recipes run it (Megatron-Bridge 25.11,
    # scripts/performance: tp_comm_overlap=True; bf16_with_fp8_current_scaling_mixed:
    # fp8_param_gather=True; grad_reduce_in_fp32=False with FP8, True with bf16 (Megatron-LM's
    # validate_args forces fp32 accumulation and all-reduce under --bf16)); the Megatron-LM README's
    # scaling runs use --tp-comm-overlap --overlap-grad-reduce --overlap-param-gather; context
    # parallelism as cp_comm_type="p2p" (ring), Megatron's default; TE fused kernels (attention:
    # TE gives cuDNN's fused attention preference over FlashAttention on Hopper and newer).
    "megatron": Framework("megatron", "Megatron-Core 0.15 / Megatron-Bridge 25.11",
                          {"tp_overlap": True, "fp8_params": True, "cp_comm": "ring",
                           "eager_ops": False, "fsdp_copies": False, "fused_swiglu": True,
                           "attn_kernel": "fused"}),
    # Megatron-LM's own training script (pretrain_gpt.py, github.com/NVIDIA/Megatron-LM@f2e5db4,
    # the commit of its README's scaling table) with the overlaps that README names
    # (--tp-comm-overlap --overlap-grad-reduce --overlap-param-gather), otherwise its defaults: the
    # unfused vocab-parallel cross-entropy (--cross-entropy-loss-fusion is opt-in), the
    # distributed optimizer's bucket all-gathers chained (no --delay-param-gather), bf16 weights
    # under FP8 (no FP8 parameter gather at that commit), fp32 gradient accumulation and reduction
    # (validate_args forces it under --bf16, which FP8 runs also pass), TE's ring (p2p) context
    # parallelism.
    "megatron-lm": Framework("megatron-lm", "Megatron-LM@f2e5db4 (July 2024), its README's overlaps",
                             {"tp_overlap": True, "fp8_params": False, "cp_comm": "ring",
                              "eager_ops": False, "fsdp_copies": False, "fused_swiglu": True,
                              "ce_kernel": "megatron-unfused", "param_gather_chained": True,
                              "attn_kernel": "fused"},
                             fp8_grad_fp32=True),
    # Megatron-LM as it ran the weak-scaling table of its April 2021 README
    # (images/cases_april2021.png at NVIDIA/Megatron-LM@a8d172b; Narayanan et al. 2021,
    # arXiv:2104.04473): attention as unfused batched GEMMs with the fused scale-mask-softmax
    # kernel (flash attention came in 2022), no sequence parallelism (2022), no distributed
    # optimizer, the "local" DDP all-reducing gradients after the backward (--DDP-impl local;
    # no overlap), in the training precision (--accumulate-allreduce-grads-in-fp32 off by
    # default), no TP overlap, the unfused vocab-parallel cross-entropy, pipeline messages
    # scatter-gathered over TP (on by default); `plan` searches only what it has: 1F1B or
    # interleaved pipelines, full activation checkpointing or none, no context parallelism, no
    # ZeRO.
    "megatron-lm-2021": Framework("megatron-lm-2021", "Megatron-LM@a8d172b (April 2021)",
                                  {"flash_attention": False, "sequence_parallel": False,
                                   "dp_overlap": False, "tp_overlap": False, "fp8_params": False,
                                   "eager_ops": False, "fsdp_copies": False,
                                   "fused_swiglu": True, "ce_kernel": "megatron-unfused"},
                                  bf16_grad_fp32=False,
                                  limits={"cp": 1, "zero": 0, "schedule": ("1f1b", "interleaved"),
                                          "recompute": ("none", "full")}),
    # NeMo 24.07 (NeMo-Framework-Launcher@24.07 training configs and NeMo's performance scripts):
    # tp_comm_overlap=True; fp8_params not set, so cfg.get('fp8_params', False) in
    # megatron_gpt_model.py keeps bf16 weights beside TE's cached FP8 copies;
    # grad_reduce_in_fp32=False with FP8; ring context parallelism (Megatron-Core's).
    "nemo": Framework("nemo", "NeMo 24.07",
                      {"tp_overlap": True, "fp8_params": False, "cp_comm": "ring",
                       "eager_ops": False, "fsdp_copies": False, "fused_swiglu": True,
                       "attn_kernel": "fused"}),
    # torchtitan (pytorch/torchtitan@0413364 train_configs: compile = false): eager PyTorch
    # kernels with separate Q/K/V and gate/up GEMMs, SiLU's output kept; FSDP2 copying gathered
    # weights and reduced gradients through flat buffers; MixedPrecisionPolicy(reduce_dtype=
    # float32) (torchtitan/parallelisms/parallelize_llama.py); torchao Float8 keeps bf16 weights
    # (enable_fsdp_float8_all_gather off by default); no TE userbuffers; PyTorch's context
    # parallelism rotates K/V by all-gather (its default rotate method); attention through
    # scaled_dot_product_attention, whose default flash backend is FlashAttention-2 (cuDNN's
    # fused attention is opt-in in 2.4 and again from 2.5.1, pytorch/pytorch#138649).
    "torchtitan": Framework("torchtitan", "torchtitan@0413364 (PyTorch 2.4-2.5)",
                            {"tp_overlap": False, "fp8_params": False, "cp_comm": "allgather",
                             "eager_ops": True, "fsdp_copies": True, "fused_swiglu": False,
                             "attn_kernel": "fa2", "moe_host_ops": False},
                            fp8_grad_fp32=True),
    # Meta's Llama 3 stack as the paper describes it (arXiv:2407.21783 Sec. 3.3.2: all-gather
    # context parallelism, Sec. 3.3.4: gradients accumulated and reduce-scattered in fp32); no
    # TP communication overlap is stated. No attention kernel is named: FlashAttention-2, the
    # public flash kernel for H100 training before FlashAttention-3 (July 2024, with the paper)
    # and PyTorch's cuDNN attention (October 2024), is assumed.
    "llama3": Framework("llama3", "Llama 3 paper (2024)",
                        {"tp_overlap": False, "fp8_params": False, "cp_comm": "allgather",
                         "eager_ops": False, "fsdp_copies": False, "fused_swiglu": True,
                         "attn_kernel": "fa2"},
                        fp8_grad_fp32=True),
    # commpipe's own runtime (commpipe.runtime.features through layout.runtime_job), what
    # `--gpu cpu` always prices
    "commpipe": Framework("commpipe", "this commpipe", {}),
}


def default_framework(gpu_name: str) -> str:
    """commpipe's own runtime on --gpu cpu, Megatron-Core on GPUs."""
    return "commpipe" if gpu_name == "cpu" else "megatron"


def resolve_framework(name: str) -> Framework:
    if name not in FRAMEWORKS:
        raise ValueError(f"--framework {name!r} is unknown; use one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def framework_job_fields(name: str, precision: str) -> dict:
    """The `Job` fields the framework sets for a run in `precision` (commpipe: none here; its
    fields come from `layout.runtime_job`, applied by `plan.cli_inputs.for_cluster`)."""
    fw = resolve_framework(name)
    out = dict(fw.fields)
    if name != "commpipe":
        out["grad_fp32"] = fw.fp8_grad_fp32 if precision == "fp8" else fw.bf16_grad_fp32
    return out
