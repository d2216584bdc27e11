"""Prove a Program complete, locally ordered, matched and deadlock-free.

`check_program(program)` is static: every (stage, micro-batch) has exactly one F and either one
B or one I plus one W, each on the rank that holds the stage, in an order that respects the
local dependencies; a lowered program's sends and receives must pair up and sit on the right
side of the compute they serve.

`dry_run(program)` then executes the lowered program symbolically, the way the runtime does:
receives block, sends do not, and a receive is satisfied by the send of the same tensor
(matched by kind, stage and micro-batch). If no rank can move and some have actions left, it
raises `ScheduleDeadlock` with the rank x step grid and the stuck actions in brackets.

`channel_order_conflicts(program)` checks the other half of NCCL legality: that both sides of
every rank pair post the pair's operations in one sequence (commpipe.schedules.order builds
that posting order; with it, issue-order matching pairs exactly what tag matching pairs, so a
program that passes both checks runs on NCCL as `dry_run` executed it).

Pure Python, linear in the number of actions.
"""

from __future__ import annotations

from commpipe.schedules.actions import COMM_OPS, COMPUTE_OPS, UNITS, Action, Program, lower

_MAX_LISTED = 8


class ScheduleError(ValueError):
    """A program that cannot run as written (missing, duplicated or misplaced actions)."""


class ScheduleDeadlock(ScheduleError):
    """Every rank that has actions left is blocked on a receive that will never be satisfied."""


def _fail(problems: list[str], program: Program) -> None:
    if not problems:
        return
    shown = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise ScheduleError(f"schedule {program.name!r} (pp={program.pp}, m={program.microbatches}, "
                        f"{program.num_stages} stages) is invalid:\n  " + "\n  ".join(shown) + more)


def message_key(a: Action) -> tuple[str, int, int] | None:
    """The tensor a communication action carries, named the same on both ends:
    ("F", s, m) is the activation entering stage s, ("B", s, m) the gradient leaving stage s+1
    for stage s."""
    if a.op == "SEND_F":
        return ("F", a.stage + 1, a.microbatch)
    if a.op == "RECV_F":
        return ("F", a.stage, a.microbatch)
    if a.op == "SEND_B":
        return ("B", a.stage - 1, a.microbatch)
    if a.op == "RECV_B":
        return ("B", a.stage, a.microbatch)
    return None


def check_program(program: Program) -> None:
    """Raise ScheduleError listing what is wrong, or return None for a runnable program."""
    p, m, n = program.pp, program.microbatches, program.num_stages
    problems: list[str] = []
    if p < 1 or m < 1 or n < 1:
        raise ScheduleError(f"schedule {program.name!r}: pp={p}, microbatches={m} and "
                            f"{n} stages must all be >= 1")
    if len(program.actions) != p:
        raise ScheduleError(f"schedule {program.name!r} has {len(program.actions)} rank rows "
                            f"for pp={p}; give one row per pipeline rank")
    rank_of = program.stage_to_rank
    bad = [r for r in rank_of if not 0 <= r < p]
    if bad:
        raise ScheduleError(f"schedule {program.name!r}: stage_to_rank names ranks {bad} "
                            f"outside 0..{p - 1}")
    empty = [r for r in range(p) if r not in set(rank_of)]
    if empty:
        problems.append(f"ranks {empty} hold no stage; every pipeline rank needs at least one")

    # pos[op][stage][microbatch] = step of that pass on its rank (-1 when absent); `end` the
    # same for its last step, which differs from pos only for passes written as units
    plain = COMPUTE_OPS + COMM_OPS
    pos = {op: [[-1] * m for _ in range(n)] for op in plain}
    end = {op: [[-1] * m for _ in range(n)] for op in COMPUTE_OPS}
    units: dict[tuple[str, int, int], list[tuple[str, int]]] = {}
    for r, acts in enumerate(program.actions):
        for k, a in enumerate(acts):
            for part in a.parts:
                s, mb = part.stage, part.microbatch
                if not (0 <= s < n and 0 <= mb < m and rank_of[s] == r):
                    problems.append(_misplaced(program, r, k, part))
                    continue
                if part.unit is not None:
                    units.setdefault((part.op, s, mb), []).append((part.unit, k))
                    continue
                row = pos[part.op][s]
                if row[mb] >= 0:
                    problems.append(f"rank {r}: {part} appears twice (steps {row[mb]} and {k})")
                    continue
                row[mb] = k
                if part.op in end:
                    end[part.op][s][mb] = k
            if a.is_braid:
                fw, other = a.parts
                if (fw.stage, fw.microbatch) == (other.stage, other.microbatch):
                    problems.append(f"rank {r} step {k}: braid {a} pairs two passes of one stage and "
                                    "micro-batch, which depend on each other; braid different "
                                    "micro-batches")
    for key, seen in units.items():
        problems += _check_units(program, key, seen, pos, end)
    _fail(problems, program)

    for s in range(n):
        r = rank_of[s]
        fs, bs, is_, ws = pos["F"][s], pos["B"][s], pos["I"][s], pos["W"][s]
        fe, be, ie = end["F"][s], end["B"][s], end["I"][s]
        # same-rank neighbours pass tensors locally (the turn of a V): their order matters
        f_prev = end["F"][s - 1] if s > 0 and rank_of[s - 1] == r else None
        b_next = (end["B"][s + 1], end["I"][s + 1]) if s + 1 < n and rank_of[s + 1] == r else None
        for mb in range(m):
            f, b, i, w = fs[mb], bs[mb], is_[mb], ws[mb]
            bwd = b if b >= 0 else i
            if (f >= 0 and bwd > fe[mb] and (b < 0 or (i < 0 and w < 0)) and (b >= 0 or w > ie[mb])
                    and (f_prev is None or f_prev[mb] < f)
                    and (b_next is None or max(b_next[0][mb], b_next[1][mb]) < bwd)):
                continue                                        # the common, valid case
            found = _explain(s, mb, r, fe[mb], b, i, w, f_prev, b_next)
            if not found:                                       # only unit-level orders failed
                found = [f"stage {s} micro-batch {mb} (rank {r}): its units run out of dependency "
                         f"order (forward F {f}..{fe[mb]}, backward {bwd}..{max(be[mb], ie[mb])}, "
                         f"W from {w}): every backward unit must follow the whole forward, and "
                         "W the whole I"]
            problems += found
    if program.is_lowered:
        problems += _check_comm(program, pos, end)
    _fail(problems, program)


def _check_units(program: Program, key, seen, pos, end) -> list[str]:
    """A pass written as units: all four exactly once, in dependency order, and not also whole.
    Records its first and last step in pos / end."""
    op, s, mb = key
    r = program.stage_to_rank[s]
    name = f"rank {r}: stage {s} micro-batch {mb} {op}"
    if pos[op][s][mb] >= 0:
        return [f"{name} is written both whole ({s}{op}{mb}) and as units; use one or the other"]
    names = [u for u, _ in seen]
    if sorted(names) != sorted(UNITS):
        missing = [u for u in UNITS if u not in names]
        twice = sorted({u for u in names if names.count(u) > 1})
        return [f"{name} written as units needs each of {', '.join(UNITS)} exactly once"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; repeated {', '.join(twice)}" if twice else "")]
    step = dict(seen)
    order = UNITS if op == "F" else UNITS[::-1]
    steps = [step[u] for u in order]
    if op != "W" and steps != sorted(steps):
        return [f"{name} units must run in the order {' -> '.join(order)} "
                f"(steps {', '.join(f'{u}={step[u]}' for u in order)})"]
    pos[op][s][mb], end[op][s][mb] = min(steps), max(steps)
    return []


def _misplaced(program: Program, r: int, k: int, a: Action) -> str:
    n, m = program.num_stages, program.microbatches
    if not 0 <= a.stage < n:
        return f"rank {r} step {k}: {a} names stage {a.stage}, but stages are 0..{n - 1}"
    if not 0 <= a.microbatch < m:
        return (f"rank {r} step {k}: {a} names micro-batch {a.microbatch}, but microbatches={m} "
                f"(0..{m - 1})")
    return (f"rank {r} step {k}: {a} belongs on rank {program.stage_to_rank[a.stage]}, which "
            f"holds stage {a.stage}")


def _explain(s, mb, r, f, b, i, w, f_prev, b_next) -> list[str]:
    """Why (stage s, micro-batch mb) failed the fast check in check_program."""
    out, name = [], f"stage {s} micro-batch {mb} (rank {r})"
    if f < 0:
        out.append(f"{name} has no forward {s}F{mb}")
    if b >= 0 and (i >= 0 or w >= 0):
        return out + [f"{name} has both B and I/W; use either {s}B{mb} or {s}I{mb} + {s}W{mb}"]
    if b < 0 and i < 0:
        return out + [f"{name} has no backward; add {s}B{mb} or {s}I{mb} + {s}W{mb}"]
    if i >= 0 and w < 0:
        out.append(f"{name} has {s}I{mb} but no {s}W{mb}")
    if w >= 0 and i < 0:
        out.append(f"{name} has {s}W{mb} but no {s}I{mb}")
    bwd, bwd_s = (b, f"{s}B{mb}") if b >= 0 else (i, f"{s}I{mb}")
    if 0 <= f and bwd < f:
        out.append(f"rank {r}: {bwd_s} (step {bwd}) runs before its forward {s}F{mb} (step {f})")
    if i >= 0 and 0 <= w < i:
        out.append(f"rank {r}: {s}W{mb} (step {w}) runs before {s}I{mb} (step {i})")
    if f_prev is not None and f >= 0 and f_prev[mb] > f:
        out.append(f"rank {r}: {s}F{mb} (step {f}) runs before {s - 1}F{mb} (step {f_prev[mb]}) "
                   f"that produces its input on the same rank")
    if b_next is not None and max(b_next[0][mb], b_next[1][mb]) > bwd:
        out.append(f"rank {r}: {bwd_s} (step {bwd}) runs before the backward of stage {s + 1} "
                   f"(step {max(b_next[0][mb], b_next[1][mb])}) that produces its gradient")
    return out


def _check_comm(program: Program, pos: dict, end: dict) -> list[str]:
    """Sends follow their producer, receives precede their consumer, and they pair up."""
    n, m, problems = program.num_stages, program.microbatches, []
    rank_of = program.stage_to_rank
    for s in range(n):
        for op in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            # communication only where a boundary crosses ranks
            lo, hi = {"SEND_F": (s, s + 1), "RECV_F": (s - 1, s),
                      "SEND_B": (s - 1, s), "RECV_B": (s, s + 1)}[op]
            if lo >= 0 and hi < n and rank_of[lo] != rank_of[hi]:
                continue
            for mb, k in enumerate(pos[op][s]):
                if k < 0:
                    continue
                if lo < 0 or hi >= n:
                    problems.append(f"rank {rank_of[s]}: {s}{op}{mb} crosses a boundary past the "
                                    f"first or last stage")
                else:
                    problems.append(f"rank {rank_of[s]}: {s}{op}{mb} is not needed, stages {lo} "
                                    f"and {hi} share rank {rank_of[lo]} and pass the tensor locally")
    for s in range(n - 1):
        if rank_of[s] == rank_of[s + 1]:
            continue
        a, b = rank_of[s], rank_of[s + 1]                 # boundary s -> s+1 crosses a -> b
        for kind, snd_s, rcv_s, snd_r, rcv_r in (("F", s, s + 1, a, b), ("B", s + 1, s, b, a)):
            snd_op, rcv_op = f"SEND_{kind}", f"RECV_{kind}"
            sends, recvs = pos[snd_op][snd_s], pos[rcv_op][rcv_s]
            # a send follows the last step of its producer, a receive precedes the first
            prod = end["F"][snd_s] if kind == "F" else _bwd(end, snd_s)
            cons = pos["F"][rcv_s] if kind == "F" else _bwd(pos, rcv_s)
            what = "activation" if kind == "F" else "gradient"
            for mb in range(m):
                snd, rcv = sends[mb], recvs[mb]
                if snd >= 0 and rcv >= 0 and prod[mb] < snd and (cons[mb] < 0 or rcv < cons[mb]):
                    continue
                snd_a, rcv_a = f"{snd_s}{snd_op}{mb}", f"{rcv_s}{rcv_op}{mb}"
                if snd < 0 and rcv < 0:
                    problems.append(f"{what} {snd_s}->{rcv_s} of micro-batch {mb} is never sent: "
                                    f"add {snd_a} on rank {snd_r} and {rcv_a} on rank {rcv_r}")
                elif snd < 0:
                    problems.append(f"unmatched receive {rcv_a} on rank {rcv_r}: rank {snd_r} "
                                    f"never sends {snd_a}")
                elif rcv < 0:
                    problems.append(f"unmatched send {snd_a} on rank {snd_r}: rank {rcv_r} "
                                    f"never receives {rcv_a}")
                if 0 <= snd < prod[mb]:
                    problems.append(f"rank {snd_r}: {snd_a} (step {snd}) before the action that "
                                    f"produces it (step {prod[mb]})")
                if rcv >= 0 and 0 <= cons[mb] < rcv:
                    problems.append(f"rank {rcv_r}: {rcv_a} (step {rcv}) after the action that "
                                    f"consumes it (step {cons[mb]})")
    return problems


def _bwd(pos: dict, s: int) -> list[int]:
    return [b if b >= 0 else i for b, i in zip(pos["B"][s], pos["I"][s])]


def dry_run(program: Program) -> Program:
    """Lower (if compute-only), check, and execute symbolically; return the lowered program.

    Raises ScheduleError for a malformed program and ScheduleDeadlock when the ranks block each
    other (e.g. rank 1 waits for micro-batch 1 while rank 0 only sends it after receiving
    micro-batch 0's gradient back from rank 1).
    """
    lowered = program if program.is_lowered else lower(program)
    check_program(lowered)
    pcs, _ = execute(lowered)
    if any(pcs[r] < len(lowered.actions[r]) for r in range(lowered.pp)):
        raise ScheduleDeadlock(deadlock_message(lowered, pcs))
    return lowered


def execute(lowered: Program) -> tuple[list[int], dict[tuple, int]]:
    """Run a lowered program symbolically (receives block, sends do not, a receive matches the
    send of the same tensor). Returns how far each rank got and the order in which the
    messages were sent in this run (message key -> serial): all ranks finished means no
    deadlock, and the serials are one global order consistent with every rank's own order."""
    pcs = [0] * lowered.pp
    sent: dict[tuple, int] = {}
    waiting: dict[tuple, int] = {}
    ready = list(range(lowered.pp))
    while ready:
        r = ready.pop()
        acts, k = lowered.actions[r], pcs[r]
        while k < len(acts):
            a = acts[k]
            if a.op in ("SEND_F", "SEND_B"):
                key = message_key(a)
                sent.setdefault(key, len(sent))
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif a.op in ("RECV_F", "RECV_B") and message_key(a) not in sent:
                waiting[message_key(a)] = r
                break
            k += 1
        pcs[r] = k
    return pcs, sent


def _sender_rank(program: Program, a: Action) -> int:
    kind, s, _ = message_key(a)
    return program.stage_to_rank[s - 1] if kind == "F" else program.stage_to_rank[s + 1]


def deadlock_message(lowered: Program, pcs: list[int]) -> str:
    """The rank x step grid with each stuck action in [brackets], then who waits for whom."""
    stuck = {r: pcs[r] for r in range(lowered.pp) if pcs[r] < len(lowered.actions[r])}
    lines = [f"schedule {lowered.name!r} deadlocks: every unfinished rank is blocked on a receive "
             f"whose send can never run. Grid (actions left of [ ] ran; [ ] is where each rank "
             f"is stuck):"]
    longest = max(len(a) for a in lowered.actions)
    lo = max(0, min(stuck.values()) - 3)
    hi = min(longest, max(stuck.values()) + 4)
    width = max(len(str(a)) for acts in lowered.actions for a in acts) + 3
    if hi - lo <= 16:
        lines.append("step    " + "".join(str(k).rjust(width) for k in range(lo, hi)))
        for r, acts in enumerate(lowered.actions):
            cells = []
            for k in range(lo, hi):
                text = "" if k >= len(acts) else str(acts[k])
                cells.append((f"[{text}]" if stuck.get(r) == k else text).rjust(width))
            lines.append(f"rank {r:<3}" + "".join(cells))
    else:                                         # stuck far apart: a window per rank
        for r, acts in enumerate(lowered.actions):
            k0 = pcs[r]
            a, b = max(0, k0 - 3), min(len(acts), k0 + 4)
            cells = [f"[{acts[k]}]" if k == k0 and r in stuck else str(acts[k]) for k in range(a, b)]
            tail = " (finished)" if r not in stuck else ""
            lines.append(f"rank {r:<3} steps {a}..{b - 1}: " + " ".join(cells) + tail)
    lines.append("waits:")
    for r, k in stuck.items():
        a = lowered.actions[r][k]
        src = _sender_rank(lowered, a)
        kind, s, mb = message_key(a)
        send = Action("SEND_F", s - 1, mb) if kind == "F" else Action("SEND_B", s + 1, mb)
        where = (f"stuck at step {pcs[src]} ({lowered.actions[src][pcs[src]]})" if src in stuck
                 else "finished without sending it")
        lines.append(f"  rank {r} step {k} {a} waits for {send} on rank {src}, which is {where}")
    cycle = _find_cycle(lowered, stuck)
    if cycle:
        lines.append("cycle: " + " -> ".join(f"rank {r}" for r in cycle + cycle[:1]))
    lines.append("fix: reorder the actions so each rank receives micro-batches in the order "
                 "its neighbour sends them")
    return "\n".join(lines)


def _find_cycle(lowered: Program, stuck: dict[int, int]) -> list[int]:
    waits_on = {r: _sender_rank(lowered, lowered.actions[r][k]) for r, k in stuck.items()}
    for start in waits_on:
        seen, r = [], start
        while r in waits_on and r not in seen:
            seen.append(r)
            r = waits_on[r]
        if r in seen:
            return seen[seen.index(r):]
    return []


def channel_order_conflicts(program: Program, posting=None) -> list[str]:
    """Rank pairs whose two sides post their point-to-point operations in different orders.

    NCCL matches the sends and receives of a rank pair in issue order, and runs the operations
    of one pair (both directions) one after another on one stream; so both sides must post
    the pair's messages in one common sequence, or tensors are swapped (one direction) or the
    ranks wait on each other (recv-then-send on both sides). `posting` is each rank's posting
    order as lists of action indices (default: the order the runtime uses on such backends,
    `commpipe.schedules.order.posting_order`); pass `as_written(program)` to check the
    program's own order. Returns one line per conflicting pair (empty when legal).
    """
    from commpipe.schedules.order import pair_sequences, posting_order

    lowered = program if program.is_lowered else lower(program)
    if posting is None:
        posting = posting_order(lowered)
    seqs = pair_sequences(lowered, posting)
    out = []
    for r, q in sorted(seqs):
        if r > q:
            continue
        mine = seqs[(r, q)]
        theirs = [("send" if d == "recv" else "recv", key) for d, key in seqs.get((q, r), [])]
        if mine != theirs:
            k = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                     min(len(mine), len(theirs)))

            def show(seq, k):
                return f"{seq[k][0]} {seq[k][1]}" if k < len(seq) else "nothing"

            flipped = [("send" if d == "recv" else "recv", key) for d, key in theirs]
            out.append(f"rank {r} <-> rank {q}: operation {k} of the pair is {show(mine, k)} "
                       f"on rank {r} but {show(flipped, k)} on rank {q}")
    return out
