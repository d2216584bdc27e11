"""Naming a hang: from every rank's last communication call, which rank holds the others up.

Pure Python, on the records the watchdogs publish (commpipe.elastic.watchdog):

    {"rank": 2, "step": 41, "tick": 130, "host": "n1", "pid": 812,
     "call": {"dim": "pp", "op": "send", "peer": 3, "group": [], "seq": 812, "tag": 0,
              "state": "waiting", "age_s": 47.1}}

`state` is `waiting` (the training thread is blocked on this call), `posted` (issued, not yet
waited on) or `completed`. A rank whose record stopped changing (`stale`) is frozen or dead
(SIGSTOP, a stuck kernel, a lost node).

A rank waiting on a point-to-point call waits on its peer; a rank waiting on a collective waits
on every member of the group that is not blocked in the same call (same dim, op, group and
sequence number). Following these edges from the waiting ranks ends at the rank(s) that wait on
no one: those are named, with the call they have not posted, read off the call a direct waiter
is blocked in (a send's partner posts the matching recv, a collective's the same collective):

    rank 3 has not posted pp recv from rank 2 (step 41, seq 812); ranks 0-2 wait on it
"""

from __future__ import annotations

PARTNER_OP = {"send": "recv", "recv": "send"}


def ranks_text(ranks) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 2, 5-7'."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return "ranks " + ", ".join(runs)


def call_text(call: dict | None) -> str:
    """'pp send to rank 3', 'dp all_reduce over ranks 0-3'."""
    if not call:
        return "no communication yet"
    if call.get("peer") is not None:
        way = {"send": "to", "recv": "from"}.get(call["op"], "with")
        return f"{call['dim']} {call['op']} {way} rank {call['peer']}"
    return f"{call['dim']} {call['op']} over {ranks_text(call.get('group') or [])}"


def _same_call(a: dict | None, b: dict | None) -> bool:
    keys = ("dim", "op", "seq")
    return (a is not None and b is not None and all(a.get(k) == b.get(k) for k in keys)
            and list(a.get("group") or []) == list(b.get("group") or []))


def wait_edges(records: dict[int, dict | None], stale: set[int]) -> dict[int, set[int]]:
    """rank -> the ranks it waits on (live ranks blocked in a call only)."""
    edges: dict[int, set[int]] = {}
    for r, rec in records.items():
        call = (rec or {}).get("call")
        if r in stale or rec is None or not call or call.get("state") != "waiting":
            continue
        if call.get("peer") is not None:
            edges[r] = {call["peer"]}
            continue
        others = set()
        for g in call.get("group") or []:
            if g == r:
                continue
            peer_call = (records.get(g) or {}).get("call")
            blocked_with_us = (g not in stale and peer_call is not None
                               and peer_call.get("state") == "waiting"
                               and _same_call(call, peer_call))
            if not blocked_with_us:
                others.add(g)
        edges[r] = others
    return edges


def _reaches(edges: dict[int, set[int]], start: int) -> set[int]:
    seen, todo = set(), [start]
    while todo:
        r = todo.pop()
        for n in edges.get(r, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def missing_call(waiter_call: dict, waiter: int) -> str:
    """What the waited-on rank has not posted, seen from the waiter's call."""
    if waiter_call.get("peer") is not None:
        op = PARTNER_OP.get(waiter_call["op"], waiter_call["op"])
        way = {"send": "to", "recv": "from"}.get(op, "with")
        return f"{waiter_call['dim']} {op} {way} rank {waiter}"
    return call_text(waiter_call)


def diagnose(records: dict[int, dict | None], stale: set[int], world: int,
             silent_s: dict[int, float] | None = None) -> tuple[str, list[str]]:
    """(headline, detail lines) naming the rank(s) the job is stuck on."""
    silent_s = silent_s or {}
    records = {r: records.get(r) for r in range(world)}
    edges = wait_edges(records, stale)
    waiting = set(edges)
    culprits = sorted({n for r in waiting for n in _reaches(edges, r) | {r}} - waiting)
    heads = []
    for c in culprits:
        waiters = sorted(r for r in waiting if c in _reaches(edges, r))
        direct = [r for r in waiters if c in edges[r]]
        if not direct:
            continue
        w = direct[0]
        wcall = records[w]["call"]
        step = records[w].get("step")
        what = missing_call(wcall, w)
        heads.append(f"rank {c} has not posted {what} (step {step}, seq {wcall.get('seq')}); "
                     f"{ranks_text(waiters)} wait{'s' if len(waiters) == 1 else ''} on it")
    if not heads:
        live = [r for r in range(world) if r not in stale]
        if waiting:
            heads.append(f"{ranks_text(waiting)} wait on each other (a deadlock: every one of "
                         "them is blocked in a call whose partner is blocked too)")
        elif stale:
            heads.append(f"{ranks_text(stale)} stopped answering (last calls: " + "; ".join(
                f"rank {r}: {call_text((records[r] or {}).get('call'))}" for r in sorted(stale))
                + ")")
        else:
            heads.append("no rank is blocked in a communication call: the step is stuck in "
                         f"computation or host code on {ranks_text(live)}")
    lines = []
    for r in range(world):
        rec = records[r]
        if rec is None:
            lines.append(f"rank {r}: never reported (it did not start, or its watchdog is off)")
            continue
        call = rec.get("call")
        state = call.get("state") if call else ""
        where = f"{state} {call_text(call)} (seq {call.get('seq')}, {call.get('age_s', 0):.1f} s)" \
            if call else call_text(call)
        note = ""
        if r in stale:
            note = (f"; silent for {silent_s[r]:.0f} s: stopped or frozen" if r in silent_s
                    else "; silent: stopped or frozen")
        lines.append(f"rank {r} (step {rec.get('step')}, host {rec.get('host')}, pid "
                     f"{rec.get('pid')}): {where}{note}")
    return "; ".join(heads), lines
