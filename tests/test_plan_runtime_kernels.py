"""The planner's count of what commpipe's own runtime moves beside its GEMMs and attention
(commpipe/plan/runtime_kernels.py), and of what it saves under bf16 autocast
(commpipe/plan/runtime_memory.py), against the model's own ops counted as they run: every aten
call one layer dispatches, its inputs read plus its outputs written, views free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from commpipe.models.llama import Block
from commpipe.models.spec import layer_param_count, resolve_model
from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.plan.runtime_kernels import WEIGHT_CAST_BYTES, per_token_bytes
from commpipe.plan.runtime_memory import stage_activation_bytes
from commpipe.train.config import TrainConfig
from commpipe.train.loop import Trainer

PRICED_ELSEWHERE = ("mm", "addmm", "bmm", "linear")    # GEMMs; attention kernels by name


class _Bytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in PRICED_ELSEWHERE or "attention" in name:
            return out
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        storages = {i.untyped_storage().data_ptr() for i in ins}
        if outs and all(o.untyped_storage().data_ptr() in storages for o in outs):
            return out                                   # a view (or in-place): nothing new
        self.total += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


def _layer_bytes(spec, tokens: int, mixed: bool) -> tuple[int, int]:
    block = Block(spec)
    x = torch.randn(1, tokens, spec.hidden, requires_grad=True)
    positions = torch.arange(tokens)
    fwd, bwd = _Bytes(), _Bytes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        with fwd:
            y = block(x, positions)
    grad = torch.randn_like(y)
    with bwd:
        y.backward(grad)
    return fwd.total, bwd.total


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_per_token_bytes_match_the_ops_the_layer_runs(precision):
    # a shape the coefficients were not counted on: 6 heads of 64, GQA 3:1, f = 1024
    spec = resolve_model("arch=llama,layers=1,hidden=384,heads=6,kv_heads=2,ffn_hidden=1024,"
                         "vocab=100")
    mixed = precision == "bf16"
    small, large = _layer_bytes(spec, 128, mixed), _layer_bytes(spec, 384, mixed)
    weights = layer_param_count(spec) - 2 * spec.hidden
    for i, direction in enumerate(("forward", "backward")):
        per_token = (large[i] - small[i]) / (384 - 128)
        assert per_token == pytest.approx(per_token_bytes(spec, precision, direction), rel=0.02)
        # what does not grow with tokens: the weight casts of autocast (6 bytes a parameter)
        fixed = small[i] - 128 * per_token
        expected = WEIGHT_CAST_BYTES * weights if mixed else 0.0
        assert fixed == pytest.approx(expected, rel=0.02, abs=0.01 * WEIGHT_CAST_BYTES * weights)


@pytest.mark.parametrize("recompute, schedule", [("none", "1f1b"), ("selective", "1f1b"),
                                                 ("none", "gpipe")])
def test_estimate_prices_bf16_saved_tensors(recompute, schedule):
    """bf16 autocast keeps fp32 norms, one bf16 input cast per linear map, and one bf16 copy of
    the weights for the whole step, however many micro-batches are in flight (gpipe: both):
    `estimate --precision bf16` against activation_mb, within 5%."""
    model = "arch=llama,layers=2,hidden=256,heads=8,kv_heads=2,ffn_hidden=768,vocab=1000"
    cfg = TrainConfig(model=model, seq_len=128, global_batch=4, micro_batch_size=2, steps=1,
                      device="cpu", seed=1, precision="bf16", recompute=recompute,
                      schedule=schedule)
    cfg.resolve(1)
    trainer = Trainer.build(cfg, Comm(ParallelDims(), 0, device=torch.device("cpu")))
    measured = trainer.train_step()["activation_mb"]
    if schedule == "gpipe":   # the planner runs no pipeline schedule on one rank: price directly
        act, softmax, _ = stage_activation_bytes(cfg.spec, 1, 2 * 128, True, recompute, 2,
                                                 inflight=2, last=True, last_inflight=2,
                                                 mixed=True)
        predicted = (act + softmax) / 2**20
        assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
        return
    out = subprocess.run(
        [sys.executable, "-m", "commpipe", "estimate", "--model", model, "--gpus", "1", "--gpu",
         "cpu", "--precision", "bf16", "--global-batch", "4", "--micro-batch-size", "2",
         "--seq-len", "128", "--recompute", recompute, "--schedule", schedule, "--json"],
        capture_output=True, text=True, check=True)
    predicted = json.loads(out.stdout)["activation_gb_per_gpu"] * 1024      # GiB -> MiB
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


# -- ops the host dispatches (commpipe/plan/runtime_ops.py) -----------------------------------------
class _Ops(TorchDispatchMode):
    """Every aten call, by phase: inside autograd's backward, with grad enabled (the forward, and
    the clip's norm), or without (the optimizer). Collective calls (c10d) are not counted:
    they are priced per call (`Efficiency.coll_overhead_s`)."""

    def __init__(self):
        super().__init__()
        self.counts = {"forward": 0, "backward": 0, "no_grad": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            pass
        elif torch._C._current_graph_task_id() != -1:
            self.counts["backward"] += 1
        else:
            self.counts["forward" if torch.is_grad_enabled() else "no_grad"] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(layers: int, microbatches: int, precision: str, dims=None, rank: int = 0,
              seq_len: int = 8) -> dict:
    # a shape the counts were not taken on (they were on hidden 16, 4 tokens, one sequence)
    model = f"arch=llama,layers={layers},hidden=32,heads=4,kv_heads=2,ffn_hidden=48,vocab=40"
    cfg = TrainConfig(model=model, seq_len=seq_len, global_batch=2 * microbatches,
                      micro_batch_size=2, steps=3, device="cpu", seed=0, precision=precision,
                      dims=dims or ParallelDims())
    cfg.resolve(cfg.dims.world_size)
    trainer = Trainer.build(cfg, Comm(cfg.dims, rank, device=torch.device("cpu")))
    trainer.train_step()                         # optimizer state exists from here on
    mode = _Ops()
    with mode:
        trainer.train_step()
    return mode.counts


def _layer_ops(counts: dict) -> tuple[int, int]:
    """(forward, backward) ops per layer and micro-batch: the second difference of steps of 1-2
    layers and 1-2 micro-batches. A forward's ops run with grad, or without it inside an
    autograd Function (CP's attention): both are the forward's (the optimizer's no-grad ops
    do not grow with layers and micro-batches, and cancel)."""
    def diff(phase):
        return counts[2, 2][phase] - counts[1, 2][phase] - counts[2, 1][phase] + counts[1, 1][phase]
    return diff("forward") + diff("no_grad"), diff("backward")


def _parallel_layer_ops(rank: int, world: int, precision: str) -> dict:
    shapes = ((1, 1), (2, 1), (1, 2), (2, 2))
    return {name: _layer_ops({lm: _step_ops(*lm, precision, dims, rank, seq_len=16)
                              for lm in shapes})
            for name, dims in (("cp", ParallelDims(cp=2)), ("tp", ParallelDims(tp=2)))}


def test_context_and_tensor_parallel_layers_dispatch_the_ops_counted():
    """On a rank of cp=2 and of tp=2 (sequence parallel), a layer's ops per micro-batch are
    layer_ops(precision, tp, cp): what CP's attention (two partial attentions and their merge,
    the backward's recompute) and SP's reshapes add to the plain layer's."""
    from dist_harness import spawn

    from commpipe.plan.runtime_ops import layer_ops

    got = spawn(_parallel_layer_ops, 2, "fp32")[0]
    assert got["cp"] == layer_ops("fp32", cp=2) and got["tp"] == layer_ops("fp32", tp=2), got
    assert got["cp"][0] > layer_ops("fp32")[0] + 50     # not the plain layer's count


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_op_counts_match_a_training_step(precision):
    from commpipe.plan.runtime_ops import layer_ops, total_step_ops

    ops = {(n, m): _step_ops(n, m, precision) for n, m in ((1, 1), (2, 1), (1, 2), (2, 2), (3, 3))}
    # per layer and micro-batch: what grows with both (the second difference), per pass
    for i, phase in enumerate(("forward", "backward")):
        per_pass = (ops[2, 2][phase] - ops[1, 2][phase] - ops[2, 1][phase] + ops[1, 1][phase])
        assert per_pass == layer_ops(precision)[i], phase
    # the whole step of a model and batch outside the differences, to 1%
    spec = resolve_model("arch=llama,layers=3,hidden=32,heads=4,kv_heads=2,ffn_hidden=48,vocab=40")
    assert sum(ops[3, 3].values()) == pytest.approx(total_step_ops(spec, 3, precision), rel=0.01)


def test_the_op_time_measurement_divides_by_the_ops_it_runs():
    from commpipe.plan.cpu import OP_STEP_OPS, op_step

    step = op_step("cpu")
    step()
    mode = _Ops()
    with mode:
        step()
    assert sum(mode.counts.values()) == OP_STEP_OPS


def test_host_and_device_compose_as_max_on_a_gpu_and_add_on_a_cpu():
    """Hand-derived: at a host time per op far above any kernel, one GPU's step is its ops times
    that time plus the optimizer's device time; at a negligible one it is the device time alone,
    without the per-layer overhead fitted on Megatron (which the counted ops replace)."""
    from dataclasses import replace

    from commpipe.plan.cluster import default_cluster
    from commpipe.plan.efficiency import MEASURED_GPU
    from commpipe.plan.estimate import estimate
    from commpipe.plan.gpus import resolve_gpu
    from commpipe.plan.layout import Job, Layout
    from commpipe.plan.runtime_ops import HostOps
    from commpipe.plan.timing import stage_costs

    spec = resolve_model("arch=llama,layers=4,hidden=256,heads=4,kv_heads=2,ffn_hidden=512,vocab=512")
    cluster = default_cluster(resolve_gpu("h100"), 1, 1)
    job, lay = Job(4, 256, runtime="commpipe"), Layout(micro_batch_size=1)
    device = stage_costs(spec, lay, job, cluster, replace(MEASURED_GPU, overhead_s=0.0))
    slow = replace(MEASURED_GPU, op_s=1e-3)            # 1 ms an op: host-bound everywhere
    host = stage_costs(spec, lay, job, cluster, slow)
    # forward: 4 layers of 113 ops + the head, loss and embedding's 23; backward 199 and 45
    assert host.f[0] == pytest.approx((4 * 113 + 23) * 1e-3, rel=1e-12)
    assert host.b[0] == pytest.approx((4 * 199 + 45) * 1e-3, rel=1e-12)
    assert host.w == device.w                         # the host's share is priced in I
    est = estimate(spec, lay, job, cluster, slow, detail=False)
    assert est.step_time_s == pytest.approx(4 * (4 * 312 + 68) * 1e-3 + device.optimizer[0], rel=1e-9)
    fast = stage_costs(spec, lay, job, cluster, replace(MEASURED_GPU, op_s=1e-12))
    assert fast.f[0] == pytest.approx(device.f[0], rel=1e-6)
    assert fast.b[0] == pytest.approx(device.b[0], rel=1e-6)
    # between the two: each pass takes the larger of its device and host times
    ops = HostOps(job, cluster.gpu, replace(MEASURED_GPU, op_s=1e-5))
    assert ops.forward(2e-3) == 2e-3 and ops.forward(1e-4) == pytest.approx(113e-5)
    assert ops.backward(3e-4, 1e-4) + 1e-4 == pytest.approx(199e-5)
    assert ops.backward(3e-3, 1e-3) == 3e-3
    # a CPU's one thread issues and computes: the sum, fp32 counts
    cpu = resolve_gpu("name=cpu,tflops=0.1,mem_gb=64")
    on_cpu = HostOps(Job(4, 256, precision="fp32", runtime="commpipe"), cpu,
                     replace(MEASURED_GPU, op_s=1e-5, overhead_s=0.0))
    assert on_cpu.forward(2e-3) == pytest.approx(2e-3 + 102e-5)
    assert on_cpu.backward(3e-4, 1e-4) == pytest.approx(3e-4 + 179e-5)
    # planned for a GPU from a host without one: no op time to measure, the fitted overhead stays
    if not torch.cuda.is_available():
        from commpipe.plan.runtime_ops import with_host_ops

        assert with_host_ops(MEASURED_GPU, job, cluster.gpu) is MEASURED_GPU
