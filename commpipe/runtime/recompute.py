"""Activation recomputation, applied to a plain model from outside, and the meter that measures
what the backward holds.

    apply_recompute(stage, "selective")   # the attention core (Korthikanti et al. 2022, sec. 5)
    apply_recompute(stage, "full")        # each whole layer; only its input is kept

Selective puts a `RecomputedCore` in the attention's `core` slot (where context parallelism puts
its own core); full gives each layer the `Recomputed` forward by swapping its class. Nothing
replaces a module's `forward` attribute.

Both use reentrant checkpointing: the wrapped forward runs without building a graph, its inputs
are saved with `ctx.save_for_backward` (so the saved-tensor hooks below see them), and the
backward recomputes the forward and back-propagates through it. The deferred weight-gradient
GEMMs (I/W split), the TP regions and the DP readiness hooks work inside it unchanged: each
parameter still accumulates once per micro-batch.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from commpipe.runtime.features import RECOMPUTE_MODES


class RecomputedCore:
    """An attention core (the model's `Attention.core` method, or context parallelism's
    `CPOverlappedCore`) run under recomputation: `inner` is the core it replays."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=True)


class Recomputed:
    """Mixin of a layer whose whole forward is recomputed; `recomputed_class` puts it in front
    of the layer's own class (the way FSDP2's `fully_shard` swaps a module's class), so the
    layer keeps its parameters, names and `isinstance` and only `forward` changes."""

    def forward(self, *args):
        return checkpoint(super().forward, *args, use_reentrant=True)


_RECOMPUTED: dict[type, type] = {}


def recomputed_class(cls: type) -> type:
    """`cls` with its forward recomputed (one class per layer class)."""
    if issubclass(cls, Recomputed):
        return cls
    if cls not in _RECOMPUTED:
        _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (Recomputed, cls), {})
    return _RECOMPUTED[cls]


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Recompute the attention cores (selective) or the layers (full) of `model`."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute {mode!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return model
    for block in model.layers.values():
        if mode == "full":
            block.__class__ = recomputed_class(type(block))
        elif not isinstance(block.attention.core, RecomputedCore):
            block.attention.core = RecomputedCore(block.attention.core)
    return model


class _Held:
    """A tensor saved for backward; releases its bytes from the meter when autograd drops it."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, meter, key, tensor):
        self.tensor, self.key, self.meter = tensor, key, meter
        weakref.finalize(self, meter._release, key)


class ActivationMeter:
    """Peak bytes held for backward during a step.

    CPU: saved-tensor hooks count every tensor autograd saves (a storage once, however many
    nodes save it; parameters excluded) from when it is saved until the graph releases it.
    CUDA: the allocator's peak during the step minus what was allocated when it began (weights,
    gradients, optimizer states)."""

    def __init__(self, params, device: torch.device):
        self.device = device
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.peak = 0

    def __enter__(self):
        self.peak = self.current = 0
        self.live: dict[int, list] = {}       # storage pointer -> [refs, bytes]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.static = torch.cuda.memory_allocated(self.device)
            self._hooks = None
            return self
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        else:
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.static
        return False

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, storage.nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]
