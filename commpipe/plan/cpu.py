"""A CPU as the planner's "GPU": peak FLOP/s and memory bandwidth measured on this machine.

    python -m commpipe.plan.cpu                 # prints the entry as JSON
    commpipe estimate --gpu cpu ...             # measured once per process

A CPU has no datasheet number that its training reaches: commpipe trains on CPU in fp32 with
one thread per rank (torchrun sets OMP_NUM_THREADS=1), so the peak is what one thread's fp32
matmul reaches here (a square GEMM large enough to be compute-bound: 512^3, ~2 ms) and the
"HBM" bandwidth is what one thread's copy of a 256 MB tensor reaches (read + write bytes). The
entry describes one rank's share of the machine when every rank has its own core; more ranks
than cores are `Cluster.host_cores`'s business (commpipe.plan.host). Links come from
`commpipe probe`, not from here: nvlink_gbps and nic_gbps are placeholders (the copy rate, and
1 GB/s) for a cluster built without a probe.

The host's third number is what one eager op costs it (`measure_op_seconds`, `Efficiency.op_s`):
commpipe's layers dispatch ~300 ops a layer per micro-batch (commpipe.plan.runtime_ops), and at
the shapes a CPU trains each costs more to issue than to compute. Measured like the layer runs
them: a few of commpipe's own LLaMA layers (commpipe.models.llama.Block) on tiny tensors, forward
and backward for two micro-batches, the gradient-norm clip's per-tensor ops and an AdamW step,
timed (best of a few) and divided by the ops that step dispatches (OP_STEP_OPS); ~0.05 s.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from functools import lru_cache

from commpipe.plan.gpus import GPU


def _best_seconds(fn, repeats: int) -> float:
    fn()                                           # warm-up: allocation, page faults, caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(threads: int = 1, gemm: int = 512, copy_mb: int = 256, repeats: int = 5) -> GPU:
    """Measure peak fp32 matmul FLOP/s and copy bandwidth with `threads` threads."""
    import torch

    if threads < 1 or gemm < 16 or copy_mb < 1:
        raise ValueError("measure_cpu needs threads >= 1, gemm >= 16 and copy_mb >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
        out = torch.empty(gemm, gemm)
        t_mm = _best_seconds(lambda: torch.mm(a, b, out=out), repeats)
        src = torch.ones(copy_mb * (1 << 20) // 4)
        dst = torch.empty_like(src)
        t_copy = _best_seconds(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(previous)
    tflops = 2 * gemm ** 3 / t_mm / 1e12
    copy_gbps = 2 * src.numel() * 4 / t_copy / 1e9          # read + write
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return GPU("cpu", tflops, round(mem_gb, 1), copy_gbps, copy_gbps, 1.0)


def host_share(cluster):
    """The ranks of one CPU host share its memory: each rank is planned with its share, the
    host's memory over the ranks it runs (`gpus_per_node`, at most the job's ranks), as
    `commpipe train` checks the sum of its local ranks' needs against the host (plan.fits)."""
    ranks = max(1, min(cluster.num_gpus, cluster.gpus_per_node))
    if ranks == 1:
        return cluster
    host_gb = cluster.gpu.mem_gb
    return replace(cluster, gpu=replace(cluster.gpu, mem_gb=round(host_gb / ranks, 2)),
                   source=f"{cluster.source}; each of {ranks} ranks on a host plans with "
                          f"1/{ranks} of its {host_gb:g} GB")


@lru_cache(maxsize=1)
def this_cpu() -> GPU:
    """The measured entry, once per process (`--gpu cpu`)."""
    return measure_cpu()


# ops one `op_step` dispatches (2 layers, 2 micro-batches): per layer and micro-batch 281 (forward
# 102, backward 179 under the meter's hooks, as commpipe.plan.runtime_ops counts them in the
# trainer), 16 per parameter tensor (clip 6, AdamW 10; 18 tensors), the loss and the step's own;
# recounted by tests/test_plan_runtime_kernels.py with a TorchDispatchMode (counting with one
# here would import torch._dynamo, ~3 s)
OP_STEP_OPS = 1423


def op_step(device: str = "cpu"):
    """A training step of two of commpipe's LLaMA layers (commpipe.models.llama.Block) on tiny
    tensors (hidden 16, 4 tokens) on `device`, fp32: two micro-batches forward and backward under
    the trainer's activation meter (on a CPU its saved-tensor hooks run for every tensor saved for
    backward, ~40 a layer pass), the gradient-norm clip's per-tensor ops and AdamW's; the time it
    takes is dispatch and the runtime's hooks, not arithmetic.
    On CUDA the step ends in a synchronisation, which tiny kernels reach long before the host has
    issued them. Returns the step as a function of nothing."""
    import torch

    from commpipe.models.llama import Block
    from commpipe.models.spec import resolve_model
    from commpipe.runtime.recompute import ActivationMeter

    dev = torch.device(device)
    spec = resolve_model("arch=llama,layers=1,hidden=16,heads=2,kv_heads=1,ffn_hidden=16,vocab=8")
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(Block(spec) for _ in range(2)).to(dev)
    params = list(blocks.parameters())
    # the step count on the host, as torch.optim keeps it (capturable=False): no sync to read it
    moments = [(torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())) for p in params]
    x = torch.randn(1, 4, spec.hidden, generator=gen).to(dev).requires_grad_()
    positions = torch.arange(4, device=dev)

    meter = ActivationMeter(params, dev)

    def step():
        with meter:         # as the trainer's step runs: on a CPU a saved-tensor hook per save
            for _ in range(2):
                h = x
                for block in blocks:
                    h = block(h, positions)
                h.sum().backward()
        with torch.no_grad():      # commpipe.parallel.data.clip_grad_norm_'s per-tensor ops
            sq = torch.zeros((), dtype=torch.float64, device=dev)
            for p in params:
                sq.add_(p.grad.detach().double().pow(2).sum())
            scale = 1.0 / (1.0 + float(sq.sqrt()))
            for p in params:
                p.grad.mul_(scale)
        _adamw(params, moments)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return step


def measure_op_seconds(device: str = "cpu", repeats: int = 7) -> float:
    """Host seconds per eager op on this host driving `device`, with one thread: the best of
    `repeats` runs of `op_step` over its OP_STEP_OPS ops (~0.05 s on a CPU)."""
    import torch

    if repeats < 1:
        raise ValueError("measure_op_seconds needs repeats >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = _best_seconds(op_step(device), repeats)
    finally:
        torch.set_num_threads(previous)
    return seconds / OP_STEP_OPS


def _adamw(params, moments, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
           decay: float = 0.1) -> None:
    """The ops torch.optim.AdamW's per-tensor loop (foreach off, as on a CPU) dispatches for
    each parameter, written out: the same 10 per tensor (commpipe.plan.runtime_ops), without
    torch.optim's first use, which imports for ~2 s."""
    import torch

    with torch.no_grad():
        for p, (m, v, step) in zip(params, moments):
            step += 1
            p.mul_(1 - lr * decay)
            m.lerp_(p.grad, 1 - betas[0])
            v.mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
            n = step.item()
            c1, c2 = 1 - betas[0] ** n, 1 - betas[1] ** n
            denom = (v.sqrt() / c2 ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / c1)


def _capacity_worker(index: int, seconds: float, barrier, results, model: str | None = None,
                     seq_len: int = 0) -> None:
    """One process of `measure_core_capacity`: its workload runs for `seconds` alone (index 0
    only), then for `seconds` beside the others; each phase's steps per second go to `results`.
    Every process meets at `barrier` when a phase begins (the end of the one before) and at the
    end. The workload: op_step, or with `model` its first stage's pass at 4 samples of
    `seq_len` tokens (commpipe.plan.pass_split.first_stage_pass)."""
    import torch

    torch.set_num_threads(1)
    if model is None:
        step = op_step()
    else:
        from commpipe.models.family import resolve
        from commpipe.plan.pass_split import first_stage_pass

        run = first_stage_pass(resolve(model), seq_len, (4,))
        step = lambda: run(4)          # noqa: E731
    step()                                          # warm-up
    rates = []
    for running in (index == 0, True):
        barrier.wait()
        if running:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                step()
                n += 1
            rates.append(n / (time.perf_counter() - t0))
    barrier.wait()
    results.put((index, rates))


def measure_core_capacity(cores: int | None = None, seconds: float = 1.0,
                          processes: int | None = None, model: str | None = None,
                          seq_len: int = 32) -> float:
    """How many ranks' worth of eager training this host's cores run at once: `processes`
    (default: one per core; `cores` default: every core this process may use) each step
    commpipe's layers for `seconds` on one thread, first one of them alone, then all together;
    the capacity is the sum of their step rates over the lone one's. Cores that share a physical
    core (SMT siblings) or a virtual machine's vCPUs backed by less than a core each deliver
    less than their count: on one 2-vCPU machine two such ranks ran at 1.46 lone ranks' speed
    between them. The step is `op_step`, or with `model` (a --model value) that model's first
    stage's pass at 4 samples of `seq_len` tokens: with more processes than cores the scheduler
    switches between them and each switch refills caches the others evicted, which a real
    layer's working set is likelier to show than op_step's tiny tensors
    (benchmarks/cpu_oversubscription.py). `plan --host-cores auto` passes the default (one
    process per core, op_step) as `Cluster.host_cores` (commpipe.plan.host shares it among the
    busy ranks). At least 1, at most `cores`; ~3 s with the processes' start."""
    import multiprocessing as mp

    cores = cores or len(os.sched_getaffinity(0))
    processes = processes or cores
    if cores < 1 or processes < 1 or seconds <= 0:
        raise ValueError("measure_core_capacity needs cores >= 1, processes >= 1 and seconds > 0")
    if cores == 1 or processes == 1:
        return 1.0
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [ctx.Process(target=_capacity_worker,
                         args=(i, seconds, barrier, results, model, seq_len))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    try:
        rates = dict(results.get(timeout=120 + 4 * seconds) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return capacity_of(rates, cores)


def capacity_of(rates: dict[int, list[float]], cores: int) -> float:
    """Capacity from `_capacity_worker`'s rates: process 0's [alone, together], the others'
    [together]; the together rates' sum over the lone one, within [1, cores]."""
    alone = rates[0][0]
    together = rates[0][1] + sum(r[0] for i, r in rates.items() if i)
    return min(float(cores), max(1.0, together / alone))


@lru_cache(maxsize=2)
def host_op_seconds(device: str = "cpu") -> float:
    """`measure_op_seconds` once per process and device."""
    return measure_op_seconds(device)


if __name__ == "__main__":
    print(json.dumps(this_cpu().to_dict() | {"op_us": host_op_seconds() * 1e6,
                                             "core_capacity": measure_core_capacity()}, indent=2))
