"""Bad input fails before any process group starts, with a message that names the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from commpipe.cli import main
from commpipe.models.spec import parse_model_fields, resolve_model
from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import TrainConfig


def cfg(**kw) -> TrainConfig:
    dims = ParallelDims(**{k: kw.pop(k) for k in ("tp", "cp", "pp", "dp") if k in kw})
    kw.setdefault("seq_len", 64)
    return TrainConfig(dims=dims, **kw)


# (what is wrong, config, world size, words the message must contain)
BAD = [
    ("tp does not divide heads", dict(tp=3), 3, ["tp=3", "attention heads", "{1, 2}"]),
    ("tp does not divide kv heads", dict(model="arch=llama,layers=2,hidden=64,heads=8,kv_heads=2,"
                                         "vocab=256", tp=4), 4, ["tp=4", "KV heads", "{1, 2}"]),
    ("pp larger than layers", dict(pp=8, microbatches=8), 8, ["pp*vpp=8", "4 layers"]),
    ("world size mismatch", dict(tp=2, pp=2), 2, ["world size 2", "= 4", "--nproc-per-node 4"]),
    ("seq not divisible by 2cp", dict(cp=2, seq_len=30), 2, ["2*cp=4", "seq_len=30", "--seq-len 28 or 32"]),
    # an odd length fits no cp > 1: the message names lengths that do, not an empty set
    ("odd seq with cp", dict(cp=2, seq_len=63), 2, ["--seq-len 60 or 64"]),
    ("seq fits a smaller cp", dict(cp=4, seq_len=68), 4, ["--seq-len 64 or 72", "cp in {2}"]),
    ("1f1b with too few micro-batches", dict(pp=4, microbatches=2), 4,
     ["m=2 < p=4", "--microbatches >= 4"]),
    ("unknown preset", dict(model="llama9"), 1, ["unknown model 'llama9'", "tiny"]),
    ("malformed model fields", dict(model="arch=llama,layers=two,hidden=64,heads=4,vocab=256"), 1,
     ["layers='two'", "not a number"]),
    ("missing model fields", dict(model="arch=llama,layers=2"), 1, ["missing", "hidden"]),
    ("global batch not divisible", dict(dp=2, global_batch=5), 2, ["global batch 5", "multiple of 2"]),
    ("micro-batch count disagrees", dict(global_batch=8, microbatches=3), 1,
     ["--microbatches 3", "= 8"]),
    ("unknown schedule", dict(schedule="pipedream9"), 1, ["unknown schedule 'pipedream9'", "1f1b"]),
    ("stage layers not summing", dict(pp=2, stage_layers=[1, 1]), 2, ["sum to", "4 layers"]),
    ("stage layer count wrong", dict(pp=2, stage_layers=[1, 1, 2]), 2, ["3 stages", "pp*vpp=2"]),
    ("gpt shape for training", dict(model="arch=gpt,layers=2,hidden=64,heads=4,vocab=256"), 1,
     ["arch=llama", "plan"]),
    ("missing schedule csv", dict(schedule="nowhere/sched.csv"), 1, ["does not exist"]),
    ("vocab not divisible by tp", dict(model="arch=llama,layers=2,hidden=64,heads=4,kv_heads=2,"
                                          "vocab=255", tp=2), 2, ["vocab=255"]),
]


@pytest.mark.parametrize("what,kw,world,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_with_the_fix(what, kw, world, words):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        cfg(**kw).resolve(world)
    for w in words:
        assert w in str(err.value), f"{what}: {w!r} not in {err.value!r}"


def test_schedule_csv_names_the_pp_and_microbatches_it_was_written_for(tmp_path):
    # a 2-rank, 2-micro-batch CSV; training defaults to 2*pp = 4 micro-batches
    path = tmp_path / "mine.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    with pytest.raises(ValueError, match="runs 2 micro-batches, training has 4; give --microbatches 2"):
        cfg(pp=2, schedule=str(path)).resolve(2)
    with pytest.raises(ValueError, match="is for pp=2, layout has pp=4; use --pp 2"):
        cfg(pp=4, microbatches=2, schedule=str(path)).resolve(4)
    assert cfg(pp=2, microbatches=2, schedule=str(path)).resolve(2).program().microbatches == 2


def test_bad_degree_values():
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="unknown model field 'depth'"):
        parse_model_fields("depth=3,layers=2,hidden=64,heads=4,vocab=256")
    assert resolve_model("llama-8b-32k").vocab == 32000


def test_cli_rejects_before_starting_processes(capsys):
    # world size comes from the environment (1 here): tp=2 needs 2 processes
    assert main(["train", "--tp", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "world size 1" in err and "--nproc-per-node 2" in err
    assert main(["train", "--comm-monitor", "sample=2"]) == 2
    assert "sample=F with 0 < F <= 1" in capsys.readouterr().err


def test_only_comm_calls_torch_distributed_communication():
    """The chokepoint rule: no other module issues torch.distributed communication."""
    ops = r"(dist|distributed)\.(all_reduce|all_gather|reduce_scatter|broadcast|isend|irecv|send|recv|" \
          r"all_to_all|gather|scatter|barrier|batch_isend_irecv|all_gather_object)\b"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["grep", "-rlE", "--include=*.py", ops, "commpipe"], capture_output=True,
                         text=True, cwd=root)
    offenders = sorted(set(out.stdout.split()) - {"commpipe/parallel/comm.py"})
    assert offenders == [], f"torch.distributed communication outside the chokepoint: {offenders}"


def test_schedule_csv_is_proven_before_training(tmp_path, capsys):
    # rank 1 runs micro-batch 1 first while rank 0 waits for micro-batch 0's gradient: the
    # same rank x step grid `commpipe simulate` prints, before any process group starts
    dead = tmp_path / "dead.csv"
    dead.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(ValueError, match="deadlocks") as err:
        cfg(pp=2, microbatches=2, schedule=str(dead)).resolve(2)
    assert "[0RECV_B0]" in str(err.value) and "[1RECV_F1]" in str(err.value)
    assert "cycle: rank 0 -> rank 1 -> rank 0" in str(err.value)
    assert main(["simulate", "--schedule", str(dead)]) == 2
    simulated = capsys.readouterr().err.split("error: ", 1)[1]
    assert main(["train", "--pp", "2", "--microbatches", "2", "--schedule", str(dead)]) == 2
    assert capsys.readouterr().err.split("error: ", 1)[1] == simulated
    # a missing forward: named, instead of a KeyError inside the executor
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1B1\n")
    with pytest.raises(ValueError, match=r"stage 1 micro-batch 1 \(rank 1\) has no forward 1F1"):
        cfg(pp=2, microbatches=2, schedule=str(bad)).resolve(2)
