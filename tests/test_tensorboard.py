"""`commpipe train --tensorboard`: the event files hold metrics.jsonl's values step for step, the
monitor's bandwidth per dimension and link class, and the adaptive controller's records; read
back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from commpipe.train import cli as train_cli
from commpipe.train.tensorboard import SCALARS, TensorBoardLog

ROOT = Path(__file__).resolve().parents[1]


def accumulator(folder: Path):
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = ea_mod.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def scalars(ea, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in ea.Scalars(tag)}


def texts(ea, tag: str) -> list[tuple[int, str]]:
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in ea.Tensors(f"{tag}/text_summary")]


@pytest.mark.slow
def test_scalars_equal_metrics_and_links(tmp_path):
    """PP2 on two torchrun ranks with every call timed (set in a job config file): rank 1 (the
    last stage) writes the events, rank 0 the links; every step's loss, LR, step time and
    TFLOP/s equal metrics.jsonl and bandwidth/pp/intra_node equals the median of that step's PP
    links in links.jsonl (all written at close, so read after the closing barrier)."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    # the layout and the monitor from a job file that each rank reads, the rest as flags
    job = tmp_path / "job.toml"
    job.write_text('[parallelism]\npp = 2\n[training]\nsteps = 5\n[monitor]\n'
                   'comm-monitor = "all"\ntensorboard = true\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "--", "commpipe", "train", "--config", str(job), "--seq-len", "16",
           "--global-batch", "4", "--steps", "3", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2] and metrics[0]["pp"] == 2
    ea = accumulator(out / "tensorboard")
    for key in ("loss", "lr", "step_time_s", "tflops_per_gpu", "tokens_per_s", "grad_norm"):
        got = scalars(ea, SCALARS[key])
        assert got == {m["step"]: pytest.approx(m[key], rel=1e-6) for m in metrics}, key
    # the reference: each step's PP links (0->1 activations, 1->0 gradients) as the monitor
    # joined them, their receivers' per-message bandwidth
    links = [json.loads(x) for x in (out / "monitor" / "links.jsonl").read_text().splitlines()]
    want = {}
    for step in (0, 1, 2):
        pp = [r["bandwidth_gbps"] for r in links if r["step"] == step and r["kind"] == "p2p"
              and r["dim"] == "pp" and r["matched"] and r["bandwidth_gbps"]]
        assert len(pp) == 2
        assert {r["link_class"] for r in links if r["dim"] == "pp"} == {"intra_node"}
        want[step] = pytest.approx(statistics.median(pp), rel=1e-6)
    assert scalars(ea, "bandwidth/pp/intra_node") == want
    assert not any(t.startswith("bandwidth/") and t != "bandwidth/pp/intra_node"
                   for t in ea.Tags()["scalars"])


DECISIONS = [   # records as commpipe.adapt.controller writes them to adapt.jsonl
    {"step": 14, "action": "switch", "kind": "resplit",
     "detections": [{"kind": "compute", "key": "rank 1", "baseline": 10.0, "current": 40.0,
                     "shift": 3.0, "onset_step": 10, "step": 14}],
     "from": {"name": "pp2 [2,2]"}, "to": {"name": "pp2 [3,1]"}, "predicted_current_ms": 80.0,
     "predicted_best_ms": 50.0, "predicted_saving_s": 2.5, "switch_cost_s": 0.3,
     "reason": "saves 2.5 s over 86 steps"},
    {"step": 19, "action": "settle", "to": {"name": "pp2 [3,1]"}, "measured_ms": 52.5,
     "reason": "fastest measured"},
]


def test_adaptive_records_become_text(tmp_path):
    pytest.importorskip("tensorboard")
    board = TensorBoardLog(tmp_path)
    logger = SimpleNamespace(is_logger=True)
    board.log_step(logger, {"step": 14, "loss": 3.0}, DECISIONS[:1])
    board.log_step(logger, {"step": 15, "loss": 2.5}, DECISIONS[:1])   # written once
    board.close(None, DECISIONS)                                        # the last step's too
    ea = accumulator(tmp_path / "tensorboard")
    got = dict(texts(ea, "adapt"))
    assert [step for step, _ in texts(ea, "adapt")] == [14, 19]     # each record once
    assert got[14] == ("switch; compute rank 1: 10 -> 40 ms (+300%); pp2 [2,2] -> pp2 [3,1]; "
                       "kind resplit; predicted_current_ms 80 ms; predicted_best_ms 50 ms; "
                       "predicted_saving_s 2.5 s; switch_cost_s 0.3 s; "
                       "reason saves 2.5 s over 86 steps")
    assert got[19] == "settle; - -> pp2 [3,1]; measured_ms 52.5 ms; reason fastest measured"
    assert scalars(ea, "train/loss") == {14: 3.0, 15: 2.5}


def test_only_the_logging_rank_writes(tmp_path):
    pytest.importorskip("tensorboard")
    board = TensorBoardLog(tmp_path)
    board.log_step(SimpleNamespace(is_logger=False), {"step": 0, "loss": 3.0}, DECISIONS[:1])
    board.close(None, DECISIONS[:1])
    assert not (tmp_path / "tensorboard").exists()


def _config(*flags: str):
    import argparse

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return train_cli.config_from_args(parser.parse_args(list(flags)))


def test_fails_early_without_out_or_package(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--tensorboard writes into OUT/tensorboard; give --out DIR"):
        _config("--tensorboard").resolve(1)
    # a module set to None in sys.modules is how Python marks it unavailable (find_spec: None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ValueError, match="needs the tensorboard package: pip install tensorboard"):
        _config("--tensorboard", "--out", str(tmp_path)).resolve(1)
