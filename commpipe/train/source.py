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
    from commpipe.models.family import family_for_model
    from commpipe.train.families import training_for

    # a tokenized corpus (commpipe.train.decoder), COCO captions (commpipe.train.multimodal)
    return training_for(family_for_model(cfg.model)).open_data(cfg, world_size)


def make_source(cfg, spec: ModelSpec):
    """A batch source with `batch(step, global_batch, dp_rank, dp_size) -> (inputs, labels)`."""
    from commpipe.models.family import family_of
    from commpipe.train.families import training_for

    return training_for(family_of(spec)).make_source(cfg)


def check_vocab(source, spec: ModelSpec, data_dir) -> None:
    if source.vocab_size > spec.vocab:
        raise ValueError(f"the tokenizer of {data_dir} has {source.vocab_size} tokens but "
                         f"model {spec.name} has vocab {spec.vocab}; leave the vocabulary to "
                         f"--data (it pads the tokenizer's) or retokenize with a smaller one")
