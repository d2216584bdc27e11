"""`commpipe probe`: measure link latency and bandwidth before training.

    commpipe probe --nproc 4 --out probe.json        # 4 ranks on this host: one node
    torchrun --nnodes 2 --nproc-per-node 8 ... -m commpipe probe --out probe.json

Nodes are where the ranks actually run, found as the monitor finds them
(commpipe.monitor.clock.node_identity: host name, boot id and network namespace), so ranks of one
host form one node and each namespace of the emulated cluster is a node of its own. Ranks spawned
by --nproc all run on this host: one node, every pair intra_node. --ranks-per-node, when given,
is checked against the nodes found, never used to draw a node boundary that does not exist.

Point-to-point: rank 0 ping-pongs messages of every size with the first other rank on its node
(intra_node) and with the first rank on another node (inter_node); one-way time = median round
trip / 2.
All-reduce: every block of g consecutive ranks all-reduces together, for g = 2, 4, ... up to
the world (all blocks at once, as data-parallel groups do); rank 0's group is reported.

Calls as training makes them (gloo only): ranks 0 and 1 make each collective commpipe's runtime
makes under tensor and context parallelism (all-reduce, all-gather, reduce-scatter; 8 KiB, an
activation of a small model) `--calls` times, each after computing for 0.5 ms, as a layer's
work separates its collectives, with no barrier between, in 5 rounds that each make every op in
turn. The mean time of a call (the median of its 5 rounds' means, so that another process
starting or exiting during one round does not set it) is what a step pays for it: the
partner's late arrival, waking the rank that slept in the call and gloo's hand-off to its
worker thread, none of which a barrier-timed all-reduce shows (on 2 vCPUs: 0.4-1.6 ms
against the all-reduce's 0.3 ms median). The planner prices a gloo collective call's host time
from it (commpipe.plan.cluster.probe_call_overhead).

Each size series is fitted with t(bytes) = latency + bytes / bandwidth by least squares on the
relative error (so small messages weigh as much as large ones): latency = fitted intercept,
bandwidth = 1 / fitted slope, in ms and decimal GB/s.

JSON written by --out (schema "commpipe-probe/1", loadable by the cost model):
  {"schema", "world_size", "ranks_per_node", "nodes", "node_of_rank", "backend", "device", "fit",
   "pairs": {"intra_node": {"ranks": [0, 1], "latency_ms", "bandwidth_gbps", "bandwidth_from",
                            "sizes": [{"bytes", "time_ms", "bandwidth_gbps"}, ...]} | null,
             "inter_node": {...} | null},
   "allreduce": [{"group_size", "ranks", "latency_ms", "busbw_gbps", "bandwidth_from",
                  "sizes": [{"bytes", "time_ms", "algbw_gbps", "busbw_gbps"}, ...]}, ...],
   "calls": {"ranks": [0, 1], "bytes", "gap_ms", "calls",
             "ops": {"all_reduce": {"mean_ms", "median_ms", "round_means_ms"}, "all_gather": ...,
                     "reduce_scatter": ...}}
            | null (nccl, or an odd number of ranks),
   "host_load": [{"node", "cores", "other_cores"}, ...]}   (cores other processes kept busy on
            each node while the probe measured, commpipe.monitor.host_load; null without
            /proc/stat; above a tenth of the node's cores the table ends with a warning)
A class is null when the layout has no such pair (one node, or one rank per node).
ranks_per_node is the number of ranks on rank 0's node.
"""

from __future__ import annotations

import os
import statistics
import time

from commpipe.monitor.host_load import Span
from commpipe.monitor.probe_result import format_table, host_load, write_result

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
CALLS, CALL_BYTES, CALL_GAP_S, CALL_ROUNDS = 200, 8192, 0.5e-3, 5
CALL_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=2,
                   help="local processes to spawn when not under torchrun (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="expected ranks per node, checked against the nodes the ranks run on "
                        "(default: not checked; with --nproc every rank is on this host)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per size (default 1)")
    p.add_argument("--calls", type=int, default=CALLS,
                   help=f"timed collective calls per op after compute, gloo (default {CALLS}; 0: none)")
    p.add_argument("--backend", default=None, help="gloo | nccl (default: nccl with a GPU, else gloo)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def parse_sizes(text: str) -> list[int]:
    sizes = []
    for token in str(text).split(","):
        t = token.strip().upper()
        digits = t.rstrip("BKMGI")
        unit = t[len(digits):]
        try:
            value = int(float(digits) * _UNITS[unit])
        except (ValueError, KeyError):
            raise ValueError(f"--sizes: cannot read {token.strip()!r}; write sizes like 4K,1M,64M") from None
        if value < 1:
            raise ValueError(f"--sizes: {token.strip()!r} must be at least 1 byte")
        sizes.append(value)
    if len(sizes) < 2:
        raise ValueError("--sizes needs at least two sizes to fit latency and bandwidth")
    return sorted(set(sizes))


def fit_latency_bandwidth(sizes: list[int], times_s: list[float]) -> tuple[float, float, str]:
    """(latency_s, bandwidth_bytes_per_s, how) of t = latency + bytes / bandwidth, by least
    squares on relative residuals (t_i - a - b s_i) / t_i; latency is clamped at 0.

    When the bytes term explains under 1% of the largest message's time (times that do not
    grow with size: noise, or sizes too small to see the bandwidth), the bandwidth falls back
    to the largest message's bytes / time, a lower bound, and `how` says so.
    """
    import numpy as np

    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    a_mat = np.stack([1.0 / t, s / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)
    i = int(np.argmax(s))
    if b * s[i] >= 0.01 * t[i]:
        return max(float(a), 0.0), 1.0 / float(b), "fit"
    return max(float(a), 0.0), float(s[i] / t[i]), "largest message (time does not grow with size)"


def _check(args, world: int) -> None:
    if world < 2:
        raise ValueError(f"probe needs at least 2 ranks (world size {world}); "
                         "use --nproc 2 or torchrun --nproc-per-node 2")
    rpn = args.ranks_per_node
    if rpn is not None and not 1 <= rpn <= world:
        raise ValueError(f"--ranks-per-node {rpn} must be between 1 and the world size {world}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")


def node_numbers(identities: list) -> list[int]:
    """Node of every rank from its node identity, nodes numbered by their first rank."""
    firsts = list(dict.fromkeys(identities))
    return [firsts.index(h) for h in identities]


def probe_pairs(node_of: list[int]) -> dict[str, tuple[int, int] | None]:
    """The pair measured per link class: rank 0 with the first other rank on its node, and with
    the first rank on another node; None when there is no such rank."""
    same = [r for r in range(1, len(node_of)) if node_of[r] == node_of[0]]
    other = [r for r in range(1, len(node_of)) if node_of[r] != node_of[0]]
    return {"intra_node": (0, same[0]) if same else None,
            "inter_node": (0, other[0]) if other else None}


def check_ranks_per_node(declared: int | None, node_of: list[int]) -> None:
    """--ranks-per-node must describe the nodes the ranks run on."""
    counts = [node_of.count(n) for n in sorted(set(node_of))]
    if declared is None or all(c == declared for c in counts):
        return
    found = (f"all {len(node_of)} ranks run on one node (one host, one network namespace)"
             if len(counts) == 1 else f"the ranks run on {len(counts)} nodes holding "
             f"{', '.join(map(str, counts))} ranks")
    raise ValueError(f"--ranks-per-node {declared} does not match where the ranks run: {found}. "
                     "The probe labels a pair inter_node only when its ranks are on different nodes; "
                     "drop --ranks-per-node, or launch with torchrun on each node (or on the emulated "
                     "cluster, `commpipe cluster up`) to measure links between nodes")


def run(args) -> int:
    parse_sizes(args.sizes)
    if args.out:    # checked now, not after the whole measurement
        from commpipe.files import check_out_file

        check_out_file(args.out, "--out")
    if "WORLD_SIZE" in os.environ:
        _check(args, int(os.environ["WORLD_SIZE"]))
        _probe(args)
        return 0
    _check(args, args.nproc)
    check_ranks_per_node(args.ranks_per_node, [0] * args.nproc)   # spawned here: one node
    import torch.multiprocessing as mp

    from commpipe.ports import free_port

    mp.spawn(_spawned, args=(args.nproc, free_port(), vars(args)), nprocs=args.nproc, join=True)
    return 0


def _spawned(rank: int, world: int, port: int, arg_dict: dict) -> None:
    import argparse

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _probe(argparse.Namespace(**{k: v for k, v in arg_dict.items() if not k.startswith("_")}))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pingpong(comm, a: int, b: int, nbytes: int, iters: int, warmup: int) -> float | None:
    """Median one-way time (s) from rank a's view; None on other ranks."""
    import torch

    if comm.rank not in (a, b):
        return None
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=comm.device)
    times = []
    for i in range(warmup + iters):
        if comm.rank == a:
            t0 = time.perf_counter()
            comm.send(buf, b, dim="world")
            comm.recv(buf, b, dim="world")
            _sync(comm.device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) / 2.0)
        else:
            comm.recv(buf, a, dim="world")
            comm.send(buf, a, dim="world")
    return statistics.median(times) if times else None


def _allreduce(comm, nbytes: int, iters: int, warmup: int) -> float:
    import torch

    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=comm.device)
    times = []
    for i in range(warmup + iters):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(buf, "dp")
        _sync(comm.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _compute_for(seconds: float, a, b) -> None:
    """Keep this rank's core busy for `seconds` with small matmuls, as a layer's work does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b


def calls_after_compute(comm, nbytes: int, calls: int, warmup: int, gap_s: float,
                        dim: str = "dp", rounds: int = CALL_ROUNDS) -> dict:
    """{op: {"mean_ms", "median_ms", "round_means_ms"}} of comm's `dim` group making each of
    CALL_OPS `calls` times, every call after `gap_s` of compute and without a barrier (the module
    docstring). The calls are spread over `rounds` rounds, each making every op in turn, and an
    op's mean_ms is the median of its rounds' means (`robust_mean_ms`): a burst of other work on
    the host during one round (a process starting or exiting) does not set what a step is
    priced at, while what every round pays does. median_ms is over every call."""
    import torch

    a, b = torch.randn(32, 64), torch.randn(64, 64)
    n = comm.size(dim)
    buf = torch.zeros(max(nbytes // 4, n) // n * n, dtype=torch.float32)   # n equal slices
    make = {"all_reduce": lambda: comm.all_reduce(buf, dim),
            "all_gather": lambda: comm.all_gather(buf, dim),
            "reduce_scatter": lambda: comm.reduce_scatter(buf, dim)}
    rounds = max(1, min(rounds, calls))
    per_round = [calls // rounds + (r < calls % rounds) for r in range(rounds)]
    times = {op: [[] for _ in range(rounds)] for op in CALL_OPS}
    comm.barrier(dim)
    for op in CALL_OPS:
        for _ in range(warmup):
            _compute_for(gap_s, a, b)
            make[op]()
    for r, count in enumerate(per_round):
        for op in CALL_OPS:
            for _ in range(count):
                _compute_for(gap_s, a, b)
                t0 = time.perf_counter()
                make[op]()
                times[op][r].append(time.perf_counter() - t0)
    return {op: {"mean_ms": robust_mean_ms(times[op]),
                 "median_ms": statistics.median(t for rnd in times[op] for t in rnd) * 1e3,
                 "round_means_ms": [statistics.fmean(rnd) * 1e3 for rnd in times[op]]}
            for op in CALL_OPS}


def robust_mean_ms(rounds: list[list[float]]) -> float:
    """The median of the rounds' mean call times (seconds in, ms out): what a call costs on
    average in the rounds that ran as the host usually runs."""
    return statistics.median(statistics.fmean(r) for r in rounds if r) * 1e3


def _probe(args) -> None:
    import torch

    from commpipe.monitor.clock import node_identity
    from commpipe.monitor.records import busbw_factor
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims
    from commpipe.parallel.world import init_distributed

    rank, world = init_distributed(args.backend)
    _check(args, world)
    sizes = parse_sizes(args.sizes)
    on_gpu = torch.cuda.is_available() and args.backend != "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    comm = Comm(ParallelDims(dp=world), rank, device=device)
    node_of = node_numbers(comm.gather_objects(node_identity(), "world"))
    check_ranks_per_node(args.ranks_per_node, node_of)     # the same verdict on every rank
    pairs = probe_pairs(node_of)
    comm.barrier()
    span = Span.start()          # what other processes use of each node's cores meanwhile
    result = {"schema": "commpipe-probe/1", "world_size": world,
              "ranks_per_node": node_of.count(node_of[0]), "nodes": len(set(node_of)),
              "node_of_rank": node_of,
              "backend": "nccl" if on_gpu else "gloo", "device": str(device),
              "fit": "t(bytes) = latency + bytes / bandwidth; least squares on relative error",
              "pairs": {}, "allreduce": []}
    for name, pair in pairs.items():
        if pair is None:
            result["pairs"][name] = None
            continue
        times = [pingpong(comm, *pair, n, args.iters, args.warmup) for n in sizes]
        comm.barrier()
        if rank == 0:
            lat, bw, how = fit_latency_bandwidth(sizes, times)
            result["pairs"][name] = {
                "ranks": list(pair), "latency_ms": lat * 1e3, "bandwidth_gbps": bw / 1e9,
                "bandwidth_from": how,
                "sizes": [{"bytes": n, "time_ms": t * 1e3, "bandwidth_gbps": n / t / 1e9}
                          for n, t in zip(sizes, times)]}
    g = 2
    group_sizes = []
    while g <= world:
        if world % g == 0:
            group_sizes.append(g)
        g *= 2
    if world not in group_sizes:
        group_sizes.append(world)
    blocks = {}
    for g in group_sizes:
        # dp blocks of g consecutive ranks: ParallelDims puts dp inside pp
        sub = blocks[g] = Comm(ParallelDims(dp=g, pp=world // g), rank, device=device)
        times = [_allreduce(sub, n, args.iters, args.warmup) for n in sizes]
        if rank == 0:
            f = busbw_factor("all_reduce", g)
            lat, bw, how = fit_latency_bandwidth(sizes, times)
            result["allreduce"].append({
                "group_size": g, "ranks": list(range(g)), "latency_ms": lat * 1e3,
                "busbw_gbps": bw * f / 1e9, "bandwidth_from": how,
                "sizes": [{"bytes": n, "time_ms": t * 1e3, "algbw_gbps": n / t / 1e9,
                           "busbw_gbps": n / t * f / 1e9} for n, t in zip(sizes, times)]})
    result["calls"] = None
    if result["backend"] == "gloo" and world % 2 == 0 and args.calls > 0:
        # ranks 0 and 1 alone, the others idle: the host model adds contention for the cores
        # itself (commpipe.plan.host)
        if rank < 2:      # the blocks of 2 the all-reduces above used (world is even)
            ops = calls_after_compute(blocks[2], CALL_BYTES, args.calls, 10, CALL_GAP_S)
            result["calls"] = {"ranks": [0, 1], "bytes": CALL_BYTES, "gap_ms": CALL_GAP_S * 1e3,
                               "calls": args.calls, "ops": ops}
        comm.barrier()
    spans = comm.gather_objects(span.stop().to_dict(), "world")
    result["host_load"] = host_load(spans, node_of)
    if rank == 0:
        print(format_table(result))
        if args.out:
            write_result(args.out, result)
            print(f"wrote {args.out}")
    comm.barrier()
    # tear the process group down on every rank before the interpreter exits, so no backend
    # thread is left behind
    import torch.distributed as dist

    dist.destroy_process_group()
