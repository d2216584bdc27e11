"""`commpipe plan`: rank every layout of a model on a cluster, or calibrate the cost model.

    commpipe plan --model llama3-8b --gpu h100 --gpus 64 --gpus-per-node 8 \\
        --global-batch 256 --seq-len 8192 [--tp 2 --pp 4 ...] [--top 5] [--json]
    commpipe plan --calibrate runs/sweep --gpu a100-80gb --gpus-per-node 8 --profile prof.json
    commpipe plan --model llama3-70b --gpus 512 ... --profile prof.json      # use the fit

Dimensions given on the command line (--tp --cp --pp --dp --vpp --micro-batch-size
--schedule --recompute) are fixed; the rest are searched. Tiny CPU example:
    commpipe plan --model tiny --gpu a100-80gb --gpus 4 --global-batch 8 --seq-len 64
"""

from __future__ import annotations

import json
import sys

from commpipe.models.family import family_for_model, planner_of
from commpipe.plan.cli_inputs import (
    check_experts,
    check_framework_flags,
    cluster_from_args,
    fixed_from_args,
    for_cluster,
    framework_from_args,
    host_cores_arg,
    job_from_args,
    resolve_planned,
)
from commpipe.plan.frameworks import FRAMEWORKS, resolve_framework
from commpipe.plan.layout import ATTN_KERNELS, PRECISIONS, RECOMPUTE, SCHEDULES, ZERO_STAGES
from commpipe.plan.pass_split import busy_note, with_measured_pass
from commpipe.plan.pass_split import describe as describe_pass
from commpipe.plan.runtime_ops import with_host_ops


def add_common_arguments(p, require_layout: bool = False) -> None:
    """Model, cluster and job flags shared by `plan` and `estimate`."""
    g = p.add_argument_group("model and job")
    g.add_argument("--model", help="named shape (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
                                   "...) or fields arch=gpt,layers=96,hidden=12288,heads=96,vocab=51200")
    g.add_argument("--expert-imbalance", type=float, default=1.25,
                   help="MoE: token copies the busiest expert-parallel rank receives over the mean "
                        "(default 1.25, Switch Transformer's capacity factor; plan/moe.py)")
    g.add_argument("--no-moe-host-ops", action="store_true",
                   help="MoE: leave out the host time of Megatron-Core's MoE-layer operations "
                        "(plan/moe_host.py), e.g. for layers captured in CUDA graphs; the "
                        "torchtitan and commpipe presets leave it out already")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--seq-len", type=int, help="tokens per sequence")
    g.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="bf16: mixed precision, fp32 master weights (default; fp32 with --gpu cpu, "
                        "as commpipe train runs on a CPU); fp32: all fp32; fp8: "
                        "bf16 mixed precision with the layers' linear GEMMs in FP8 (Transformer Engine)")
    g.add_argument("--framework", choices=tuple(FRAMEWORKS),
                   help="the training framework's default internals (TP overlap, FP8 weights, kernels, "
                        "FSDP copies, gradient precision, CP exchange; commpipe.plan.frameworks): "
                        "default commpipe on --gpu cpu, megatron on GPUs")
    g.add_argument("--bf16-weights-with-fp8", action="store_true",
                   help="fp8: keep bf16 weights plus TE's cached FP8 copies (default: FP8 parameters, "
                        "Megatron --fp8-param-gather)")
    g.add_argument("--grad-fp32", action="store_true",
                   help="accumulate and all-reduce gradients in fp32 (Megatron-LM's default)")
    g.add_argument("--no-dp-overlap", action="store_true",
                   help="DP gradient reduction after the backward instead of overlapped with it")
    g.add_argument("--dp-overlap", action="store_true",
                   help="DP gradient reduction overlapped with the backward, over a --framework "
                        "that does not (megatron-lm-2021)")
    g.add_argument("--tp-overlap", action="store_true",
                   help="TP collectives pipelined with their GEMMs (TE userbuffers, --tp-comm-overlap)")
    g.add_argument("--no-sequence-parallel", action="store_true",
                   help="TP without sequence parallelism (all-reduce, norms replicated)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="TP with sequence parallelism over a --framework without it "
                        "(megatron-lm-2021)")
    g.add_argument("--flash-attention", default="auto", choices=("auto", "on", "off"),
                   help="auto: the --framework's (on but for megatron-lm-2021); off: attention as "
                        "batched GEMMs with the s x s scores in memory (2021-era stacks)")
    g.add_argument("--attention-kernel", choices=ATTN_KERNELS,
                   help="flash attention's kernel: fused (the GPU's own: cuDNN on Hopper and newer, "
                        "as Transformer Engine picks it) or fa2 (FlashAttention-2, PyTorch SDPA's "
                        "default; 35%% of the bf16 peak on Hopper); default: the --framework's")
    g.add_argument("--eager-ops", action="store_true",
                   help="llama only: non-GEMM work as unfused eager PyTorch kernels, counted op by op "
                        "(torchtitan without torch.compile: separate Q/K/V and gate/up GEMMs, SiLU's "
                        "output kept for the backward); default: fused kernels (Megatron/TE, compile)")
    g.add_argument("--fsdp-copies", action="store_true",
                   help="ZeRO-3 as PyTorch FSDP2: price copying the gathered weights out of, and the "
                        "gradients into, the flat communication buffers on the compute stream; "
                        "needs ZeRO 3 (--zero 3, or left to the search)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", default="h100", help="a100-40gb, a100-80gb, h100, h200, b200, cpu, or "
                                                 "name=foo,tflops=..,mem_gb=..[,hbm_gbps=..,nvlink_gbps=..,nic_gbps=..]")
    c.add_argument("--gpus", type=int, help="total GPUs")
    c.add_argument("--gpus-per-node", type=int,
                   help="GPUs (ranks) per node (default: the --cluster probe's ranks per node, else 8)")
    c.add_argument("--cluster", help="a `commpipe probe` JSON with measured link latency/bandwidth")
    c.add_argument("--intra-node-gbps", type=float, help="GPU-pair bandwidth inside a node, decimal GB/s")
    c.add_argument("--inter-node-gbps", type=float,
                   help="GPU-pair bandwidth across nodes (per GPU/NIC), decimal GB/s")
    c.add_argument("--intra-node-latency-ms", type=float)
    c.add_argument("--inter-node-latency-ms", type=float)
    c.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                   help="collective library, for its latency steps and per-call cost (default: "
                        "the --cluster probe's; else gloo on --gpu cpu, nccl on GPUs)")
    c.add_argument("--host-cores", type=host_cores_arg, default=None, metavar="N|auto",
                   help="CPU cores all ranks share (training on one CPU machine); a number, or "
                        "auto: what this machine's cores run at once, measured (~3 s; vCPUs "
                        "that share a physical core count for less). Default: every rank has "
                        "its own device")
    title = "layout" if require_layout else "layout (fix dimensions; the rest is searched)"
    lay = p.add_argument_group(title)
    lay.add_argument("--tp", type=int)
    lay.add_argument("--cp", type=int)
    lay.add_argument("--pp", type=int)
    lay.add_argument("--dp", type=int)
    lay.add_argument("--vpp", type=int)
    lay.add_argument("--micro-batch-size", type=int)
    lay.add_argument("--schedule", choices=SCHEDULES)
    lay.add_argument("--recompute", choices=RECOMPUTE)
    lay.add_argument("--zero", type=int, choices=ZERO_STAGES,
                     help="ZeRO stage: 0 replicated, 1 optimizer states sharded (Megatron's distributed "
                          "optimizer), 2 + gradients, 3 + weights (FSDP)" +
                          ("" if require_layout else "; searched over 1 and 3 when not given"))
    lay.add_argument("--zero1", action="store_true", help="same as --zero 1")
    lay.add_argument("--dp-shard", type=int,
                     help="ranks one ZeRO shard group spans (HSDP: shard inside, replicate across); "
                          "default the whole dp*cp group")
    lay.add_argument("--ep", type=int,
                     help="MoE: expert-parallel size, consecutive ranks of dp*cp holding experts/ep "
                          "experts each" + (" (default 1)" if require_layout else
                                            "; searched over the divisors of dp*cp that divide the "
                                            "expert count when not given"))
    p.add_argument("--json", action="store_true", help="print only JSON on stdout")


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    p.add_argument("--profile", help="cluster profile JSON from --calibrate (read; with "
                                     "--calibrate: where to write it)")
    p.add_argument("--calibrate", metavar="DIR",
                   help="fit the efficiency curve and links to measured runs: a sweep folder "
                        "(*/metrics.jsonl + config.json), probe JSON and/or CSV files like vTrain's")


def add_intervals(estimates, cluster) -> None:
    """Attach the prediction interval from held-out public runs (plan.interval) to GPU
    estimates; CPU clusters price commpipe's runtime, which those runs say nothing about."""
    if cluster.gpu.name == "cpu":
        return
    from commpipe.plan.interval import interval_dict

    for e in estimates:
        if e.tflops_per_gpu == e.tflops_per_gpu:
            e.interval = interval_dict(e.tflops_per_gpu, moe=bool(e.moe))


def run(args) -> int:
    if args.calibrate:
        if getattr(args, "framework", None):
            raise ValueError("--calibrate fits to runs whose settings come from their own files "
                             "(config.json, a CSV's columns) and the flags; --framework presets "
                             "are not applied there: drop --framework, give the flags it would "
                             "set (e.g. --flash-attention off, --no-sequence-parallel), and pass "
                             "--framework to the `plan` that reads the --profile")
        from commpipe.plan.cli_calibrate import run_calibration
        return run_calibration(args)
    if not args.model:
        raise ValueError("--model is required (a named shape or arch=...,layers=... fields)")
    if args.top < 1:
        raise ValueError("--top must be >= 1")
    family = family_for_model(args.model)
    planner = PLANNERS.get(planner_of(family))
    if planner is None:
        raise ValueError(f"commpipe plan has no planner for arch={family.arch} models "
                         f"(planners: {', '.join(PLANNERS)})")
    return planner(args)


def _plan_towers(args) -> int:
    """A vision encoder and a text decoder, each a stack of its own (commpipe.plan.blip)."""
    from commpipe.plan.blip import run_blip_cli

    if args.eager_ops or args.fsdp_copies:
        raise ValueError("--eager-ops and --fsdp-copies price torchtitan's Llama; not a BLIP model")
    return run_blip_cli(args)


def _plan_layers(args) -> int:
    """The layout search over a stack of decoder layers (commpipe.plan.search)."""
    from commpipe.plan.report import print_plan
    from commpipe.plan.search import search

    spec = resolve_planned(args.model)
    fixed = fixed_from_args(args)
    check_framework_flags(args, spec, fixed.get("zero"))
    cluster, eff = cluster_from_args(args, profile_path=args.profile)
    job = for_cluster(job_from_args(args), cluster, framework_from_args(args))
    eff = with_host_ops(eff, job, cluster.gpu)
    if not args.profile:
        eff = with_measured_pass(eff, spec, job, cluster.gpu)
    check_experts(spec, job, fixed.get("ep"))
    # what the framework's stack cannot vary stays as it runs it, unless fixed by hand
    fixed = {**resolve_framework(framework_from_args(args)).limits, **fixed}
    try:
        result = search(spec, job, cluster, eff, fixed, top=args.top)
    except ValueError as e:
        if not args.json:
            raise
        # a fixed dimension no layout can take: still one JSON object on stdout, and the exit
        # status of any other invalid argument (2), as without --json
        json.dump({"feasible": False, "reason": str(e), "fixes": []}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 2
    add_intervals(result.top, cluster)
    if args.json:
        out = [e.to_dict() for e in result.top] if result.top else result.explanation
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_plan(result, spec, job, cluster)
        if line := describe_pass(eff):
            print(line)
    if not args.profile and (warn := busy_note(spec, job, cluster.gpu)):
        print(warn, file=sys.stderr if args.json else sys.stdout)   # --json: stdout stays JSON
    return 0 if result.top else 1


# what a family's `planner` names (commpipe.models.family.ModelFamily.planner)
PLANNERS = {"layers": _plan_layers, "towers": _plan_towers}
