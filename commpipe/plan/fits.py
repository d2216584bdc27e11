"""Does a `commpipe train` run fit this machine? The planner's memory model (memory.py, with
this runtime's own activations, runtime_memory.py) priced for the run's layout, checked
before any process group starts against the memory the ranks will share.

    >>> from commpipe.models.spec import resolve_model
    >>> from commpipe.plan.layout import Job, Layout
    >>> need = rank_need_gb(resolve_model("llama3-70b"), Layout(), Job(2, 64, precision="fp32"),
    ...                     on_cpu=True)
    >>> round(need[0])     # 16 bytes per parameter (weights, gradients, Adam m and v)
    1053

On a GPU each rank has its own device: the rank's need (states, activations, logits and the
planner's reserve: CUDA context, workspaces, fragmentation) against the device's free memory.
On CPU the ranks of one host share its memory: the needs of all local ranks are summed against
the host's available memory, measured once every rank is running (the interpreter and torch
are resident already); the fixed reserve is what a rank adds on top of its model (gloo
buffers, the data pipeline, allocator arenas), plus the same 10% fragmentation share of the
transient tensors.
"""

from __future__ import annotations

import os
from dataclasses import replace

from commpipe.models.family import layer_form, layout_planned
from commpipe.models.spec import PRESETS, ModelSpec, param_count
from commpipe.plan.layout import Job, Layout
from commpipe.plan.memory import GIB, stage_memory
from commpipe.plan.pipeline import peak_inflight

# a rank's growth beyond its model, once torch is imported: `commpipe train --model tiny` peaks
# at 0.84 GB resident, 0.27 GB above the 0.57 GB of the imported process
CPU_RANK_GIB = 0.3
CPU_PROCESS_GIB = 0.57
# what `plan --gpu cpu` reserves per rank before any process runs (Job.rank_reserve_gb)
CPU_RANK_RESERVE_GIB = CPU_PROCESS_GIB + CPU_RANK_GIB


def rank_need_gb(spec: ModelSpec, layout: Layout, job: Job, on_cpu: bool) -> list[float]:
    """GiB each pipeline rank needs at its peak (memory.stage_memory; the fixed part of the
    reserve is a rank's growth on CPU instead of a CUDA context)."""
    m = layout.microbatches_for(job)
    stages = stage_memory(spec, layout, job, list(peak_inflight(layout.schedule, layout.pp,
                                                                layout.vpp, m)))
    fixed = CPU_RANK_GIB - job.rank_reserve_gb if on_cpu else 0.0
    return [s.total_gb + fixed for s in stages]


def host_need_gb(spec: ModelSpec, layout: Layout, job: Job, on_cpu: bool,
                 local_ranks: list[int]) -> float:
    """GiB the memory being checked must hold: on CPU the sum over the ranks of this host, on
    a GPU the need of the one rank on that device (the heaviest of `local_ranks`)."""
    per_pp = rank_need_gb(spec, layout, job, on_cpu)
    needs = [per_pp[layout.dims.coords(r)["pp"]] for r in local_ranks]
    return sum(needs) if on_cpu else max(needs)


def available_gb(on_cpu: bool, device_index: int = 0) -> float | None:
    """Free memory now: the host's MemAvailable (Linux) or the GPU's free memory; None where
    it cannot be read."""
    if not on_cpu:
        import torch

        return torch.cuda.mem_get_info(device_index)[0] / GIB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def _alternatives(spec: ModelSpec, layout: Layout, job: Job, on_cpu: bool):
    """(what to change, spec, layout, job), cheapest change first: recomputation, smaller
    micro-batches and sequences, more pipeline/tensor ranks (GPU: each has its own memory),
    then smaller models."""
    if layout.recompute != "full":
        yield "--recompute full", spec, replace(layout, recompute="full"), job
    mbs = layout.micro_batch_size
    while mbs > 1:
        mbs //= 2
        yield (f"--micro-batch-size {mbs}", spec, replace(layout, micro_batch_size=mbs),
               replace(job, global_batch=job.global_batch // layout.micro_batch_size * mbs))
    seq = 1 << (job.seq_len - 1).bit_length()       # powers of two below the given length
    step = 2 * layout.cp * layout.tp                # what context and sequence parallelism split
    while seq // 2 >= step:
        seq //= 2
        if seq % step == 0:
            yield f"--seq-len {seq}", spec, layout, replace(job, seq_len=seq)
    if not on_cpu:
        for k in (2, 4, 8, 16):
            pp = layout.pp * k
            if pp * layout.vpp <= spec.layers and job.global_batch // (
                    layout.dp * layout.micro_batch_size) >= pp:
                yield (f"--pp {pp} ({layout.gpus * k} GPUs)", spec, replace(layout, pp=pp),
                       job)
    smaller = sorted((p for p in PRESETS.values()
                      if layer_form(p) == layer_form(spec) and param_count(p) < param_count(spec)),
                     key=param_count, reverse=True)
    for p in smaller:
        yield f"--model {p.name}", p, layout, job


def fit_problem(spec: ModelSpec, layout: Layout, job: Job, on_cpu: bool,
                local_ranks: list[int], capacity_gb: float) -> str | None:
    """Why the run does not fit `capacity_gb`, with the planner's figure and the first
    change that fits (or None when it fits)."""
    need = host_need_gb(spec, layout, job, on_cpu, local_ranks)
    if need <= capacity_gb:
        return None
    where = (f"{len(local_ranks)} rank(s) on this host need" if on_cpu
             else "the heaviest rank needs")
    worst = max(stage_memory(spec, layout, job, list(peak_inflight(
        layout.schedule, layout.pp, layout.vpp, layout.microbatches_for(job)))),
        key=lambda s: s.total_gb)
    parts = (f"weights+gradients+optimizer {worst.weights_gb + worst.grads_gb + worst.optimizer_gb:.1f}"
             f" GiB, activations {worst.activations_gb + worst.logits_gb:.1f} GiB per rank")
    fix = "no smaller layout or model here fits; use a machine with more memory"
    for change, s, lay, j in _alternatives(spec, layout, job, on_cpu):
        try:
            n = host_need_gb(s, lay, j, on_cpu, local_ranks)
        except ValueError:       # a change the layout cannot take (e.g. pp beyond the layers)
            continue
        if n <= capacity_gb:
            fix = f"{change} would need {n:.1f} GiB"
            break
    memory = "available host memory" if on_cpu else "free GPU memory"
    return (f"out of memory: {spec.name} with tp={layout.tp} cp={layout.cp} pp={layout.pp} "
            f"dp={layout.dp}, micro-batch size {layout.micro_batch_size}, seq_len {job.seq_len}: "
            f"{where} {need:.1f} GiB ({parts}), {memory} is {capacity_gb:.1f} GiB; {fix}")


def train_fit_problem(cfg, world: int, rank: int = 0, local_world: int | None = None,
                      capacity_gb: float | None = None) -> str | None:
    """`fit_problem` for a resolved TrainConfig the layout search prices (`layout_planned`;
    BLIP's towers have their own model, plan/blip.py) on a named schedule (a CSV's placement
    is not a planner layout).
    `local_world` ranks share this host, starting at this rank's node; `capacity_gb` defaults
    to what is free now."""
    from commpipe.plan.layout import runtime_job
    from commpipe.schedules.registry import SCHEDULES

    if cfg.spec is None or not layout_planned(cfg.spec) or cfg.schedule not in SCHEDULES:
        return None
    on_cpu = not (cfg.device.startswith("cuda") or cfg.device == "auto" and _has_cuda())
    d = cfg.dims
    layout = Layout(d.tp, d.cp, d.pp, d.dp, cfg.program().num_stages // d.pp,
                    cfg.micro_batch_size, cfg.schedule, cfg.recompute, 1 if cfg.optim.zero1 else 0)
    job = Job(cfg.global_batch, cfg.seq_len, precision=cfg.precision or "fp32",
              **runtime_job(cfg.features()))
    local_world = local_world or (world if on_cpu else 1)
    first = rank - rank % local_world
    local = [r for r in range(first, first + local_world) if r < d.world_size]
    if capacity_gb is None:
        capacity_gb = available_gb(on_cpu, rank % local_world)
        if capacity_gb is None:
            return None
    return fit_problem(cfg.spec, layout, job, on_cpu, local or [0], capacity_gb)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
