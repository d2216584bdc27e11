"""The measuring half of benchmarks/planner_rank.py: each set's probe, its layouts (one oracle
launch), the pass rates read around it, and this machine's CPU entry and core capacity.

Not a benchmark itself: imported as a sibling module.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from _spare_cores import CpuMeter, spare_cores

MODEL = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"  # DEMO_MODEL
TRAIN = {"model": MODEL, "seq_len": 32, "global_batch": 8}
PROBE_SIZES = "1K,4K,16K,64K,256K,1M"
WORLDS = (4, 8)
CALIB_WORLDS = (1, 2)


def _log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Host:
    """This machine as a one-node cluster for the oracle's and the probe's launch (loopback)."""

    ranks_per_node: int
    nodes: int = 1
    ifname: str = "lo"

    def node_ip(self, node: int) -> str:
        return "127.0.0.1"

    def popen(self, node: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, start_new_session=True, **kw)


# -- measuring ------------------------------------------------------------------------------------
def probe(cluster, out: Path, port: int) -> None:
    """`commpipe probe` on every rank of `cluster`, one torchrun per node; the cores other
    processes left it (`spare_cores`, whole machine's worth) go to OUT/<probe>-host.json: its
    call times are what a step pays only on a host as idle as the runs' (the report shows it)."""
    from commpipe.cluster.launch import NodeCommand, run_commands, torchrun

    inner = ["-m", "--", "commpipe", "probe", "--ranks-per-node", str(cluster.ranks_per_node),
             "--sizes", PROBE_SIZES, "--iters", "5", "--out", str(out.resolve())]
    cmds = [NodeCommand(i, torchrun("--nnodes", str(cluster.nodes), "--nproc-per-node",
                                    str(cluster.ranks_per_node), "--node-rank", str(i),
                                    "--master-addr", cluster.node_ip(0), "--master-port", str(port),
                                    *inner), {"GLOO_SOCKET_IFNAME": cluster.ifname},
                        f"probe-node{i}.log")
            for i in range(cluster.nodes)]
    t0 = time.time()
    with CpuMeter() as meter:
        result = run_commands(cmds, out.parent / f"{out.stem}-logs", cluster=cluster,
                              timeout_s=300)
    if not result.ok or not out.exists():
        raise RuntimeError(f"probe failed: {result.reason}")
    cores = os.cpu_count()
    (out.parent / f"{out.stem}-host.json").write_text(json.dumps(
        {"cores": cores, "spare_cores": spare_cores(meter.samples, t0, time.time(), cores)}) + "\n")


def measure_set(name: str, cluster, out: Path, args, port: int, with_probe: bool = True) -> None:
    """Probe `cluster` and train every layout of its ranks (one launch); skipped when --reuse
    finds both already there."""
    from commpipe.adapt.oracle import run_oracle

    probe_file, folder = out / f"probe-{name}.json", out / name
    t0 = time.monotonic()
    if with_probe and not (args.reuse and probe_file.exists()):
        probe(cluster, probe_file, port)
    if not (args.reuse and (folder / "candidates.json").exists()):
        before = read_pass_rates()
        with CpuMeter() as meter:
            run_oracle(cluster, dict(TRAIN, steps=args.steps), folder, port + 1, steps=args.steps,
                       warmup=args.warmup, cutoff=float("inf"), repeat_best=args.repeat_best,
                       log=lambda m: None, timeout_s=900)
        (folder / "host_cpu.json").write_text(json.dumps({"cores": os.cpu_count(),
                                                          "samples": meter.samples}))
        (out / f"pass_split-{name}.json").write_text(json.dumps(
            {"before": before, "after": read_pass_rates()}) + "\n")
    _log(f"{name}: {time.monotonic() - t0:.0f} s  (load average {os.getloadavg()[0]:.1f})")


def measure(args, out: Path) -> list[str]:
    """Every set this machine can run; returns their names."""
    from commpipe.plan.cpu import measure_cpu, measure_op_seconds

    cpu = out / "cpu.json"
    if not (args.reuse and cpu.exists()):
        cpu.write_text(json.dumps(measure_cpu().to_dict(), indent=2) + "\n")
    ops = out / "host_ops.json"
    if not (args.reuse and ops.exists()):
        ops.write_text(json.dumps({"op_s": measure_op_seconds()}) + "\n")
    pass_rates(out, fresh=not args.reuse)
    host_capacity(out, args.cores, fresh=not args.reuse)
    port = 29640
    for world in CALIB_WORLDS:
        measure_set(f"calib{world}", Host(world), out, args, port, with_probe=world > 1)
        port += 2
    names = []
    for world in WORLDS:
        name = f"local{world}"
        measure_set(name, Host(world), out, args, port)
        names.append(name)
        port += 2
    if args.no_emulated:
        return names
    from commpipe.cluster import netns

    ok, why = netns.available()
    if not ok:
        _log(f"emulated cluster skipped: {why}")
        return names
    for mbit in args.rates:
        for world in WORLDS:
            name = f"emu{mbit:g}mbit{world}"
            with netns.EmulatedCluster(world // 2, 2, mbit, prefix=f"cpr{os.getpid() % 1000}") as c:
                measure_set(name, c, out, args, port)
            names.append(name)
            port += 2
    return names


def host_capacity(out: Path, cores: int, fresh: bool = False) -> float:
    """What this machine's `cores` run at once in lone ranks' worth (`plan --host-cores auto`,
    commpipe.plan.cpu.measure_core_capacity), measured once and kept in OUT/host_capacity.json."""
    path = out / "host_capacity.json"
    if fresh or not path.exists():
        from commpipe.plan.cpu import measure_core_capacity

        path.write_text(json.dumps({"cores": cores, "capacity": measure_core_capacity(cores)}) + "\n")
    return json.loads(path.read_text())["capacity"]


def pass_rates(out: Path, fresh: bool = False) -> dict:
    """A pass of the model's first layer split into its fixed part per op and its part per unit
    of work, as `plan --gpu cpu` measures it on the model (commpipe.plan.pass_split, one thread;
    OUT/pass_split.json, one reading, taken with the sets unless missing)."""
    path = out / "pass_split.json"
    if fresh or not path.exists():
        path.write_text(json.dumps(read_pass_rates(readings=1)) + "\n")
    return json.loads(path.read_text())


def read_pass_rates(readings: int = 2) -> dict:
    """The pass rates `plan --gpu cpu` measures on the model (commpipe.plan.pass_split, one
    thread, fresh: not the cached reading), the median of `readings` readings in a row (each
    PLAN_BUDGET_S long), with when they were read and the cores other processes kept busy."""
    from commpipe.models.spec import resolve_model
    from commpipe.plan.pass_split import measure, planned_measure

    got = []
    for _ in range(readings):
        measure.cache_clear()
        got.append(planned_measure(resolve_model(MODEL), TRAIN["seq_len"]))
    measure.cache_clear()
    return {"op_s": statistics.median(g.op_ms for g in got) / 1e3,
            "work_s": statistics.median(g.work_ms for g in got) / 1e3, "time": time.time(),
            "other_cores": max((g.other_cores or 0.0) for g in got)}
