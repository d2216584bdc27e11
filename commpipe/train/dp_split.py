"""Uneven micro-batches across data-parallel replicas (`--dp-microbatches 3,1`).

A slower replica gets fewer micro-batches of the same global batch, as Malleus, FALCON and
ReCycle react to a straggler inside data parallelism. Replica d runs counts[d] micro-batches
(its pipeline runs the schedule for that count; every rank of a replica agrees, since the count
depends on the dp coordinate alone) and reads rows

    [sum(counts[:d]) * b, sum(counts[:d + 1]) * b)      b = micro-batch size

of the single-device global batch, so the replicas' rows, taken in DP order, are the global
batch in its own order. Nothing else changes: every micro-batch loss is already divided by the
tokens of the whole global batch (commpipe.train.loop.Trainer.prepare_batch), so the sum that
GradReducer all-reduces over DP is each replica's gradient weighted by its sample count, and
the result is the gradient of the global mean loss that one device computes.

With expert parallelism (--ep) the replicas of one EP group (`ep` consecutive DP ranks,
commpipe.parallel.expert) exchange tokens by all-to-all in every MoE layer of every
micro-batch, so they must run the same count (`check_ep_blocks`); counts may differ between EP
groups. The expert gradients, summed over edp (one replica of each EP group), are weighted by
sample count the same way.
"""

from __future__ import annotations


def check_dp_microbatches(counts, dp: int, m: int, pp: int, schedule: str) -> tuple[int, ...] | None:
    """The validated per-replica counts, or None when they are the even split (m each).
    `m`: micro-batches per replica of the even split (global batch / (mbs * dp))."""
    if counts is None:
        return None
    counts = tuple(int(c) for c in counts)
    if len(counts) != dp:
        raise ValueError(f"--dp-microbatches {_text(counts)} gives {len(counts)} counts for "
                         f"dp={dp} replicas; give one count per replica")
    if min(counts) < 1:
        raise ValueError(f"--dp-microbatches {_text(counts)}: every replica needs at least one "
                         "micro-batch")
    if sum(counts) != m * dp:
        raise ValueError(f"--dp-microbatches {_text(counts)} sums to {sum(counts)} micro-batches; "
                         f"the global batch holds {m * dp} (dp {dp} x {m}): make the counts sum "
                         f"to {m * dp}")
    if not schedule.endswith(".csv"):
        from commpipe.schedules.registry import info

        for c in sorted(set(counts)):
            problem = info(schedule).m_problem(pp, c)
            if problem:
                raise ValueError(f"--dp-microbatches {_text(counts)}: a replica with {c} "
                                 f"micro-batches cannot run {schedule} on pp={pp} ({problem})")
    elif len(set(counts)) > 1:
        raise ValueError("--dp-microbatches needs a named schedule (a CSV program has one "
                         "micro-batch count)")
    return None if len(set(counts)) == 1 else counts


def check_ep_blocks(counts, ep: int) -> None:
    """Refuse per-replica counts that differ inside an expert-parallel group (replicas
    [k*ep, (k+1)*ep)): their all-to-alls pair up micro-batch by micro-batch."""
    if not counts or ep == 1:
        return
    blocks = [counts[k:k + ep] for k in range(0, len(counts), ep)]
    bad = next((k for k, b in enumerate(blocks) if len(set(b)) > 1), None)
    if bad is None:
        return
    first = bad * ep
    even = [sum(b) // ep for b in blocks]
    hint = (f", e.g. --dp-microbatches {_text([c for c in even for _ in range(ep)])}"
            if all(sum(b) % ep == 0 for b in blocks) else "")
    raise ValueError(f"--dp-microbatches {_text(counts)} with --ep {ep}: replicas {first} to "
                     f"{first + ep - 1} form one expert-parallel group and run "
                     f"{_text(blocks[bad])} micro-batches, but the all-to-alls of an EP group pair "
                     f"up micro-batch by micro-batch; give every {ep} consecutive replicas the "
                     f"same count (counts may differ between EP groups){hint}, or use --ep 1")


def replica_microbatches(counts, m: int, dp_rank: int) -> int:
    return m if not counts else counts[dp_rank]


def replica_rows(counts, micro_batch_size: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of replica dp_rank's rows in the global batch."""
    start = sum(counts[:dp_rank]) * micro_batch_size
    return start, start + counts[dp_rank] * micro_batch_size


def replica_batch(source, step: int, global_batch: int, counts, micro_batch_size: int,
                  dp_rank: int, dp_size: int):
    """This replica's rows of the step's global batch. Sources serve DP ranks equal shares, so
    under uneven counts the whole global batch is read (its content does not depend on dp_size,
    see commpipe.data) and this replica's rows are cut from it."""
    if not counts:
        return source.batch(step, global_batch, dp_rank, dp_size)
    start, stop = replica_rows(counts, micro_batch_size, dp_rank)
    batch = source.batch(step, global_batch, 0, 1)
    if isinstance(batch, dict):     # image-caption batches: every entry is per sample
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(t[start:stop] for t in batch)


def _text(counts) -> str:
    return ",".join(str(c) for c in counts)
