"""Sequence parallelism, overlap (TP, DP, CP, pipeline prefetch), recomputation and ZeRO-1 as a
distributed optimizer compute what one device computes: loss and pre-clip gradient norm of each
step, the last step's pre-clip gradients and the final parameters (fp32, CPU, gloo), every
layout with overlap on and with `--no-overlap`. Measured activation memory falls from none to
selective to full recomputation.

One launch per world size; the checks are tests/test_equivalence.py's, shown to fail on a planted
bug (DP buckets issued before their gradients are final). The chunked forward all-gather/GEMM
overlap (`tp_forward_overlap`) is run on and off whatever its default, with the I/W split and
recomputation, in bf16 against the unchunked path, and observed to overlap in a real run.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from commpipe.parallel.dims import ParallelDims
from tests.dist_harness import run_jobs
from tests.reference import reference_run
from tests.test_equivalence import GLOBAL_BATCH, SEQ, STEPS, check_against, check_grads, make_cfg

LAYOUTS = {  # world -> name: (dims, schedule, options)
    4: {
        "tp2pp2-sp-full": (ParallelDims(tp=2, pp=2), "1f1b", {"recompute": "full"}),
        "tp2dp2-selective": (ParallelDims(tp=2, dp=2), "1f1b", {"recompute": "selective"}),
        "tp2pp2-zbv-selective": (ParallelDims(tp=2, pp=2), "zbv", {"recompute": "selective"}),
        "cp2dp2-zero1-full": (ParallelDims(cp=2, dp=2), "1f1b",
                              {"recompute": "full", "zero1": True}),
        "tp2dp2-zero1-zbh1": (ParallelDims(tp=2, dp=2), "zbh1", {"zero1": True}),
        "tp2pp2-nosp": (ParallelDims(tp=2, pp=2), "1f1b", {"sequence_parallel": False}),
        "tp2pp2-sp-none": (ParallelDims(tp=2, pp=2), "1f1b", {}),
        "tp2pp2-sp-selective": (ParallelDims(tp=2, pp=2), "1f1b", {"recompute": "selective"}),
    },
    8: {
        "tp2cp2pp2": (ParallelDims(tp=2, cp=2, pp=2), "1f1b", {}),
    },
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_cfg(ParallelDims(), "1f1b"))


def _cfg(dims, schedule, options, overlap):
    options = dict(options)
    zero1 = options.pop("zero1", False)
    # small buckets: several per stage, issued one by one during the backward
    return make_cfg(dims, schedule, zero1=zero1, overlap=overlap, dp_bucket_mb=0.05, **options)


def plant_early_buckets(trainer) -> None:
    """Gradients counted final after the first micro-batch: buckets go out too early."""
    trainer.reducer.expected = 1


class _GatherLog:
    """A comm observer: logs when each TP all-gather is issued and when its wait returned."""

    def __init__(self, log: list):
        self.log = log

    def begin(self, call):
        if call.dim == "tp" and call.op == "all_gather":
            self.log.append(("issue",))
            return call
        return None

    def end(self, ctx, call):
        if ctx is not None:
            self.log.append(("waited",))


class _MatmulLog(TorchDispatchMode):
    """Logs the row count of every matrix multiply the kernels actually run."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.log.append(("mm", args[-2].shape[0]))
        return func(*args, **(kwargs or {}))


def probe_forward_gathers(trainer) -> None:
    """Not a bug: records, in order, the TP all-gathers' issue and wait and every GEMM run."""
    log = trainer.test_log = []
    trainer.comm.observers.append(_GatherLog(log))
    step = trainer.train_step

    def logged():
        with _MatmulLog(log):
            return step()

    trainer.train_step = logged


def gemms_in_flight(log: list) -> list[list[int]]:
    """Per TP all-gather, the row counts of the GEMMs run between its issue and its wait."""
    out, current = [], None
    for event in log:
        if event[0] == "issue":
            current = []
        elif event[0] == "waited":
            out.append(current)
            current = None
        elif current is not None:
            current.append(event[1])
    return out


PROBED = ParallelDims(tp=2, dp=2)
# the chunked forward all-gather (off by default) with the I/W split and recomputation; the
# probe runs below check it on and off with 1F1B
FWDCHUNK = {
    "tp2pp2-zbv-full-fwdchunk": (ParallelDims(tp=2, pp=2), "zbv",
                                 {"recompute": "full", "tp_forward_overlap": True}),
    "tp2dp2-zbh1-selective-fwdchunk": (ParallelDims(tp=2, dp=2), "zbh1",
                                       {"recompute": "selective", "tp_forward_overlap": True}),
}


@functools.cache
def results_of(world: int) -> dict:
    jobs = [(f"{name}-{'overlap' if ov else 'no-overlap'}", _cfg(d, s, o, ov))
            for name, (d, s, o) in LAYOUTS[world].items() for ov in (True, False)]
    if world == 4:
        jobs.append(("planted-early-buckets", _cfg(ParallelDims(tp=2, dp=2), "1f1b", {}, True),
                     plant_early_buckets))
        jobs += [(name, _cfg(d, s, o, True)) for name, (d, s, o) in FWDCHUNK.items()]
        for chunk in (True, False):
            opts = {"tp_forward_overlap": chunk}
            jobs.append((f"probe-fwdchunk-{chunk}", _cfg(PROBED, "1f1b", opts, True),
                         probe_forward_gathers))
            # bf16 autocast: chunked against unchunked (one device rounds differently)
            jobs.append((f"bf16-fwdchunk-{chunk}",
                         _cfg(ParallelDims(tp=2, pp=2), "zbh1", {**opts, "precision": "bf16"}, True)))
    return run_jobs(world, jobs)


@pytest.mark.parametrize("world", [4, 8])
def test_features_match_single_device(world, reference):
    for key, got in results_of(world).items():
        if not key.startswith(("planted-", "bf16-")):
            check_against(reference, got, key)


def test_chunked_forward_gather_overlaps_own_rows():
    """In a real tp2 dp2 run, each forward all-gather before the column-parallel Linears has
    the GEMMs over the rank's own rows (micro-batch x seq/tp of them) running while it travels:
    wq, wk, wv; w1, w3; the head. Unchunked, nothing runs between issue and wait."""
    got = results_of(4)
    rows = 1 * SEQ // PROBED.tp                                  # micro-batch size 1
    layers, microbatches = 4, GLOBAL_BATCH // PROBED.dp          # tiny: 4 layers
    for log in got["probe-fwdchunk-True"]["logs"]:
        inside = [g for g in gemms_in_flight(log) if g]
        assert len(inside) == STEPS * microbatches * (2 * layers + 1), len(inside)
        assert all(set(g) == {rows} for g in inside), inside[:3]
        assert sorted({len(g) for g in inside}) == [1, 2, 3]     # head; w1, w3; wq, wk, wv
    for log in got["probe-fwdchunk-False"]["logs"]:
        gathers = gemms_in_flight(log)
        assert gathers and not any(gathers), "unchunked: nothing runs during the gather"


def test_chunked_forward_bf16_matches_unchunked():
    got = results_of(4)
    on, off = got["bf16-fwdchunk-True"], got["bf16-fwdchunk-False"]
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]),
                               rtol=1e-5, atol=0)
    for name, grad in off["grads"].items():
        torch.testing.assert_close(on["grads"][name], grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"bf16 grad {n}: {m}")
    for name, param in off["params"].items():
        torch.testing.assert_close(on["params"][name], param, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"bf16 param {n}: {m}")


def test_planted_early_buckets_are_caught(reference):
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, results_of(4)["planted-early-buckets"], "early buckets")


def test_estimate_predicts_activation_mb():
    """`commpipe estimate --gpu cpu --precision fp32 --json` prices commpipe's own saved tensors:
    activation_gb_per_gpu within 20% of the activation_mb the tp2 pp2 runs measured."""
    import json
    import subprocess
    import sys

    got = results_of(4)
    for mode in ("none", "selective", "full"):
        out = subprocess.run(
            [sys.executable, "-m", "commpipe", "estimate", "--model", "tiny", "--tp", "2", "--pp",
             "2", "--gpus", "4", "--gpu", "cpu", "--precision", "fp32", "--global-batch",
             str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--recompute", mode, "--json"],
            capture_output=True, text=True, check=True)
        predicted = json.loads(out.stdout)["activation_gb_per_gpu"] * 1024    # GiB -> MiB
        measured = max(got[f"tp2pp2-sp-{mode}-overlap"]["activation_mb"])
        assert abs(predicted - measured) <= 0.2 * measured, (mode, predicted, measured)


def test_activation_memory_falls_with_recomputation():
    got = results_of(4)
    mb = {mode: max(got[f"tp2pp2-sp-{mode}-overlap"]["activation_mb"])
          for mode in ("none", "selective", "full")}
    assert mb["none"] > mb["selective"] > mb["full"] > 0, mb
    # overlap changes when things happen, not what the backward holds
    assert max(got["tp2pp2-sp-none-no-overlap"]["activation_mb"]) == mb["none"]
    # sequence parallelism shards the norms' and residuals' activations
    assert max(got["tp2pp2-nosp-overlap"]["activation_mb"]) > mb["none"]
