"""Training data: corpus readers, tokenizers, memory-mapped token caches, deterministic batches.

Prepare a corpus once (trains or loads the tokenizer, tokenizes every split into a cache):

    commpipe tokenize --data data/wikitext-103 --train-tokenizer --vocab-size 32000

Then the training loop gets a *source* and asks it for batches:

    from commpipe.data import open_source, SyntheticTokens
    source = open_source("data/wikitext-103", seq_len=1024, seed=0, build=False)
    # or, without a corpus:  source = SyntheticTokens(vocab=32000, seed=0, seq_len=1024)

Source interface (CorpusSource and SyntheticTokens implement exactly this):

    source.vocab_size                    int; the model's vocabulary must be at least this
    source.seq_len                       int; tokens per sequence
    source.batch(step, global_batch, dp_rank, dp_size) -> (inputs, labels)
        torch.int64 tensors [global_batch // dp_size, seq_len]; labels[:, i] is the token
        after inputs[:, i]. Deterministic in (seed, step); DP ranks read disjoint rows of one
        global batch whose content does not depend on dp_size. TP, CP and PP ranks of one DP
        replica pass the same dp_rank and get the same rows (CP chunks them itself).
    source.validation(global_batch, dp_rank, dp_size, max_batches=None) -> iterator of
        (inputs, labels) as above: fixed, unshuffled windows of the valid split.
    source.state_dict() -> dict            position after the last step served (JSON-able)
    source.load_state_dict(state)          resume: the next batches equal the uninterrupted run's

`open_source(..., build=True)` trains a missing tokenizer and tokenizes missing or stale
splits; with `build=False` it only reads, and a missing cache is a FileNotFoundError naming the
`commpipe tokenize` command to run. In a multi-process job call it with `build=False` (after
`commpipe tokenize`), or with `build=True` on one rank followed by a barrier.
"""

from commpipe.data.cache import CacheInfo, ensure_cache, token_dtype
from commpipe.data.corpus import SPLITS, Corpus, open_corpus
from commpipe.data.sampler import TokenDataset, WindowSampler
from commpipe.data.sources import CorpusSource, SyntheticTokens, open_source, prepare
from commpipe.data.tokenizer import EOD_TOKEN, Tokenizer, load_tokenizer, resolve_tokenizer, train_bpe

__all__ = [
    "SPLITS", "EOD_TOKEN", "CacheInfo", "Corpus", "CorpusSource", "SyntheticTokens", "TokenDataset",
    "Tokenizer", "WindowSampler", "ensure_cache", "load_tokenizer", "open_corpus", "open_source",
    "prepare", "resolve_tokenizer", "token_dtype", "train_bpe",
]
