"""Planner on CPU hosts: gloo rings, one NIC per node, rank placement, commpipe's own runtime,
host contention and host-term calibration (benchmarks/plan_vs_sweep.py relies on these).

    python -m pytest -q tests/test_plan_host.py
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from commpipe.cli import main
from commpipe.models.spec import resolve_model
from commpipe.plan.calibrate import Point, fit, predict
from commpipe.plan.cluster import Link
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout
from commpipe.plan.memory import stage_params
from commpipe.plan.timing import stage_costs

H100 = resolve_gpu("h100")


# -- CPU hosts, gloo and commpipe's own runtime (benchmarks/plan_vs_sweep.py) ----------------------
DEMO_LIKE = "arch=llama,layers=2,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"


def _cpu_cluster(**kw):
    gpu = resolve_gpu("name=cpu,tflops=0.1,mem_gb=16,hbm_gbps=40")
    from commpipe.plan.cluster import Cluster
    return Cluster(gpu, 8, 2, Link(1.0, 1e-4), Link(0.01, 2e-4), **kw)


def test_gloo_rings_and_one_nic_per_node():
    c = _cpu_cluster(backend="gloo", nics_per_node=1)
    # 4 ranks on 2 nodes: one shared link per node -> bus bandwidth 0.01 GB/s (not 2 x 0.01);
    # gloo's ring all-reduce pays 2(n-1) = 6 latency steps, all-gather n-1 = 3
    assert c.all_reduce(1e6, 4, 1) == pytest.approx(2 * 3 / 4 * 1e6 / 1e7 + 6 * 2e-4)
    assert c.all_gather(1e6, 4, 1) == pytest.approx(3 / 4 * 1e6 / 1e7 + 3 * 2e-4)
    # commpipe's gloo reduce-scatter: the same bytes in one all-to-all round, one latency step
    assert c.reduce_scatter(1e6, 4, 1) == pytest.approx(3 / 4 * 1e6 / 1e7 + 1 * 2e-4)
    # tp2 x dp2 on the same nodes: the DP groups {0, 2} and {1, 3} both cross through each
    # node's one link at once, each at half its rate (0.005 GB/s), 2(n-1) = 2 latency steps
    assert c.all_reduce(1e6, 2, 2) == pytest.approx(2 * 1 / 2 * 1e6 / 5e6 + 2 * 2e-4)
    # with a NIC per GPU (the default) nothing is shared
    assert _cpu_cluster(backend="gloo").all_reduce(1e6, 2, 2) == pytest.approx(
        2 * 1 / 2 * 1e6 / 1e7 + 2 * 2e-4)
    # NCCL with a NIC per GPU: 2 links per node, 2*ceil(log2 4) = 4 steps
    n = _cpu_cluster()
    assert n.all_reduce(1e6, 4, 1) == pytest.approx(2 * 3 / 4 * 1e6 / 2e7 + 4 * 2e-4)
    assert n.reduce_scatter(1e6, 4, 1) == n.all_gather(1e6, 4, 1) == pytest.approx(
        3 / 4 * 1e6 / 2e7 + 2 * 2e-4)


def test_an_all_to_alls_senders_on_a_node_link():
    """Every EP group dispatches at once, so a node's one link carries the members there of
    each group crossing it: ep4 over 2 nodes of 2 has both of a node's ranks in one group; tp2 x
    ep2 has one in each of two; EP groups inside their nodes send nothing across."""
    from commpipe.adapt.model_links import groups_of
    from commpipe.layout import Layout as PlanLayout
    from commpipe.plan.cluster import groups_on_a_node_link, ranks_on_a_node_link

    def node(r):
        return r // 2

    def plan(**kw):
        return PlanLayout(**({"tp": 1, "cp": 1, "pp": 1, "dp": 4, "stage_layers": (2,),
                             "schedule": "1f1b", "microbatches": 1, "micro_batch_size": 1} | kw))
    ep4 = groups_of(plan(ep=4), "ep")
    assert ep4 == [[0, 1, 2, 3]]
    assert ranks_on_a_node_link(ep4, node, ep4[0]) == 2
    assert groups_on_a_node_link(ep4, node, ep4[0]) == 1          # one group, two senders
    across = groups_of(plan(tp=2, dp=2, ep=2), "ep")
    assert sorted(map(sorted, across)) == [[0, 2], [1, 3]]
    assert ranks_on_a_node_link(across, node, across[0]) == 2
    inside = groups_of(plan(ep=2), "ep")
    assert sorted(map(sorted, inside)) == [[0, 1], [2, 3]]
    assert ranks_on_a_node_link(inside, node, inside[0]) == 1
    assert sorted(map(sorted, groups_of(plan(ep=2), "edp"))) == [[0, 2], [1, 3]]


def test_node_of_places_groups_and_pipeline_links():
    from commpipe.cluster.grids import Layout as GridLayout
    from commpipe.cluster.grids import node_of_rank

    # TP2 x PP4 with TP outermost (the demo's tp2x-pp4), 2 ranks per node: the sweep's own map
    nodes = tuple(node_of_rank(GridLayout(tp=2, pp=4, placement="cp-dp-pp-tp"), 2))
    assert nodes == (0, 2, 0, 2, 1, 3, 1, 3)
    c = _cpu_cluster(node_of=nodes)
    assert c.placement(2, 1) == (False, 1)              # TP partners 0, 1 sit on nodes 0 and 2
    # pipeline ranks 0, 2, 4, 6 (stride tp=2): nodes 0, 0, 1, 1
    assert [c.p2p_link(a, a + 2) is c.intra for a in (0, 2, 4)] == [True, False, True]
    with pytest.raises(ValueError, match="one node per rank"):
        _cpu_cluster(node_of=(0, 0, 1))


def test_runtime_job_prices_what_commpipe_sends():
    from commpipe.plan.compute import layer_compute
    from commpipe.plan.layout import runtime_job
    from commpipe.runtime.features import Overlap, RuntimeFeatures

    spec = resolve_model(DEMO_LIKE)
    c = _cpu_cluster(backend="gloo")                   # tp and cp groups inside a node (2 per node)
    c = replace(c, gpus_per_node=4)
    call = 5e-4
    eff = Efficiency(coll_overhead_s=call)
    # commpipe train --no-sequence-parallel --no-overlap
    plain = runtime_job(RuntimeFeatures(sequence_parallel=False, overlap=Overlap.none()))
    assert not plain["dp_overlap"] and not plain["cp_overlap"] and not plain["pp_sharded"]
    job = Job(8, 32, precision="fp32", **plain)
    costs = stage_costs(spec, Layout(tp=2, cp=2, dp=2), job, c, eff)
    tokens = 32 / 2                                     # b * s / cp
    act = 4 * tokens * 64                               # fp32 [b, s/cp, h] = 4096 bytes
    ar = lambda nbytes: 2 * (1 / 2) * nbytes / 1e9 + 2 * 1e-4     # gloo ring, n = 2
    # per layer 2 all-reduces forward; embedding 1 all-reduce; vocabulary-parallel CE 3 of 4 B/token
    tp_f = 2 * 2 * (ar(act) + call) + (ar(act) + call) + 3 * (ar(4 * tokens) + call)
    assert costs.tp_f[0] == pytest.approx(tp_f)
    # CP: all-gather K and V (4 * tokens * kv_dim / tp bytes each, gathered over 2) per layer
    kv = 4 * tokens * 32 / 2
    ag = (1 / 2) * (2 * kv) / 1e9 + 1 * 1e-4
    assert costs.cp_f[0] == pytest.approx(2 * 2 * (ag + call))
    assert costs.p2p_bytes == act                       # full activations between stages
    # host CPU inside those collectives: one call overhead per collective call
    assert costs.host_f[0] == pytest.approx((2 * 2 + 2 * 2 + 1 + 3) * call)
    # what train runs by default: SP (pipeline messages carry the TP shards), DP buckets during
    # the backward, and the K/V gather overlapped with attention over the rank's own chunk
    default = runtime_job()
    assert default == runtime_job(RuntimeFeatures()) and default["dp_overlap"]
    job = Job(8, 32, precision="fp32", **default)
    lay = Layout(tp=2, cp=2, dp=2)
    sp = stage_costs(spec, lay, job, c, eff)
    assert sp.p2p_bytes == act / 2
    own_attn = layer_compute(spec, lay, job, c, eff)["attn"] / 2
    assert sp.cp_f[0] == pytest.approx(2 * max(0.0, 2 * (ag + call) - own_attn))
    assert sp.cp_b[0] == costs.cp_b[0]                  # gradients reduce-scattered after, exposed
    # SP makes each layer's two all-reduces as 2 all-gathers and 2 reduce-scatters (the same
    # bytes and latency steps on gloo's ring): twice the calls. The embedding's output is
    # reduce-scattered, the head's input gathered (commpipe's gloo reduce-scatter: one round)
    gather = scatter = (1 / 2) * act / 1e9 + 1 * 1e-4 + call
    head = gather + 3 * (ar(4 * tokens) + call)
    assert sp.tp_f[0] == pytest.approx(2 * (2 * ar(act) + 4 * call) + scatter + head)
    assert sp.host_f[0] == pytest.approx((2 * (4 + 2) + 1 + 4) * call)


def test_step_syncs_and_optimizer_host_time():
    spec = resolve_model(DEMO_LIKE)
    c = _cpu_cluster(backend="gloo")
    eff = Efficiency(coll_overhead_s=1e-3, optimizer_overhead_s=2e-3)
    job = Job(8, 32, precision="fp32", step_syncs=True)
    lay = Layout(tp=2, pp=2, dp=2)
    costs = stage_costs(spec, lay, job, c, eff)
    # grad norm over tp (ranks 0,1: node 0) and pp (ranks 0,4: nodes 0,2); loss over dp (0,2:
    # nodes 0,1) and pp; each an all-reduce of 8 bytes plus one call overhead
    intra = 2 * 8 / 2 / 1e9 + 2 * 1e-4
    inter = 2 * 8 / 2 / 1e7 + 2 * 2e-4
    assert costs.step_sync[0] == pytest.approx(intra + 3 * inter + 4 * 1e-3)
    # optimizer host time: rank 0 holds 1 layer + the embedding, rank 1 one layer + the head
    hbm = 40e9 * 0.8
    params = [p for _, p in stage_params(spec, lay, job)]
    assert costs.optimizer == pytest.approx([p * 24 / hbm + 2 * 2e-3 for p in params])


def test_busy_overlap_by_hand():
    from commpipe.plan.pipeline import busy_overlap

    free = dict(latency_ms=0.0, bandwidth_gbps=1e12, activation_bytes=1.0)
    # one rank: n(t) = 1 whenever it works; weighted by a CPU share of 1/2: n = 1/2
    assert busy_overlap("1f1b", 1, 1, 4, [1.0], [2.0], [1.0], [1.0], **free) == pytest.approx(1.0)
    half = {op: [0.5] for op in "FBIW"}
    assert busy_overlap("1f1b", 1, 1, 4, [1.0], [2.0], [1.0], [1.0], **free, cpu_share=half) == \
        pytest.approx(0.5)
    # GPipe, 2 stages, 2 micro-batches, f = b = 1: rank 0 F F . . B B, rank 1 . F F B B; both
    # busy in [1,2] and [4,5]: integral of n = 8, of n^2 = 1+4+1+1+4+1 = 12 -> 1.5
    assert busy_overlap("gpipe", 2, 1, 2, [1.0, 1.0], [1.0, 1.0], [0.5, 0.5], [0.5, 0.5], **free) == \
        pytest.approx(1.5)


def test_host_contention_stretches_a_fully_busy_host():
    from commpipe.plan.host import contended

    spec = resolve_model(DEMO_LIKE)
    c = replace(_cpu_cluster(backend="gloo"), intra=Link(1e12, 0.0), inter=Link(1e12, 0.0))
    eff = Efficiency(overhead_s=1e-4, optimizer_overhead_s=1e-4)
    job, lay = Job(8, 32, precision="fp32"), Layout(dp=4)
    alone = estimate(spec, lay, job, replace(c, num_gpus=4), eff)
    # four ranks that only compute, on 2 cores: all four always busy -> kappa = 4/2 = 2, and
    # every second of the step (compute, optimizer) takes twice as long
    shared = estimate(spec, lay, job, replace(c, num_gpus=4, host_cores=2), eff)
    assert shared.host_contention == pytest.approx(2.0, rel=1e-3)
    assert shared.step_time_s == pytest.approx(2 * alone.step_time_s, rel=1e-3)
    # as many cores as ranks: no contention
    own = estimate(spec, lay, job, replace(c, num_gpus=4, host_cores=4), eff)
    assert own.step_time_s == pytest.approx(alone.step_time_s)
    # four cores that run three lone ranks' worth at once (measure_core_capacity's figure on
    # shared vCPUs): kappa = 4/3, every second of the step 4/3 as long
    three = estimate(spec, lay, job, replace(c, num_gpus=4, host_cores=3.0), eff)
    assert three.host_contention == pytest.approx(4 / 3, rel=1e-3)
    assert three.step_time_s == pytest.approx(4 / 3 * alone.step_time_s, rel=1e-3)
    # a woken rank waits wake_s per busy rank ahead of it: latency + wake_s * (kappa - 1)
    c2, e2 = contended(_cpu_cluster(), Efficiency(wake_s=1e-3, overhead_s=1e-4), 3.0)
    assert c2.inter.latency_s == pytest.approx(2e-4 + 2e-3) and e2.overhead_s == pytest.approx(3e-4)
    assert c2.gpu.tflops == pytest.approx(0.1 / 3)


def test_calibration_recovers_host_terms_and_reads_placement(tmp_path):
    from commpipe.plan.calibrate import point_from_run
    from commpipe.plan.layout import RUNTIME_JOB  # runtime_job() of train's defaults

    spec = resolve_model(DEMO_LIKE)
    c = _cpu_cluster(backend="gloo")
    truth = Efficiency(overhead_s=2e-4, coll_overhead_s=5e-4, optimizer_overhead_s=3e-4)
    job = Job(8, 32, precision="fp32", **RUNTIME_JOB)
    pts = [Point(spec, Layout(tp=t, pp=p, dp=d), job, 0.0, "synthetic")
           for t, p, d in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 1, 2), (1, 1, 2), (2, 2, 1)]]
    pts = [replace(p, measured_s=float(t)) for p, t in zip(pts, predict(pts, truth, c))]
    start = Efficiency(overhead_s=1e-4, coll_overhead_s=1e-4, optimizer_overhead_s=1e-4)
    res = fit(pts, start, c, fit_links=False,
              params=("overhead_s", "coll_overhead_s", "optimizer_overhead_s"))
    assert res.mape_after < 0.005
    assert res.eff.coll_overhead_s == pytest.approx(5e-4, rel=0.05)
    assert res.eff.optimizer_overhead_s == pytest.approx(3e-4, rel=0.05)
    with pytest.raises(ValueError, match="start at 0"):
        fit(pts, Efficiency(), c, params=("wake_s",))
    # a sweep's run folder: placement from sweep.jsonl becomes the rank -> node map
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig

    run = tmp_path / "tp2x-pp4"
    run.mkdir()
    TrainConfig(model=DEMO_LIKE.replace("layers=2", "layers=8"), dims=ParallelDims(tp=2, pp=4),
                global_batch=8, seq_len=32).resolve(8).save(run / "config.json")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": 0.3}) + "\n"
                                               for s in range(4)))
    (tmp_path / "sweep.jsonl").write_text(json.dumps({"name": "tp2x-pp4", "placement": "cp-dp-pp-tp",
                                                      "cluster": {"ranks_per_node": 2}}) + "\n")
    point = point_from_run(run, {"recompute": "none", "precision": "fp32", "flash_attention": None})
    assert point.node_of == (0, 2, 0, 2, 1, 3, 1, 3)
    # priced with the features the run recorded: SP on (shards between stages), overlap on
    assert point.job.pp_sharded and point.job.dp_overlap and point.job.runtime == "commpipe"
    cfg = json.loads((run / "config.json").read_text())
    cfg.update(sequence_parallel=False, overlap=False)
    (run / "config.json").write_text(json.dumps(cfg))
    point = point_from_run(run, {"recompute": "none", "precision": "fp32", "flash_attention": None})
    assert not point.job.pp_sharded and not point.job.dp_overlap and not point.job.cp_overlap


def test_cpu_entry_is_measured():
    from commpipe.plan.cpu import measure_cpu

    g = measure_cpu(gemm=64, copy_mb=1, repeats=2)
    assert g.name == "cpu" and 0 < g.tflops < 100 and 0 < g.hbm_gbps < 10000 and g.mem_gb > 0


def test_estimate_cli_prices_shared_host_cores(capsys):
    """--host-cores: more busy ranks than cores slow every rank down (never speed it up)."""
    base = ["estimate", "--model", "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,"
            "ffn_hidden=128,vocab=256", "--gpu", "name=toy,tflops=1,mem_gb=16", "--gpus", "4",
            "--gpus-per-node", "4", "--pp", "4", "--global-batch", "8", "--seq-len", "32",
            "--schedule", "1f1b", "--backend", "gloo", "--json"]
    times = []
    for extra in ([], ["--host-cores", "4"], ["--host-cores", "1"]):
        assert main(base + extra) == 0
        times.append(json.loads(capsys.readouterr().out)["step_time_s"])
    own, enough, shared = times
    assert enough == pytest.approx(own, rel=1e-9)   # a core per rank: no contention
    assert shared > 1.5 * own                       # four ranks on one core


def test_host_cores_flag_takes_a_capacity_or_auto(monkeypatch):
    import argparse

    import commpipe.plan.cpu as cpu
    from commpipe.plan.cli_inputs import host_cores_arg

    assert host_cores_arg("2") == 2 and isinstance(host_cores_arg("2"), int)   # JSON stays 2
    assert host_cores_arg("1.46") == pytest.approx(1.46)
    for bad in ("0.5", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="core"):
            host_cores_arg(bad)
    monkeypatch.setattr(cpu, "measure_core_capacity", lambda: 1.4567)
    assert host_cores_arg("auto") == pytest.approx(1.46)


def test_core_capacity_is_the_cores_rate_together_over_one_alone():
    from commpipe.plan.cpu import capacity_of, measure_core_capacity

    # steps per second: process 0 alone 190, then beside process 1: 180 and 95 (one vCPU that
    # gets half a core) -> (180 + 95) / 190 lone ranks' worth
    assert capacity_of({0: [190.0, 180.0], 1: [95.0]}, 2) == pytest.approx(275 / 190)
    # never below one rank's worth nor above the cores (a load spike while one ran alone)
    assert capacity_of({0: [100.0, 40.0], 1: [40.0]}, 2) == 1.0
    assert capacity_of({0: [50.0, 100.0], 1: [100.0]}, 2) == 2.0
    # one core has nothing to share; two real processes on this machine finish and agree
    # with the bounds (the figure itself is the machine's and its load's)
    assert measure_core_capacity(1) == 1.0
    assert 1.0 <= measure_core_capacity(2, seconds=0.3) <= 2.0
    # more processes than cores, each stepping a model's first stage
    # (benchmarks/cpu_oversubscription.py)
    assert 1.0 <= measure_core_capacity(2, seconds=0.3, processes=3, model="tiny", seq_len=16) <= 2.0


def test_cpu_plans_write_their_rates_in_gflops(capsys):
    """A CPU rank's ~1e-3 TFLOP/s reads 0.0 in a TFLOP/s column: `plan` and `estimate --gpu cpu`
    write GFLOP/s (the JSON keeps TFLOP/s), a GPU plan TFLOP/s."""
    import json
    import re

    from commpipe.cli import main

    argv = ["estimate", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--pp", "2",
            "--global-batch", "4", "--seq-len", "32"]
    assert main(argv + ["--json"]) == 0
    tflops = json.loads(capsys.readouterr().out)["tflops_per_gpu"]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step "))
    got = re.search(r"model ([\d.]+) GFLOP/s/GPU", line)
    assert got and float(got[1]) == pytest.approx(tflops * 1e3, abs=0.06)
    assert main(["plan", "--model", "tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "4",
                 "--seq-len", "32", "--top", "1"]) == 0
    assert "GFLOP/s" in capsys.readouterr().out.splitlines()[3]
    assert main(["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "8",
                 "--global-batch", "8", "--seq-len", "4096"]) == 0
    assert "TFLOP/s/GPU" in capsys.readouterr().out


def test_cpu_ranks_are_planned_with_their_share_of_the_host(monkeypatch, capsys):
    """CPU ranks of one host share its memory: each is planned with the host's memory over its
    ranks, and reserves a CPU process (fits.CPU_RANK_RESERVE_GIB), not a CUDA context's 1.5 GB."""
    import json

    import commpipe.plan.cpu as cpu
    from commpipe.cli import main
    from commpipe.plan.fits import CPU_RANK_RESERVE_GIB
    from commpipe.plan.gpus import GPU

    monkeypatch.setattr(cpu, "this_cpu", lambda: GPU("cpu", 0.05, 16.0, 10.0, 10.0, 1.0))
    # ~200M parameters: 16 bytes each in fp32 with Adam, ~3.2 GB on one rank
    base = ["estimate", "--model", "arch=llama,layers=8,hidden=1024,heads=8,vocab=32000",
            "--gpu", "cpu", "--gpus", "8", "--global-batch", "8", "--seq-len", "64", "--json"]

    def run(*extra, rc=0):          # estimate exits 1 on a layout that does not fit
        assert main(base + list(extra)) == rc
        return json.loads(capsys.readouterr().out)

    dp8 = run("--dp", "8", rc=1)                  # 8 ranks on the host: 16 / 8 = 2 GB each
    assert not dp8["feasible"] and "> 2 GB" in dp8["reason"], dp8["reason"]
    assert 3.0 < dp8["memory_gb_per_gpu"] < 16.0  # it fits the whole host's 16 GB
    # the fixed reserve plus 10% of the transient tensors (activations, here 0.05 GB)
    assert dp8["reserve_gb_per_gpu"] == pytest.approx(CPU_RANK_RESERVE_GIB, abs=0.01)
    pp8 = run("--pp", "8")                        # an eighth of the layers each
    assert pp8["feasible"] and max(pp8["memory_gb_per_stage"]) <= 2.0
    # one rank per host (8 hosts): each has the host to itself
    assert run("--dp", "8", "--gpus-per-node", "1")["feasible"]
