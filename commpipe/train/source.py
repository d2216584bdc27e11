"""Where training tokens come from: a tokenized corpus (`--data DIR`) or synthetic tokens.

With `--data` the model's vocabulary is the tokenizer's, padded (see `padded_vocab`); the
corpus is opened before any process group starts, so a missing tokenizer or token cache fails
early with the `commpipe tokenize` command that makes it.
"""

from __future__ import annotations

import math

from commpipe.models.spec import ModelSpec

# Pad the embedding and head to a multiple of 64 rows: matmuls over a vocabulary dimension
# that is a multiple of 64 use whole GPU tiles (the reason Megatron-LM pads to 128 * tp), and
# 64 is divisible by every power-of-two tp up to 64, so the padded size, and with it a
# checkpoint, does not change when tp does. The padding rows are never a label; their logits
# only add to the softmax denominator, and training pushes them down like any unused token.
VOCAB_MULTIPLE = 64


def padded_vocab(tokenizer_vocab: int, tp: int) -> int:
    """Smallest multiple of lcm(64, tp) that holds `tokenizer_vocab` tokens."""
    step = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-tokenizer_vocab // step) * step


def open_data(cfg, world_size: int):
    """Open `cfg.data` and set the model vocabulary from its tokenizer (call before resolve()).

    One process (world_size 1) may train the tokenizer and tokenize missing splits; a
    multi-process job only reads, so no two ranks race to write the same cache.
    """
    from commpipe import data
    from commpipe.models.blip_spec import is_blip

    if is_blip(cfg.model):   # image-caption pairs in the COCO captions layout
        from commpipe.train.multimodal import open_coco

        return open_coco(cfg, world_size)
    source = data.open_source(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed,
                              tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                              build=world_size == 1, progress=False if world_size > 1 else None)
    if cfg.eval_every and "valid" not in source.prepared.caches:
        raise ValueError(f"--eval-every needs a valid split in {cfg.data} (e.g. wiki.valid.raw, "
                         f"valid.txt or valid.jsonl); add one or drop --eval-every")
    cfg.vocab = padded_vocab(source.vocab_size, cfg.dims.tp)
    return source


def make_source(cfg, spec: ModelSpec):
    """A batch source with `batch(step, global_batch, dp_rank, dp_size) -> (inputs, labels)`."""
    from commpipe import data

    if spec.arch == "blip":
        from commpipe.train.multimodal import make_blip_source

        return make_blip_source(cfg)
    if cfg.data:
        world = cfg.dims.world_size
        source = data.open_source(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed,
                                  tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size,
                                  build=world == 1, progress=False if world > 1 else None)
        check_vocab(source, spec, cfg.data)
        return source
    return data.SyntheticTokens(vocab=spec.vocab, seq_len=cfg.seq_len, seed=cfg.seed)


def check_vocab(source, spec: ModelSpec, data_dir) -> None:
    if source.vocab_size > spec.vocab:
        raise ValueError(f"the tokenizer of {data_dir} has {source.vocab_size} tokens but "
                         f"model {spec.name} has vocab {spec.vocab}; leave the vocabulary to "
                         f"--data (it pads the tokenizer's) or retokenize with a smaller one")
