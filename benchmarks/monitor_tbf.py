"""Does the monitor's transfer bandwidth match a throttled link, with the wait left out?

    sudo python benchmarks/monitor_tbf.py                     # 200 Mbit/s, 16 and 64 MiB
    sudo python benchmarks/monitor_tbf.py --mbit 100 --sizes 8,32 --stall 0.5

Two ranks run in two network namespaces (commpipe.cluster.netns.EmulatedCluster: a veth per
node on a bridge) whose links are shaped with
    tc qdisc replace dev X root tbf rate 200mbit burst 32kbit latency 400ms
on both ends of both veths. Rank 0 sleeps `--stall` seconds, then sends one large message; rank 1
has posted its receive beforehand, so the naive interval around the receive contains the stall.
Prints, per message, the monitor's transfer bandwidth (wait excluded) and the raw interval's
bandwidth (wait included) next to the shaped rate. The reference is the TCP goodput the shaper
allows: rate * 1448 / 1514 (payload per full Ethernet frame with TCP timestamps); the goal is
the monitor within 10% of it. Needs root and iproute2; otherwise it says why and exits 0.
Everything it creates is removed on exit (also on errors and Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOODPUT = 1448 / 1514   # TCP payload per 1514-byte frame (1500 MTU + Ethernet header, TCP timestamps)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=200.0, help="shaped rate, Mbit/s (default 200)")
    p.add_argument("--burst", default="32kbit", help="tbf burst (default 32kbit)")
    p.add_argument("--latency", default="400ms", help="tbf latency (default 400ms)")
    p.add_argument("--sizes", default="16,16,64", help="message sizes in MiB (default 16,16,64)")
    p.add_argument("--stall", type=float, default=1.0, help="sender sleep before each send, s")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from commpipe.monitor import Monitor
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims

    rank = args.worker
    dist.init_process_group("gloo", rank=rank, world_size=2)
    comm = Comm(ParallelDims(pp=2), rank)
    mon = Monitor(comm, args.out, sample=1.0).attach()
    comm.all_reduce(torch.zeros(1), "pp")   # connect before timing anything
    for step, mib in enumerate(int(s) for s in args.sizes.split(",")):
        buf = torch.zeros(mib * (1 << 20), dtype=torch.uint8)
        if rank == 0:
            time.sleep(args.stall)
            comm.send(buf, 1)
        else:
            comm.recv(buf, 0)
        mon.end_step(step)
    mon.close()
    dist.destroy_process_group()


def qdisc(cluster, args) -> None:
    spec = ["tbf", "rate", f"{args.mbit:g}mbit", "burst", args.burst, "latency", args.latency]
    for node in range(cluster.nodes):
        for cmd in (["ip", "netns", "exec", cluster.ns(node), "tc", "qdisc", "replace", "dev",
                     cluster.ifname, "root", *spec],
                    ["tc", "qdisc", "replace", "dev", cluster.host_veth(node), "root", *spec]):
            subprocess.run(cmd, check=True, capture_output=True, text=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    sys.path.insert(0, str(REPO))
    from commpipe.cluster.netns import EmulatedCluster, available

    ok, why = available()
    if not ok:
        print(f"monitor_tbf: skipped: {why}")
        return 0
    out = Path(tempfile.mkdtemp(prefix="monitor_tbf_"))
    with EmulatedCluster(nodes=2, prefix="cpmtbf") as cluster:
        qdisc(cluster, args)
        env = dict(os.environ, MASTER_ADDR=cluster.node_ip(0), MASTER_PORT="29533", WORLD_SIZE="2",
                   GLOO_SOCKET_IFNAME=cluster.ifname, PYTHONPATH=str(REPO))
        procs = [cluster.popen(node, [sys.executable, __file__, "--worker", str(node), "--out", str(out),
                                      "--sizes", args.sizes, "--stall", str(args.stall)],
                               env=dict(env, RANK=str(node)))
                 for node in range(2)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            print(f"monitor_tbf: workers exited with {codes}")
            return 1
    report(args, out)
    return 0


def report(args, out: Path) -> None:
    rate = args.mbit * 1e6 / 8 / 1e9                     # GB/s on the wire
    good = rate * GOODPUT
    recs = [json.loads(line) for line in open(out / "monitor" / "rank1.jsonl")]
    sends = {r["step"]: r for r in map(json.loads, open(out / "monitor" / "rank0.jsonl"))
             if r["op"] == "send"}
    print(f"tbf rate {args.mbit:g} Mbit/s (burst {args.burst}, latency {args.latency}); TCP goodput "
          f"reference {good * 8e3:.1f} Mbit/s; sender stalls {args.stall:g} s before each send")
    print(f"{'step':>4} {'MiB':>5} {'wait ms':>9} {'transfer ms':>12} {'monitor Mbit/s':>15} "
          f"{'/ goodput':>10} {'raw Mbit/s':>11} {'/ goodput':>10} {'sender Mbit/s':>14}")
    for r in recs:
        if r["op"] != "recv" or not r["calls"]:
            continue
        bw, raw = r["bandwidth_gbps"], r["raw_bandwidth_gbps"]
        snd = sends.get(r["step"], {}).get("bandwidth_gbps")
        print(f"{r['step']:>4} {r['bytes'] / (1 << 20):>5.0f} {r['wait_ms']:>9.1f} {r['transfer_ms']:>12.1f} "
              f"{bw * 8e3:>15.1f} {bw / good:>10.3f} {raw * 8e3:>11.1f} {raw / good:>10.3f} "
              f"{snd * 8e3 if snd else float('nan'):>14.1f}")
    print(f"(records in {out}/monitor)")


if __name__ == "__main__":
    sys.exit(main())
