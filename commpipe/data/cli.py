"""`commpipe tokenize`: train or load a tokenizer and cache every split as a token file.

    commpipe tokenize --data data/wikitext-103 --train-tokenizer --vocab-size 32000
    commpipe tokenize --data my_corpus --format jsonl --text-field content --tokenizer tok.json

Tiny CPU example (a folder with train.txt and valid.txt):

    commpipe tokenize --data /tmp/tiny --train-tokenizer --vocab-size 300 --seq-len 64

A second run reuses the tokenizer and every cache that is still up to date.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_VOCAB = 32000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="DIR", help="corpus directory")
    p.add_argument("--format", default="auto", choices=["auto", "wikitext", "text", "jsonl"],
                   help="corpus layout (default: detect)")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a byte-level BPE on the train split (reused if already trained)")
    tok.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json to use")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary of the trained tokenizer (default {DEFAULT_VOCAB})")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="where tokenizer and caches go (default: the data directory)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="also report how many windows of this length each split holds")
    p.add_argument("--rebuild", action="store_true", help="re-tokenize even up-to-date caches")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from commpipe.data.sources import prepare

    if args.vocab_size is not None and args.tokenizer:
        raise ValueError("--vocab-size applies to --train-tokenizer; a --tokenizer file has its own")
    vocab_size = args.vocab_size
    if args.train_tokenizer and vocab_size is None:
        vocab_size = DEFAULT_VOCAB
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len {args.seq_len} must be positive")
    prepared = prepare(args.data, format=args.format, text_field=args.text_field,
                       tokenizer=args.tokenizer, vocab_size=vocab_size, cache_dir=args.cache_dir,
                       rebuild=args.rebuild, progress=False if args.quiet else None,
                       allow_train=args.train_tokenizer)
    tok = prepared.tokenizer
    out = sys.stdout
    print(f"corpus     {prepared.corpus.describe()}", file=out)
    tok_status = "trained" if tok.trained else "loaded" if args.tokenizer else "reused"
    print(f"tokenizer  {tok.describe()} [{tok_status}]", file=out)
    header = f"{'split':<6} {'documents':>10} {'tokens':>14}"
    if args.seq_len:
        header += f" {f'windows@{args.seq_len}':>14}"
    print(header + "  cache", file=out)
    for split, info in prepared.caches.items():
        line = f"{split:<6} {info.num_documents:>10,} {info.num_tokens:>14,}"
        if args.seq_len:
            line += f" {max(0, (info.num_tokens - 1) // args.seq_len):>14,}"
        status = "reused" if info.reused else f"built ({info.reason})"
        print(f"{line}  {info.bin_path} [{info.dtype}, {status}]", file=out)
    print(f"ready: `commpipe train --data {args.data}` reads these caches "
          f"(model vocabulary >= {tok.vocab_size})", file=out)
    return 0
