"""Predicted step time of any running `Layout` from what the running plan measured, priced by the simulator.

The running plan's timeline is calibrated exactly as `simulate --compare` does it
(`commpipe.sim.compare.calibrate`: median F/B/I/W per stage plus the host time between compute
actions). From that table each stage's speed is expressed per unit of work, the forward FLOPs
of its layers (and head) per sample (models/spec.py's one FLOPs definition), divided by tp*cp:

    unit_s = (f_s + b_s - 2 host) / work_s        (ms per work unit)

The fastest stage gives the healthy unit; each physical rank's slowdown factor k_g is its
stage's unit over the healthy one (a straggler, or ranks sharing a slow host). A candidate's
stage costs are then unit_healthy * max(k_g over its ranks) * work, split into F and B in the
measured ratio, plus the host time. Point-to-point links are looked up per rank pair in the
monitor's measurements (else by node pair, else by link class); TP and CP collectives and the
DP x CP gradient all-reduce are priced by the planner's `Cluster` (commpipe.plan.cluster: bus
bytes and latency steps per backend) at the rate measured for their link class (across nodes
at their share of each node's link: commpipe.adapt.model_links), activations at
the run's element size (2 bytes under bf16), gradients in fp32 as GradReducer sums them; on
gloo each TP and CP call, and each bucket of the gradient reduction, adds the per-call time
measured as training makes calls (`Measured.call_ms`, commpipe.adapt.link_probe), as
`plan --cluster` adds a probe's.
On a CPU the rank's one thread also issues every eager op, one at a time: that part of a
micro-batch's F and B does not grow with its size. A stage's pass is k * unit * (b * work +
ops * op_work): the ops its layers (and head) dispatch per micro-batch (commpipe.plan.
runtime_ops' counts) at `Measured.op_work`, the work one op costs as much time as, measured on
the run's own model (commpipe.plan.pass_split). A slow rank's k stretches both parts, and a
candidate with larger micro-batches is predicted with fewer ops a sample, as it runs.
A Mixture-of-Experts model's stages are priced the same way, with its family's FLOPs per layer,
plus its expert-parallel all-to-alls and the experts' own gradient reduction
(commpipe.adapt.model_moe).
Everything else in the measured step (optimizer, loss reduction) is carried over as a constant,
so the current plan's prediction equals its measured step time. Under a fault that constant is
taken from the plan's healthy steps (`Measured.reference`) and the time the fault added beyond
the model goes to the links (else the ranks) measured slower than there: a candidate that
avoids them does not inherit it. Layout candidates assume one
device per rank (tp and cp divide a stage's compute); on an emulated cluster whose ranks share
a few host cores that flatters them, so such runs may restrict the controller to re-splits and
re-batching (`--adapt-resplit-only`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from commpipe.adapt.config import AdaptConfig
from commpipe.adapt.model_links import MeasuredLinks
from commpipe.adapt.model_moe import edp_group, ep_stage_ms, stage_params
from commpipe.layout import Layout
from commpipe.models.family import family_of
from commpipe.models.spec import ModelSpec
from commpipe.plan.runtime_ops import layer_ops, microbatch_ops, stage_ops
from commpipe.schedules import generate
from commpipe.sim.costs import CostTable
from commpipe.sim.engine import simulate


def replica_m(plan: Layout, d: int) -> int:
    """Micro-batches DP replica d runs under `plan`."""
    return plan.dp_microbatches[d] if plan.dp_microbatches else plan.microbatches


def stage_work(spec: ModelSpec, seq_len: int, stage_layers, s: int) -> float:
    """Forward FLOPs of one sample through stage s of the split `stage_layers` (its blocks, and
    the head on the last stage): the family's FLOPs per layer (`layer_costs`, from
    models/spec.py's or models/moe_spec.py's one definition)."""
    costs = family_of(spec).layer_costs(spec, seq_len)   # the head charged to the last layer
    start = sum(stage_layers[:s])
    return sum(costs[start:start + stage_layers[s]]) * seq_len


@dataclass
class Measured:
    """What the running plan measured, gathered from every rank (see commpipe.adapt.signals)."""

    plan: Layout
    costs: CostTable                 # calibrated on the running program (per stage)
    host_ms: float                   # host time charged to each compute action
    step_ms: float                   # measured step time (median over the recent window)
    links: dict = field(default_factory=dict)   # (src, dst) -> (latency_ms, bandwidth_gbps)
    collective_gbps: dict = field(default_factory=dict)  # "intra_node"/"inter_node" -> GB/s
    rank_busy: dict = field(default_factory=dict)  # rank -> compute ms per step
    element_bytes: int = 4           # bytes of an activation element on the wire (2 under bf16)
    backend: str = "gloo"            # the process groups' backend: gloo | nccl
    rebuild_s: float = 0.0           # seconds this run took to build its stages (Trainer.build_s)
    groups_s: float = 0.0            # and to create its process groups (Comm.groups_s)
    # the part of a pass fixed per micro-batch, as units of FLOP work per counted op
    # (commpipe.plan.pass_split, measured on this host's CPU); 0: not separated (a GPU)
    op_work: float = 0.0
    # a gloo collective call's time beyond its latency steps and bytes, measured as training
    # makes calls (commpipe.adapt.link_probe.measure_calls); 0: not measured
    call_ms: float = 0.0
    sequence_parallel: bool = False  # TP candidates gather and scatter the sequence: 4 calls a pass
    dp_bucket_bytes: float = 25e6    # the DP reduction's bucket (GradReducer): one call each
    # the same plan measured before the change (the steps its detector's baselines came from):
    # what the step cost outside the modelled compute and communication while healthy
    reference: Measured | None = None


class CostModel(MeasuredLinks):
    def __init__(self, spec: ModelSpec, seq_len: int, world: int, ranks_per_node: int,
                 measured: Measured, acfg: AdaptConfig | None = None):
        a = acfg or AdaptConfig()
        self.default_gbps = {"intra_node": a.default_intra_gbps,
                             "inter_node": a.default_inter_gbps}
        self.spec, self.seq_len, self.world = spec, seq_len, world
        self.rpn = max(1, ranks_per_node)
        self.m = measured
        cur = measured.plan
        self.dims = cur.dims
        c = measured.costs
        host = measured.host_ms
        # per stage: its measured F + B (host gaps out), its FLOPs work and its ops, as work
        wholes, works, fb_f = [], [], []
        for s in range(len(cur.stage_layers)):
            work = stage_work(spec, seq_len, cur.stage_layers, s)
            works.append(work * cur.micro_batch_size / (cur.tp * cur.cp) + self.op_work(cur, s))
            wholes.append(max(c.f[s] + c.b[s] - 2 * host, 1e-9))
            fb_f.append((c.f[s] - host) / wholes[-1])
        # A slow rank is slow at everything it does, its ops' issue as much as its FLOPs: stage
        # s takes k_s * unit * (work_s + op work_s). The fastest stage has k = 1, so the healthy
        # unit is the least time per work over the stages, and each stage's k is its own over it.
        units = [w / work for w, work in zip(wholes, works)]
        self.unit = min(units)
        self.f_share = statistics.median(fb_f)
        # slowdown per physical rank: its stage's factor (timed on DP rank 0's replica), times
        # its own compute per micro-batch over that of the timed rank (group[0]); replicas of an
        # uneven plan run different counts, hence per micro-batch
        self.k: dict[int, float] = {}
        for s, u in enumerate(units):
            group = [self.dims.rank_of(pp=s, dp=d, cp=q, tp=t) for d in range(cur.dp)
                     for q in range(cur.cp) for t in range(cur.tp)]
            busy = [(measured.rank_busy.get(g) or 0.0) / replica_m(cur, self.dims.coords(g)["dp"])
                    for g in group]
            ref = busy[0] or max(busy)
            for g, b in zip(group, busy):
                rel = (b / ref) if (b and ref) else 1.0
                self.k[g] = max(u / self.unit * rel, 1.0)
        lat = [v[0] for v in measured.links.values() if v[0] is not None]
        self.base_latency = min(lat) if lat else c.link(0, 1)[0] if c.num_stages > 1 else 0.0
        # Tie predictions to the measured step. Compute is measured directly; communication
        # is extrapolated from sampled transfers, so its share is what gets calibrated: the
        # simulated communication time (exposed in the makespan, plus DP) is weighted by
        # `comm_weight` in [0, 1] so that the current plan predicts its measured step, and
        # what remains (optimizer, loss reduction) is a constant. A measured step shorter
        # than even the simulated compute scales the compute instead.
        self.scale, self.comm_weight, self.other_ms = 1.0, 1.0, 0.0
        self.slow_links: set[tuple[int, int]] = set()   # rank pairs measured slower than before
        self.slow_ranks: set[int] = set()
        self.fault_factor, self.fault_ms = 1.0, 0.0
        self.least_factor = 1.0                  # _find_slow
        self.healthy_parts: dict | None = None   # the healthy step's modelled parts, for the log
        ref = measured.reference
        if ref is None:
            self._fit(measured.step_ms)
            return
        # Under a fault the step's unexplained time is mostly the fault's (small collectives
        # and waits over the slow link that the model does not price), and a constant would
        # carry it into candidates that avoid the slow link. So the constants come from the
        # healthy steps, and what the fault added beyond the model is put on what the monitor
        # measured as slow: the links (or, failing those, the ranks) that slowed by min_shift.
        healthy = CostModel(spec, seq_len, world, ranks_per_node, ref, a)
        self.healthy_parts = dict(zip(("compute_ms", "comm_ms"), healthy.components(cur)),
                                  collective_gbps=ref.collective_gbps)
        self.scale, self.comm_weight, self.other_ms = \
            healthy.scale, healthy.comm_weight, healthy.other_ms
        self._find_slow(healthy, a.min_shift)
        self.fault_ms = measured.step_ms - self.predict(cur)
        # a model that over-prices the slow links (their rate comes from sampled transfers)
        # has them scaled down the same way, rather than a negative constant carried into
        # every candidate, those that avoid the slow links most of all; a slow rank's compute
        # is measured, not sampled, and is not scaled below what was measured
        if (self.fault_ms > 0 and (self.slow_links or self.slow_ranks)) \
                or (self.fault_ms < 0 and self.slow_links):
            self.fault_factor = self._solve_factor(cur, measured.step_ms)
        # what the slow parts cannot explain stays a constant: the running plan still predicts
        # its measured step
        self.other_ms += measured.step_ms - self.predict(cur)

    @property
    def _precision(self) -> str:
        """The precision whose op counts apply (commpipe.plan.runtime_ops): the element size."""
        return "bf16" if self.m.element_bytes == 2 else "fp32"

    def op_work(self, plan: Layout, s: int) -> float:
        """The part of a micro-batch's F + B on stage s of `plan` that is fixed per micro-batch,
        as units of work (0: not separated)."""
        if not self.m.op_work:
            return 0.0
        return sum(stage_ops(plan.stage_layers, s, self._precision, *self._op_group(plan))) \
            * self.m.op_work

    def _op_group(self, plan: Layout) -> tuple[int, int]:
        """(tp, cp) whose ops a layer of `plan` adds (commpipe.plan.runtime_ops.layer_ops): TP's
        are counted with sequence parallelism, as commpipe's runtime runs it."""
        return (plan.tp if self.m.sequence_parallel else 1), plan.cp

    def _fit(self, step: float) -> None:
        """The calibration without a healthy reference: the running plan's step as measured."""
        compute, comm = self.components(self.m.plan)
        if step < compute:
            self.scale, self.comm_weight = step / compute, 0.0
        else:
            self.comm_weight = min(1.0, (step - compute) / comm) if comm > 0 else 0.0
            self.other_ms = step - compute - self.comm_weight * comm

    def _find_slow(self, healthy: CostModel, min_shift: float) -> None:
        """Rank pairs whose link, and ranks whose compute, the monitor measured at least
        `min_shift` slower than in the healthy steps. A link is judged by its own rate where
        both were measured, else by its link class's collective rate."""
        slower = 1.0 + min_shift
        for a in range(self.world):
            for b in range(self.world):
                if a != b and healthy.link(a, b)[1] > slower * self.link(a, b)[1]:
                    self.slow_links.add((a, b))
        # the least factor on the slow links' time: at it the fastest of them is back at its
        # healthy rate (point to point, and the collectives of its class); below it a step
        # measured a little under the model would price the slow links faster than healthy
        ratios = [self.link(a, b)[1] / healthy.link(a, b)[1] for a, b in self.slow_links]
        for cls in {self.link_class(a, b) for a, b in self.slow_links}:
            now, before = self.m.collective_gbps.get(cls), healthy.m.collective_gbps.get(cls)
            if now and before:
                ratios.append(now / before)
        self.least_factor = max(ratios, default=1.0)
        self.slow_ranks = {g for g, k in self.k.items() if k > slower * healthy.k.get(g, 1.0)}

    def _solve_factor(self, plan: Layout, step: float) -> float:
        """The factor on the slow links' time (or the slow ranks' compute) that makes `plan`
        predict `step`: bisection, the prediction grows with it. Above 1 where the model
        without it predicts less than `step`; below 1 where it predicts more, down to
        `least_factor` at most (the slow links back at their healthy rates: what is still over
        stays in the constant)."""
        self.fault_factor = 1.0
        lo, hi = (1.0, 1e4) if self.predict(plan) < step else (min(self.least_factor, 1.0), 1.0)
        self.fault_factor = hi
        if self.predict(plan) < step:
            return hi
        self.fault_factor = lo
        if self.predict(plan) > step:
            return lo
        for _ in range(60):
            self.fault_factor = mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if self.predict(plan) < step else (lo, mid)
        return hi

    def describe(self) -> dict:
        """The calibration behind the predictions, for the decision log."""
        c = self.m.costs
        return {"f_ms": c.f, "b_ms": c.b, "host_ms": self.m.host_ms, "unit_ms": self.unit,
                "op_work": self.m.op_work,
                "slowdown": {str(g): k for g, k in sorted(self.k.items())},
                "links": {f"{a}->{b}": bw for (a, b), (_, bw) in sorted(self.m.links.items())},
                "scale": self.scale, "comm_weight": self.comm_weight, "other_ms": self.other_ms,
                "reference_step_ms": self.m.reference.step_ms if self.m.reference else None,
                "reference_parts": self.healthy_parts,
                "fault_ms": self.fault_ms, "fault_factor": self.fault_factor,
                "slow_links": sorted(f"{a}->{b}" for a, b in self.slow_links),
                "slow_ranks": sorted(self.slow_ranks)}

    def slowdown(self, rank: int) -> float:
        """A rank's measured slowdown factor; a slow rank's carries the fault's unexplained
        time where no link was measured slow."""
        k = self.k.get(rank, 1.0)
        return k * self.fault_factor if rank in self.slow_ranks and not self.slow_links else k

    # -- prediction ----------------------------------------------------------------------------
    def predict(self, plan: Layout) -> float:
        """Predicted step time (ms) of `plan` on the measured machine."""
        compute, comm = self.components(plan)
        return compute * self.scale + comm * self.comm_weight + self.other_ms

    def components(self, plan: Layout) -> tuple[float, float]:
        """(simulated step without communication, the communication it adds) in ms. Under
        uneven DP each replica's pipeline is simulated with its own count and its own ranks'
        slowdowns; the slowest replica sets the step."""
        if not plan.dp_microbatches:
            bare, makespan = self._pipeline(plan, range(plan.dp), plan.microbatches)
        else:
            bare, makespan = max((self._pipeline(plan, [d], c)
                                  for d, c in enumerate(plan.dp_microbatches)),
                                 key=lambda x: x[1])
        return bare, makespan - bare + self._dp_ms(plan)

    def replica_slowdown(self, plan: Layout, d: int) -> float:
        """The slowest measured factor among DP replica d's ranks under `plan`."""
        dims = plan.dims
        return max(self.slowdown(dims.rank_of(pp=s, dp=d, cp=q, tp=t)) for s in range(plan.pp)
                   for q in range(plan.cp) for t in range(plan.tp))

    def _pipeline(self, plan: Layout, replicas, m: int) -> tuple[float, float]:
        """(makespan without communication, with it) of `m` micro-batches through the pipeline,
        each stage at the slowest factor among its ranks in `replicas`."""
        spec, seq = self.spec, self.seq_len
        dims = plan.dims
        program = generate(plan.schedule, plan.pp, m, 1)
        n = program.num_stages
        act_bytes = self.m.element_bytes * plan.micro_batch_size * (seq // plan.cp) * spec.hidden
        f, b, tp_comm, lat, bw = [], [], [], {}, {}
        for s, layers in enumerate(plan.stage_layers):
            group = [dims.rank_of(pp=s, dp=d, cp=q, tp=t) for d in replicas
                     for q in range(plan.cp) for t in range(plan.tp)]
            k = max(self.slowdown(g) for g in group)
            work = stage_work(spec, seq, plan.stage_layers, s) * plan.micro_batch_size
            busy = k * self.unit * (work / (plan.tp * plan.cp) + self.op_work(plan, s))
            f.append(busy * self.f_share + self.m.host_ms)
            b.append(busy * (1 - self.f_share) + self.m.host_ms)
            comm = 0.0
            if plan.tp > 1:   # Megatron TP: 2 all-reduces' traffic per layer and pass, made as
                # 2 calls, or under sequence parallelism as 2 all-gathers and 2 reduce-scatters
                calls = 4 if self.m.sequence_parallel else 2
                comm += layers * (2 * self.all_reduce_ms(act_bytes, dims.group_of("tp", group[0]),
                                                         plan, "tp")
                                  + calls * self.m.call_ms)
            if plan.cp > 1:   # this rank's K (and V): [b, s/cp, kv_dim/tp], 2 calls a pass
                k_bytes = act_bytes * spec.kv_dim / spec.hidden / plan.tp
                comm += layers * (self.cp_ms(k_bytes, dims.group_of("cp", group[0]), plan)
                                  + 2 * self.m.call_ms)
            comm += ep_stage_ms(self, plan, s, group)   # MoE: the EP all-to-alls
            tp_comm.append(comm)
            if s + 1 < n:
                src, dst = dims.rank_of(pp=s), dims.rank_of(pp=s + 1)
                lat[(s, s + 1)], bw[(s, s + 1)] = self.link(src, dst)
        # the simulator's links are between pipeline ranks (program ranks = pp ranks)
        costs = CostTable(f=f, b=b, latency_ms=lat or 0.0, bandwidth_gbps=bw or float("inf"),
                          activation_bytes=act_bytes, tp_comm=tp_comm)
        makespan = simulate(program, costs, check=False).makespan
        bare = simulate(program, CostTable(f=f, b=b), check=False).makespan
        return bare, makespan

    def _dp_ms(self, plan: Layout) -> float:
        n = plan.pp
        dims = plan.dims
        dp_ms = 0.0
        if plan.dp * plan.cp > 1:   # gradients are summed over DP and CP ranks (GradReducer):
            # an all-reduce of the largest stage's TP shard, fp32; a MoE stage's routed experts
            # (E/ep per layer) over the ranks holding the same experts (edp) instead
            shared, experts = max((stage_params(self.spec, plan, s) for s in range(n)), key=sum)
            if plan.ep == 1:     # edp is the dp x cp group: one reduction
                shared, experts = shared + experts, 0.0
            dp_ms = self._reduction_ms(4.0 * shared / plan.tp, dims.group_of("dp_cp", 0),
                                       plan)
            if experts:
                dp_ms += self._reduction_ms(4.0 * experts / plan.ep, edp_group(plan), plan,
                                            "edp")
        return dp_ms

    def _reduction_ms(self, nbytes: float, ranks: list[int], plan: Layout | None = None,
                      dim: str = "dp_cp") -> float:
        """A gradient all-reduce of `nbytes` over `ranks` (a group of `dim`), made as one call
        per bucket of `Measured.dp_bucket_bytes` (commpipe.parallel.data.GradReducer), each
        paying the measured call time on gloo."""
        if len(ranks) < 2 or nbytes <= 0:
            return 0.0
        calls = math.ceil(nbytes / self.m.dp_bucket_bytes)
        return self.all_reduce_ms(nbytes, ranks, plan, dim) + calls * self.m.call_ms

    def stage_rate(self, plan: Layout, s: int) -> float:
        """Stage s's slowdown under `plan`: its slowest rank's measured factor."""
        dims = plan.dims
        group = [dims.rank_of(pp=s, dp=d, cp=q, tp=t) for d in range(plan.dp)
                 for q in range(plan.cp) for t in range(plan.tp)]
        return max(self.slowdown(g) for g in group)

    def layer_ms(self, plan: Layout) -> list[float]:
        """Healthy F + B ms of each layer for one micro-batch of `plan`: its FLOPs and its fixed
        part at the healthy unit (the head, and its ops, on the last layer)."""
        costs = family_of(self.spec).layer_costs(self.spec, self.seq_len)
        per_sample = self.seq_len * plan.micro_batch_size / (plan.tp * plan.cp)
        ms = [self.unit * c * per_sample for c in costs]
        if self.m.op_work:
            ops = sum(layer_ops(self._precision, *self._op_group(plan)))
            ms = [x + self.unit * ops * self.m.op_work for x in ms]
            ms[-1] += self.unit * sum(microbatch_ops(self._precision)) * self.m.op_work
        return ms

    def balanced_split(self, plan: Layout) -> tuple[int, ...]:
        """Contiguous layers per stage minimising the slowest stage, each stage's time scaled by
        its measured slowdown (the same balancer as --stage-layers auto)."""
        from commpipe.parallel.balance import balance

        return tuple(balance(self.layer_ms(plan), plan.pp,
                             [self.stage_rate(plan, s) for s in range(plan.pp)]))
