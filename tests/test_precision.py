"""Mixed precision (bf16 autocast) on CPU, so its code paths run without a GPU.

- the deferred weight-gradient GEMM of the I/W split gives autograd's own autocast gradients;
- every loss path (full and vocabulary-parallel, text and caption) takes bf16 logits to an fp32
  loss equal to F.cross_entropy of the same logits in fp32;
- one process: bf16 tracks the fp32 run, ZB-H1's deferred W equals 1F1B exactly, master
  parameters, gradients and optimizer state stay fp32, and each microbatch's loss is the fp32
  loss of its bf16 logits;
- four processes: every schedule with tp and pp tracks the fp32 single-device reference within
  2% per step, with every pipeline message in bf16 and every loss the fp32 loss of its (gathered)
  bf16 logits; also with --recompute full and selective beside the deferred weight gradients of
  ZB-H1 and ZB-V.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.blip import IGNORE, caption_loss_sum
from commpipe.models.llama import cross_entropy_sum
from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.tensor import run_steps, vocab_parallel_ce_steps
from commpipe.parallel.weight_grad import WeightGradStore, enable_weight_grad_split
from commpipe.train.loop import Trainer
from tests.dist_harness import run_jobs
from tests.reference import reference_run
from tests.test_equivalence import make_cfg

MODEL = "arch=llama,layers=8,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,vocab=128"
LOSS_RTOL = 0.02          # bf16 against fp32, per step
FP32_LOSS_RTOL = 1e-5     # a loss against F.cross_entropy of the same logits in fp32: summation
                          # order only (a loss summed in bf16 is off by ~1e-3)


def _vocab_parallel_loss(logits, labels):
    """vocab_parallel_ce_steps on one rank (the whole vocabulary, all-reduces of size 1)."""
    return run_steps(vocab_parallel_ce_steps(logits.flatten(0, -2), labels.flatten(),
                                             Comm(ParallelDims(), 0), 0))


@pytest.mark.parametrize("loss_fn", [cross_entropy_sum, caption_loss_sum, _vocab_parallel_loss],
                         ids=["full", "caption", "vocab-parallel"])
def test_loss_of_bf16_logits_is_computed_in_fp32(loss_fn):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 48, 128)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 128, (2, 48))
    if loss_fn is caption_loss_sum:
        labels[:, -5:] = IGNORE
    loss = loss_fn(logits, labels)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.detach().double().flatten(0, -2), labels.flatten(),
                          reduction="sum", ignore_index=IGNORE)
    assert abs(loss.item() - ref.item()) <= FP32_LOSS_RTOL * ref.item(), (loss.item(), ref.item())
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16          # the gradient goes back in the logits' dtype


def check_loss_is_fp32_of_logits(trainer) -> None:
    """Not a bug: wraps the runtime's loss so that every call logs (logits dtype, loss dtype,
    loss, fp32 cross-entropy of the same logits); a vocabulary shard is all-gathered over tp
    first, so the reference sees the full logits."""
    runtime, comm = trainer.runtime, trainer.comm
    loss_fn, log = runtime.loss_fn, []
    trainer.test_log = log

    def record(logits, labels, loss):
        x = logits.detach().flatten(0, -2).double()                     # [tokens, vocab/tp]
        x = comm.all_gather(x.t().contiguous(), "tp").t()               # [tokens, vocab]
        ref = F.cross_entropy(x, labels.flatten(), reduction="sum")
        log.append((logits.dtype, loss.dtype, loss.item(), ref.item()))

    def checked(logits, labels):
        loss = loss_fn(logits, labels)
        record(logits, labels, loss)
        return loss

    if hasattr(loss_fn, "steps"):
        def steps(logits, labels):
            loss = yield from loss_fn.steps(logits, labels)
            record(logits, labels, loss)
            return loss
        checked.steps = steps
    runtime.loss_fn = checked


def assert_losses_fp32_of_bf16_logits(log: list, label: str) -> None:
    assert log, f"{label}: no loss computed"
    for logits_dtype, loss_dtype, loss, ref in log:
        assert logits_dtype == torch.bfloat16, f"{label}: logits in {logits_dtype}"
        assert loss_dtype == torch.float32, f"{label}: loss in {loss_dtype}"
        assert abs(loss - ref) <= FP32_LOSS_RTOL * ref, f"{label}: loss {loss} against fp32 {ref}"


def test_deferred_weight_grad_under_autocast_matches_autograd():
    torch.manual_seed(0)
    split = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    plain = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    plain.load_state_dict(split.state_dict())
    store = WeightGradStore()
    enable_weight_grad_split(split, store)
    x = torch.randn(3, 5, 8)
    for module, defer in ((split, True), (plain, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        assert y.dtype == torch.bfloat16
        store.deferring = defer
        y.float().square().sum().backward()
        store.deferring = False
    assert all(p.grad is None for p in split.parameters())     # I only: W still pending
    WeightGradStore.flush(store.take())
    for a, b in zip(split.parameters(), plain.parameters()):
        assert a.grad.dtype == torch.float32                    # the master weight's dtype
        # bit for bit: the same bf16 GEMM autograd runs (grad_out^T x), cast to fp32 alike
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def _one_process(schedule: str, precision: str):
    cfg = make_cfg(ParallelDims(), schedule, model=MODEL, precision=precision)
    cfg.resolve(1)
    trainer = Trainer.build(cfg, Comm(cfg.dims, 0))
    trainer.capture_grads = True
    check_loss_is_fp32_of_logits(trainer)
    records = [trainer.train_step() for _ in range(cfg.steps)]
    return trainer, [r["loss"] for r in records]


def test_one_process_bf16_tracks_fp32_and_keeps_fp32_master_state():
    _, fp32 = _one_process("1f1b", "fp32")
    trainer, bf16 = _one_process("1f1b", "bf16")
    zb, zb_bf16 = _one_process("zbh1", "bf16")        # pp=1 ZB-H1: every W deferred
    assert trainer.runtime.autocast_dtype == torch.bfloat16
    for a, b in zip(bf16, fp32):
        assert abs(a - b) <= LOSS_RTOL * abs(b)
    assert bf16 != fp32, "bf16 losses equal fp32 to the last bit: autocast did not run"
    assert zb_bf16 == bf16
    for t in (trainer, zb):
        assert_losses_fp32_of_bf16_logits(t.test_log, "one process")
    for name, g in zb.last_grads.items():
        # bit for bit under bf16: W's GEMMs are autograd's, and their fp32 results are summed
        # over micro-batches by the same add as autograd's (the fused addmm_ is fp32's alone)
        torch.testing.assert_close(g, trainer.last_grads[name], rtol=0, atol=0)
    for t in (trainer, zb):
        assert {p.dtype for p in t.params} == {torch.float32}
        assert {g.dtype for g in t.last_grads.values()} == {torch.float32}
        states = [v for s in t.optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert states and {v.dtype for v in states} == {torch.float32}


def test_precision_flag_is_checked_before_training():
    cfg = make_cfg(ParallelDims(), "1f1b", device="cpu")
    assert cfg.resolve(1).precision == "fp32"               # the CPU default
    with pytest.raises(ValueError, match="use fp32 or bf16"):
        make_cfg(ParallelDims(), "1f1b", precision="fp16").resolve(1)


# -- four processes: every schedule, tp and pp -------------------------------------------------
def check_pp_messages_are_bf16(trainer) -> None:
    """Not a bug: wraps the chokepoint so that a pipeline message in any dtype but bf16 fails
    the run (receive buffers and sent activations/gradients alike)."""
    comm = trainer.comm
    for name in ("isend", "irecv"):
        op = getattr(comm, name)

        def checked(tensor, peer, dim="pp", tag=0, _op=op, _name=name):
            if dim == "pp" and tensor.dtype != torch.bfloat16:
                raise AssertionError(f"pipeline {_name} of a {tensor.dtype} tensor under bf16")
            return _op(tensor, peer, dim, tag)

        setattr(comm, name, checked)


JOBS = [(ParallelDims(pp=2, tp=2), name, v, "none") for name, v in
        (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 1))]
JOBS += [(ParallelDims(pp=4), "zbv", 1, "none")]
# recomputation under bf16 autocast, beside the deferred weight gradients of zero-bubble schedules
JOBS += [(ParallelDims(pp=2, tp=2), "zbh1", 1, "full"), (ParallelDims(pp=2, tp=2), "zbv", 1, "selective")]


@functools.cache
def bf16_results() -> dict:
    jobs = [(f"{d}-{name}-v{v}-{rc}", make_cfg(d, name, vpp=v, model=MODEL, precision="bf16",
                                               recompute=rc),
             check_pp_messages_are_bf16, check_loss_is_fp32_of_logits) for d, name, v, rc in JOBS]
    return run_jobs(4, jobs)


def test_bf16_schedules_track_fp32_reference():
    reference = reference_run(make_cfg(ParallelDims(), "1f1b", model=MODEL))
    ref = torch.tensor(reference["losses"], dtype=torch.float64)
    for key, got in bf16_results().items():
        losses = torch.tensor(got["losses"], dtype=torch.float64)
        torch.testing.assert_close(losses, ref, rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m, k=key: f"{k} bf16 loss: {m}")
        assert not torch.equal(losses, ref), f"{key}: bf16 losses equal fp32 exactly"
        # the first step's gradient is bf16 rounding alone (later ones also carry the rounding
        # of earlier updates, which Adam amplifies where gradients are small)
        first = got["grad_norms"][0]
        assert abs(first - reference["grad_norms"][0]) <= 0.01 * reference["grad_norms"][0], key
        assert {p.dtype for p in got["params"].values()} == {torch.float32}, key
        assert {g.dtype for g in got["grads"].values()} == {torch.float32}, key
        logs = [log for log in got["logs"] if log]          # the last stage's ranks
        assert logs, key
        for log in logs:
            assert_losses_fp32_of_bf16_logits(log, key)
