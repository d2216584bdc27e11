"""Restarting on another world size under torchrun's elastic agent.

    torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --rdzv-id JOB -m commpipe train --tp 2 --pp 4 --dp 4 \\
        --save-every 100 --out /shared/run --elastic

torchrun does the rendezvous and the restarts: when a worker fails (or the hang watchdog ends
it), every agent stops its workers and the surviving nodes meet again; the workers start anew
with the new WORLD_SIZE. Under `--elastic` each worker then, before any process group starts:

- keeps the layout given on the command line when it fits the world (a regrown job gets it
  back), else re-plans: the planner (commpipe.plan.search) ranks the layouts of the new world
  for the same model, sequence length and *global batch* (the micro-batching is re-derived),
  and the first layout the trainer accepts is taken; the choice and its reason are printed;
- resumes from the latest checkpoint in OUT/checkpoints (any layout loads it), so what is lost
  is the steps since the last `--save-every` save.

A MoE model under expert parallelism keeps its --ep where it still divides the new dp*cp (and
the experts), else takes the largest ep below it that does (`elastic_ep`; the planner's ranking
is read for layouts with that ep, as the user's ep says how many experts a rank may hold and
which ranks exchange tokens); the checkpoint holds every expert tensor whole, in shards at
their row offsets, so each rank reads the rows of its experts under the new ep
(commpipe.train.checkpoint_shards).

Every worker of one attempt computes the same plan from the same inputs (no exchange needed).
The process group's keys in torchrun's store are kept apart per attempt (`attempt_prefix`,
commpipe.parallel.attempt): the agent keeps one store across restarts, and a restarted gloo
worker reading the addresses the previous attempt left there would fail to connect.
"""

from __future__ import annotations

import os

# steps between copies of the state on another node (commpipe.train.peer_copies) unless
# --peer-copy-every says; their cost on a healthy run is in docs/checkpoints.md
PEER_COPY_EVERY = 20


# -- re-planning for the world there is ---------------------------------------------------------
def elastic_config(cfg, world: int, restart: int = 0, log=print):
    """`cfg` for `world` ranks: its own layout when that has `world` ranks, else the planner's
    best layout the trainer accepts, with the same global batch; resuming from the latest
    checkpoint. A fault drill (--fail-at) fires in the first attempt only (`restart` 0).
    Runs before any process group starts; raises ValueError naming the fix."""
    import copy

    if not cfg.out:
        raise ValueError("--elastic resumes from OUT/checkpoints after a restart; give --out DIR "
                         "and --save-every N")
    cfg = copy.copy(cfg)
    cfg.elastic = True
    if cfg.resume is None:
        cfg.resume = "latest"
    if cfg.peer_copy_every is None:
        cfg.peer_copy_every = PEER_COPY_EVERY
    if restart > 0:
        cfg.fail_at = None
    given = cfg.dims.world_size
    if given == world:
        return cfg
    base = copy.deepcopy(cfg)
    base.spec = None
    base.resolve()                     # the global batch the command line means
    global_batch = base.global_batch
    choice, why = plan_for_world(base, world, global_batch)
    say = log if os.environ.get("RANK", "0") == "0" else (lambda *_: None)
    say(f"commpipe: elastic: {world} ranks instead of the {given} of the command line "
        f"({_dims_text(cfg.dims, cfg.ep)}); running {_dims_text(choice.dims, choice.ep)}, "
        f"{choice.schedule}, "
        f"{choice.microbatches} micro-batches of {choice.micro_batch_size} (global batch "
        f"{global_batch} kept): {why}")
    return choice


def _dims_text(d, ep: int = 1) -> str:
    return f"tp{d.tp}-cp{d.cp}-pp{d.pp}-dp{d.dp}" + (f"-ep{ep}" if ep > 1 else "")


def elastic_ep(base, replicas: int) -> int:
    """The expert-parallel size for `replicas` = dp*cp ranks: `base.ep` where it divides them
    and the model's experts, else the largest ep below it that does (1 always does; a dense
    model keeps ep 1)."""
    experts = getattr(base.spec, "experts", 0) or 0
    if base.ep <= 1 or not experts:
        return base.ep
    return max(e for e in range(1, base.ep + 1) if replicas % e == 0 and experts % e == 0)


def _with_layout(base, tp, cp, pp, dp, mbs, schedule, global_batch):
    """A resolved copy of `base` under this layout (and `elastic_ep`), or None if the trainer
    refuses it."""
    import copy

    from commpipe.parallel.dims import ParallelDims

    new = copy.deepcopy(base)
    new.dims = ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp)
    new.ep = elastic_ep(base, dp * cp)
    new.schedule, new.vpp = schedule, 1
    new.dp_microbatches = None         # uneven counts were for the old replicas: even split
    new.microbatches, new.micro_batch_size, new.global_batch = None, mbs, global_batch
    if isinstance(new.stage_layers, list) and len(new.stage_layers) != pp:
        new.stage_layers = None        # explicit counts were for the old pipeline: even split
    new.spec, new.fail_at, new.slow_rank = None, None, None   # drills were for the old world
    try:
        return new.resolve(tp * cp * pp * dp)
    except ValueError:
        return None


def plan_for_world(base, world: int, global_batch: int):
    """(resolved config, why): the planner's ranking of the layouts for `world` ranks, the
    first one the trainer accepts; else the least model-parallel layout that resolves."""
    from commpipe.schedules.registry import ONE_CHUNK

    schedule = base.schedule if base.schedule in ONE_CHUNK else "1f1b"
    try:
        ranked = _planner_ranking(base, world, global_batch, schedule)
    except ValueError as exc:          # the planner found nothing that fits
        ranked, note = [], f"the planner found no layout ({exc})"
    else:
        note = "no layout of the planner's ranking runs here"
    for i, (lay, step_s) in enumerate(ranked):
        if getattr(lay, "ep", 1) != elastic_ep(base, lay.dp * lay.cp):
            continue                   # expert parallelism stays as close to --ep as fits
        cfg = _with_layout(base, lay.tp, lay.cp, lay.pp, lay.dp, lay.micro_batch_size, schedule,
                           global_batch)
        if cfg is not None:
            return cfg, (f"the planner's {'best' if i == 0 else f'#{i + 1}'} layout for "
                         f"{world} ranks (predicted {step_s * 1e3:.3g} ms per step on "
                         f"{_gpu_text()}; {len(ranked)} ranked)")
    from commpipe.models.spec import divisors

    for tp, cp, pp in sorted(((t, c, p) for t in divisors(world) for c in divisors(world // t)
                              for p in divisors(world // (t * c))),
                             key=lambda x: (x[0] * x[1] * x[2], x[1], x[0])):
        dp = world // (tp * cp * pp)
        for mbs in (base.micro_batch_size, 1):
            cfg = _with_layout(base, tp, cp, pp, dp, mbs, schedule, global_batch)
            if cfg is not None:
                return cfg, f"{note}; the least model-parallel layout that runs"
    raise ValueError(f"--elastic: no layout of {world} ranks trains this model with global batch "
                     f"{global_batch}; use a global batch divisible by more DP degrees, or "
                     "--nnodes with a larger minimum")


def _gpu_text() -> str:
    return _gpu().name


def _gpu():
    """The device class the planner prices: the CUDA device's table entry, else a fixed
    stand-in (H100) so that every rank ranks the same way (a measured CPU would differ)."""
    from commpipe.plan.gpus import GPUS

    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name().lower()
            for key in GPUS:
                if key.split("-")[0] in name:
                    return GPUS[key]
    except RuntimeError:
        pass
    return GPUS["h100"]


def _planner_ranking(base, world: int, global_batch: int, schedule: str) -> list:
    """[(Layout, predicted step s)], best first (commpipe.plan.search with this runtime's
    features)."""
    from dataclasses import replace

    from commpipe.plan.cluster import default_cluster
    from commpipe.plan.efficiency import default_efficiency
    from commpipe.plan.layout import Job, runtime_job
    from commpipe.plan.search import search

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
    cluster = default_cluster(_gpu(), world, min(local, world))
    job = replace(Job(global_batch, base.seq_len, precision=base.precision or "fp32"),
                  **runtime_job(base.features()))
    fixed = {"schedule": schedule, "vpp": 1, "recompute": base.recompute,
             "zero": 1 if base.optim.zero1 else 0}
    result = search(base.spec, job, cluster, default_efficiency(cluster.gpu), fixed=fixed, top=8,
                    explain=False)
    return [(e.layout, e.step_time_s) for e in result.top]
