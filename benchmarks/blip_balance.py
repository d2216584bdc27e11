"""Stage balancing for blip-tiny on this machine, one process: predicted vs measured stage times.

    python benchmarks/blip_balance.py                  # pp=2, micro-batch 4, one thread
    python benchmarks/blip_balance.py --stages 4 --micro-batch 8 --model blip-base --repeats 2

Profiles each layer's forward + backward (commpipe.parallel.balance.blip_layer_costs), splits
the layers three ways (even by layer count, balanced by FLOPs, balanced by the measured
profile), then times each stage of each split as a block, forward + backward, stages chained
as a pipeline would feed them, the fastest of --repeats rounds interleaved across splits so
that load drift hits all alike. Prints each split's predicted stage times (sum of its layers'
profiled costs) beside the measured ones, and the ratio of the slowest stage to the even
split's slowest stage: the bound on the pipeline's step-time ratio in steady state.
No assertions (tests/test_balance.py checks correctness); numbers are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from commpipe.models.blip import build_stages, caption_loss_sum
from commpipe.models.blip_spec import resolve_blip, stage_io
from commpipe.parallel.balance import balance, blip_layer_costs, stage_costs
from commpipe.parallel.dims import split_layers


def time_stages(spec, counts, micro_batch, data):
    """Seconds of forward + backward of each stage of a split, chained."""
    stages = build_stages(spec, counts)
    ios = stage_io(spec, counts, micro_batch)
    out_times, prev = [], {}
    for k, (stage, io) in enumerate(zip(stages, ios)):
        inputs = {t.name: prev[t.name].detach().requires_grad_() for t in io.recv}
        inputs.update({t.name: data[t.name] for t in io.data if t.name != "labels"})
        t0 = time.perf_counter()
        out = stage(**inputs)
        if k == len(stages) - 1:
            caption_loss_sum(out["logits"], data["labels"]).backward()
        else:
            sent = [out[t.name] for t in io.send]
            torch.autograd.backward(sent, [torch.ones_like(s) for s in sent])
        out_times.append(time.perf_counter() - t0)
        prev = {k2: v.detach() for k2, v in out.items()}
    return out_times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="blip-tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = resolve_blip(args.model)
    measured = blip_layer_costs(spec, "measured", args.micro_batch, repeats=args.repeats)
    flops = blip_layer_costs(spec, "flops")
    print(f"{spec.name}: per-layer forward+backward ms (measured, micro-batch {args.micro_batch}):",
          " ".join(f"{c * 1e3:.2f}" for c in measured))
    print("per-layer forward GFLOP/sample:", " ".join(f"{f / 1e9:.4f}" for f in flops))
    splits = {"even": [len(r) for r in split_layers(spec.layers, args.stages)],
              "flops": balance(flops, args.stages), "measured": balance(measured, args.stages)}
    g = torch.Generator().manual_seed(0)
    b, s = args.micro_batch, spec.text_len
    data = {"pixels": torch.randn(b, 3, spec.image_size, spec.image_size, generator=g),
            "tokens": torch.randint(0, spec.vocab, (b, s), generator=g),
            "labels": torch.randint(0, spec.vocab, (b, s), generator=g)}
    best = {name: [float("inf")] * args.stages for name in splits}
    for _ in range(args.repeats + 1):
        for name, counts in splits.items():
            t = time_stages(spec, counts, b, data)
            best[name] = [min(x, y) for x, y in zip(best[name], t)]
    even_max = max(best["even"])
    for name, counts in splits.items():
        predicted = stage_costs(measured, counts)
        print(f"{name:>8}: layers {counts}  predicted ms {[round(p * 1e3, 2) for p in predicted]}"
              f"  measured ms {[round(m * 1e3, 2) for m in best[name]]}"
              f"  slowest/even {max(best[name]) / even_max:.3f}")


if __name__ == "__main__":
    main()
