"""COCO captions for the BLIP-style captioner: layout, image and caption caches, batches.

The COCO 2017 layout, as downloaded from cocodataset.org (nothing is downloaded here):

    <root>/annotations/captions_train2017.json   {"images": [{"id", "file_name"}, ...],
    <root>/annotations/captions_val2017.json      "annotations": [{"id", "image_id", "caption"}]}
    <root>/train2017/<file_name>                  JPEG (or any format Pillow reads)
    <root>/val2017/<file_name>

`prepare_coco` trains (or loads) a byte-level BPE on the train captions and builds, per split:

    <cache>/tokenizer-captions-<vocab>.json         [PAD]=0, [BOS]=1, [EOS]=2, then BPE pieces
    <cache>/images-<size>/<split>.npy                uint8 [images, size, size, 3], RGB, resized
    <cache>/images-<size>/<split>.json               index: image files (digest of name, size,
                                                     mtime), the row of every image id
    <cache>/cache-<tokenizer>/<split>-<len>.npy      int32 [captions, len + 1]: [BOS] caption
                                                     [EOS] [PAD]..., truncated to len + 1
    <cache>/cache-<tokenizer>/<split>-<len>.json     index, and <split>-<len>-rows.npy: each
                                                     caption's image row

Every image is decoded once, when its cache is built; a caption whose image is missing or
unreadable stops the build before any training, with the file named. Caches are rebuilt when
the annotation file, an image file (size or mtime), the tokenizer or the shapes change, and
written under temporary names then renamed (a reader sees the old or the new cache, whole).

A caption is one sample. `CocoSource.batch(step, global_batch, dp_rank, dp_size)` returns
{"pixels": float32 [b, 3, size, size] (normalized), "tokens": int64 [b, len], "labels": int64
[b, len]} with b = global_batch / dp_size; labels are tokens shifted by one, padding -100. The
order is a seeded permutation per epoch, sharded by DP rank as the text corpora are
(`commpipe.data.sampler.WindowSampler`, one "window" per caption).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commpipe.data.sampler import WindowSampler, check_dp
from commpipe.data.tokenizer import Tokenizer, load_tokenizer, train_byte_level_bpe

SPLITS = {"train": ("annotations/captions_train2017.json", "train2017"),
          "val": ("annotations/captions_val2017.json", "val2017")}
PAD, BOS, EOS = "[PAD]", "[BOS]", "[EOS]"
IGNORE = -100
CACHE_VERSION = 1
# BLIP normalizes with CLIP's image statistics (BLIP's data/__init__.py, from CLIP)
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


@dataclass(frozen=True)
class Caption:
    image_id: int
    text: str


@dataclass
class CocoSplit:
    """One split's captions and the image files they refer to."""

    name: str
    annotation: Path
    image_dir: Path
    files: dict[int, str]            # image id -> file name inside image_dir
    captions: list[Caption]


def clean_caption(text: str) -> str:
    """Lower case, single spaces, no trailing full stop (as BLIP's pre_caption, shorter)."""
    return re.sub(r"\s+", " ", text.lower()).strip().rstrip(".").strip()


def read_split(root: str | Path, split: str) -> CocoSplit:
    if split not in SPLITS:
        raise ValueError(f"unknown COCO split {split!r}; use one of {', '.join(SPLITS)}")
    root = Path(root).expanduser()
    ann_rel, image_rel = SPLITS[split]
    path = root / ann_rel
    if not path.is_file():
        raise FileNotFoundError(f"COCO annotations {path} not found; {root} must hold "
                                f"{ann_rel} and {image_rel}/ (the COCO 2017 captions layout)")
    try:
        raw = json.loads(path.read_text())
        files = {int(im["id"]): str(im["file_name"]) for im in raw["images"]}
        captions = [Caption(int(a["image_id"]), clean_caption(str(a["caption"])))
                    for a in sorted(raw["annotations"], key=lambda a: a["id"])]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a COCO captions file ({type(e).__name__}: {e}); "
                         "it needs 'images' with id and file_name, 'annotations' with "
                         "image_id and caption") from None
    unknown = sorted({c.image_id for c in captions} - files.keys())
    if unknown:
        raise ValueError(f"{path}: captions refer to image ids {unknown[:5]} that 'images' "
                         "does not list")
    if not captions:
        raise ValueError(f"{path} holds no captions")
    return CocoSplit(split, path, root / image_rel, files, captions)


def load_image(path: Path, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: decoded, RGB, resized (bicubic, no crop, as BLIP evaluates)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC))


def normalize(images: np.ndarray):
    """uint8 [b, H, W, 3] -> float32 torch [b, 3, H, W], CLIP mean/std."""
    import torch

    x = (images.astype(np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def train_caption_tokenizer(captions: list[str], vocab_size: int, out_path: str | Path) -> Tokenizer:
    """Byte-level BPE trained on the (train) captions, [PAD] [BOS] [EOS] first."""
    if vocab_size < 259:
        raise ValueError(f"caption vocabulary {vocab_size} is too small: a byte-level BPE needs "
                         "256 bytes + [PAD] [BOS] [EOS] = 259")
    train_byte_level_bpe(captions, vocab_size, [PAD, BOS, EOS], out_path)
    return load_tokenizer(out_path)


def _files_digest(split: CocoSplit, ids: list[int]) -> str:
    """Digest of every image's (name, size, mtime); a missing image is named."""
    digest = hashlib.sha256()
    for i in ids:
        path = split.image_dir / split.files[i]
        try:
            st = path.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"image {path} (image id {i}, in {split.annotation}) is "
                                    "missing; restore it or remove its captions") from None
        digest.update(f"{split.files[i]}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _save_atomic(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def image_cache(split: CocoSplit, size: int, cache_dir: Path, build: bool = True) -> tuple:
    """(uint8 memmap [images, size, size, 3], {image id: row}), decoding images if stale."""
    ids = sorted({c.image_id for c in split.captions})
    folder = cache_dir / f"images-{size}"
    npy, index_path = folder / f"{split.name}.npy", folder / f"{split.name}.json"
    expected = {"version": CACHE_VERSION, "size": size, "ids": ids,
                "files": _files_digest(split, ids)}
    if _read_json(index_path) != expected or not npy.is_file():
        if not build:
            raise FileNotFoundError(f"image cache {npy} is missing or stale; prepare the data "
                                    "first (prepare_coco(..., build=True))")
        folder.mkdir(parents=True, exist_ok=True)
        bad = []

        def write(tmp):
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8,
                                            shape=(len(ids), size, size, 3))
            for row, i in enumerate(ids):
                path = split.image_dir / split.files[i]
                try:
                    out[row] = load_image(path, size)
                except Exception as e:  # Pillow raises OSError, ValueError, SyntaxError, ...
                    bad.append(f"{path} ({type(e).__name__}: {e})")
            out.flush()
            del out
            if bad:
                raise ValueError(f"{len(bad)} image(s) of {split.annotation} cannot be read: "
                                 + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else "")
                                 + ". Replace them or remove their captions")

        _save_atomic(npy, write)
        _save_atomic(index_path, lambda tmp: tmp.write_text(json.dumps(expected) + "\n"))
    return np.load(npy, mmap_mode="r"), {i: row for row, i in enumerate(ids)}


def caption_cache(split: CocoSplit, tokenizer: Tokenizer, text_len: int, rows: dict[int, int],
                  cache_dir: Path, build: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [captions, text_len + 1] token rows, int32 [captions] image rows)."""
    folder = cache_dir / f"cache-{tokenizer.name}"
    stem = f"{split.name}-{text_len}"
    npy, rows_npy, index_path = (folder / f"{stem}.npy", folder / f"{stem}-rows.npy",
                                 folder / f"{stem}.json")
    st = split.annotation.stat()
    expected = {"version": CACHE_VERSION, "annotation": [st.st_size, st.st_mtime_ns],
                "tokenizer": tokenizer.sha256, "text_len": text_len}
    if _read_json(index_path) != expected or not npy.is_file() or not rows_npy.is_file():
        if not build:
            raise FileNotFoundError(f"caption cache {npy} is missing or stale; prepare the data "
                                    "first (prepare_coco(..., build=True))")
        folder.mkdir(parents=True, exist_ok=True)
        pad, bos, eos = (tokenizer.hf.token_to_id(t) for t in (PAD, BOS, EOS))
        tokens = np.full((len(split.captions), text_len + 1), pad, dtype=np.int32)
        for row, ids in enumerate(tokenizer.encode_batch([c.text for c in split.captions])):
            seq = [bos, *ids, eos][:text_len + 1]
            tokens[row, :len(seq)] = seq
        image_rows = np.array([rows[c.image_id] for c in split.captions], dtype=np.int32)
        _save_atomic(npy, lambda tmp: np.save(tmp, tokens))
        _save_atomic(rows_npy, lambda tmp: np.save(tmp, image_rows))
        _save_atomic(index_path, lambda tmp: tmp.write_text(json.dumps(expected) + "\n"))
    return np.load(npy), np.load(rows_npy)


@dataclass
class CocoData:
    """One prepared split: images, caption tokens, and which image each caption shows."""

    images: np.ndarray               # uint8 [images, size, size, 3]
    tokens: np.ndarray               # int32 [captions, text_len + 1]
    image_rows: np.ndarray           # int32 [captions]
    pad_id: int

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, caption_ids: np.ndarray) -> dict:
        import torch

        seq = torch.from_numpy(self.tokens[caption_ids].astype(np.int64))
        labels = seq[:, 1:].clone()
        labels[labels == self.pad_id] = IGNORE
        return {"pixels": normalize(self.images[self.image_rows[caption_ids]]),
                "tokens": seq[:, :-1].contiguous(), "labels": labels}


def prepare_coco(root: str | Path, image_size: int, text_len: int, *, vocab_size: int | None = None,
                 tokenizer: str | Path | None = None, cache_dir: str | Path | None = None,
                 splits: tuple[str, ...] = ("train", "val"), build: bool = True
                 ) -> tuple[Tokenizer, dict[str, CocoData]]:
    """The caption tokenizer and each split's data, building stale caches if `build`.
    Give a tokenizer file, or a vocabulary size to train `tokenizer-captions-<vocab>.json`
    on the train captions (or load it, if it exists)."""
    root = Path(root).expanduser()
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else root / "cache"
    read = {s: read_split(root, s) for s in splits}
    if (tokenizer is None) == (vocab_size is None):
        raise ValueError("give either a caption tokenizer file or a vocabulary size to train one")
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        path = cache_dir / f"tokenizer-captions-{vocab_size}.json"
        if path.is_file():
            tok = load_tokenizer(path)
        elif not build:
            raise FileNotFoundError(f"no caption tokenizer {path}; prepare the data first")
        else:
            train = read.get("train") or read_split(root, "train")
            tok = train_caption_tokenizer([c.text for c in train.captions], vocab_size, path)
    for special in (PAD, BOS, EOS):
        if tok.hf.token_to_id(special) is None:
            raise ValueError(f"caption tokenizer {tok.path} lacks the {special} token")
    out = {}
    for name, split in read.items():
        images, rows = image_cache(split, image_size, cache_dir, build)
        tokens, image_rows = caption_cache(split, tok, text_len, rows, cache_dir, build)
        out[name] = CocoData(images, tokens, image_rows, tok.hf.token_to_id(PAD))
    return tok, out


class CocoSource:
    """Seeded, DP-sharded, resumable image-caption batches (train split; val for validation)."""

    kind = "coco"

    def __init__(self, tokenizer: Tokenizer, data: dict[str, CocoData], seed: int = 0):
        self.tokenizer, self.data, self.seed = tokenizer, data, seed
        self.vocab_size = tokenizer.vocab_size
        train = data["train"]
        self.text_len = train.tokens.shape[1] - 1
        self.image_size = train.images.shape[1]
        # one "window" of length 1 per caption: WindowSampler's seeded per-epoch permutation,
        # DP sharding and resume state, unchanged
        self.sampler = WindowSampler(len(train) + 1, 1, seed)

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1) -> dict:
        return self.data["train"].batch(self.sampler.window_ids(step, global_batch, dp_rank, dp_size))

    def validation(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                   max_batches: int | None = None, split: str = "val") -> Iterator[dict]:
        """Fixed, unshuffled batches: global batch i is captions [i*B, (i+1)*B), by DP rank."""
        local = check_dp(global_batch, dp_rank, dp_size)
        data = self.data[split]
        n = len(data) // global_batch
        if n == 0:
            raise ValueError(f"the {split} split has {len(data)} captions, fewer than one global "
                             f"batch of {global_batch}")
        for i in range(n if max_batches is None else min(n, max_batches)):
            first = i * global_batch + dp_rank * local
            yield data.batch(np.arange(first, first + local))

    def state_dict(self) -> dict:
        return {"kind": "corpus", **self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "kind"})
