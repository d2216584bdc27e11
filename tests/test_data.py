"""Tests of commpipe.data on a tiny generated corpus in the WikiText-103 layout.

    python -m pytest tests/test_data.py -x -q
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from commpipe.cli import main as cli_main
from commpipe.data import (
    SyntheticTokens,
    WindowSampler,
    ensure_cache,
    open_corpus,
    open_source,
    prepare,
    resolve_tokenizer,
    token_dtype,
)

VOCAB = 400
SEQ = 16
_SYLLABLES = ["ka", "to", "ri", "na", "mo", "sel", "vin", "dra", "ul", "pe", "qua", "zen", "or", "li"]


def write_wikitext(root, articles=(10, 3, 3), seed=0, ext="raw"):
    """WikiText-style files: ' = Title = ' starts an article, ' = = Section = = ' does not."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(150)]
    words += [",", ".", "the", "of", "@-@", "1", "2"]
    root.mkdir(parents=True, exist_ok=True)
    for split, count in zip(("train", "valid", "test"), articles):
        lines = [" \n"]
        for a in range(count):
            lines += [f" = {split.title()} Article {a} = \n", " \n"]
            for s in range(2):
                if s:
                    lines += [f" = = Section {s} = = \n", " \n"]
                for _ in range(3):
                    lines += [" " + " ".join(rng.choice(words) for _ in range(25)) + " \n", " \n"]
        (root / f"wiki.{split}.{ext}").write_text("".join(lines), encoding="utf-8")
    return dict(zip(("train", "valid", "test"), articles))


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    """One corpus with a trained tokenizer and caches, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("wt") / "wikitext-103"
    write_wikitext(root)
    prepare(root, vocab_size=VOCAB, progress=False)
    return root


# -- readers --------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["raw", "tokens"])
def test_wikitext_documents_are_articles(tmp_path, ext):
    counts = write_wikitext(tmp_path, ext=ext)
    corpus = open_corpus(tmp_path)
    assert corpus.format == "wikitext" and corpus.variant == ext
    for split, n in counts.items():
        docs = list(corpus.documents(split))
        # one document per " = Title = " line; each keeps its section heading
        assert len(docs) == n
        assert all(d.startswith(f"= {split.title()} Article") and "= = Section 1 = =" in d for d in docs)


def test_missing_files_name_the_expected_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"wiki\.train\.raw.*wiki\.valid\.raw.*wiki\.test\.raw"):
        open_corpus(tmp_path, "wikitext")
    with pytest.raises(FileNotFoundError, match=r"wiki\.train\.raw.*train\.txt.*train\.jsonl"):
        open_corpus(tmp_path)
    (tmp_path / "wiki.train.raw").write_text(" = A = \n text \n")
    with pytest.raises(FileNotFoundError, match=r"not wiki\.valid\.raw, wiki\.test\.raw"):
        open_corpus(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_corpus(tmp_path / "nope")
    nested = tmp_path / "outer"
    write_wikitext(nested / "wikitext-103-raw")
    with pytest.raises(FileNotFoundError, match="pass --data .*wikitext-103-raw"):
        open_corpus(nested)


def test_text_and_jsonl_readers(tmp_path):
    text = tmp_path / "text"
    (text / "valid").mkdir(parents=True)
    (text / "train.txt").write_text("first doc\nline two\n\n\nsecond doc\n  \nthird\n")
    (text / "valid" / "a.txt").write_text("whole file\n\nis one doc\n")
    corpus = open_corpus(text)
    assert corpus.format == "text"
    assert list(corpus.documents("train")) == ["first doc\nline two", "second doc", "third"]
    assert list(corpus.documents("valid")) == ["whole file\n\nis one doc"]
    with pytest.raises(FileNotFoundError, match="no test split"):
        list(corpus.documents("test"))

    js = tmp_path / "js"
    js.mkdir()
    (js / "train.jsonl").write_text('{"body": "a b"}\n\n{"body": "c", "id": 2}\n')
    (js / "validation.jsonl").write_text('{"body": "v"}\n')
    corpus = open_corpus(js, text_field="body")
    assert corpus.format == "jsonl" and corpus.splits == ("train", "valid")
    assert list(corpus.documents("train")) == ["a b", "c"]
    with pytest.raises(ValueError, match=r"train\.jsonl:1: no field 'text' \(found: body\)"):
        list(open_corpus(js).documents("train"))
    (js / "train.jsonl").write_text('{"body": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"train\.jsonl:2: not valid JSON"):
        list(corpus.documents("train"))


# -- tokenizer ------------------------------------------------------------------------------
def test_tokenizer_trained_once_then_reused(tmp_path):
    write_wikitext(tmp_path)
    corpus = open_corpus(tmp_path)
    first = resolve_tokenizer(corpus, tmp_path, vocab_size=VOCAB)
    path = tmp_path / f"tokenizer-{VOCAB}.json"
    assert first.trained and first.path == path
    mtime = path.stat().st_mtime_ns
    second = resolve_tokenizer(corpus, tmp_path, vocab_size=VOCAB)
    third = resolve_tokenizer(corpus, tmp_path)  # found by glob, no size given
    assert not second.trained and not third.trained and path.stat().st_mtime_ns == mtime
    assert first.sha256 == second.sha256 == third.sha256
    # byte-level BPE: 256 byte symbols + EOD at least, at most what was asked
    assert 257 <= second.vocab_size <= VOCAB and second.eod_id == 0
    doc = next(corpus.documents("valid"))
    assert first.encode(doc) == second.encode(doc)
    assert second.decode(second.encode(doc)) == doc  # lossless on unseen text
    with pytest.raises(ValueError, match="at least 257"):
        resolve_tokenizer(corpus, tmp_path / "other", vocab_size=100)


def test_loaded_tokenizer_without_eod_gets_one(tmp_path, prepared_dir):
    from tokenizers import Tokenizer as HF

    hf = HF.from_file(str(prepared_dir / f"tokenizer-{VOCAB}.json"))
    data = json.loads(hf.to_str())
    # a tokenizer that has no end-of-text token: rename it everywhere
    data["added_tokens"] = []
    data["model"]["vocab"]["<pad>"] = data["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "plain.json").write_text(json.dumps(data))
    tok = resolve_tokenizer(open_corpus(prepared_dir), tmp_path, tokenizer=tmp_path / "plain.json")
    n = hf.get_vocab_size()
    assert tok.hf.token_to_id("<pad>") == 0
    assert tok.eod_token == "<|endoftext|>" and tok.eod_id == n and tok.vocab_size == n + 1


# -- caches ---------------------------------------------------------------------------------
def test_cache_matches_reference_and_is_reused(tmp_path):
    write_wikitext(tmp_path)
    first = prepare(tmp_path, vocab_size=VOCAB, progress=False)
    tok = first.tokenizer
    assert set(first.caches) == {"train", "valid", "test"}
    assert all(not c.reused for c in first.caches.values())
    info = first.caches["train"]
    assert info.dtype == "uint16" and info.bin_path.stat().st_size == 2 * info.num_tokens
    # reference: each article encoded alone, followed by EOD, concatenated in file order
    ref = []
    for doc in open_corpus(tmp_path).documents("train"):
        ref += tok.hf.encode(doc, add_special_tokens=False).ids + [tok.eod_id]
    np.testing.assert_array_equal(np.fromfile(info.bin_path, dtype=np.uint16), ref)
    # small batches give the same file as one big batch
    small = ensure_cache(first.corpus, "train", tok, tmp_path, rebuild=True, batch_chars=500,
                         progress=False)
    np.testing.assert_array_equal(small.tokens(), ref)

    mtimes = {s: c.bin_path.stat().st_mtime_ns for s, c in first.caches.items()}
    second = prepare(tmp_path, progress=False)
    assert all(c.reused for c in second.caches.values())
    assert second.tokenizer.encoded_docs == 0  # nothing was tokenized
    assert {s: c.bin_path.stat().st_mtime_ns for s, c in second.caches.items()} == mtimes
    assert not list(info.bin_path.parent.glob("*.tmp-*"))


def test_stale_cache_is_detected_and_rebuilt(tmp_path):
    write_wikitext(tmp_path)
    prepare(tmp_path, vocab_size=VOCAB, progress=False)
    train = tmp_path / "wiki.train.raw"
    with open(train, "a", encoding="utf-8") as f:
        f.write(" = Extra Article = \n \n more words here \n")
    with pytest.raises(FileNotFoundError, match="source wiki.train.raw changed.*commpipe tokenize"):
        prepare(tmp_path, build=False)
    again = prepare(tmp_path, progress=False)
    assert not again.caches["train"].reused and again.caches["valid"].reused
    assert again.caches["train"].num_documents == 11
    assert again.tokenizer.encoded_docs == 11  # only the changed split was re-tokenized

    # a different tokenizer under the same file name makes every cache stale
    own = tmp_path / "tok" / "mine.json"
    own.parent.mkdir()
    shutil.copy(tmp_path / f"tokenizer-{VOCAB}.json", own)
    prepare(tmp_path, tokenizer=own, progress=False)
    resolve_tokenizer(open_corpus(tmp_path), tmp_path / "tok", vocab_size=300)
    shutil.copy(tmp_path / "tok" / "tokenizer-300.json", own)
    rebuilt = prepare(tmp_path, tokenizer=own, progress=False)
    assert {c.reason for c in rebuilt.caches.values()} == {"tokenizer changed"}


def test_token_dtype():
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    assert token_dtype(128256) == np.uint32


def test_missing_cache_without_build(tmp_path):
    write_wikitext(tmp_path)
    with pytest.raises(FileNotFoundError, match="commpipe tokenize --data .* --train-tokenizer"):
        open_source(tmp_path, SEQ, build=False)


# -- sampling -------------------------------------------------------------------------------
def test_dp_shards_are_disjoint_and_cover_the_epoch():
    seq, gb = 8, 12
    sampler = WindowSampler(num_tokens=100 * seq + 1, seq_len=seq, seed=3)  # 100 windows
    per_epoch = 100 // gb  # 8 batches; the last 4 windows are skipped
    single = [set(sampler.window_ids((0, step * gb), gb).tolist()) for step in range(per_epoch)]
    seen = set().union(*single)
    assert len(seen) == per_epoch * gb  # no window twice in one epoch
    for dp_size in (2, 3, 4):
        for step in range(per_epoch):
            shards = [set(WindowSampler(100 * seq + 1, seq, 3, r, dp_size).window_ids(step, gb).tolist())
                      for r in range(dp_size)]
            assert set().union(*shards) == single[step]
            assert sum(len(s) for s in shards) == gb  # pairwise disjoint
    with pytest.raises(ValueError, match="not a positive multiple of dp=5"):
        sampler.window_ids(0, gb, dp_rank=0, dp_size=5)


def test_windows_deterministic_by_seed():
    a, b, c = (WindowSampler(2001, 10, seed) for seed in (1, 1, 2))
    ids = [s.window_ids(5, 8).tolist() for s in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert not np.array_equal(a.order(0), a.order(1))  # each epoch reshuffles
    assert sorted(a.order(1)) == list(range(200))


def test_source_batches_are_shifted_windows_and_dp_independent(prepared_dir):
    source = open_source(prepared_dir, SEQ, seed=5, build=False)
    tokens = np.fromfile(prepared_dir / f"cache-tokenizer-{VOCAB}" / "train.bin", dtype=np.uint16)
    x, y = source.batch(2, 8)
    assert x.shape == y.shape == (8, SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, w in enumerate(source.sampler.window_ids(2, 8)):
        np.testing.assert_array_equal(x[row].numpy(), tokens[w * SEQ:w * SEQ + SEQ])
        np.testing.assert_array_equal(y[row].numpy(), tokens[w * SEQ + 1:w * SEQ + SEQ + 1])
    parts = [source.batch(2, 8, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    # the sampler's own batch() reads the same rows for its DP rank
    rank1 = WindowSampler(source.train.num_tokens, SEQ, 5, dp_rank=1, dp_size=4, dataset=source.train)
    assert torch.equal(rank1.batch(2, 8)[1], parts[1][1])


def test_resume_gives_identical_batches(prepared_dir):
    gb = 8
    ref = open_source(prepared_dir, SEQ, seed=7, build=False)
    per_epoch = ref.sampler.batches_per_epoch(gb)
    steps = range(per_epoch + 4)  # crosses an epoch boundary
    expected = [ref.batch(s, gb) for s in steps]
    for stop in (3, per_epoch - 1, per_epoch + 1):
        run = open_source(prepared_dir, SEQ, seed=7, build=False)
        for s in range(stop):
            run.batch(s, gb)
        state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint file
        assert state["step"] == stop
        resumed = open_source(prepared_dir, SEQ, seed=7, build=False)
        resumed.load_state_dict(state)
        for s in steps[stop:]:
            got = resumed.batch(s, gb)
            assert torch.equal(got[0], expected[s][0]) and torch.equal(got[1], expected[s][1])
    other = open_source(prepared_dir, SEQ + 1, seed=7, build=False)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(state)


def test_resume_after_global_batch_change():
    # steps 0-2 at batch 4, then batch 8: the windows continue where batch 4 left off
    s = WindowSampler(401, 4, seed=0)  # 100 windows
    first = np.concatenate([s.window_ids(i, 4) for i in range(3)])
    then = s.window_ids(3, 8)
    np.testing.assert_array_equal(np.concatenate([first, then]), s.order(0)[:20])
    state = s.state_dict()
    assert (state["step"], state["epoch"], state["index"]) == (4, 0, 20)


def test_validation_is_fixed_and_sharded(prepared_dir):
    source = open_source(prepared_dir, SEQ, seed=0, build=False)
    tokens = np.fromfile(prepared_dir / f"cache-tokenizer-{VOCAB}" / "valid.bin", dtype=np.uint16)
    batches = list(source.validation(4, max_batches=3))
    assert len(batches) == 3
    for i, (x, _) in enumerate(batches):  # window k = tokens[k*SEQ : k*SEQ+SEQ], in order
        ref = np.stack([tokens[k * SEQ:(k + 1) * SEQ] for k in range(4 * i, 4 * i + 4)])
        np.testing.assert_array_equal(x.numpy(), ref)
    halves = [list(source.validation(4, r, 2, max_batches=3)) for r in range(2)]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), batches[i][0])
    test = next(source.validation(4, split="test"))
    assert test[0].shape == (4, SEQ)


def test_synthetic_tokens():
    src = SyntheticTokens(vocab=50, seed=1, seq_len=12)
    x, y = src.batch(3, 6)
    assert x.shape == (6, 12) and x.dtype == torch.int64 and int(x.max()) < 50
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(SyntheticTokens(50, 1, seq_len=12).batch(3, 6)[0], x)
    assert not torch.equal(SyntheticTokens(50, 2, seq_len=12).batch(3, 6)[0], x)
    assert not torch.equal(src.batch(4, 6)[0], x)
    assert torch.equal(torch.cat([src.batch(3, 6, r, 3)[0] for r in range(3)]), x)
    val = [v[0] for v in src.validation(6)]
    assert len(val) == 8 and torch.equal(val[0], next(src.validation(6))[0])
    state = src.state_dict()
    assert state["step"] == 4  # the last batch served was step 3
    with pytest.raises(ValueError, match="vocab"):
        SyntheticTokens(64, 1, seq_len=12).load_state_dict(state)


def test_synthetic_validation_is_held_out():
    # a validation row that a training step also serves would measure memorisation: no row of
    # the 8 validation batches equals any row of the first 64 training steps (two rows of 13
    # uniform tokens over 50 values match by chance with probability 50**-13, ~1e-22), and the
    # validation rows differ from each other; DP ranks read disjoint rows of each batch
    src = SyntheticTokens(vocab=50, seed=1, seq_len=12)
    val = [torch.cat([x, y[:, -1:]], 1) for x, y in src.validation(6)]
    train = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in
                       (src.batch(step, 6) for step in range(64))])
    rows = torch.cat(val)
    assert len({tuple(r) for r in rows.tolist()}) == len(rows) == 8 * 6
    seen = (rows[:, None, :] == train[None, :, :]).all(-1).any(1)
    assert not seen.any(), f"{int(seen.sum())} of {len(rows)} validation rows are training rows"
    halves = [list(src.validation(6, r, 2)) for r in range(2)]
    for i, v in enumerate(val):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), v[:, :-1])


# -- CLI ------------------------------------------------------------------------------------
def test_cli_tokenize_builds_then_reuses(tmp_path, capsys):
    write_wikitext(tmp_path)
    argv = ["tokenize", "--data", str(tmp_path), "--train-tokenizer", "--vocab-size", "300",
            "--seq-len", "32", "--quiet"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "[trained]" in out and out.count("built (no cache yet)") == 3
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "[reused]" in out and out.count("reused]") == 3 + 1
    bin_size = os.path.getsize(tmp_path / "cache-tokenizer-300" / "train.bin")
    train_line = next(line for line in out.splitlines() if line.startswith("train"))
    tokens, windows = (int(v.replace(",", "")) for v in train_line.split()[2:4])
    assert tokens == bin_size // 2 and windows == (tokens - 1) // 32
    assert cli_main(["tokenize", "--data", str(tmp_path), "--vocab-size", "320"]) == 2  # not trained
    assert "no tokenizer" in capsys.readouterr().err
    assert cli_main(["tokenize", "--data", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
