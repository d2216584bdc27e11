"""Where training tokens come from: a tokenized corpus (`--data DIR`) or synthetic tokens."""

from __future__ import annotations

from commpipe.models.spec import ModelSpec


def make_source(cfg, spec: ModelSpec):
    """A batch source with `batch(step, global_batch, dp_rank, dp_size) -> (inputs, labels)`."""
    from commpipe import data

    if cfg.data:
        source = data.open_source(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed)
        if source.vocab_size > spec.vocab:
            raise ValueError(f"the tokenizer of {cfg.data} has {source.vocab_size} tokens but "
                             f"model {spec.name} has vocab {spec.vocab}; give --vocab "
                             f"{source.vocab_size} or retokenize with a smaller vocabulary")
        return source
    return data.SyntheticTokens(vocab=spec.vocab, seq_len=cfg.seq_len, seed=cfg.seed)
