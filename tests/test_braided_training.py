"""Braided schedules (stp, dualpipev) train exactly as one device does, unit by unit.

    python -m pytest tests/test_braided_training.py -q

A braid runs its two passes step by step, alternating (commpipe/runtime/units.py); with tensor
parallelism each step's collective is issued asynchronously and waited by the next step of the
same pass. Checked against the single-process reference (loss, pre-clip gradients, parameters):
pp 2 here (pp 4 under strict order in tests/test_strict_order.py), tp 2 with and without
sequence parallelism and overlap, dp 2, cp 2, selective recomputation; validation (forward only,
unit by unit) after every training step equals the single-device one; under bf16 autocast stp
equals the whole-stage zbv bit for bit. A probe in a real run shows
the collectives in flight while the other pass computes; a planted bug (an input-gradient
all-reduce dropped) shows the comparison fails.
"""

from __future__ import annotations

import functools

from commpipe.parallel.dims import ParallelDims
from tests.dist_harness import run_jobs
from tests.reference import reference_run
from tests.test_equivalence import check_against, make_cfg

MODEL = "arch=llama,layers=8,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,vocab=128"


def cfg(dims, schedule, **kw):
    return make_cfg(dims, schedule, model=MODEL, **kw)


def probe_overlap(trainer) -> None:
    """Record, on this rank, when each asynchronous TP collective of a unit edge is issued and
    waited, and which pass of a braid each step belongs to (trainer.test_log)."""
    from commpipe.runtime import step_run, units

    log = trainer.test_log = []
    issue = units._issue

    def logged_issue(tp, kind, backward, t):
        out = issue(tp, kind, backward, t)
        if isinstance(out, units._InFlight):
            n = len(log)
            log.append(("issue", n))
            wait = out.handle.wait

            def logged_wait():
                log.append(("wait", n))
                return wait()
            out.handle.wait = logged_wait
        return out

    def logged_alternate(runs):
        runs = list(runs)
        tagged = []
        for k, r in enumerate(runs):
            def gen(r=r, k=k):
                for unit in r:
                    log.append(("step", k, len(runs)))
                    yield unit
            tagged.append(gen())
        return alternate(tagged)

    alternate = step_run._alternate
    units._issue = logged_issue
    step_run._alternate = logged_alternate


def probe_roots(trainer) -> None:
    """After each forward pass, record the bytes its steps' backward roots hold beyond the
    storages the next steps read, the stage output (which the loss or the send reads) aside
    (trainer.test_log: (bytes, number of roots))."""
    from commpipe.runtime import units

    log = trainer.test_log = []
    forward = units.UnitPass.forward_steps

    def logged(self):
        yield from forward(self)
        if self.grad:
            read = {t.untyped_storage().data_ptr() for st in self.steps for t in st.leaves}
            extra = sum(r.untyped_storage().nbytes() for st in self.steps for r in st.results
                        if r.untyped_storage().data_ptr() not in read and st.outs != ("out",))
            log.append((extra, sum(len(st.results) for st in self.steps if st.outs != ("out",))))
    units.UnitPass.forward_steps = logged


def plant_dropped_allreduce(trainer) -> None:
    """A deliberate bug: the backward all-reduce of the input gradient before attention and MLP
    (the adjoint of `f`) is skipped, so each TP rank keeps its partial gradient."""
    from commpipe.runtime import units

    issue = units._issue

    def buggy(tp, kind, backward, t):
        if backward and kind == units.ENTER:
            return t
        return issue(tp, kind, backward, t)
    units._issue = buggy


def validate_each_step(trainer) -> None:
    """Validation loss after every training step (trainer.test_log holds the last): the
    forward-only runner shares the stages with the training runner, so training after it checks
    that it leaves the unit edges' collectives as training needs them."""
    step, log = trainer.train_step, []
    trainer.test_log = log

    def train_then_validate():
        record = step()
        log[:] = [trainer.evaluate()]
        return record
    trainer.train_step = train_then_validate


def reference_validation() -> float:
    """The single-device validation loss with the reference's final parameters."""
    import torch
    import torch.nn.functional as F

    from commpipe.models.llama import build_model
    from commpipe.train.source import make_source

    c = cfg(ParallelDims(), "1f1b", eval_batches=EVAL_BATCHES)
    c.resolve(1)
    model = build_model(c.spec, c.seed)
    model.load_state_dict(reference()["params"])
    source = make_source(c, c.spec)
    with torch.no_grad():
        losses = [F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
                  for inputs, labels in source.validation(c.global_batch, 0, 1, EVAL_BATCHES)]
    return sum(losses) / len(losses)


EVAL_BATCHES = 2


@functools.cache
def results(world: int) -> dict:
    if world == 2:
        jobs = [("pp2-stp", cfg(ParallelDims(pp=2), "stp")),
                ("pp2-dualpipev", cfg(ParallelDims(pp=2), "dualpipev")),
                ("tp2-stp-probed", cfg(ParallelDims(tp=2), "stp", sequence_parallel=False),
                 probe_overlap)]
        # bf16 autocast: unit by unit computes what the whole-stage zbv computes on the same
        # stages (same V split, same I/W split), to the bit
        jobs += [(f"tp2-{name}-bf16", cfg(ParallelDims(tp=2), name, precision="bf16"), probe_roots)
                 for name in ("stp",)]
        jobs.append(("tp2-zbv-bf16", cfg(ParallelDims(tp=2), "zbv", precision="bf16")))
        # the probe patches module functions in the worker processes: the planted bug runs last
        jobs.append(("planted", cfg(ParallelDims(tp=2), "stp", sequence_parallel=False),
                     plant_dropped_allreduce))
        return run_jobs(2, jobs)
    jobs = [("tp2pp2-stp", cfg(ParallelDims(tp=2, pp=2), "stp", eval_batches=EVAL_BATCHES),
             validate_each_step),
            ("tp2pp2-dualpipev-selective", cfg(ParallelDims(tp=2, pp=2), "dualpipev",
                                                recompute="selective")),
            ("tp2pp2-stp-selective-nosp-nooverlap",
             cfg(ParallelDims(tp=2, pp=2), "stp", recompute="selective", sequence_parallel=False,
                 overlap=False)),
            ("pp2dp2-stp", cfg(ParallelDims(pp=2, dp=2), "stp")),
            ("pp2dp2-dualpipev", cfg(ParallelDims(pp=2, dp=2), "dualpipev")),
            # context parallelism: the K/V exchange runs inside the attention unit
            ("cp2pp2-dualpipev", cfg(ParallelDims(cp=2, pp=2), "dualpipev",
                                     eval_batches=EVAL_BATCHES), validate_each_step)]
    return run_jobs(4, jobs)


@functools.cache
def reference():
    return reference_run(cfg(ParallelDims(), "1f1b"))


def test_braided_schedules_match_single_device_pp2():
    for key, got in results(2).items():
        if key not in ("planted", "tp2-stp-bf16", "tp2-zbv-bf16"):
            check_against(reference(), got, key)


def test_braided_schedules_match_single_device_tp_dp_recompute():
    for key, got in results(4).items():
        check_against(reference(), got, key)


def test_bf16_unit_by_unit_equals_whole_stages_bitwise():
    import torch

    got, want = results(2)["tp2-stp-bf16"], results(2)["tp2-zbv-bf16"]
    assert got["losses"] == want["losses"] and got["grad_norms"] == want["grad_norms"]
    for name, grad in want["grads"].items():
        assert torch.equal(got["grads"][name], grad), name
        assert torch.equal(got["params"][name], want["params"][name]), name


def test_validation_runs_unit_by_unit_between_training_steps():
    # tp 2 (the unit edges' collectives) and cp 2, validated after every step of 3: the last
    # validation loss is the single-device one of the reference's final parameters
    want = reference_validation()
    for key in ("tp2pp2-stp", "cp2pp2-dualpipev"):
        got = [log for log in results(4)[key]["logs"] if log]
        assert got and all(abs(v[0] - want) <= 1e-5 * want for v in got), (key, got, want)


def test_dropped_input_gradient_allreduce_is_caught():
    import pytest

    with pytest.raises(AssertionError):
        check_against(reference(), results(2)["planted"], "planted")


def test_tp_collectives_are_in_flight_while_the_other_pass_computes():
    # the probe logs a step after it ran, so the issues and waits logged before a step belong
    # to it; steps are (index in log order, braid pass or None outside braids)
    steps, pending, issued, waited = [], [], {}, {}
    for event in results(2)["tp2-stp-probed"]["logs"][0]:
        if event[0] != "step":
            pending.append(event)
            continue
        steps.append(event[1] if event[2] == 2 else None)
        for kind, n in pending:
            (issued if kind == "issue" else waited)[n] = len(steps) - 1
        pending = []
    in_braids = [n for n, i in issued.items() if steps[i] is not None and n in waited]
    hidden = [n for n in in_braids
              if any(p not in (None, steps[issued[n]]) for p in steps[issued[n] + 1:waited[n]])]
    assert len(in_braids) >= 8, len(in_braids)
    # stp at pp=1 braids every steady-state forward with an input gradient: the collectives a
    # braid's step issues are waited for only after a step of the other pass has run
    assert len(hidden) >= 0.75 * len(in_braids), (len(hidden), len(in_braids))


def test_backward_roots_do_not_keep_full_sequence_partials():
    # a step's output that went through a collective is kept only as its backward's root: once
    # the collective has read it, its values are freed (the row-parallel partial sums span the
    # whole sequence with sequence parallelism; the whole-stage path never keeps them)
    log = results(2)["tp2-stp-bf16"]["logs"][0]
    # at most one element (a freed root keeps a 1-element storage for its shape) per root
    assert log and all(extra <= 4 * roots for extra, roots in log), log[:3]
