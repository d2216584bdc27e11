"""The one FLOPs definition per model family against PyTorch's own count of a training step.

`torch.utils.flop_counter.FlopCounterMode` counts the matmul-family ops (mm, addmm, bmm,
convolution and their backward, scaled_dot_product_attention) of whatever runs under it, and
nothing else: softmax, norms, rotary embeddings, SiLU/GELU, residual adds and the loss are
uncounted there, as they are in `flops_per_token` (Megatron-style matmul accounting). Attention
runs on SDPA's math backend, which is a pair of batched matmuls over the full s x s scores
whether causal or not, as the formula counts it (CPU's fused kernel is not registered with the
counter at all). So the two agree exactly, up to one documented difference: BLIP's patch
projection has no input gradient (pixels need none), which the 3x-forward rule counts.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from commpipe.models.blip import build_model as build_blip
from commpipe.models.blip import caption_loss_sum
from commpipe.models.blip_spec import flops_per_sample, resolve_blip, vision_embed_flops
from commpipe.models.llama import build_model, cross_entropy_sum
from commpipe.models.spec import flops_per_token, parse_model_fields, resolve_model
from commpipe.parallel.balance import llama_layer_costs


def _counted(step) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


@pytest.mark.parametrize("model,batch,seq", [
    ("tiny", 2, 32),
    ("small", 2, 64),
    # GQA (kv_heads < heads) and an ffn width that is not the default
    ("arch=llama,layers=2,hidden=96,heads=6,kv_heads=2,ffn_hidden=200,vocab=300", 3, 48),
])
def test_llama_flops_equal_flop_counter(model, batch, seq):
    spec = resolve_model(model) if "=" not in model else parse_model_fields(model)
    net = build_model(spec)
    tokens = torch.randint(0, spec.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        cross_entropy_sum(net(tokens), tokens).backward()

    assert _counted(step) == pytest.approx(flops_per_token(spec, seq) * batch * seq, rel=1e-12)


def test_balance_costs_are_the_spec_flops():
    """Stage balancing prices layers with the same definition: its forward costs, tripled,
    are the training FLOPs per token."""
    spec = resolve_model("llama3-8b")
    costs = llama_layer_costs(spec, 8192)
    assert 3 * sum(costs) == pytest.approx(flops_per_token(spec, 8192), rel=1e-12)
    assert costs[0] == costs[-2] < costs[-1]


@pytest.mark.parametrize("batch", [1, 2])
def test_blip_flops_equal_flop_counter(batch):
    spec = resolve_blip("blip-tiny")
    net = build_blip(spec)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, spec.channels, spec.image_size, spec.image_size, generator=g)
    tokens = torch.randint(0, spec.vocab, (batch, spec.text_len), generator=g)

    def step():
        caption_loss_sum(net(pixels=pixels, tokens=tokens)["logits"], tokens).backward()

    # the patch projection's input gradient is never computed (pixels are not trained)
    want = (flops_per_sample(spec) - vision_embed_flops(spec)) * batch
    assert _counted(step) == pytest.approx(want, rel=1e-12)
