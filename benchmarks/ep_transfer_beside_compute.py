"""What an all-to-all across the emulated nodes costs beside compute on this host: alone, beside
the other pair's, beside other ranks' compute, and in flight while its own ranks compute.

    sudo python benchmarks/ep_transfer_beside_compute.py                 # 400 Mbit/s, 512 KiB
    sudo python benchmarks/ep_transfer_beside_compute.py --mbit 200 --kib 128 --rounds 5

Two emulated nodes (commpipe.cluster.netns) of two ranks, as benchmarks/moe_ep_emulated.py runs
them: pair A (ranks 0 and 2) and pair B (ranks 1 and 3) each span the two nodes, so their
all-to-alls (`--kib` each way, async gloo work) cross the shaped link. Per round and mode,
pair A makes `--calls` exchanges (a barrier of the pair before each) and rank 0 keeps the
median; printed: the median over rounds.

- alone: pair B waits in a barrier.
- both pairs: pair B exchanges at the same time (the node's one link carries both).
- others compute: pair B's ranks multiply matrices (one thread each, as training does).
- beside own compute C ms: pair A issues the exchange, computes for C ms of wall time, then
  waits; printed is the wait left. A transfer that moves while its ranks compute leaves
  max(0, alone - C); one that needs the cores the compute holds leaves more.
- the same with the compute under `--emulate-device` (commpipe.runtime.device_time: the host
  idle for (F - 1) / F of each operator's time with `--factor F`, as a GPU leaves it while a
  kernel runs).

No assertion; DualPipe-style hiding on this host (docs/moe.md) is bounded by the last columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPUTE_MS = (4, 8, 16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=400.0, help="inter-node rate (default 400)")
    p.add_argument("--kib", type=int, default=512, help="KiB each rank sends per exchange (default 512)")
    p.add_argument("--calls", type=int, default=20, help="exchanges per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--factor", type=float, default=3.0,
                   help="the emulated device's time over the host's (default 3)")
    return p.parse_args(argv)


def _spin(seconds: float) -> None:
    import torch

    a, b = torch.randn(96, 96), torch.randn(96, 96)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        (a @ b).tanh()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from commpipe.runtime.device_time import emulated

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    in_a = rank in (0, 2)
    mine = pairs[0] if in_a else pairs[1]
    n = 2 * args.kib * 1024 // 4          # half stays on the rank, half crosses to the peer
    x, y = torch.randn(n), torch.empty(n)

    def exchange(compute_s: float = 0.0, factor: float = 1.0) -> tuple[float, float]:
        """Median ms of (the exchange, or the wait left after the compute; the compute's wall)."""
        waits, walls = [], []
        for _ in range(args.calls):
            dist.barrier(group=mine)
            t0 = time.perf_counter()
            work = dist.all_to_all_single(y, x, group=mine, async_op=True)
            if compute_s:
                with emulated(factor):
                    _spin(compute_s)
            t1 = time.perf_counter()
            work.wait()
            waits.append((time.perf_counter() - (t1 if compute_s else t0)) * 1e3)
            walls.append((t1 - t0) * 1e3)
        return statistics.median(waits), statistics.median(walls)

    modes = ["alone", "both pairs", "others compute"]
    modes += [f"beside own compute {c} ms" for c in COMPUTE_MS]
    modes += [f"beside emulated device {c} ms" for c in COMPUTE_MS]
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            dist.barrier()
            value = None
            if mode == "alone":
                value = exchange() if in_a else None
            elif mode == "both pairs":
                value = exchange()
            elif mode == "others compute":       # pair B spins until rank 0's flag file
                flag = Path(os.environ["XFER_FLAGS"]) / f"done-{rnd}"
                if in_a:
                    value = exchange()
                    if rank == 0:
                        flag.touch()
                else:
                    while not flag.exists():
                        _spin(0.005)
            else:
                c = float(mode.split()[-2]) / 1e3
                factor = args.factor if "emulated" in mode else 1.0
                value = exchange(c, factor) if in_a else None
            dist.barrier()
            if rank == 0:
                results[mode].append(value)
    if rank == 0:
        report(args, results)
    dist.destroy_process_group()


def report(args, results: dict) -> None:
    wire = args.kib * 1024 * 8 / (args.mbit * 1e6) * 1e3
    print(f"2 emulated nodes x 2 ranks, {args.mbit:g} Mbit/s; {args.kib} KiB each way per "
          f"exchange (wire time {wire:.2f} ms); {os.cpu_count()} cores; median of {args.rounds} "
          f"rounds x {args.calls} exchanges")
    print(f"{'mode':<31} {'ms':>6}  note (medians: 'in all' adds the compute's to the wait's)")
    alone = statistics.median(w for w, _ in results["alone"])
    for mode, values in results.items():
        ms = statistics.median(w for w, _ in values)
        if mode.startswith("beside"):
            wall = statistics.median(c for _, c in values)
            note = (f"wait left after {wall:.2f} ms of compute (a transfer moving beside it: "
                    f"{max(0.0, alone - wall):.2f}); {wall + ms:.2f} ms in all")
        else:
            note = "exchange" + ("" if mode == "alone" else f", {ms / alone:.2f}x alone")
        print(f"{mode:<31} {ms:6.2f}  {note}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:          # a rank, started below by torchrun in its namespace
        sys.path.insert(0, str(REPO))
        worker(args)
        return 0
    from _emulated import runs_dir

    out_dir = runs_dir("ep_transfer_beside_compute", None)   # None: no namespaces here (said why)
    if out_dir is None:
        return 0
    from commpipe.cluster.launch import NodeCommand, run_commands, torchrun
    from commpipe.cluster.netns import EmulatedCluster

    argv = sys.argv[1:] if argv is None else list(argv)
    out = str(out_dir)
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=args.mbit,
                         prefix="cpxfer") as cluster:
        cmds = [NodeCommand(i, torchrun("--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
                                        str(i), "--master-addr", cluster.node_ip(0),
                                        "--master-port", str(29600 + os.getpid() % 300), __file__, *argv),
                            {"GLOO_SOCKET_IFNAME": cluster.ifname, "XFER_FLAGS": out},
                            f"node{i}.log")
                for i in range(2)]
        res = run_commands(cmds, out, cluster=cluster, timeout_s=600)   # logs kept in `out`
        log = (Path(out) / "logs" / "node0.log").read_text()
        print("\n".join(x for x in log.splitlines() if not x.startswith(("$", "[W", "W1"))))
        if not res.ok:
            print(f"failed: {res.status}: {res.reason} (logs in {out}/logs)")
            return 1
    print(f"(logs in {out}/logs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
