"""Why nothing fits: the smallest memory shortfall and the knobs that would close it.

When every layout the search may try is over the GPU's memory, `explain_none` finds the layout
closest to fitting, then tries single changes on it (full recompute, a higher ZeRO stage, a smaller
micro-batch, HSDP over the whole group) and, for every dimension the user fixed, whether letting
the search choose it admits a layout. `commpipe plan` prints the result and exits non-zero;
`--json` prints it as one object (never an empty list).

    >>> from commpipe.models.spec import resolve_model
    >>> from commpipe.plan.cluster import default_cluster
    >>> from commpipe.plan.gpus import resolve_gpu
    >>> from commpipe.plan.layout import Job
    >>> why = explain_none(resolve_model("llama3-70b"), Job(8, 4096),
    ...                    default_cluster(resolve_gpu("h100"), 1, 8), fixed={})
    >>> why["feasible"], why["shortfall_gb"] > 0
    (False, True)
"""

from __future__ import annotations

from dataclasses import replace

from commpipe.models.spec import ModelSpec
from commpipe.plan.cluster import Cluster
from commpipe.plan.gpus import GPUS
from commpipe.plan.layout import Job, Layout, enumerate_layouts, layout_problem
from commpipe.plan.memory import stage_memory, static_memory_gb
from commpipe.plan.pipeline import peak_inflight

MAX_RELEASE_LAYOUTS = 20000     # layouts tried per released dimension before giving up


def needed_gb(spec: ModelSpec, layout: Layout, job: Job) -> float:
    """Memory of the layout's largest stage (GiB)."""
    static = static_memory_gb(spec, layout, job)
    inflight = list(peak_inflight(layout.schedule, layout.pp, layout.vpp, layout.microbatches_for(job)))
    return max(static, max(s.total_gb for s in stage_memory(spec, layout, job, inflight)))


def _variants(layout: Layout, job: Job) -> list[tuple[str, str, Layout]]:
    """(dimension, description, changed layout) for single memory-saving changes."""
    out = []
    if layout.recompute != "full":
        out.append(("recompute", "--recompute full", replace(layout, recompute="full")))
    group = layout.dp * layout.cp
    if group > 1:
        best_zero = 3 if layout.pp == 1 else 1
        if layout.zero < best_zero:
            out.append(("zero", f"--zero {best_zero}", replace(layout, zero=best_zero, dp_shard=0)))
        if layout.zero and layout.dp_shard and layout.dp_shard < group:
            out.append(("dp_shard", f"--dp-shard {group}", replace(layout, dp_shard=group)))
    if layout.micro_batch_size > 1:
        out.append(("micro_batch_size", "--micro-batch-size 1", replace(layout, micro_batch_size=1)))
    return out


def explain_none(spec: ModelSpec, job: Job, cluster: Cluster, fixed: dict,
                 layouts: list[Layout] | None = None) -> dict:
    """A JSON-ready account of why no layout fits (see the module docstring)."""
    layouts = layouts if layouts is not None else enumerate_layouts(spec, job, cluster.num_gpus, fixed)
    cap = cluster.gpu.mem_gb
    if not layouts:
        return {"feasible": False, "reason": "no valid layout for the fixed dimensions", "fixes": []}
    best, best_gb = None, float("inf")
    for lay in layouts:
        gb = needed_gb(spec, lay, job)
        if gb < best_gb:
            best, best_gb = lay, gb
    shortfall = best_gb - cap
    fixes = []
    for dim, text, lay in _variants(best, job):
        if layout_problem(spec, job, lay, cluster.num_gpus):
            continue
        gb = needed_gb(spec, lay, job)
        if gb <= cap:
            note = " (you fixed it)" if dim in fixed and fixed[dim] != getattr(lay, dim) else ""
            fixes.append(f"{text}{note}: {lay.short()} needs {gb:.1f} GB")
    for dim in sorted(fixed):
        freed = {k: v for k, v in fixed.items() if k != dim}
        for lay in enumerate_layouts(spec, job, cluster.num_gpus, freed)[:MAX_RELEASE_LAYOUTS]:
            if getattr(lay, dim) != fixed[dim] and needed_gb(spec, lay, job) <= cap:
                fixes.append(f"let the search choose {dim} (you fixed {dim}={fixed[dim]}): "
                             f"e.g. {lay.short()} fits")
                break
    bigger = sorted((g for g in GPUS.values() if g.mem_gb >= best_gb and g.mem_gb > cap),
                    key=lambda g: g.mem_gb)
    if bigger:
        g = bigger[0]
        fixes.append(f"a GPU with {best_gb:.0f} GB or more, e.g. --gpu {g.name} ({g.mem_gb:.0f} GB)")
    fixes.append("more GPUs (--gpus), for more tensor/pipeline/ZeRO sharding")
    reason = (f"no layout fits in {cap:.0f} GB: the closest, {best.short()}, needs {best_gb:.1f} GB "
              f"({shortfall:.1f} GB over)")
    return {"feasible": False, "reason": reason, "shortfall_gb": shortfall, "closest": best.to_dict(),
            "closest_memory_gb": best_gb, "fixes": fixes, "considered": len(layouts)}
