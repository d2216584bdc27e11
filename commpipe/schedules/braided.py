"""Braided V schedules: `stp(p, m)` and `dualpipev(p, m)`, pure functions -> compute-only Program.

Both place two chunks per rank in a V (rank r holds stage r going down and stage 2p-1-r coming
back, like ZB-V), so the turn at rank p-1 and the loss on rank 0 need no communication, and
both pair a forward of one micro-batch with a backward-side pass of another in one braided
action ("2F5&5B1", see actions.py), executed unit by unit so that each unit's TP collective is
in flight while the other pass computes.

Notation in the comments: chunk 0 = the rank's down stage, chunk 1 = its up stage; F0/F1 the
next forward of that chunk, B/I the next (full / input-gradient) backward, W the oldest
deferred weight gradient (first in, first out).
"""

from __future__ import annotations

from collections import deque

from commpipe.schedules.actions import B, F, I, Program, W, braid, make_program


def _check_v(name: str, p: int, m: int, min_m: int) -> None:
    if p < 1:
        raise ValueError(f"{name}: pp={p} must be >= 1")
    if m < min_m:
        raise ValueError(f"{name} needs microbatches >= 2*pp = {min_m} to fill the V and reach its "
                         f"braided steady state, got m={m} (pp={p}); use --microbatches {min_m} or "
                         f"more (any m >= {min_m} works), or --schedule zbv")


def _v_placement(p: int) -> list[int]:
    return list(range(p)) + list(range(p - 1, -1, -1))


class _Rank:
    """Counters for one rank's two chunks, emitting actions in order."""

    def __init__(self, p: int, r: int):
        self.stage = (r, 2 * p - 1 - r)
        self.nf, self.nb = [0, 0], [0, 0]
        self.deferred: deque = deque()            # weight gradients not yet run, oldest first
        self.acts: list = []

    def f(self, c: int):
        a = F(self.stage[c], self.nf[c])
        self.nf[c] += 1
        return a

    def b(self, c: int, split: bool):
        """The next backward of chunk c: whole (B), or I with its W deferred."""
        s, mb = self.stage[c], self.nb[c]
        self.nb[c] += 1
        if split:
            self.deferred.append(W(s, mb))
            return I(s, mb)
        return B(s, mb)

    def w(self):
        return self.deferred.popleft()

    def emit(self, *actions):
        self.acts += actions


def dualpipev(p: int, m: int) -> Program:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto p ranks as a V): overlapped F&B pairs.

    After DeepSeek's public description of DualPipeV (eight phases per rank, below). Each
    steady-state step runs two braids, F0&B1 then F1&B0: the forward of one chunk overlaps the
    full backward of the other. Input-gradient / weight-gradient splitting (zero bubble) is
    used only where it fills the ramp-up and the drain. Needs m >= 2p.
    """
    _check_v("dualpipev", p, m, 2 * p)
    per_rank = []
    for r in range(p):
        k = _Rank(p, r)
        _v_warm_up(k, p, r)                                   # phases 1 and 2
        # 3. ramp: the first chunk-1 gradients; I, its W at once, then the next F1
        for _ in range(p - r - 1):
            k.emit(k.b(1, True), k.w(), k.f(1))
        # 4. steady state: F0&B1 then F1&B0 braids (the last rank's first F0 runs alone: its
        #    B1 gradient is still on its way from rank p-2)
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                k.emit(k.f(0), k.b(1, False))
            else:
                k.emit(braid(k.f(0), k.b(1, False)))
            k.emit(braid(k.f(1), k.b(0, False)))
        # 5. chunk-0 forwards are done: B1, then F1&B0
        for _ in range(p - r - 1):
            k.emit(k.b(1, False), braid(k.f(1), k.b(0, False)))
        # 6. drain: B1, B0 pairs; from the middle on, split them and defer W
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            k.emit(k.b(1, split))
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            k.emit(k.b(0, split))
        # 7. drain: a deferred W, then the next B0 as I (its W deferred too)
        for _ in range(p - r - 1):
            k.emit(k.w(), k.b(0, True))
        # 8. tail: the remaining weight gradients
        while k.deferred:
            k.emit(k.w())
        per_rank.append(k.acts)
    return make_program("dualpipev", p, m, _v_placement(p), per_rank)


def _v_warm_up(k: _Rank, p: int, r: int) -> None:
    """The warm-up both V schedules share, on rank r of p."""
    # 1. chunk-0 forwards until micro-batch 0 is back at this rank's chunk 1
    for _ in range(2 * (p - r - 1)):
        k.emit(k.f(0))
    # 2. alternate F0, F1 while chunk-1 inputs arrive every other slot
    for _ in range(r + 1):
        k.emit(k.f(0), k.f(1))


def stp(p: int, m: int) -> Program:
    """STP's braided V schedule (Qi et al., "Synergistic Tensor and Pipeline Parallelism",
    NeurIPS 2025), after the paper's description: warm-up forwards; F&W braids where the first
    gradients arrive (the F's TP collectives hide behind the W's compute); F&I braids in the
    steady state (both passes carry TP collectives and hide each other's), with the W's run
    between them; cool-down input gradients first, their W's deferred into the tail.

    Written from the paper's description and cost table, not transcribed from its release.
    Every forward and every input gradient of the steady state is braided, so the exposed TP
    time comes from the ramp-up and drain only and does not grow with m. Deferring the W's
    holds more activations than ZB-V (about 3p chunk activations on rank 0, the paper's
    3p M_a). Needs m >= 2p.
    """
    _check_v("stp", p, m, 2 * p)
    per_rank = []
    for r in range(p):
        k = _Rank(p, r)
        _v_warm_up(k, p, r)                                   # phases 1 and 2
        # 3. ramp: chunk-1 gradients arrive; I (on the critical path), then F1&W braided
        for _ in range(p - r - 1):
            k.emit(k.b(1, True))
            k.emit(braid(k.f(1), k.w()))
        # 4. steady state: F0&I1, W, F1&I0, W - every forward braided with an input gradient
        for _ in range(m - 2 * p + r + 1):
            k.emit(braid(k.f(0), k.b(1, True)), k.w())
            k.emit(braid(k.f(1), k.b(0, True)), k.w())
        # 5. cool-down: chunk-0 forwards are done; I1, one deferred W while the chunk-0
        #    gradient travels, then F1&I0
        for _ in range(p - r - 1):
            k.emit(k.b(1, True), k.w(), braid(k.f(1), k.b(0, True)))
        # 6. cool-down: the last input gradients, both chunks, W's deferred
        for _ in range(r + 1):
            k.emit(k.b(1, True), k.b(0, True))
        # 7. cool-down: chunk-0 gradients still arrive; two deferred W's fill each wait
        for _ in range(p - r - 1):
            k.emit(*(k.w() for _ in range(min(2, len(k.deferred)))), k.b(0, True))
        # 8. tail: the deferred weight gradients fill the drain
        while k.deferred:
            k.emit(k.w())
        per_rank.append(k.acts)
    return make_program("stp", p, m, _v_placement(p), per_rank)
