"""The MoE decoder (commpipe.models.moe) against independent references: the routed layer
against a per-token Python loop, parameter counts against hand derivations and the published
Mixtral 8x7B / DeepSeek-V3 totals, FLOPs against FlopCounterMode (see tests/test_plan_flops.py
for what the counter counts)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from commpipe.models.moe import MoELayer, build_moe, gate_scores, load_balance_loss, moe_loss_sum
from commpipe.models.moe_spec import (
    PRESETS,
    active_param_count,
    flops_per_token,
    is_moe,
    param_count,
    resolve_moe,
)

TINY = PRESETS["moe-tiny"]
# sigmoid gate, a dense first layer, MLA attention with a query latent: DeepSeek-V3 in miniature
TINY_V3 = dataclasses.replace(
    TINY, name="v3-tiny", layers=3, dense_layers=1, dense_ffn=96, experts=8, top_k=3,
    gate="sigmoid", route_scale=2.5, attention="mla", heads=4, kv_heads=4, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=12)
# heads 32 wide where hidden / heads is 16: a head_dim set apart from the hidden size (Qwen3-MoE)
TINY_WIDE = dataclasses.replace(TINY, name="wide-tiny", head_dim=32)
GATES = {
    "mixtral": dict(gate="softmax", norm_topk=True),
    "switch": dict(gate="softmax", norm_topk=False),
    "deepseek-v3": dict(gate="sigmoid", norm_topk=True, route_scale=2.5),
}


def _per_token_reference(layer: MoELayer, x: torch.Tensor):
    """The routed layer one token at a time: experts chosen by sorting a Python list, gate
    weights from the formulas of MoESpec, the chosen experts applied and summed in a loop.
    Differentiable, so gradients compare too."""
    spec, ex = layer.spec, layer.experts
    outs, probs_all, chosen_all = [], [], []
    for t in range(x.shape[0]):
        xt = x[t]
        logits = layer.router.weight @ xt                          # [E]
        if spec.gate == "softmax":
            select = logits
            probs = torch.exp(logits) / torch.exp(logits).sum()
        else:
            select = 1 / (1 + torch.exp(-logits))
            probs = select / select.sum()
        values = select.tolist()
        chosen = sorted(range(spec.experts), key=lambda e: -values[e])[:spec.top_k]
        if spec.gate == "softmax" and spec.norm_topk:
            z = sum(torch.exp(logits[e]) for e in chosen)
            w = [torch.exp(logits[e]) / z for e in chosen]
        elif spec.gate == "softmax":
            w = [probs[e] for e in chosen]
        else:
            z = sum(select[c] for c in chosen) if spec.norm_topk else 1.0
            w = [select[e] / z for e in chosen]
        y = torch.zeros_like(xt)
        for e, we in zip(chosen, w):
            hid = F.silu(ex.w1[e] @ xt) * (ex.w3[e] @ xt)
            y = y + we * spec.route_scale * (ex.w2[e] @ hid)
        if layer.shared is not None:
            y = y + layer.shared(xt)
        outs.append(y)
        probs_all.append(probs)
        chosen_all.append(chosen)
    # the balancing loss, by counting
    n = spec.experts
    share = [sum(c.count(e) for c in chosen_all) / (len(chosen_all) * spec.top_k) for e in range(n)]
    mean_p = torch.stack(probs_all).mean(0)
    aux = n * sum(f * mean_p[e] for e, f in enumerate(share))
    return torch.stack(outs), aux


def _layer(gate: str, shared: int, seed: int = 0) -> MoELayer:
    spec = dataclasses.replace(TINY, experts=6, top_k=2, shared_experts=shared, **GATES[gate])
    torch.manual_seed(seed)
    layer = MoELayer(spec)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)   # outputs of order 0.1-1: fp32 rounding ~1e-7
    return layer


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("gate", list(GATES))
def test_routed_layer_equals_per_token_loop(gate, shared):
    layer = _layer(gate, shared)
    x = torch.randn(3, 7, TINY.hidden, generator=torch.Generator().manual_seed(1))
    out, aux = layer(x)
    want, want_aux = _per_token_reference(layer, x.reshape(-1, TINY.hidden))
    torch.testing.assert_close(out.reshape(-1, TINY.hidden), want, atol=1e-6, rtol=0)
    assert aux.item() == pytest.approx(want_aux.item(), abs=1e-6)

    # gradients of every parameter and of the input, through the same loss, in float64 (fp32
    # rounding of sums over tokens alone reaches a few 1e-6 in the router's gradient)
    layer, x = layer.double(), x.double()
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x, generator=torch.Generator().manual_seed(2))
    out, aux = layer(xg)
    grads = torch.autograd.grad((out * g).sum() + aux, [xg, *layer.parameters()])
    xr = x.reshape(-1, TINY.hidden).clone().requires_grad_(True)
    ref, ref_aux = _per_token_reference(layer, xr)
    ref_grads = torch.autograd.grad((ref * g.reshape(-1, TINY.hidden)).sum() + ref_aux,
                                    [xr, *layer.parameters()])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.reshape(b.shape), b, atol=1e-12, rtol=0)


def test_routed_layer_is_deterministic_and_token_local():
    """Bitwise the same on a rerun; a token's output does not depend on its batch-mates."""
    layer = _layer("deepseek-v3", 1)
    x = torch.randn(64, TINY.hidden, generator=torch.Generator().manual_seed(3))
    a, b = layer(x[None])[0], layer(x[None])[0]
    assert torch.equal(a, b)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x[perm][None])[0][0], a[0][perm], atol=1e-6, rtol=0)


def test_mixtral_gate_is_renormalised_softmax():
    """Softmax over the k selected logits equals the full softmax renormalised over the top k."""
    spec = dataclasses.replace(TINY, experts=8, top_k=2, **GATES["mixtral"])
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(5))
    w, top, probs = gate_scores(logits, spec)
    p = probs.gather(-1, top)
    torch.testing.assert_close(w, p / p.sum(-1, keepdim=True), atol=1e-7, rtol=0)


def test_load_balance_loss_by_hand():
    # 4 tokens, 2 experts, top-1: tokens 0-2 to expert 0, token 3 to expert 1
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    top = torch.tensor([[0], [0], [0], [1]])
    # f = (3/4, 1/4), P = (2.6/4, 1.4/4): 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    assert load_balance_loss(probs, top, 2).item() == pytest.approx(1.15, abs=1e-6)
    # perfect balance gives 1 for any k
    uniform = torch.full((6, 3), 1 / 3)
    top2 = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])
    assert load_balance_loss(uniform, top2, 3).item() == pytest.approx(1.0, abs=1e-6)


def test_aux_loss_trains_the_router_and_crosses_stage_boundaries():
    model = build_moe(TINY, seed=3)
    tokens = torch.randint(0, TINY.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, aux = model(tokens)
    # aux = coef * tokens * sum over MoE layers of each layer's loss (about 1 each at init)
    scale = TINY.aux_loss_coef * 32 * TINY.layers
    assert 0.5 * scale < aux.item() < 2 * scale
    aux.backward()
    assert model.layers["0"].feed_forward.router.weight.grad.abs().sum() > 0
    # two stages built from names, the aux term handed from one to the next
    first = build_moe(TINY, seed=3, layer_ids=[0], has_head=False)
    last = build_moe(TINY, seed=3, layer_ids=[1], has_embedding=False)
    h, carried = first(tokens)
    logits2, aux2 = last(h, aux=carried)
    assert torch.equal(logits2, logits) and torch.equal(aux2, aux)
    loss = moe_loss_sum(logits, tokens, aux)
    assert loss.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), tokens.flatten(),
                                                        reduction="sum").item() + aux.item(), rel=1e-6)


# ---- parameter counts ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", [TINY, TINY_V3, TINY_WIDE], ids=lambda s: s.name)
def test_param_count_equals_built_model(spec):
    model = build_moe(spec)
    assert param_count(spec) == sum(p.numel() for p in model.parameters())
    # active: every parameter but the (experts - top_k) unused routed experts of each MoE layer
    unused = spec.moe_layers * (spec.experts - spec.top_k) * 3 * spec.hidden * spec.expert_ffn
    assert active_param_count(spec) == param_count(spec) - unused


def test_mixtral_8x7b_counts_match_published():
    """Mistral: 46.7B total, 12.9B active per token (mistral.ai/news/mixtral-of-experts)."""
    spec = resolve_moe("mixtral-8x7b")
    h, f, L, V = 4096, 14336, 32, 32000
    attn = h * (h + 2 * 8 * 128) + h * h              # wq, wk, wv (8 kv heads of 128), wo
    expert = 3 * h * f
    per_layer_total = attn + 8 * expert + 8 * h + 2 * h       # 8 experts, router, two norms
    per_layer_active = attn + 2 * expert + 8 * h + 2 * h      # top-2
    total = L * per_layer_total + 2 * V * h + h
    active = L * per_layer_active + 2 * V * h + h
    assert param_count(spec) == total == 46_702_792_704
    assert active_param_count(spec) == active == 12_879_925_248
    assert round(total / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


def test_deepseek_v3_counts_match_published():
    """DeepSeek-V3 technical report: 671B total, 37B activated (the multi-token-prediction
    module, 14B more in the released checkpoint, is not part of the main model)."""
    spec = resolve_moe("deepseek-v3")
    h, nh, V = 7168, 128, 129280
    mla = (h * 1536 + 1536 + 1536 * nh * (128 + 64)          # q latent, its norm, q up-projection
           + h * (512 + 64) + 512 + 512 * nh * (128 + 128)   # kv latent + rope key, norm, k/v up
           + nh * 128 * h)                                   # output
    dense = mla + 3 * h * 18432 + 2 * h
    moe_total = mla + 257 * 3 * h * 2048 + 256 * h + 2 * h   # 256 routed + 1 shared, router
    moe_active = mla + 9 * 3 * h * 2048 + 256 * h + 2 * h    # 8 routed + 1 shared
    total = 3 * dense + 58 * moe_total + 2 * V * h + h
    active = 3 * dense + 58 * moe_active + 2 * V * h + h
    assert param_count(spec) == total
    assert active_param_count(spec) == active
    assert round(total / 1e9) == 671 and round(active / 1e9) in (37, 38)


@pytest.mark.parametrize("fields,total,active", [
    # Qwen3-30B-A3B and Qwen3-235B-A22B (their model cards on Hugging Face: "30.5B in total and
    # 3.3B activated", "235B in total and 22B activated"; config.json: head_dim 128 against
    # hidden / heads = 64); their per-head q/k RMSNorms (256 weights a layer) are not modelled
    ("layers=48,hidden=2048,heads=32,kv_heads=4,head_dim=128,vocab=151936,experts=128,top_k=8,"
     "expert_ffn=768", 30.5, 3.3),
    ("layers=94,hidden=4096,heads=64,kv_heads=4,head_dim=128,vocab=151936,experts=128,top_k=8,"
     "expert_ffn=1536", 235, 22),
])
def test_qwen3_moe_counts_match_published(fields, total, active):
    spec = resolve_moe("arch=moe," + fields)
    assert spec.q_width == 2 * spec.hidden
    # the cards' figures carry two or three digits: within 2% of each
    assert param_count(spec) / 1e9 == pytest.approx(total, rel=0.02)
    assert active_param_count(spec) / 1e9 == pytest.approx(active, rel=0.02)


# ---- FLOPs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,batch,seq", [(TINY, 2, 32), (TINY_V3, 3, 16), (TINY_WIDE, 2, 16)],
                         ids=["tiny", "v3", "wide"])
def test_flops_equal_flop_counter(spec, batch, seq):
    """Forward + backward of a training step, active experts only. Dropless routing sends every
    token to exactly top_k experts, so the count does not depend on which experts (the routing
    is still fixed by the seeds): the matmul FLOPs are exact, hence rel=1e-12. Experts that
    receive no token run a 0-row matmul, which counts 0."""
    model = build_moe(spec, seed=1)
    tokens = torch.randint(0, spec.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        logits, aux = model(tokens)
        moe_loss_sum(logits, tokens, aux).backward()

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    assert counter.get_total_flops() == pytest.approx(flops_per_token(spec, seq) * batch * seq,
                                                      rel=1e-12)


def test_flops_hand_derivation_mixtral():
    spec = resolve_moe("mixtral-8x7b")
    s, h = 4096, 4096
    layer = 2 * (h * (h + 2048) + h * h) + 4 * s * h + 2 * 8 * h + 2 * 2 * 3 * h * 14336
    assert flops_per_token(spec, s) == 3 * (32 * layer + 2 * h * 32000)


# ---- names and fields ----------------------------------------------------------------------

def test_resolve_names_and_fields():
    assert is_moe("moe-tiny") and is_moe("arch=moe,layers=2") and not is_moe("tiny")
    spec = resolve_moe("arch=moe,layers=2,hidden=64,heads=4,vocab=128,experts=4,top_k=2,"
                       "expert_ffn=32,gate=sigmoid")
    assert (spec.kv_heads, spec.gate, spec.shared_experts) == (4, "sigmoid", 0)
    assert resolve_moe("deepseek-v3").to_dict()["arch"] == "moe"
    with pytest.raises(ValueError, match="top_k=5 exceeds experts=4"):
        resolve_moe("arch=moe,layers=2,hidden=64,heads=4,vocab=128,experts=4,top_k=5,expert_ffn=32")
    with pytest.raises(ValueError, match="unknown moe model 'moe-huge'; use one of moe-tiny"):
        resolve_moe("moe-huge")
    with pytest.raises(ValueError, match="gate='relu' is unknown"):
        dataclasses.replace(TINY, gate="relu").validate()
