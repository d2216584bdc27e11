"""`commpipe train --config FILE`: a job TOML file or a run's config.json as the train parser's
defaults, command-line flags over them, errors naming file, section and key; a sweep grid
pointing at one."""

from __future__ import annotations

import argparse
import json

import pytest

from commpipe.cli import build_parser, main
from commpipe.cluster.grids import load_grid
from commpipe.cluster.launch import train_flags
from commpipe.cluster.sweep import LocalRunner, fingerprint, run_sweep, validate_layout
from commpipe.train import cli as train_cli
from commpipe.train.jobconfig import SECTIONS, parse_known_args

JOB = """
[model]
preset = "tiny"
recompute = "selective"
[parallelism]
tp = 2
pp = 2
stage-layers = [3, 1]
no-overlap = true
dp_bucket_mb = 5
[schedule]
schedule = "gpipe"
microbatches = 8
[training]
steps = 7
seq-len = 32
lr = 1e-3
warmup = 1
[data]
eval-every = 3
[checkpoint]
save-every = 5
resume = true
[monitor]
comm-monitor = "sample=0.5"
log-every = 2
[job]
out = "runs/job"
timeout-s = 60
[adapt]
adapt = true
min-steps = 3
adapt-trials = 0
slow-rank = "1:3@4"
"""


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args, rest = parse_known_args(parser, argv)
    assert rest == []
    return args


def job(tmp_path, text: str = JOB, name: str = "job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def resolved(args, world: int) -> dict:
    """The resolved config as config.json holds it."""
    cfg = train_cli.config_from_args(args).resolve(world)
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def test_every_key_reaches_the_config(tmp_path):
    cfg = train_cli.config_from_args(parse(["--config", job(tmp_path)]))
    assert (cfg.model, cfg.recompute, cfg.dims.tp, cfg.dims.pp) == ("tiny", "selective", 2, 2)
    assert cfg.stage_layers == [3, 1] and cfg.overlap is False and cfg.dp_bucket_mb == 5.0
    assert (cfg.schedule, cfg.microbatches, cfg.steps, cfg.seq_len) == ("gpipe", 8, 7, 32)
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.eval_every) == (1e-3, 1, 3)
    assert (cfg.save_every, cfg.resume, cfg.monitor, cfg.log_every) == (5, "latest", 0.5, 2)
    assert (cfg.out, cfg.timeout_s) == ("runs/job", 60.0)
    assert cfg.adapt.min_steps == 3 and cfg.adapt.trials == 0
    assert (cfg.slow_rank.rank, cfg.slow_rank.factor, cfg.slow_rank.step) == (1, 3.0, 4)


def test_flags_override_the_file(tmp_path):
    path = job(tmp_path)
    # flags before and after --config both win over the file
    args = parse(["--steps", "2", "--config", path, "--tp", "1", "--schedule", "1f1b",
                  "--comm-monitor", "off"])
    cfg = train_cli.config_from_args(args)
    assert (cfg.steps, cfg.dims.tp, cfg.schedule, cfg.monitor) == (2, 1, "1f1b", None)
    assert cfg.dims.pp == 2 and cfg.seq_len == 32            # the rest still from the file
    # an explicit flag equal to the built-in default also wins, wherever it stands
    assert parse(["--config", path, "--tp", "1"]).tp == 1
    assert parse(["--tp", "1", "--config", path]).tp == 1
    # and an unknown flag is still left over for the parser to refuse
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    assert parse_known_args(parser, ["--config", path, "--no-such-flag"])[1] == ["--no-such-flag"]


def test_the_commpipe_command_reads_the_file(tmp_path, capsys):
    """Through `commpipe train`: the file's values are validated like flags (tp=3 fails before
    any process starts) and a flag given on the command line replaces them."""
    path = job(tmp_path, '[parallelism]\ntp = 3\n[training]\nsteps = 0\n')
    assert main(["train", "--config", path]) == 2
    assert "tp=3 does not divide 4 attention heads" in capsys.readouterr().err
    assert main(["train", "--config", path, "--tp", "2"]) == 2
    assert "--steps 0 must be >= 1" in capsys.readouterr().err
    # each verb parser gets its own defaults: a second parser is untouched by the first's file
    parser = build_parser({"train": ("commpipe.train.cli", "")})
    assert parser.parse_args(["train"]).tp == 1


def test_every_train_flag_has_one_section():
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    placed = [d for ds in SECTIONS.values() for d in ds]
    assert sorted(set(placed)) == sorted(placed), "a flag is in two sections"
    assert dests == set(placed), f"flags without a section: {dests - set(placed)}"


@pytest.mark.parametrize("text, message", [
    ("[parallelisms]\ntp = 2\n", r"job.toml: unknown section \[parallelisms\]; did you mean \[parallelism\]"),
    ("[training]\nstepz = 2\n", r"job.toml: \[training\] stepz: unknown key; did you mean steps\?"),
    ("[training]\ntp = 2\n", r"job.toml: \[training\] tp: unknown key; tp belongs in \[parallelism\]"),
    ("steps = 2\n", r"job.toml: steps = 2 is outside any section; put it under \[training\]"),
    ("[training]\nsteps = \"ten\"\n", r"job.toml: \[training\] steps = 'ten': expected an integer"),
    ("[training]\nsteps = 2.5\n", r"\[training\] steps = 2.5: expected an integer"),
    ("[training]\nlr = true\n", r"\[training\] lr = True: expected a number"),
    ("[schedule]\nstrict-order = 1\n", r"\[schedule\] strict-order = 1: expected true or false"),
    ("[model]\nprecision = \"fp16\"\n", r"\[model\] precision = 'fp16': expected one of fp32, bf16"),
    ("[job]\nout = 3\n", r"\[job\] out = 3: expected a string"),
    ("[parallelism]\nstage-layers = [3, \"x\"]\n", r"expected layer counts like \[3, 3, 2\]"),
    ("[model]\nmodel = \"tiny\"\npreset = \"small\"\n", r"\[model\] preset sets model a second time"),
    ("[training\n", r"job.toml: malformed TOML"),
    ("[xyz]\n", r"job.toml: unknown section \[xyz\]; valid: \[adapt\], \[checkpoint\], \[data\]"),
])
def test_errors_name_file_section_and_key(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        parse(["--config", job(tmp_path, text)])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config .*nope.toml: no such file"):
        parse(["--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize("argv, world", [
    ([], 4),
    (["--stage-layers", "auto", "--schedule", "1f1b", "--microbatches", "4"], 4),
    (["--tp", "1", "--pp", "1", "--dp", "2", "--stage-layers", "", "--zero1", "--global-batch", "8",
      "--microbatches", "4", "--precision", "bf16", "--fail-at", "1:2", "--comm-monitor", "all",
      "--trace", "--tensorboard", "--adapt-resplit-only", "--adapt-switch-cost", "0.5"], 2),
])
def test_config_json_round_trip(tmp_path, argv, world):
    """A run folder's config.json, loaded with --config, resolves to the same config."""
    first = resolved(parse(["--config", job(tmp_path), *argv]), world)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(first))
    again = resolved(parse(["--config", str(folder / "config.json")]), world)
    assert again == first
    # and it is a config like any other: flags override it
    assert resolved(parse(["--config", str(folder / "config.json"), "--steps", "3"]), world)["steps"] == 3


def test_config_json_keeps_the_global_batch(tmp_path):
    """config.json gives back the global batch, not the micro-batch count, so another dp
    splits the same batch differently instead of failing on a count that no longer fits."""
    first = resolved(parse(["--config", job(tmp_path), "--tp", "1"]), 2)
    assert (first["global_batch"], first["microbatches"]) == (8, 8)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(first))
    again = resolved(parse(["--config", str(path), "--dp", "2"]), 4)
    assert (again["global_batch"], again["microbatches"]) == (8, 4)


def test_config_json_unknown_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"dims": {"tp": 1, "cp": 1, "pp": 1, "dp": 1}, "stepz": 3}))
    with pytest.raises(ValueError, match=r"config.json: unknown field stepz; did you mean steps"):
        parse(["--config", str(path)])


# -- sweeps ---------------------------------------------------------------------------------------
def test_grid_points_at_a_job_config(tmp_path):
    (tmp_path / "jobs").mkdir()
    job(tmp_path / "jobs", '[training]\nseq-len = 31\nsteps = 2\n[model]\nmodel = "tiny"\n')
    grid_path = tmp_path / "grid.toml"
    grid_path.write_text('[train]\nconfig = "jobs/job.toml"\nsteps = 3\n\n[[layout]]\ntp = 2\n\n'
                         '[[layout]]\nname = "one"\n')
    grid = load_grid(str(grid_path))
    config = str((tmp_path / "jobs" / "job.toml").resolve())
    assert grid.train == {"config": config, "steps": 3}
    tp2, one = grid.layouts
    flags = train_flags(one, grid.train, "/o")
    assert flags[flags.index("--config") + 1] == config
    # the file's seq-len 31 reaches the trainer's validation: TP2 with sequence parallelism
    # cannot split 31 tokens
    assert "use a --seq-len divisible by cp*tp=2" in validate_layout(tp2, grid.train)
    assert validate_layout(one, grid.train) is None
    # a changed file is a changed run
    before = fingerprint(one, grid.train)
    job(tmp_path / "jobs", '[training]\nseq-len = 32\n')
    assert fingerprint(one, grid.train) != before


@pytest.mark.parametrize("text, message", [
    ('[train]\nconfig = "missing.toml"\n[[layout]]\ntp = 1\n',
     r"\[train\]: config = 'missing.toml': no such file"),
    ('[[layout]]\nconfig = "bad.toml"\n', r"bad.toml: \[training\] stepz: unknown key"),
])
def test_grid_config_errors_at_load(tmp_path, text, message):
    job(tmp_path, "[training]\nstepz = 1\n", "bad.toml")
    path = tmp_path / "grid.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_grid(str(path))


@pytest.mark.slow
def test_sweep_trains_with_the_grid_config(tmp_path):
    """One real layout: the run's config.json holds the job file's values, the [train] table's
    override and the layout's degrees."""
    job(tmp_path, '[model]\nmodel = "tiny"\n[training]\nseq-len = 16\nsteps = 5\nlr = 0.002\n'
                  '[parallelism]\npp = 4\n')
    grid_path = tmp_path / "grid.toml"
    grid_path.write_text('[train]\nconfig = "job.toml"\nsteps = 2\n\n[[layout]]\nname = "pp2"\npp = 2\n')
    recs = run_sweep(load_grid(str(grid_path)), tmp_path / "sweep", LocalRunner(timeout_s=600),
                     progress=False, log=lambda *_: None)
    assert [r["status"] for r in recs] == ["ok"], [r["reason"] for r in recs]
    cfg = json.loads((tmp_path / "sweep" / "pp2" / "config.json").read_text())
    assert (cfg["seq_len"], cfg["optim"]["lr"], cfg["steps"], cfg["dims"]["pp"]) == (16, 0.002, 2, 2)
