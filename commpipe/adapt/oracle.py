"""The adaptive demo's oracle: the best *static* layout for the degraded network, found by
measurement, independently of the controller.

Every tp x cp x pp x dp layout of the world that the model and batch admit (x ep, every
expert-parallel size, for a Mixture-of-Experts model; for pp > 1 the even split of layers and,
where it differs, the split balancing the stages' matmul work; schedule 1f1b) trains from
step 0 under the degraded link for a few steps, all of them in one launch of the same processes
(one set of process groups per layout, as a fresh run builds them), so the candidates pay one
start-up instead of one each. The layout with the lowest
median step time is the oracle. A candidate whose median after `min_steps` steps is already
more than `cutoff` times the best so far stops early (it cannot win); candidates.json says so.
The fastest `repeat_best` are then trained again from step 0 and ranked on the median of both
passes: on a shared host a burst of other work during one pass can spoil it.

    python -m torch.distributed.run ... -m commpipe.adapt.oracle --plan OUT/oracle_plan.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
from pathlib import Path

WARMUP = 2          # steps left out of a candidate's median (allocation, first collectives)
STEPS = 10          # steps per candidate: a median of 8
MIN_STEPS = 4       # steps before a clearly slower candidate may stop
CUTOFF = 4.0        # ... when its median so far exceeds this multiple of the best median
REPEAT_BEST = 3     # the fastest this many are measured a second time, after all the others


def _factorizations(world: int):
    for tp, cp, pp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * cp * pp) == 0:
            yield tp, cp, pp, world // (tp * cp * pp)


def _config(flags: list[str]):
    from commpipe.train import cli as train_cli

    parser = argparse.ArgumentParser(exit_on_error=False)
    train_cli.add_arguments(parser)
    cfg = train_cli.config_from_args(parser.parse_args(flags))
    cfg.out = None
    return cfg


def balanced_split(spec, seq_len: int, pp: int) -> tuple[int, ...]:
    """Contiguous layers per stage minimising the largest stage's matmul work (the last stage
    also holds the head): what a pipeline on equal devices should run (--stage-layers auto)."""
    from commpipe.parallel.balance import balance, llama_layer_costs

    return tuple(balance(llama_layer_costs(spec, seq_len), pp))


def candidate_layouts(train: dict, world: int) -> tuple[list[dict], list[dict]]:
    """(candidates, rejected): each candidate {name, tp, cp, pp, dp, ep, stage_layers, split,
    flags}; each rejected layout with the reason `commpipe train` gives. A Mixture-of-Experts
    model's layouts come at every expert-parallel size their dp x cp ranks admit
    (commpipe.plan.moe.ep_choices); a dense model's at ep 1."""
    from commpipe.cluster.grids import Layout
    from commpipe.cluster.launch import train_flags
    from commpipe.plan.moe import ep_choices

    # the layout's own ep is each candidate's (a shared one would run every candidate at it)
    shared = {k: v for k, v in train.items() if k not in ("adapt", "out", "log_every", "ep")}
    found, rejected = [], []
    for tp, cp, pp, dp in _factorizations(world):
        base = Layout(tp=tp, cp=cp, pp=pp, dp=dp, schedule="1f1b" if pp > 1 else None)
        try:
            cfg = _config(train_flags(base, shared, "unused"))
            cfg.resolve(world)
        except (ValueError, argparse.ArgumentError) as e:
            rejected.append({"tp": tp, "cp": cp, "pp": pp, "dp": dp, "reason": str(e)})
            continue
        splits = [("whole", (cfg.spec.layers,))]
        if pp > 1:
            n = cfg.spec.layers
            even = tuple(n // pp + (1 if s < n % pp else 0) for s in range(pp))
            bal = balanced_split(cfg.spec, cfg.seq_len, pp)
            splits = [("even = balanced" if bal == even else "even", even)]
            if bal != even:
                splits.append(("balanced", bal))
        for (label, split), ep in itertools.product(splits, ep_choices(cfg.spec, dp * cp)):
            extra = {"stage_layers": ",".join(map(str, split))} if pp > 1 else {}
            lay = Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, schedule=base.schedule, extra=extra)
            flags = train_flags(lay, shared, "unused")
            try:
                c = _config(flags)
                c.resolve(world)
            except (ValueError, argparse.ArgumentError) as e:
                rejected.append({"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep,
                                 "stage_layers": list(split), "reason": str(e)})
                continue
            name = lay.name + ("" if label != "balanced" else "-bal") + (f"-ep{ep}" if ep > 1 else "")
            found.append({"name": name, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep,
                          "stage_layers": list(split), "split": label, "schedule": c.schedule,
                          "microbatches": c.microbatches,
                          "micro_batch_size": c.micro_batch_size, "flags": flags})
    # fewest ranks replicating the model across nodes first: a good early best to stop against
    found.sort(key=lambda c: (c["dp"], c["tp"], c["cp"]))
    return found, rejected


# -- in the launched processes ---------------------------------------------------------------------
def _measure(plan: dict) -> None:
    from commpipe.parallel.comm import shutdown_distributed
    from commpipe.parallel.world import init_distributed

    rank, world = init_distributed()
    out = Path(plan["out"])
    medians: dict[str, float] = {}
    try:
        for cand in plan["candidates"]:                 # pass 1: every layout
            best = min(medians.values(), default=None)
            medians[cand["name"]] = _train_candidate(cand, plan, rank, world, best,
                                                     out / "candidates" / f"{cand['name']}.jsonl")
        # pass 2: the fastest few again, later (a load burst on a shared host can spoil one
        # pass); the medians the ranks computed are the same, so is this choice
        again = sorted(medians, key=medians.get)[:plan["repeat_best"]]
        for cand in plan["candidates"]:
            if cand["name"] in again:
                _train_candidate(cand, plan, rank, world, None,
                                 out / "candidates" / f"{cand['name']}.pass2.jsonl")
    finally:
        shutdown_distributed()


def _train_candidate(cand: dict, plan: dict, rank: int, world: int, best, path: Path) -> float:
    """Train one layout from step 0 for plan["steps"] steps (fewer when it is clearly slower
    than `best`); the logging rank writes its rows to `path`. Returns the median of the
    slowest rank's step times after the warm-up."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    steps, warm = plan["steps"], plan["warmup"]
    cfg = _config(cand["flags"])     # the run's --steps: the same LR schedule
    cfg.resolve(world)
    trainer = Trainer.build(cfg, Comm(cfg.dims, rank))
    rows, stopped = [], False
    for i in range(steps):
        rec = trainer.train_step()
        # decide on the slowest rank's time: every rank sees the same numbers and stops
        # alike; rows keep the logging rank's own time, as metrics.jsonl does
        rec["step_time_max_s"] = trainer.comm.all_reduce_scalars([rec["step_time_s"]],
                                                                 op="max")[0]
        rows.append(rec)
        timed = [r["step_time_max_s"] for r in rows[warm:]]
        if (best is not None and i + 1 >= plan["min_steps"] and i + 1 < steps
                and statistics.median(timed) > plan["cutoff"] * best):
            stopped = True
            break
    med = statistics.median(r["step_time_max_s"] for r in rows[warm:])
    if trainer.is_logger:
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"oracle candidate {path.name}: median {med * 1e3:.0f} ms over "
              f"{len(rows) - warm} steps" + (" (stopped early)" if stopped else ""), flush=True)
    del trainer
    gc.collect()
    return med


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commpipe.adapt.oracle")
    p.add_argument("--plan", required=True, help="the JSON written by run_oracle")
    args = p.parse_args(argv)
    _measure(json.loads(Path(args.plan).read_text()))
    return 0


# -- in the demo's process -------------------------------------------------------------------------
def run_oracle(cluster, train: dict, out_dir, port: int, *, steps: int = STEPS, warmup: int = WARMUP,
               min_steps: int = MIN_STEPS, cutoff: float = CUTOFF, repeat_best: int = REPEAT_BEST,
               log=print, extra: list[dict] = (),
               timeout_s: float = 400.0) -> dict:
    """Measure every candidate on `cluster` as it is now (degrade it first); write
    OUT/candidates.json, OUT/candidates/NAME.jsonl and the best candidate's rows as
    OUT/metrics.jsonl. `extra`: candidates beyond the even and balanced splits (each as
    `candidate_layouts` builds one, with its own name), e.g. the split that takes layers off a
    slow rank. Returns the contents of candidates.json."""
    from commpipe.cluster.launch import NodeCommand, run_commands, torchrun

    out = Path(out_dir).resolve()
    (out / "candidates").mkdir(parents=True, exist_ok=True)
    world = cluster.nodes * cluster.ranks_per_node
    found, rejected = candidate_layouts(train, world)
    found = found + list(extra)
    if not found:
        raise RuntimeError(f"no static layout of {world} ranks admits this model: {rejected}")
    plan = {"out": str(out), "steps": steps, "warmup": warmup, "min_steps": min_steps,
            "cutoff": cutoff, "repeat_best": repeat_best, "candidates": found}
    (out / "oracle_plan.json").write_text(json.dumps(plan, indent=1))
    env = {"GLOO_SOCKET_IFNAME": cluster.ifname} if cluster.ifname else {}
    cmds = [NodeCommand(i, torchrun("--nnodes", str(cluster.nodes), "--nproc-per-node",
                                    str(cluster.ranks_per_node), "--node-rank", str(i),
                                    "--master-addr", cluster.node_ip(0), "--master-port", str(port),
                                    "-m", "commpipe.adapt.oracle", "--plan",
                                    str(out / "oracle_plan.json")), env, f"node{i}.log")
            for i in range(cluster.nodes)]
    log(f"oracle: {len(found)} static layouts of {world} ranks under the degraded link from "
        f"step 0, {steps} steps each (median of the last {steps - warmup}), one launch")
    result = run_commands(cmds, out, cluster=cluster, timeout_s=timeout_s)
    if not result.ok:
        raise RuntimeError(f"oracle sweep {result.status}: {result.reason}")
    measured = []
    for cand in found:
        path = out / "candidates" / f"{cand['name']}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        ms = [r["step_time_s"] * 1e3 for r in rows]
        again = path.with_suffix(".pass2.jsonl")
        rows2 = [json.loads(x) for x in again.read_text().splitlines() if x.strip()] \
            if again.exists() else []
        ms2 = [r["step_time_s"] * 1e3 for r in rows2]
        timed = ms[warmup:] + ms2[warmup:]          # the median over both passes
        measured.append({k: v for k, v in cand.items() if k != "flags"}
                        | {"step_ms": ms, "step_ms_pass2": ms2, "median_ms": statistics.median(timed),
                           "steps_measured": len(timed), "stopped_early": len(ms) < steps,
                           "losses": [r["loss"] for r in rows],
                           "losses_pass2": [r["loss"] for r in rows2]})
    measured.sort(key=lambda c: c["median_ms"])
    best = measured[0]
    rows = (out / "candidates" / f"{best['name']}.jsonl").read_text()
    (out / "metrics.jsonl").write_text(rows)
    record = {"best": {k: best[k] for k in ("name", "tp", "cp", "pp", "dp", "stage_layers",
                                            "schedule", "microbatches", "micro_batch_size",
                                            "median_ms")},
              "steps": steps, "warmup": warmup, "min_steps": min_steps, "cutoff": cutoff,
              "sweep_s": result.elapsed_s, "candidates": measured, "rejected": rejected}
    (out / "candidates.json").write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    sys.exit(main())
