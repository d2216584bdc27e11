"""The planner prices only what `commpipe train` runs when it plans for commpipe's own runtime
(`--gpu cpu`): every layout it enumerates passes train's validation, and its option lists agree
with commpipe.runtime.features, the runtime's one definition."""

from __future__ import annotations

import pytest

from commpipe.models.spec import resolve_model
from commpipe.parallel.dims import ParallelDims
from commpipe.plan import layout as plan_layout
from commpipe.plan.cli_inputs import for_cluster
from commpipe.plan.cluster import default_cluster
from commpipe.plan.gpus import GPU
from commpipe.plan.layout import Job, enumerate_layouts
from commpipe.runtime.features import RECOMPUTE_MODES, RuntimeFeatures
from commpipe.schedules.registry import SCHEDULES
from commpipe.train.config import OptimConfig, TrainConfig

CPU = GPU("cpu", 0.05, 64.0, 10.0, 10.0, 1.0)


def test_option_lists_agree():
    opts = RuntimeFeatures.options()
    # the planner searches exactly the runtime's modes; it prices more (torchtitan's "op") when
    # --recompute fixes one, which `--gpu cpu` plans never do on their own
    assert set(opts["recompute"]) == set(plan_layout.SEARCHED_RECOMPUTE) == set(RECOMPUTE_MODES)
    assert set(RECOMPUTE_MODES) <= set(plan_layout.RECOMPUTE)
    assert set(opts["precision"]) <= set(plan_layout.PRECISIONS)
    assert set(opts["zero"]) <= set(plan_layout.ZERO_STAGES)


@pytest.mark.parametrize("gpus,precision", [(4, "fp32"), (8, "bf16")])
def test_every_planned_layout_is_accepted_by_train(gpus, precision):
    job = for_cluster(Job(global_batch=8, seq_len=512, precision=precision),
                      default_cluster(CPU, gpus, gpus))
    assert job.runtime == "commpipe"
    spec = resolve_model("tiny")
    layouts = enumerate_layouts(spec, job, gpus)
    assert {lay.recompute for lay in layouts} == set(RECOMPUTE_MODES)
    assert any(lay.zero == 1 for lay in layouts) and any(lay.cp > 1 for lay in layouts)
    # every named schedule is planned, the braided ones (STP, DualPipeV) included
    assert {lay.schedule for lay in layouts} == set(SCHEDULES)
    for lay in layouts:
        cfg = TrainConfig(model="tiny", dims=ParallelDims(dp=lay.dp, pp=lay.pp, cp=lay.cp, tp=lay.tp),
                          schedule=lay.schedule, vpp=lay.vpp, micro_batch_size=lay.micro_batch_size,
                          global_batch=job.global_batch, seq_len=job.seq_len, recompute=lay.recompute,
                          optim=OptimConfig(zero1=lay.zero == 1), precision=precision, device="cpu",
                          sequence_parallel=job.sequence_parallel)
        cfg.resolve(gpus)            # raises ValueError naming what train does not run
        assert cfg.features().zero == lay.zero, lay


def test_cpu_plans_refuse_what_the_runtime_cannot_run():
    with pytest.raises(ValueError, match="fp8"):
        for_cluster(Job(global_batch=8, seq_len=64, precision="fp8"), default_cluster(CPU, 4, 4))


@pytest.mark.parametrize("sp,overlap", [(True, True), (False, False)])
def test_cpu_plans_price_the_features_train_runs(sp, overlap):
    # the job `plan --gpu cpu` prices against the features `commpipe train` builds from the
    # same choices (--no-sequence-parallel; --no-dp-overlap standing for --no-overlap)
    job = for_cluster(Job(8, 64, precision="fp32", sequence_parallel=sp, dp_overlap=overlap),
                      default_cluster(CPU, 4, 4))
    cfg = TrainConfig(model="tiny", dims=ParallelDims(tp=2, cp=2), global_batch=8, seq_len=64,
                      sequence_parallel=sp, overlap=overlap, device="cpu").resolve(4)
    f = cfg.features()
    assert (job.sequence_parallel, job.pp_sharded) == (f.sequence_parallel, f.sequence_parallel)
    assert (job.dp_overlap, job.cp_overlap) == (f.overlap.dp, f.overlap.cp)
    assert job.cp_comm == "allgather" and job.runtime == "commpipe" and not job.tp_overlap
