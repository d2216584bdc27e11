"""`Plan`: one way to lay training out on the same processes, and the payback rule (pure Python).

A plan is (tp, cp, pp, dp, stage_layers, schedule, microbatches, micro_batch_size, for uneven
data parallelism the micro-batches of each DP replica, the rank order that places the
groups on the processes: commpipe.parallel.dims, and for a Mixture-of-Experts model the
expert-parallel size ep carved from dp*cp: commpipe.parallel.expert) with the global batch fixed:
every plan computes the same values (commpipe's layouts are numerically equal), so
a switch changes speed, never results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from commpipe.parallel.dims import DEFAULT_ORDER


@dataclass(frozen=True)
class Plan:
    tp: int
    cp: int
    pp: int
    dp: int
    stage_layers: tuple[int, ...]
    schedule: str
    microbatches: int
    micro_batch_size: int
    dp_microbatches: tuple[int, ...] = ()   # per DP replica (commpipe.train.dp_split); (): even
    order: str = DEFAULT_ORDER              # rank placement (ParallelDims.order)
    ep: int = 1                             # expert parallelism (MoE models; parallel.expert)

    def __post_init__(self):   # read back from JSON as lists
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        object.__setattr__(self, "dp_microbatches", tuple(self.dp_microbatches or ()))

    @classmethod
    def of(cls, cfg) -> Plan:
        """The plan a resolved TrainConfig runs."""
        from commpipe.parallel.dims import split_layers

        d = cfg.dims
        n = cfg.program().num_stages
        layers = tuple(len(r) for r in split_layers(cfg.spec.layers, n, cfg.stage_layers))
        return cls(d.tp, d.cp, d.pp, d.dp, layers, cfg.schedule, cfg.microbatches,
                   cfg.micro_batch_size, tuple(cfg.dp_microbatches or ()), d.order, cfg.ep)

    def dims(self):
        """The rank grid of this plan (commpipe.parallel.dims.ParallelDims)."""
        from commpipe.parallel.dims import ParallelDims

        return ParallelDims(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, order=self.order)

    def layout(self, recompute: str = "none", zero: int = 0):
        """The planner's description of this plan (commpipe.layout.Layout): its degrees,
        micro-batch size and schedule, with the run's recompute and ZeRO stage. Stage splits,
        per-replica micro-batches and the rank order stay the plan's own (a Layout's
        `placement` places a launch's ranks on nodes; `order` numbers the ranks of the running
        processes)."""
        from commpipe.layout import Layout

        return Layout(self.tp, self.cp, self.pp, self.dp, 1, self.micro_batch_size, self.schedule,
                      recompute, zero, ep=self.ep)

    @property
    def name(self) -> str:
        split = ",".join(str(x) for x in self.stage_layers)
        name = (f"tp{self.tp}-cp{self.cp}-pp{self.pp}-dp{self.dp} {self.schedule} "
                f"m{self.microbatches}x{self.micro_batch_size} layers {split}")
        if self.ep > 1:   # as the metrics' `layout` (commpipe.train.config.layout_label)
            name = f"ep{self.ep}-{name}"
        if self.dp_microbatches:
            name += " dp-m " + ",".join(str(x) for x in self.dp_microbatches)
        if self.order != DEFAULT_ORDER:
            name += f" ranks {self.order}"
        return name

    def same_layout(self, other: Plan) -> bool:
        """Same process groups (tp, cp, pp, dp, ep and rank order): a switch re-splits or
        re-batches only."""
        return (self.tp, self.cp, self.pp, self.dp, self.order, self.ep) == \
            (other.tp, other.cp, other.pp, other.dp, other.order, other.ep)

    def kind_of_switch(self, other: Plan) -> str:
        if (self.tp, self.cp, self.pp, self.dp, self.ep) == \
                (other.tp, other.cp, other.pp, other.dp, other.ep) and self.order != other.order:
            return "replace"       # the same degrees, ranks placed differently
        if not self.same_layout(other):
            return "reshard"
        if self.stage_layers != other.stage_layers:
            return "resplit"
        if (self.schedule, self.microbatches, self.micro_batch_size) == \
                (other.schedule, other.microbatches, other.micro_batch_size):
            return "rebalance"     # only the micro-batches per DP replica change
        return "rebatch"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stage_layers"] = list(self.stage_layers)
        d["dp_microbatches"] = list(self.dp_microbatches)
        d["name"] = self.name
        return d

    def apply(self, cfg):
        """A new, resolved TrainConfig running this plan; everything else as in `cfg`."""
        import copy

        new = copy.copy(cfg)
        new.optim = copy.copy(cfg.optim)
        new.dims = self.dims()
        new.ep = self.ep
        new.stage_layers = list(self.stage_layers)
        new.schedule, new.vpp = self.schedule, 1
        new.microbatches, new.micro_batch_size = self.microbatches, self.micro_batch_size
        new.dp_microbatches = self.dp_microbatches or None
        new.spec = None
        return new.resolve(self.tp * self.cp * self.pp * self.dp)


def held_parts(plan: Plan, rank: int) -> set:
    """The model parts rank holds under `plan` (full tensors once its TP group gathers them):
    ("layer", i), ("embedding",), ("head",)."""
    stage = plan.dims().coords(rank)["pp"]
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


def moved_bytes(cur: Plan, new: Plan, spec) -> float:
    """The most bytes any rank must receive to switch from `cur` to `new`: parameters and two
    AdamW moments (fp32) of the parts it will hold and does not hold now."""
    size = part_bytes(spec)
    world = cur.tp * cur.cp * cur.pp * cur.dp
    return max(sum(size[p[0]] for p in held_parts(new, r) - held_parts(cur, r))
               for r in range(world))


def nearest_holder(holders, dst: int, ranks_per_node: int) -> int:
    """The rank a switch fetches an item for `dst` from: a holder on dst's node if there is one
    (a node's own links are its fastest, and a degraded link between nodes is not crossed), else
    the lowest holding rank."""
    return min(holders, key=lambda r: (r // ranks_per_node != dst // ranks_per_node, r))


def moved_s(cur: Plan, new: Plan, spec, gbps, ranks_per_node: int) -> float:
    """Seconds the slowest rank spends receiving what it lacks to switch from `cur` to `new`
    (parameters and two AdamW moments, fp32): each part from its `nearest_holder` under `cur`
    at `gbps(src, dst)` GB/s. Only ranks whose role changes receive anything, and a part that a
    rank of its own node holds never crosses to another node."""
    size = part_bytes(spec)
    world = cur.tp * cur.cp * cur.pp * cur.dp
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
