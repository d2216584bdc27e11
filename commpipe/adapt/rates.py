"""What the controller knows of the cluster's links across plans (rank 0).

A plan that keeps its collectives off a slow link sends nothing over it, so its own steps
measure no rate there; without a memory the cost model would price that link at its class's
default and switch back onto it. `KnownRates` keeps the last rate any plan measured per
pipeline link and per link class's collectives, the links no step measured at all (measured by
a short probe, commpipe.adapt.link_probe), and on gloo the time of a collective call beyond its
link, priced from the calls timed on this host at the start.
"""

from __future__ import annotations

from commpipe.adapt import link_probe
from commpipe.adapt.model import Measured
from commpipe.adapt.signals import collective_rates, link_rates


class KnownRates:
    def __init__(self):
        self.links: dict = {}                    # (src, dst) -> (latency ms, GB/s)
        self.collective: dict[str, float] = {}   # link class -> collective GB/s
        self.call_ms: float | None = None        # a gloo call's time beyond its link
        self.host: dict | None = None            # what rank 0 measured of this host at the start

    def recall(self, m: Measured, learn: bool) -> None:
        """Rates `m` did not measure are the last ones an earlier plan measured. With `learn`,
        what `m` measured becomes the rate known from now on."""
        if learn:
            self.links.update({k: v for k, v in m.links.items() if v[1]})
            self.collective.update(m.collective_gbps)
        links = dict(self.links)
        links.update({k: v for k, v in m.links.items() if v[1] or k not in links})
        m.links = links
        m.collective_gbps = self.collective | m.collective_gbps
        m.call_ms = self.call_ms or 0.0

    def measure_unrated(self, comm, window: list, least_bytes: float, world: int,
                        rpn: int) -> dict | None:
        """Measure the link classes neither the window's summaries nor an earlier plan gave a
        rate for and, once a run on gloo, price a collective call from the calls timed at the
        start: collective; rank 0 keeps what was measured and returns it (None elsewhere, or
        when nothing was)."""
        pairs = None
        if comm.rank == 0:
            rated = link_probe.rated_classes(
                self.links | link_rates(window, least_bytes),
                self.collective | collective_rates(window, rpn, least_bytes), rpn)
            pairs = link_probe.pairs_to_measure(world, rpn, rated)
        pairs = comm.broadcast_object(pairs, 0)
        out = {}
        if pairs:
            rates, took = link_probe.measure(comm, pairs)
            self.links.update(rates)
            out = {"seconds": took, "links": {f"{a}->{b}": {"latency_ms": lat, "gbps": gbps}
                                              for (a, b), (lat, gbps) in rates.items()}}
        if self.call_ms is None and (self.host or {}).get("calls"):
            # the calls timed at the start, less what they paid on the link known now, then
            # stretched by the ranks that share the machine's cores in training
            # (link_probe.host_sharing: the calls were timed with the others asleep)
            lat, gbps = self.links.get((0, 1)) or (None, None)
            alone = link_probe.call_ms(self.host["calls"], self.host["call_bytes"],
                                       lat or 0.0, gbps or float("inf"))
            factor = (self.host.get("sharing") or {}).get("factor", 1.0)
            self.call_ms = alone * factor
            out |= {"call_ms": self.call_ms, "call_ms_alone": alone, "sharing_factor": factor}
        return out if out and comm.rank == 0 else None
