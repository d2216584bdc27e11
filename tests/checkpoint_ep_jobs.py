"""The expert-parallel jobs of tests/test_checkpoint.py's launch of 4 gloo processes: a MoE run
saved under ep2 x dp4 and loaded under ep1 x dp4, ep4 x dp4, ep2 x dp2 x pp2 and ep2 x dp4 with
ZeRO-1 (dense AdamW states sharded over dp4, the experts' over the 2 ranks replicating them);
the ep1, pp2 and ZeRO-1 runs save again, loaded under ep2 x dp4 and ep4 x dp4; the ZeRO-1 run
also keeps a copy of its state in memory for an elastic restart (commpipe.train.peer_copies),
restored as a checkpoint that ep4 x dp4 loads here and one process (the layout an elastic
restart picks for 1 rank) loads in tests/test_checkpoint.py; a resume under ep2 x dp4 through
the training loop with the communication monitor on, whose run folder `check_report` reads; a
run started from the weights only; and two planted bugs (each rank puts the rows it loaded into
its experts in reverse order; under tp2 x ep2 each keeps the other TP rank's slice of its expert
rows) that the comparisons must catch. The tp2 x ep2 layout (each expert split over TP too)
loads the ep2 x dp4 checkpoint and saves one that ep1 x dp4 (no TP, no EP) loads.

Snapshots hold full tensors: each rank all-gathers its experts' rows (and their AdamW moments)
over its ep group in group order, so tests/test_checkpoint.py's `assemble` compares them as
replicated parameters.
"""

from __future__ import annotations

from pathlib import Path

from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.placement import placement
from commpipe.train import checkpoint, checkpoint_shards
from commpipe.train.config import OptimConfig, TrainConfig

# 4 experts (ep 1, 2 and 4 on 4 ranks), 2 layers (pp2), tiny enough for the shared 2-core host;
# hidden 64: a dispatch moves 8 KiB per rank, above the report's 4 KiB bandwidth threshold (the
# 32-byte row counts before it have records of their own)
MOE = ("arch=moe,layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,experts=4,top_k=2,"
       "expert_ffn=16,shared_experts=1,rope_theta=10000")
SAVED_AT, MORE = 2, 2     # the uninterrupted run: saved after step 2, then 2 more steps

LAYOUTS = {  # key: (dims, ep[, ZeRO-1]); every one loads the ep2 x dp4 checkpoint
    "ep1-dp4": (ParallelDims(dp=4), 1),
    "ep4-dp4": (ParallelDims(dp=4), 4),
    "ep2-dp2-pp2": (ParallelDims(dp=2, pp=2), 2),
    "ep2-dp4-zero1": (ParallelDims(dp=4), 2, True),
    # each expert also split over tp2 (gate and up by columns, down by its input columns)
    "ep2-dp2-tp2": (ParallelDims(dp=2, tp=2), 2),
}
SAVE_AGAIN = {  # key of LAYOUTS that saves after step 3: (dims, ep) that loads that checkpoint
    "ep1-dp4": (ParallelDims(dp=4), 2),           # whole expert tensors read as ep2 shards
    "ep2-dp2-pp2": (ParallelDims(dp=4), 4),       # pp2's shards read as ep4's
    "ep2-dp4-zero1": (ParallelDims(dp=4), 4),     # states written by their ZeRO-1 owners
    "ep2-dp2-tp2": (ParallelDims(dp=4), 1),       # tp2 x ep2 expert slices read whole
}
PEERS = "ep2-dp4-zero1"      # takes the in-memory copy right after loading (step 2)


def moe_cfg(dims: ParallelDims, ep: int, zero1: bool = False, **kw) -> TrainConfig:
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, eps=1e-4, zero1=zero1)
    return TrainConfig(model=MOE, dims=dims, ep=ep, schedule="1f1b", global_batch=8,
                       micro_batch_size=1, seq_len=16, steps=SAVED_AT + MORE, seed=5, optim=optim,
                       **kw)


def snapshot(trainer) -> dict:
    """tests/test_checkpoint.py's snapshot with every expert tensor gathered whole."""
    comm = trainer.comm
    adam, holds = checkpoint.adam_and_holder(trainer)

    def whole(t, p):
        if not checkpoint_shards.ep_sharded(p):
            return t.detach().clone()
        return comm.all_gather(t.detach().contiguous(), "ep")   # rows in ep group order

    opt = {}
    for name, p in trainer.named_params:
        st = adam.state.get(p)
        if holds(p) and st:   # the same answer on every rank of an ep group
            opt[name] = (whole(st["exp_avg"], p), whole(st["exp_avg_sq"], p), float(st["step"]))
    return {"coords": comm.coords, "step": trainer.step,
            "params": {n: (whole(p, p), placement(p).tp_dim)
                       for n, p in trainer.named_params}, "opt": opt}


def plant_experts_in_the_wrong_slots() -> None:
    """The planted bug: each rank copies the expert rows it loaded (weights and moments) into
    its experts in reverse order."""
    right = checkpoint_shards.local_part

    def wrong(loaded, p, comm):
        part = right(loaded, p, comm)
        return part.flip(0) if checkpoint_shards.ep_sharded(p) else part

    checkpoint_shards.local_part = wrong
    checkpoint.local_part = wrong


def plant_expert_tp_slices_swapped():
    """The planted bug of TP inside experts: each rank keeps the other TP rank's slice of the
    expert rows it loaded. Returns the undo."""
    right = checkpoint_shards.local_part

    def wrong(loaded, p, comm):
        tp_dim = placement(p).tp_dim
        if not checkpoint_shards.ep_sharded(p) or tp_dim is None:
            return right(loaded, p, comm)
        rows = loaded.to_local()
        return rows.chunk(comm.size("tp"), tp_dim)[comm.size("tp") - 1 - comm.local_rank("tp")]

    checkpoint_shards.local_part = checkpoint.local_part = wrong

    def undo():
        checkpoint_shards.local_part = checkpoint.local_part = right

    return undo


def run(rank: int, root: Path, build) -> dict:
    """Every expert-parallel job on this rank; `build(cfg, rank)` resolves and builds a Trainer."""
    from commpipe.train.loop import train
    from commpipe.train.weights import load_weights

    res = {}
    e = build(moe_cfg(ParallelDims(dp=4), 2), rank)
    losses = [e.train_step()["loss"] for _ in range(SAVED_AT)]
    res["moe@2"] = snapshot(e)
    ck = checkpoint.save(e, root / "moe")
    losses += [e.train_step()["loss"] for _ in range(MORE)]
    res["moe"] = dict(snapshot(e), losses=losses)
    hist = train(moe_cfg(ParallelDims(dp=4), 2, resume=str(ck), monitor=1.0,
                         out=str(root / "monitored")), log=None)
    res["moe-resume"] = {"losses": [r["loss"] for r in hist], "steps": [r["step"] for r in hist]}
    again = {}
    for key, (dims, ep, *zero1) in LAYOUTS.items():
        t = build(moe_cfg(dims, ep, *zero1), rank)
        checkpoint.load(t, ck)
        res[key] = snapshot(t)
        if key == PEERS:
            restored = copy_and_restore(t, root / "peers")
        steps = [t.train_step()["loss"]]
        if key in SAVE_AGAIN:            # saved after step 3, loaded below under another ep
            res[f"{key}@3"] = snapshot(t)
            again[key] = checkpoint.save(t, root / key)
        steps.append(t.train_step()["loss"])
        res[key + "-after"] = dict(snapshot(t), losses=steps)
    for key, (dims, ep) in SAVE_AGAIN.items():
        t = build(moe_cfg(dims, ep), rank)
        checkpoint.load(t, again[key])
        res[f"from-{key}"] = snapshot(t)
    t = build(moe_cfg(ParallelDims(dp=4), 4), rank)
    checkpoint.load(t, restored)
    res["ep4-from-peers"] = snapshot(t)
    t = build(moe_cfg(ParallelDims(dp=4), 4), rank)      # --init-from: weights only
    load_weights(t, ck)
    res["ep4-init"] = snapshot(t)
    undo = plant_expert_tp_slices_swapped()
    t = build(moe_cfg(ParallelDims(dp=2, tp=2), 2), rank)
    checkpoint.load(t, ck)
    res["planted-tp"] = snapshot(t)
    undo()
    plant_experts_in_the_wrong_slots()                   # last: the modules stay planted
    t = build(moe_cfg(ParallelDims(dp=2, pp=2), 2), rank)
    checkpoint.load(t, ck)
    res["planted"] = snapshot(t)
    return res


def copy_and_restore(trainer, out: Path) -> Path:
    """The elastic path's in-memory copy of `trainer`'s state (every part in this one node's
    shared memory, as on a restart of its workers), written back as checkpoint
    out/checkpoints/step_N by the ranks holding its parts; the copies are then removed."""
    from commpipe.train.peer_copies import PeerCopies, restore

    out.mkdir(parents=True, exist_ok=True)
    copies = PeerCopies(out, 1)
    copies.take(trainer)
    try:
        return restore(trainer, out, after=None)
    finally:
        copies.close()


def a2a_bytes_per_step(cfg: TrainConfig, ep: int) -> tuple[int, int]:
    """(payload, row-count) all-to-all bytes one ep group's ranks post per step, summed over
    them, from the model's shape (commpipe.parallel.expert): per MoE layer and micro-batch,
    dispatch and combine forward and both again backward, each moving the group's tokens x
    top_k rows of `hidden` fp32 once in total; and before them the row counts (E int64 per
    rank)."""
    spec = cfg.spec
    per_rank = cfg.global_batch // cfg.dims.dp            # micro-batches of 1 sequence
    rows = ep * cfg.micro_batch_size * cfg.seq_len * spec.top_k
    return (spec.layers * per_rank * 4 * rows * spec.hidden * 4,
            spec.layers * per_rank * ep * spec.experts * 8)


def check_report(run_dir: Path) -> None:
    """`commpipe report` of the monitored ep2 x dp4 run lists EP like the other dimensions."""
    import csv
    import json

    from commpipe.parallel.expert import COUNTS_OP, ep_groups
    from commpipe.report.cli import write_report
    from commpipe.report.links import class_summary, link_rows, rank_matrices
    from commpipe.report.tables import terminal_table

    cfg = moe_cfg(ParallelDims(dp=4), 2).resolve(4)
    eps, edps = ep_groups(cfg.dims, 2)                     # [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    records = [json.loads(line) for r in range(4)
               for line in (run_dir / "monitor" / f"rank{r}.jsonl").read_text().splitlines()]
    a2a = [r for r in records if r["dim"] == "ep" and r["op"] == "all_to_all"]
    counts = [r for r in records if r["dim"] == "ep" and r["op"] == COUNTS_OP]
    assert {r["step"] for r in a2a} == {r["step"] for r in counts} == {2, 3}   # the resumed steps
    for step in (2, 3):
        for group in eps:                                   # the traffic the layer's shape implies
            got = [sum(r["bytes"] for r in recs if r["step"] == step and r["rank"] in group)
                   for recs in (a2a, counts)]
            assert tuple(got) == a2a_bytes_per_step(cfg, 2), (step, group, got)
    for r in a2a:                                           # nccl-tests alltoall: (n-1)/n
        assert r["group"] in eps and r["link_class"] == "intra_node"
        if r["bandwidth_gbps"]:
            assert abs(r["busbw_gbps"] - r["bandwidth_gbps"] / 2) <= 1e-12 * r["bandwidth_gbps"]

    out = write_report(run_dir)
    (row,) = out["rows"]
    assert row["label"] == "TP1/CP1/PP1/DP4/EP2" and row["ep"] == 2
    assert row["ep_bw_gbps"] > 0 and row["ep_latency_ms"] > 0 and row["ep_intra_gbps"] > 0
    summary = {(s["dim"], s["link_class"]): s for s in class_summary(link_rows(run_dir))}
    assert summary[("ep", "intra_node")]["links"] == len(eps)
    assert summary[("dp", "intra_node")]["links"] == 1 + len(edps)   # dp_cp and the edp groups
    mats = rank_matrices(link_rows(run_dir), 4)
    pairs = {(i, j) for g in eps for i in g for j in g if i != j}
    assert {(i, j) for i in range(4) for j in range(4) if mats["ep"][i][j]} == pairs
    html = (run_dir / "report.html").read_text()
    assert "<td>EP</td>" in html and "EP GB/s" in html
    with open(run_dir / "results.csv") as f:
        (line,) = csv.DictReader(f)
    assert line["ep"] == "2" and float(line["ep_bw_gbps"]) > 0
    table = terminal_table(out["rows"]).splitlines()
    assert table[0].split()[-3:] == ["EP", "intra", "Loss"]      # one node: no inter-node column
    assert table[2].startswith("TP1/CP1/PP1/DP4/EP2 ")
