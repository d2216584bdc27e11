"""Ranks that share a machine's CPU cores: contention for the cores and for being woken up.

When all ranks of a job run on `cluster.host_cores` cores (training on CPU, or the emulated
cluster of `commpipe sweep`, whose namespaces share one machine), a rank that has work gets a
core only part of the time. With the host contention

    kappa = max(1, ranks busy at once, as a busy rank sees it / cores)
          = max(1, integral of n(t)^2 dt / integral of n(t) dt / cores),

with n(t) the ranks using the CPU at time t: computing or making a collective call (its
`coll_overhead_s`; a rank waiting for its peers inside a collective sleeps, as a blocked gloo
call does: ~0.1% of a core), each repeated on the tp*cp*dp ranks of its pipeline rank, or
stepping the optimizer (all ranks at once, after the pipeline). Each simulated compute action
adds its CPU share (CPU time / duration) to n(t) while it runs. Weighting by n(t) itself is
what a rank experiences: a pipeline whose 4 stages all run in the steady state and idle in the
warm-up has 4 busy ranks whenever one is busy, although 2 on average. The model stretches
  - compute and host overheads by kappa: the cores are shared evenly among busy ranks
    (processor sharing; a rank blocked on a receive sleeps and leaves its core, which gloo does:
    a blocked recv uses ~0.1% of a core);
  - every blocking wait by wake_s * (kappa - 1): each pipeline message and each latency step of
    a collective needs the woken rank back on a core, where on average kappa - 1 other busy
    ranks are ahead of it; wake_s is about one scheduler time slice and is fitted
    (`Efficiency.wake_s`; Linux CFS slices are 0.75-3 ms, sched_min_granularity_ns).
Busy time grows with kappa, so kappa is a fixed point: `estimate.finish_estimate` simulates,
recomputes kappa from the result, re-prices with the damped mean of old and new, and stops when
kappa moves by less than TOLERANCE. Without contention (at most `host_cores` ranks, or
`host_cores` None) nothing changes.

Worked example (tests/test_plan_host.py::test_host_contention_stretches_a_fully_busy_host): four DP
ranks that only compute, on two cores: every rank is busy the whole step, kappa = 4/2 = 2, and
the step takes exactly twice its time on four dedicated cores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from commpipe.plan.cluster import Cluster
from commpipe.plan.efficiency import Efficiency

if TYPE_CHECKING:
    from commpipe.plan.estimate import Estimate

MAX_ITERS = 40
TOLERANCE = 1e-4


def oversubscribed(cluster: Cluster, layout) -> bool:
    return cluster.host_cores is not None and layout.gpus > cluster.host_cores


def contention(est: Estimate, cluster: Cluster) -> tuple[float, float]:
    """(kappa, kappa_wake) implied by a simulated step: ranks using the CPU at once, and ranks
    in play (inside an action, computing or waiting in a collective) at once, each as one of
    them sees it, per host core, at least 1."""
    lay = est.layout
    replicas = lay.tp * lay.cp * lay.dp            # ranks that repeat each pipeline rank
    tail = replicas * sum(est.optimizer_s)         # the optimizer: all ranks at once
    out = []
    for per_rank, overlap in ((est.cpu_s, est.busy_overlap), (est.busy_s, est.presence_overlap)):
        pipe = replicas * sum(per_rank)            # integral of n(t) over the pipeline part
        first = pipe + tail
        second = replicas * overlap * pipe + lay.gpus * tail
        out.append(max(1.0, second / first / cluster.host_cores) if first > 0 else 1.0)
    return out[0], out[1]


def contended(cluster: Cluster, eff: Efficiency, kappa: float,
              kappa_wake: float | None = None) -> tuple[Cluster, Efficiency]:
    """The cluster and efficiency as a rank sees them under host contention `kappa` (compute)
    and `kappa_wake` (waiting for a core after a blocking wait; default kappa)."""
    kappa_wake = kappa if kappa_wake is None else kappa_wake
    if kappa <= 1.0 and kappa_wake <= 1.0:
        return cluster, eff
    gpu = replace(cluster.gpu, tflops=cluster.gpu.tflops / kappa, hbm_gbps=cluster.gpu.hbm_gbps / kappa)
    wait = eff.wake_s * (kappa_wake - 1.0)
    intra = replace(cluster.intra, latency_s=cluster.intra.latency_s + wait)
    inter = replace(cluster.inter, latency_s=cluster.inter.latency_s + wait)
    eff = replace(eff, overhead_s=eff.overhead_s * kappa, coll_overhead_s=eff.coll_overhead_s * kappa,
                  optimizer_overhead_s=eff.optimizer_overhead_s * kappa, op_s=eff.op_s * kappa)
    return replace(cluster, gpu=gpu, intra=intra, inter=inter), eff
