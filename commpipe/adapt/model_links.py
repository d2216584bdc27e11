"""How the adaptive controller's cost model (commpipe.adapt.model.CostModel) prices links and
collectives from what the running plan measured.

A point-to-point link is priced at its own measured rate, else its node pair's (a degraded
node link slows every pair across it), else its class's; a fault's unexplained time rides on
the links measured slow (`fault_on_link`). A collective is priced by the planner's `Cluster`
(commpipe.plan.cluster: bus bytes and latency steps per backend) at the bus rate measured for
its link class; across nodes at its share of each node's link, which every group of its
dimension crossing from the node uses at once (`link_share`; an EP all-to-all's senders:
`a2a_senders`).
"""

from __future__ import annotations

import statistics

from commpipe.layout import Layout
from commpipe.plan.cluster import Cluster, Link, groups_on_a_node_link, ranks_on_a_node_link
from commpipe.plan.gpus import GPU

# Collectives are priced by the planner's Cluster, whose GPU entry only matters for compute,
# which is measured here: a placeholder with no peak of its own.
MEASURED_RUN = GPU("measured run", tflops=0.0, mem_gb=0.0, hbm_gbps=0.0, nvlink_gbps=0.0,
                   nic_gbps=0.0)


class MeasuredLinks:
    """Link and collective prices of CostModel: it sets `m` (Measured), `rpn`, `world`,
    `default_gbps`, `base_latency`, `slow_links` and `fault_factor`."""

    def node(self, rank: int) -> int:
        return rank // self.rpn

    def link_class(self, a: int, b: int) -> str:
        return "intra_node" if self.node(a) == self.node(b) else "inter_node"

    def class_gbps(self, cls: str) -> float:
        if cls in self.m.collective_gbps:
            return self.m.collective_gbps[cls]
        vals = [bw for (a, b), (_, bw) in self.m.links.items()
                if bw and self.link_class(a, b) == cls]
        if vals:
            return statistics.median(vals)
        return self.default_gbps[cls]

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(latency ms, GB/s) of a -> b: measured for this pair, else for this node pair (a
        degraded node link slows every pair across it), else the class's median."""
        lat, bw = self._measured_link(a, b)
        return lat, bw / self.fault_on_link(a, b)

    def fault_on_link(self, a: int, b: int) -> float:
        """The factor on a -> b's time that carries the fault's unexplained time (1: healthy)."""
        return self.fault_factor if (a, b) in self.slow_links else 1.0

    def _measured_link(self, a: int, b: int) -> tuple[float, float]:
        for key in ((a, b), (b, a)):
            if key in self.m.links and self.m.links[key][1]:
                return self.base_latency, self.m.links[key][1]
        na, nb = self.node(a), self.node(b)
        same_nodes = [bw for (x, y), (_, bw) in self.m.links.items()
                      if bw and {self.node(x), self.node(y)} == {na, nb}]
        if same_nodes:
            return self.base_latency, min(same_nodes)
        return self.base_latency, self.class_gbps(self.link_class(a, b))

    def group_gbps(self, ranks: list[int]) -> float:
        """A ring runs at its slowest hop."""
        if len(ranks) < 2:
            return float("inf")
        return min(self.link(ranks[i], ranks[(i + 1) % len(ranks)])[1] for i in range(len(ranks)))

    def cluster_for(self, ranks: list[int], plan: Layout | None = None, dim: str = "dp_cp"
                    ) -> Cluster:
        """The planner's cluster (commpipe.plan.cluster, whose collective pricing this uses) as
        the group `ranks` sees it: at the bus bandwidth measured for collectives of its link
        class when there is one, else at its slowest hop's point-to-point rate; the run's
        backend sets the latency steps (gloo rings, NCCL trees). Across nodes, when `plan`
        runs other groups of `dim` through the same node link at once, at its share of the
        link (`link_share`)."""
        cls = "intra_node" if len({self.node(r) for r in ranks}) == 1 else "inter_node"
        # the group's ring crosses a slow link if any pair of it is slow: the fault's factor
        # (above 1, or below where the model over-priced the slow link: CostModel.__init__)
        slow = any((a, b) in self.slow_links for a in ranks for b in ranks if a != b)
        fault = self.fault_factor if slow else 1.0
        gbps = self.m.collective_gbps.get(cls)
        gbps = gbps / fault if gbps else self.group_gbps(ranks)
        if cls == "inter_node" and plan is not None:     # a whole node link's rate, shared
            gbps = gbps / self.link_share(plan, dim, ranks)
        link = Link(gbps, self.base_latency / 1e3)
        return Cluster(MEASURED_RUN, self.world, self.rpn, intra=link, inter=link,
                       source="measured", backend=self.m.backend)

    def link_share(self, plan: Layout, dim: str, ranks: list[int]) -> int:
        """Groups of `dim` whose collectives cross a node link that `ranks` cross
        (commpipe.plan.cluster.groups_on_a_node_link): a node's ranks share its one link, as
        two all-to-alls between the emulated nodes took 1.4-1.9x one's time
        (benchmarks/ep_transfer_beside_compute.py). Every pipeline stage's groups count: the
        stages' reductions start a backward pass apart, and a slow link's last far longer."""
        return groups_on_a_node_link(groups_of(plan, dim), self.node, ranks)

    def a2a_senders(self, plan: Layout, ranks: list[int]) -> int:
        """Ranks sending across the busiest node link that the EP group `ranks` crosses, while
        every EP group of `plan` dispatches at once (commpipe.plan.cluster.ranks_on_a_node_link):
        each gets that share of the link's measured rate."""
        return ranks_on_a_node_link(groups_of(plan, "ep"), self.node, ranks)

    def all_reduce_ms(self, nbytes: float, ranks: list[int], plan: Layout | None = None,
                      dim: str = "dp_cp") -> float:
        return 1e3 * self.cluster_for(ranks, plan, dim).all_reduce(nbytes, len(ranks), 1) \
            if len(ranks) > 1 else 0.0

    def cp_ms(self, k_bytes: float, ranks: list[int], plan: Layout | None = None) -> float:
        """Context parallelism per layer and pass (commpipe.parallel.context): forward
        all-gathers K and V (each rank's `k_bytes` of each), backward reduce-scatters their
        gradients; the mean of the two, as the simulator adds one value to F and to B."""
        n = len(ranks)
        if n < 2:
            return 0.0
        cl = self.cluster_for(ranks, plan, "cp")
        gather = 2 * cl.all_gather(n * k_bytes, n, 1)
        scatter = 2 * cl.reduce_scatter(n * k_bytes, n, 1)
        return 1e3 * (gather + scatter) / 2


def groups_of(plan: Layout, dim: str) -> list[list[int]]:
    """The groups of `dim` under `plan`: a dimension of its rank grid, or expert parallelism's
    "ep" and "edp" groups (commpipe.parallel.expert.ep_groups)."""
    if dim in ("ep", "edp"):
        from commpipe.parallel.expert import ep_groups

        eps, edps = ep_groups(plan.dims, plan.ep)
        return eps if dim == "ep" else edps
    return plan.dims.groups(dim)
