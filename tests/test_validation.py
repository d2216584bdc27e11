"""Bad input fails before any process group starts, with a message that names the fix."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from commpipe.cli import main
from commpipe.models.spec import parse_model_fields, resolve_model
from commpipe.parallel.dims import ParallelDims
from commpipe.plan.fits import fit_problem, host_need_gb, train_fit_problem
from commpipe.plan.layout import Job, Layout, runtime_job
from commpipe.train.config import OptimConfig, TrainConfig


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
    with pytest.raises(ValueError, match="must name tp, cp, dp and pp once each"):
        ParallelDims(pp=2, order="tp-pp-dp")


def test_rank_order_places_the_groups():
    # Megatron's default tp-cp-dp-pp: rank = ((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    d = ParallelDims(pp=2, dp=2, tp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # tp-cp-pp-dp: rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
    r = ParallelDims(pp=2, dp=2, tp=2, order="tp-cp-pp-dp")
    assert r.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert r.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert r.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for dims in (d, r):
        assert all(dims.rank_of(**dims.coords(k)) == k for k in range(8))
    assert str(r) == "tp2-cp1-pp2-dp2 ranks tp-cp-pp-dp" and str(d) == "tp2-cp1-pp2-dp2"


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


# (what is wrong, config, words the message must contain): numbers a run cannot use, each named
# with its flag and the range it takes, before any process group starts
OUT_OF_RANGE = [
    ("negative warm-up", dict(optim=OptimConfig(warmup_steps=-3)), ["--warmup -3", ">= 0"]),
    ("negative clip", dict(optim=OptimConfig(clip=-1.0)), ["--clip -1.0", ">= 0"]),
    ("min-lr above lr", dict(optim=OptimConfig(lr=1e-3, min_lr=1e-2)), ["--min-lr", "[0, --lr"]),
    ("log-every 0", dict(log_every=0), ["--log-every 0", ">= 1"]),
    ("zero micro-batches", dict(microbatches=0), ["--microbatches 0 must be >= 1"]),
    ("zero micro-batch size", dict(micro_batch_size=0), ["--micro-batch-size 0 must be >= 1"]),
    ("fail-at rank outside the layout", dict(pp=2, fail_at=(5, 1)), ["--fail-at 5:1", "2 ranks",
                                                                     "(0..1)"]),
    ("fail-at step after the run", dict(steps=3, fail_at=(0, 3)), ["steps 0..2"]),
    ("a step's program too long", dict(microbatches=10**8), ["--microbatches <= 65536"]),
    ("a global batch too long", dict(pp=2, global_batch=10**9),
     ["--microbatches <= 32768", "--global-batch <= 32768"]),
    ("unknown device", dict(device="tpu"), ["--device 'tpu'", "auto, cpu or cuda"]),
]


@pytest.mark.parametrize("what,kw,words", OUT_OF_RANGE, ids=[b[0] for b in OUT_OF_RANGE])
def test_out_of_range_values_name_the_flag(what, kw, words):
    c = cfg(**kw)
    with pytest.raises(ValueError) as err:
        c.resolve(c.dims.world_size)
    for w in words:
        assert w in str(err.value), f"{what}: {w!r} not in {err.value!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPU")
def test_cuda_without_gpu_says_so():
    with pytest.raises(ValueError, match="--device cuda: PyTorch sees no CUDA GPU"):
        cfg(device="cuda").resolve(1)


def test_adapt_options_need_adapt(capsys):
    assert main(["train", "--adapt-relaunch", "--steps", "1"]) == 2
    assert "--adapt-relaunch" in capsys.readouterr().err


def test_memory_is_estimated_before_training():
    # llama3-70b: 70.55e9 parameters at 16 bytes (fp32 weights, gradients, Adam m and v)
    # = 1051.3 GiB of states, whatever the layout on one host's shared memory
    big = cfg(model="llama3-70b").resolve(1)
    problem = train_fit_problem(big, 1, capacity_gb=24.0)
    assert "1051.3 GiB" in problem and "is 24.0 GiB" in problem
    assert "--model small would need" in problem
    assert train_fit_problem(cfg().resolve(1), 1, capacity_gb=24.0) is None
    # activations: what fits is named (a shorter sequence, here)
    long = cfg(seq_len=2**22).resolve(1)
    problem = train_fit_problem(long, 1, capacity_gb=24.0)
    assert "seq_len 4194304" in problem and "--seq-len 524288 would need" in problem
    # on GPUs each rank has its own memory: more pipeline ranks fit llama3-8b (119.7 GiB of
    # states: 8.03e9 parameters at 16 bytes) into 80 GB; not 2: a stage's 60 GiB of states, the
    # bf16 copy of its weights autocast keeps for the step and the activations of its
    # micro-batches in flight exceed 79 GiB
    job = Job(8, 2048, precision="bf16", **runtime_job())
    problem = fit_problem(resolve_model("llama3-8b"), Layout(), job, False, [0], 79.0)
    assert "weights+gradients+optimizer 119.7 GiB" in problem and "--pp 4 (4 GPUs)" in problem
    # on CPU the ranks of a host share it: four tiny ranks need four times one
    tiny = resolve_model("tiny")
    one = host_need_gb(tiny, Layout(), job, True, [0])
    four = host_need_gb(tiny, Layout(dp=4), replace(job, global_batch=32), True, [0, 1, 2, 3])
    assert four == pytest.approx(4 * one)
    assert host_need_gb(tiny, Layout(dp=4), replace(job, global_batch=32), False,
                        [0, 1, 2, 3]) == host_need_gb(tiny, Layout(), job, False, [0])  # a GPU each


def test_cli_refuses_a_model_this_host_cannot_hold():
    # no machine here has the 1 TB llama3-70b's states need: refused in seconds, not OOM-killed
    out = subprocess.run([sys.executable, "-m", "commpipe", "train", "--model", "llama3-70b",
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "out of memory: llama3-70b" in out.stderr and "available host memory" in out.stderr


@pytest.mark.parametrize("flag,value", [("--nodes", "0"), ("--ranks-per-node", "-1"),
                                        ("--timeout", "0")])
def test_sweep_sizes_are_checked_before_any_layout(flag, value, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--grid", "demo8", "--out", str(out), "--cluster", "local",
                 flag, value]) == 2
    assert f"{flag} {value} must be" in capsys.readouterr().err
    assert not out.exists()      # nothing ran, nothing written
