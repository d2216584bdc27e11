"""Stage balancing: cut a sequence of layers into contiguous pipeline stages so that the slowest
stage is as fast as possible, from per-layer costs that are predicted (FLOPs) or measured (a
short forward + backward profile of each layer, as torchgpipe's balance_by_time).

    >>> balance([4, 4, 4, 1, 1, 1, 1, 1, 1], stages=2)
    [2, 7]
    >>> stage_costs([4, 4, 4, 1, 1, 1, 1, 1, 1], [2, 7])
    [8, 10]

`balance` is exact: a dynamic program over (stages, layers), O(stages * layers^2), which for
the few hundred layers of any pipeline is instant. The linear-partition problem it solves is
the one torchgpipe's `balance_by_time` and Megatron-style "uneven stages" solve heuristically.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from itertools import accumulate

from commpipe.models.spec import head_flops_per_token, layer_flops_per_token


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Total cost of each stage of a split given as layer counts."""
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


def balance(costs: Sequence[float], stages: int, slowdown: Sequence[float] | None = None) -> list[int]:
    """Layer counts per stage (each at least one layer, contiguous, first stage first)
    minimizing the largest stage cost. Among optimal splits the one whose last stage is
    lightest wins (the last stage also computes the loss). `slowdown[k]` multiplies stage k's
    cost: a straggling device (the adaptive controller re-balances with it)."""
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages; use 1..{n} stages")
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be non-negative, got {list(costs)}")
    slowdown = [1.0] * stages if slowdown is None else list(slowdown)
    if len(slowdown) != stages or any(f <= 0 for f in slowdown):
        raise ValueError(f"slowdown needs one positive factor per stage ({stages}), got {slowdown}")
    prefix = [0.0, *accumulate(costs)]
    inf = float("inf")
    # best[k][j]: smallest possible slowest stage when the first j layers form k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):        # stage k holds layers i..j-1
                worst = max(best[k - 1][i], (prefix[j] - prefix[i]) * slowdown[k - 1])
                if worst <= best[k][j]:      # <=: prefer the latest cut, a lighter last stage
                    best[k][j], cut[k][j] = worst, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def measure_layer_costs(modules: Sequence[Callable[..., dict]], ios, data: dict,
                        loss_fn: Callable[[dict, dict], object], repeats: int = 5,
                        warmup: int = 2) -> list[float]:
    """Seconds of forward + backward of each single-layer stage: the median of `repeats` rounds
    after `warmup` untimed ones (first calls pay for allocation and kernel selection).

    A round runs every layer once, first to last, so load that drifts during the profile hits
    all layers alike rather than a few of them. On CPU with one intra-op thread the clock is the
    calling thread's CPU time (`time.thread_time`), which time slices given to other processes
    on a shared machine do not inflate; otherwise it is the wall clock, synchronized on CUDA.

    `modules[i]` runs layer i (with the pieces its stage holds) on keyword tensors and returns
    a dict; `ios[i]` is its boundary description (`commpipe.models.boundary.StageIO`): it gets
    the batch fields named in `ios[i].data` (labels excepted: `loss_fn(outputs, data)` reads
    them) and the previous layer's outputs named in `ios[i].recv`. Each layer's backward is
    seeded with a random gradient of the right shape, or with the loss for the last layer.
    """
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    cuda = any(t.is_cuda for t in data.values() if isinstance(t, torch.Tensor))
    cpu_clock = not cuda and torch.get_num_threads() == 1
    clock = time.thread_time if cpu_clock else time.perf_counter

    def sync():
        if cuda:
            torch.cuda.synchronize()

    seeds: list[list] = []   # each layer's output gradients, drawn once, outside the clock

    def run(index: int, inputs: dict) -> dict:
        out = modules[index](**inputs)
        if index == len(modules) - 1:
            loss_fn(out, data).backward()
        else:
            sent = [out[t.name] for t in ios[index].send]
            if len(seeds) == index:
                seeds.append([torch.randn_like(s) for s in sent])
            torch.autograd.backward(sent, seeds[index])
        return out

    def inputs_of(index: int, prev: dict) -> dict:
        io = ios[index]
        inputs = {t.name: prev[t.name].detach().requires_grad_(t.has_grad) for t in io.recv}
        inputs.update({t.name: data[t.name] for t in io.data if t.name != "labels"})
        return inputs

    # each layer's inputs: the previous layer's outputs, computed once, kept detached
    layer_inputs, prev = [], {}
    for index in range(len(modules)):
        layer_inputs.append(inputs_of(index, prev))
        prev = {k: v.detach() for k, v in run(index, layer_inputs[index]).items()}
    times = [[] for _ in modules]
    for rnd in range(warmup + repeats):
        for index in range(len(modules)):
            inputs = {k: (v.detach().requires_grad_(v.requires_grad) if v.is_floating_point()
                          else v) for k, v in layer_inputs[index].items()}
            sync()
            t0 = clock()
            run(index, inputs)
            sync()
            if rnd >= warmup:
                times[index].append(clock() - t0)
    for m in modules:   # leave no profile gradients behind
        if hasattr(m, "zero_grad"):
            m.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def blip_layer_costs(spec, how: str = "flops", micro_batch: int = 4, repeats: int = 5,
                     device="cpu", seed: int = 0, warmup: int = 2) -> list[float]:
    """Per-layer costs of a BLIP model: `flops` (forward FLOPs per sample from the model's
    FLOPs function, proportional to time at equal efficiency) or `measured` (seconds of
    forward + backward of each layer on `device`, micro-batch `micro_batch`, random data; the
    median of `repeats` rounds after `warmup`, see `measure_layer_costs`)."""
    from commpipe.models.blip_spec import layer_flops, stage_io

    if how == "flops":
        return [float(f) for f in layer_flops(spec)]
    if how != "measured":
        raise ValueError(f"layer costs are 'flops' or 'measured', not {how!r}")
    import torch

    from commpipe.models.blip import build_model, caption_loss_sum

    g = torch.Generator().manual_seed(seed)
    size, s = spec.image_size, spec.text_len
    data = {"pixels": torch.randn(micro_batch, spec.channels, size, size, generator=g),
            "tokens": torch.randint(0, spec.vocab, (micro_batch, s), generator=g),
            "labels": torch.randint(0, spec.vocab, (micro_batch, s), generator=g)}
    data = {k: v.to(device) for k, v in data.items()}
    modules = [build_model(spec, seed, range(i, i + 1), device) for i in range(spec.layers)]
    ios = stage_io(spec, [1] * spec.layers, micro_batch)
    return measure_layer_costs(modules, ios, data,
                               lambda out, d: caption_loss_sum(out["logits"], d["labels"]), repeats,
                               warmup)


def llama_layer_costs(spec, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each LLaMA layer, the vocabulary head charged to the last
    layer (whose stage runs it): the layers are identical, so balancing only moves the head's
    share (commpipe.models.spec.flops_per_token's accounting)."""
    costs = [layer_flops_per_token(spec, seq_len)] * spec.layers
    costs[-1] += head_flops_per_token(spec)
    return costs
