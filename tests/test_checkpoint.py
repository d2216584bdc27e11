"""Checkpoints: resume equals the uninterrupted run, and a checkpoint saved under one layout
loads under another (model weights and AdamW states, with and without ZeRO-1, and the experts of
a MoE model across expert-parallel degrees: tests/checkpoint_ep_jobs.py).

    python -m pytest tests/test_checkpoint.py -x -q

One spawn of 4 gloo processes runs every multi-rank job; single-process checks run in-process.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpipe.cli import main
from commpipe.data import SyntheticTokens
from commpipe.models.llama import build_model
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.placement import placement
from commpipe.train import checkpoint
from commpipe.train.config import OptimConfig, TrainConfig
from tests import checkpoint_ep_jobs
from tests.dist_harness import spawn
from tests.test_equivalence import check_params

GLOBAL_BATCH, SEQ, STEPS, EVAL_BATCHES = 4, 16, 4, 2


def make_cfg(tp=1, pp=1, dp=1, zero1=False, schedule="1f1b", **kw) -> TrainConfig:
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, eps=1e-4, zero1=zero1)
    return TrainConfig(model="tiny", dims=ParallelDims(dp=dp, pp=pp, tp=tp), schedule=schedule,
                       global_batch=GLOBAL_BATCH, micro_batch_size=1, seq_len=SEQ, steps=STEPS,
                       seed=5, optim=optim, eval_batches=EVAL_BATCHES, **kw)


# -- the spawned side -----------------------------------------------------------------------------
def _snapshot(trainer) -> dict:
    """This rank's parameters and the AdamW states it holds, with what is needed to reassemble."""
    adam, holds = checkpoint.adam_and_holder(trainer)
    opt = {}
    for name, p in trainer.named_params:
        st = adam.state.get(p)
        if holds(p) and st:
            opt[name] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"]))
    return {"coords": trainer.comm.coords, "step": trainer.step,
            "params": {n: (p.detach().clone(), placement(p).tp_dim)
                       for n, p in trainer.named_params}, "opt": opt}


def _build(cfg, rank):
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    cfg.resolve(dist.get_world_size())
    return Trainer.build(cfg, Comm(cfg.dims, rank))


def _worker(rank: int, world: int, root: str) -> dict:
    from commpipe.train.loop import train

    root = Path(root)
    res = {}
    # A: tp=2 pp=2, four uninterrupted steps, saved after step 2 (in passing)
    a = _build(make_cfg(tp=2, pp=2), rank)
    losses = [a.train_step()["loss"] for _ in range(2)]
    res["A@2"] = _snapshot(a)
    res["A@2"]["val"] = a.evaluate()
    ck2 = checkpoint.save(a, root / "a")
    losses += [a.train_step()["loss"] for _ in range(2)]
    res["A"] = {"losses": losses}
    # resume in the same layout through the training loop (--resume PATH)
    hist = train(make_cfg(tp=2, pp=2, resume=str(ck2)), log=None)
    res["resume"] = {"losses": [r["loss"] for r in hist], "steps": [r["step"] for r in hist]}
    # the same checkpoint under other layouts: weights, optimizer, then two more steps
    # (zbv: four one-layer stages in a V over two ranks, the forward-only program included)
    for key, cfg in (("pp4", make_cfg(pp=4)), ("dp2tp2z", make_cfg(dp=2, tp=2, zero1=True)),
                     ("zbv", make_cfg(tp=2, pp=2, schedule="zbv"))):
        t = _build(cfg, rank)
        checkpoint.load(t, ck2)
        res[key] = _snapshot(t)
        res[key]["val"] = t.evaluate()
        res[key]["losses"] = [t.train_step()["loss"] for _ in range(2)]
    # ZeRO-1 on the saving side: dp=2 tp=2 saves after step 3, pp=4 loads it
    c = _build(make_cfg(dp=2, tp=2, zero1=True), rank)
    checkpoint.load(c, ck2)
    c.train_step()
    res["C@3"] = _snapshot(c)
    ck3 = checkpoint.save(c, root / "c")
    d = _build(make_cfg(pp=4), rank)
    checkpoint.load(d, ck3)
    res["D"] = _snapshot(d)
    res.update(checkpoint_ep_jobs.run(rank, root, _build))   # MoE under ep 1, 2, 4
    return res


def _cat(shards: dict, tp_dim: int | None) -> torch.Tensor:
    """Full tensor from {tp_rank: shard}."""
    order = [shards[t] for t in sorted(shards)]
    return order[0] if tp_dim is None else torch.cat(order, tp_dim)


def assemble(snapshots: list[dict]) -> tuple[dict, dict]:
    """Full parameters and full AdamW states (exp_avg, exp_avg_sq, step) from every rank's
    shards; asserts that replicas (DP, CP, ZeRO owners) agree."""
    tp_dims = {n: v[1] for s in snapshots for n, v in s["params"].items()}
    shards: dict = {}  # (kind, name, index) -> {(dp, cp): {tp: tensor}}
    for snap in snapshots:
        c = snap["coords"]
        for name, (tensor, _) in snap["params"].items():
            shards.setdefault(("p", name, 0), {}).setdefault((c["dp"], c["cp"]), {})[c["tp"]] = tensor
        for name, (m, v, step) in snap["opt"].items():
            for i, t in enumerate((m, v, torch.tensor(step))):
                shards.setdefault(("o", name, i), {}).setdefault((c["dp"], c["cp"]), {})[c["tp"]] = t
    full = {}
    for (kind, name, i), replicas in shards.items():
        dim = tp_dims[name] if i < 2 else None
        values = [_cat(by_tp, dim) for by_tp in replicas.values()]
        assert all(torch.equal(v, values[0]) for v in values), f"{name}: replicas differ"
        full[(kind, name, i)] = values[0]
    params = {name: t for (kind, name, _), t in full.items() if kind == "p"}
    opt = {name: (full[("o", name, 0)], full[("o", name, 1)], full[("o", name, 2)].item())
           for (kind, name, i) in full if kind == "o" and i == 0}
    return params, opt


@pytest.fixture(scope="module")
def world4():
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = spawn(_worker, 4, tmp)
        saved = Path(tmp) / "a" / checkpoint.step_dirname(2)
        keep = Path(tempfile.mkdtemp()) / "ckpt"
        shutil.copytree(saved, keep)
        shutil.copytree(Path(tmp) / "moe" / checkpoint.step_dirname(2), keep.parent / "moe")
        shutil.copytree(Path(tmp) / "monitored", keep.parent / "monitored")
        shutil.copytree(Path(tmp) / "peers" / "checkpoints" / checkpoint.step_dirname(2),
                        keep.parent / "peers" / checkpoint.step_dirname(2))
    out = {}
    for key in per_rank[0]:
        snaps = [pr[key] for pr in per_rank]
        out[key] = dict(snaps[-1])  # losses/val live on the last pipeline stage and agree
        if "params" in snaps[0]:
            out[key]["params"], out[key]["opt"] = assemble(snaps)
        if "losses" in snaps[0]:
            out[key]["losses"] = next(s["losses"] for s in snaps if s["losses"])
    out["ckpt"], out["moe_ckpt"], out["monitored"] = keep, keep.parent / "moe", keep.parent / "monitored"
    out["peers_ckpt"] = keep.parent / "peers" / checkpoint.step_dirname(2)
    yield out
    shutil.rmtree(keep.parent, ignore_errors=True)


def assert_same_state(got: dict, want: dict, label: str) -> None:
    """Loading copies tensors: parameters and optimizer states must be bit-identical."""
    assert set(got["params"]) == set(want["params"]), label
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), f"{label}: parameter {name} differs"
    assert set(got["opt"]) == set(want["opt"]), f"{label}: optimizer states for other parameters"
    for name, (m, v, step) in want["opt"].items():
        gm, gv, gstep = got["opt"][name]
        assert torch.equal(gm, m) and torch.equal(gv, v), f"{label}: AdamW moments of {name}"
        assert gstep == step, f"{label}: AdamW step of {name}"


def test_resume_equals_uninterrupted_run(world4):
    # a resumed run must continue exactly: same weights, optimizer, LR position and data
    assert world4["resume"]["steps"] == [2, 3]
    for got, want in zip(world4["resume"]["losses"], world4["A"]["losses"][2:]):
        assert abs(got - want) <= 1e-6, (world4["resume"]["losses"], world4["A"]["losses"])


@pytest.mark.parametrize("layout", ["pp4", "dp2tp2z", "zbv"])
def test_reshard_to_another_layout(world4, layout):
    got = world4[layout]
    assert_same_state(got, world4["A@2"], f"tp2pp2 -> {layout}")
    # training continues with the losses of the unchanged layout; another layout sums in
    # another order, so agreement is to rounding (the tolerance of test_equivalence)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(world4["A"]["losses"][2:]),
                               rtol=1e-5, atol=0)


def test_zero1_sharded_optimizer_saves_and_reshards(world4):
    assert_same_state(world4["D"], world4["C@3"], "dp2tp2 zero1 -> pp4")
    assert all(st[2] == 3.0 for st in world4["D"]["opt"].values())


def reference_val_loss(params: dict, cfg: TrainConfig) -> float:
    """Single-device validation loss: a whole model, plain cross-entropy, same batches."""
    cfg.resolve(1)
    model = build_model(cfg.spec, cfg.seed)
    model.load_state_dict(params)
    source = SyntheticTokens(vocab=cfg.spec.vocab, seed=cfg.seed, seq_len=cfg.seq_len)
    losses = []
    with torch.no_grad():
        for inputs, labels in source.validation(cfg.global_batch, 0, 1, max_batches=EVAL_BATCHES):
            logits = model(inputs)
            losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item())
    return sum(losses) / len(losses)


def test_validation_loss_matches_single_device(world4):
    ref = reference_val_loss(world4["A@2"]["params"], make_cfg())
    for key in ("A@2", "pp4", "dp2tp2z", "zbv"):
        assert math.isclose(world4[key]["val"], ref, rel_tol=1e-5), (key, world4[key]["val"], ref)


def test_single_process_loads_a_tp_pp_checkpoint(world4, tmp_path):
    from commpipe.train.loop import Trainer

    cfg = make_cfg().resolve(1)
    trainer = Trainer.build(cfg)
    checkpoint.load(trainer, world4["ckpt"])
    for name, p in trainer.named_params:
        assert torch.equal(p.detach(), world4["A@2"]["params"][name]), name
    assert trainer.step == 2 and trainer.source.state_dict()["step"] == 2


# -- MoE experts sharded over ep: saved as shards at their offsets, loaded under another ep -------
@pytest.mark.parametrize("layout", list(checkpoint_ep_jobs.LAYOUTS))
def test_ep_checkpoint_reshards_to_another_ep(world4, layout):
    """Saved under ep2 x dp4 after 2 steps: every expert row and AdamW moment lands where the
    other layout holds it, and 2 more steps follow the uninterrupted ep2 run (losses to the
    tolerance above, parameters to test_equivalence's)."""
    assert_same_state(world4[layout], world4["moe@2"], f"ep2 x dp4 -> {layout}")
    after, want = world4[f"{layout}-after"], world4["moe"]
    torch.testing.assert_close(torch.tensor(after["losses"]), torch.tensor(want["losses"][2:]),
                               rtol=1e-5, atol=0)
    # replicas were checked equal by assemble
    check_params(want, dict(after, replicas_equal=True), f"ep2 x dp4 -> {layout}, 2 steps on")


@pytest.mark.parametrize("saver", list(checkpoint_ep_jobs.SAVE_AGAIN))
def test_ep_checkpoint_saved_under_ep1_pp2_and_zero1(world4, saver):
    dims, ep = checkpoint_ep_jobs.SAVE_AGAIN[saver]
    got = world4[f"from-{saver}"]
    assert_same_state(got, world4[f"{saver}@3"], f"{saver} -> ep{ep} x dp{dims.dp}")
    assert all(st[2] == 3.0 for st in got["opt"].values())


def test_init_from_an_ep_checkpoint_loads_the_weights_only(world4):
    got = world4["ep4-init"]
    assert got["step"] == 0 and got["opt"] == {}
    for name, value in world4["moe@2"]["params"].items():
        assert torch.equal(got["params"][name], value), name


def test_experts_loaded_into_the_wrong_slots_are_caught(world4):
    """The planted bug (tests/checkpoint_ep_jobs.py): each rank's loaded expert rows reversed."""
    got, want = world4["planted"], world4["moe@2"]
    with pytest.raises(AssertionError, match="experts"):
        assert_same_state(got, want, "planted")
    dense = [n for n in want["params"] if ".experts." not in n]
    assert all(torch.equal(got["params"][n], want["params"][n]) for n in dense)


def test_expert_tp_slices_loaded_swapped_are_caught(world4):
    """The planted bug of TP inside experts (tests/checkpoint_ep_jobs.py): each tp2 x ep2 rank
    keeps the other TP rank's slice of its expert rows."""
    got, want = world4["planted-tp"], world4["moe@2"]
    with pytest.raises(AssertionError, match="experts"):
        assert_same_state(got, want, "planted")


def test_single_process_loads_an_ep_checkpoint(world4):
    from commpipe.train.loop import Trainer

    cfg = checkpoint_ep_jobs.moe_cfg(ParallelDims(), 1).resolve(1)
    trainer = Trainer.build(cfg)
    checkpoint.load(trainer, world4["moe_ckpt"])
    for name, p in trainer.named_params:
        assert torch.equal(p.detach(), world4["moe@2"]["params"][name]), name
    meta = checkpoint.read_meta(world4["moe_ckpt"])
    assert meta["layout"]["ep"] == 2 and trainer.step == 2


def test_ep_resume_through_the_loop_and_its_report(world4):
    """--resume under ep2 x dp4 through the training loop continues exactly; its monitored run
    folder's report lists EP's all-to-all (tests/checkpoint_ep_jobs.check_report)."""
    assert world4["moe-resume"]["steps"] == [2, 3]
    for got, want in zip(world4["moe-resume"]["losses"], world4["moe"]["losses"][2:]):
        assert abs(got - want) <= 1e-6, (world4["moe-resume"]["losses"], world4["moe"]["losses"])
    checkpoint_ep_jobs.check_report(world4["monitored"])


def test_elastic_restart_of_an_ep_run_picks_an_ep_that_fits():
    """A restart keeps --ep where it divides the new dp and the experts, else the largest ep
    below it that does; the global batch is kept."""
    from commpipe.elastic.restart import elastic_config

    cfg = checkpoint_ep_jobs.moe_cfg(ParallelDims(dp=4), 4, zero1=True, out="unused",
                                     elastic=True, save_every=2)
    said = []
    for world, ep in ((4, 4), (2, 2), (1, 1)):
        new = elastic_config(cfg, world, restart=1, log=said.append)
        assert (new.dims.dp, new.ep, new.global_batch) == (world, ep, 8), (world, new.dims)
    assert said[0].startswith("commpipe: elastic: 2 ranks instead of the 4 of the command line "
                              "(tp1-cp1-pp1-dp4-ep4); running tp1-cp1-pp1-dp2-ep2")


def test_ep_zero1_run_restarts_elastically_on_one_rank(world4, tmp_path):
    """The ep2 x dp4 ZeRO-1 run's in-memory copy (experts gathered whole over each EP group,
    states from their ZeRO-1 owners), restored as a checkpoint, holds the state the run had:
    ep4 x dp4 loads it exactly, and the layout an elastic restart picks for one rank resumes
    from it through the training loop with the uninterrupted run's losses."""
    from commpipe.elastic.restart import elastic_config
    from commpipe.train.checkpoint_io import read_metadata
    from commpipe.train.loop import train

    assert checkpoint.read_meta(world4["peers_ckpt"])["from_peer_copies"]
    # written whole (one chunk each): a copy names none of the process groups a restart ends
    stored = read_metadata(world4["peers_ckpt"]).state_dict_metadata
    experts = [k for k in stored if ".experts.w" in k]
    assert experts and all(len(stored[k].chunks) == 1 for k in experts)
    assert_same_state(world4["ep4-from-peers"], world4["moe@2"], "peer copy -> ep4 x dp4")
    shutil.copytree(world4["peers_ckpt"], tmp_path / "checkpoints" / world4["peers_ckpt"].name)
    cfg = checkpoint_ep_jobs.moe_cfg(ParallelDims(dp=4), 2, zero1=True, out=str(tmp_path))
    cfg = elastic_config(cfg, 1, restart=1, log=lambda *_: None)
    assert (cfg.dims.world_size, cfg.ep) == (1, 1)
    hist = train(cfg, log=None)
    assert [r["step"] for r in hist] == [2, 3]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in hist]),
                               torch.tensor(world4["moe"]["losses"][2:]), rtol=1e-5, atol=0)


# -- single process: the CLI loop, resume, refusals, atomicity --------------------------------------
TINY = ["--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH), "--seed", "5"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *TINY, "--steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    return out


def test_cli_saves_and_resumes_exactly(tiny_run, tmp_path):
    root = tiny_run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert (root / "latest").read_text().strip() == "step_000004"
    meta = checkpoint.read_meta(root / "step_000002")
    assert meta["step"] == 2 and meta["data"]["step"] == 2
    out = tmp_path / "resumed"
    assert main(["train", *TINY, "--steps", "4", "--resume", str(root / "step_000002"),
                 "--out", str(out)]) == 0
    first = metrics(tiny_run)
    again = metrics(out)
    assert [r["step"] for r in again] == [2, 3]
    for got, want in zip(again, first[2:]):
        assert abs(got["loss"] - want["loss"]) <= 1e-6


def test_resume_in_the_same_folder_continues_metrics_without_repeats(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = metrics(run)
    assert [r["step"] for r in before] == [0, 1, 2, 3]
    # resume from the checkpoint of step 2: steps 2 and 3 run again and replace their records
    assert main(["train", *TINY, "--steps", "4", "--resume", str(run / "checkpoints" / "step_000002"),
                 "--out", str(run)]) == 0
    after = metrics(run)
    assert [r["step"] for r in after] == [0, 1, 2, 3]
    assert after[:2] == before[:2]
    for got, want in zip(after[2:], before[2:]):
        assert abs(got["loss"] - want["loss"]) <= 1e-6
    # the replaced records are kept beside it, not lost
    replaced = [json.loads(line) for line in (run / "metrics.replaced.jsonl").read_text().splitlines()]
    assert replaced == before[2:]


def test_resume_latest_skips_unfinished_saves(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    root = run / "checkpoints"
    # a save that crashed: its .tmp folder, and a `latest` naming a folder that never appeared
    (root / "step_000006.tmp").mkdir()
    (root / "step_000006.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (root / "latest").write_text("step_000006\n")
    assert checkpoint.find_checkpoint(run) == root / "step_000004"
    shutil.rmtree(root / "step_000004")
    (root / "latest").unlink()
    assert checkpoint.find_checkpoint(run) == root / "step_000002"
    # --resume without a checkpoint in OUT starts fresh (a requeued job may always pass it)
    assert checkpoint.find_checkpoint(tmp_path / "empty") is None


def test_refuses_another_model_shape(tiny_run, capsys):
    other = "arch=llama,layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"
    assert main(["train", *TINY, "--model", other, "--steps", "4",
                 "--resume", str(tiny_run)]) == 2
    err = capsys.readouterr().err
    assert "the model differs: layers=4 (checkpoint) vs 2 (this run)" in err
    assert main(["train", *TINY, "--steps", "4", "--resume", str(tiny_run / "nowhere")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_resume_under_another_global_batch_says_so(tiny_run, capsys):
    # it loads (a batch-size change is allowed), but is said, with the flag that keeps the batch
    assert main(["train", *TINY, "--global-batch", "2", "--steps", "5", "--resume", str(tiny_run)]) == 0
    out = capsys.readouterr().out
    assert "note: global batch 2, the checkpoint's was 4; pass --global-batch 4" in out
    assert main(["train", *TINY, "--steps", "5", "--resume", str(tiny_run)]) == 0
    assert "note: global batch" not in capsys.readouterr().out


def test_nan_stops_and_keeps_the_last_good_checkpoint(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    root = run / "checkpoints"
    shutil.rmtree(root / "step_000004")
    (root / "latest").write_text("step_000002\n")
    # an infinite learning rate from step 2 on: the update of step 2 makes the weights inf
    base = ["train", *TINY, "--steps", "6", "--lr", "inf", "--out", str(run), "--resume"]
    assert main([*base, "--save-every", "1"]) == 3
    err = capsys.readouterr().err
    assert "parameters became NaN or inf in the update of step 2" in err
    assert f"last good checkpoint is {root / 'step_000002'}" in err
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
    # without a save in between, the next loss is NaN: stopped at that step, nothing saved
    assert main(base) == 3
    err = capsys.readouterr().err
    assert "loss is nan" in err and "at step 3" in err
    assert checkpoint.find_checkpoint(run) == root / "step_000002"
