"""--emulate-device: compute operators leave the host idle for (factor - 1) x their time, as a
GPU's kernels do; collectives are not stretched; values are untouched."""

from __future__ import annotations

import json
import time

import pytest
import torch

from commpipe.runtime.device_time import MIN_SLEEP_S, DeviceTime


class _Op:
    """An operator stand-in: `namespace` as torch's OpOverload has it, taking `seconds`."""

    def __init__(self, namespace: str, seconds: float):
        self.namespace, self.seconds = namespace, seconds

    def __call__(self, *args, **kwargs):
        if self.seconds:
            time.sleep(self.seconds)
        return "out"


def test_a_compute_operator_leaves_the_host_idle_for_the_rest_of_its_device_time():
    mode = DeviceTime(3.0)
    t0 = time.perf_counter()
    assert mode.__torch_dispatch__(_Op("aten", 0.01), ()) == "out"
    wall = time.perf_counter() - t0
    assert mode.op_s >= 0.01
    # owed 2 x its time, paid in one sleep (at least what was asked; an overshoot is owed back)
    assert mode.idle_s >= 2 * mode.op_s - 1e-9
    assert wall >= mode.op_s + mode.idle_s - 1e-6


def test_collectives_and_short_operators_are_not_slept_on_one_by_one():
    mode = DeviceTime(3.0)
    mode.__torch_dispatch__(_Op("c10d", 0.01), ())           # a collective's host time
    assert mode.op_s == 0.0 and mode.idle_s == 0.0
    mode.__torch_dispatch__(_Op("aten", 0.0), ())            # owed; slept only from MIN_SLEEP_S
    assert mode.idle_s + mode._owed == pytest.approx(2 * mode.op_s, rel=1e-9)
    if 2 * mode.op_s < MIN_SLEEP_S:                          # (unless the host paused it 1 ms)
        assert mode.idle_s == 0.0


def test_real_operators_are_stretched_and_values_are_the_same():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    ref = (a @ b).tanh().sum()
    mode = DeviceTime(2.0)
    with mode:
        for _ in range(20):
            got = (a @ b).tanh().sum()
    assert torch.equal(got, ref)
    assert mode.op_s > 0 and mode.idle_s + mode._owed == pytest.approx(mode.op_s, rel=1e-9)


def test_training_under_an_emulated_device_gives_the_same_losses(tmp_path, capsys):
    from commpipe.cli import main

    runs = {}
    for name, extra in (("plain", []), ("emulated", ["--emulate-device", "2"])):
        out = tmp_path / name
        assert main(["train", "--steps", "3", "--seq-len", "32", "--global-batch", "2",
                     "--device", "cpu", "--out", str(out), *extra]) == 0
        runs[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        said = capsys.readouterr().out
        assert ("--emulate-device 2: every compute operator takes 2x" in said) == bool(extra)
    assert [r["loss"] for r in runs["emulated"]] == [r["loss"] for r in runs["plain"]]
    assert [r["grad_norm"] for r in runs["emulated"]] == [r["grad_norm"] for r in runs["plain"]]
    saved = json.loads((tmp_path / "emulated" / "config.json").read_text())
    assert saved["emulate_device"] == 2.0
    # plan --calibrate fits this host's speed: an emulated device's step times are left out
    from types import SimpleNamespace

    from commpipe.plan.calibrate import job_defaults, point_from_run

    defaults = job_defaults(SimpleNamespace())
    assert point_from_run(tmp_path / "plain", defaults) is not None
    assert point_from_run(tmp_path / "emulated", defaults) is None


def test_a_factor_below_one_is_refused_with_what_to_change(capsys):
    from commpipe.cli import main

    for bad in ("0.5", "nan", "inf"):
        assert main(["train", "--steps", "1", "--device", "cpu", "--emulate-device", bad]) != 0
        err = capsys.readouterr().err
        assert f"--emulate-device {float(bad)}" in err and "finite factor >= 1" in err


def test_the_mode_is_taken_by_every_step_of_a_trainer():
    """Trainer.train_step itself runs under the mode: the loop, the controller's trials and the
    adaptive demo's oracle all step through it."""
    from commpipe.train.config import TrainConfig
    from commpipe.train.loop import Trainer

    cfg = TrainConfig(model="tiny", steps=2, seq_len=16, global_batch=2, device="cpu",
                      emulate_device=2.0)
    cfg.resolve(1)
    trainer = Trainer.build(cfg)
    trainer.train_step()
    assert isinstance(trainer.device_time, DeviceTime) and trainer.device_time.op_s > 0
    seen = trainer.device_time.op_s
    trainer.train_step()
    assert trainer.device_time.op_s > seen
