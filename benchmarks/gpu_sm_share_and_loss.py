"""Two planner terms measured on one GPU (docs/planner.md, "Validation on public runs"):

1. A kernel holding k SMs slows a GEMM beside it by sms / (sms - k) (commpipe/plan/kernels.py,
   `nccl_sm_share`: an overlapped NCCL collective holds one SM per channel). A persistent spin
   kernel of k blocks (1024 threads each, one block per SM) runs on a second stream while bf16
   GEMMs run on the first; the GEMMs' time against theirs alone is compared with sms/(sms - k).
2. Megatron-LM's unfused vocab-parallel cross-entropy moves 38 bytes per logit forward and 14
   backward (kernels.CE_BYTES): its op sequence is timed on [tokens, V] logits and the bytes that
   time implies at the planner's HBM rate (80% of the datasheet) are printed beside 38 and 14.

    python benchmarks/gpu_sm_share_and_loss.py [--json out.json]

Needs a CUDA GPU and Triton (the spin kernel). Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.kernels import HBM_EFFICIENCY


def _events(fn, reps: int) -> float:
    """Seconds per call of fn on the current stream (CUDA events, after one warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def sm_share(gpu_name: str, shape: tuple[int, int, int], ks: tuple[int, ...]) -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, n_iter, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.arange(0, BLOCK).to(tl.float32)
        for _ in range(n_iter):
            acc = acc * 0.9999 + 1.0
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, k, n = shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    block = 32 * 1024                     # 32 fp32 values per thread of 1024: one block per SM
    out = torch.empty(max(ks) * block, device="cuda")
    reps = 50
    alone = _events(lambda: a @ b, reps)
    # spin long enough to cover the GEMM loop: time 2000 iterations, scale
    spin[(1,)](out, 2000, BLOCK=block, num_warps=32)
    torch.cuda.synchronize()
    t = _events(lambda: spin[(1,)](out, 2000, BLOCK=block, num_warps=32), 3)
    iters = int(2000 * 3 * reps * alone / t) + 2000
    side = torch.cuda.Stream()
    rows = []
    for kk in ks:
        torch.cuda.synchronize()
        if kk:
            with torch.cuda.stream(side):
                spin[(kk,)](out, iters, BLOCK=block, num_warps=32)
        beside = _events(lambda: a @ b, reps)
        torch.cuda.synchronize()
        rows.append({"blocks": kk, "gemm_alone_ms": alone * 1e3, "gemm_beside_ms": beside * 1e3,
                     "measured_ratio": beside / alone, "model_ratio": sms / (sms - kk),
                     "sms": sms, "shape": shape})
        print(f"{kk:3d} SMs held: GEMM {m}x{k}x{n} {beside * 1e3:7.3f} ms (alone {alone * 1e3:.3f}),"
              f" x{beside / alone:.3f} measured, x{sms / (sms - kk):.3f} = {sms}/({sms}-{kk}) modelled")
    return rows


def unfused_cross_entropy(gpu_name: str, tokens: int, vocab: int) -> dict:
    """Megatron-LM's vocab_parallel_cross_entropy op sequence at tp 1 (written from its
    description in commpipe/plan/kernels.py), forward and backward timed separately."""
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    rows = torch.arange(tokens, device="cuda")

    def forward():
        x = logits.float()                                  # r 2, w 4
        mx = torch.max(x, dim=-1)[0]                        # r 4
        x -= mx.unsqueeze(-1)                               # r 4, w 4
        picked = x[rows, target].clone()
        torch.exp(x, out=x)                                 # r 4, w 4
        s = x.sum(dim=-1)                                   # r 4
        loss = torch.log(s) - picked
        x.div_(s.unsqueeze(-1))                             # r 4, w 4
        return x, loss

    softmax, _ = forward()
    grad_out = torch.ones(tokens, device="cuda")

    def backward():
        g = softmax                                         # in place, as Megatron does
        g[rows, target] -= 1.0
        g.mul_(grad_out.unsqueeze(-1))                      # r 4, w 4
        return g.to(torch.bfloat16)                         # r 4, w 2 (the .float()'s backward)

    t_f = _events(forward, 5)
    t_b = _events(backward, 5)
    hbm = resolve_gpu(gpu_name).hbm_gbps * 1e9 * HBM_EFFICIENCY
    n = tokens * vocab
    res = {"tokens": tokens, "vocab": vocab, "forward_ms": t_f * 1e3, "backward_ms": t_b * 1e3,
           "forward_bytes_per_logit": t_f * hbm / n, "backward_bytes_per_logit": t_b * hbm / n,
           "model_forward": 38.0, "model_backward": 14.0}
    print(f"unfused cross-entropy [{tokens} x {vocab}]: forward {t_f * 1e3:.2f} ms = "
          f"{t_f * hbm / n:.1f} B/logit at {gpu_name}'s planner HBM rate (model 38), backward "
          f"{t_b * 1e3:.2f} ms = {t_b * hbm / n:.1f} B/logit (model 14)")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100", help="planner GPU whose HBM rate converts times to bytes")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    print(torch.cuda.get_device_name(0), torch.__version__)
    out = {"device": torch.cuda.get_device_name(0)}
    runs = {"sm_share": lambda: sm_share(args.gpu, (8192, 4096, 12288), (0, 4, 16, 24, 32)),
            "sm_share_small": lambda: sm_share(args.gpu, (4096, 2048, 6144), (0, 4, 16, 24)),
            "cross_entropy": lambda: unfused_cross_entropy(args.gpu, 8192, 131072)}
    for name, run in runs.items():
        try:
            out[name] = run()
        except Exception as exc:        # one part failing (no Triton) leaves the others
            print(f"{name}: {type(exc).__name__}: {exc}")
            out[name] = {"error": str(exc)}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
