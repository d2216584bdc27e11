"""Windows over a token file: `TokenDataset` reads them, `WindowSampler` decides which.

A split of N tokens is cut into W = (N - 1) // seq_len windows; window w holds tokens
[w * seq_len, w * seq_len + seq_len + 1): its first seq_len tokens are the inputs and its last
seq_len the labels (inputs shifted by one), so consecutive windows share one boundary token
and every token except the first is a label exactly once per epoch.

Training order: epoch e visits the windows in the permutation drawn by
`numpy.random.default_rng([seed, e])`. A global batch of B windows is the next B entries of
that order; DP rank r of d takes entries [r*B/d, (r+1)*B/d) of it, so ranks read disjoint
windows and their union is exactly the batch a single rank would read (the model sees the same
data under every layout). The W mod B windows left at the end of an epoch are skipped, so a
batch never spans two epochs.

A *position* (epoch, index) says where a batch begins in that order. The sampler maps training
steps to positions from an anchor (step, epoch, index): step s begins s - step batches after
it. `state_dict()` saves the position of the step after the last one served; loading it makes
that step the new anchor, so a resumed run reads exactly the batches the uninterrupted one
would have read, even if the global batch size changes at the resume point.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Position = tuple[int, int]  # (epoch, index of the batch's first window in that epoch's order)


def check_dp(global_batch: int, dp_rank: int, dp_size: int) -> int:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
    if global_batch < 1 or global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not a positive multiple of dp={dp_size}; "
                         f"use --global-batch divisible by dp")
    return global_batch // dp_size


class TokenDataset:
    """Read-only windows of one split's token file (a numpy memmap)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_tokens = int(tokens.shape[0])
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)

    def window_tokens(self, window_ids: np.ndarray) -> np.ndarray:
        """[len(window_ids), seq_len + 1] int64 tokens."""
        n = self.seq_len + 1
        out = np.empty((len(window_ids), n), dtype=np.int64)
        for row, w in enumerate(window_ids):
            start = int(w) * self.seq_len
            out[row] = self.tokens[start:start + n]
        return out

    def batch(self, window_ids: np.ndarray):
        """(inputs, labels), torch LongTensors of shape [len(window_ids), seq_len]."""
        import torch

        rows = torch.from_numpy(self.window_tokens(window_ids))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def validation(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                   max_batches: int | None = None) -> Iterator:
        """Fixed, unshuffled batches: global batch i is windows [i*B, (i+1)*B), sharded by DP rank.

        Windows past the last full global batch are left out so every rank runs the same number
        of batches; `max_batches` caps the count (cheap periodic evaluation).
        """
        local = check_dp(global_batch, dp_rank, dp_size)
        num_batches = self.num_windows // global_batch
        if num_batches == 0:
            raise ValueError(f"validation split has {self.num_windows} windows of {self.seq_len} "
                             f"tokens, fewer than one global batch of {global_batch}")
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        for i in range(num_batches):
            first = i * global_batch + dp_rank * local
            yield self.batch(np.arange(first, first + local))


class WindowSampler:
    """Deterministic, seeded, DP-sharded order of windows; resumable via `state_dict()`."""

    def __init__(self, num_tokens: int, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 dataset: TokenDataset | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.num_windows = max(0, (num_tokens - 1) // seq_len)
        if self.num_windows == 0:
            raise ValueError(f"{num_tokens} tokens hold no window of seq_len+1 = {seq_len + 1} "
                             f"tokens; use a larger corpus or a smaller --seq-len")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.seq_len, self.seed = seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.dataset = dataset  # where `batch` reads tokens from
        self._anchor = (0, 0, 0)          # (step, epoch, index)
        self._anchor_batch: int | None = None  # global batch used since the anchor
        self._next = self._anchor         # position of the step after the last one served
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The window permutation of `epoch` (cached for the current epoch)."""
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def batches_per_epoch(self, global_batch: int) -> int:
        n = self.num_windows // global_batch
        if n == 0:
            raise ValueError(f"the train split has {self.num_windows} windows of {self.seq_len} "
                             f"tokens, fewer than one global batch of {global_batch}; lower "
                             f"--global-batch or --seq-len, or use more data")
        return n

    def advance(self, position: Position, batches: int, global_batch: int) -> Position:
        """The position `batches` global batches after `position` (0 normalizes it)."""
        epoch, index = position
        per_epoch = self.batches_per_epoch(global_batch)
        left = (self.num_windows - index) // global_batch  # full batches left in this epoch
        if batches < left:
            return epoch, index + batches * global_batch
        batches -= left
        return epoch + 1 + batches // per_epoch, (batches % per_epoch) * global_batch

    def position(self, step: int, global_batch: int) -> Position:
        """Where the batch of training step `step` begins (steps count from the anchor)."""
        a_step, a_epoch, a_index = self._anchor
        if step < a_step:
            raise ValueError(f"step {step} comes before the resume point (step {a_step})")
        if self._anchor_batch is None:
            self._anchor_batch = global_batch
        elif global_batch != self._anchor_batch:
            # new global batch size from here on: re-anchor where the old size left off
            epoch, index = self.advance((a_epoch, a_index), step - a_step, self._anchor_batch)
            self._anchor, self._anchor_batch = (step, epoch, index), global_batch
            return self.advance((epoch, index), 0, global_batch)
        return self.advance((a_epoch, a_index), step - a_step, global_batch)

    def window_ids(self, step_or_position: int | Position, global_batch: int,
                   dp_rank: int | None = None, dp_size: int | None = None) -> np.ndarray:
        """This DP rank's window ids for a step (advances the resume state) or a position."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        dp_size = self.dp_size if dp_size is None else dp_size
        local = check_dp(global_batch, dp_rank, dp_size)
        if isinstance(step_or_position, tuple):
            epoch, index = self.advance(step_or_position, 0, global_batch)
        else:
            step = int(step_or_position)
            epoch, index = self.position(step, global_batch)
            self._next = (step + 1, *self.advance((epoch, index), 1, global_batch))
        first = index + dp_rank * local
        return self.order(epoch)[first:first + local]

    def starts(self, step_or_position: int | Position, global_batch: int) -> np.ndarray:
        """Token offsets of this rank's windows (window w starts at token w * seq_len)."""
        return self.window_ids(step_or_position, global_batch) * self.seq_len

    def batch(self, step_or_position: int | Position, global_batch: int):
        """This DP rank's (inputs, labels), LongTensors [global_batch / dp_size, seq_len]."""
        if self.dataset is None:
            raise ValueError("this WindowSampler has no dataset; pass dataset=TokenDataset(...)")
        return self.dataset.batch(self.window_ids(step_or_position, global_batch))

    def state_dict(self) -> dict:
        step, epoch, index = self._next
        return {"seed": self.seed, "seq_len": self.seq_len, "num_windows": self.num_windows,
                "step": step, "epoch": epoch, "index": index}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "num_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={state[key]}, this run has "
                                 f"{getattr(self, key)}; resume with the same data, --seq-len and --seed")
        self._anchor = (int(state["step"]), int(state["epoch"]), int(state["index"]))
        self._anchor_batch = None
        self._next = self._anchor
