"""The ModelFamily registry (commpipe.models.family): every named shape resolves through the
family that owns it and reads back from a checkpoint's record; counts, FLOPs and per-layer
costs agree with the modules the family builds and with the hand-written formulas."""

from __future__ import annotations

import pytest
import torch

from commpipe.models.family import (
    families,
    family_for_arch,
    family_for_model,
    family_of,
    resolve,
    spec_from_dict,
)

SPLITS = {"llama": ("tiny", [1, 3]), "blip": ("blip-tiny", [3, 5])}


def test_three_registrations_serve_every_arch():
    assert sorted(f.arch for f in families()) == ["blip", "llama", "moe"]
    assert family_for_arch("gpt") is family_for_arch("llama")   # gpt shapes: the decoder family
    with pytest.raises(ValueError, match="arch='mamba' is unknown"):
        family_for_arch("mamba")


@pytest.mark.parametrize("family", families(), ids=lambda f: f.arch)
def test_every_preset_resolves_through_its_family_and_reads_back(family):
    for name, spec in family.presets().items():
        assert family_for_model(name) is family
        assert resolve(name) == spec and spec.name == name
        assert family_of(spec) is family
        assert spec_from_dict(spec.to_dict()) == spec


def test_fields_pick_the_family():
    gpt = resolve("arch=gpt,layers=2,hidden=64,heads=4,vocab=128")
    assert gpt.arch == "gpt" and family_of(gpt).arch == "llama"
    assert "gpt shapes work with plan and estimate" in family_of(gpt).trainable(gpt)
    assert family_for_model("layers=2,hidden=64,heads=4,vocab=128").arch == "llama"
    blip = family_for_arch("blip").presets()["blip-tiny"]
    assert family_for_model(",".join(f"{k}={v}" for k, v in blip.to_dict().items())).arch == "blip"
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        resolve("nope")
    # a misspelt name: the closest named shape of any family, and every family's shapes
    with pytest.raises(ValueError, match="did you mean mixtral-8x7b\\?") as e:
        resolve("mixtrl-8x7b")
    assert all(name in str(e.value) for name in ("tiny", "moe-tiny", "deepseek-v3", "blip-base"))


@pytest.mark.parametrize("arch", sorted(SPLITS))
def test_stages_hold_the_counted_parameters(arch):
    family = family_for_arch(arch)
    name, counts = SPLITS[arch]
    spec = family.resolve(name)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    ranges = [range(a, a + c) for a, c in zip(starts, counts)]
    stages = family.build_stages(spec, ranges, seed=0, device="cpu")
    built = sum(p.numel() for s in stages for p in s.parameters())
    assert family.param_count(spec, 128) == built
    ios = family.stage_io(spec, counts, micro_batch=2, seq_len=16)
    assert [list(io.layers) for io in ios] == [list(r) for r in ranges]


def test_flops_and_layer_costs_by_hand():
    llama = family_for_arch("llama")
    spec = llama.resolve("tiny")   # h=64, kv 2*16=32, ffn 128, vocab 256, 4 layers
    s = 128
    layer = 2 * 64 * (64 + 2 * 32) + 2 * 2 * s * 64 + 2 * 64 * 64 + 2 * 3 * 64 * 128
    head = 2 * 64 * 256
    assert llama.layer_costs(spec, s) == [layer] * 3 + [layer + head]
    assert llama.flops_per_unit(spec, s) == 3 * (4 * layer + head)
    assert llama.step_flops(spec, s, 8) == 3 * (4 * layer + head) * 8 * s
    assert llama.unit == "token" and llama.sequence_parallel
    blip = family_for_arch("blip")
    tiny = blip.resolve("blip-tiny")
    assert blip.flops_per_unit(tiny, tiny.text_len) == 1_649_940_480   # tests/test_blip.py
    assert blip.step_flops(tiny, tiny.text_len, 4) == 4 * 1_649_940_480
    assert len(blip.layer_costs(tiny, tiny.text_len)) == tiny.layers
    assert blip.unit == "sample" and not blip.sequence_parallel


def test_loss_is_the_family_sum():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, -1] = -100    # BLIP's padding label: ignored by its loss only
    llama, blip = family_for_arch("llama"), family_for_arch("blip")
    keep = labels != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(blip.loss_sum(logits, labels), ref)
    labels[0, -1] = 3
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(llama.loss_sum(logits, labels), ref)


@pytest.mark.parametrize("arch", sorted(SPLITS))
def test_hugging_face_mapping_is_the_family_s(arch):
    family = family_for_arch(arch)
    assert family.hf.arch == arch
    spec = family.resolve(SPLITS[arch][0])
    whole = family.build_stages(spec, [range(spec.layers)], seed=0, device="meta")[0]
    assert set(family.hf.parameters(spec)) == {n for n, _ in whole.named_parameters()}
