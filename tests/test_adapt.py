"""Adaptive training, multi-rank: switching in memory, the slow-rank drill with its trial phase,
the relaunch fallback (the pure parts are in tests/test_adapt_logic.py).

    python -m pytest tests/test_adapt.py -q

The multi-rank part is one launch of 4 gloo processes: a run that switches pp4 -> tp2 pp2 (a
new layout, resharded in memory) -> stage re-split 2,2 -> 3,1 must hold bit-identical
parameters and optimizer states across each switch and produce the losses of a run that never
switched; then `train --adapt` with the --slow-rank drill on pp2 x dp2 must move layers off the
slow rank's stage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from commpipe.adapt.config import AdaptConfig, SlowRank
from commpipe.layout import Layout
from tests.dist_harness import spawn

# -- switching in memory (4 processes) -------------------------------------------------------------

TINY = dict(model="tiny", seq_len=16, global_batch=8, micro_batch_size=1, seed=3)
STEPS = 60   # the slow-rank run


def _cfg(**kw):
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import OptimConfig, TrainConfig

    dims = ParallelDims(**{k: kw.pop(k) for k in ("tp", "cp", "pp", "dp") if k in kw})
    return TrainConfig(dims=dims, optim=OptimConfig(warmup_steps=1), **(TINY | kw))


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank: int, world: int, outdir: str) -> dict:
    from commpipe.adapt.switch import gather_state, held_state, switch
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer, train

    res: dict = {}
    ref_cfg = _cfg(pp=4, steps=15).resolve(world)
    ref = Trainer.build(ref_cfg, Comm(ref_cfg.dims, rank))
    res["ref"] = [ref.train_step()["loss"] for _ in range(15)]

    cfg = _cfg(pp=4, steps=15).resolve(world)
    tr = Trainer.build(cfg, Comm(cfg.dims, rank))
    losses = [tr.train_step()["loss"] for _ in range(3)]
    kept = []
    for plan in (Layout(tp=2, cp=1, pp=2, dp=1, stage_layers=(2, 2), schedule="1f1b", microbatches=8,
                        micro_batch_size=1),      # new layout: reshard
                 Layout(tp=2, cp=1, pp=2, dp=1, stage_layers=(3, 1), schedule="1f1b", microbatches=8,
                        micro_batch_size=1),      # same layout: re-split
                 Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(3, 1), schedule="1f1b", microbatches=4,
                        micro_batch_size=1),      # TP -> DP replicas
                 # re-placement: the same degrees, stages on ranks {0, 1} and {2, 3}
                 Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(3, 1), schedule="1f1b", microbatches=4,
                        micro_batch_size=1, order="tp-cp-pp-dp")):
        before = gather_state(tr)
        tr, seconds = switch(tr, plan)
        after = gather_state(tr)
        # what this rank holds now (full tensors), against the state before the switch
        mine = held_state(tr)
        own_ok = all(torch.equal(v, before[k]) for k, v in mine.items())
        with_optim = sum(k.endswith(".exp_avg") for k in mine)
        kept.append((_equal_states(before, after), len(before), seconds,
                     str(tr.cfg.dims), tr.cfg.stage_layers, tr.step,
                     own_ok, with_optim == len(tr.named_params)))
        losses += [tr.train_step()["loss"] for _ in range(3)]
    res["switched"], res["kept"] = losses, kept

    # ZeRO-1: optimizer states live on their owner DP rank only, and owners change
    zcfg = _cfg(pp=2, dp=2, steps=8).resolve(world)
    zcfg.optim.zero1 = True
    zref = Trainer.build(zcfg, Comm(zcfg.dims, rank))
    res["zero_ref"] = [zref.train_step()["loss"] for _ in range(8)]
    zcfg = _cfg(pp=2, dp=2, steps=8).resolve(world)
    zcfg.optim.zero1 = True
    tr = Trainer.build(zcfg, Comm(zcfg.dims, rank))
    zl = [tr.train_step()["loss"] for _ in range(4)]
    tr, _ = switch(tr, Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                              micro_batch_size=1))
    res["zero_switched"] = zl + [tr.train_step()["loss"] for _ in range(4)]

    # a planted bug: a switch that drops the AdamW states must show in the losses
    import commpipe.adapt.switch as sw

    def lossy(new, state, _load=sw.load_state):
        _load(new, {k: v for k, v in state.items() if not k.startswith("optim.")})

    cfg = _cfg(pp=4, steps=15).resolve(world)
    tr = Trainer.build(cfg, Comm(cfg.dims, rank))
    planted = [tr.train_step()["loss"] for _ in range(3)]
    sw.load_state, kept_load = lossy, sw.load_state
    try:
        tr, _ = switch(tr, Layout(tp=2, cp=1, pp=2, dp=1, stage_layers=(2, 2), schedule="1f1b",
                                  microbatches=8, micro_batch_size=1))
    finally:
        sw.load_state = kept_load
    res["planted"] = planted + [tr.train_step()["loss"] for _ in range(3)]

    # the drill: rank 2 (pp stage 1, dp 0) computes 6x slower from step 6 on. Re-splits
    # only: the 4 ranks share 2 cores, which layout candidates (one device per rank) ignore
    out = Path(outdir) / "slow"
    scfg = _cfg(pp=2, dp=2, steps=STEPS, seq_len=64, out=str(out),
                slow_rank=SlowRank(2, 6.0, 6),
                adapt=AdaptConfig(min_steps=4, baseline_steps=3, layouts=False,
                                  rebalance=False))
    scfg.resolve(world)
    train(scfg, Comm(scfg.dims, rank), log=None)
    return res


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapt")
    per_rank = spawn(_worker, 4, str(tmp))
    decisions = [json.loads(x) for x in (tmp / "slow" / "adapt.jsonl").read_text()
                 .splitlines()]
    metrics = [json.loads(x) for x in (tmp / "slow" / "metrics.jsonl").read_text()
               .splitlines()]
    monitored = {r: {json.loads(x)["step"] for x in
                     (tmp / "slow" / "monitor" / f"rank{r}.jsonl").read_text().splitlines()}
                 for r in range(4)}
    return per_rank, decisions, metrics, monitored


@pytest.mark.slow
def test_in_memory_switches_keep_the_state_bit_for_bit_and_the_losses(four_ranks):
    per_rank, _, _, _ = four_ranks
    expect = [("tp2-cp1-pp2-dp1", [2, 2], 3), ("tp2-cp1-pp2-dp1", [3, 1], 6),
              ("tp1-cp1-pp2-dp2", [3, 1], 9), ("tp1-cp1-pp2-dp2 ranks tp-cp-pp-dp", [3, 1], 12)]
    for r in per_rank:
        sizes = set()
        for (ok, n, seconds, dims, split, step, own_ok, all_optim), want in zip(r["kept"], expect):
            assert ok, "parameters or optimizer states changed across a switch"
            assert own_ok and all_optim, "a rank holds a changed or missing state after a switch"
            assert (dims, split, step) == want and seconds > 0
            sizes.add(n)
        # parameters and their exp_avg, exp_avg_sq and step: 4 tensors each, every time
        assert len(sizes) == 1 and sizes.pop() % 4 == 0
    ref, switched = per_rank[0]["ref"], per_rank[0]["switched"]
    assert len(switched) == 15
    for step, (a, b) in enumerate(zip(ref, switched)):
        assert abs(a - b) <= 1e-5, f"step {step}: {a} (never switched) vs {b}"
    assert ref[3:] != ref[:6]      # the losses do move: the comparison is not vacuous
    # the comparison catches a switch that loses the optimizer state
    planted = per_rank[0]["planted"]
    assert planted[:4] == pytest.approx(ref[:4], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(ref[4:6], planted[4:6])) > 1e-5
    zref, zsw = per_rank[0]["zero_ref"], per_rank[0]["zero_switched"]
    assert len(zsw) == 8 and max(abs(a - b) for a, b in zip(zref, zsw)) <= 1e-5


@pytest.mark.slow
def test_slow_rank_drill_moves_layers_off_the_slow_stage(four_ranks):
    _, decisions, metrics, monitored = four_ranks
    switches = [d for d in decisions if d["action"] == "switch"]
    assert switches, f"no switch; decisions: {[d['reason'] for d in decisions]}"
    first = switches[0]
    # each step's summaries are read after the next step (AdaptConfig.lagged): the switch
    # acted after the step following the one whose signals confirmed the change
    assert first["step"] == max(x["step"] for x in first["detections"]) + 1
    # the summary in flight at each switch and at the end was read first: every rank's
    # monitor wrote records of every step, across the switches and trials
    assert all(steps == set(range(STEPS)) for steps in monitored.values()), \
        {r: sorted(set(range(STEPS)) - s) for r, s in monitored.items()}
    # a change confirmed after the drill started triggered it, and the recalibrated model
    # blames rank 2 (four ranks share two cores: one rank's sleeps speed up the others, so the
    # first confirmed change may be another rank's or a collective's)
    assert all(x["onset_step"] >= 6 - 1 for x in first["detections"]), first["detections"]
    slowdown = first["model"]["slowdown"]
    assert slowdown["2"] > 1.5 and slowdown["2"] == max(slowdown.values()), slowdown
    assert first["step"] >= 6 and first["kind"] == "resplit"
    # rank 2 holds pipeline stage 1: it must hold fewer layers afterwards
    assert first["from"]["stage_layers"] == [2, 2]
    assert first["to"]["stage_layers"][1] < 2
    assert first["switch_time_s"] > 0 and first["switch_cost_s"] > 0
    assert first["predicted_saving_s"] >= 2.0 * first["switch_cost_s"]
    # before the first step the controller timed gloo collective calls after compute and the
    # pass split (adapt/link_probe.measure_host), once: positive times in under a minute; the
    # first evaluation priced a call from them, below a second, and no later one again
    host = [d for d in decisions if d["action"] == "host"]
    assert len(host) == 1 and host[0] is decisions[0] and host[0]["step"] == -1, host
    assert set(host[0]["calls"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(0.0 < v["mean_ms"] < 1e3 for v in host[0]["calls"].values())
    assert host[0]["op_work"] > 0 and host[0]["calls_seconds"] + host[0]["op_work_seconds"] < 60
    evals = [d for d in decisions if d["action"] in ("switch", "stay")]
    timed = [d for d in evals if "call_ms" in (d.get("probed") or {})]
    assert timed and timed[0] is evals[0] and len(timed) == 1, [d.get("probed") for d in evals]
    assert 0.0 < timed[0]["probed"]["call_ms"] < 1e3
    # every rank runs on this machine: the calls timed by 2 of them are priced for all of them
    # on its cores (link_probe.host_sharing)
    import os

    share, probed = host[0]["sharing"], timed[0]["probed"]
    cores = len(os.sched_getaffinity(0))
    assert share == {"ranks": 4, "cores": cores, "timing_ranks": 2,
                     "factor": max(1.0, 4 / cores) / max(1.0, 2 / cores)}
    assert probed["call_ms"] == pytest.approx(probed["call_ms_alone"] * share["factor"])
    layouts = [m["layout"] for m in metrics]
    assert layouts[0].endswith("m4x1") and "layers 3,1" in layouts[-1]
    # the switch was confirmed by measurement: each trialled candidate ran its warm-up and 3
    # measured steps (the metrics say which layout ran them), then the fastest measured won.
    # A trial step's time is the slowest rank's, so never below the logging rank's own time of
    # that step in the metrics (the same measurement, one of those maximized over)
    # (the first round's trials: a later detection may start another round after its settle)
    settle = next(d for d in decisions if d["action"] == "settle")
    trials = [d for d in decisions
              if d["action"] == "trial" and first["step"] < d["step"] <= settle["step"]]
    # in the listed order, less those a measured trial showed could not win (`dropped`)
    dropped = {p for t in trials for p in t.get("dropped", [])}
    assert [t["plan"] for t in trials] == [t["plan"] for t in first["trials"]
                                          if t["plan"] not in dropped]
    assert not dropped & {t["plan"] for t in trials}
    for t in trials:
        assert len(t["steps_ms"]) == 3 and len(t["warmup_ms"]) == 1
        logged = [m["step_time_s"] * 1e3 for m in metrics if t["step"] - 3 < m["step"] <= t["step"]]
        assert len(logged) == 3 and all(a >= b for a, b in zip(t["steps_ms"], logged)), (t, logged)
        assert all(m["layout"] == t["plan"] for m in metrics if t["step"] - 4 < m["step"] <= t["step"])
    fastest = min(settle["measured"], key=lambda x: x["measured_ms"])
    assert settle["to"]["name"] == fastest["plan"] and settle["measured_ms"] == fastest["measured_ms"]
    # the phase's cost holds every switch it made: into the first trial (the decision's, > 0
    # above) and between trials (none when the first trial's measurement dropped the rest)
    between = sum(t.get("switch_time_s", 0) for t in trials)
    assert settle["trial_cost_s"] >= first["switch_time_s"] + between - 1e-9
    assert [m["step"] for m in metrics] == list(range(STEPS))   # each step once, in order
    # the settled plan is re-checked once, on its own steps, when its baselines are armed
    # (warm-up, then baseline_steps): an evaluation without a detection, from that plan
    rechecks = [d for d in decisions if d.get("recheck")]
    assert rechecks and not rechecks[0]["detections"]
    assert rechecks[0]["from"]["name"] == settle["to"]["name"]
    assert rechecks[0]["step"] > settle["step"] + AdaptConfig().warmup_steps


@pytest.mark.slow
def test_relaunch_fallback_continues_under_the_new_layout(tmp_path):
    """--adapt-relaunch: the first launch checkpoints and stops with a request; the same
    command again resumes from that checkpoint under the new stage split."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "commpipe", "train", "--pp", "2", "--seq-len", "64", "--steps", "24",
           "--adapt", "--adapt-relaunch", "--adapt-resplit-only", "--adapt-min-steps", "4",
           "--slow-rank", "1:8@6", "--out", str(out), "--log-every", "100"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0 and "run the same command again" in first.stdout + first.stderr
    request = json.loads((out / "adapt_relaunch.json").read_text())
    assert request["to"]["stage_layers"] == [3, 1]
    second = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed from {request['checkpoint']}" in second.stdout
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(24))
    switched = [m for m in metrics if m["step"] >= request["step"]]
    assert all("layers 3,1" in m["layout"] for m in switched)
    log = [json.loads(x) for x in (out / "adapt.jsonl").read_text().splitlines()]
    modes = [(d["action"], d.get("switch_mode")) for d in log]
    assert ("switch", "relaunch") in modes and ("relaunched", None) in modes
