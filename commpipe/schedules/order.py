"""Posting order: when each rank issues its point-to-point operations.

A lowered Program says where each receive is *waited for* (right before its consumer) and where
each send is issued (right after its producer). On a tag-matching backend (gloo with a tag per
message) the runtime may post receives whenever it likes. NCCL is stricter:

- the sends and receives between two ranks are matched in issue order, per direction;
- the operations of one rank pair (both directions) run one after another on one stream, so a
  rank that posts recv(x) then send(y) while its peer posts recv(y) then send(x) deadlocks.

Both hold at once when the two sides of every pair post the pair's messages in one common
sequence. `posting_order` builds such an order: one symbolic run of the program
(`validate.execute`, tag matching) gives every message a send serial; each pair's messages
are ordered by it; a rank's sends stay where the program has them (their serials already
follow its order), and each receive is posted at the latest point that keeps the pair's
sequence: before its consumer, before any own send to the same peer with a later serial, and
before the receives of later messages from that peer. Receives only move earlier and posting
never blocks, so the run that produced the serials is still a run of the new order, and with
every pair agreeing, in-order matching pairs exactly the messages tag matching pairs:
`dry_run` (deadlock-free under tags) plus `channel_order_conflicts` (empty) prove the program
legal under NCCL's rules.

Receive prefetch (posting the receives the next compute needs before the current compute)
is a further move earlier; with `agree=True` it is clamped so that it never passes an
operation of the same pair, which keeps the sequence. Pure Python, no torch.
"""

from __future__ import annotations

from collections import defaultdict

from commpipe.schedules.actions import Action, Program
from commpipe.schedules.validate import execute, message_key

_SENDS, _RECVS = ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")


def peer_of(program: Program, a: Action) -> int:
    """The pipeline rank on the other end of communication action `a`."""
    kind, s, _ = message_key(a)
    if a.op in _SENDS:
        return program.stage_to_rank[s]
    return program.stage_to_rank[s - 1] if kind == "F" else program.stage_to_rank[s + 1]


def as_written(program: Program) -> list[list[int]]:
    """The program's own order as a posting order."""
    return [list(range(len(acts))) for acts in program.actions]


def posting_order(lowered: Program, prefetch: bool = False, agree: bool = True) -> list[list[int]]:
    """Per rank, the indices of its actions in the order the runtime issues them.

    Compute actions and sends keep their relative order; RECVs move earlier. `agree`: keep a
    common per-pair sequence (required on NCCL and in strict-order mode); without it
    (tag-matching gloo) receives are placed freely. `prefetch`: post the receives that the
    next compute action needs before the current one runs, so transfers overlap compute.
    A program that deadlocks or misses messages keeps its own order (the validator reports it).
    """
    serial: dict | None = None
    if agree:
        pcs, serial = execute(lowered)
        finished = all(pcs[r] == len(acts) for r, acts in enumerate(lowered.actions))
        n_recvs = sum(a.op in _RECVS for acts in lowered.actions for a in acts)
        if not finished or len(serial) != n_recvs:
            return as_written(lowered)
    return [_rank_order(lowered, r, prefetch, serial) for r in range(lowered.pp)]


def _rank_order(lowered: Program, r: int, prefetch: bool, serial: dict | None) -> list[int]:
    acts = lowered.actions[r]
    point: dict[int, int] = {}          # RECV index -> index of the action it is posted before
    last_compute = None
    before_compute = []                  # per index: the latest compute action before it
    for k, a in enumerate(acts):
        before_compute.append(last_compute)
        if a.is_compute:
            last_compute = k
    for j, a in enumerate(acts):
        if a.op in _RECVS:
            point[j] = before_compute[j] if prefetch and before_compute[j] is not None else j
    if serial is not None:
        _agree(lowered, r, point, serial)
    at: dict[int, list[int]] = defaultdict(list)
    for j in sorted(point, key=lambda j: (point[j], serial[message_key(acts[j])] if serial else j)):
        at[point[j]].append(j)
    order = []
    for k, a in enumerate(acts):
        order += at.get(k, [])
        if a.op not in _RECVS:
            order.append(k)
    return order


def _agree(lowered: Program, r: int, point: dict[int, int], serial: dict) -> None:
    """Clamp receive posting points so that each pair's operations follow the send serials."""
    acts = lowered.actions[r]
    sends: dict[int, list[tuple[int, int]]] = defaultdict(list)   # peer -> [(serial, index)]
    recvs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for k, a in enumerate(acts):
        if a.op in _SENDS:
            sends[peer_of(lowered, a)].append((serial[message_key(a)], k))
        elif a.op in _RECVS:
            recvs[peer_of(lowered, a)].append((serial[message_key(a)], k))
    for peer, items in recvs.items():
        own = sends.get(peer, [])
        nxt = None
        for sigma, j in sorted(items, reverse=True):
            # after own sends to this peer with earlier serials, before those with later ones
            earliest = max((k + 1 for s, k in own if s < sigma), default=0)
            latest = min([j] + [k for s, k in own if s > sigma] + ([nxt] if nxt is not None else []))
            point[j] = max(earliest, min(point[j], latest))
            nxt = point[j]


def pair_sequences(lowered: Program, posting) -> dict[tuple[int, int], list[tuple[str, tuple]]]:
    """(rank, peer) -> the pair's operations in the rank's posting order, as
    ("send" | "recv", message key)."""
    out: dict[tuple[int, int], list] = defaultdict(list)
    for r, order in enumerate(posting):
        acts = lowered.actions[r]
        for k in order:
            a = acts[k]
            if a.op in _SENDS or a.op in _RECVS:
                out[(r, peer_of(lowered, a))].append(
                    ("send" if a.op in _SENDS else "recv", message_key(a)))
    return dict(out)
