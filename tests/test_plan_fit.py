"""plan --calibrate's least-squares fit at the edge of its domain: e_max is bounded by 1 (the
GPU's achievable matmul rate), and runs that are faster than that allows leave it on the bound
with the rest of the gap taken by the other parameters, not by an e_max above 1."""

from dataclasses import replace

import pytest

from commpipe.models.spec import resolve_model
from commpipe.plan.calibrate import Point, fit, predict
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout


def _points(truth: Efficiency):
    spec = resolve_model("arch=gpt,layers=8,hidden=2048,heads=16,vocab=51200")
    c = default_cluster(resolve_gpu("a100-80gb"), 8, 8)
    pts = [Point(spec, Layout(tp=tp, pp=pp, dp=8 // (tp * pp), micro_batch_size=mbs), Job(64, 2048),
                 0.0, "synthetic")
           for tp, pp, mbs in [(1, 1, 1), (1, 1, 4), (2, 1, 2), (4, 1, 1), (8, 1, 8), (2, 2, 1),
                               (1, 4, 2), (4, 2, 4)]]
    return [replace(p, measured_s=float(t)) for p, t in zip(pts, predict(pts, truth, c))], c


@pytest.mark.parametrize("start", [0.92, 1.0])
def test_fit_finds_e_max_on_its_bound(start):
    """Truth at e_max = 1, the fit started inside the domain and on its edge."""
    truth = Efficiency(e_max=1.0, ai_half_ridge=0.8, elementwise=1.3, overhead_s=40e-6)
    pts, c = _points(truth)
    res = fit(pts, Efficiency(e_max=start), c, fit_links=False)
    assert res.eff.e_max <= 1.0
    assert res.eff.e_max == pytest.approx(1.0, abs=0.01)
    assert res.eff.elementwise == pytest.approx(1.3, rel=0.1)
    assert res.mape_after < 0.005
