"""`commpipe sweep`: train a grid of layouts one after another and collect the results.

    commpipe sweep --grid demo8 --out runs/demo --cluster emulated --nodes 4 --ranks-per-node 2 \
        --inter-node-mbit 200
    commpipe sweep --grid grid.toml --out runs/g --cluster local --preset tiny --steps 5
    commpipe sweep --grid study --out runs/study --cluster slurm --nodes 4 --ranks-per-node 4 \
        --account m1234                       # writes sbatch scripts + submit_all.sh, runs nothing
    commpipe report runs/demo

Each layout trains in OUT/<layout-name>/ (a `commpipe train` run folder, plus logs/) and, once it
finishes, appends one status line to OUT/sweep.jsonl: ok, or failed / invalid / timeout with
the reason. A failing layout never stops the sweep. Re-running the same command skips layouts
already recorded with the same settings (--retry-failed reruns failures, --force everything); a
torn last line of sweep.jsonl (a sweep killed while writing it) is dropped with a warning and
its layout runs again.

SIGTERM or SIGINT stops the layout in progress (its torchrun process group, started in a session
of its own, gets SIGTERM, then SIGKILL), records it as interrupted (it runs again on a rerun),
tears down the emulated cluster and exits with 128 + the signal number. The emulated cluster's
name prefix is printed at the start and written to OUT/cluster.json, so that after a SIGKILL
`commpipe cluster down --sweep OUT` removes what was left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from commpipe.cluster.grids import Grid, Layout, check_train_values, load_grid, shared_global_batch
from commpipe.cluster.launch import (
    RunResult,
    nodes_used,
    plan_commands,
    plan_local,
    run_commands,
    train_flags,
)
from commpipe.cluster.sweep_state import (  # noqa: F401  (read_status, last_step: public here too)
    CLUSTER_FILE,
    STATUS_FILE,
    Interrupted,
    _drop_torn_tail,
    already_done,
    fingerprint,
    last_step,
    nothing_to_run,
    read_status,
    record_status,
    signals_interrupt,
)
from commpipe.files import check_out_dir

TRAIN_FLAGS = ("model", "steps", "seq_len", "global_batch", "micro_batch_size", "microbatches", "seed",
               "schedule", "comm_monitor", "trace", "lr", "data", "device")


# -- what a layout run needs ----------------------------------------------------------------------
def validate_layout(layout: Layout, train: dict) -> str | None:
    """Why `commpipe train` would reject this layout, checked in-process (no launch), or None."""
    try:
        from commpipe.train import cli as train_cli
        from commpipe.train.jobconfig import parse_known_args
    except ModuleNotFoundError:
        return None
    parser = argparse.ArgumentParser(exit_on_error=False)
    train_cli.add_arguments(parser)
    try:
        args, unknown = parse_known_args(parser, train_flags(layout, train, "unused"))
        if unknown:
            return f"`commpipe train` does not know {' '.join(unknown)}; drop it from the grid or flags"
        train_cli.config_from_args(args).resolve(layout.world_size)
    except (ValueError, FileNotFoundError, argparse.ArgumentError) as e:
        return str(e)
    return None


# -- runners: (layout, train, run_dir, poll) -> RunResult ----------------------------------------
class LocalRunner:
    """Every rank of a layout on this host (torchrun --standalone, loopback)."""

    kind = "local"

    def __init__(self, timeout_s: float = 900.0):
        self.timeout_s = timeout_s

    def describe(self) -> dict:
        return {"kind": self.kind}

    def __call__(self, layout, train, run_dir, poll=None) -> RunResult:
        return run_commands(plan_local(layout, train, run_dir), run_dir, timeout_s=self.timeout_s, poll=poll)


class EmulatedRunner:
    """One torchrun per node, each inside its namespace of an `EmulatedCluster`."""

    kind = "emulated"

    def __init__(self, cluster, timeout_s: float = 900.0, base_port: int = 29500):
        self.cluster, self.timeout_s, self.port = cluster, timeout_s, base_port

    def describe(self) -> dict:
        c = self.cluster
        return {"kind": self.kind, "nodes": c.nodes, "ranks_per_node": c.ranks_per_node,
                "inter_node_mbit": c.rates}

    def check(self, layout: Layout) -> None:
        nodes_used(layout, self.cluster.ranks_per_node, self.cluster.nodes)

    def __call__(self, layout, train, run_dir, poll=None) -> RunResult:
        c = self.cluster
        self.port += 1          # a fresh port per run: the previous store may linger in TIME_WAIT
        cmds = plan_commands(layout, train, Path(run_dir).resolve(), nodes=c.nodes,
                             ranks_per_node=c.ranks_per_node, master_addr=c.node_ip(0),
                             master_port=self.port, ifname=c.ifname)
        return run_commands(cmds, run_dir, cluster=c, timeout_s=self.timeout_s, poll=poll)


# -- the sweep ------------------------------------------------------------------------------------
def run_sweep(grid: Grid, out_dir, runner, train: dict | None = None, *, retry_failed: bool = False,
              force: bool = False, progress: bool = True, log=print) -> list[dict]:
    """Run every layout of `grid` with `runner`; returns the status record of each layout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = {**grid.train, **(train or {})}
    steps = int(train.get("steps", 10))
    done = read_status(out, warn=log)
    _drop_torn_tail(out / STATUS_FILE)
    records = []
    bar = _progress(len(grid.layouts), progress)
    if progress and log is print:
        log = bar.write             # keeps the bar intact below the messages
    for i, layout in enumerate(grid.layouts):
        run_dir = out / layout.name
        fp = fingerprint(layout, train)
        prev = done.get(layout.name)
        if already_done(prev, fp, run_dir, force, retry_failed):
            log(f"[{i + 1}/{len(grid.layouts)}] {layout.name}: already {prev['status']}, skipped")
            records.append(prev)
            bar.update(1)
            continue
        bar.set_description(f"{i + 1}/{len(grid.layouts)} {layout.name}")
        reason = validate_layout(layout, train)
        if reason is None and hasattr(runner, "check"):
            try:
                runner.check(layout)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            result = RunResult("invalid", reason)
        else:
            if run_dir.exists():       # metrics.jsonl is appended to: start from an empty folder
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)

            at = f"[{i + 1}/{len(grid.layouts)}] {layout.name}"

            def poll(elapsed, run_dir=run_dir, at=at, said=[0.0]):     # noqa: B006 (one per layout)
                s = last_step(run_dir)
                where = f"step {'-' if s is None else s + 1}/{steps}, {elapsed:.0f} s"
                bar.set_postfix_str(where)
                # without a live bar (a log, a pipe) a line now and then says the layout is alive
                if progress and bar.disable and elapsed - said[0] >= QUIET_PROGRESS_S:
                    said[0] = elapsed
                    log(f"{at}: running, {where}")

            started = time.monotonic()
            try:
                result = runner(layout, train, run_dir, poll)
            except Interrupted as e:    # the runner's `finally` has stopped the layout's processes
                elapsed = time.monotonic() - started
                result = RunResult("interrupted", f"stopped by {e} after {elapsed:.0f} s; it runs "
                                   "again when the sweep is rerun", None, elapsed)
                record_status(out, layout, result, runner, train, fp)
                log(f"[{i + 1}/{len(grid.layouts)}] {layout.name}: interrupted by {e}")
                raise
        rec = record_status(out, layout, result, runner, train, fp)
        records.append(rec)
        bar.update(1)
        msg = "ok" if result.ok else f"{result.status}: {result.reason}"
        log(f"[{i + 1}/{len(grid.layouts)}] {layout.name}: {msg} ({result.elapsed_s:.1f} s)")
    bar.close()
    return records


QUIET_PROGRESS_S = 30.0     # seconds between "running" lines when no live bar is drawn


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    # a live bar on a terminal only; logs and CI get the one line per finished layout
    return tqdm(total=total, unit="layout", disable=not enabled or not sys.stderr.isatty(),
                file=sys.stderr, dynamic_ncols=True)


def make_runner(kind: str, nodes: int, ranks_per_node: int, inter_node_mbit=None, timeout_s: float = 900.0,
                log=print, prefix: str | None = None, out_dir=None):
    """(runner, cluster or None). kind: emulated | local | auto; emulated falls back to local with
    a message when namespaces cannot be built here. The emulated cluster's prefix is logged and,
    with `out_dir`, written to OUT/cluster.json before any namespace exists."""
    from commpipe.cluster import netns

    if kind in ("emulated", "auto"):
        ok, why = netns.available()
        if ok:
            cluster = netns.EmulatedCluster(nodes, ranks_per_node, inter_node_mbit,
                                            prefix=prefix or f"cps{os.getpid() % 100000}")
            where = ""
            if out_dir is not None:
                path = Path(out_dir) / CLUSTER_FILE
                path.write_text(json.dumps({**cluster.describe(), "pid": os.getpid()}, indent=1) + "\n")
                where = f" (also in {path})"
            log(f"emulated cluster: namespaces {cluster.prefix}n0..{cluster.prefix}n{nodes - 1}; if this "
                f"sweep is killed, remove them with `commpipe cluster down --prefix {cluster.prefix}`{where}")
            return EmulatedRunner(cluster.up(), timeout_s), cluster
        log(f"emulated cluster unavailable ({why}); running every rank on this host over loopback")
    elif kind != "local":
        raise ValueError(f"--cluster {kind!r}: use emulated, local, auto or slurm")
    if inter_node_mbit is not None:
        log("--inter-node-mbit has no effect on one host: every rank talks over loopback")
    return LocalRunner(timeout_s), None


# -- the verb -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--grid", required=True, help="grid TOML file or preset (study, demo8)")
    p.add_argument("--out", required=True, help="sweep folder: one run folder per layout + sweep.jsonl")
    p.add_argument("--cluster", default="auto", choices=("auto", "emulated", "local", "slurm"),
                   help="auto: emulated when possible, else local (default)")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks (GPUs) per node")
    p.add_argument("--inter-node-mbit", default=None,
                   help="inter-node link rate in Mbit/s, one value or one per node (200 or 200,200,50,200)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per layout (default 900)")
    p.add_argument("--retry-failed", action="store_true", help="rerun layouts recorded as failed")
    p.add_argument("--force", action="store_true", help="rerun every layout")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", action="store_true", help="write the report when the sweep ends")
    g = p.add_argument_group("training flags (override the grid's [train] table)")
    g.add_argument("--preset", "--model", dest="model", default=None)
    for name, typ in (("steps", int), ("seq-len", int), ("global-batch", int), ("micro-batch-size", int),
                      ("microbatches", int), ("seed", int), ("lr", float)):
        g.add_argument(f"--{name}", type=typ, default=None)
    g.add_argument("--schedule", default=None, help="default schedule for layouts that name none")
    g.add_argument("--comm-monitor", "--monitor", dest="comm_monitor", default=None,
                   help="off | sample=0.1 | all (default sample=0.1)")
    g.add_argument("--trace", action="store_true", default=None)
    g.add_argument("--data", default=None)
    g.add_argument("--train-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other `commpipe train` flag, e.g. --train-arg zero1=true")
    g = p.add_argument_group("slurm (with --cluster slurm)")
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default="regular")
    g.add_argument("--time", default="00:30:00")
    g.add_argument("--constraint", default="gpu")
    g.add_argument("--setup", action="append", default=[], help="a shell line run before srun "
                   "(e.g. 'module load pytorch'); repeatable")


def parse_rates(text: str | None):
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--inter-node-mbit {text!r}: give a number or comma-separated numbers") from None
    return values[0] if len(values) == 1 else values


def train_overrides(args) -> dict:
    out = {}
    for key in TRAIN_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    for item in args.train_arg:
        if "=" not in item:
            raise ValueError(f"--train-arg {item!r}: write KEY=VALUE, e.g. zero1=true")
        key, value = item.split("=", 1)
        low = value.lower()
        out[key.strip().replace("-", "_")] = True if low == "true" else False if low == "false" else value
    return out


DEFAULT_MONITOR = "sample=0.1"   # time one call in ten, as the study did; count all


def run(args) -> int:
    for flag, value in (("--nodes", args.nodes), ("--ranks-per-node", args.ranks_per_node)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout:g} must be > 0 (seconds per layout)")
    grid = load_grid(args.grid)
    check_train_values(grid.train, f"{grid.source} [train]")
    for layout in grid.layouts:
        check_train_values(layout.extra, f"{grid.source} layout {layout.name}")
    overrides = train_overrides(args)
    check_train_values({k: v for k, v in overrides.items() if k not in TRAIN_FLAGS}, "--train-arg")
    train = {"comm_monitor": DEFAULT_MONITOR, **grid.train, **overrides}
    batch = shared_global_batch(grid.layouts, train)
    if batch is not None:
        train["global_batch"] = batch
        print(f"sweep: every layout trains a global batch of {batch} (the grid sets none; give "
              "global_batch in [train] or --global-batch to choose it)")
    check_out_dir(args.out, "--out")     # before namespaces are built or any layout runs
    read_status(args.out, warn=lambda _: None)   # an unreadable status file: said now
    rates = parse_rates(args.inter_node_mbit)
    if args.cluster == "slurm":
        from commpipe.cluster.slurm import SlurmOptions, write_scripts

        opts = SlurmOptions(account=args.account, qos=args.qos, time=args.time, constraint=args.constraint,
                            gpus_per_node=args.ranks_per_node, setup=args.setup)
        paths = write_scripts(grid.layouts, train, args.out, opts)
        print(f"wrote {len(paths) - 1} sbatch scripts; submit them with: bash {paths[-1]}")
        print(f"then: commpipe report {args.out}")
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    cluster = None
    try:
        with signals_interrupt():
            if nothing_to_run(grid, args.out, train, args.force, args.retry_failed):
                runner = None           # a finished sweep again: its records, no cluster built
            else:
                runner, cluster = make_runner(args.cluster, args.nodes, args.ranks_per_node, rates,
                                              args.timeout, out_dir=args.out)
            records = run_sweep(grid, args.out, runner, train, retry_failed=args.retry_failed,
                                force=args.force, progress=not args.no_progress)
    except (Interrupted, KeyboardInterrupt) as e:
        return said_stopped(e, args.out)
    finally:
        if cluster is not None:
            cluster.teardown()
    ok = sum(r["status"] == "ok" for r in records)
    print(f"{ok}/{len(records)} layouts ok; results in {args.out}/{STATUS_FILE}")
    if args.report:
        from commpipe.report.cli import write_report

        out = write_report(args.out)        # the table `commpipe report` prints, and its files
        print(out["terminal"])
        print(f"\nwrote {out['csv']}, {out['markdown_path']}, {out['html']} ({len(out['figures'])} figures)")
    return 0 if ok else 1


def said_stopped(e: BaseException, out) -> int:
    """The console's word on a sweep stopped by SIGTERM or SIGINT (`Interrupted` or Python's
    KeyboardInterrupt), and the exit status a shell reads for that signal."""
    signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
    print(f"\n{signal.Signals(signum).name}: the sweep stopped; the layout in progress is recorded as "
          f"interrupted. Run the same command again to resume (results so far in "
          f"{out}/{STATUS_FILE})", file=sys.stderr)
    return 128 + signum


def run_demo_sweep(out_dir, nodes: int = 4, ranks_per_node: int = 2, inter_node_mbit: float | None = 50.0,
                   steps: int = 10, seq_len: int = 32, cluster: str = "auto", progress: bool = True,
                   timeout_s: float = 240.0, log=print) -> tuple[str, Path]:
    """The demo8 grid with a tiny model on an emulated 4-node x 2-rank cluster with 50 Mbit/s
    inter-node links (loopback when namespaces are unavailable), then the report. Returns
    (markdown table, report.html path). About 4-5 minutes on 2 cores (`commpipe demo`)."""
    from commpipe.cluster.grids import demo8
    from commpipe.report.cli import write_report

    grid = demo8()
    # every call timed, so each layout's timeline shows all of its communication
    train = {"steps": steps, "seq_len": seq_len, "trace": True,
             "comm_monitor": "all"}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    runner, emu = make_runner(cluster, nodes, ranks_per_node, inter_node_mbit, timeout_s, log=log,
                              out_dir=out_dir)
    try:
        run_sweep(grid, out_dir, runner, train, progress=progress, log=log)
    finally:
        if emu is not None:
            emu.teardown()
    written = write_report(out_dir)
    return written["markdown"], Path(written["html"])
