"""`train --adapt` over a suite of faults, each run adaptive, static and as the best static layout.

    python benchmarks/adaptive_suite.py --out /tmp/adaptive_suite --json /tmp/adaptive_suite.json
    python benchmarks/adaptive_suite.py --scenarios healthy,link-2x      # a subset
    python benchmarks/adaptive_suite.py --list                           # the scenarios
    python benchmarks/adaptive_suite.py --out DIR --reuse --write-interval   # trials' interval
    python benchmarks/adaptive_suite.py --out DIR --json F --reuse           # draw F again

Two emulated nodes of one rank each (commpipe.cluster.netns: network namespaces, tc tbf; needs
root and iproute2), the tiny 4-layer LLaMA of `commpipe demo --adaptive`, 50 steps with the fault
from step 12 (30 steps for the healthy and transient runs, three runs each). Faults use
the mechanisms commpipe already has: a link changes rate while the run trains
(`EmulatedCluster.set_rate` at step boundaries, commpipe.adapt.demo.RateDriver) and a rank's
compute is stretched by the `--slow-rank RANK:FACTOR@STEP` drill. The degraded link rates are
aimed at a static dp2 step of ~1.3x, ~2x and ~5x the healthy one from a 12-step healthy run on
this host first (`aimed_rates`; `--fixed-rates` keeps 80, 40 and 12 Mbit/s). The intra-node
scenario runs its two ranks on one emulated node and slows the link between them
(`EmulatedCluster.set_intra_rate`, the node's loopback) to twice the ~2x rate, as both
directions share that link. Each scenario runs

    adaptive   the scenario with --adapt
    static     the same scenario, controller off (same seed: same losses)
    best       every static layout of the 2 ranks, measured under the fault from step 0
               (commpipe.adapt.oracle, plus the splits that take work off a slow rank and
               the layouts at micro-batch sizes 2 and 4: `extra_candidates`); the fastest
               median is the best static layout for the faulty period

and reports: detection latency (steps and seconds after the fault's first step), false switches
(switches before any lasting fault, or in a scenario without one), detection to settled (the
trial phase's end, or the switch without trials), the switch time split (planning on rank 0,
then the switch as the decision records time it), the recovered share
(T_static - T_adaptive) / (T_static - T_best) on mean wall time per step over the faulty period
(in brackets, the same share over the faulty steps after the reaction settled: what the layout
it reached recovers, without the steps before detection and the trials),
the overhead of --adapt on a healthy run (wall per step, same seed) and the largest loss
difference against the static run. Wall time per step comes from when each step's record
reaches metrics.jsonl, so it includes what the controller does between steps (its per-step
gather, planning, switches, trials), which the records' step_time_s leaves out. OUT/suite.md
shows the table, the outcome against the goals (suite.png) and each adaptive run's step time
with its detections, switches and re-checks (benchmarks/_suite_figure.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _adaptive_metrics import COLUMNS, measure, row, table  # noqa: E402
from _suite_figure import write_suite_page  # noqa: E402

from commpipe.adapt.demo import MODEL, RateDriver  # noqa: E402

STEPS = 50
ONSET = 12           # first step under a lasting fault
NODE = 1             # the node whose link is throttled
TRAIN = {"model": MODEL, "seq_len": 32, "global_batch": 8, "seed": 0, "log_every": 10}
DP2, PP2 = {"dp": 2}, {"pp": 2, "schedule": "1f1b"}
# link rates (Mbit/s): the healthy link, as in the demo, and the degraded ones for a static dp2
# step ~1.3x, ~2x and ~5x of the healthy one: aimed on this host before the scenarios run
# (`aimed_rates`), or these fixed ones with --fixed-rates (each run reports the severity it
# measured: a loaded host moves it)
FAST = 1000.0
FIXED_RATES = {1.3: 80.0, 2.0: 40.0, 5.0: 12.0}


def gradient_bits() -> float:
    """Bits the dp2 gradient all-reduce sends each way over the inter-node link per step: every
    fp32 gradient once (a ring of two ranks: reduce-scatter half, all-gather half)."""
    from commpipe.models.family import family_for_model

    family = family_for_model(MODEL)
    return 32.0 * family.param_count(family.resolve(MODEL), TRAIN["seq_len"])


def aimed_rates(healthy_s: float, bits: float, targets=tuple(FIXED_RATES)) -> dict[float, float]:
    """Inter-node rates (Mbit/s) for a static dp2 step k x the healthy one: the step is the rest
    of its work plus the gradient all-reduce's bits over the link, T(r) = T_c + bits / r, where
    the healthy step gives T_c = T_h - bits / FAST; so r = bits / (k T_h - T_c). The bucketed
    all-reduce overlaps part of the backward, so the measured severity can fall short of k."""
    rest = healthy_s - bits / (FAST * 1e6)
    return {k: bits / (k * healthy_s - rest) / 1e6 for k in targets}


@dataclass
class Case:
    name: str
    what: str
    start: dict
    link: list = field(default_factory=list)   # [(step, Mbit/s)] rate changes
    slow_rank: str | None = None                # --slow-rank RANK:FACTOR@STEP
    lasting: tuple | None = None                # [onset, end) of the faulty period (end None: run end)
    best: dict | None = None                    # the fault from step 0: {mbit, slow_rank, extra}
    repeats: int = 1
    static_each_repeat: bool = True
    steps: int = STEPS
    skip: str = ""                              # why the scenario cannot be run here
    intra: bool = False                         # the link between two ranks of one node


def cases(rates: dict[float, float] = FIXED_RATES) -> list[Case]:
    """The scenarios, the issue's list in the order the suite runs them: the goals' scenarios
    first, so an interrupted run has measured those. `rates`: Mbit/s per aimed severity."""
    lasting = (ONSET, None)
    RATE_13, RATE_2, RATE_5 = (round(rates[k], 1) for k in (1.3, 2.0, 5.0))

    def link(name, what, mbit):
        return Case(name, what, DP2, [(ONSET, mbit)], lasting=lasting,
                    best={"mbit": mbit, "extra": ("batches",)})

    def straggler(name, what, start, factor, extra):
        return Case(name, what, start, slow_rank=f"1:{factor:g}@{ONSET}", lasting=lasting,
                    best={"mbit": FAST, "slow_rank": f"1:{factor:g}@0", "extra": extra})

    return [
        Case("healthy", "dp2, host noise only", DP2, repeats=3, steps=30),
        link("link-2x", f"dp2, inter-node link at {RATE_2:g} Mbit/s", RATE_2),
        link("link-5x", f"dp2, inter-node link at {RATE_5:g} Mbit/s", RATE_5),
        straggler("slow-1.5x", "pp2, rank 1 compute 1.5x", PP2, 1.5, ("splits",)),
        Case("transient", f"dp2, link at {RATE_5:g} Mbit/s for 3 steps", DP2,
             [(ONSET, RATE_5), (ONSET + 3, FAST)], repeats=3, static_each_repeat=False,
             steps=30),
        link("link-1.3x", f"dp2, inter-node link at {RATE_13:g} Mbit/s", RATE_13),
        straggler("slow-3x", "pp2, rank 1 compute 3x", PP2, 3.0, ("splits",)),
        straggler("slow-dp", "dp2, rank 1 (DP replica 1) compute 3x", DP2, 3.0, ("dp", "batches")),
        Case("recovers", f"dp2, link at {RATE_5:g} Mbit/s for steps {ONSET}-31, then back", DP2,
             [(ONSET, RATE_5), (32, FAST)], lasting=(ONSET, 32),
             best={"mbit": RATE_5, "extra": ("batches",)}),
        Case("two-faults", f"dp2, link at {RATE_2:g} Mbit/s and rank 1 compute 1.5x", DP2,
             [(ONSET, RATE_2)], slow_rank=f"1:1.5@{ONSET}", lasting=lasting,
             best={"mbit": RATE_2, "slow_rank": "1:1.5@0", "extra": ("splits", "dp", "batches")}),
        Case("link-intra", f"dp2 on one node, the link between its ranks at {2 * RATE_2:g} "
             "Mbit/s (shared by both directions)", DP2, [(ONSET, 2 * RATE_2)], lasting=lasting,
             best={"mbit": 2 * RATE_2, "extra": ("batches",)}, intra=True),
    ]


# -- running (emulated cluster) --------------------------------------------------------------------
class StepClock(RateDriver):
    """RateDriver that also notes when each step's record reaches metrics.jsonl."""

    def __init__(self, cluster, run_dir: Path, node: int, changes, set_rate):
        super().__init__(cluster, run_dir, node, changes)
        self.seen: dict[int, float] = {}
        self.set_rate = set_rate    # (node, Mbit/s): the node's NIC or its internal link

    def run(self) -> None:
        pending = sorted(self.changes)
        while not self.stop.is_set():
            done = self.note()
            while pending and done + 1 >= pending[0][0]:
                mbit = pending.pop(0)[1]
                self.set_rate(self.node, mbit)
                self.applied.append((self.note() + 1, mbit))
            time.sleep(0.01)

    def note(self) -> int:
        now, last = time.monotonic(), -1
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return -1
        for line in lines:
            try:
                last = json.loads(line)["step"]
            except (ValueError, KeyError):
                continue
            self.seen.setdefault(last, now)
        return last


class Bench:
    def __init__(self, cluster, out: Path):
        self.cluster, self.out, self.port = cluster, out, 29800
        self.best_cache: dict[str, dict] = {}
        self.one_node = None        # the intra-node scenario's cluster: one node of two ranks

    def site(self, case: Case):
        """(cluster, node, set_rate(node, Mbit/s)) of the case's link faults: node 1's NIC on
        the two-node cluster, or the link between the two ranks of a one-node cluster (FAST
        there means unshaped)."""
        if not case.intra:
            return self.cluster, NODE, self.cluster.set_rate
        if self.one_node is None:
            from commpipe.cluster.netns import EmulatedCluster

            self.one_node = EmulatedCluster(nodes=1, ranks_per_node=2, prefix="cpsintra").up()
        c = self.one_node
        return c, 0, lambda node, mbit: c.set_intra_rate(node, None if mbit == FAST else mbit)

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def train(self, case: Case, run_dir: Path, adapt: bool) -> dict:
        from commpipe.cluster.grids import Layout
        from commpipe.cluster.launch import plan_commands, run_commands

        cluster, node, set_rate = self.site(case)
        set_rate(node, FAST)
        train = dict(TRAIN, steps=case.steps, overwrite=True, adapt=adapt or None,
                     slow_rank=case.slow_rank)
        cmds = plan_commands(Layout(**case.start), train, run_dir.resolve(),
                             nodes=cluster.nodes, ranks_per_node=cluster.ranks_per_node,
                             master_addr=cluster.node_ip(0), master_port=self.next_port(),
                             ifname=cluster.ifname)
        clock = StepClock(cluster, run_dir, node, case.link, set_rate)
        load = os.getloadavg()[0]
        clock.start()
        try:
            result = run_commands(cmds, run_dir, cluster=cluster, timeout_s=400)
        finally:
            clock.stop.set()
            clock.join()
            set_rate(node, FAST)
        if not result.ok:
            raise RuntimeError(f"{run_dir}: {result.status}: {result.reason}")
        (run_dir / "wall.json").write_text(json.dumps({"seen": clock.seen,
                                                       "applied": clock.applied}))
        return {"rows": _jsonl(run_dir / "metrics.jsonl"), "wall": clock.seen,
                "applied": clock.applied, "decisions": _jsonl(run_dir / "adapt.jsonl"),
                "load": (load, os.getloadavg()[0])}

    def best_static(self, case: Case) -> dict:
        from commpipe.adapt.oracle import run_oracle

        b = case.best
        key = json.dumps(dict(b, intra=case.intra), sort_keys=True)
        if key not in self.best_cache:
            train = dict(TRAIN, steps=case.steps, slow_rank=b.get("slow_rank"))
            train = {k: v for k, v in train.items() if v is not None}
            cluster, node, set_rate = self.site(case)
            set_rate(node, b["mbit"])
            try:
                self.best_cache[key] = run_oracle(
                    cluster, train, self.out / f"best-{len(self.best_cache)}",
                    self.next_port(), steps=8, repeat_best=1, log=lambda *_: None,
                    extra=extra_candidates(train, b["extra"]))
            finally:
                set_rate(node, FAST)
        return self.best_cache[key]


def extra_candidates(train: dict, kinds) -> list[dict]:
    """Static layouts beyond the oracle's even and balanced splits at micro-batch size 1, as the
    controller's own candidates reach them: pp2 with each split of the 4 layers, micro-batch
    size 1, 2 or 4 and the 1f1b or zbh1 schedule ("splits"), dp2 with fewer micro-batches on
    replica 1 ("dp"), dp2 and the even pp2 at micro-batch size 2 or 4 ("batches")."""
    from commpipe.adapt.oracle import _config
    from commpipe.cluster.launch import train_flags
    from commpipe.layout import Layout

    shared = {k: v for k, v in train.items() if k not in ("adapt", "out", "log_every")}
    found = []
    for kind in kinds:
        if kind == "splits":
            options = [(f"layers{a}.{4 - a}-mbs{m}", dict(PP2, schedule=sched),
                        {"stage_layers": f"{a},{4 - a}", "micro_batch_size": m})
                       for a in (1, 2, 3) for m in (1, 2, 4) for sched in ("1f1b", "zbh1")
                       if (a, m, sched) != (2, 1, "1f1b")]   # the oracle's own even split
        elif kind == "dp":
            options = [(f"dpm{a}.{8 - a}", DP2, {"dp_microbatches": f"{a},{8 - a}"})
                       for a in (5, 6, 7)]
        else:
            options = [(f"mbs{m}", DP2, {"micro_batch_size": m}) for m in (2, 4)] + \
                [(f"layers2.2-mbs{m}", dict(PP2, schedule=sched),
                  {"stage_layers": "2,2", "micro_batch_size": m})
                 for m in (2, 4) for sched in ("1f1b", "zbh1")]
        for label, start, extra in options:
            lay = Layout(**start, extra=extra)
            flags = train_flags(lay, shared, "unused")
            cfg = _config(flags)
            cfg.resolve(2)
            if any(f["name"] == f"{lay.name}-{label}" for f in found):
                continue                 # two kinds reach the same layout
            found.append({"name": f"{lay.name}-{label}", "tp": 1, "cp": 1, "pp": lay.pp,
                          "dp": lay.dp, "stage_layers": list(cfg.stage_layers or [4]),
                          "split": label, "schedule": cfg.schedule,
                          "microbatches": cfg.microbatches,
                          "micro_batch_size": cfg.micro_batch_size, "flags": flags})
    return found


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# -- main ------------------------------------------------------------------------------------------
def run_case(bench: Bench, case: Case, log) -> list[dict]:
    out = bench.out / case.name
    results, static = [], None
    for i in range(case.repeats):
        tag = f"-{i + 1}" if case.repeats > 1 else ""
        t0 = time.monotonic()
        adaptive = bench.train(case, out / f"adaptive{tag}", adapt=True)
        if static is None or case.static_each_repeat:
            static = bench.train(case, out / f"static{tag}", adapt=False)
        best = bench.best_static(case) if case.best else None
        m = measure(case, adaptive, static, best)
        m["repeat"] = i + 1 if case.repeats > 1 else None
        m["elapsed_s"] = time.monotonic() - t0
        m["load"] = {"adaptive": adaptive["load"], "static": static["load"]}
        log(row(m))
        results.append(m)
    return results


def main(argv=None) -> int:
    from commpipe.cluster.netns import EmulatedCluster, available

    all_cases = {c.name: c for c in cases()}
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/adaptive_suite", help="runs go here")
    p.add_argument("--scenarios", default=None,
                   help="comma-separated subset of: " + ",".join(all_cases))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--fixed-rates", action="store_true",
                   help=f"degrade links to {', '.join(f'{v:g}' for v in FIXED_RATES.values())} "
                        "Mbit/s instead of rates aimed at this host's healthy step")
    p.add_argument("--write-interval", action="store_true",
                   help="store the trials' relative error quantiles in commpipe/plan/interval.py "
                        "(after the run; alone with --reuse: from OUT's runs)")
    p.add_argument("--reuse", action="store_true",
                   help="run nothing: with --write-interval, read the trials of OUT's runs; with "
                        "--json, draw its results and OUT's runs again (OUT/suite.md)")
    args = p.parse_args(argv)
    if args.reuse:
        if not (args.write_interval or args.json):
            p.error("--reuse goes with --write-interval or --json (the results to draw)")
        if args.write_interval:
            write_interval(Path(args.out))
        if args.json:
            results = json.loads(Path(args.json).read_text())["results"]
            print(write_suite_page(results, table(results), Path(args.out)))
        return 0
    if args.list:
        for c in all_cases.values():
            print(f"{c.name:<12} {c.what}")
        return 0
    names = args.scenarios.split(",") if args.scenarios else list(all_cases)
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(all_cases)}")
    ok, why = available()
    if not ok:
        p.error(f"the suite needs the emulated cluster: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = {"load_avg": os.getloadavg(), "cpus": os.cpu_count(), "time": time.time()}
    t0, results = time.monotonic(), []
    print("  ".join(COLUMNS), flush=True)
    with EmulatedCluster(nodes=2, ranks_per_node=1, inter_node_mbit=FAST,
                         prefix="cpsuite") as cluster:
        bench = Bench(cluster, out)
        rates = dict(FIXED_RATES)
        if not args.fixed_rates and any(all_cases[n].link for n in names):
            probe = Case("calibrate", "dp2, healthy, to aim the link rates", DP2, steps=12)
            steps = [r["step_time_s"] for r in bench.train(probe, out / "calibrate", False)["rows"][1:]]
            healthy = statistics.median(steps)
            rates = aimed_rates(healthy, gradient_bits())
            print(f"healthy dp2 step {healthy * 1e3:.0f} ms; link rates aimed at "
                  + ", ".join(f"{k:g}x: {v:.0f} Mbit/s" for k, v in rates.items()), flush=True)
            all_cases = {c.name: c for c in cases(rates)}
        start["rates_mbit"] = rates
        for name in names:
            case = all_cases[name]
            if case.skip:
                results.append({"scenario": name, "what": case.what, "skipped": case.skip})
                continue
            results += run_case(bench, case, log=lambda r: print("  ".join(r), flush=True))
            if args.json:       # after every scenario: an interrupted suite keeps what it ran
                write_json(args.json, start, t0, results, [all_cases[n] for n in names])
        if bench.one_node is not None:
            bench.one_node.teardown()
    machine = write_json(args.json, start, t0, results, [all_cases[n] for n in names])
    print()
    print(table(results))
    print(f"\n{len(results)} results in {machine['elapsed_s'] / 60:.1f} min; load average "
          f"{start['load_avg'][0]:.1f} at the start, {machine['end_load_avg'][0]:.1f} at the end "
          f"({start['cpus']} cpus)")
    print(f"figures: {write_suite_page(results, table(results), out)}")
    if args.write_interval:
        write_interval(out)
    return 0


def trial_ratios(out: Path) -> list[float]:
    """Each trial's measured over predicted step time over the median of its trial phase's, from
    every adaptive run under `out` (a phase of one trial says nothing of relative error)."""
    ratios = []
    for log in sorted(out.glob("*/adaptive*/adapt.jsonl")):
        phase = []
        for rec in _jsonl(log) + [{"action": "end"}]:
            if rec["action"] == "trial":
                phase.append(rec["measured_ms"] / rec["predicted_ms"])
            elif phase and rec["action"] != "trial":
                if len(phase) > 1:
                    mid = statistics.median(phase)
                    ratios += [r / mid for r in phase]
                phase = []
    return ratios


def write_interval(out: Path) -> None:
    """The 10th, 50th and 90th percentile of `trial_ratios` into commpipe/plan/interval.py, the
    interval the controller chooses and drops trials by."""
    import numpy as np
    from _interval_file import write_block

    ratios = trial_ratios(out)
    if len(ratios) < 10:
        print(f"only {len(ratios)} trials under {out}: the interval is left as it was")
        return
    q = {k: round(float(np.percentile(ratios, k)), 4) for k in (10, 50, 90)}
    path = write_block("adaptive_suite.py", f"TRIAL_QUANTILES = {q}\nTRIALS = {len(ratios)}")
    print(f"wrote {path}: a trial's measured / predicted over its phase's median {q}, "
          f"{len(ratios)} trials")


def write_json(path, start: dict, t0: float, results: list, scenarios: list) -> dict:
    machine = {"start": start, "end_load_avg": os.getloadavg(), "elapsed_s": time.monotonic() - t0,
               "healthy_mbit": FAST, "steps": STEPS, "onset": ONSET}
    if path:
        Path(path).write_text(json.dumps({"machine": machine, "results": results,
                                          "scenarios": [asdict(c) for c in scenarios]},
                                         indent=1, default=str))
    return machine


if __name__ == "__main__":
    sys.exit(main())
