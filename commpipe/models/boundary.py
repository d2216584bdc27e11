"""What crosses a pipeline stage boundary, as pure data (no torch).

Every stage of a split says which batch fields it reads, which tensors it receives from the
stage before and which it sends to the stage after (names, shapes, dtypes). A runtime or a
simulator sizes its messages from these descriptions instead of one global activation shape,
so stages of a heterogeneous model (a vision encoder feeding a text decoder) need nothing else.
Gradients flow back along the same boundaries with the same shapes (for floating tensors).

    >>> from commpipe.models.spec import resolve_model
    >>> io = llama_stage_io(resolve_model("tiny"), [2, 2], micro_batch=1, seq_len=8)
    >>> io[0].send
    (TensorDesc(name='hidden', shape=(1, 8, 64), dtype='float32'),)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int64": 8, "int32": 4}


@dataclass(frozen=True)
class TensorDesc:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def has_grad(self) -> bool:
        """Floating tensors carry a gradient back across the boundary; token ids do not."""
        return not self.dtype.startswith("int")


@dataclass(frozen=True)
class StageIO:
    """One stage's boundary: `data` comes from the batch, `recv` from stage - 1 (forward; its
    gradients go back there), `send` to stage + 1. The last stage sends nothing and outputs
    the loss."""

    stage: int
    layers: range
    data: tuple[TensorDesc, ...]
    recv: tuple[TensorDesc, ...]
    send: tuple[TensorDesc, ...]

    @property
    def send_bytes(self) -> int:
        return sum(t.nbytes for t in self.send)

    @property
    def recv_bytes(self) -> int:
        return sum(t.nbytes for t in self.recv)


def check_counts(stage_layers: list[int], layers: int) -> None:
    if not stage_layers or any(c < 1 for c in stage_layers) or sum(stage_layers) != layers:
        raise ValueError(f"stage layer counts {stage_layers} must be positive and sum to the "
                         f"model's {layers} layers")


def llama_stage_io(spec, stage_layers: list[int], micro_batch: int, seq_len: int,
                   dtype: str = "float32") -> list[StageIO]:
    """The same description for a decoder-only model: one hidden-state tensor per boundary."""
    check_counts(stage_layers, spec.layers)
    hidden = (TensorDesc("hidden", (micro_batch, seq_len, spec.hidden), dtype),)
    tokens = TensorDesc("tokens", (micro_batch, seq_len), "int64")
    labels = TensorDesc("labels", (micro_batch, seq_len), "int64")
    out, start, last = [], 0, len(stage_layers) - 1
    for k, count in enumerate(stage_layers):
        data = ((tokens,) if k == 0 else ()) + ((labels,) if k == last else ())
        out.append(StageIO(k, range(start, start + count), data, hidden if k > 0 else (),
                           hidden if k < last else ()))
        start += count
    return out
