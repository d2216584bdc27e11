"""What a switch between two running layouts moves, and the payback rule (pure Python).

A plan is a running `commpipe.layout.Layout`: (tp, cp, pp, dp, stage_layers, schedule,
microbatches, micro_batch_size, for uneven data parallelism the micro-batches of each DP
replica, the rank order that places the groups on the processes: commpipe.parallel.dims, and
for a Mixture-of-Experts model the expert-parallel size ep carved from dp*cp:
commpipe.parallel.expert) with the global batch fixed: every plan computes the same values
(commpipe's layouts are numerically equal), so a switch changes speed, never results.
"""

from __future__ import annotations

from dataclasses import dataclass

from commpipe.layout import Layout


def held_parts(plan: Layout, rank: int) -> set:
    """The model parts rank holds under `plan` (full tensors once its TP group gathers them):
    ("layer", i), ("embedding",), ("head",)."""
    stage = plan.dims.coords(rank)["pp"]
    start = sum(plan.stage_layers[:stage])
    parts = {("layer", i) for i in range(start, start + plan.stage_layers[stage])}
    if stage == 0:
        parts.add(("embedding",))
    if stage == plan.pp - 1:
        parts.add(("head",))
    return parts


def part_bytes(spec) -> dict[str, float]:
    """Bytes a switch moves per model part: parameters and two AdamW moments, fp32 (a MoE
    model's layer: its largest, all E experts, as the switch gathers them whole)."""
    from commpipe.models import moe_spec
    from commpipe.models.spec import layer_param_count
    from commpipe.plan.moe import routed_spec

    moe = routed_spec(spec)
    layer = max(moe_spec.layer_param_count(moe, i) for i in range(moe.layers)) if moe \
        else layer_param_count(spec)
    return {"layer": 12.0 * layer, "embedding": 12.0 * spec.vocab * spec.hidden,
            "head": 12.0 * (spec.vocab * spec.hidden + spec.hidden)}


def moved_bytes(cur: Layout, new: Layout, spec) -> float:
    """The most bytes any rank must receive to switch from `cur` to `new`: parameters and two
    AdamW moments (fp32) of the parts it will hold and does not hold now."""
    size = part_bytes(spec)
    world = cur.world_size
    return max(sum(size[p[0]] for p in held_parts(new, r) - held_parts(cur, r))
               for r in range(world))


def nearest_holder(holders, dst: int, ranks_per_node: int) -> int:
    """The rank a switch fetches an item for `dst` from: a holder on dst's node if there is one
    (a node's own links are its fastest, and a degraded link between nodes is not crossed), else
    the lowest holding rank."""
    return min(holders, key=lambda r: (r // ranks_per_node != dst // ranks_per_node, r))


def moved_s(cur: Layout, new: Layout, spec, gbps, ranks_per_node: int) -> float:
    """Seconds the slowest rank spends receiving what it lacks to switch from `cur` to `new`
    (parameters and two AdamW moments, fp32): each part from its `nearest_holder` under `cur`
    at `gbps(src, dst)` GB/s. Only ranks whose role changes receive anything, and a part that a
    rank of its own node holds never crosses to another node."""
    size = part_bytes(spec)
    world = cur.world_size
    held = [held_parts(cur, r) for r in range(world)]
    worst = 0.0
    for dst in range(world):
        took = 0.0
        for part in held_parts(new, dst) - held[dst]:
            src = nearest_holder([r for r in range(world) if part in held[r]], dst,
                                 ranks_per_node)
            took += size[part[0]] / (gbps(src, dst) * 1e9)
        worst = max(worst, took)
    return worst


@dataclass
class Verdict:
    admit: bool
    saving_s: float          # predicted saving over the horizon (s); negative: a loss
    horizon_steps: int
    reason: str


def payback(current_ms: float, candidate_ms: float, switch_cost_s: float, steps_left: int,
            horizon: int, margin: float, min_gain: float) -> Verdict:
    """Admit a switch only if the predicted saving over the horizon pays for the switch with a
    margin: (current - candidate) * min(horizon, steps_left) >= margin * switch cost, and the
    candidate is at least `min_gain` faster (relative)."""
    steps = max(min(horizon, steps_left), 0)
    per_step = (current_ms - candidate_ms) / 1e3
    saving = per_step * steps
    gain = (current_ms - candidate_ms) / current_ms if current_ms > 0 else 0.0
    if gain < min_gain:
        return Verdict(False, saving, steps, f"predicted gain {gain:.1%} is below the minimum "
                                             f"{min_gain:.0%}")
    if saving < margin * switch_cost_s:
        return Verdict(False, saving, steps,
                       f"saving {saving:.2f} s over {steps} steps does not pay {margin:g} x the "
                       f"switch cost {switch_cost_s:.2f} s")
    return Verdict(True, saving, steps,
                   f"saving {saving:.2f} s over {steps} steps >= {margin:g} x switch cost "
                   f"{switch_cost_s:.2f} s (gain {gain:.1%})")
