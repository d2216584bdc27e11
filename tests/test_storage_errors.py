"""Files commpipe reads and writes: crafted or damaged checkpoints, a run folder holding another
run, a full disk, unwritable or wrong-kind paths, and files that do not parse. Each case must
fail before any work starts (or, for a save, at once) with the file and the reason named."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from commpipe.cli import main
from commpipe.cluster.sweep import read_status
from commpipe.train import checkpoint

TINY = ["--seq-len", "16", "--global-batch", "2", "--seed", "3"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """A one-process run of 2 steps with a checkpoint after each."""
    out = tmp_path_factory.mktemp("run2") / "run"
    assert main(["train", *TINY, "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    return out


def _copy(run2, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run2, out)
    return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# -- a checkpoint runs no code ------------------------------------------------------------------
class _Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_and_runs_nothing(run2, tmp_path, capsys):
    out = _copy(run2, tmp_path)
    marker = tmp_path / "marker"
    meta = out / "checkpoints" / "step_000002" / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    assert main(["train", *TINY, "--steps", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "refusing checkpoint" in err and "posix.system" in err and ".metadata" in err
    assert not marker.exists()


def test_bytes_entries_and_outside_files_are_refused(run2, tmp_path):
    """A bytes entry would be loaded with torch.load(weights_only=False); a file outside the
    folder is not the checkpoint's."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from commpipe.files import StorageError
    from commpipe.train.checkpoint_io import read_metadata

    out = _copy(run2, tmp_path)
    step = out / "checkpoints" / "step_000002"
    md = pickle.loads((step / ".metadata").read_bytes())     # our own file: trusted here
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    (step / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(StorageError, match="BytesStorageMetadata"):
        read_metadata(step)
    md = pickle.loads((run2 / "checkpoints" / "step_000002" / ".metadata").read_bytes())
    next(iter(md.storage_data.values())).relative_path = "../../config.json"
    (step / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(StorageError, match="outside the checkpoint folder"):
        read_metadata(step)


def test_a_real_checkpoint_still_resumes(run2, tmp_path):
    out = _copy(run2, tmp_path)
    assert main(["train", *TINY, "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert [r["step"] for r in _metrics(out)] == [0, 1, 2]


# -- damaged checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("name,damage", [
    ("__0_0.distcp", "truncate"), (".metadata", "truncate"), ("commpipe.json", "truncate"),
    ("__0_0.distcp", "scramble")])
def test_damaged_checkpoint_names_the_file_and_the_earlier_one(run2, tmp_path, capsys, name,
                                                               damage):
    out = _copy(run2, tmp_path)
    f = out / "checkpoints" / "step_000002" / name
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:                         # same size, every tensor record's header overwritten
        f.write_bytes(b"\0" * len(data))
    assert main(["train", *TINY, "--steps", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {out / 'checkpoints' / 'step_000002'} is damaged" in err
    assert (name if damage == "truncate" else ".distcp") in err
    assert f"--resume {out / 'checkpoints' / 'step_000001'}" in err
    # the named earlier checkpoint does resume
    assert main(["train", *TINY, "--steps", "3", "--out", str(out),
                 "--resume", str(out / "checkpoints" / "step_000001")]) == 0


# -- a full disk ------------------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A real 1.5 MB file system (tmpfs): a tiny model's first checkpoint (2.4 MB) fills it."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_during_a_save_names_the_folder_and_the_reason(small_fs, capsys):
    out = small_fs / "run"
    assert main(["train", *TINY, "--steps", "1", "--save-every", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device (ENOSPC)" in err
    assert str(out / "checkpoints" / "step_000001.tmp") in err
    assert "CheckpointException" not in err
    # the partial save is removed (its space freed); metrics of the step are kept
    assert not (out / "checkpoints" / "step_000001.tmp").exists()
    assert [r["step"] for r in _metrics(out)] == [0]


# -- a folder holding another run -----------------------------------------------------------------
def test_out_holding_another_run_is_refused_naming_the_difference(run2, tmp_path, capsys):
    out = _copy(run2, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    assert main(["train", *TINY, "--steps", "2", "--lr", "0.01", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a run with lr=0.003" in err and "this one has lr=0.01" in err
    assert "--resume" in err and "--overwrite" in err
    # the same configuration again: also refused (its steps would repeat in metrics.jsonl)
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 2
    assert "already holds this run (metrics up to step 1, checkpoint step_000002)" in \
        capsys.readouterr().err
    assert (out / "metrics.jsonl").read_bytes() == before
    assert checkpoint.find_checkpoint(out).name == "step_000002"


def test_overwrite_replaces_the_run_files_only(run2, tmp_path):
    out = _copy(run2, tmp_path)
    (out / "notes.txt").write_text("mine")
    assert main(["train", *TINY, "--steps", "1", "--lr", "0.01", "--out", str(out),
                 "--overwrite"]) == 0
    assert [r["step"] for r in _metrics(out)] == [0]
    assert not (out / "checkpoints").exists()                   # no --save-every this time
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 0.01
    assert (out / "notes.txt").read_text() == "mine"
    assert main(["train", *TINY, "--out", str(out), "--overwrite", "--resume"]) == 2


# -- paths checked before anything starts -----------------------------------------------------------
@pytest.fixture
def read_only(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    (mnt / "inside").mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", "-o", "ro", str(mnt), str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("needs root for a read-only bind mount")
    subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=False)
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_unusable_paths_are_named_before_anything_starts(tmp_path, read_only, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    probe = tmp_path / "probe_dir"
    probe.mkdir()
    cases = [
        (["train", *TINY, "--out", str(a_file)], f"--out {a_file} is a file"),
        (["train", *TINY, "--out", str(read_only / "run")], "Read-only file system"),
        (["sweep", "--grid", str(tmp_path), "--out", str(tmp_path / "s"), "--cluster", "local"],
         f"grid file {tmp_path} is a folder"),
        (["sweep", "--grid", "demo8", "--out", str(a_file), "--cluster", "local"],
         f"--out {a_file} is a file"),
        (["plan", "--model", "tiny", "--gpus", "8", "--cluster", str(probe)],
         f"probe file {probe} is a folder"),
        (["probe", "--nproc", "2", "--out", str(read_only / "p.json")], "Read-only file system"),
        (["probe", "--nproc", "2", "--out", str(probe)], f"--out {probe} is a folder"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
        assert "Traceback" not in err


def test_tokenize_into_a_read_only_cache_dir_fails_before_training(tmp_path, read_only, capsys):
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "train.txt").write_text("some text here\n\nand more text\n")
    assert main(["tokenize", "--data", str(data), "--train-tokenizer", "--vocab-size", "300",
                 "--cache-dir", str(read_only / "inside"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Read-only file system" in err and str(read_only / "inside") in err


# -- files that do not parse ----------------------------------------------------------------------
def test_parse_errors_name_the_file_and_the_key(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text('[train]\nsteps = "two"\n\n[[layout]]\ntp = 1\n')
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"[train]\n# caf\xe9\n[[layout]]\ntp = 1\n")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"pairs": {"intra_node": {"latency_ms": 0.01,
                                                          "bandwidth_gbps": 10}},
                                 "ranks_per_node": "abc"}))
    csv = tmp_path / "s.csv"
    csv.write_bytes(b"1F0,1B0\xff\n")
    cases = [
        (["sweep", "--grid", str(grid), "--out", str(tmp_path / "s"), "--cluster", "local"],
         f"{grid} [train]: steps = 'two': expected an integer"),
        (["sweep", "--grid", str(latin), "--out", str(tmp_path / "s"), "--cluster", "local"],
         f"grid file {latin} is not UTF-8 text: byte 0xe9 at line 2, column 6"),
        (["plan", "--model", "tiny", "--gpus", "8", "--cluster", str(probe)],
         f'probe file {probe}: ranks_per_node = "abc": expected a positive integer'),
        (["simulate", "--schedule", str(csv)], f"schedule file {csv} is not UTF-8 text"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert not (tmp_path / "s" / "sweep.jsonl").exists()


def test_non_utf8_corpus_names_the_file_and_the_byte(tmp_path, capsys):
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "train.txt").write_bytes(b"good text\n\nbad \xff text\n")
    assert main(["tokenize", "--data", str(data), "--train-tokenizer", "--vocab-size", "300",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"corpus file {data / 'train.txt'} is not UTF-8 text: byte 0xff at line 3" in err


def test_corrupt_relaunch_request_is_named(tmp_path):
    from commpipe.adapt.config import AdaptConfig
    from commpipe.adapt.relaunch import apply_pending
    from commpipe.train.config import TrainConfig

    (tmp_path / "adapt_relaunch.json").write_text('{"step": 4, "checkp')
    cfg = TrainConfig(out=str(tmp_path), adapt=AdaptConfig())
    with pytest.raises(ValueError, match="relaunch request file .*adapt_relaunch.json is not "
                                         "valid JSON"):
        apply_pending(cfg, 1)
    (tmp_path / "adapt_relaunch.json").write_text('{"step": 4}')
    with pytest.raises(ValueError, match='expected "checkpoint"'):
        apply_pending(cfg, 1)


def test_torn_sweep_status_line_is_skipped_with_a_warning(tmp_path):
    good = {"name": "a", "status": "ok"}
    path = tmp_path / "sweep.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"name": "b", "sta')
    warnings = []
    assert read_status(tmp_path, warn=warnings.append) == {"a": good}
    assert len(warnings) == 1 and "sweep.jsonl:2: ignoring a torn last line" in warnings[0]
    # a damaged line in the middle is named, not skipped
    path.write_text("garbage\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"sweep.jsonl:1: not a status record"):
        read_status(tmp_path)


def test_a_rerun_after_a_torn_status_line_runs_that_layout_again(tmp_path):
    from commpipe.cluster.grids import Grid, Layout
    from commpipe.cluster.launch import RunResult
    from commpipe.cluster.sweep import run_sweep

    grid = Grid([Layout(name="a"), Layout(name="b")], {"steps": 1, "seq_len": 16})
    ran = []

    def runner(layout, train, run_dir, poll=None):
        ran.append(layout.name)
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        return RunResult("ok")

    run_sweep(grid, tmp_path, runner, progress=False, log=lambda *_: None)
    path = tmp_path / "sweep.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(first + "\n" + second[:20])          # killed while writing b's record
    ran.clear()
    said = []
    run_sweep(grid, tmp_path, runner, progress=False, log=said.append)
    assert ran == ["b"]
    assert any("torn last line" in line for line in said)
    assert set(read_status(tmp_path, warn=pytest.fail)) == {"a", "b"}   # every line reads
