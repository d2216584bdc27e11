"""One `Layout` for the planner, the sweep, the launchers and the adaptive controller: how a job
is spread over ranks.

    Layout(tp=2, pp=4, schedule="zbv")                 # vpp follows the schedule (2 for a V)
    Layout(2, 1, 4, 1, 2, 1, "zbv", "none", 1)         # positional, as the planner builds them
    Layout(tp=2, pp=4, placement="cp-dp-pp-tp")        # a sweep entry: TP partners across nodes

Degrees (tp, cp, pp, dp), the pipeline schedule and its chunks per rank (vpp), micro-batch size,
recomputation, ZeRO stage and shard group: what the planner prices. A sweep entry adds where
ranks go (`placement`, innermost first, as Megatron-LM's --rank-order), a run name, a pinned
micro-batch count and extra `commpipe train` flags. Schedule, vpp and micro-batch count left
out (None) take the defaults (1f1b; the schedule's own chunk count) and stay unpinned: a sweep
then passes the grid's or `commpipe sweep`'s value to `commpipe train` instead (`pinned`).
A running job's layout (`Layout.of(cfg)`, what commpipe.adapt switches between) also names the
layers of each pipeline stage, the micro-batches of each DP replica and the order its processes
number the rank grid in; `apply(cfg)` makes a training configuration of it again.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from commpipe.parallel.dims import DEFAULT_ORDER, ParallelDims

# train flags a sweep entry may set itself -> the field holding each
PINNABLE = {"schedule": "schedule", "vpp": "vpp", "microbatches": "microbatches"}


def parse_order(order: str) -> tuple[str, ...]:
    dims = tuple(order.split("-"))
    if sorted(dims) != sorted(("tp", "cp", "dp", "pp")):
        raise ValueError(f"placement {order!r} must name tp, cp, dp and pp once each, innermost "
                         f"first, e.g. {DEFAULT_ORDER} (default) or cp-dp-pp-tp (TP across nodes)")
    return dims


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None              # model chunks per rank; None: the schedule's (1, or 2 for a V)
    micro_batch_size: int = 1
    schedule: str | None = None         # None: 1f1b
    recompute: str = "none"
    zero: int = 0           # 0: replicated; 1: optimizer states sharded; 2: + gradients; 3: + weights
    #                         (FSDP: parameters all-gathered per layer, gradients reduce-scattered)
    dp_shard: int = 0       # ranks a ZeRO shard group spans (HSDP); 0: the whole dp*cp group
    microbatches: int | None = None     # a sweep entry's or a running plan's micro-batches per
    #                                     pipeline (the planner derives m from the global batch:
    #                                     `microbatches_for(job)`)
    placement: str = DEFAULT_ORDER
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False)   # per-layout training flags
    pinned: frozenset | None = field(default=None, compare=False, repr=False)
    ep: int = 1             # expert-parallel size (MoE models): consecutive ranks of dp*cp
    # what a running job adds (commpipe.adapt switches between such layouts in memory):
    stage_layers: tuple[int, ...] = ()      # layers per pipeline stage; (): the trainer's split
    dp_microbatches: tuple[int, ...] = ()   # micro-batches per DP replica; (): even
    #                                         (commpipe.train.dp_split)
    order: str = DEFAULT_ORDER  # how the running processes number the rank grid (ParallelDims
    #                             order); `placement` instead puts a launch's ranks on nodes

    def __post_init__(self):
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))   # JSON gives lists
        object.__setattr__(self, "dp_microbatches", tuple(self.dp_microbatches or ()))
        ParallelDims(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp)   # validates the degrees
        if self.ep > 1 and "ep" in self.extra and str(self.extra["ep"]) != str(self.ep):
            raise ValueError(f"expert parallelism given twice, ep={self.ep} and a training flag "
                             f"ep={self.extra['ep']}; give it once")
        if self.pinned is None:
            given = frozenset(k for k, f in PINNABLE.items() if getattr(self, f) is not None)
            object.__setattr__(self, "pinned", given)
        if self.schedule is None:
            object.__setattr__(self, "schedule", "1f1b")
        if self.vpp is None:
            object.__setattr__(self, "vpp", _default_vpp(self.schedule))
        if self.placement != DEFAULT_ORDER:
            parse_order(self.placement)
        if not self.name:
            object.__setattr__(self, "name", self.default_name())
        elif not re.fullmatch(r"[A-Za-z0-9._+-]+", self.name):
            raise ValueError(f"layout name {self.name!r} must use only letters, digits and . _ + - "
                             "(it names the run folder)")

    # -- sizes --------------------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    world_size = gpus

    @property
    def dims(self) -> ParallelDims:
        """The rank grid, numbered in `order`."""
        return ParallelDims(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, order=self.order)

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the sharded states is spread over (dp*cp unless HSDP)."""
        return self.dp_shard or self.dp * self.cp

    def microbatches_for(self, job) -> int:
        """Micro-batches per pipeline for a job's global batch (the planner's m)."""
        return job.global_batch // (self.dp * self.micro_batch_size)

    # -- names and records --------------------------------------------------------------------
    @property
    def label(self) -> str:
        """The study's notation, e.g. TP4/CP1/PP4 (DP shown when it is not 1)."""
        text = f"TP{self.tp}/CP{self.cp}/PP{self.pp}" + (f"/DP{self.dp}" if self.dp > 1 else "")
        if self.placement != DEFAULT_ORDER:
            text += f" [{self.placement}]"
        return text

    def default_name(self) -> str:
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}", f"dp{self.dp}"]
        if "vpp" in self.pinned and self.vpp > 1:
            parts.append(f"v{self.vpp}")
        if "schedule" in self.pinned:
            parts.append(self.schedule)
        if self.microbatches:
            parts.append(f"m{self.microbatches}")
        if self.placement != DEFAULT_ORDER:
            parts.append("order-" + self.placement.replace("-", ""))
        return "-".join(parts)

    def short(self) -> str:
        s = f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"
        if self.vpp > 1:
            s += f" VPP{self.vpp}"
        schedule = f" {self.schedule}" if self.pp > 1 else ""   # no pipeline, no schedule
        s = f"{s} mbs{self.micro_batch_size}{schedule} rc={self.recompute}"
        if self.zero:
            s += f" zero{self.zero}"
            if self.dp_shard and self.dp_shard != self.dp * self.cp:
                s += f" shard{self.dp_shard}"
        if self.ep > 1:
            s += f" EP{self.ep}"
        return s

    def to_dict(self) -> dict:
        """What the planner reports of a layout (`commpipe plan/estimate --json`); `ep` where
        experts are sharded (a MoE estimate reports it always)."""
        d = {k: getattr(self, k) for k in ("tp", "cp", "pp", "dp", "vpp", "micro_batch_size",
                                           "schedule", "recompute", "zero", "dp_shard")}
        if self.ep > 1:
            d["ep"] = self.ep
        return d

    def grid_dict(self) -> dict:
        """What a sweep records of an entry (sweep.jsonl, its fingerprint): unpinned schedule,
        vpp and micro-batches as None."""
        d = {k: getattr(self, k) for k in ("tp", "cp", "pp", "dp")}
        d.update({k: getattr(self, f) if k in self.pinned else None for k, f in PINNABLE.items()})
        d.update(placement=self.placement, name=self.name, extra=self.extra,
                 world_size=self.world_size)
        return d

    def train_flags(self) -> list[str]:
        """The layout's own `commpipe train` flags: its degrees (ep when above 1), and the pinned
        schedule, vpp and micro-batch count."""
        flags = ["--tp", str(self.tp), "--cp", str(self.cp), "--pp", str(self.pp), "--dp", str(self.dp)]
        if self.ep > 1:
            flags += ["--ep", str(self.ep)]
        for key, attr in PINNABLE.items():
            if key in self.pinned:
                flags += [f"--{key}", str(getattr(self, attr))]
        return flags

    # -- a running job's layout (commpipe.adapt switches between these) -----------------------
    @classmethod
    def of(cls, cfg) -> Layout:
        """The layout a resolved TrainConfig runs: its degrees, stage split, schedule and
        micro-batching, rank order and expert parallelism."""
        from commpipe.parallel.dims import split_layers

        d = cfg.dims
        n = cfg.program().num_stages
        layers = tuple(len(r) for r in split_layers(cfg.spec.layers, n, cfg.stage_layers))
        return cls(tp=d.tp, cp=d.cp, pp=d.pp, dp=d.dp, stage_layers=layers, schedule=cfg.schedule,
                   microbatches=cfg.microbatches, micro_batch_size=cfg.micro_batch_size,
                   dp_microbatches=tuple(cfg.dp_microbatches or ()), order=d.order, ep=cfg.ep)

    def apply(self, cfg):
        """A new, resolved TrainConfig running this layout; everything else as in `cfg`."""
        import copy

        new = copy.copy(cfg)
        new.optim = copy.copy(cfg.optim)
        new.dims = self.dims
        new.ep = self.ep
        new.stage_layers = list(self.stage_layers) or None
        new.schedule, new.vpp = self.schedule, 1
        new.microbatches, new.micro_batch_size = self.microbatches, self.micro_batch_size
        new.dp_microbatches = self.dp_microbatches or None
        new.spec = None
        return new.resolve(self.world_size)

    @property
    def title(self) -> str:
        """One line naming everything a switch can change, as adapt.jsonl and the report show
        it, e.g. "tp1-cp1-pp2-dp2 1f1b m8x1 layers 4,4"."""
        split = ",".join(str(x) for x in self.stage_layers)
        title = (f"tp{self.tp}-cp{self.cp}-pp{self.pp}-dp{self.dp} {self.schedule} "
                 f"m{self.microbatches}x{self.micro_batch_size} layers {split}")
        if self.ep > 1:   # as the metrics' `layout` (commpipe.train.config.layout_label)
            title = f"ep{self.ep}-{title}"
        if self.dp_microbatches:
            title += " dp-m " + ",".join(str(x) for x in self.dp_microbatches)
        if self.order != DEFAULT_ORDER:
            title += f" ranks {self.order}"
        return title

    def same_groups(self, other: Layout) -> bool:
        """Same process groups (tp, cp, pp, dp, ep and rank order): a switch re-splits or
        re-batches only."""
        return (self.tp, self.cp, self.pp, self.dp, self.order, self.ep) == \
            (other.tp, other.cp, other.pp, other.dp, other.order, other.ep)

    def kind_of_switch(self, other: Layout) -> str:
        if (self.tp, self.cp, self.pp, self.dp, self.ep) == \
                (other.tp, other.cp, other.pp, other.dp, other.ep) and self.order != other.order:
            return "replace"       # the same degrees, ranks placed differently
        if not self.same_groups(other):
            return "reshard"
        if self.stage_layers != other.stage_layers:
            return "resplit"
        if (self.schedule, self.microbatches, self.micro_batch_size) == \
                (other.schedule, other.microbatches, other.micro_batch_size):
            return "rebalance"     # only the micro-batches per DP replica change
        return "rebatch"

    def record(self) -> dict:
        """A running layout as adapt.jsonl and checkpoints record it (`from_record` reads it)."""
        d = {k: getattr(self, k) for k in RECORDED}
        d["stage_layers"] = list(self.stage_layers)
        d["dp_microbatches"] = list(self.dp_microbatches)
        d["name"] = self.title
        return d

    @classmethod
    def from_record(cls, d: dict) -> Layout:
        """The layout `record` wrote: KeyError for a missing key it always writes, TypeError
        for one it never writes, ValueError for impossible degrees."""
        unknown = set(d) - set(RECORDED) - {"name"}
        if unknown:
            raise TypeError(f"unexpected keys {sorted(unknown)}")
        return cls(**{k: d[k] for k in RECORDED_ALWAYS},
                   **{k: d[k] for k in RECORDED_SINCE if k in d})


# what `Layout.record` keeps of a running layout, in its order: the keys every record has, then
# those older records may lack (their defaults apply)
RECORDED_ALWAYS = ("tp", "cp", "pp", "dp", "stage_layers", "schedule", "microbatches",
                   "micro_batch_size")
RECORDED_SINCE = ("dp_microbatches", "order", "ep")
RECORDED = RECORDED_ALWAYS + RECORDED_SINCE


def _default_vpp(schedule: str) -> int:
    from commpipe.schedules.registry import SCHEDULES, default_vpp

    return default_vpp(schedule) if schedule in SCHEDULES and schedule != "interleaved" else 1


def node_of_rank(layout: Layout, ranks_per_node: int) -> list[int]:
    """Which node hosts each global rank when ranks fill nodes in `layout.placement` order."""
    dims = layout.dims
    order = parse_order(layout.placement)
    sizes = {d: getattr(layout, d) for d in order}
    out = [0] * layout.world_size
    # enumerate coordinates with the first-named dimension varying fastest
    ranges = [range(sizes[d]) for d in reversed(order)]
    for slot, coords in enumerate(itertools.product(*ranges)):
        c = dict(zip(reversed(order), coords))
        out[dims.rank_of(pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=c["tp"])] = slot // ranks_per_node
    return out
