"""`commpipe train`: one process, or one process per rank under torchrun.

    python -m commpipe train --preset tiny --steps 5
    torchrun --nproc-per-node 8 -m commpipe train --tp 2 --cp 2 --pp 2 --schedule 1f1b \
        --microbatches 4 --steps 10 --out runs/t
    commpipe train --data data/wikitext-103 --eval-every 50 --save-every 100 --out runs/w
    torchrun --nproc-per-node 4 -m commpipe train --pp 4 --out runs/w --resume   # any layout
"""

from __future__ import annotations

import argparse
import os

from commpipe.adapt.cli import adapt_options, add_adapt_arguments
from commpipe.monitor.flag import parse_monitor_flag
from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import OptimConfig, TrainConfig
from commpipe.train.failures import parse_fail_at, run_rank
from commpipe.train.source import open_data


def add_layout_arguments(p) -> None:
    g = p.add_argument_group("layout")
    for dim in ("tp", "cp", "pp", "dp"):
        g.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} degree (default 1)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallelism of MoE models: experts sharded over groups of EP "
                        "ranks carved from the dp*cp ranks; must divide dp*cp and the expert "
                        "count (default 1)")
    g.add_argument("--rank-order", default="tp-cp-dp-pp",
                   help="how the groups are placed on the ranks, innermost first (Megatron's "
                        "order): tp-cp-dp-pp (default: DP replicas inside a pipeline stage's "
                        "node, stages across nodes) or tp-cp-pp-dp (consecutive stages on "
                        "consecutive ranks, DP replicas across nodes)")
    g.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule name (gpipe, 1f1b, interleaved, zbh1, zbv, and the "
                        "braided stp, dualpipev) or a schedule .csv (default 1f1b)")
    g.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank "
                   "(interleaved schedule)")
    g.add_argument("--stage-layers", default=None,
                   help="explicit layers per pipeline stage, e.g. 3,3,2 (default: even split); "
                        "auto: balanced by predicted FLOPs per layer; auto:measured (blip "
                        "models): by a short per-layer forward+backward profile")


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="job config: a TOML file with [model], [parallelism], [schedule], "
                        "[training], [data], [checkpoint], [monitor], [job] and [adapt] tables "
                        "of these flags, or a run folder's config.json; flags given here "
                        "override it (commpipe.train.jobconfig)")
    p.add_argument("--preset", "--model", dest="model", default=None,
                   help="model preset (tiny, small, llama3-8b, blip-tiny, blip-base, ...) or fields "
                        "arch=llama,layers=..,hidden=..,heads=..,vocab=.. (default: tiny, or "
                        "the model of --init-from)")
    add_layout_arguments(p)
    g = p.add_argument_group("batch")
    g.add_argument("--microbatches", type=int, default=None, help="micro-batches per step "
                   "per pipeline (default 2*pp, or derived from --global-batch)")
    g.add_argument("--dp-microbatches", default=None, metavar="M0,M1,..",
                   help="micro-batches of each DP replica (uneven: a slower replica gets "
                        "fewer; they sum to microbatches*dp, the global batch is unchanged)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default microbatches*mbs*dp)")
    g.add_argument("--seq-len", type=int, default=64)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=10)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--warmup", type=int, default=2, help="warm-up steps")
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    g.add_argument("--zero1", action="store_true", help="shard optimizer states across DP")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", default=None, help="corpus directory (see `commpipe tokenize`); "
                   "synthetic tokens when absent. The model vocabulary becomes the tokenizer's, "
                   "rounded up to a multiple of 64 (and of tp)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json for --data (default: the one in the data directory)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="use (one process: train if missing) DIR/tokenizer-<N>.json")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="validation loss every N steps and after the last (0: off); logged as "
                        "val_loss")
    g.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="global batches of the valid split per evaluation (default 4)")
    g = p.add_argument_group("checkpoints and failures")
    g.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="checkpoint every N steps and after the last into OUT/checkpoints "
                        "(0: only on SIGTERM/SIGINT)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from the latest checkpoint in OUT/checkpoints (a fresh start "
                        "if there is none), or from PATH; any layout may load it")
    g.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from the weights of this checkpoint (`commpipe convert --from-hf` "
                        "writes one; a run's works too) under any layout, with a fresh optimizer "
                        "at step 0; the model is the checkpoint's. A checkpoint --resume finds "
                        "comes first")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run OUT already holds (its metrics, config and checkpoints); "
                        "without it a folder holding a run is only continued, with --resume")
    g.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a rank that stops answering fails the job "
                        "after this long (default 300)")
    g.add_argument("--hang-timeout-s", type=float, default=60.0, metavar="S",
                   help="hang watchdog: when no step finishes for S seconds, name the rank the "
                        "others wait on and the call it has not posted, and end the job (exit "
                        "code 4); the first step, saves, evaluation and layout switches get "
                        "10 x S; 0 turns it off (default 60)")
    g.add_argument("--elastic", action="store_true",
                   help="under torchrun's elastic agent (--nnodes MIN:MAX --max-restarts N): a "
                        "(re)started job resumes from the latest checkpoint in OUT, under the "
                        "layout given here when the world has its size, else under the planner's "
                        "layout for the ranks there are, with the same global batch")
    g.add_argument("--peer-copy-every", type=int, default=None, metavar="N",
                   help="--elastic: every N steps each rank keeps a copy of its state in its "
                        "node's memory and on another node; a restart resumes from the copies "
                        "when they are newer than the latest checkpoint (0: off; default 20 "
                        "under --elastic)")
    g.add_argument("--fail-at", default=None, metavar="RANK:STEP",
                   help="fault drill: rank RANK raises at step STEP, to check that the job "
                        "fails loudly on your cluster")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="run folder: metrics.jsonl, config.json, "
                   "checkpoints/, monitor/, trace/")
    # not `--monitor`: torchrun would take that as an abbreviation of its --monitor-interval
    g.add_argument("--comm-monitor", default="off", metavar="off|sample=F|all",
                   help="time communication calls: off, all, or sample=0.1 (one call in ten)")
    g.add_argument("--trace", action="store_true",
                   help="record a timeline (compute and every communication call; "
                        "torch.profiler on GPU) into OUT/trace/rank{r}.json for HTA and Perfetto")
    g.add_argument("--tensorboard", action="store_true",
                   help="TensorBoard scalars (loss, LR, step time, TFLOP/s, bandwidth per "
                        "dimension and link class with --comm-monitor) and adaptive events into "
                        "OUT/tensorboard (pip install tensorboard)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--emulate-device", type=float, default=1.0, metavar="FACTOR",
                   help="CPU: every compute operator takes FACTOR times its host time, the host "
                        "idle for the extra as while an accelerator runs a kernel, so transfers "
                        "in flight get the cores (benchmarks of overlap; values unchanged; "
                        "default 1: off)")
    g.add_argument("--precision", default=None, choices=("fp32", "bf16"),
                   help="bf16: autocast with fp32 master weights, gradients, optimizer and loss "
                        "(default bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--strict-order", action="store_true",
                   help="pair point-to-point messages in issue order, as NCCL does (gloo: one "
                        "tag per rank pair), to check a schedule's NCCL legality on CPU")
    g.add_argument("--log-every", type=int, default=1)
    g = p.add_argument_group("overlap and memory (commpipe.runtime.features)")
    g.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recomputation: selective = the attention core, full = the "
                        "whole layer with its input kept (default none)")
    g.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="with tp > 1, keep norms and residuals on the whole sequence on every TP "
                        "rank (default: sequence parallelism on)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="turn every communication overlap off (TP, DP, CP, pipeline receive "
                        "prefetch), for A/B measurement; results are identical")
    g.add_argument("--tp-forward-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="with sequence parallelism, compute the column-parallel GEMMs over the "
                        "rank's own rows while the forward all-gather brings the others "
                        "(default off: it does not pay on CPU/gloo, see docs/overlap.md; "
                        "--no-overlap turns it off too)")
    g.add_argument("--dp-bucket-mb", type=float, default=25.0,
                   help="gradients are reduced in buckets of about this many MB, each as soon "
                        "as its gradients are final (default 25)")
    add_adapt_arguments(p)


def config_from_args(args) -> TrainConfig:
    stage_layers = None
    if args.stage_layers and args.stage_layers.startswith("auto"):
        stage_layers = args.stage_layers          # checked by TrainConfig.set_balanced_split
    elif args.stage_layers:
        try:
            stage_layers = [int(x) for x in args.stage_layers.split(",")]
        except ValueError:
            raise ValueError(f"--stage-layers {args.stage_layers!r}: write counts like 3,3,2") \
                from None
    dp_microbatches = None
    if getattr(args, "dp_microbatches", None):
        try:
            dp_microbatches = tuple(int(x) for x in args.dp_microbatches.split(","))
        except ValueError:
            raise ValueError(f"--dp-microbatches {args.dp_microbatches!r}: write one count per "
                             "DP replica, like 3,1") from None
    dims = ParallelDims(dp=args.dp, pp=args.pp, cp=args.cp, tp=args.tp,
                        order=getattr(args, "rank_order", "tp-cp-dp-pp"))
    optim = OptimConfig(lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup, clip=args.clip,
                        zero1=args.zero1)
    monitor = parse_monitor_flag(args.comm_monitor)
    if (monitor is not None or args.trace) and not args.out:
        raise ValueError("--comm-monitor and --trace write into the run folder; give --out DIR")
    return TrainConfig(model=args.model or "tiny", dims=dims, ep=getattr(args, "ep", 1),
                       schedule=args.schedule, vpp=args.vpp,
                       microbatches=args.microbatches, micro_batch_size=args.micro_batch_size,
                       dp_microbatches=dp_microbatches,
                       global_batch=args.global_batch, seq_len=args.seq_len, steps=args.steps,
                       seed=args.seed, stage_layers=stage_layers, optim=optim, data=args.data,
                       tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       eval_every=args.eval_every, eval_batches=args.eval_batches,
                       save_every=args.save_every, resume=args.resume,
                       init_from=getattr(args, "init_from", None),
                       overwrite=getattr(args, "overwrite", False), timeout_s=args.timeout_s,
                       hang_timeout_s=getattr(args, "hang_timeout_s", 60.0),
                       elastic=getattr(args, "elastic", False),
                       peer_copy_every=getattr(args, "peer_copy_every", None),
                       fail_at=parse_fail_at(args.fail_at), out=args.out, monitor=monitor,
                       trace=args.trace, tensorboard=args.tensorboard, log_every=args.log_every,
                       device=args.device, emulate_device=args.emulate_device,
                       precision=args.precision, strict_order=args.strict_order,
                       recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                       overlap=args.overlap, dp_bucket_mb=args.dp_bucket_mb,
                       tp_forward_overlap=args.tp_forward_overlap,
                       **adapt_options(args))


def run(args) -> int:
    cfg = config_from_args(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cfg.elastic:   # a (re)started elastic job: the layout for this world, from the checkpoint
        from commpipe.elastic.restart import elastic_config

        cfg = elastic_config(cfg, world, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    # validate everything before any process group starts: layout, data, resume checkpoint
    source = None
    if cfg.init_from:   # the model's shape is the checkpoint's (a given --model must agree)
        from commpipe.train.weights import init_model

        cfg.model = init_model(cfg.init_from, args.model)
    if cfg.data:
        cfg.dims.check_world(world)
        source = open_data(cfg, world)
    cfg.resolve(world)
    from commpipe.adapt.relaunch import apply_pending
    from commpipe.adapt.resume import resume_adapted
    from commpipe.train.checkpoint import resolve_resume

    cfg = apply_pending(cfg, world)   # --adapt-relaunch: continue under the requested layout
    cfg = resume_adapted(cfg, world)  # --adapt --resume: continue in the checkpoint's plan
    from commpipe.plan.fits import train_fit_problem

    problem = train_fit_problem(cfg, world, rank, int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
    if problem:                       # the planner's memory model against what this host has
        raise ValueError(problem)

    resolve_resume(cfg, source)
    if cfg.init_from:
        from commpipe.train.weights import check_init_from

        check_init_from(cfg)
    from commpipe.train.run_folder import prepare_run_folder

    prepare_run_folder(cfg, rank)   # a writable --out, holding no other run
    from commpipe.parallel.comm import shutdown_distributed
    from commpipe.train.loop import train

    code = run_rank(lambda: train(cfg, source=source), rank, world)
    shutdown_distributed()
    return code
