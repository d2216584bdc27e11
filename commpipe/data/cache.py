"""Token caches: one memory-mapped token file per split plus a small JSON index.

    <cache_dir>/cache-<tokenizer name>/<split>.bin    flat token ids, uint16 (vocab <= 65535)
                                                      or uint32, each document followed by EOD
    <cache_dir>/cache-<tokenizer name>/<split>.json   index: sources (path, size, mtime_ns),
                                                      reader config, tokenizer sha256, dtype,
                                                      token and document counts

A cache is reused when its index still matches the source files, the reader config and the
tokenizer; otherwise it is stale and rebuilt. Both files are written to a temporary name and
renamed into place (an atomic step on POSIX), so a reader on any rank sees either the old
complete cache or the new one, never a half-written file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commpipe.data.corpus import Corpus
from commpipe.data.tokenizer import Tokenizer
from commpipe.files import check_out_dir

CACHE_VERSION = 1
BATCH_CHARS = 4_000_000  # text per encode_batch call: bounds memory, keeps all cores busy


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


@dataclass(frozen=True)
class CacheInfo:
    split: str
    bin_path: Path
    index_path: Path
    num_tokens: int
    num_documents: int
    dtype: str
    vocab_size: int
    eod_id: int
    reused: bool          # True: read from disk; False: tokenized in this call
    reason: str           # why it was (re)built, or "up to date"

    def tokens(self) -> np.memmap:
        """Read-only memory map of the split's tokens (any rank can read any window)."""
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


def cache_paths(cache_dir: str | Path, tokenizer: Tokenizer, split: str) -> tuple[Path, Path]:
    folder = Path(cache_dir) / f"cache-{tokenizer.name}"
    return folder / f"{split}.bin", folder / f"{split}.json"


def _sources(corpus: Corpus, split: str) -> list[dict]:
    out = []
    for path in corpus.paths(split):
        st = path.stat()
        # relative paths: moving the data folder (mv keeps mtimes) does not invalidate caches
        out.append({"path": path.relative_to(corpus.root).as_posix(), "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns})
    return out


def _expected(corpus: Corpus, split: str, tokenizer: Tokenizer) -> dict:
    return {
        "version": CACHE_VERSION,
        "split": split,
        "reader": corpus.config(),
        "sources": _sources(corpus, split),
        "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256,
                      "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id},
        "dtype": token_dtype(tokenizer.vocab_size).name,
    }


def _staleness(index: dict | None, expected: dict, bin_path: Path) -> str:
    """Why a cache cannot be reused ("" when it can)."""
    if index is None:
        return "no cache yet"
    if index.get("version") != CACHE_VERSION:
        return "cache written by another cache version"
    if index.get("reader") != expected["reader"]:
        return f"reader changed ({index.get('reader')} -> {expected['reader']})"
    old = {s["path"]: s for s in index.get("sources", [])}
    new = {s["path"]: s for s in expected["sources"]}
    if old.keys() != new.keys():
        return f"source files changed ({sorted(old)} -> {sorted(new)})"
    for name, src in new.items():
        if old[name] != src:
            return f"source {name} changed (size or modification time)"
    if index.get("tokenizer", {}).get("sha256") != expected["tokenizer"]["sha256"]:
        return "tokenizer changed"
    if index.get("dtype") != expected["dtype"]:
        return "token dtype changed"
    itemsize = np.dtype(expected["dtype"]).itemsize
    if not bin_path.is_file() or bin_path.stat().st_size != index.get("num_tokens", -1) * itemsize:
        return f"token file {bin_path.name} missing or truncated"
    return ""


def _read_index(path: Path) -> dict | None:
    """The cache index, or None when there is none or it cannot be read (the cache is rebuilt)."""
    try:
        index = json.loads(path.read_text())
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return index if isinstance(index, dict) else None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _text_batches(docs: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenize_to(tmp: Path, corpus: Corpus, split: str, tokenizer: Tokenizer, dtype: np.dtype,
                 total_bytes: int, progress: bool | None, batch_chars: int) -> tuple[int, int]:
    from tqdm import tqdm

    num_tokens = num_docs = 0
    eod = tokenizer.eod_id
    with open(tmp, "wb") as f, tqdm(total=total_bytes, unit="B", unit_scale=True,
                                    desc=f"tokenize {split}", disable=None if progress is None
                                    else not progress) as bar:
        for batch in _text_batches(corpus.documents(split), batch_chars):
            flat: list[int] = []
            for ids in tokenizer.encode_batch(batch):
                flat.extend(ids)
                flat.append(eod)
            arr = np.asarray(flat, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                raise ValueError(f"{tokenizer.path} produced id {arr.max()} outside its vocabulary "
                                 f"of {tokenizer.vocab_size}")
            f.write(arr.astype(dtype).tobytes())
            num_tokens += arr.size
            num_docs += len(batch)
            bar.update(sum(len(d) for d in batch))  # characters ~ bytes; exact at the end
        bar.n = total_bytes
    return num_tokens, num_docs


def ensure_cache(corpus: Corpus, split: str, tokenizer: Tokenizer, cache_dir: str | Path,
                 build: bool = True, rebuild: bool = False, progress: bool | None = None,
                 batch_chars: int = BATCH_CHARS) -> CacheInfo:
    """Reuse the split's token cache if it is up to date, else (if `build`) tokenize it."""
    bin_path, index_path = cache_paths(cache_dir, tokenizer, split)
    expected = _expected(corpus, split, tokenizer)
    index = _read_index(index_path)
    reason = "rebuild requested" if rebuild else _staleness(index, expected, bin_path)
    if not reason:
        return _info(split, bin_path, index_path, index, reused=True, reason="up to date")
    if not build:
        raise FileNotFoundError(
            f"token cache {bin_path} is not usable ({reason}); run `commpipe tokenize --data "
            f"{corpus.root} --tokenizer {tokenizer.path}` first")
    check_out_dir(bin_path.parent, "the token cache folder (--cache-dir)")   # before tokenizing
    dtype = token_dtype(tokenizer.vocab_size)
    total_bytes = sum(s["size"] for s in expected["sources"])
    tmp = bin_path.with_name(f"{bin_path.name}.tmp-{os.getpid()}")
    try:
        num_tokens, num_docs = _tokenize_to(tmp, corpus, split, tokenizer, dtype, total_bytes,
                                            progress, batch_chars)
        if num_docs == 0:
            raise ValueError(f"the {split} split of {corpus.root} holds no text "
                             f"({', '.join(map(str, corpus.paths(split)))})")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    index = {**expected, "num_tokens": num_tokens, "num_documents": num_docs,
             "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write_atomic(index_path, (json.dumps(index, indent=1) + "\n").encode())
    return _info(split, bin_path, index_path, index, reused=False, reason=reason)


def _info(split, bin_path, index_path, index, reused, reason) -> CacheInfo:
    tok = index["tokenizer"]
    return CacheInfo(split, bin_path, index_path, index["num_tokens"], index["num_documents"],
                     index["dtype"], tok["vocab_size"], tok["eod_id"], reused, reason)
