"""What `commpipe plan` asks of a model family: which planner prices it and the form of its
decoder layers (commpipe.models.family: planner_of, layer_form). The planner's figures for the
two forms are checked by hand here; tests/test_plan*.py check them against published runs."""

from __future__ import annotations

import argparse

import pytest

from commpipe.models import family as F
from commpipe.models.family import LayerForm, layer_form, layout_planned, planner_of, resolve
from commpipe.plan.cli import PLANNERS, run
from commpipe.plan.layout import Job, Layout
from commpipe.plan.memory import stage_params

GPT = "arch=gpt,layers=4,hidden=64,heads=4,vocab=128"
LLAMA = "arch=llama,layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=128"


def test_every_planner_a_family_names_exists():
    named = {f.arch: planner_of(f) for f in F.families() if planner_of(f) is not None}
    assert set(named.values()) <= set(PLANNERS), named
    assert named["llama"] == "layers" and named["blip"] == "towers"
    assert layout_planned(resolve("llama3-8b")) and not layout_planned(resolve("blip-base"))


def test_layer_forms_of_llama_and_gpt():
    assert layer_form(resolve(LLAMA)) == LayerForm()
    gpt = layer_form(resolve(GPT))
    assert (gpt.gated_mlp, gpt.biases, gpt.learned_positions, gpt.tied_head, gpt.eager_ops) == (
        False, True, True, True, False)


@pytest.mark.parametrize("model, pp, expect", [
    # h=64, v=128, seq 16, tp 1. llama layer: wq, wo 64*64, wk, wv 64*32, w1, w2, w3 64*128,
    # 2 norms 64: 36992; first stage + embedding 8192, last + head 8192 + final norm 64
    (LLAMA, 1, [(4, 4 * 36992 + 8192 + 8192 + 64)]),
    (LLAMA, 2, [(2, 2 * 36992 + 8192), (2, 2 * 36992 + 8192 + 64)]),
    # gpt layer: qkv 64*192 + 192, proj 64*64 + 64, fc1 64*256 + 256, fc2 256*64 + 64, 2 LNs
    # 2*128: 49984; positions 16*64; tied head: a copy on the last stage only when pp > 1,
    # final LN weight and bias 128
    (GPT, 1, [(4, 4 * 49984 + 8192 + 1024 + 128)]),
    (GPT, 2, [(2, 2 * 49984 + 8192 + 1024), (2, 2 * 49984 + 8192 + 128)]),
])
def test_stage_parameters_follow_the_layer_form(model, pp, expect):
    layout = Layout(1, 1, pp, 1, 1, 1, "1f1b", "none", 0)
    assert stage_params(resolve(model), layout, Job(8, 16)) == expect


def test_a_family_without_a_planner_is_refused_by_name():
    class Plain:              # a registered family that declares nothing for the planner
        arch, archs = "plain", ("plain",)

        def owns(self, model):
            return model == "plain-1"

    F._load()
    F.register(Plain())
    try:
        assert layer_form.__wrapped__(type("S", (), {"arch": "plain"})()) == LayerForm()
        args = argparse.Namespace(calibrate=None, model="plain-1", top=5)
        with pytest.raises(ValueError, match="no planner for arch=plain models"):
            run(args)
    finally:
        del F.FAMILIES["plain"]
