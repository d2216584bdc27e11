"""Hugging Face Mixtral checkpoints in and out (`commpipe convert`, `commpipe train --init-from`).

Small random MixtralForCausalLM models are built with transformers and saved with
save_pretrained; nothing is downloaded. Hugging Face's own forward is the reference: the
converted model's logits and loss (its balancing term included, where the config asks for one)
and the first training step's loss under pp=2 and tp=2 must equal it, and Hugging Face ->
commpipe -> Hugging Face must be bit-identical.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from commpipe.cli import main  # noqa: E402
from commpipe.models import hf, hf_llama, hf_moe  # noqa: E402
from commpipe.models.llama import cross_entropy_sum  # noqa: E402
from commpipe.models.moe import MoETransformer  # noqa: E402
from commpipe.train.weights import read_weights, save_weights  # noqa: E402
from tests.dist_harness import first_losses, spawn  # noqa: E402
from tests.test_hf_convert import save_and_convert  # noqa: E402

SEQ, GLOBAL_BATCH, SEED = 16, 4, 3
KINDS = ("mixtral", "mixtral-aux", "mixtral-wide-heads")


def mixtral_config(kind: str = "mixtral", **kw):
    """'mixtral': 2 layers, no balancing loss in the objective (output_router_logits false, as
    Mixtral's published config); 'mixtral-aux': 1 layer whose loss adds the balancing term;
    'mixtral-wide-heads': heads of 32 where hidden / heads is 16 (a head_dim set apart from the
    hidden size, as Qwen3-MoE's 128 at hidden 2048 and 32 heads)."""
    aux = kind == "mixtral-aux"
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=32,
                num_hidden_layers=1 if aux else 2, num_attention_heads=4, num_key_value_heads=2,
                num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                rope_theta=10000.0, output_router_logits=aux, router_aux_loss_coef=0.02)
    if kind == "mixtral-wide-heads":
        args["head_dim"] = 32
    return transformers.MixtralConfig(**(args | kw))


def hf_model(kind: str):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(mixtral_config(kind))
    with torch.no_grad():   # norms start at one and the router near zero: make both matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_and_convert(tmp_path_factory, KINDS, hf_model)


def commpipe_model(spec, state):
    model = MoETransformer(spec)
    model.load_state_dict(state)
    return model.eval()


def tokens_of(spec) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def converted(hf_dir, family=hf_moe.FAMILY):
    config, tensors = hf.read_folder(hf_dir)
    spec = family.spec_from_config(config, "t")
    return spec, hf.to_commpipe(family, spec, config, tensors)[0]


def logit_error(model, reference, tokens) -> float:
    with torch.no_grad():
        return (model(tokens)[0] - reference(input_ids=tokens).logits).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_round_trip_is_bit_identical(saved, kind, tmp_path):
    hf_dir, ckpt, _ = saved[kind]
    assert main(["convert", "--from", str(ckpt), "--to-hf", str(tmp_path / "back")]) == 0
    want, got = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config


def test_config_maps_to_the_spec(saved):
    """The fields that decide the function: experts stacked [experts, ...], Mixtral's router,
    and the balancing loss as Hugging Face weighs it (top_k x its coefficient for one layer)."""
    _, spec, state = read_weights(saved["mixtral"][1])
    assert (spec.layers, spec.experts, spec.top_k, spec.expert_ffn, spec.kv_heads) == (2, 4, 2, 32, 2)
    assert (spec.gate, spec.norm_topk, spec.route_scale, spec.shared_experts) == ("softmax", True, 1.0, 0)
    assert (spec.rope_theta, spec.aux_loss_coef) == (10000.0, 0.0)
    assert state["layers.1.feed_forward.experts.w2"].shape == (4, 64, 32)
    assert read_weights(saved["mixtral-aux"][1])[1].aux_loss_coef == pytest.approx(0.04)
    wide = read_weights(saved["mixtral-wide-heads"][1])
    assert (wide[1].head_dim, wide[1].q_width, spec.head_dim) == (32, 128, 16)
    assert wide[2]["layers.0.attention.wq.weight"].shape == (128, 64)
    assert wide[2]["layers.0.attention.wo.weight"].shape == (64, 128)


@pytest.mark.parametrize("kind", KINDS)
def test_converted_logits_and_loss_equal_hugging_face(saved, kind):
    """Logits within 1e-5, and the loss: Hugging Face's (labels = the inputs, shifted inside;
    the balancing term added when output_router_logits is set) against commpipe's token
    cross-entropy over the same positions plus its carried balancing term per token."""
    _, ckpt, reference = saved[kind]
    _, spec, state = read_weights(ckpt)
    tokens = tokens_of(spec)
    with torch.no_grad():
        logits, aux = commpipe_model(spec, state)(tokens)
        out = reference(input_ids=tokens, labels=tokens)
    assert (logits - out.logits).abs().max().item() <= 1e-5
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)   # the last has none
    loss = cross_entropy_sum(logits, labels) / (labels >= 0).sum() + aux / tokens.numel()
    assert (aux > 0) == (kind == "mixtral-aux")
    assert abs(loss.item() - out.loss.item()) <= 1e-5


def test_fused_expert_layout_converts_to_the_same_weights(saved, tmp_path):
    """A folder holding transformers >= 5's in-memory layout (mlp.gate, mlp.experts.gate_up_proj
    and down_proj) gives the same commpipe weights as save_pretrained's per-expert one."""
    hf_dir, ckpt, reference = saved["mixtral"]
    fused = {n: t.contiguous() for n, t in reference.state_dict().items()}
    assert any(n.endswith("experts.gate_up_proj") for n in fused)
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((hf_dir / "config.json").read_text())
    _, want = read_weights(ckpt)[1:]
    _, got = converted(tmp_path / "fused")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_bf16_folders_come_back_as_save_pretrained_writes_them(saved, tmp_path):
    """A bf16 Mixtral, per-expert (save_pretrained) or fused, is trained in fp32 master weights
    and written back in bf16, per expert: bit-identical to save_pretrained's folder."""
    reference = copy.deepcopy(saved["mixtral"][2]).to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "hf")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "fused").mkdir()
    save_file({n: t.contiguous() for n, t in reference.state_dict().items()},
              tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    for source in ("hf", "fused"):
        ckpt, back = tmp_path / f"{source}-ckpt", tmp_path / f"{source}-back"
        assert main(["convert", "--from-hf", str(tmp_path / source), "--out", str(ckpt)]) == 0
        assert read_weights(ckpt)[2]["layers.0.feed_forward.experts.w1"].dtype == torch.float32
        assert main(["convert", "--from", str(ckpt), "--to-hf", str(back)]) == 0
        got = load_file(back / "model.safetensors")
        assert sorted(got) == sorted(want), source
        for name, tensor in want.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("plant", ["unpermuted rotary rows", "w1 and w3 swapped"])
def test_planted_mapping_bugs_are_caught(saved, monkeypatch, plant):
    """The weights still load (the shapes agree), but the logits comparison above sees it."""
    hf_dir, _, reference = saved["mixtral"]
    if plant == "unpermuted rotary rows":
        # the attention rules Mixtral shares with LLaMA (hf_llama.attention_rules)
        monkeypatch.setattr(hf_llama, "halves_to_pairs", lambda w, heads: w)
    else:
        monkeypatch.setattr(hf_moe, "EXPERT_NAMES", (("w1", "w3"), ("w2", "w2"), ("w3", "w1")))
    spec, state = converted(hf_dir)
    assert logit_error(commpipe_model(spec, state), reference, tokens_of(spec)) > 1e-3


@pytest.mark.parametrize("edit, message", [
    (dict(sliding_window=8, max_position_embeddings=64), "sliding_window=8"),
    (dict(output_router_logits=True), "output_router_logits"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope type 'linear'"),
])
def test_what_commpipe_cannot_compute_is_refused(edit, message):
    config = mixtral_config().to_dict() | edit
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_moe.spec_from_config(config, "t")


def test_sliding_window_covering_the_context_is_full_attention():
    config = mixtral_config().to_dict() | dict(sliding_window=64, max_position_embeddings=64)
    assert hf_moe.spec_from_config(config, "t").layers == 2


@pytest.mark.parametrize("layers, aux, written, back", [
    (1, 0.04, (True, 0.02), 0.04),   # one layer: Hugging Face's loss is top_k x commpipe's
    (2, 0.0, (False, 0.001), 0.0),   # no balancing loss: output_router_logits off
    (2, 0.02, (False, 0.01), 0.0),   # a pooled loss is another objective: left off
])
def test_balancing_loss_written_for_hugging_face(layers, aux, written, back):
    """commpipe's aux_loss_coef -> (output_router_logits, router_aux_loss_coef) and back."""
    from commpipe.models.moe_spec import MoESpec

    spec = MoESpec("m", layers=layers, hidden=64, heads=4, kv_heads=2, vocab=128, experts=4,
                   top_k=2, expert_ffn=32, aux_loss_coef=aux)
    config = hf_moe.config_from_spec(spec, None)
    assert (config["output_router_logits"], config["router_aux_loss_coef"]) == written
    assert hf_moe.spec_from_config(config, "m").aux_loss_coef == back


def test_commpipe_weights_load_in_hugging_face(tmp_path, capsys):
    """A commpipe MoE model (no Hugging Face origin) exported and read back by transformers'
    from_pretrained computes the same logits; a shape Mixtral cannot hold is refused."""
    from commpipe.models.moe import build_moe
    from commpipe.models.moe_spec import resolve_moe

    spec = resolve_moe("arch=moe,layers=2,hidden=64,heads=8,kv_heads=2,vocab=128,experts=4,"
                       "top_k=2,expert_ffn=48,norm_eps=1e-6,rope_theta=5e5,aux_loss_coef=0.02")
    model = build_moe(spec, seed=4)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.feed_forward.router.weight.mul_(20)
    save_weights(tmp_path / "ckpt", spec, dict(model.state_dict()))
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    reference = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert logit_error(model.eval(), reference, tokens_of(spec)) <= 1e-5
    save_weights(tmp_path / "tiny", resolve_moe("moe-tiny"),
                 dict(build_moe("moe-tiny").state_dict()))
    assert main(["convert", "--from", str(tmp_path / "tiny"), "--to-hf", str(tmp_path / "no")]) == 2
    assert "shared_experts=1" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def hf_loss(kind: str, reference, spec) -> float:
    """Hugging Face's loss on the first batch a run with --seed SEED reads (one micro-batch):
    mean next-token cross-entropy plus, where its config asks, its balancing term."""
    from commpipe.data import SyntheticTokens

    tokens, labels = SyntheticTokens(spec.vocab, SEED, seq_len=SEQ).batch(0, GLOBAL_BATCH)
    with torch.no_grad():
        out = reference(input_ids=tokens)
    ce = F.cross_entropy(out.logits.flatten(0, 1).double(), labels.flatten()).item()
    return ce + (reference.config.router_aux_loss_coef * out.aux_loss.item()
                 if out.aux_loss is not None else 0.0)


def test_cli_init_from_trains_the_converted_model(saved, tmp_path):
    _, ckpt, reference = saved["mixtral-aux"]
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(ckpt), "--steps", "1", "--seq-len", str(SEQ),
                 "--global-batch", str(GLOBAL_BATCH), "--micro-batch-size", str(GLOBAL_BATCH),
                 "--seed", str(SEED), "--out", str(out)]) == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    _, spec, _ = read_weights(ckpt)
    assert first["step"] == 0 and abs(first["loss"] - hf_loss("mixtral-aux", reference, spec)) <= 1e-5


# -- pp=2 and tp=2: the first step's loss from --init-from equals Hugging Face's ----------------
@pytest.mark.slow
def test_pp2_and_tp2_first_step_from_init_equals_hugging_face(saved):
    """The 2-layer model split over two pipeline stages (four micro-batches, 1F1B), the 1-layer
    model with its balancing term under tp=2 (one micro-batch: Hugging Face's balancing loss is
    over the whole batch of one forward), and the wide-headed model under tp=2 (its 32-wide heads
    split two a rank)."""
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.weights import init_model

    jobs = []
    for kind, dims, mbs in (("mixtral", ParallelDims(pp=2), 1),
                            ("mixtral-aux", ParallelDims(tp=2), GLOBAL_BATCH),
                            ("mixtral-wide-heads", ParallelDims(tp=2), 1)):
        ckpt = str(saved[kind][1])
        jobs.append((kind, TrainConfig(model=init_model(ckpt, None), init_from=ckpt, dims=dims,
                                       steps=1, seq_len=SEQ, global_batch=GLOBAL_BATCH,
                                       micro_batch_size=mbs, seed=SEED, device="cpu")))
    per_rank = spawn(first_losses, 2, jobs)
    for kind in KINDS:
        _, spec, _ = read_weights(saved[kind][1])
        want = hf_loss(kind, saved[kind][2], spec)
        for r, losses in enumerate(per_rank):   # every rank learns the step's loss
            assert abs(losses[kind] - want) <= 1e-5, (kind, r, losses[kind], want)

