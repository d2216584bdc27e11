"""The MoE family trains as one device computes: loss and pre-clip gradient norm of each of 3
steps, the last step's pre-clip gradients and the final parameters, against a plain loop over
the whole MoETransformer (fp32, CPU, gloo), with the tolerances of tests/test_equivalence.py.

The model's first layer is a dense MLP, the other three MoE layers. Under tp2 every MLP is split
over TP, each routed expert's width too (commpipe.parallel.tensor_moe; a probe checks the
shapes and placements). Layouts, in one launch of 4 processes (and one of 8): experts whole over
ep (ep 1) under tp2 x pp2, with 1f1b and unit by unit under dualpipev; expert parallelism
ep2 x dp4 (expert gradients summed over the 2 ranks holding the same experts), ep2 x pp2 under
1f1b, zbv, dualpipev and stp, ep2 x tp2, ep2 x dp4 with ZeRO-1 (expert states sharded over
those 2 ranks, dense ones over dp4), ep2 x dp4 with uneven micro-batches across the two EP
groups (3,3,1,1), and ep4 x dp8 on 8 ranks. Under the braided schedules (dualpipev, stp) the
stages run unit by unit, the EP all-to-alls on the edges between units
(commpipe.runtime.units_moe); a probe checks that path is taken. Planted bugs must fail the
comparison: expert gradients summed over the EP group, which holds *different* experts, instead
of over the ranks replicating them; unit by unit, the dispatch all-to-all's adjoint dropped;
ZeRO-1 sharding the experts' states over the whole DP group; uneven replicas weighted equally
instead of by their sample counts; and under ep2 x tp2 the routed experts' partial sums left out
of the TP all-reduce, the gate weights' gradient not summed over TP, and the down projection's
placement naming the wrong dimension.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from commpipe.models.moe import build_moe, moe_loss_sum
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.placement import place, placement
from commpipe.train.config import TrainConfig
from commpipe.train.source import make_source
from tests.dist_harness import assemble, spawn, train_jobs
from tests.reference import reference_loop
from tests.test_equivalence import check_against, check_grads, check_losses, make_cfg

# 4 layers: pp2 under zbv and dualpipev has 4 stages; the first a dense MLP (DeepSeek-style)
MODEL = ("arch=moe,layers=4,hidden=32,heads=4,kv_heads=2,vocab=128,experts=4,top_k=2,"
         "expert_ffn=16,shared_experts=1,dense_layers=1,dense_ffn=32,rope_theta=10000")


def moe_cfg(dims: ParallelDims, schedule: str = "1f1b", ep: int = 1, **kw) -> TrainConfig:
    return make_cfg(dims, schedule, model=MODEL, ep=ep, **kw)


def moe_reference_run(cfg: TrainConfig) -> dict:
    """One whole MoETransformer: the global batch in micro-batches of the trainer's size (the
    load-balancing loss is per micro-batch), summed cross-entropy plus each micro-batch's
    balancing term, divided by the global token count."""
    cfg.resolve(cfg.dims.world_size)
    model = build_moe(cfg.spec, cfg.seed)
    source = make_source(cfg, cfg.spec)

    def loss_at(step: int) -> torch.Tensor:
        inputs, labels = source.batch(step, cfg.global_batch, 0, 1)
        total = 0
        for x, y in zip(inputs.split(cfg.micro_batch_size), labels.split(cfg.micro_batch_size)):
            logits, aux = model(x)
            total = total + moe_loss_sum(logits, y, aux)
        return total / labels.numel()

    return reference_loop(cfg, model, loss_at)


@contextlib.contextmanager
def one_thread():
    """Tiny in-process runs: one intra-op thread (a second only spins on a shared 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        return moe_reference_run(moe_cfg(ParallelDims()))


def plant_expert_grads_over_ep(trainer) -> None:
    """Expert gradients summed over the EP group instead of the ranks holding the same experts."""
    reducer, make = trainer.reducer, trainer.reducer._make_buckets

    def over_ep(order):
        buckets = make(order)
        for b in buckets:
            if b.dim == "edp":
                b.dim = "ep"
        return buckets

    reducer._make_buckets = over_ep
    reducer.buckets = over_ep([p for b in reducer.buckets for p in b.params])


def plant_zero1_experts_over_dp(trainer) -> None:
    """ZeRO-1 shards the experts' states over the whole DP group instead of the edp ranks that
    replicate them: one reduce-scatter sums the gradients of different experts."""
    from commpipe.parallel.data import Bucket
    from commpipe.train.optim import make_optimizer

    reducer = trainer.reducer
    reducer._bucket = lambda params, dim: Bucket(params, reducer.comm.size("dp"), dim, "dp")
    reducer.buckets = reducer._make_buckets([p for b in reducer.buckets for p in b.params])
    reducer._begin_step()
    trainer.optimizer = make_optimizer(trainer.params, trainer.cfg, reducer)


def plant_replicas_weighted_equally(trainer) -> None:
    """Uneven micro-batches: each replica's loss is its own mean over its samples, averaged over
    the replicas, instead of every sample weighing the same."""
    prepare, cfg = trainer.prepare_batch, trainer.cfg

    def per_replica_mean(batch):
        *parts, _ = prepare(batch)
        rows = cfg.replica_microbatches(trainer.comm.local_rank("dp")) * cfg.micro_batch_size
        return (*parts, 1.0 / (rows * cfg.seq_len * cfg.dims.dp))

    trainer.prepare_batch = per_replica_mean


def probe_units(trainer) -> None:
    """Records whether the runtime runs its stages unit by unit."""
    trainer.test_log = {"units": trainer.runtime.units}


def plant_dispatch_adjoint_dropped(trainer) -> None:
    """Unit by unit, the dispatch all-to-all's adjoint dropped: the routing step's backward gets
    zeros for the rows it sent, so the router and everything before it lose the experts' part
    of their gradient."""
    from commpipe.parallel.comm import _done_handle

    probe_units(trainer)
    for module in trainer.stages.values():
        for experts in [m for m in module.modules() if hasattr(m, "unit_edges")]:
            def unit_edges(make=experts.unit_edges, comm=experts.comm):
                edges = make()
                issue = edges.dispatch.issue

                def dropped(t, backward):
                    if not backward:
                        return issue(t, backward)
                    return _done_handle(comm, t.new_zeros(sum(edges.ex.input_splits), t.shape[1]))

                edges.dispatch.issue = dropped
                return edges

            experts.unit_edges = unit_edges


def _tp_moe_layers(trainer) -> list:
    from commpipe.parallel.tensor_moe import TensorParallelMoELayer

    return [m for stage in trainer.stages.values() for m in stage.modules()
            if isinstance(m, TensorParallelMoELayer)]


def probe_expert_tp(trainer) -> None:
    """Records each expert tensor's shape and placement (is it split over TP, and how)."""
    probe_units(trainer)
    trainer.test_log["experts"] = {
        n: (tuple(p.shape), placement(p).tp_dim, placement(p).ep_sharded)
        for n, p in trainer.named_params if ".experts.w" in n}


def plant_routed_not_reduced_over_tp(trainer) -> None:
    """TP inside experts without the routed part's reduction: each rank adds its own experts'
    partial sums to the shared experts' TP-reduced output."""
    from commpipe.models.moe import MoELayer
    from commpipe.parallel.functional import reduce_from

    for layer in _tp_moe_layers(trainer):
        def unit_combine(y, r, shared, layer=layer):
            return MoELayer.combine(layer, y, r) + reduce_from(shared, layer.comm, "tp")

        layer.unit_combine = unit_combine


def plant_gate_grad_not_reduced_over_tp(trainer) -> None:
    """The gate weights' gradient left as each TP rank's partial sum (no `f` on them): the
    router and everything before it get a rank's share of the experts' part."""
    for layer in _tp_moe_layers(trainer):
        layer.weigh = lambda weights: weights


def plant_down_split_recorded_by_rows(trainer) -> None:
    """The experts' down projection (w2 [E, h, f], split over its f input columns) recorded as
    split by its h output rows: whatever reads the placement (checkpoints, the switch, this
    test's reassembly) puts the shards together the wrong way."""
    for layer in _tp_moe_layers(trainer):
        place(layer.experts.w2, tp_dim=1)


def run_ep_jobs(world: int, jobs: list) -> dict:
    """tests.dist_harness.run_jobs, with expert shards put back together: the experts a rank
    holds are rows [ep_rank * E/ep, ...) of each stacked expert weight."""
    per_rank = spawn(train_jobs, world, jobs)
    out = {}
    for key, cfg, *_ in jobs:
        results = [pr[key] for pr in per_rank]
        dense = [_without_experts(r) for r in results]   # replicated over ep too
        holders = {}
        for r in results:
            c = r["coords"]
            replica = c["dp"] * cfg.dims.cp + c["cp"]
            holders.setdefault((c["pp"], c["tp"], replica // cfg.ep), []).append((replica, r))
        merged = []
        for group in holders.values():
            group = [r for _, r in sorted(group, key=lambda x: x[0])]
            first = dict(group[0], params=dict(group[0]["params"]), grads=dict(group[0]["grads"]))
            for name in _expert_names(first):
                first["params"][name] = (torch.cat([r["params"][name][0] for r in group]),
                                         first["params"][name][1])
                first["grads"][name] = torch.cat([r["grads"][name] for r in group])
            merged.append(first)
        got = assemble(merged)
        got["replicas_equal"] &= assemble(dense)["replicas_equal"]
        out[key] = got
    return out


def _expert_names(result: dict) -> list[str]:
    return [n for n in result["params"] if ".experts.w" in n]


def _without_experts(result: dict) -> dict:
    keep = [n for n in result["params"] if ".experts.w" not in n]
    return dict(result, params={n: result["params"][n] for n in keep},
                grads={n: result["grads"][n] for n in keep})


LAYOUTS = {  # world 4
    "tp2-pp2-ep1": (ParallelDims(tp=2, pp=2), "1f1b", 1),
    "dp4-ep2": (ParallelDims(dp=4), "1f1b", 2),
    "dp2-pp2-ep2-1f1b": (ParallelDims(dp=2, pp=2), "1f1b", 2),
    "dp2-pp2-ep2-zbv": (ParallelDims(dp=2, pp=2), "zbv", 2),
    "dp2-pp2-ep2-dualpipev": (ParallelDims(dp=2, pp=2), "dualpipev", 2),
    "dp2-pp2-ep2-stp": (ParallelDims(dp=2, pp=2), "stp", 2),
    "dp2-tp2-ep2": (ParallelDims(dp=2, tp=2), "1f1b", 2),
    # TP inside the experts unit by unit (the braided runtime calls the layer's parts)
    "tp2-pp2-ep1-dualpipev": (ParallelDims(tp=2, pp=2), "dualpipev", 1),
    # ZeRO-1: dense states sharded over dp4, the experts' over the 2 ranks replicating them
    "dp4-ep2-zero1": (ParallelDims(dp=4), "1f1b", 2, {"zero1": True}),
    # uneven DP across the two EP groups (one count inside each)
    "dp4-ep2-uneven": (ParallelDims(dp=4), "1f1b", 2, {"dp_microbatches": (3, 3, 1, 1)}),
}


@functools.cache
def results_of(world: int) -> dict:
    if world == 8:
        return run_ep_jobs(8, [("dp8-ep4", moe_cfg(ParallelDims(dp=8), ep=4))])
    jobs = [(key, moe_cfg(d, sched, ep, **(kw[0] if kw else {})), probe_expert_tp)
            for key, (d, sched, ep, *kw) in LAYOUTS.items()]
    jobs.append(("planted-dp4-ep2", moe_cfg(ParallelDims(dp=4), ep=2), plant_expert_grads_over_ep))
    jobs.append(("planted-dualpipev-adjoint", moe_cfg(ParallelDims(dp=2, pp=2), "dualpipev", 2),
                 plant_dispatch_adjoint_dropped))
    jobs.append(("planted-zero1-experts-over-dp", moe_cfg(ParallelDims(dp=4), ep=2, zero1=True),
                 plant_zero1_experts_over_dp))
    jobs.append(("planted-uneven-equal-weights",
                 moe_cfg(ParallelDims(dp=4), ep=2, dp_microbatches=(3, 3, 1, 1)),
                 plant_replicas_weighted_equally))
    for plant in (plant_routed_not_reduced_over_tp, plant_gate_grad_not_reduced_over_tp,
                  plant_down_split_recorded_by_rows):
        jobs.append((f"planted-{plant.__name__}", moe_cfg(ParallelDims(dp=2, tp=2), ep=2), plant))
    return run_ep_jobs(4, jobs)


def test_one_rank_matches_reference(reference):
    """ep 1 on one rank, in this process: the family's stages, runtime, loss and optimizer."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    cfg = moe_cfg(ParallelDims()).resolve(1)
    with one_thread():
        trainer = Trainer.build(cfg, Comm(cfg.dims, 0))
        trainer.capture_grads = True
        records = [trainer.train_step() for _ in range(cfg.steps)]
    got = {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
           "params": {n: p.detach() for n, p in trainer.named_params},
           "grads": trainer.last_grads, "replicas_equal": True}
    check_against(reference, got, "one rank")


@pytest.mark.parametrize("world", [4, 8])
def test_layouts_match_single_device(world, reference):
    for key, got in results_of(world).items():
        if not key.startswith("planted-"):
            check_against(reference, got, key)


def test_braided_schedules_run_moe_stages_by_units():
    """dualpipev and stp hide the EP all-to-alls only if their stages run unit by unit; the
    other schedules run them whole."""
    for key in [*LAYOUTS, "planted-dualpipev-adjoint"]:
        logs, braided = results_of(4)[key]["logs"], any(s in key for s in ("dualpipev", "stp"))
        assert logs and all(log["units"] == braided for log in logs), (key, logs)


def test_dropped_dispatch_adjoint_is_caught(reference):
    got = results_of(4)["planted-dualpipev-adjoint"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted")
    check_losses({"losses": reference["losses"][:1]}, {"losses": got["losses"][:1]}, "planted")


def test_expert_grads_reduced_over_ep_is_caught(reference):
    got = results_of(4)["planted-dp4-ep2"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted")
    # the first step's loss comes before any reduction; later ones follow the wrong update
    check_losses({"losses": reference["losses"][:1]}, {"losses": got["losses"][:1]}, "planted")


@pytest.mark.parametrize("key", ["planted-zero1-experts-over-dp", "planted-uneven-equal-weights"])
def test_zero1_and_uneven_dp_bugs_are_caught(key, reference):
    """ZeRO-1 sharding an expert's state over the whole DP group, and uneven replicas weighted
    equally instead of by their sample counts, must fail the gradient comparison."""
    got = results_of(4)[key]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted")


def test_experts_split_over_tp():
    """With tp2 every routed expert holds half its width: gate and up [E/ep, f/2, h] split by
    output columns (tp_dim 1), down [E/ep, h, f/2] by input columns (tp_dim 2)."""
    h, f, experts = 32, 16, 4
    for key, (dims, _, ep) in [(k, v[:3]) for k, v in LAYOUTS.items()]:
        tp = dims.tp
        for log in results_of(4)[key]["logs"]:
            for name, (shape, tp_dim, ep_sharded) in log["experts"].items():
                down = name.endswith("w2")
                want = (experts // ep, h, f // tp) if down else (experts // ep, f // tp, h)
                assert shape == want, (key, name, shape, want)
                assert tp_dim == ((2 if down else 1) if tp > 1 else None), (key, name, tp_dim)
                assert ep_sharded == (ep > 1), (key, name)


@pytest.mark.parametrize("plant", ["plant_routed_not_reduced_over_tp",
                                   "plant_gate_grad_not_reduced_over_tp"])
def test_tp_inside_experts_bugs_are_caught(plant, reference):
    """The routed experts' partial sums not reduced over TP (the loss is already wrong), and
    the gate weights' gradient not summed over TP (the router's gradient is wrong)."""
    got = results_of(4)[f"planted-{plant}"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted")


def test_expert_down_split_recorded_by_rows_is_caught(reference):
    """A wrong tp_dim on the down projection: reassembled from its placement, w2 is not the
    one-device tensor (the run itself computes right: only the metadata is wrong)."""
    got = results_of(4)["planted-plant_down_split_recorded_by_rows"]
    check_losses(reference, got, "planted")
    with pytest.raises(AssertionError):
        check_against(reference, got, "planted")


def test_uneven_dp_inside_an_ep_group_is_refused():
    cfg = moe_cfg(ParallelDims(dp=4), ep=2, dp_microbatches=(3, 1, 2, 2))
    with pytest.raises(ValueError, match="replicas 0 to 1 form one expert-parallel group and "
                       "run 3,1 micro-batches.*e.g. --dp-microbatches 2,2,2,2"):
        cfg.resolve(4)


@pytest.mark.parametrize("ep,dp,why", [
    (3, 4, "--ep 3 does not divide dp\\*cp = 4\\*1 = 4 .*use --ep in \\[1, 2, 4\\]"),
    (8, 8, "--ep 8 does not divide the model's 4 experts; use --ep in \\[1, 2, 4\\]"),
])
def test_bad_ep_fails_before_launch(ep, dp, why):
    with pytest.raises(ValueError, match=why):
        moe_cfg(ParallelDims(dp=dp), ep=ep).resolve(dp)


def test_tp_that_does_not_divide_an_experts_width_is_refused():
    odd = MODEL.replace("expert_ffn=16", "expert_ffn=15")
    with pytest.raises(ValueError, match="--tp 2 does not divide expert_ffn = 15 .*use --tp in "
                       "\\[1\\]"):
        make_cfg(ParallelDims(tp=2, dp=2), "1f1b", model=odd, ep=2).resolve(4)


def test_ep_on_a_dense_model_says_what_to_change():
    with pytest.raises(ValueError, match="--ep 2 shards the experts of MoE models; tiny has none"):
        make_cfg(ParallelDims(dp=2), "1f1b", ep=2).resolve(2)


def test_family_builds_the_counted_stages():
    """The registration: stages of a split hold param_count parameters and chain through their
    boundaries (hidden states and the carried balancing term); layer costs add up to the FLOPs."""
    from commpipe.models.family import family_for_model
    from commpipe.models.moe import MoEOutput
    from commpipe.runtime.messages import as_stage_io

    family = family_for_model("moe-tiny")
    spec = family.resolve("moe-tiny")
    assert family.arch == "moe" and family_for_model(MODEL) is family
    stages = family.build_stages(spec, [range(0, 1), range(1, 2)], seed=0, device="cpu")
    assert family.param_count(spec, 16) == sum(p.numel() for s in stages for p in s.parameters())
    ios = as_stage_io(family.stage_io(spec, [1, 1], micro_batch=2, seq_len=16), 2)
    assert [d.name for d in ios[0].send] == ["hidden", "aux"]
    assert 3 * sum(family.layer_costs(spec, 16)) == family.flops_per_unit(spec, 16)
    tokens = torch.randint(0, spec.vocab, (2, 16))
    mid = stages[0](tokens=tokens)
    out = stages[1](**mid)["logits"]
    whole = build_moe(spec, 0)
    logits, aux = whole(tokens)
    torch.testing.assert_close(out.logits, logits)
    loss = family.loss_sum(MoEOutput(logits, aux), tokens)
    torch.testing.assert_close(loss, moe_loss_sum(logits, tokens, aux))
    assert aux > 0


def test_ep_from_a_job_file_and_a_run_config(tmp_path):
    """--ep is a [parallelism] key of a job TOML and reads back from a run's config.json."""
    import argparse
    import json

    from commpipe.train import cli as train_cli
    from commpipe.train.jobconfig import parse_known_args

    def config(argv):
        parser = argparse.ArgumentParser()
        train_cli.add_arguments(parser)
        args, rest = parse_known_args(parser, argv)
        assert rest == []
        return train_cli.config_from_args(args)

    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nmodel = "moe-tiny"\n[parallelism]\ndp = 4\nep = 2\n')
    cfg = config(["--config", str(toml)]).resolve(4)
    assert (cfg.ep, cfg.dims.dp) == (2, 4)
    run = tmp_path / "config.json"
    run.write_text(json.dumps(cfg.to_dict(), default=str))
    assert config(["--config", str(run)]).ep == 2
