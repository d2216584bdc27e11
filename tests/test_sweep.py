"""Grids and the sweep loop: parsing, presets, resume, failures recorded, one real end-to-end run.

Most tests inject a small runner that starts a real subprocess writing a metrics file (through
the same run_commands path real layouts take), so they do not train models.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

import pytest

from commpipe.cluster import netns
from commpipe.cluster.grids import DEFAULT_ORDER, STUDY_LAYOUTS, Grid, Layout, demo8, load_grid, study
from commpipe.cluster.launch import NodeCommand, run_commands, train_flags
from commpipe.cluster.sweep import (
    EmulatedRunner,
    LocalRunner,
    read_status,
    run_sweep,
    train_overrides,
    validate_layout,
)

# the reference data lives beside the repository, in ../shared/data
STUDY_CSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "study_perlmutter_llama8b.csv"

FAKE_TRAIN = """
import json, pathlib, sys, time
out, steps, fail = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out.mkdir(parents=True, exist_ok=True)
if fail == "crash":
    print("Traceback (most recent call last):", flush=True)
    print("ValueError: stage 3 ran out of layers", flush=True)
    sys.exit(1)
if fail == "hang":
    time.sleep(60)
with open(out / "metrics.jsonl", "w") as f:
    for s in range(steps):
        f.write(json.dumps({"step": s, "loss": 5.0 - s, "step_time_s": 0.1, "tokens_per_s": 100.0,
                            "tflops_per_gpu": 1.0}) + "\\n")
"""


class FakeRunner:
    """Runs FAKE_TRAIN as a real process; layouts named *crash* or *hang* misbehave. Only the
    hanging one runs under `timeout_s`: the others get at least a minute, so that a slow
    start-up on a loaded host is never taken for a hang."""

    kind = "fake"

    def __init__(self, timeout_s=30.0):
        self.calls, self.timeout_s = [], timeout_s

    def describe(self):
        return {"kind": self.kind}

    def __call__(self, layout, train, run_dir, poll=None):
        self.calls.append(layout.name)
        mode = "crash" if "crash" in layout.name else "hang" if "hang" in layout.name else "ok"
        argv = [sys.executable, "-c", FAKE_TRAIN, str(run_dir), str(train.get("steps", 3)), mode]
        cmd = NodeCommand(0, argv)
        timeout_s = self.timeout_s if mode == "hang" else max(self.timeout_s, 60.0)
        return run_commands([cmd], run_dir, timeout_s=timeout_s, poll=poll)


def _grid(*layouts, **train) -> Grid:
    return Grid(list(layouts), {"model": "tiny", "seq_len": 32, "steps": 3, **train})


# -- grids ----------------------------------------------------------------------------------------
def test_grid_toml(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('[train]\npreset = "tiny"\nsteps = 4\n\n[[layout]]\ntp = 2\npp = 2\n\n'
                    '[[layout]]\nname = "deep"\npp = 4\nschedule = "gpipe"\nmicrobatches = 8\n'
                    'placement = "cp-dp-pp-tp"\n')
    grid = load_grid(str(path))
    a, b = grid.layouts
    assert (a.tp, a.cp, a.pp, a.dp, a.world_size) == (2, 1, 2, 1, 4)        # missing degrees are 1
    assert a.name == "tp2-cp1-pp2-dp1" and a.placement == DEFAULT_ORDER
    assert (b.name, b.schedule, b.microbatches, b.world_size) == ("deep", "gpipe", 8, 4)
    assert grid.train == {"preset": "tiny", "steps": 4}
    assert b.train_flags() == ["--tp", "1", "--cp", "1", "--pp", "4", "--dp", "1", "--schedule", "gpipe",
                               "--microbatches", "8"]
    # a layout built with an expert-parallel size passes it on (the adaptive demo's start layout),
    # once, whatever the shared flags say
    moe = Layout(dp=4, ep=2)
    argv = train_flags(moe, {"ep": 4, "steps": 3}, "/o")
    assert argv[argv.index("--ep") + 1] == "2" and argv.count("--ep") == 1
    assert Layout(dp=4, ep=2, extra={"ep": 2}).ep == 2
    with pytest.raises(ValueError, match="expert parallelism given twice"):
        Layout(dp=4, ep=2, extra={"ep": 4})


@pytest.mark.parametrize("text, message", [
    ("[[layout]]\ntp = 2\n[[layout]]\ntp = 2\n", "two layouts are named"),
    ("[[layout]]\ntp = 0\n", "tp=0 must be a positive integer"),
    ("[[layout]]\ntp = 'two'\n", "must be an integer"),
    ("[[layout]]\ntp = 2\nplacement = 'tp-pp'\n", "must name tp, cp, dp and pp"),
    ("[[layout]\n", "malformed TOML"),
    ("[train]\nsteps = 1\n", "no [[layout]] tables"),
    ("[[layouts]]\ntp = 1\n", "unknown top-level keys"),
])
def test_grid_errors_say_what_to_change(tmp_path, text, message):
    path = tmp_path / "g.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_grid(str(path))


def test_layouts_left_to_their_own_batch_share_one(tmp_path):
    """Alone, train gives pp2 x dp2 2*2 micro-batches on 2 replicas (8), tp2 x pp2 4 and pp4 8;
    the sweep gives all three 8, the smallest common multiple of their micro-batch x dp at
    least that large; dp3 and dp2 at micro-batch 2: lcm(6, 4) = 12 >= 2 * 6. A batch set
    anywhere (shared, a layout's microbatches, a config file) is left alone."""
    from commpipe.cluster.grids import shared_global_batch

    three = [Layout(pp=2, dp=2), Layout(tp=2, pp=2), Layout(pp=4)]
    assert shared_global_batch(three, {}) == 8
    assert shared_global_batch([Layout(dp=3), Layout(dp=2)], {"micro_batch_size": 2}) == 12
    assert shared_global_batch(study().layouts, study().train) == 32
    assert shared_global_batch(three, {"microbatches": 4}) is None
    assert shared_global_batch(three + [Layout(dp=2, microbatches=2)], {}) is None
    assert shared_global_batch(demo8().layouts, demo8().train) is None
    job = tmp_path / "job.toml"
    job.write_text("[training]\nglobal_batch = 16\n")
    assert shared_global_batch(three, {"config": str(job)}) is None
    job.write_text("[training]\nseq_len = 16\n")
    assert shared_global_batch(three, {"config": str(job)}) == 8


@pytest.mark.parametrize("where, text, message", [
    ("[train]", "[train]\nstepz = 2\n\n[[layout]]\ntp = 1\n", "stepz is not a flag of commpipe "
     "train; did you mean steps"),
    ("layout tp1-cp1-pp1-dp1", "[[layout]]\ntp = 1\nscheduel = 'gpipe'\n", "scheduel is not a flag "
     "of commpipe train; did you mean schedule"),
    ("[train]", "[train]\nwhatever = 1\n\n[[layout]]\ntp = 1\n", "without their dashes"),
])
def test_a_key_train_does_not_know_fails_when_the_grid_loads(tmp_path, where, text, message):
    from commpipe.cluster.grids import check_train_values

    path = tmp_path / "g.toml"
    path.write_text(text)
    grid = load_grid(str(path))
    with pytest.raises(ValueError, match=message) as e:
        for flags, at in [(grid.train, "[train]")] + [(lay.extra, f"layout {lay.name}")
                                                       for lay in grid.layouts]:
            check_train_values(flags, f"{path} {at}")
    assert f"{path} {where}: " in str(e.value)


def test_missing_grid_file():
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_grid("no-such-grid.toml")


def test_study_preset_matches_the_study_csv():
    assert [(lay.tp, lay.cp, lay.pp, lay.dp) for lay in study().layouts] == STUDY_LAYOUTS
    assert all(lay.world_size == 16 for lay in study().layouts)
    if not STUDY_CSV.exists():
        pytest.skip(f"{STUDY_CSV} not present")
    with open(STUDY_CSV) as f:
        rows = [(int(r["tp"]), int(r["cp"]), int(r["pp"]), int(r["dp"])) for r in csv.DictReader(f)]
    assert rows == STUDY_LAYOUTS


def test_demo8_is_valid_for_train_on_8_ranks():
    grid = demo8()
    assert len(grid.layouts) == 8 and {lay.world_size for lay in grid.layouts} == {8}
    assert {lay.pp for lay in grid.layouts} >= {2, 4, 8}
    assert any(lay.cp > 1 for lay in grid.layouts) and any(lay.dp > 1 for lay in grid.layouts)
    assert any(lay.placement != DEFAULT_ORDER for lay in grid.layouts)      # TP across nodes
    pytest.importorskip("commpipe.train.cli")
    for lay in grid.layouts:
        assert validate_layout(lay, grid.train) is None, lay.name


def test_one_layout_for_the_planner_and_the_sweep():
    from commpipe.layout import Layout as Shared
    from commpipe.plan.layout import Layout as Planned

    assert Layout is Shared is Planned
    # a grid entry that names no schedule: 1f1b for whoever reads it, but unpinned, so the
    # sweep's own --schedule (or [train] schedule) reaches `commpipe train`
    a = Layout(tp=2, pp=2)
    assert (a.schedule, a.vpp, a.name) == ("1f1b", 1, "tp2-cp1-pp2-dp1")
    assert a.train_flags() == ["--tp", "2", "--cp", "1", "--pp", "2", "--dp", "1"]
    assert a.grid_dict()["schedule"] is None and a.grid_dict()["world_size"] == 4
    flags = train_flags(a, {"schedule": "gpipe"}, "out")
    assert flags[flags.index("--schedule") + 1] == "gpipe"
    # a V schedule brings its two chunks per rank; pinned, it wins over the sweep's default
    b = Layout(tp=2, pp=2, schedule="stp")
    assert (b.vpp, b.name) == (2, "tp2-cp1-pp2-dp1-stp")
    flags = train_flags(b, {"schedule": "gpipe"}, "out")
    assert flags.count("--schedule") == 1 and flags[flags.index("--schedule") + 1] == "stp"
    # the planner's positional form and its JSON keys
    p = Layout(2, 1, 2, 1, 2, 1, "zbv", "selective", 1)
    assert p.to_dict() == dict(tp=2, cp=1, pp=2, dp=1, vpp=2, micro_batch_size=1, schedule="zbv",
                               recompute="selective", zero=1, dp_shard=0)
    assert p.gpus == p.world_size == 4 and p.dims.pp == 2


def test_grid_schedules_include_the_braided_ones():
    from commpipe.cluster.grids import layouts_from_dicts

    with pytest.raises(ValueError, match="unknown schedule 'zb-v'.*stp, dualpipev"):
        layouts_from_dicts([{"pp": 2, "schedule": "zb-v"}])
    train = {"model": "tiny", "seq_len": 64, "microbatches": 4}
    for sched in ("stp", "dualpipev"):
        lay, = layouts_from_dicts([{"tp": 2, "pp": 2, "schedule": sched}])
        assert validate_layout(lay, train) is None, sched
    lay, = layouts_from_dicts([{"pp": 2, "schedule": "stp", "microbatches": 3}])
    assert "microbatches >= 2*pp = 4" in validate_layout(lay, {"model": "tiny"})


def test_validate_layout_uses_train_rules():
    pytest.importorskip("commpipe.train.cli")
    assert "does not divide 4 attention heads" in validate_layout(Layout(tp=3), {"model": "tiny"})
    assert "exceeds the model's 4 layers" in validate_layout(Layout(pp=8), {"model": "tiny"})
    assert "does not know" in validate_layout(Layout(), {"no_such_flag": 1})


def test_layout_settings_win_over_shared_flags():
    from commpipe.cluster.launch import train_flags

    layout = Layout(pp=2, schedule="gpipe", extra={"seed": 7})
    flags = train_flags(layout, {"schedule": "1f1b", "seed": 1, "steps": 2, "trace": True, "tp": 4}, "/o")
    assert flags == ["--tp", "1", "--cp", "1", "--pp", "2", "--dp", "1", "--schedule", "gpipe",
                     "--seed", "7", "--steps", "2", "--trace", "--out", "/o"]
    # a layout that names no schedule takes the shared one
    assert "1f1b" in train_flags(Layout(pp=2), {"schedule": "1f1b"}, "/o")


def test_train_overrides_parse_extra_flags():
    class Args:
        model, steps, train_arg = "tiny", 3, ["zero1=true", "lr=0.01"]

    got = train_overrides(Args)
    assert got["model"] == "tiny" and got["steps"] == 3 and got["zero1"] is True and got["lr"] == "0.01"


# -- the sweep loop -------------------------------------------------------------------------------
def test_sweep_records_results_and_resumes(tmp_path):
    grid = _grid(Layout(tp=2, pp=2), Layout(dp=2, name="dp2"))
    runner = FakeRunner()
    recs = run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)
    assert [r["status"] for r in recs] == ["ok", "ok"] and runner.calls == ["tp2-cp1-pp2-dp1", "dp2"]
    lines = (tmp_path / "tp2-cp1-pp2-dp1" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert (tmp_path / "dp2" / "logs" / "node0.log").exists()
    # the same sweep again: nothing runs, and `commpipe sweep` builds no cluster for it
    from commpipe.cluster.sweep import nothing_to_run

    assert nothing_to_run(grid, tmp_path, {}) and not nothing_to_run(grid, tmp_path, {"steps": 2})
    assert not nothing_to_run(grid, tmp_path, {}, force=True)
    again = run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)
    assert runner.calls == ["tp2-cp1-pp2-dp1", "dp2"] and [r["status"] for r in again] == ["ok", "ok"]
    # other training settings: the layouts run again, into emptied folders
    run_sweep(grid, tmp_path, runner, {"steps": 2}, progress=False, log=lambda *_: None)
    assert runner.calls[2:] == ["tp2-cp1-pp2-dp1", "dp2"]
    assert len((tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()) == 2
    status = read_status(tmp_path)
    assert status["dp2"]["train"]["steps"] == 2
    assert len((tmp_path / "sweep.jsonl").read_text().splitlines()) == 4


def test_a_sweep_without_a_live_bar_says_now_and_then_that_a_layout_runs(tmp_path, monkeypatch):
    """Piped or logged (no terminal for the bar), a layout that runs long gets a "running" line
    every QUIET_PROGRESS_S (30 s) of its time, each layout counting from its own start."""
    import io

    from commpipe.cluster.launch import RunResult

    monkeypatch.setattr(sys, "stderr", io.StringIO())       # not a terminal, also under -s

    def runner(layout, train, run_dir, poll):
        for elapsed in (0.5, 10.0, 31.0, 45.0, 62.0):
            poll(elapsed)
        return RunResult("ok", "", 0, 62.0)

    said = []
    run_sweep(_grid(Layout(pp=2, name="a"), Layout(dp=2, name="b")), tmp_path, runner,
              progress=True, log=said.append)
    running = [x for x in said if ": running," in x]
    assert [x.split(":")[0] for x in running] == ["[1/2] a", "[1/2] a", "[2/2] b", "[2/2] b"]
    assert running[0].endswith("31 s") and running[1].endswith("62 s")
    said.clear()
    run_sweep(_grid(Layout(pp=2, name="c")), tmp_path, runner, progress=False, log=said.append)
    assert not [x for x in said if ": running," in x]          # --no-progress: quiet


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path):
    grid = _grid(Layout(tp=3, name="bad-tp3"), Layout(pp=2, name="crash"), Layout(pp=2, name="hang"),
                 Layout(pp=2, name="fine"))
    runner = FakeRunner(timeout_s=2.0)
    recs = {r["name"]: r for r in run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)}
    assert recs["bad-tp3"]["status"] == "invalid" and "attention heads" in recs["bad-tp3"]["reason"]
    assert recs["crash"]["status"] == "failed"
    assert recs["crash"]["reason"] == "ValueError: stage 3 ran out of layers"
    assert recs["hang"]["status"] == "timeout" and "timeout after 2 s" in recs["hang"]["reason"]
    assert recs["fine"]["status"] == "ok"
    assert runner.calls == ["crash", "hang", "fine"]           # the invalid one never launched
    # failures are skipped on a rerun unless asked
    run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)
    assert runner.calls == ["crash", "hang", "fine"]
    runner.timeout_s = 1.0
    run_sweep(grid, tmp_path, runner, retry_failed=True, progress=False, log=lambda *_: None)
    assert runner.calls[3:] == ["crash", "hang"]


def test_emulated_runner_refuses_layouts_larger_than_the_cluster():
    class Cluster:
        nodes, ranks_per_node = 2, 2

    with pytest.raises(ValueError, match="cluster has 2 nodes"):
        EmulatedRunner(Cluster()).check(Layout(pp=8))


# -- end to end with the real trainer -------------------------------------------------------------
@pytest.mark.slow
def test_real_sweep_end_to_end(tmp_path):
    pytest.importorskip("commpipe.train.loop")
    from commpipe.report.cli import write_report

    grid = Grid([Layout(tp=2, pp=2), Layout(tp=2, pp=2, placement="cp-dp-pp-tp", name="tp2x-pp2")],
                {"model": "tiny", "seq_len": 16, "steps": 2, "comm_monitor": "all", "trace": True})
    ok, _ = netns.available()
    cluster = netns.EmulatedCluster(2, 2, 200, prefix=f"te{os.getpid() % 10000}") if ok else None
    try:
        runner = EmulatedRunner(cluster.up(), timeout_s=240) if cluster else LocalRunner(timeout_s=240)
        recs = run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)
    finally:
        if cluster:
            cluster.teardown()
    assert [r["status"] for r in recs] == ["ok", "ok"], [r["reason"] for r in recs]
    losses = []
    for name in ("tp2-cp1-pp2-dp1", "tp2x-pp2"):
        metrics = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [0, 1]
        losses.append([m["loss"] for m in metrics])
        assert len(list((tmp_path / name / "monitor").glob("rank*.jsonl"))) == 4
    # placement moves ranks between nodes, never changes the math
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    out = write_report(tmp_path)
    assert Path(out["html"]).exists() and len(out["rows"]) == 2


@pytest.mark.slow
def test_blip_sweep_and_report(tmp_path):
    """A grid with model = "blip-tiny" runs (2 local ranks, PP2 ZB-H1) and reports: TFLOP/s from
    BLIP's FLOPs per image-caption pair, a bubble from the trace, PP bandwidth from the monitor,
    and losses equal to one process training the same configuration."""
    pytest.importorskip("commpipe.train.loop")
    from commpipe.models.blip_spec import flops_per_sample
    from commpipe.parallel.comm import Comm
    from commpipe.report.cli import write_report
    from commpipe.train import cli as train_cli
    from commpipe.train.loop import Trainer

    path = tmp_path / "blip.toml"
    path.write_text('[train]\nmodel = "blip-tiny"\nsteps = 2\nglobal_batch = 4\ncomm_monitor = "all"\n'
                    'trace = true\n\n[[layout]]\npp = 2\nschedule = "zbh1"\n')
    grid = load_grid(str(path))
    recs = run_sweep(grid, tmp_path, LocalRunner(timeout_s=240), progress=False, log=lambda *_: None)
    assert [r["status"] for r in recs] == ["ok"], [r["reason"] for r in recs]
    metrics = [json.loads(x) for x in (tmp_path / recs[0]["name"] / "metrics.jsonl").read_text().splitlines()]
    (row,) = write_report(tmp_path)["rows"]

    # one process, same flags: the reference losses
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    cfg = train_cli.config_from_args(parser.parse_args(
        train_flags(Layout(schedule="1f1b"), grid.train, tmp_path / "ref")))
    cfg.resolve(1)
    trainer = Trainer.build(cfg, Comm(cfg.dims, 0))
    ref = [trainer.train_step()["loss"] for _ in range(cfg.steps)]
    assert [m["loss"] for m in metrics] == pytest.approx(ref, rel=1e-5)
    assert row["final_loss"] == pytest.approx(ref[-1], rel=1e-5)

    flops = flops_per_sample(cfg.spec, cfg.seq_len) * 4          # training FLOPs of one step
    want = flops / metrics[1]["step_time_s"] / 2 / 1e12      # step 0 is the warm-up
    assert row["tflops_per_gpu"] == pytest.approx(want, rel=1e-9)
    assert 0 < row["bubble"] < 1
    assert row["pp_bw_gbps"] > 0 and row["pp_calls"] > 0
