"""Hugging Face checkpoints in and out (`commpipe convert`, `commpipe train --init-from`).

Small random LlamaForCausalLM (GQA) and BlipForConditionalGeneration models are built with
transformers and saved with save_pretrained; nothing is downloaded. Hugging Face's own forward
is the reference: the converted model's logits and the first training step's loss under
tp=2 pp=2 must equal it, and Hugging Face -> commpipe -> Hugging Face must be bit-identical.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from commpipe.cli import main  # noqa: E402
from commpipe.models import hf_llama  # noqa: E402
from commpipe.train.weights import read_weights, save_weights  # noqa: E402
from tests.dist_harness import first_losses, spawn  # noqa: E402

SEQ, GLOBAL_BATCH, SEED = 16, 4, 3


def llama_config(tied: bool = False):
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, rms_norm_eps=1e-5,
                                    rope_theta=10000.0, tie_word_embeddings=tied)


def blip_config():
    return transformers.BlipConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8),
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                         bos_token_id=1, sep_token_id=2))


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "blip":
        model = transformers.BlipForConditionalGeneration(blip_config())
    else:
        model = transformers.LlamaForCausalLM(llama_config(tied=kind == "llama-tied"))
    with torch.no_grad():   # norms start at one; random ones make the comparison meaningful
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_and_convert(tmp_path_factory, kinds, hf_model) -> dict:
    """{kind: (Hugging Face folder, converted commpipe checkpoint, the Hugging Face model)}:
    each kind's model saved with save_pretrained and converted by `commpipe convert`."""
    out = {}
    for kind in kinds:
        root = tmp_path_factory.mktemp(kind)
        model = hf_model(kind)
        model.save_pretrained(root / "hf")
        assert main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
        out[kind] = (root / "hf", root / "ckpt", model)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_and_convert(tmp_path_factory, ("llama", "llama-tied", "blip"), hf_model)


def commpipe_model(spec, state):
    from commpipe.models.blip import Blip
    from commpipe.models.llama import Transformer

    model = Blip(spec) if spec.arch == "blip" else Transformer(spec)
    model.load_state_dict(state)
    return model.eval()


def inputs(kind: str, spec) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab, (2, SEQ), generator=g)
    if kind != "blip":
        return {"tokens": tokens}
    return {"tokens": tokens,
            "pixels": torch.randn(2, 3, spec.image_size, spec.image_size, generator=g)}


def logits_of(model, batch) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            kw = {"input_ids": batch["tokens"]}
            if "pixels" in batch:
                kw["pixel_values"] = batch["pixels"]
            return model(**kw).logits
        if "pixels" in batch:
            return model(pixels=batch["pixels"], tokens=batch["tokens"])["logits"]
        return model(batch["tokens"])


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "blip"])
def test_hugging_face_round_trip_is_bit_identical(saved, kind, tmp_path):
    hf_dir, ckpt, _ = saved[kind]
    assert main(["convert", "--from", str(ckpt), "--to-hf", str(tmp_path / "back")]) == 0
    want, got = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "blip"])
def test_converted_logits_equal_hugging_face(saved, kind):
    _, ckpt, reference = saved[kind]
    _, spec, state = read_weights(ckpt)
    batch = inputs(kind, spec)
    got, want = logits_of(commpipe_model(spec, state), batch), logits_of(reference, batch)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_unpermuted_rotary_rows_are_caught(saved, monkeypatch):
    """Without the q/k row permutation the weights load (the shapes agree) but the logits
    are wrong: the comparison above must see that."""
    hf_dir, _, reference = saved["llama"]
    monkeypatch.setattr(hf_llama, "halves_to_pairs", lambda w, heads: w)
    from commpipe.models import hf

    config, tensors = hf.read_folder(hf_dir)
    spec = hf_llama.spec_from_config(config, "planted")
    state, _ = hf.to_commpipe(hf_llama.FAMILY, spec, config, tensors)
    batch = inputs("llama", spec)
    assert (logits_of(commpipe_model(spec, state), batch) - logits_of(reference, batch)).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "blip"])
def test_commpipe_weights_load_in_hugging_face(kind, tmp_path):
    """A commpipe model (untied head, no Hugging Face origin) exported and read back by
    transformers' from_pretrained computes the same logits."""
    from commpipe.models import blip, llama
    from commpipe.models.blip_spec import BlipSpec
    from commpipe.models.spec import ModelSpec

    if kind == "blip":
        spec = BlipSpec("b", image_size=32, patch=8, enc_layers=2, enc_hidden=32, enc_heads=4,
                        enc_mlp=64, dec_layers=1, dec_hidden=32, dec_heads=2, dec_mlp=64, vocab=50,
                        text_len=16, max_text_len=32)
        model = blip.build_model(spec, seed=4)
        cls = transformers.BlipForConditionalGeneration
    else:
        spec = ModelSpec("l", "llama", layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=96,
                         vocab=128, norm_eps=1e-6, rope_theta=5e5)
        model = llama.build_model(spec, seed=4)
        cls = transformers.LlamaForCausalLM
    save_weights(tmp_path / "ckpt", spec, dict(model.state_dict()))
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    reference = cls.from_pretrained(tmp_path / "hf").eval()
    batch = inputs(kind, spec)
    assert (logits_of(model.eval(), batch) - logits_of(reference, batch)).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["llama-tied", "blip"])
def test_head_trained_apart_from_the_embedding_is_written_untied(saved, kind, tmp_path):
    """Imported tied, then changed apart (as training does): the export writes the head and
    tie_word_embeddings false, and transformers computes commpipe's logits from it."""
    meta, spec, state = read_weights(saved[kind][1])
    head = "head.output.weight" if kind == "blip" else "output.weight"
    g = torch.Generator().manual_seed(2)
    state[head] = state[head] + 0.05 * torch.randn(state[head].shape, generator=g)
    save_weights(tmp_path / "ckpt", spec, state, hf=meta["hf"])
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    cls = transformers.BlipForConditionalGeneration if kind == "blip" else transformers.LlamaForCausalLM
    reference = cls.from_pretrained(tmp_path / "hf").eval()
    batch = inputs(kind, spec)
    assert (logits_of(commpipe_model(spec, state), batch) - logits_of(reference, batch)).abs().max() <= 1e-5


def hf_loss(kind: str, reference, spec) -> float:
    """Hugging Face's logits on the first batch a run with --seed SEED reads, under commpipe's
    loss (mean next-token cross-entropy over the labelled tokens)."""
    if kind == "blip":
        from commpipe.train.multimodal import SyntheticCaptions

        batch = SyntheticCaptions(spec, SEED).batch(0, GLOBAL_BATCH)
        logits = logits_of(reference, batch)
        labels = batch["labels"]
    else:
        from commpipe.data import SyntheticTokens

        tokens, labels = SyntheticTokens(spec.vocab, SEED, seq_len=SEQ).batch(0, GLOBAL_BATCH)
        logits = logits_of(reference, {"tokens": tokens})
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100).item()


def test_cli_init_from_trains_the_converted_model(saved, tmp_path):
    _, ckpt, reference = saved["llama"]
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(ckpt), "--steps", "1", "--seq-len", str(SEQ),
                 "--global-batch", str(GLOBAL_BATCH), "--seed", str(SEED), "--out", str(out)]) == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    _, spec, _ = read_weights(ckpt)
    assert first["step"] == 0 and abs(first["loss"] - hf_loss("llama", reference, spec)) <= 1e-5


def test_init_from_refuses_another_model_and_resume_of_weights(saved, capsys):
    _, ckpt, _ = saved["llama"]
    assert main(["train", "--init-from", str(ckpt), "--model", "tiny", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--model tiny is not the model of --init-from" in err and "layers=2 (checkpoint)" in err
    assert main(["train", "--resume", str(ckpt), "--steps", "1"]) == 2
    assert "start a run from it with --init-from" in capsys.readouterr().err


# -- tp=2 pp=2: the first step's loss from --init-from equals Hugging Face's ---------------------
@pytest.mark.slow
def test_tp2_pp2_first_step_from_init_equals_hugging_face(saved):
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.weights import init_model

    jobs = []
    for kind in ("llama", "blip"):
        ckpt = str(saved[kind][1])
        jobs.append((kind, TrainConfig(model=init_model(ckpt, None), init_from=ckpt,
                                       dims=ParallelDims(tp=2, pp=2), steps=1, seq_len=SEQ,
                                       global_batch=GLOBAL_BATCH, seed=SEED, device="cpu")))
    per_rank = spawn(first_losses, 4, jobs)
    for kind in ("llama", "blip"):
        _, spec, _ = read_weights(saved[kind][1])
        want = hf_loss(kind, saved[kind][2], spec)
        for r, losses in enumerate(per_rank):   # every rank learns the step's loss
            assert abs(losses[kind] - want) <= 1e-5, (kind, r, losses[kind], want)
