"""Schedule generators: pure functions (pp, microbatches[, vpp]) -> compute-only Program.

Each generator states its constraints and rejects a violation with a message that says what to
change. `commpipe.schedules.lower` then inserts communication; `commpipe.schedules.validate`
proves the result complete and deadlock-free. Phases (warm-up, steady state, cool-down) are
commented where they begin.

Conventions: rank r runs the actions of the stages `stage_to_rank` gives it, in list order.
F = forward, B = full backward, I = input-gradient half of B, W = weight-gradient half of B.
"""

from __future__ import annotations

from commpipe.schedules.actions import B, F, I, Program, W, make_program


def _check_basic(name: str, p: int, m: int) -> None:
    if p < 1:
        raise ValueError(f"{name}: pp={p} must be >= 1")
    if m < 1:
        raise ValueError(f"{name}: microbatches={m} must be >= 1")


def gpipe(p: int, m: int) -> Program:
    """GPipe (Huang et al., 2019): all forwards, then all backwards. Any m >= 1.

    Bubble fraction (p-1)/(m+p-1); every stage holds all m micro-batches' activations.
    """
    _check_basic("gpipe", p, m)
    per_rank = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return make_program("gpipe", p, m, range(p), per_rank)


def one_f_one_b(p: int, m: int) -> Program:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021). Needs m >= p to fill the pipeline.

    Same bubble as GPipe, (p-1)/(m+p-1), but stage r holds at most p-r micro-batches.
    """
    _check_basic("1f1b", p, m)
    if m < p:
        raise ValueError(f"1f1b needs microbatches >= pp to fill the pipeline, got m={m} < p={p}; "
                         f"use --microbatches >= {p} or --schedule gpipe")
    per_rank = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [F(r, i) for i in range(warmup)]                  # warm-up: forwards only
        for i in range(m - warmup):                               # steady state: one F, one B
            acts += [F(r, warmup + i), B(r, i)]
        acts += [B(r, i) for i in range(m - warmup, m)]          # cool-down: remaining backwards
        per_rank.append(acts)
    return make_program("1f1b", p, m, range(p), per_rank)


def interleaved(p: int, m: int, v: int) -> Program:
    """Interleaved 1F1B (Narayanan et al., SC'21, Section 2.2), Megatron-LM's ordering.

    Each rank holds v model chunks; stage s (of p*v) lives on rank s % p, so rank r holds
    stages r, r+p, ..., r+(v-1)p. Micro-batches go through the chunks in groups of p, which is
    why m must be a multiple of p; v >= 2 (v = 1 is plain 1F1B).

    Bubble (p-1)(t_f+t_b)/v with t_f, t_b the times of a whole rank's layers: 1/v of 1F1B's.
    Peak activations on rank 0: (v+1)p-1 chunk-activations = p + (p-1)/v micro-batch units
    (Korthikanti et al., 2022, Section 4.2.3: a factor 1 + (p-1)/(pv) over 1F1B's p).
    """
    _check_basic("interleaved", p, m)
    if v < 2:
        raise ValueError(f"interleaved needs vpp >= 2 model chunks per rank, got vpp={v}; "
                         "use --vpp 2 (or more), or --schedule 1f1b for one chunk per rank")
    if m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        raise ValueError(f"interleaved groups micro-batches by pp, so microbatches must be a "
                         f"multiple of pp={p}, got m={m}; use --microbatches "
                         f"{hi if lo == 0 else f'{lo} or {hi}'}")
    total = m * v                   # "virtual micro-batches": (chunk, micro-batch) pairs per rank

    def fwd(k: int, r: int):        # k-th forward on rank r: chunks cycle every p micro-batches
        chunk = (k % (p * v)) // p
        return F(chunk * p + r, (k // (p * v)) * p + k % p)

    def bwd(k: int, r: int):        # backwards visit the chunks in reverse order
        chunk = v - 1 - (k % (p * v)) // p
        return B(chunk * p + r, (k // (p * v)) * p + k % p)

    per_rank = []
    for r in range(p):
        # warm-up: enough forwards that the first backward's gradient has arrived when they end
        # (Megatron-LM schedules.py: 2(p-r-1) + (v-1)p)
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [fwd(k, r) for k in range(warmup)]
        for k in range(total - warmup):                           # steady state: one F, one B
            acts += [fwd(warmup + k, r), bwd(k, r)]
        acts += [bwd(k, r) for k in range(total - warmup, total)]  # cool-down
        per_rank.append(acts)
    return make_program("interleaved", p, m, [s % p for s in range(p * v)], per_rank)


def zb_h1(p: int, m: int) -> Program:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1).

    1F1B with every backward split into I (input gradient, on the critical path) and W (weight
    gradient, movable). Rank r defers its W passes by r micro-batches, so every rank keeps p
    micro-batches in flight (F done, W not yet) - 1F1B's peak - and the deferred W's fill the
    cool-down. With T_F = T_I = T_W the bubble is (p-1)(T_F+T_I-T_W), a third of 1F1B's
    (p-1)(T_F+T_I+T_W). Needs m >= p, like 1F1B.
    """
    _check_basic("zbh1", p, m)
    if m < p:
        raise ValueError(f"zbh1 needs microbatches >= pp to fill the pipeline, got m={m} < p={p}; "
                         f"use --microbatches >= {p}")
    per_rank = []
    for r in range(p):
        warmup = p - r - 1
        acts = [F(r, i) for i in range(warmup)]                  # warm-up: forwards only
        w_next = 0                                                # oldest micro-batch without W
        for i in range(m - warmup):                               # steady state: F, I, deferred W
            acts += [F(r, warmup + i), I(r, i)]
            if i >= r:
                acts.append(W(r, w_next))
                w_next += 1
        for i in range(m - warmup, m):                            # cool-down: I, then a W
            acts.append(I(r, i))
            acts.append(W(r, w_next))
            w_next += 1
        acts += [W(r, i) for i in range(w_next, m)]              # flush the deferred W's
        per_rank.append(acts)
    return make_program("zbh1", p, m, range(p), per_rank)


def zbv(p: int, m: int) -> Program:
    """ZB-V (Qi et al., ICLR 2024, Section 6): two chunks per rank in V order, I/W split.

    Rank r holds stage r (chunk 0, going down) and stage 2p-1-r (chunk 1, coming back), so the
    turn at rank p-1 and the loss on rank 0 need no communication. Every rank keeps at most
    2p chunk-activations alive = p micro-batch units, 1F1B's peak; with equal F, I, W times
    the bubble is close to zero. Needs m >= 2p-1 so that rank 0's warm-up (2p-1 forwards of
    chunk 0) exists.
    """
    _check_basic("zbv", p, m)
    if m < 2 * p - 1:
        raise ValueError(f"zbv needs microbatches >= 2*pp-1 = {2 * p - 1} to fill the V, got m={m}; "
                         f"use --microbatches >= {2 * p - 1} (2*pp or more is typical)")
    per_rank = [_zbv_rank(p, m, r) for r in range(p)]
    stage_to_rank = list(range(p)) + list(range(p - 1, -1, -1))
    return make_program("zbv", p, m, stage_to_rank, per_rank)


def _zbv_rank(p: int, m: int, r: int) -> list:
    """Rank r's ZB-V action list (see zbv)."""
    down, up = r, 2 * p - 1 - r
    acts: list = []
    nf = {down: 0, up: 0}           # next micro-batch to forward, per chunk
    ni = {down: 0, up: 0}           # next micro-batch to input-grad, per chunk
    nw = {down: 0, up: 0}           # next micro-batch to weight-grad, per chunk

    def f(s):
        acts.append(F(s, nf[s]))
        nf[s] += 1

    def i(s):
        acts.append(I(s, ni[s]))
        ni[s] += 1

    def w(s):
        acts.append(W(s, nw[s]))
        nw[s] += 1

    # warm-up 1: chunk-0 forwards until micro-batch 0 comes back up the V to this rank
    # (it leaves at time r, turns at rank p-1, returns at 2p-1-r: 2(p-r)-1 slots)
    for _ in range(2 * (p - r) - 1):
        f(down)
    # warm-up 2: chunk-1 inputs now arrive every other slot; alternate the chunks
    for _ in range(r):
        f(up)
        f(down)
    # warm-up 3: chunk-1 gradients start coming back (from the loss on rank 0); run each
    # chunk-1 micro-batch's F, I and W back to back, which keeps memory at 2p
    for _ in range(p - r):
        f(up)
        i(up)
        w(up)
    # steady state: F, I, W on each chunk in turn until every forward is done
    while nf[up] < m:
        if nf[down] < m:
            f(down)
        i(down)
        w(down)
        f(up)
        i(up)
        w(up)
    # cool-down: input gradients first (they are on the critical path back to rank 0),
    # then the deferred weight gradients fill the tail
    for _ in range(r):
        i(down)
        i(up)
    for _ in range(p - r):
        i(down)
        w(down)
    while nw[up] < m:
        w(up)
    while nw[down] < m:
        w(down)
    return acts
