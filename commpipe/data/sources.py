"""Batch sources for the training loop: a tokenized corpus, or synthetic random tokens.

Both implement the same interface (see the `commpipe.data` package docstring):

    source.vocab_size, source.seq_len
    source.batch(step, global_batch, dp_rank, dp_size) -> (inputs, labels)   # [B/dp, seq_len]
    source.validation(global_batch, dp_rank, dp_size, max_batches) -> iterator of such pairs
    source.state_dict() / source.load_state_dict(state)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commpipe.data.cache import CacheInfo, ensure_cache
from commpipe.data.corpus import Corpus, open_corpus
from commpipe.data.sampler import TokenDataset, WindowSampler, check_dp
from commpipe.data.tokenizer import Tokenizer, resolve_tokenizer


@dataclass
class Prepared:
    corpus: Corpus
    tokenizer: Tokenizer
    caches: dict[str, CacheInfo]
    cache_dir: Path
    build: bool


def prepare(data_dir: str | Path, *, format: str = "auto", text_field: str = "text",
            tokenizer: str | Path | None = None, vocab_size: int | None = None,
            cache_dir: str | Path | None = None, splits: tuple[str, ...] | None = None,
            build: bool = True, rebuild: bool = False, progress: bool | None = None,
            allow_train: bool | None = None) -> Prepared:
    """Find the corpus, get its tokenizer (training it if asked) and its up-to-date caches.

    With `build=False` nothing is trained or tokenized: a missing or stale tokenizer/cache is a
    FileNotFoundError naming the `commpipe tokenize` command that makes it. `allow_train`
    (default: `build`) says whether a missing `tokenizer-<vocab_size>.json` may be trained.
    """
    corpus = open_corpus(data_dir, format, text_field)
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else corpus.root
    allow_train = build if allow_train is None else allow_train and build
    tok = resolve_tokenizer(corpus, cache_dir, tokenizer, vocab_size, allow_train=allow_train,
                            progress=progress)
    wanted = corpus.splits if splits is None else tuple(s for s in splits if s in corpus.splits)
    caches = {s: ensure_cache(corpus, s, tok, cache_dir, build=build, rebuild=rebuild,
                              progress=progress) for s in wanted}
    return Prepared(corpus, tok, caches, cache_dir, build)


class CorpusSource:
    """Seeded, DP-sharded, resumable windows of a tokenized corpus (train split)."""

    kind = "corpus"

    def __init__(self, prepared: Prepared, seq_len: int, seed: int = 0):
        self.prepared = prepared
        self.tokenizer = prepared.tokenizer
        self.vocab_size = prepared.tokenizer.vocab_size
        self.eod_id = prepared.tokenizer.eod_id
        self.seq_len, self.seed = seq_len, seed
        self.train = TokenDataset(prepared.caches["train"].tokens(), seq_len)
        self.sampler = WindowSampler(self.train.num_tokens, seq_len, seed)
        self._eval: dict[str, TokenDataset] = {}

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        """This DP rank's (inputs, labels) of training step `step`, each [B/dp, seq_len] int64."""
        return self.train.batch(self.sampler.window_ids(step, global_batch, dp_rank, dp_size))

    def validation(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                   max_batches: int | None = None, split: str = "valid") -> Iterator:
        """Fixed, unshuffled batches of the valid (or test) split; see TokenDataset.validation."""
        if split not in self._eval:
            p = self.prepared
            info = p.caches.get(split) or ensure_cache(p.corpus, split, p.tokenizer, p.cache_dir,
                                                       build=p.build)
            self._eval[split] = TokenDataset(info.tokens(), self.seq_len)
        return self._eval[split].validation(global_batch, dp_rank, dp_size, max_batches)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "tokenizer_sha256": self.tokenizer.sha256,
                **self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"data state is from a {state.get('kind')!r} source, this run reads a "
                             f"corpus; resume with the same --data")
        if state["tokenizer_sha256"] != self.tokenizer.sha256:
            raise ValueError("data state was saved with another tokenizer; resume with the same one")
        self.sampler.load_state_dict(state)

    def describe(self) -> str:
        return (f"{self.prepared.corpus.describe()}, {self.train.num_tokens:,} train tokens, "
                f"{self.sampler.num_windows:,} windows of {self.seq_len}, tokenizer "
                f"{self.tokenizer.describe()}")


class SyntheticTokens:
    """Uniform random tokens, a pure function of (seed, step, row): no corpus needed.

    Row g of the global batch of step s is drawn from `numpy.random.default_rng([seed, 0, s, g])`,
    so the global batch does not depend on dp_size and DP ranks read disjoint rows of it. The
    loss of a model trained on it cannot drop below ln(vocab): it exercises the machinery only.
    """

    kind = "synthetic"

    def __init__(self, vocab: int, seed: int = 0, *, seq_len: int, val_batches: int = 8):
        if vocab < 2 or seq_len < 1:
            raise ValueError(f"synthetic tokens need vocab >= 2 and seq_len >= 1 (got {vocab}, {seq_len})")
        self.vocab_size, self.seed, self.seq_len = vocab, seed, seq_len
        self.val_batches = val_batches
        self._next_step = 0

    def _rows(self, stream: int, step: int, rows: range):
        import torch

        out = np.stack([np.random.default_rng([self.seed, stream, step, g])
                        .integers(0, self.vocab_size, self.seq_len + 1) for g in rows])
        t = torch.from_numpy(out.astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        local = check_dp(global_batch, dp_rank, dp_size)
        self._next_step = step + 1
        return self._rows(0, step, range(dp_rank * local, (dp_rank + 1) * local))

    def validation(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                   max_batches: int | None = None, split: str = "valid") -> Iterator:
        """`val_batches` fixed global batches from a stream separate from training."""
        local = check_dp(global_batch, dp_rank, dp_size)
        n = self.val_batches if max_batches is None else min(max_batches, self.val_batches)
        for i in range(n):
            yield self._rows(1, i, range(dp_rank * local, (dp_rank + 1) * local))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "vocab": self.vocab_size, "seed": self.seed,
                "seq_len": self.seq_len, "step": self._next_step}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("kind", "vocab", "seed", "seq_len"):
            if state.get(key) != mine[key]:
                raise ValueError(f"data state was saved with {key}={state.get(key)!r}, this run has "
                                 f"{mine[key]!r}; resume with the same data settings")
        self._next_step = int(state["step"])

    def describe(self) -> str:
        return f"synthetic tokens (vocab {self.vocab_size}, seed {self.seed}, seq_len {self.seq_len})"


def open_source(data_dir: str | Path, seq_len: int, seed: int = 0, *, format: str = "auto",
                text_field: str = "text", tokenizer: str | Path | None = None,
                vocab_size: int | None = None, cache_dir: str | Path | None = None,
                build: bool = True, progress: bool | None = None) -> CorpusSource:
    """The training source for a data directory (train and valid caches made or reused)."""
    prepared = prepare(data_dir, format=format, text_field=text_field, tokenizer=tokenizer,
                       vocab_size=vocab_size, cache_dir=cache_dir, splits=("train", "valid"),
                       build=build, progress=progress)
    return CorpusSource(prepared, seq_len, seed)
