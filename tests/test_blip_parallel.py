"""blip-tiny under pipeline, tensor and data parallelism computes what one device computes:
loss and pre-clip gradient norm of 3 steps, the last step's pre-clip gradients and the final
parameters against tests/reference_blip.py (fp32, CPU, gloo), all layouts in one launch of 4
processes. Covers per-boundary messages (image features travelling with text hidden states and
their gradients summed), TP of both towers with cross-attention, the labelled-token loss scale
over DP, and --stage-layers auto.

    python -m pytest -q tests/test_blip_parallel.py
"""

from __future__ import annotations

import functools

import pytest

from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import TrainConfig
from tests.dist_harness import run_jobs
from tests.reference_blip import blip_reference_run
from tests.test_equivalence import check_against, check_grads, make_cfg

LAYOUTS = {   # key: (dims, schedule, extra config)
    "tp2-pp2-1f1b": (ParallelDims(tp=2, pp=2), "1f1b", {}),
    "pp4-1f1b": (ParallelDims(pp=4), "1f1b", {}),
    "pp2-dp2-auto": (ParallelDims(pp=2, dp=2), "1f1b", {"stage_layers": "auto"}),
    "tp2-pp2-zbv": (ParallelDims(tp=2, pp=2), "zbv", {}),
    "pp2-dp2-interleaved": (ParallelDims(pp=2, dp=2), "interleaved", {"vpp": 2}),
    "pp4-zbh1": (ParallelDims(pp=4), "zbh1", {}),
    "tp2-pp2-stp": (ParallelDims(tp=2, pp=2), "stp", {}),   # braids of towers without units
}


def blip_cfg(dims: ParallelDims, schedule: str, **kw) -> TrainConfig:
    return make_cfg(dims, schedule, model="blip-tiny", **kw)


@pytest.fixture(scope="module")
def reference():
    return blip_reference_run(blip_cfg(ParallelDims(), "1f1b"))


def plant_unsummed_image_grad(trainer) -> None:
    """Decoder stages pass the image features on detached: the gradient that later stages'
    cross-attention sends back is dropped instead of summed with this stage's own."""
    for module in trainer.stages.values():
        def cut(*args, _forward=module.forward, **kw):
            out = _forward(*args, **kw)
            if "text_hidden" in out:
                out["image_features"] = out["image_features"].detach()
            return out

        module.forward = cut


@functools.cache
def results() -> dict:
    jobs = [(key, blip_cfg(d, sched, **kw)) for key, (d, sched, kw) in LAYOUTS.items()]
    jobs.append(("planted-unsummed", blip_cfg(ParallelDims(pp=4), "1f1b"),
                 plant_unsummed_image_grad))
    return run_jobs(4, jobs)


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_blip_layouts_match_single_device(key, reference):
    check_against(reference, results()[key], key)


def test_planted_unsummed_image_gradient_is_caught(reference):
    """pp4 cuts inside the decoder: losses still agree in step 0, gradients do not."""
    got = results()["planted-unsummed"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted-unsummed")


def test_auto_split_is_uneven_and_logged():
    """blip-tiny's encoder layers cost ~2.7 decoder layers: FLOPs balancing moves layers off
    the encoder stage and predicts a smaller slowest stage than the even split."""
    cfg = blip_cfg(ParallelDims(pp=2, dp=2), "1f1b", stage_layers="auto").resolve(4)
    b = cfg.stage_balance
    assert cfg.stage_layers == b["split"] != b["even_split"] == [4, 4]
    assert max(b["predicted_stage_costs"]) < max(b["even_stage_costs"])
    assert "stage_balance" in cfg.to_dict()


def test_cp_is_rejected_for_blip():
    with pytest.raises(ValueError, match="context parallelism is not supported"):
        blip_cfg(ParallelDims(cp=2, pp=2), "1f1b").resolve(4)
