"""Corpus readers: WikiText-103 (raw or `.tokens` release), plain text and JSONL.

`open_corpus(DIR)` finds the files of each split (train, valid, test) and returns a `Corpus`
whose `documents(split)` yields one document (a str) at a time, so no reader ever holds the
whole corpus in memory. Layouts understood:

    wikitext  DIR/wiki.{train,valid,test}.raw      (WikiText-103 raw release), or
              DIR/wiki.{train,valid,test}.tokens   (the tokenized release; <unk>, @-@ kept as is)
              one document per article: an article starts at a " = Title = " line; section
              headings " = = Section = = " stay inside their article.
    text      DIR/<split>.txt: one document per blank-line-separated block, and/or
              DIR/<split>/*.txt: one document per file; with neither, every DIR/*.txt is a
              train document (one per file).
    jsonl     DIR/<split>.jsonl and/or DIR/<split>/*.jsonl: one document per line, taken from
              the field `text_field` (default "text"); with neither, every DIR/*.jsonl is train.

Split names: train; valid (also found as val or validation); test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "valid", "test")
FORMATS = ("wikitext", "text", "jsonl")
_SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "val", "validation"), "test": ("test",)}
_WIKI_VARIANTS = ("raw", "tokens")
# An article title is " = Title = " with one '=' each side; sections have two or more
# (" = = Gameplay = = "), which is why the character after " = " must not be '='.
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")


@dataclass(frozen=True)
class SourceFile:
    """One file of a split and how it holds documents."""

    path: Path
    layout: str  # "wikitext" (articles) | "blocks" (blank-line separated) | "file" | "jsonl"


@dataclass(frozen=True)
class Corpus:
    root: Path
    format: str                                   # wikitext | text | jsonl
    files: dict[str, tuple[SourceFile, ...]]      # split -> its files, in reading order
    text_field: str = "text"
    variant: str = ""                             # wikitext: raw | tokens

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if self.files.get(s))

    def config(self) -> dict:
        """What decides the text read (stored in cache indexes to detect a changed reader)."""
        cfg = {"format": self.format}
        if self.format == "jsonl":
            cfg["text_field"] = self.text_field
        return cfg

    def paths(self, split: str) -> list[Path]:
        return [f.path for f in self._split_files(split)]

    def documents(self, split: str) -> Iterator[str]:
        """Yield the non-empty documents of `split` in file order."""
        for src in self._split_files(split):
            try:
                yield from self._file_documents(src)
            except UnicodeDecodeError:
                from commpipe.files import StorageError, first_bad_utf8

                raise StorageError(f"corpus file {src.path} is not UTF-8 text: "
                                   f"{first_bad_utf8(src.path)}; convert it (e.g. iconv -f "
                                   "latin1 -t utf-8) or move it out of the corpus") from None

    def _file_documents(self, src: SourceFile) -> Iterator[str]:
        if src.layout == "wikitext":
            yield from _wikitext_documents(src.path)
        elif src.layout == "blocks":
            yield from _block_documents(src.path)
        elif src.layout == "file":
            text = src.path.read_text(encoding="utf-8").strip()
            if text:
                yield text
        else:
            yield from _jsonl_documents(src.path, self.text_field)

    def describe(self) -> str:
        kind = f"wikitext {self.variant}" if self.format == "wikitext" else self.format
        names = ", ".join(f"{s}: {len(self.files[s])} file(s)" for s in self.splits)
        return f"{self.root} ({kind}; {names})"

    def _split_files(self, split: str) -> tuple[SourceFile, ...]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if not self.files.get(split):
            raise FileNotFoundError(f"{self.root} has no {split} split ({_expected(self.format, split)})")
        return self.files[split]


# -- readers --------------------------------------------------------------------------------
def _wikitext_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if _WIKI_TITLE.match(line.rstrip("\n")) and lines:
                doc = "".join(lines).strip()
                if doc:
                    yield doc
                lines = []
            lines.append(line)
    doc = "".join(lines).strip()
    if doc:
        yield doc


def _block_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).strip()
                lines = []
    if lines:
        yield "".join(lines).strip()


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be "
                                 f"one JSON object") from None
            if not isinstance(record, dict) or text_field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno}: no field {text_field!r} (found: {keys}); "
                                 f"choose the field with --text-field")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is "
                                 f"{type(text).__name__}, expected a string")
            if text.strip():
                yield text


# -- layout detection -----------------------------------------------------------------------
def _expected(fmt: str, split: str = "train") -> str:
    if fmt == "wikitext":
        return f"expected wiki.{split}.raw or wiki.{split}.tokens"
    ext = "txt" if fmt == "text" else "jsonl"
    return f"expected {split}.{ext} or {split}/*.{ext}"


def _wikitext(root: Path) -> Corpus:
    for variant in _WIKI_VARIANTS:
        wanted = {s: root / f"wiki.{s}.{variant}" for s in SPLITS}
        if wanted["train"].is_file():
            missing = [p.name for p in wanted.values() if not p.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{root} holds wiki.train.{variant} but not {', '.join(missing)}; the WikiText "
                    f"release has wiki.train.{variant}, wiki.valid.{variant} and wiki.test.{variant}"
                    f" (unpack the whole archive into {root})")
            files = {s: (SourceFile(p, "wikitext"),) for s, p in wanted.items()}
            return Corpus(root, "wikitext", files, variant=variant)
    raise FileNotFoundError(
        f"{root} does not hold WikiText files: expected wiki.train.raw, wiki.valid.raw, "
        f"wiki.test.raw (raw release) or wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens"
        f"{_wiki_hint(root)}")


def _wiki_hint(root: Path) -> str:
    """Point at a sub-folder holding WikiText files (the archives unpack into one)."""
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if any((sub / f"wiki.train.{v}").is_file() for v in _WIKI_VARIANTS):
            return f"; found them in {sub}: pass --data {sub}"
    return ""


def _by_extension(root: Path, fmt: str, text_field: str) -> Corpus:
    ext = "txt" if fmt == "text" else "jsonl"
    file_layout = "blocks" if fmt == "text" else "jsonl"
    dir_layout = "file" if fmt == "text" else "jsonl"
    files: dict[str, tuple[SourceFile, ...]] = {}
    for split, aliases in _SPLIT_ALIASES.items():
        found: list[SourceFile] = []
        for name in aliases:
            if (root / f"{name}.{ext}").is_file():
                found.append(SourceFile(root / f"{name}.{ext}", file_layout))
            if (root / name).is_dir():
                found += [SourceFile(p, dir_layout) for p in sorted((root / name).glob(f"*.{ext}"))]
        if found:
            files[split] = tuple(found)
    if not files:
        loose = sorted(p for p in root.glob(f"*.{ext}") if p.is_file())
        if loose:
            files["train"] = tuple(SourceFile(p, dir_layout) for p in loose)
    if "train" not in files:
        raise FileNotFoundError(
            f"{root} holds no {fmt} training data: expected train.{ext} or train/*.{ext} "
            f"(optionally valid.{ext}, test.{ext}), or loose *.{ext} files")
    return Corpus(root, fmt, files, text_field=text_field)


def open_corpus(data_dir: str | Path, format: str = "auto", text_field: str = "text") -> Corpus:
    """Find the split files under `data_dir`; `format` is auto, wikitext, text or jsonl."""
    root = Path(data_dir).expanduser().resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"data directory {root} does not exist; pass --data DIR holding the "
                                f"corpus (e.g. the unpacked wikitext-103-raw folder)")
    if format not in ("auto", *FORMATS):
        raise ValueError(f"unknown data format {format!r}; use auto, {', '.join(FORMATS)}")
    if format == "wikitext":
        return _wikitext(root)
    if format in ("text", "jsonl"):
        return _by_extension(root, format, text_field)
    if any((root / f"wiki.train.{v}").is_file() for v in _WIKI_VARIANTS):
        return _wikitext(root)
    for fmt, ext in (("jsonl", "jsonl"), ("text", "txt")):
        if any(root.glob(f"*.{ext}")) or any(root.glob(f"*/*.{ext}")):
            return _by_extension(root, fmt, text_field)
    raise FileNotFoundError(
        f"{root} holds no corpus: expected WikiText files (wiki.train.raw, wiki.valid.raw, "
        f"wiki.test.raw or the .tokens variant), train.txt / train/*.txt, or train.jsonl / "
        f"train/*.jsonl{_wiki_hint(root)}")
