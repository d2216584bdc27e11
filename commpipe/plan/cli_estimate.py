"""`commpipe estimate`: memory and speed of one fully given layout.

    commpipe estimate --model llama3-70b --gpu h100 --gpus 64 --gpus-per-node 8 \\
        --tp 8 --pp 4 --dp 2 --micro-batch-size 1 --schedule interleaved --vpp 2 \\
        --global-batch 64 --seq-len 8192 [--recompute selective] [--json]

Unset --cp/--vpp default to 1, --schedule to 1f1b, --recompute to none; --dp defaults to
--gpus / (tp*cp*pp). Tiny CPU example:
    commpipe estimate --model tiny --gpu a100-80gb --gpus 2 --pp 2 --global-batch 4 --seq-len 64
"""

from __future__ import annotations

import json
import sys

from commpipe.plan.cli import add_common_arguments, add_intervals
from commpipe.plan.cli_inputs import (
    check_experts,
    check_framework_flags,
    cluster_from_args,
    for_cluster,
    framework_from_args,
    job_from_args,
    resolve_planned,
    zero_from_args,
)
from commpipe.plan.estimate import estimate
from commpipe.plan.layout import Layout
from commpipe.plan.pass_split import busy_note, with_measured_pass
from commpipe.plan.pass_split import describe as describe_pass
from commpipe.plan.runtime_ops import with_host_ops
from commpipe.schedules.registry import SCHEDULES, default_vpp


def add_arguments(p) -> None:
    add_common_arguments(p, require_layout=True)
    p.add_argument("--profile", help="cluster profile JSON written by `commpipe plan --calibrate`")


def run(args) -> int:
    if not args.model:
        raise ValueError("--model is required (a named shape or arch=...,layers=... fields)")
    spec = resolve_planned(args.model)
    job = job_from_args(args)
    tp, cp, pp = args.tp or 1, args.cp or 1, args.pp or 1
    gpus = args.gpus
    if args.dp is None:
        if gpus is None:
            raise ValueError("give --gpus or --dp")
        if gpus % (tp * cp * pp):
            raise ValueError(f"--gpus {gpus} is not divisible by tp*cp*pp = {tp * cp * pp}; "
                             "change the layout or give --dp")
        dp = gpus // (tp * cp * pp)
    else:
        dp = args.dp
        if gpus is not None and gpus != tp * cp * pp * dp:
            raise ValueError(f"--gpus {gpus} but tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {tp * cp * pp * dp}; "
                             "drop --dp (it is then --gpus / (tp*cp*pp)) or change the degrees")
    gpus = gpus if gpus is not None else tp * cp * pp * dp
    schedule = args.schedule or "1f1b"
    vpp = args.vpp or (default_vpp(schedule) if schedule in SCHEDULES else 1)
    zero = zero_from_args(args) or 0
    check_framework_flags(args, spec, zero)
    if args.dp_shard is not None and not zero:
        raise ValueError("--dp-shard shards ZeRO states; use it with --zero 1, 2 or 3")
    layout = Layout(tp, cp, pp, dp, vpp, args.micro_batch_size or 1, schedule, args.recompute or "none",
                    zero, args.dp_shard or 0, ep=args.ep or 1)
    cluster, eff = cluster_from_args(args, num_gpus=gpus, profile_path=args.profile)
    job = for_cluster(job, cluster, framework_from_args(args))
    eff = with_host_ops(eff, job, cluster.gpu)
    if not args.profile:
        eff = with_measured_pass(eff, spec, job, cluster.gpu)
    check_experts(spec, job, args.ep, layout)
    est = estimate(spec, layout, job, cluster, eff)
    add_intervals([est], cluster)
    if args.json:
        json.dump(est.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from commpipe.plan.report import print_estimate
        print_estimate(est, cluster)
        if line := describe_pass(eff):
            print(line)
    if not args.profile and (warn := busy_note(spec, job, cluster.gpu)):
        print(warn, file=sys.stderr if args.json else sys.stdout)   # --json: stdout stays JSON
    return 0 if est.feasible else 1
