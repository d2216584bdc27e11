"""Overlapped NCCL collectives slow the computation they hide behind (commpipe/plan/kernels.py,
`nccl_channels`): each holds one SM per channel of its ring for its hidden duration, as many
channels as NCCL's topology search and connection give the group. Expectations worked by hand.

    python -m pytest -q tests/test_plan_comm_sms.py
"""

from __future__ import annotations

import pytest

from commpipe.models.spec import resolve_model
from commpipe.plan import kernels
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.kernels import nccl_channels, nccl_sm_share
from commpipe.plan.layout import Job, Layout
from commpipe.plan.timing import stage_costs
from commpipe.plan.zero_costs import zero_exposed

H100 = resolve_gpu("h100")
# h=1024, 16 heads, 4 KV heads (kv 256), f=4096: tests/test_plan_kernels.py's small Llama; a layer
# has 15,206,400 parameters, the whole model 126,362,624
SPEC = resolve_model("arch=llama,layers=4,hidden=1024,heads=16,kv_heads=4,ffn_hidden=4096,vocab=32000")
LAYER, MODEL = 15_206_400, 126_362_624


def test_nccl_ring_channels_by_placement_by_hand():
    h100 = default_cluster(H100, 48, 8)
    # DP over 6 nodes, 8 ranks a node, 8 NICs at 400 Gb/s (ring speed 45-48 GB/s): 8 search
    # channels, not duplicated (more than 4 below 50 GB/s on Hopper), doubled by connectRings
    assert nccl_channels(h100, 48, 1) == 16
    # one rank a node (tp 8): 1 channel at 48, duplicated (2 x 24), doubled: 4; 2 a node: 8;
    # 4 a node: 16
    assert nccl_channels(h100, 6, 8) == 4
    assert nccl_channels(h100, 12, 4) == 8
    assert nccl_channels(h100, 24, 2) == 16
    # inside one node: six NVLink rings, doubled twice
    assert nccl_channels(h100, 8, 1) == 24
    assert nccl_channels(h100, 1, 1) == 0
    # DGX A100, 200 Gb/s NICs: rings at 24 GB/s are never duplicated: 8 -> 16, 1 -> 2
    a100 = default_cluster(resolve_gpu("a100-80gb"), 64, 8)
    assert nccl_channels(a100, 64, 1) == 16
    assert nccl_channels(a100, 8, 8) == 2
    # the share of the SMs: 16 of the H100's 132, 4 of 132, 16 of the A100's 108; none on a GPU
    # of unknown SM count (a CPU)
    assert nccl_sm_share(h100, 48, 1) == pytest.approx(16 / 132, rel=1e-15)
    assert nccl_sm_share(h100, 6, 8) == pytest.approx(4 / 132, rel=1e-15)
    assert nccl_sm_share(a100, 64, 1) == pytest.approx(16 / 108, rel=1e-15)
    assert nccl_sm_share(default_cluster(resolve_gpu("h100,sms=0"), 48, 8), 48, 1) == 0.0


def test_fsdp_prefetch_slows_each_layer_by_its_hidden_traffic_by_hand():
    # ZeRO-3 over 8 H100 of one node (24 channels), 4 layers: each layer's bf16 weights
    # all-gathered (2 x 15,206,400 B), its fp32 gradients reduce-scattered (4 x 15,206,400 B)
    cluster = default_cluster(H100, 8, 8)
    job, lay = Job(8, 2048, grad_fp32=True), Layout(dp=8, zero=3)
    ag = cluster.all_gather(2 * LAYER, 8, 1)
    rs = cluster.reduce_scatter(4 * LAYER, 8, 1)
    share = 24 / 132
    # compute far longer than the traffic: all of it hidden, the compute loses 24 SMs meanwhile
    f, b, sm_f, sm_b = zero_exposed(SPEC, lay, job, cluster, 4, 1.0, 2.0)
    assert (f, b) == pytest.approx((ag, ag + rs), rel=1e-12)     # the first gather, the last pair
    assert sm_f == pytest.approx(share * 4 * ag, rel=1e-12)
    assert sm_b == pytest.approx(share * 4 * (ag + rs), rel=1e-12)
    # compute shorter than the traffic (1 us): only that microsecond overlaps, the rest is exposed
    f, b, sm_f, sm_b = zero_exposed(SPEC, lay, job, cluster, 4, 1e-6, 1e-6)
    assert f == pytest.approx(ag + 4 * (ag - 1e-6), rel=1e-12)
    assert sm_f == pytest.approx(share * 4e-6, rel=1e-12)
    assert sm_b == pytest.approx(share * 4e-6, rel=1e-12)
    # and it reaches the stage's compute: the same stage on a GPU of unknown SM count differs by it
    nosm = default_cluster(resolve_gpu("h100,sms=0"), 8, 8)
    eff = Efficiency()
    with_sm, without = stage_costs(SPEC, lay, job, cluster, eff), stage_costs(SPEC, lay, job, nosm, eff)
    assert with_sm.comp_f[0] - without.comp_f[0] == pytest.approx(share * 4 * ag, rel=1e-9)
    assert with_sm.comp_i[0] - without.comp_i[0] == pytest.approx(share * 4 * (ag + rs), rel=1e-9)


def test_megatron_hidden_dp_traffic_slows_the_step_by_hand():
    # ZeRO-1 over 8 H100 of one node (24 channels), one micro-batch (mbs 4 of 2048 tokens),
    # Megatron's overlap:
    # the fp32 reduce-scatter (4 x 126,362,624 B) hides behind the backward and the bf16 parameter
    # all-gather (2 x 126,362,624 B) behind the forward, all but the last (first) 40M bucket
    # (overlapped_dp_exposed with one chunk). The hidden 1 - 40M / 126.4M of both runs beside
    # compute on 108 of 132 SMs: the step grows by 24/132 of it.
    cluster = default_cluster(H100, 8, 8)
    job, lay = Job(32, 2048, grad_fp32=True), Layout(dp=8, micro_batch_size=4, zero=1)
    red = cluster.reduce_scatter(4 * MODEL, 8, 1)
    ag = cluster.all_gather(2 * MODEL, 8, 1)
    costs = stage_costs(SPEC, lay, job, cluster, Efficiency())
    assert costs.f[0] > ag and costs.b[0] > red          # long enough to hide all but a bucket
    hidden = (red + ag) * (1 - 40e6 / MODEL)
    assert costs.dp_sm[0] == pytest.approx(24 / 132 * hidden, rel=1e-9)
    e = estimate(SPEC, lay, job, cluster, Efficiency())
    nosm = estimate(SPEC, lay, job, default_cluster(resolve_gpu("h100,sms=0"), 8, 8), Efficiency())
    assert e.breakdown["dp_sm"] == pytest.approx(24 / 132 * hidden, rel=1e-9)
    assert e.step_time_s - nosm.step_time_s == pytest.approx(24 / 132 * hidden, rel=1e-6)
    # without the overlap (--no-dp-overlap) nothing hides and nothing is slowed
    off = stage_costs(SPEC, lay, Job(32, 2048, grad_fp32=True, dp_overlap=False), cluster, Efficiency())
    assert off.dp_sm == [0.0]


def test_more_channels_more_slowdown(monkeypatch):
    # the charge is linear in the channel count: 12 NVLink channels instead of 24 halve it
    cluster = default_cluster(H100, 8, 8)
    job, lay = Job(32, 2048, grad_fp32=True), Layout(dp=8, micro_batch_size=4, zero=1)
    at24 = stage_costs(SPEC, lay, job, cluster, Efficiency()).dp_sm[0]
    monkeypatch.setattr(kernels, "NCCL_INTRA_CHANNELS", 12)
    assert stage_costs(SPEC, lay, job, cluster, Efficiency()).dp_sm[0] == pytest.approx(at24 / 2, rel=1e-12)
