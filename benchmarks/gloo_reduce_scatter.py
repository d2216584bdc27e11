"""gloo's reduce-scatter against the all-to-all plus local sum that commpipe's Comm runs on gloo.

    python benchmarks/gloo_reduce_scatter.py                    # 2 ranks on loopback
    python benchmarks/gloo_reduce_scatter.py --ranks 4 --sizes 64,1024
    sudo python benchmarks/gloo_reduce_scatter.py --mbit 200    # one rank per emulated node

Both are timed side by side in the same processes, alternating, on float32 tensors of each
size (the full input, KiB); an all-gather of the output size is timed beside them as the floor
(it moves the same bytes per rank). Printed per size: the median milliseconds of each and
native/all-to-all. Both results are checked equal before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="64,512,4096", help="input sizes in KiB (default 64,512,4096)")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--mbit", type=float, default=None,
                   help="run one rank per emulated node, links shaped to this rate (needs root)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29671, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def time_size(kib: int, n: int, iters: int) -> dict[str, float]:
    """Median ms of gloo's reduce-scatter, the all-to-all plus sum, and an all-gather of the
    output (the floor), on a float32 input of `kib` KiB, timed alternating."""
    import torch
    import torch.distributed as dist

    x = torch.randn(kib * 256 // n * n)
    out = torch.empty(x.numel() // n)
    slices = torch.empty_like(x)

    def native():
        dist.reduce_scatter_tensor(out, x)
        return out.clone()

    def a2a():
        dist.all_to_all_single(slices, x)
        return slices.view(n, -1).sum(0)

    def gather():
        dist.all_gather_into_tensor(slices, out)

    assert torch.allclose(native(), a2a(), rtol=1e-6, atol=1e-6)
    times = {"native": [], "a2a": [], "all_gather": []}
    for _ in range(iters):
        for name, fn in (("native", native), ("a2a", a2a), ("all_gather", gather)):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v[5:]) for k, v in times.items()}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.worker, world_size=args.ranks)
    rows = {int(s): time_size(int(s), args.ranks, args.iters) for s in args.sizes.split(",")}
    if args.worker == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    me = [sys.executable, __file__, "--ranks", str(args.ranks), "--sizes", args.sizes,
          "--iters", str(args.iters), "--port", str(args.port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(args.port)}
    if args.mbit is None:
        env["MASTER_ADDR"] = "127.0.0.1"
        procs = [subprocess.Popen(me + ["--worker", str(r)], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(args.ranks)]
        outs = [p.communicate()[0] for p in procs]
        where = "loopback"
    else:
        sys.path.insert(0, str(REPO))
        from commpipe.cluster.netns import EmulatedCluster, available

        ok, why = available()
        if not ok:
            print(f"gloo_reduce_scatter: skipped: {why}")
            return 0
        with EmulatedCluster(nodes=args.ranks, inter_node_mbit=args.mbit, prefix="cprs") as c:
            env.update(MASTER_ADDR=c.node_ip(0), GLOO_SOCKET_IFNAME=c.ifname,
                       PYTHONPATH=str(REPO))
            procs = [c.popen(r, me + ["--worker", str(r)], env=env, stdout=subprocess.PIPE, text=True)
                     for r in range(args.ranks)]
            outs = [p.communicate()[0] for p in procs]
        where = f"{args.ranks} emulated nodes at {args.mbit:g} Mbit/s"
    if any(p.returncode for p in procs):
        print("gloo_reduce_scatter: a rank failed")
        return 1
    rows = json.loads(outs[0].strip().splitlines()[-1])
    print(f"{args.ranks} ranks, {where}; median ms over {args.iters - 5} alternating rounds")
    print("input KiB | native reduce_scatter | all-to-all + sum | all_gather (floor) | native/a2a")
    for kib, r in rows.items():
        print(f"{kib:>9} | {r['native']:21.2f} | {r['a2a']:16.2f} | {r['all_gather']:18.2f} | "
              f"{r['native'] / r['a2a']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
