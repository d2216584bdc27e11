"""`commpipe demo --adaptive --out DIR`: the controller on an emulated 2-node x 2-rank cluster.

The story: data parallelism across the nodes is the fastest layout while the inter-node link is
fast; a short blip of that link must be ignored; then the link degrades for good, the gradient
all-reduce across it dominates, and the controller switches (in memory) to a layout that sends
far less across it. Three runs of the same training:
    DIR/adaptive/  the scenario with `--adapt`
    DIR/static/    the same scenario, controller off
    DIR/oracle/    every static tp x cp x pp x dp layout of the same 4 ranks, measured for a few
                   steps under the degraded link from step 0 (commpipe.adapt.oracle); the best
                   by median step time is the oracle (candidates.json, metrics.jsonl)
plus DIR/scenario.json (degrade_step, link, rates, blip steps as they happened), report.html
and a printed account: what the controller did, and how far from the best static layout it
ended (and, when it did not reach that layout, why, from its decision log). Link rates change
live with `EmulatedCluster.set_rate` while the run trains, at step boundaries read from the
run's metrics.jsonl. Needs root and iproute2.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from commpipe.adapt.demo_summary import criteria, format_summary, summarize

MODEL = "arch=llama,layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=512,vocab=256"


@dataclass
class Scenario:
    steps: int = 60
    fast_mbit: float = 1000.0
    slow_mbit: float = 20.0
    blip: tuple[int, int] = (12, 13)     # [start, end) steps of the short degrade
    degrade_step: int = 26               # lasting degrade from here on
    node: int = 1                        # the node whose link is throttled
    start: dict = field(default_factory=lambda: {"dp": 4})
    train: dict = field(default_factory=lambda: {
        "model": MODEL, "seq_len": 32, "global_batch": 8, "seed": 0, "log_every": 10})
    emulate_device: float = 1.0          # --emulate-device of every run (1: the host's compute)

    def train_flags(self, **more) -> dict:
        """`commpipe train` options of every run of the scenario (and the oracle's)."""
        emulate = {"emulate_device": self.emulate_device} if self.emulate_device > 1.0 else {}
        return {**self.train, "steps": self.steps, **emulate, **more}

    def timeout_s(self, host_s: float) -> float:
        """A run's time limit: `host_s`, stretched with the emulated device's compute."""
        return host_s * max(self.emulate_device, 1.0)


class RateDriver(threading.Thread):
    """Sets the node's link rate when the run's metrics reach given steps; records when."""

    def __init__(self, cluster, run_dir: Path, node: int, changes: list[tuple[int, float]]):
        super().__init__(daemon=True)
        self.cluster, self.path, self.node = cluster, run_dir / "metrics.jsonl", node
        self.changes = sorted(changes)
        self.applied: list[tuple[int, float]] = []   # (first step under the rate, Mbit/s)
        self.stop = threading.Event()

    def last_step(self) -> int:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return -1
        for line in reversed(lines):
            try:
                return json.loads(line)["step"]
            except (ValueError, KeyError):
                continue
        return -1

    def run(self) -> None:
        pending = list(self.changes)
        while pending and not self.stop.is_set():
            done = self.last_step()
            if done + 1 >= pending[0][0]:
                step, mbit = pending.pop(0)
                self.cluster.set_rate(self.node, mbit)
                self.applied.append((self.last_step() + 1, mbit))
            time.sleep(0.02)


def run_scenario(cluster, sc: Scenario, run_dir: Path, layout: dict, adapt: bool, changes,
                 port: int):
    """Train `layout` on the emulated cluster with `sc.train` for `sc.steps` (with --adapt if
    asked) while a RateDriver applies `changes` [(step, Mbit/s)] to node `sc.node`'s link;
    returns the rate changes as applied (commpipe.adapt.demo, benchmarks/replace_emulated.py)."""
    from commpipe.cluster.grids import Layout
    from commpipe.cluster.launch import plan_commands, run_commands

    # a rerun of the demo replaces its earlier runs
    train = sc.train_flags(adapt=adapt or None, overwrite=True)
    lay = Layout(**layout)
    cmds = plan_commands(lay, train, run_dir.resolve(), nodes=cluster.nodes,
                         ranks_per_node=cluster.ranks_per_node, master_addr=cluster.node_ip(0),
                         master_port=port, ifname=cluster.ifname)
    driver = RateDriver(cluster, run_dir, sc.node, changes)
    driver.start()
    try:
        result = run_commands(cmds, run_dir, cluster=cluster, timeout_s=sc.timeout_s(300))
    finally:
        driver.stop.set()
        driver.join()
    if not result.ok:
        raise RuntimeError(f"{run_dir.name} run {result.status}: {result.reason}")
    return driver.applied


def run_adaptive_demo(out, sc: Scenario | None = None, log=print) -> dict:
    from commpipe.adapt.oracle import run_oracle
    from commpipe.cluster.netns import EmulatedCluster, available

    ok, why = available()
    if not ok:
        raise RuntimeError(f"the adaptive demo needs the emulated cluster: {why}")
    sc = sc or Scenario()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=sc.fast_mbit,
                         prefix="cpad") as cluster:
        plan = [(sc.blip[0], sc.slow_mbit), (sc.blip[1], sc.fast_mbit),
                (sc.degrade_step, sc.slow_mbit)]
        blip = f"step {sc.blip[0]}" if sc.blip[1] - sc.blip[0] == 1 else \
            f"steps {sc.blip[0]}-{sc.blip[1] - 1}"
        log(f"adaptive: {sc.start} with --adapt; link of node {sc.node} {sc.fast_mbit:g} Mbit/s, "
            f"blip to {sc.slow_mbit:g} at {blip}, lasting from step {sc.degrade_step}")
        applied = run_scenario(cluster, sc, out / "adaptive", sc.start, True, plan, 29611)
        cluster.set_rate(sc.node, sc.fast_mbit)
        log("static: the same scenario, controller off")
        run_scenario(cluster, sc, out / "static", sc.start, False, plan, 29612)
        cluster.set_rate(sc.node, sc.slow_mbit)
        oracle = run_oracle(cluster, sc.train_flags(), out / "oracle", 29613, log=log,
                            timeout_s=sc.timeout_s(400))
        log(f"oracle: {oracle['best']['name']} {oracle['best']['median_ms']:.0f} ms "
            f"(sweep {oracle['sweep_s']:.0f} s)")
    scenario = {"degrade_step": next((s for s, m in applied if m == sc.slow_mbit
                                      and s >= sc.blip[1]), sc.degrade_step),
                "link": f"node {sc.node}",
                "rates_mbit": {"fast": sc.fast_mbit, "slow": sc.slow_mbit},
                "blip_steps": list(range(applied[0][0], applied[1][0])) if len(applied) >= 2
                else [],
                "rate_changes": applied, "scenario": asdict(sc)}
    (out / "scenario.json").write_text(json.dumps(scenario, indent=2))
    summary = summarize(out, sc, applied, oracle)
    summary["elapsed_s"] = time.monotonic() - t0          # without the report (its notes)
    summary["report"] = write_demo_report(out, summary)
    summary["elapsed_s"] = time.monotonic() - t0
    summary["criteria"] = [{"criterion": c, "pass": ok, "measured": m}
                           for c, ok, m in criteria(summary)]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_demo_report(out: Path, summary: dict) -> str:
    """The sweep report of the three runs (the comparison figures come first), with the summary
    as its notes."""
    from commpipe.report.cli import write_report

    return write_report(out, warmup=2, title="commpipe adaptive demo",
                        notes=format_summary(summary).splitlines())["html"]
