"""Tokenizers: a local Hugging Face `tokenizer.json`, or a byte-level BPE trained on the corpus.

A trained tokenizer is saved as `<cache_dir>/tokenizer-<vocab>.json` and loaded, not retrained,
on every later run. Every document is followed by an end-of-document token (EOD) in the token
stream; a trained tokenizer reserves `<|endoftext|>` (id 0) for it, a loaded one uses its own
end-of-text token if it has one and otherwise gets `<|endoftext|>` added.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from commpipe.data.corpus import Corpus

EOD_TOKEN = "<|endoftext|>"
# End-of-text tokens of common released tokenizers (GPT-2/NeoX, LLaMA-3, LLaMA-2/T5, others).
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
# 256 byte symbols of the byte-level alphabet + the EOD token (GPT-2 byte-level BPE, Radford
# et al. 2019, section 2.2): a smaller vocabulary cannot encode every byte.
MIN_BPE_VOCAB = 257


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the EOD id and a content hash used by the token caches."""

    def __init__(self, hf, path: Path, eod_token: str, trained: bool = False):
        self.hf = hf
        self.path = Path(path)
        self.eod_token = eod_token
        self.eod_id = hf.token_to_id(eod_token)
        self.trained = trained            # True when this object was trained in this process
        self.encoded_docs = 0             # documents encoded through this object
        ids = hf.get_vocab(with_added_tokens=True).values()
        # ids may have holes in hand-made files; the embedding must cover the largest one
        self.vocab_size = max(hf.get_vocab_size(with_added_tokens=True), max(ids) + 1)
        digest = hashlib.sha256(self.path.read_bytes())
        digest.update(f"|eod={eod_token}".encode())
        self.sha256 = digest.hexdigest()

    @property
    def name(self) -> str:
        return self.path.stem

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without the post-processor's BOS/CLS additions."""
        self.encoded_docs += len(texts)
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)  # no offsets: faster
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def describe(self) -> str:
        return f"{self.path} (vocab {self.vocab_size}, eod {self.eod_token!r}={self.eod_id})"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a Hugging Face `tokenizer.json`; add `<|endoftext|>` if it has no end-of-text token."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist; pass the path of a Hugging "
                                f"Face tokenizer.json, or use --train-tokenizer --vocab-size N")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None
    for token in _EOD_CANDIDATES:
        if hf.token_to_id(token) is not None:
            return Tokenizer(hf, path, token)
    hf.add_special_tokens([EOD_TOKEN])
    return Tokenizer(hf, path, EOD_TOKEN)


def train_bpe(corpus: Corpus, vocab_size: int, out_path: str | Path,
              progress: bool | None = None) -> Tokenizer:
    """Train a byte-level BPE on the train split and save it (atomically) at `out_path`."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                         f"{MIN_BPE_VOCAB} (256 bytes + end-of-document token)")
    # Only the train split: valid/test text must not shape the vocabulary.
    hf = train_byte_level_bpe(corpus.documents("train"), vocab_size, [EOD_TOKEN], out_path,
                              progress=bool(progress))
    return Tokenizer(hf, Path(out_path), EOD_TOKEN, trained=True)


def train_byte_level_bpe(texts, vocab_size: int, special_tokens: list[str], out_path: str | Path,
                         progress: bool = False):
    """A byte-level BPE (HF tokenizers) trained on `texts`, special tokens first (ids 0, 1, ..),
    saved atomically at `out_path`; returns the HF tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from commpipe.files import check_out_dir

    check_out_dir(Path(out_path).parent, "the tokenizer's folder (--cache-dir)")   # before training
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress)
    hf.train_from_iterator(texts, trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    try:
        hf.save(str(tmp))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return hf


def trained_path(cache_dir: str | Path, vocab_size: int) -> Path:
    return Path(cache_dir) / f"tokenizer-{vocab_size}.json"


def resolve_tokenizer(corpus: Corpus, cache_dir: str | Path, tokenizer: str | Path | None = None,
                      vocab_size: int | None = None, allow_train: bool = True,
                      progress: bool | None = None) -> Tokenizer:
    """The tokenizer for a corpus.

    `tokenizer` given: load that file. `vocab_size` given: load `tokenizer-<vocab>.json` from
    `cache_dir`, training it first if it is missing (and `allow_train`). Neither: use the one
    `tokenizer-*.json` in `cache_dir` (or a `tokenizer.json` there).
    """
    if tokenizer is not None and vocab_size is not None:
        raise ValueError("give either a tokenizer file (--tokenizer) or a vocabulary size to train "
                         "(--train-tokenizer --vocab-size N), not both")
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    cache_dir = Path(cache_dir)
    if vocab_size is not None:
        path = trained_path(cache_dir, vocab_size)
        if path.is_file():
            return load_tokenizer(path)
        if not allow_train:
            raise FileNotFoundError(f"no tokenizer {path}; run `commpipe tokenize --data {corpus.root} "
                                    f"--train-tokenizer --vocab-size {vocab_size}` first")
        return train_bpe(corpus, vocab_size, path, progress)
    found = sorted(cache_dir.glob("tokenizer-*.json"))
    if len(found) == 1:
        return load_tokenizer(found[0])
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{cache_dir} holds several tokenizers ({names}); choose one with "
                         f"--tokenizer PATH or --vocab-size N")
    if (cache_dir / "tokenizer.json").is_file():
        return load_tokenizer(cache_dir / "tokenizer.json")
    raise FileNotFoundError(f"no tokenizer in {cache_dir}; run `commpipe tokenize --data {corpus.root} "
                            f"--train-tokenizer --vocab-size 32000` or pass --tokenizer PATH")
