"""`commpipe plan --model blip-*`: layouts of the BLIP-style captioner priced with FLOPs-balanced
stages; one-GPU step time checked against the model's FLOPs by hand.

    python -m pytest -q tests/test_plan_blip.py
"""

from __future__ import annotations

import json
import math

import pytest

from commpipe.cli import main
from commpipe.models.blip_spec import flops_per_sample, resolve_blip
from commpipe.plan.blip import plan_blip, plan_layout
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.gpus import resolve_gpu


def test_one_gpu_step_is_flops_over_rate():
    spec, eff = resolve_blip("blip-base"), Efficiency()
    gpu = resolve_gpu("a100-80gb")
    cluster = default_cluster(gpu, 1, 8)
    p = plan_layout(spec, cluster, eff, global_batch=32, tp=1, pp=1, mbs=8)
    rate = gpu.tflops * gpu.mamf * 1e12 * eff.e_max   # the measured matmul ceiling, not the datasheet
    want = 32 * flops_per_sample(spec) / rate + 4 * 3 * spec.layers * eff.overhead_s
    assert math.isclose(p.step_ms, want * 1e3, rel_tol=1e-9)
    assert p.dp == 1 and p.microbatches == 4 and p.split == [24] and p.fits


def test_pipeline_stages_are_balanced_and_messages_priced():
    spec, eff = resolve_blip("blip-base"), Efficiency()
    cluster = default_cluster(resolve_gpu("h100"), 8, 8)
    p = plan_layout(spec, cluster, eff, global_batch=256, tp=1, pp=2, mbs=32)
    assert p.split == [9, 15]
    assert max(p.stage_ms) / min(p.stage_ms) < 1.15   # the even [12, 12] split: 2.2x in FLOPs
    plans = plan_blip(spec, cluster, eff, 64, {"pp": 2}, top=3)
    assert all(x.pp == 2 for x in plans) and plans == sorted(plans, key=lambda x: x.step_ms)


def test_cli_plans_blip_base_and_rejects_cp(capsys):
    assert main(["plan", "--model", "blip-base", "--gpu", "a100-80gb", "--gpus", "16",
                 "--global-batch", "256", "--top", "2", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == 2 and all(p["fits"] and p["tp"] * p["pp"] * p["dp"] == 16 for p in plans)
    assert main(["plan", "--model", "blip-base", "--gpus", "8", "--global-batch", "64",
                 "--cp", "2"]) == 2
    assert "no CP" in capsys.readouterr().err


def test_too_small_gpu_reports_least_memory():
    spec = resolve_blip("blip-large")
    gpu = resolve_gpu("name=small,tflops=100,mem_gb=1,hbm_gbps=1000,nvlink_gbps=100,nic_gbps=10")
    plans = plan_blip(spec, default_cluster(gpu, 2, 2), Efficiency(), 8)
    assert not plans[0].fits and plans[0].memory_gib > 1
    with pytest.raises(ValueError, match="no layout"):
        plan_blip(spec, default_cluster(gpu, 2, 2), Efficiency(), 3, {"pp": 2, "dp": 2})
