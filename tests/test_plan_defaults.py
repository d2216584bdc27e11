"""The planner's default efficiency: measured constants on GPUs, the untuned ones on a CPU with
its host terms measured."""

import pytest

from commpipe.models.spec import resolve_model
from commpipe.plan.cluster import default_cluster
from commpipe.plan.compute import gemm_time
from commpipe.plan.efficiency import MEASURED_GPU, Efficiency, default_efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout
from commpipe.plan.search import search

H100 = resolve_gpu("h100")
SPEC = resolve_model("arch=gpt,layers=4,hidden=2048,heads=16,vocab=32000")
JOB = Job(8, 2048)


def test_gpu_estimates_and_searches_default_to_the_measured_constants():
    c = default_cluster(H100, 2, 8)
    lay = Layout(dp=2)
    default = estimate(SPEC, lay, JOB, c, detail=False)
    assert default.step_time_s == estimate(SPEC, lay, JOB, c, MEASURED_GPU, detail=False).step_time_s
    assert default.step_time_s != estimate(SPEC, lay, JOB, c, Efficiency(), detail=False).step_time_s
    found = {name: search(SPEC, JOB, c, eff, top=3, explain=False).top
             for name, eff in (("default", None), ("measured", MEASURED_GPU))}
    assert [e.step_time_s for e in found["default"]] == [e.step_time_s for e in found["measured"]]


def test_a_cpu_keeps_the_untuned_constants_with_measured_host_terms():
    from commpipe.plan.cpu import host_op_seconds

    cpu = resolve_gpu("name=cpu,tflops=0.1,mem_gb=64")
    # the 20 us per layer pass gives way to each pass's ops at this host's time per op
    assert default_efficiency(cpu) == Efficiency(overhead_s=0.0, op_s=host_op_seconds())
    assert 0 < host_op_seconds() < 1e-3
    assert default_efficiency(H100) is MEASURED_GPU
    assert default_efficiency(resolve_gpu("a100-80gb")) is MEASURED_GPU


def test_measured_gemm_curve_at_a_small_model_shape():
    # the QKV GEMM of a 1.7B GPT (h=2048) at one 4096-token micro-batch on H100, by hand:
    # intensity MKN/(MK+KN+MN) = 51.54e9/46.14e6 = 1117.1 FLOP/B; ridge = MAMF/HBM =
    # 989e12*0.803/3.35e12 = 237.06 FLOP/B; efficiency = 0.9912 * 1117.1/(1117.1 + 2.742*237.06)
    # = 0.6266 of MAMF (794.2 TFLOP/s), 497.6 TFLOP/s; the untuned curve said
    # 0.92 * 1117.1/(1117.1 + 0.5*237.06) = 0.8317, 660.5 TFLOP/s
    m, k, n = 4096, 2048, 6144
    flops = 2 * m * k * n
    peak, ridge = 989e12 * 0.803, 989e12 * 0.803 / 3.35e12
    measured = gemm_time(flops, m, k, n, peak, MEASURED_GPU, ridge)
    untuned = gemm_time(flops, m, k, n, peak, Efficiency(), ridge)
    assert flops / measured / 1e12 == pytest.approx(497.6, rel=1e-3)
    assert flops / untuned / 1e12 == pytest.approx(660.5, rel=1e-3)
