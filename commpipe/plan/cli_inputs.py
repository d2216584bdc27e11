"""What the flags of `commpipe plan` and `commpipe estimate` describe: the job (precision,
framework preset, batch), the cluster (GPU, links, probe, profile, host cores) and the
dimensions fixed by hand. The verbs themselves: commpipe.plan.cli, cli_estimate, cli_calibrate.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from commpipe.models.family import family_for_model, layer_form, planner_of
from commpipe.plan.cluster import (
    apply_links,
    apply_probe,
    default_cluster,
    override_links,
    probe_call_overhead,
)
from commpipe.plan.efficiency import default_efficiency
from commpipe.plan.frameworks import default_framework, framework_job_fields
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, runtime_job

DEFAULT_GPUS_PER_NODE = 8
FIXABLE = ("tp", "cp", "pp", "dp", "vpp", "micro_batch_size", "schedule", "recompute", "zero", "dp_shard",
           "ep")


def precision_of(args) -> str:
    """--precision, or its default: fp32 on `--gpu cpu` (what `commpipe train` runs on a CPU),
    bf16 mixed precision on GPUs."""
    if getattr(args, "precision", None):
        return args.precision
    return "fp32" if getattr(args, "gpu", None) == "cpu" else "bf16"


def framework_from_args(args) -> str:
    """--framework, or the default for --gpu (commpipe on cpu, megatron on GPUs)."""
    name = getattr(args, "framework", None)
    return name or default_framework(resolve_gpu(args.gpu).name)


def job_from_args(args) -> Job:
    """The job: the framework's internals (plan.frameworks), then the explicit flags on top."""
    for flag in ("global_batch", "seq_len"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required")
    fields = framework_job_fields(framework_from_args(args), precision_of(args))
    if args.flash_attention != "auto":
        fields["flash_attention"] = args.flash_attention == "on"
    for name in ("dp_overlap", "sequence_parallel"):
        on, off = getattr(args, name, False), getattr(args, "no_" + name, False)
        if on and off:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} and --no-{flag} contradict each other; give one")
        if on or off:
            fields[name] = bool(on)
    explicit = {"grad_fp32": args.grad_fp32, "tp_overlap": args.tp_overlap,
                "eager_ops": getattr(args, "eager_ops", False),
                "fsdp_copies": getattr(args, "fsdp_copies", False)}
    fields.update({k: True for k, v in explicit.items() if v})
    if explicit["eager_ops"]:
        fields["fused_swiglu"] = False      # eager autograd keeps SiLU's output
    if getattr(args, "bf16_weights_with_fp8", False):
        fields["fp8_params"] = False
    if getattr(args, "attention_kernel", None):
        fields["attn_kernel"] = args.attention_kernel
    if getattr(args, "no_moe_host_ops", False):
        fields["moe_host_ops"] = False
    return Job(args.global_batch, args.seq_len, precision=precision_of(args),
               expert_imbalance=args.expert_imbalance, **fields)


def resolve_planned(model: str):
    """The spec of `--model` for the layer planner (`plan`, `estimate`): any family whose
    `planner` is "layers" (LLaMA and GPT shapes, MoE decoders); others are refused by name."""
    family = family_for_model(model)
    spec = family.resolve(model)
    if planner_of(family) != "layers":
        raise ValueError(f"commpipe estimate prices a stack of decoder layers; arch={family.arch} "
                         f"models are planned by `commpipe plan --model {model}`")
    return spec


def check_experts(spec, job: Job, ep: int | None, layout=None) -> None:
    """MoE shapes the planner cannot price, an --ep the model or the layout (`estimate`'s) cannot
    take, and --ep on a dense model, fail before any search."""
    from commpipe.plan.layout import zero_stage
    from commpipe.plan.moe import layout_problem, model_problem, routed_spec

    problem = model_problem(spec, job)
    if not problem and layout is not None:
        problem = layout_problem(spec, layout, zero_stage(layout, job))
    if problem:
        raise ValueError(problem)
    if ep is not None:
        moe = routed_spec(spec)
        if moe is None and ep != 1:
            raise ValueError(f"--ep {ep} shards routed experts; {spec.name} (arch={spec.arch}) has "
                             "none: drop --ep")
        if ep < 1 or (moe is not None and moe.experts % ep):
            ok = [e for e in range(1, moe.experts + 1) if moe.experts % e == 0] if moe else [1]
            raise ValueError(f"--ep {ep} does not divide the model's {moe.experts if moe else 0} "
                             f"experts; use --ep in {ok} (and dividing dp*cp)")


def check_framework_flags(args, spec, zero: int | None) -> None:
    """--eager-ops and --fsdp-copies describe a PyTorch-eager / FSDP2 stack; fail where they would
    price nothing. `zero`: the ZeRO stage the command fixes (None: searched)."""
    if getattr(args, "eager_ops", False) and not layer_form(spec).eager_ops:
        raise ValueError(f"--eager-ops counts the kernels of torchtitan's Llama op by op; this model is "
                         f"arch={spec.arch}, priced with fused kernels (drop --eager-ops)")
    if zero is not None and zero > 1 and framework_from_args(args) == "commpipe":
        raise ValueError(f"--zero {zero}: commpipe's runtime shards the optimizer states only "
                         "(ZeRO 1, commpipe train --zero1); use --zero 0 or 1, or price a GPU "
                         "stack that shards more (--framework megatron or torchtitan)")
    if getattr(args, "fsdp_copies", False) and zero is not None and zero != 3:
        raise ValueError(f"--fsdp-copies prices FSDP2's buffer copies under ZeRO-3; the layout has "
                         f"ZeRO stage {zero} (--zero, 0 unless given to estimate): add --zero 3, "
                         "or leave --zero to plan's search")


def for_cluster(job: Job, cluster, framework: str | None = None) -> Job:
    """On `--gpu cpu` the planner prices commpipe's own runtime: its saved tensors and only what
    `commpipe train` runs, from the runtime's own definitions (commpipe.runtime.features, turned
    into job fields by `layout.runtime_job`): --no-sequence-parallel carries over, and
    --no-dp-overlap stands for train's --no-overlap (the runtime turns overlap off as a whole)."""
    framework = framework or default_framework(cluster.gpu.name)
    if cluster.gpu.name == "cpu" and framework != "commpipe":
        raise ValueError(f"--gpu cpu prices commpipe's own runtime; --framework {framework} describes a "
                         "GPU stack (drop --framework or use --framework commpipe)")
    if framework != "commpipe":
        return job
    from commpipe.runtime.features import PRECISIONS, Overlap, RuntimeFeatures

    if job.eager_ops or job.fsdp_copies:
        raise ValueError("--gpu cpu prices commpipe's own runtime tensor by tensor; --eager-ops and "
                         "--fsdp-copies describe torchtitan / FSDP2 on GPUs (drop them)")
    if job.precision not in PRECISIONS:
        raise ValueError(f"--gpu cpu prices commpipe's own runtime, which trains in "
                         f"{' or '.join(PRECISIONS)}; --precision {job.precision} is for GPU stacks")
    if cluster.gpu.name == "cpu":       # a rank's process, not a CUDA context (plan.fits)
        from commpipe.plan.fits import CPU_RANK_RESERVE_GIB
        job = replace(job, rank_reserve_gb=CPU_RANK_RESERVE_GIB)
    features = RuntimeFeatures(sequence_parallel=job.sequence_parallel,
                               overlap=Overlap() if job.dp_overlap else Overlap.none(),
                               precision=job.precision)
    return replace(job, **runtime_job(features.validate()))


def host_cores_arg(value: str) -> float:
    """--host-cores: a number of cores >= 1, or `auto` (measured, commpipe.plan.cpu)."""
    if value == "auto":
        from commpipe.plan.cpu import measure_core_capacity

        return round(measure_core_capacity(), 2)
    try:
        cores = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of cores or 'auto'") from None
    if cores < 1:
        raise argparse.ArgumentTypeError(f"{value}: ranks share at least one core")
    return int(cores) if cores.is_integer() else cores


def cluster_from_args(args, num_gpus: int | None = None, profile_path: str | None = None):
    """(Cluster, Efficiency): defaults < probe JSON < profile < explicit link flags."""
    n = num_gpus if num_gpus is not None else args.gpus
    if n is None:
        raise ValueError("--gpus is required (total GPUs in the cluster)")
    cluster = default_cluster(resolve_gpu(args.gpu), n, args.gpus_per_node or DEFAULT_GPUS_PER_NODE)
    if args.cluster:
        cluster = apply_probe(cluster, args.cluster)
        if args.gpus_per_node:          # the flag wins over the probe's ranks per node
            cluster = replace(cluster, gpus_per_node=args.gpus_per_node)
    if cluster.gpu.name == "cpu":       # its ranks share the host's memory
        from commpipe.plan.cpu import host_share
        cluster = host_share(cluster)
    eff = default_efficiency(cluster.gpu)
    if profile_path:
        from commpipe.plan.calibrate import load_profile
        eff, links = load_profile(profile_path)
        if links:
            cluster = apply_links(cluster, links, f"profile:{profile_path}")
    cluster = override_links(cluster, args.intra_node_gbps, args.inter_node_gbps,
                             args.intra_node_latency_ms, args.inter_node_latency_ms)
    backend = args.backend or (cluster.backend if args.cluster else
                               "gloo" if cluster.gpu.name == "cpu" else "nccl")
    cluster = replace(cluster, backend=backend, host_cores=args.host_cores)
    if args.cluster and not profile_path and cluster.backend == "gloo":
        # a gloo call's host time as training pays it, measured by the probe (a profile's own
        # calibrated terms win)
        call = probe_call_overhead(args.cluster, cluster)
        if call is not None:
            eff = replace(eff, coll_overhead_s=call)
            cluster = replace(cluster, source=f"{cluster.source}; a gloo call after compute "
                                              f"{call * 1e3:.2f} ms beyond its link")
    if hasattr(args, "precision"):
        cluster.gpu.peak_tflops(precision_of(args))  # --precision fp8 on a GPU without FP8: fail early
    return cluster, eff


def zero_from_args(args) -> int | None:
    """--zero N, or 1 for the --zero1 alias; None when neither is given."""
    if args.zero1 and args.zero not in (None, 1):
        raise ValueError(f"--zero1 contradicts --zero {args.zero}; give one of them")
    return 1 if args.zero1 else args.zero


def fixed_from_args(args) -> dict:
    fixed = {k: getattr(args, k) for k in FIXABLE if getattr(args, k, None) is not None}
    zero = zero_from_args(args)
    if zero is not None:
        fixed["zero"] = zero
    if args.dp_shard is not None:
        if args.dp_shard < 1:
            raise ValueError("--dp-shard must be at least 1")
        if fixed.get("zero", 1) == 0:
            raise ValueError("--dp-shard shards ZeRO states; use it with --zero 1, 2 or 3")
    return fixed
