"""BLIP-style captioner: parameter counts and FLOPs against hand derivations and torch's own
counters, stage splits against the whole model, stage boundary descriptions against the
tensors that really cross.

    python -m pytest -q tests/test_blip.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from commpipe.models.blip import Blip, build_model, build_stages, caption_loss_sum
from commpipe.models.blip_spec import (
    BLIP_PRESETS,
    boundary,
    flops_per_sample,
    layer_flops,
    layer_params,
    param_count,
    resolve_blip,
    stage_io,
)
from commpipe.models.boundary import llama_stage_io
from commpipe.models.spec import resolve_model

TINY = resolve_blip("blip-tiny")


def batch(spec, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(b, spec.channels, spec.image_size, spec.image_size, generator=g)
    tokens = torch.randint(0, spec.vocab, (b, spec.text_len), generator=g)
    return pixels, tokens


@pytest.mark.parametrize("name", list(BLIP_PRESETS))
def test_param_count_matches_built_model(name):
    spec = resolve_blip(name)
    with torch.device("meta"):
        model = Blip(spec)
    assert param_count(spec) == sum(p.numel() for p in model.parameters())
    # per-layer counts (with the pieces each layer's stage holds) add up stage by stage
    with torch.device("meta"):
        stage = Blip(spec, range(spec.enc_layers - 1, spec.enc_layers + 1))
    assert sum(p.numel() for p in stage.parameters()) == \
        layer_params(spec, spec.enc_layers - 1) + layer_params(spec, spec.enc_layers)


def test_blip_base_param_count_by_hand():
    # ViT-B/16 at 224 (h=768, 196 patches + [CLS]):
    #   block: attention 4*(768*768+768) + MLP (768*3072+3072) + (3072*768+768) + 2 LN 4*768
    #        = 2,362,368 + 4,722,432 + 3,072 = 7,087,872;  x12 = 85,054,464
    #   patch conv 3*16*16*768+768 = 590,592; [CLS] 768; positions 197*768 = 151,296; norm 1,536
    #   encoder = 85,798,656  (timm's vit_base_patch16_224 is 86.57M = this + its 769k class head)
    # BERT-base decoder with cross-attention (h=768, vocab 30524, 512 positions):
    #   layer: self-attn 4*(768*768+768) = 2,362,368, cross-attn the same (K, V from the 768-wide
    #          image features), MLP 4,722,432, 3 LN 4,608: 9,451,776 = 16 h^2 + 19 h
    #   x12 = 113,421,312; words 30524*768 = 23,442,432; positions 393,216; embedding LN 1,536
    #   head: dense 590,592 + LN 1,536 + output 30524*768 + 30524 = 23,472,956
    #   decoder = 161,323,580
    vit = 12 * (12 * 768**2 + 13 * 768) + (3 * 16 * 16 * 768 + 768) + 768 + 197 * 768 + 2 * 768
    assert vit == 85_798_656
    decoder = 12 * (16 * 768**2 + 19 * 768) + 30524 * 768 + 512 * 768 + 2 * 768 \
        + (768**2 + 768) + 2 * 768 + (30524 * 768 + 30524)
    assert decoder == 161_323_580
    spec = resolve_blip("blip-base")
    assert param_count(spec) == vit + decoder == 247_122_236
    # BLIP ties the head to the word embedding; untied here (they may sit on different stages).
    # Tied, this is 223.68M: the ~224M of BLIP ViT-B + BERT-base.
    tied = param_count(spec) - spec.vocab * spec.dec_hidden
    assert tied == 223_679_804
    # Published size of Salesforce/blip-image-captioning-large (Hugging Face model listing,
    # 470M, checkpoint stores the head untied; captioning fine-tunes at 384x384): ViT-L/16 at 384
    # with the same BERT-base decoder, cross-attention K/V projecting 1024 -> 768.
    large = replace(resolve_blip("blip-large"), image_size=384)
    assert param_count(large) == 469_732_924
    assert abs(param_count(large) / 470e6 - 1) < 0.001


@pytest.mark.parametrize("name", ["blip-tiny", "blip-base"])
def test_forward_flops_equal_torch_flop_counter(name):
    """torch's FlopCounterMode counts every matmul, conv and (math-kernel) attention bmm; with
    the full s x s causal product that is exactly our forward count."""
    spec = resolve_blip(name)
    if name == "blip-base":  # a few decoder-width layers suffice; shapes are those of base
        spec = replace(spec, enc_layers=1, dec_layers=1)
    model = build_model(spec)
    pixels, tokens = batch(spec, b=2)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(pixels=pixels, tokens=tokens)
    assert fc.get_total_flops() == 2 * sum(layer_flops(spec))
    assert flops_per_sample(spec) == 3 * sum(layer_flops(spec))


def test_blip_base_flops_by_hand():
    # Per sample, forward, 2 FLOPs per multiply-add. Encoder layer over p = 197 tokens:
    # Q,K,V,O 8 p h^2 + MLP 16 p h^2 + scores and values 4 p^2 h = 2,907,909,120.
    # Decoder layer over s = 40 tokens: self-attention 8 s h^2 + 4 s^2 h; cross-attention Q,O
    # 4 s h^2, K,V over the image 4 p h^2, scores and values 4 s p h; MLP 16 s h^2.
    s, p, h = 40, 197, 768
    enc = 24 * p * h * h + 4 * p * p * h
    dec = (8 * s * h * h + 4 * s * s * h) + (4 * s * h * h + 4 * p * h * h + 4 * s * p * h) \
        + 16 * s * h * h
    embed = 2 * 196 * 3 * 256 * h
    head = 2 * s * h * (h + 30524)
    spec = resolve_blip("blip-base")
    assert enc == 2_907_909_120
    assert layer_flops(spec)[1] == enc and layer_flops(spec)[12] == dec
    assert flops_per_sample(spec) == 3 * (12 * enc + 12 * dec + embed + head)
    # an encoder layer costs ~2.5 decoder layers; cross-attention K/V over 197 image tokens
    # (4 p h^2 = 465M) is the decoder layer's largest matmul
    assert 2.4 < enc / dec < 2.6
    assert flops_per_sample(spec, recompute=True) == flops_per_sample(spec) + 12 * (enc + dec)


def test_tiny_keeps_base_proportions():
    base, tiny = resolve_blip("blip-base"), TINY
    assert tiny.image_tokens > 4 * tiny.text_len and base.image_tokens > 4 * base.text_len
    # the same 197 image tokens (14 x 14 patches + [CLS]) against 40 caption tokens as blip-base
    assert (tiny.image_tokens, tiny.text_len) == (base.image_tokens, base.text_len) == (197, 40)
    ratio = lambda s: layer_flops(s)[1] / layer_flops(s)[s.enc_layers]
    assert 2 < ratio(tiny) < 4 and 2 < ratio(base) < 4


def test_blip_tiny_numbers_by_hand():
    # h = 128, MLP 512, 112x112 images in 8x8 patches (197 tokens), 40-token captions,
    # vocabulary 512, 64 text positions.
    # params: encoder block 12 h^2 + 13 h = 198,272 (x4 = 793,088); patch conv 3*8*8*128+128 =
    #   24,704, [CLS] 128, positions 197*128 = 25,216; final norm 256. Decoder layer
    #   16 h^2 + 19 h = 264,576 (x4 = 1,058,304); words 512*128 = 65,536, positions 8,192,
    #   LN 256; head 16,512 + 256 + 66,048. Total 2,058,496.
    assert 4 * 198_272 + 24_704 + 128 + 25_216 + 256 == 843_392
    assert 4 * 264_576 + 65_536 + 8_192 + 256 + 16_512 + 256 + 66_048 == 1_215_104
    assert param_count(TINY) == 843_392 + 1_215_104 == 2_058_496
    # forward FLOPs per sample: encoder layer 24 p h^2 + 4 p^2 h = 77,463,552 + 19,870,208 =
    #   97,333,760; decoder layer 8 s h^2 + 4 s^2 h (5,242,880 + 819,200) + 4 s h^2 + 4 p h^2
    #   + 4 s p h (2,621,440 + 12,910,592 + 4,034,560) + 16 s h^2 (10,485,760) = 36,114,432:
    #   cross-attention's K/V over the image is the largest matmul, as in blip-base.
    #   Patch embedding 2*196*192*128 = 9,633,792; head 2*40*128*(128+512) = 6,553,600.
    enc, dec = 97_333_760, 36_114_432
    assert layer_flops(TINY)[1] == enc and layer_flops(TINY)[4] == dec
    assert flops_per_sample(TINY) == 3 * (4 * enc + 4 * dec + 9_633_792 + 6_553_600) \
        == 1_649_940_480
    assert round(enc / dec, 2) == 2.70   # blip-base: 2.52


@pytest.mark.parametrize("counts", [[8], [4, 4], [3, 3, 2], [2, 2, 2, 2], [5, 3]])
def test_stage_split_equals_whole_model(counts):
    """Chained stages give the whole model's logits and, passing boundary gradients back as
    a pipeline does, its gradients: image-feature gradients from every decoder stage sum."""
    whole = build_model(TINY, seed=3)
    stages = build_stages(TINY, counts, seed=3)
    pixels, tokens = batch(TINY)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    loss_ref = caption_loss_sum(whole(pixels=pixels, tokens=tokens)["logits"], labels)
    loss_ref.backward()

    ios = stage_io(TINY, counts, micro_batch=2)
    data = {"pixels": pixels, "tokens": tokens}
    sent, saved = {}, []
    for stage, io in zip(stages, ios):
        inputs = {t.name: sent[t.name].detach().requires_grad_() for t in io.recv}
        inputs.update({t.name: data[t.name] for t in io.data if t.name in data})
        out = stage(**inputs)
        assert [(t.name, tuple(out[t.name].shape), str(out[t.name].dtype).split(".")[1])
                for t in io.send] == [(t.name, t.shape, t.dtype) for t in io.send]
        if io.send:
            assert set(out) == {t.name for t in io.send}
        saved.append((inputs, out))
        sent = out
    loss = caption_loss_sum(saved[-1][1]["logits"], labels)
    assert torch.equal(loss, loss_ref)
    grads = None
    for (inputs, out), io in reversed(list(zip(saved, ios))):
        if grads is None:
            loss.backward()
        else:
            torch.autograd.backward([out[t.name] for t in io.send], [grads[t.name] for t in io.send])
        grads = {t.name: inputs[t.name].grad for t in io.recv}
    ref = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, ref[name]), name
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_decoder_is_causal_and_reads_the_image():
    model = build_model(TINY)
    pixels, tokens = batch(TINY, b=1)
    logits = model(pixels=pixels, tokens=tokens)["logits"]
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % TINY.vocab
    after = model(pixels=pixels, tokens=changed)["logits"]
    torch.testing.assert_close(after[:, :10], logits[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 10:], logits[:, 10:])
    other_image = model(pixels=pixels.flip(-1), tokens=tokens)["logits"]
    assert (other_image - logits).abs().amax(-1).min() > 1e-4  # every position sees the image


def test_boundaries_and_errors():
    spec = resolve_blip("blip-base")
    assert [t.name for t in boundary(spec, 5, 1)] == ["image_hidden"]
    assert [t.name for t in boundary(spec, 12, 1)] == ["image_features"]
    after = boundary(spec, 13, 4, dtype="bfloat16")
    assert [(t.name, t.shape) for t in after] == [("text_hidden", (4, 40, 768)),
                                                  ("image_features", (4, 197, 768))]
    assert sum(t.nbytes for t in after) == 4 * (40 + 197) * 768 * 2
    ios = stage_io(spec, [12, 12], micro_batch=1)
    assert [t.name for t in ios[1].data] == ["tokens", "labels"] and ios[1].send == ()
    with pytest.raises(ValueError, match="sum to the model's 24 layers"):
        stage_io(spec, [12, 11], 1)
    with pytest.raises(ValueError, match="contiguous"):
        Blip(TINY, [0, 2])
    with pytest.raises(ValueError, match="needs input 'image_features'"):
        build_model(TINY, layer_ids=range(4, 8))(tokens=batch(TINY)[1])
    llama = llama_stage_io(resolve_model("tiny"), [1, 3], 2, 8)
    assert llama[1].recv[0].shape == (2, 8, 64) and [t.name for t in llama[1].data] == ["labels"]
