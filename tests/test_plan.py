"""Cost model and planner: hand-computed expectations, simulator agreement, CLI contract.

    python -m pytest tests/test_plan.py -x -q
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from commpipe.cli import main
from commpipe.models.spec import flops_per_token, param_count, resolve_model
from commpipe.plan.calibrate import Point, fit, load_profile, predict, save_profile
from commpipe.plan.cluster import Link, apply_probe, default_cluster
from commpipe.plan.compute import layer_compute
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate, lower_bound
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout, enumerate_layouts
from commpipe.plan.memory import GIB, stage_memory
from commpipe.plan.pipeline import peak_inflight, simulate_step
from commpipe.plan.search import _prepare, search
from commpipe.plan.timing import stage_costs
from commpipe.schedules import generate, lower
from commpipe.sim import CostTable, simulate

H100 = resolve_gpu("h100")


# -- FLOPs and parameters --------------------------------------------------------------------------
def test_flops_per_token_llama3_8b_by_hand():
    # h=4096, kv=8*128=1024, f=14336, V=128256, s=8192, L=32; forward per token and layer:
    #   QKV 2*4096*(4096+2*1024) = 50,331,648     scores+values 2*2*8192*4096 = 134,217,728
    #   out 2*4096^2             = 33,554,432     SwiGLU 2*3*4096*14336       = 352,321,536
    #   = 570,425,344; x32 layers x3 (fwd+bwd) = 54,760,833,024
    #   head 2*4096*128256 = 1,050,673,152, x3 = 3,152,019,456   -> 57,912,852,480
    assert flops_per_token(resolve_model("llama3-8b"), 8192) == 57_912_852_480
    # full recompute adds one more forward of the layers: + 32 * 570,425,344
    assert flops_per_token(resolve_model("llama3-8b"), 8192, recompute=True) == \
        57_912_852_480 + 32 * 570_425_344


def test_flops_per_token_gpt_by_hand():
    # GPT-3 175B (L=96, h=12288, s=2048, V=51200): per layer forward 24h^2 + 4sh
    #   24*12288^2 = 3,623,878,656; 4*2048*12288 = 100,663,296 -> 3,724,541,952
    #   x96 x3 = 1,072,668,082,176; head 3*2*12288*51200 = 3,774,873,600 -> 1,076,442,955,776
    #   (= 72 L h^2 (1 + s/6h + V/12Lh), Narayanan et al. 2021 eq. 3)
    spec = resolve_model("arch=gpt,layers=96,hidden=12288,heads=96,vocab=51200")
    assert flops_per_token(spec, 2048) == 1_076_442_955_776


@pytest.mark.parametrize("name,published", [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9),
                                            ("llama3-405b", 405.9e9)])
def test_param_counts_match_published(name, published):
    # Hugging Face model cards of Meta-Llama-3(.1): 8.03B, 70.6B, 405.9B (BF16 safetensors)
    assert abs(param_count(resolve_model(name)) / published - 1) < 0.01


def test_timing_prices_exactly_the_counted_flops():
    # layer_compute at e_max=1, infinite ridge slack (ai_half->0), no elementwise term and
    # flash off must take exactly (layer FLOPs / tp) / the achievable matmul rate, H100's MAMF:
    # 794.5 of its 989 TFLOP/s (0.803)
    spec = resolve_model("llama3-8b")
    eff = Efficiency(e_max=1.0, ai_half_ridge=1e-12, elementwise=0.0, overhead_s=0.0)
    job = Job(8, 4096, flash_attention=False)
    lay = Layout(tp=4, cp=2, dp=1, micro_batch_size=2)
    lc = layer_compute(spec, lay, job, default_cluster(H100, 8, 8), eff)
    per_token_layer = (flops_per_token(spec, 4096) - 3 * 2 * spec.hidden * spec.vocab) / spec.layers / 3
    tokens = 2 * 4096 / 2
    assert lc["gemm"] + lc["attn"] == pytest.approx(per_token_layer * tokens / 4 / (989e12 * 0.803), rel=1e-6)


# -- memory ----------------------------------------------------------------------------------------
def test_memory_one_gpu_by_hand():
    # llama, L=4, h=1024, 16 heads, kv 4 heads (kv_dim 256), f=4096, V=32000; s=2048, b=1; one H100
    # params/layer: attn 1024*(1024+512) + 1024^2 = 2,621,440; MLP 3*1024*4096 = 12,582,912;
    #   norms 2048 -> 15,206,400; x4 = 60,825,600; embedding + head 2*32000*1024 = 65,536,000;
    #   final norm 1024 -> 126,362,624 params; x16 bytes (bf16 w 2 + g 2 + fp32 master/m/v 12)
    #   = 2,021,801,984 B
    # activations/layer (fused SwiGLU keeps gate, up and the product: 6f/h):
    #   s*h*(12 + 4*256/1024 + 6*4096/1024) = 2,097,152*37 = 77,594,624
    #   + log-sum-exp 4*16*2048 = 131,072 -> 77,725,696; x4 layers x1 in flight = 310,902,784
    #   + final-norm input and the output layer's input 2 x 2*2048*1024 = 8,388,608 -> 319,291,392
    # logits: (4 fp32 softmax + 2 bf16) * 2048 * 32000 = 393,216,000
    # tensors 2,734,309,376; reserve 1.5 GiB + 10% of the transient tensors (activations and
    #   logits, 712,507,392; the states are allocated once) = 1,610,612,736 + 71,250,739.2
    # total 4,416,172,851.2 B (plain autograd SwiGLU, 8f/h, 4 x 2,097,152 x 8 = 67,108,864 more
    #   activations and 10% of them: 4,489,992,601.6)
    spec = resolve_model("arch=llama,layers=4,hidden=1024,heads=16,kv_heads=4,ffn_hidden=4096,vocab=32000")
    lay = Layout()
    job = Job(1, 2048)
    mem = stage_memory(spec, lay, job, list(peak_inflight("1f1b", 1, 1, 1)))
    assert len(mem) == 1 and mem[0].params == 126_362_624
    assert mem[0].total_gb * GIB == pytest.approx(4_416_172_851.2, rel=1e-12)
    plain = stage_memory(spec, lay, replace(job, fused_swiglu=False), list(peak_inflight("1f1b", 1, 1, 1)))
    assert plain[0].total_gb * GIB == pytest.approx(4_489_992_601.6, rel=1e-12)
    e = estimate(spec, lay, job, default_cluster(H100, 1, 8))
    assert e.feasible and e.memory_gb_per_gpu == pytest.approx(4_416_172_851.2 / GIB)


def test_zero1_shards_only_optimizer_states():
    spec = resolve_model("llama3-8b")
    job, job0 = Job(64, 4096, zero1=True), Job(64, 4096)
    lay = Layout(tp=2, cp=2, pp=2, dp=4)
    infl = list(peak_inflight("1f1b", 2, 1, 8))
    a, b = stage_memory(spec, lay, job, infl)[0], stage_memory(spec, lay, job0, infl)[0]
    assert a.optimizer_gb == pytest.approx(b.optimizer_gb / 8)          # dp*cp = 8
    assert (a.weights_gb, a.grads_gb, a.activations_gb) == (b.weights_gb, b.grads_gb, b.activations_gb)


def test_impossible_layouts_are_rejected_with_their_reason():
    c = default_cluster(H100, 1, 8)
    e = estimate(resolve_model("llama3-70b"), Layout(), Job(1, 4096), c)
    assert not e.feasible and "out of memory" in e.reason and "GB > 80 GB" in e.reason
    e = estimate(resolve_model("llama3-8b"), Layout(tp=3, dp=1), Job(1, 4096), default_cluster(H100, 3, 8))
    assert not e.feasible and "tp=3 does not divide 32 attention heads" in e.reason
    e = estimate(resolve_model("llama3-8b"), Layout(pp=4, dp=1, schedule="1f1b"), Job(2, 4096),
                 default_cluster(H100, 4, 8))
    assert not e.feasible and "m=2 >= pp=4" in e.reason


# -- communication -------------------------------------------------------------------------------
def test_collective_prices_by_placement():
    c = default_cluster(H100, 16, 8)        # intra 0.8*450 = 360 GB/s, inter 0.9*50 = 45 GB/s/GPU
    nbytes = 1e9
    # 8 ranks inside a node: 2*7/8 * 1e9 / 360e9 + 2*3 steps * 5 us
    assert c.all_reduce(nbytes, 8, 1) == pytest.approx(2 * 7 / 8 * nbytes / 360e9 + 6 * 5e-6)
    # 16 ranks over 2 nodes, 8 per node: bus bandwidth min(360, 8*45) = 360, latency 10 us
    assert c.all_reduce(nbytes, 16, 1) == pytest.approx(2 * 15 / 16 * nbytes / 360e9 + 8 * 10e-6)
    # 2 ranks with stride 8 (one per node): one NIC, 45 GB/s
    assert c.all_reduce(nbytes, 2, 8) == pytest.approx(nbytes / 45e9 + 2 * 10e-6)
    assert c.p2p(nbytes, 0, 7) == pytest.approx(5e-6 + nbytes / 360e9)
    assert c.p2p(nbytes, 7, 8) == pytest.approx(10e-6 + nbytes / 45e9)


def test_tp_beyond_a_node_costs_more_than_inside():
    spec = resolve_model("arch=gpt,layers=8,hidden=4096,heads=32,vocab=51200")
    job = Job(16, 2048)
    c = default_cluster(H100, 16, 8)
    inside = stage_costs(spec, Layout(tp=8, dp=2), job, c, Efficiency())
    # TP16 spans two nodes; with 5 GB/s NICs its ring runs at 8 * 5 = 40 GB/s instead of 360
    slow = replace(c, inter=Link(5.0, 10e-6))
    across = stage_costs(spec, Layout(tp=16, dp=1), job, slow, Efficiency())
    act = 2 * 1 * 2048 * 4096                                   # [b, s, h] bf16
    per_layer_inside = 2 * c.all_reduce(act, 8, 1)
    per_layer_across = 2 * slow.all_reduce(act, 16, 1)
    assert per_layer_across == pytest.approx(2 * (2 * 15 / 16 * act / 40e9 + 8 * 10e-6))
    assert across.tp_f[0] > 8 * per_layer_across > 5 * inside.tp_f[0] > 5 * 8 * per_layer_inside


def test_probe_json_sets_links(tmp_path):
    probe = {"schema": "commpipe-probe/1", "world_size": 4, "ranks_per_node": 2,
             "pairs": {"intra_node": {"latency_ms": 0.02, "bandwidth_gbps": 100.0},
                       "inter_node": {"latency_ms": 0.05, "bandwidth_gbps": 3.0}}, "allreduce": []}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    c = apply_probe(default_cluster(H100, 4, 8), path)
    assert (c.gpus_per_node, c.intra, c.inter) == (2, Link(100.0, 2e-5), Link(3.0, 5e-5))


# -- simulator use ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("interleaved", 4, 2), ("zbh1", 4, 1),
                                      ("zbv", 4, 2), ("gpipe", 3, 1), ("stp", 4, 2),
                                      ("dualpipev", 4, 2), ("stp", 3, 2)])
def test_extrapolated_makespan_equals_full_simulation(name, p, v):
    rng = random.Random(p * 10 + v)
    n = p * v
    f = [rng.uniform(0.5, 1.5) for _ in range(n)]
    b = [x * rng.uniform(1.8, 2.4) for x in f]
    i, w = [x * 0.6 for x in b], [x * 0.4 for x in b]
    # braided schedules: TP collectives on the simulator's TP stream
    tp = [x * rng.uniform(0.1, 0.4) for x in f] if name in ("stp", "dualpipev") else None
    m = 40
    span, busy = simulate_step(name, p, v, m, f, b, i, w, 0.05, 20.0, 1e6, tp_comm=tp)
    full = simulate(lower(generate(name, p, m, v)),
                    CostTable(f=f, b=b, i=i, w=w, latency_ms=0.05, bandwidth_gbps=20.0,
                              activation_bytes=1e6, tp_comm=tp))
    assert span == pytest.approx(full.makespan, rel=1e-9)
    assert busy == pytest.approx(full.busy, rel=1e-9)


@pytest.mark.parametrize("p,v", [(4, 2), (8, 2), (4, 3)])
def test_peak_inflight_matches_closed_forms(p, v):
    # 1F1B: rank r holds p - r; interleaved rank 0: p + (p-1)/v (Korthikanti 2022, 4.2.3);
    # ZB-H1 and ZB-V: p on every rank (Qi et al. 2024); GPipe: all m
    m = 4 * p
    assert list(peak_inflight("1f1b", p, 1, m)) == [p - r for r in range(p)]
    assert peak_inflight("interleaved", p, v, m)[0] == pytest.approx(p + (p - 1) / v)
    assert list(peak_inflight("zbh1", p, 1, m)) == [p] * p
    assert list(peak_inflight("zbv", p, 2, m)) == [p] * p
    assert list(peak_inflight("gpipe", p, 1, 100)) == [100] * p
    # the shortcut (walk min(m, 2p) micro-batches) agrees with the full walk at large m
    for name, vv in (("1f1b", 1), ("interleaved", v), ("zbh1", 1), ("zbv", 2), ("gpipe", 1),
                     ("stp", 2), ("dualpipev", 2)):
        full = simulate(lower(generate(name, p, 5 * p, vv)), CostTable.uniform(p * vv)).peak_activations
        assert list(peak_inflight(name, p, vv, 5 * p)) == pytest.approx(full)


# -- search ----------------------------------------------------------------------------------------
SMALL = dict(spec=resolve_model("arch=llama,layers=8,hidden=1024,heads=16,kv_heads=8,vocab=32000"),
             job=Job(32, 2048))


def test_lower_bound_never_exceeds_the_simulated_step():
    spec, job = SMALL["spec"], SMALL["job"]
    c = default_cluster(H100, 16, 4)
    lays = enumerate_layouts(spec, job, 16)
    for lay in random.Random(0).sample(lays, 60):
        e = estimate(spec, lay, job, c, detail=False)
        assert e.lower_bound_s <= e.step_time_s * (1 + 1e-9), lay


def test_branch_and_bound_equals_exhaustive_search():
    spec, job = SMALL["spec"], SMALL["job"]
    c = default_cluster(resolve_gpu("a100-40gb"), 16, 4)
    res = search(spec, job, c, top=3, explain=False)
    every = []
    for lay in enumerate_layouts(spec, job, 16):
        cand = _prepare(spec, job, c, Efficiency(), lay)
        if not isinstance(cand, str):
            every.append(estimate(spec, lay, job, c, detail=False))
    every.sort(key=lambda e: e.step_time_s)
    assert res.feasible == len(every) and res.simulated < res.feasible
    assert [e.step_time_s for e in res.top] == pytest.approx([e.step_time_s for e in every[:3]])


def test_fixed_dimensions_are_respected():
    spec, job = SMALL["spec"], SMALL["job"]
    res = search(spec, job, default_cluster(H100, 16, 4), fixed={"tp": 2, "schedule": "zbv"}, top=4)
    assert res.top and all(e.layout.tp == 2 and e.layout.schedule == "zbv" for e in res.top)
    with pytest.raises(ValueError, match="tp=3"):
        search(spec, job, default_cluster(H100, 16, 4), fixed={"tp": 3})


# -- CLI -----------------------------------------------------------------------------------------
ESTIMATE_KEYS = {"tp", "cp", "pp", "dp", "vpp", "micro_batch_size", "schedule", "step_time_s",
                 "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "feasible", "reason",
                 "hw_tflops_per_gpu"}


def test_estimate_and_plan_json(capsys):
    args = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--gpus-per-node", "8",
            "--global-batch", "32", "--seq-len", "4096", "--json"]
    assert main(["estimate", *args, "--tp", "2", "--pp", "2", "--recompute", "full"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert ESTIMATE_KEYS <= set(d) and d["feasible"] and (d["tp"], d["pp"], d["dp"]) == (2, 2, 4)
    # full recompute: hardware FLOPs count the layers' forward twice (4 passes instead of 3)
    assert d["hw_tflops_per_gpu"] > d["tflops_per_gpu"] * 1.2
    assert main(["plan", *args, "--pp", "2", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and all(ESTIMATE_KEYS <= set(r) and r["pp"] == 2 for r in rows)
    assert rows[0]["step_time_s"] <= rows[1]["step_time_s"] <= rows[2]["step_time_s"]


def test_layout_that_misses_the_gpu_count_names_the_degrees_and_gpus(capsys):
    # 8*4 = 32 GPUs asked of 16: said in GPUs (no "launch 32 processes"); a tp that cannot split
    # the 32 heads is named for the heads, before any GPU-count arithmetic
    args = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--gpus-per-node", "8",
            "--global-batch", "16", "--seq-len", "4096"]
    assert main(["plan", *args, "--tp", "8", "--pp", "4"]) == 2
    err = capsys.readouterr().err
    assert "tp*cp*pp*dp = 8*1*4*1 = 32 GPUs, not the 16 of --gpus" in err and "launch" not in err
    assert main(["plan", *args, "--tp", "3"]) == 2
    assert "tp=3 does not divide 32 attention heads; use tp in {1, 2, 4, 8}" in capsys.readouterr().err
    # estimate with --dp as well as --gpus: a mismatch fails before pricing a different cluster
    assert main(["estimate", *args, "--tp", "4", "--pp", "2", "--dp", "4"]) == 2
    assert "--gpus 16 but tp*cp*pp*dp = 4*1*2*4 = 32; drop --dp" in capsys.readouterr().err


def test_plan_text_output(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpu", "a100-80gb", "--gpus", "16",
                 "--gpus-per-node", "4", "--global-batch", "64", "--seq-len", "4096", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts considered" in out and "why common alternatives lose" in out


def test_calibration_recovers_known_efficiency(tmp_path, capsys):
    # measurements generated by the model itself with known parameters: the fit must find them
    spec = resolve_model("arch=gpt,layers=8,hidden=2048,heads=16,vocab=51200")
    truth = Efficiency(e_max=0.6, ai_half_ridge=0.9, elementwise=1.5, overhead_s=50e-6)
    c = default_cluster(resolve_gpu("a100-80gb"), 8, 8)
    pts = []
    for tp, pp, mbs in [(1, 1, 1), (1, 1, 4), (2, 1, 2), (4, 1, 1), (8, 1, 8), (2, 2, 1), (1, 4, 2),
                        (4, 2, 4), (1, 8, 1), (8, 1, 1)]:
        lay = Layout(tp=tp, pp=pp, dp=8 // (tp * pp), micro_batch_size=mbs)
        job = Job(64, 2048)
        pts.append(Point(spec, lay, job, 0.0, "synthetic"))
    measured = predict(pts, truth, c)
    pts = [replace(p, measured_s=float(t)) for p, t in zip(pts, measured)]
    res = fit(pts, Efficiency(), c, fit_links=False)
    assert res.mape_before > 0.05 and res.mape_after < 0.005
    assert res.eff.e_max == pytest.approx(0.6, rel=0.05)
    assert res.eff.ai_half_ridge == pytest.approx(0.9, rel=0.1)
    path = tmp_path / "profile.json"
    save_profile(path, res, ["synthetic"])
    eff, links = load_profile(path)
    assert eff.e_max == pytest.approx(res.eff.e_max) and "inter_node" in links


def test_calibrate_cli_from_csv_then_plan_with_profile(tmp_path, capsys):
    csv_text = ("tp,cp,pp,dp,micro_batch_size,global_batch,seq_len,layers,hidden,heads,vocab,step_time_s\n"
                "1,1,1,4,2,16,1024,4,1024,8,32000,0.050\n"
                "2,1,1,2,2,16,1024,4,1024,8,32000,0.060\n"
                "1,1,2,2,1,16,1024,4,1024,8,32000,0.080\n"
                "4,1,1,1,4,16,1024,4,1024,8,32000,0.090\n")
    (tmp_path / "runs.csv").write_text(csv_text)
    prof = tmp_path / "prof.json"
    assert main(["plan", "--calibrate", str(tmp_path), "--gpu", "a100-80gb", "--gpus-per-node", "4",
                 "--profile", str(prof)]) == 0
    assert "fit error (MAPE)" in capsys.readouterr().out
    assert json.loads(prof.read_text())["schema"] == "commpipe-profile/1"
    # a preset is not applied to the runs being fitted: refused, not silently ignored
    assert main(["plan", "--calibrate", str(tmp_path), "--gpu", "a100-80gb", "--framework",
                 "megatron-lm-2021", "--profile", str(tmp_path / "other.json")]) == 2
    assert "--framework presets are not applied there" in capsys.readouterr().err
    assert not (tmp_path / "other.json").exists()
    assert main(["plan", "--model", "tiny", "--gpu", "a100-80gb", "--gpus", "4", "--gpus-per-node", "4",
                 "--global-batch", "8", "--seq-len", "64", "--profile", str(prof), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["feasible"]


def test_calibrate_from_run_folders(tmp_path):
    # run folders as `commpipe train --out` writes them: config.json + metrics.jsonl
    from commpipe.parallel.dims import ParallelDims
    from commpipe.plan.calibrate import load_sources
    from commpipe.train.config import TrainConfig

    for i, (dims, t) in enumerate([(ParallelDims(dp=2, pp=2), 0.020), (ParallelDims(tp=2, pp=2), 0.030),
                                   (ParallelDims(dp=4), 0.012)]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        TrainConfig(model="tiny", dims=dims, global_batch=8, seq_len=64).resolve(4).save(run / "config.json")
        # warm-up steps are slow and skipped; the median of the rest is the measurement
        steps = [{"step": s, "loss": 5.0, "step_time_s": (1.0 if s < 2 else t)} for s in range(6)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    defaults = {"recompute": "none", "sequence_parallel": True, "dp_overlap": True,
                "flash_attention": None, "precision": "bf16", "zero1": False, "vocab": 51200}
    c = default_cluster(resolve_gpu("a100-80gb"), 4, 4)
    pts, _, sources = load_sources(tmp_path, defaults, c)
    assert len(pts) == 3 == len(sources)
    assert sorted(p.measured_s for p in pts) == [0.012, 0.020, 0.030]
    assert {(p.layout.tp, p.layout.pp, p.layout.dp) for p in pts} == {(1, 2, 2), (2, 2, 1), (1, 1, 4)}
    # `commpipe report` on the same folder writes results.csv and .json beside the runs: a summary of
    # them, skipped (the CSV was read as runs with other columns and failed)
    from commpipe.report.cli import write_report

    write_report(tmp_path)
    assert (tmp_path / "results.csv").exists() and (tmp_path / "results.json").exists()
    again, _, sources_again = load_sources(tmp_path, defaults, c)
    assert sources_again == sources and sorted(p.measured_s for p in again) == [0.012, 0.020, 0.030]
    # three runs support at most three parameters (fit refuses more)
    with pytest.raises(ValueError, match="cannot determine 4 parameters"):
        fit(pts, Efficiency(), c, fit_links=False)
    res = fit(pts, Efficiency(), c, fit_links=False, params=("e_max", "overhead_s"))
    assert res.mape_after < res.mape_before


def test_custom_gpu_entry():
    g = resolve_gpu("name=foo,tflops=500,mem_gb=96")
    assert (g.name, g.tflops, g.mem_gb) == ("foo", 500.0, 96.0)
    with pytest.raises(ValueError, match="missing mem_gb"):
        resolve_gpu("name=foo,tflops=500")
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_gpu("v100")


def test_lower_bound_is_tight_for_uniform_1f1b():
    # (m + p - 1)(f + b) is 1F1B's exact makespan with equal stages and free links
    spec = resolve_model("arch=llama,layers=8,hidden=1024,heads=16,kv_heads=8,vocab=32000")
    lay = Layout(pp=4, dp=1, micro_batch_size=1)
    job = Job(16, 2048)
    c = default_cluster(H100, 4, 8)
    costs = stage_costs(spec, lay, job, c, Efficiency())
    costs.comp_f[-1] = costs.comp_f[0]           # drop the head: uniform stages
    costs.comp_i[-1], costs.comp_w[-1] = costs.comp_i[0], costs.comp_w[0]
    costs.tp_f[0] = costs.tp_f[1]
    f, b = costs.f[0], costs.b[0]
    tail = max(d + o for d, o in zip(costs.dp_exposed, costs.optimizer))
    lb = lower_bound(costs, lay, replace(c, intra=Link(1e12, 0.0)), 16) - tail
    assert lb == pytest.approx((16 + 4 - 1) * (f + b), rel=1e-6)


def test_schedule_rules_mirror_the_generators():
    """The planner checks schedule constraints without generating programs (too slow for
    thousands of layouts); its rules must agree with the generators: it never proposes what
    the runtime rejects, and (with a pipeline) never rejects what the runtime runs."""
    from commpipe.plan.layout import schedule_problem
    from commpipe.schedules import generate

    for name in ("gpipe", "1f1b", "interleaved", "zbh1", "zbv"):
        for pp in range(1, 6):
            for vpp in (1, 2, 3):
                for m in range(1, 13):
                    try:
                        generate(name, pp, m, vpp)
                        runs = True
                    except ValueError:
                        runs = False
                    proposed = schedule_problem(name, pp, vpp, m) is None
                    case = (name, pp, vpp, m)
                    assert runs or not proposed, f"planner proposes {case}, runtime rejects it"
                    # pp=1 (nothing to schedule) and zbv's implicit vpp=1 -> 2 are the
                    # planner's own deliberate narrowings
                    if pp > 1 and not (name == "zbv" and vpp == 1):
                        assert proposed or not runs, f"planner rejects {case}, runtime runs it"


def test_equal_predictions_rank_the_least_model_parallel_first():
    # the ranking's order: step time to 9 significant digits, then tp*cp*pp, cp, pp
    from commpipe.plan.estimate import Estimate
    from commpipe.plan.search import rank_key

    t = 1.234567891
    cp2 = Estimate(Layout(cp=2, dp=2, micro_batch_size=2), True, "", step_time_s=t)
    pp2 = Estimate(Layout(pp=2, dp=2, vpp=1), True, "", step_time_s=t * (1 + 1e-12))
    dp4 = Estimate(Layout(dp=4), True, "", step_time_s=t * (1 - 1e-12))
    tp2cp2 = Estimate(Layout(tp=2, cp=2), True, "", step_time_s=t)
    assert sorted([tp2cp2, cp2, pp2, dp4], key=rank_key) == [dp4, pp2, cp2, tp2cp2]
    # a real difference in the 9th digit wins over less parallelism
    faster = Estimate(Layout(tp=2, cp=2), True, "", step_time_s=t * (1 - 1e-8))
    assert sorted([dp4, faster], key=rank_key) == [faster, dp4]
