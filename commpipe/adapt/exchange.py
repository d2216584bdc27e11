"""The controller's per-step exchange: every rank's summary of a step, on every rank.

After each step every rank posts one small summary (its signals: commpipe.adapt.signals; its
stop flag; the monitor's exchange payload, which rides along) in one object all-gather on a
process group of its own (Comm.start_gather_objects). While the controller watches, the gather
is read after the next step: by then every rank has long posted its own, so no rank waits at
the end of a step for the slowest one, and the detector sees each step one step later. The trial
phase and the run's last step read it at once (a trial measures the step just run). Before a
switch replaces the process groups, and when the run stops, the summary in flight is read
(`drain`), so no monitor record is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from commpipe.adapt.signals import rank_summary


@dataclass
class Posted:
    step: int
    gathering: object            # commpipe.parallel.object_rows.Gathering
    timeline: list | None        # this rank's timeline of the step (pipeline rank 0s of a group)
    monitor: object | None       # the monitor whose payload rides along, if one does


@dataclass
class Taken:
    step: int
    summaries: list              # every rank's summary, in rank order
    timeline: list | None


class Exchange:
    def __init__(self, ranks_per_node: int, timer):
        self.rpn, self.timer = ranks_per_node, timer
        self.pending: Posted | None = None
        self.stop_agreed = False     # did any rank's summary read in this step ask to stop?

    def step(self, trainer, rec: dict, stop: bool, lagged: bool) -> list[Taken]:
        """Post this step's summary; return the summaries read now, oldest first: the previous
        step's (if in flight) and, unless `lagged`, this one's."""
        self.stop_agreed = False
        taken = [self.drain()] if self.pending is not None else []
        posted = self.post(trainer, rec, stop)     # after the read: the monitor's records of
        if lagged:                                 # the previous step are written by then
            self.pending = posted
        else:
            taken.append(self.read(posted))
        return taken

    def post(self, trainer, rec: dict, stop: bool) -> Posted:
        summary = rank_summary(trainer, rec["step"], self.rpn, self.timer)
        summary["step_ms"] = rec["step_time_s"] * 1e3
        summary["stop"] = stop
        c = trainer.comm.coords
        timeline = None
        if c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0:
            timeline = [e.to_dict() for e in trainer.runtime.events or ()]
        mon = trainer.monitor
        mon = mon if mon is not None and mon.exchange_by_caller else None
        carried = mon.exchange_payload() if mon is not None else None
        return Posted(rec["step"], trainer.comm.start_gather_objects((summary, carried)),
                      timeline, mon)

    def read(self, posted: Posted) -> Taken:
        """Every rank's summary of a posted step (collective); its monitor records written."""
        gathered = posted.gathering.result()
        summaries = [s for s, _ in gathered]
        self.stop_agreed = self.stop_agreed or any(s["stop"] for s in summaries)
        if posted.monitor is not None:
            posted.monitor.exchange_ingest([p for _, p in gathered])
        return Taken(posted.step, summaries, posted.timeline)

    def drain(self) -> Taken | None:
        """Read the summary in flight, if any (collective)."""
        if self.pending is None:
            return None
        posted, self.pending = self.pending, None
        return self.read(posted)

    def abandon(self) -> None:
        """Forget the summary in flight (a rank failed: no collective may follow)."""
        self.pending = None
