"""Measuring a link class no transfer of the running plan gave a rate for, at an evaluation.

The adaptive model prices a candidate's traffic over each link class at what the run measured
there: the collectives' bus rate, else the pipeline sends' rate (commpipe.adapt.model). A plan
may measure neither on a class its candidates would use: a pp2 run across two nodes whose
activations are smaller than `collective_min_bytes` (they time the host's scheduling, not the
link) says nothing of what a dp2 gradient all-reduce over the same link would take. Priced at
`default_inter_gbps` (a 10 Gbit/s network) such a candidate on the suite's 1 Gbit/s link came
out 1.7x faster than it ran, and its trial cost the run more than the straggler it answered.

So the evaluation measures such a class first: rank 0 and a rank of the class (the first
other rank on its node, the first rank on another node; `commpipe probe`'s pairs) ping-pong
64 KiB and 1 MiB messages a few times, and the latency/bandwidth fit of `commpipe probe` gives
the rate, under whatever the link does now (a degraded link is measured degraded). Rank 0
keeps it as a known link rate for the rest of the run, so each class is measured at most once;
a rate the running plan measures itself later replaces it. About 0.1 s at 1 Gbit/s, once.

What does not depend on a link is measured once, before the first step (`measure_host`), so
that the evaluation answering a fault pays only for the link it measures. On gloo, collectives
are timed as training makes them: ranks 0 and 1, in a group of their own, make each call after
0.5 ms of compute with no barrier between (`commpipe probe`'s calls_after_compute, 30 of each
op), the other ranks waiting. What a call costs beyond its latency steps and bytes
(commpipe.plan.cluster.call_overhead, at the link rate known at the first evaluation) is the
per-call time the model adds to each TP and CP collective of a candidate
(commpipe.adapt.model). On 2 vCPUs a call costs 0.8-1.6 ms there (suite run M) against a
ping-pong's 0.05-0.1 ms latency; run L's tp2 trial measured 197 ms against the 43 predicted
without it. On a CPU, rank 0 also measures how an eager pass splits into a part fixed per
micro-batch and a part that grows with it (commpipe.plan.pass_split, `Measured.op_work`).
Together about 0.3-0.5 s on 2 vCPUs, once a run; at the first evaluation, where they were
measured until then, they lengthened the step that answered the fault by as much (suite runs
M and N: 0.5-0.7 s against 0.1 s steps).
"""

from __future__ import annotations

import time

SIZES = (1 << 16, 1 << 20)     # bytes: above collective_min_bytes, and large enough for the rate
ITERS, WARMUP = 3, 1
CALLS, CALLS_WARMUP = 30, 5
PAIR = "call_pair"           # the group of ranks 0 and 1 that times calls (Comm.add_groups)


def class_of(a: int, b: int, ranks_per_node: int) -> str:
    return "intra_node" if a // ranks_per_node == b // ranks_per_node else "inter_node"


def pairs_to_measure(world: int, ranks_per_node: int, rated: set[str]) -> list[tuple[int, int]]:
    """The pairs (rank 0 first) of the link classes this world has and `rated` lacks: those
    `commpipe probe` measures (commpipe.monitor.probe.probe_pairs)."""
    from commpipe.monitor.probe import probe_pairs

    pairs = probe_pairs([r // ranks_per_node for r in range(world)])
    return [p for cls, p in pairs.items() if p is not None and cls not in rated]


def rated_classes(links: dict, collective_gbps: dict, ranks_per_node: int) -> set[str]:
    """The link classes with a measured rate: a collective bus rate, or a pipeline link's."""
    rated = {cls for cls, gbps in collective_gbps.items() if gbps}
    rated |= {class_of(a, b, ranks_per_node) for (a, b), (_, gbps) in links.items() if gbps}
    return rated


def measure(comm, pairs: list[tuple[int, int]]) -> tuple[dict, float]:
    """Ping-pong each pair (collective: every rank calls it with the same `pairs`; only the
    pair's ranks move data). Returns ({(a, b): (latency ms, GB/s)} on rank a, seconds taken)."""
    from commpipe.monitor.probe import fit_latency_bandwidth, pingpong

    t0 = time.perf_counter()
    out = {}
    for a, b in pairs:
        times = [pingpong(comm, a, b, n, ITERS, WARMUP) for n in SIZES]
        if comm.rank == a and all(t and t > 0 for t in times):
            lat_s, bytes_per_s, _ = fit_latency_bandwidth(list(SIZES), times)
            out[(a, b)] = (lat_s * 1e3, bytes_per_s / 1e9)
    return out, time.perf_counter() - t0


def measure_calls(comm) -> tuple[dict | None, int, float]:
    """Collective: ranks 0 and 1, in a group of their own (`PAIR`, made here on every rank), time
    each collective after compute while the others wait. Returns ({op: {"mean_ms",
    "median_ms", "round_means_ms"}} on ranks 0 and 1 (commpipe.monitor.probe.calls_after_compute:
    the mean is the median of its rounds' means), else None; the bytes of each call; seconds
    taken)."""
    from commpipe.monitor.probe import CALL_BYTES, CALL_GAP_S, calls_after_compute

    t0 = time.perf_counter()
    world = comm.dims.world_size
    if PAIR not in comm.groups:
        comm.add_groups(PAIR, [[0, 1]] + [[r] for r in range(2, world)])
    ops = (calls_after_compute(comm, CALL_BYTES, CALLS, CALLS_WARMUP, CALL_GAP_S, dim=PAIR)
           if comm.rank < 2 else None)
    return ops, CALL_BYTES, time.perf_counter() - t0


def measure_host(trainer) -> dict | None:
    """Collective, once before the first step: on a CPU, rank 0 measures the pass split's
    `op_work` (commpipe.adapt.calibration.op_work, kept for the run); on gloo, ranks 0 and 1
    time collective calls after compute (`measure_calls`). Returns the `host` record of the
    decision log on rank 0 (None elsewhere, or when neither applies)."""
    from commpipe.adapt.calibration import op_work

    comm = trainer.comm
    record = {"step": trainer.step - 1, "action": "host"}
    if trainer.device.type != "cuda" and comm.rank == 0:
        t0 = time.perf_counter()
        record |= {"op_work": op_work(trainer), "op_work_seconds": time.perf_counter() - t0}
    if comm.backend == "gloo" and comm.dims.world_size > 1:
        ops, nbytes, took = measure_calls(comm)
        record |= {"calls": ops, "call_bytes": nbytes, "calls_seconds": took,
                   "sharing": host_sharing(comm, trainer.cfg.emulate_device)}
    return record if comm.rank == 0 and len(record) > 2 else None


def host_sharing(comm, device_factor: float = 1.0) -> dict:
    """Collective: how many ranks share rank 0's machine and the cores they may run on (the
    union of their CPU affinities; a cgroup's CPU quota is not read), and the factor a call's
    host time timed by `measure_calls` (ranks 0 and 1 busy, the others asleep) takes in
    training, when every rank of the machine uses the CPU: processor sharing, as
    commpipe.plan.host stretches a collective call's host time by the busy ranks per core,
        factor = max(1, ranks / (device_factor * cores)) / max(1, timing ranks / cores).
    Under `--emulate-device F` (`device_factor`) a computing rank leaves the host idle for
    F - 1 of every F seconds of its compute, as a rank whose GPU runs the kernels does: 1/F
    of it is busy on a core."""
    import os

    from commpipe.monitor.clock import machine_identity

    rows = comm.gather_objects((machine_identity(), sorted(os.sched_getaffinity(0))), "world")
    machines = [m for m, _ in rows]
    here = machines[0]
    ranks = sum(m == here for m in machines)
    timing = 1 + (len(machines) > 1 and machines[1] == here)
    # the cores those ranks may run on: ranks pinned one to a core share none
    cores = len(set().union(*(set(c) for m, c in rows if m == here)))
    out = {"ranks": ranks, "cores": cores, "timing_ranks": timing,
           "factor": sharing_factor(ranks, timing, cores, device_factor)}
    return out | ({"emulated_device": device_factor} if device_factor > 1.0 else {})


def sharing_factor(ranks: int, timing_ranks: int, cores: int, device_factor: float = 1.0) -> float:
    """Busy ranks per core in training over those while the calls were timed (at least 1); a
    rank under `--emulate-device F` is busy 1/F of its compute time."""
    return max(1.0, ranks / (device_factor * cores)) / max(1.0, timing_ranks / cores)


def call_ms(ops: dict, nbytes: int, latency_ms: float, gbps: float) -> float:
    """Per-call time (ms) of `measure_calls`' ops beyond what 2 ranks pay on a link of
    `latency_ms` and `gbps` (commpipe.plan.cluster.call_overhead, gloo's rings)."""
    from commpipe.adapt.model_links import MEASURED_RUN
    from commpipe.plan.cluster import Cluster, Link, call_overhead

    link = Link(gbps, latency_ms / 1e3)
    cluster = Cluster(MEASURED_RUN, 2, 2, intra=link, inter=link, backend="gloo")
    return 1e3 * (call_overhead(ops, nbytes, cluster, 2) or 0.0)
