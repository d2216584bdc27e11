"""Recomputation applied from outside: same values and gradients as the plain model, fewer saved
bytes, the model's parameters and classes kept (commpipe.runtime.recompute)."""

from __future__ import annotations

import pytest
import torch

from commpipe.models.llama import Block, build_model
from commpipe.runtime.recompute import (
    ActivationMeter,
    Recomputed,
    RecomputedCore,
    apply_recompute,
)


def _run(mode: str):
    model = apply_recompute(build_model("tiny", seed=3), mode)
    tokens = torch.randint(0, model.spec.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with ActivationMeter(list(model.parameters()), torch.device("cpu")) as meter:
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model, loss.detach(), grads, meter.peak


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_keeps_values_and_gradients_and_saves_less(mode):
    plain, loss0, grads0, held0 = _run("none")
    model, loss, grads, held = _run(mode)
    torch.testing.assert_close(loss, loss0, rtol=0, atol=0)
    assert grads.keys() == grads0.keys()
    for name, g in grads.items():     # the replayed forward is the same arithmetic
        torch.testing.assert_close(g, grads0[name], rtol=1e-6, atol=1e-7, msg=name)
    assert 0 < held < held0, (mode, held, held0)
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_full_swaps_the_class_and_selective_fills_the_core_slot_once():
    model = apply_recompute(build_model("tiny"), "full")
    blocks = list(model.layers.values())
    assert all(isinstance(b, Recomputed) and isinstance(b, Block) for b in blocks)
    assert len({type(b) for b in blocks}) == 1               # one class per layer class
    apply_recompute(model, "full")                          # a second application is a no-op
    assert type(blocks[0]).__mro__.count(Recomputed) == 1
    assert all("forward" not in vars(b) for b in blocks)    # no per-instance forward

    model = apply_recompute(apply_recompute(build_model("tiny"), "selective"), "selective")
    core = next(iter(model.layers.values())).attention.core
    assert isinstance(core, RecomputedCore) and not isinstance(core.inner, RecomputedCore)


def test_unknown_mode_says_what_to_use():
    with pytest.raises(ValueError, match="use one of"):
        apply_recompute(build_model("tiny"), "everything")
