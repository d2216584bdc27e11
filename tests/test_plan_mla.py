"""The planner on multi-head latent attention (commpipe/plan/attention.py): the GEMMs it prices
carry the family's own FLOPs, TP splits what DeepSeek-V3's reference model splits, the saved
tensors and parameters by hand, and DeepSeek-V3 estimated end to end. No process is launched."""

from __future__ import annotations

import pytest

from commpipe.cli import main
from commpipe.models import moe_spec as M
from commpipe.models.family import resolve
from commpipe.plan.attention import mla_activation_bytes, mla_gemms
from commpipe.plan.kernels import layer_gemms
from commpipe.plan.layout import Job, Layout
from commpipe.plan.memory import layer_params_per_rank

# 2 MoE layers, 8 heads: queries through a 96-wide latent, K/V through a 64-wide one plus a
# 16-wide rotary half, qk = 32 + 16, v = 32
MLA = ("arch=moe,layers=2,hidden=256,heads=8,kv_heads=8,vocab=1024,experts=4,top_k=2,"
       "expert_ffn=128,attention=mla,q_lora_rank=96,kv_lora_rank=64,qk_nope_dim=32,"
       "qk_rope_dim=16,v_head_dim=32")
H, NH, QL, KL, NOPE, ROPE, V = 256, 8, 96, 64, 32, 16, 32
QK = NOPE + ROPE


@pytest.mark.parametrize("q_lora", [QL, 0])
def test_priced_gemms_carry_the_familys_attention_flops(q_lora):
    # summed over the TP ranks (each computes its split GEMMs and every replicated one), the
    # projections' FLOPs are tp-1 replicated down projections more than the family's count
    spec = resolve(MLA.replace(f"q_lora_rank={QL}", f"q_lora_rank={q_lora}"))
    tokens, seq = 2 * 128, 128
    core = 2 * seq * NH * (QK + V)
    family = M.attention_flops_per_token(spec, seq) - core
    down = H * (q_lora + KL + ROPE)                 # wq_a (if any) and wkv_a: replicated
    for tp in (1, 2, 4):
        got = sum(2 * m * k * n for m, k, n in mla_gemms(spec, tokens, tp)) * tp
        assert got == pytest.approx(tokens * (family + 2 * (tp - 1) * down), rel=1e-12)
    # the layer's GEMM list is MLA's, then the (empty) dense MLP of a MoE spec
    shapes = layer_gemms(spec, Layout(tp=2, micro_batch_size=2), Job(8, seq))
    assert shapes[:-2] == mla_gemms(spec, tokens, 2) and [n for _, _, n in shapes[-2:]] == [0, H]


def test_tp_splits_the_heads_and_keeps_the_latents_whole():
    spec = resolve(MLA)
    # by hand: wq_a 256x96 + q_norm 96, wq_b 96 x 8*48, wkv_a 256 x (64+16) + kv_norm 64,
    # wkv_b 64 x 8*(32+32), wo 8*32 x 256, and the layer's two RMSNorms of 256
    rep = H * QL + QL + H * (KL + ROPE) + KL + 2 * H
    split = QL * NH * QK + KL * NH * (NOPE + V) + NH * V * H
    assert M.attention_param_count(spec) + 2 * H == rep + split
    for tp in (1, 2, 8):
        assert layer_params_per_rank(spec, tp) == pytest.approx(rep + split / tp)


def test_saved_tensors_by_hand():
    spec = resolve(MLA)
    tokens, tp = 512, 2
    split, rep = mla_activation_bytes(spec, tokens, tp)
    # bf16 Q and K (8 x 48 each), V and O (8 x 32 each), split over TP; the query latent and the
    # K/V latent before and after their norms and the rotary key half, on every rank
    assert split == 2 * tokens * (2 * NH * QK + 2 * NH * V) / tp
    assert rep == 2 * tokens * (2 * QL + 2 * KL + ROPE)


def test_deepseek_v3_is_estimated(capsys):
    # DeepSeek-V3's layout (its report, section 3.1: PP16, EP64 over 8 nodes, ZeRO-1 DP, no TP,
    # DualPipe) on 2048 GPUs at the report's final batch of 15,360 sequences of 4,096 tokens
    rc = main(["estimate", "--model", "deepseek-v3", "--gpu", "h100", "--gpus", "2048",
               "--global-batch", "15360", "--seq-len", "4096", "--pp", "16", "--dp", "128",
               "--ep", "64", "--schedule", "dualpipev", "--micro-batch-size", "1", "--zero", "1",
               "--json"])
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["moe"]["ep"] == 64 and out["moe"]["a2a_braided"] and 0 < out["tflops_per_gpu"] < 989
    # in bf16, without the report's FP8 activations and recomputed up-projections, 16.5
    # micro-batches of 4 layers in flight (DualPipeV at pp 16) do not fit an 80 GB GPU: priced,
    # then refused with the reason (exit status 1, as for any layout that does not fit)
    assert rc == 1 and not out["feasible"] and out["reason"].startswith("out of memory")
