"""Schedule generators: pure functions (pp, microbatches[, vpp]) -> compute-only Program.

Each generator states its constraints and rejects a violation with a message that says what to
change. `commpipe.schedules.lower` then inserts communication.
"""

from __future__ import annotations

from commpipe.schedules.actions import B, F, Program, make_program


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
