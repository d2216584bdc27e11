"""`commpipe train --model blip-tiny` end to end on one process: 30 steps on a synthetic
COCO-format folder reduce the caption loss clearly; a missing image is named before any process
group starts; synthetic image-caption data without --data.

    python -m pytest -q tests/test_blip_train.py
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from commpipe.cli import main
from tests.test_coco import write_coco


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_train_blip_on_coco_folder_learns(tmp_path):
    coco = write_coco(tmp_path / "coco")
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--model", "blip-tiny", "--data", str(coco), "--vocab-size", "300",
                     "--steps", "30", "--global-batch", "8", "--micro-batch-size", "4",
                     "--lr", "4e-3", "--min-lr", "1e-3", "--warmup", "2", "--eval-every", "30",
                     "--eval-batches", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    assert len(losses) == 30 and losses[0] > 5.0, losses
    assert sum(losses[-5:]) / 5 < 0.25 * losses[0], losses
    assert recs[-1]["val_loss"] < 0.5 * losses[0], recs[-1]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["spec"]["arch"] == "blip" and cfg["spec"]["vocab"] == 320   # 300 padded to 64s


def test_missing_image_is_named_before_processes_start(tmp_path, monkeypatch, capsys):
    coco = write_coco(tmp_path / "coco")
    gone = sorted((coco / "train2017").iterdir())[3]
    gone.unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")     # as under torchrun
    assert main(["train", "--model", "blip-tiny", "--data", str(coco), "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert gone.name in err and "missing" in err, err
    assert not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_train_blip_synthetic_with_auto_split(tmp_path, capsys):
    """No --data: synthetic image-caption pairs; --stage-layers auto on one process (pp=1)
    keeps every layer on the one stage and logs the balance in config.json."""
    out = tmp_path / "run"
    assert main(["train", "--model", "blip-tiny", "--steps", "2", "--stage-layers", "auto",
                 "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["stage_layers"] == [8] and cfg["stage_balance"]["split"] == [8]
    assert "stage layers auto (by flops): split [8]" in capsys.readouterr().out


def test_blip_bad_layouts_fail_early(capsys):
    assert main(["train", "--model", "blip-tiny", "--cp", "2"]) == 2
    assert "context parallelism is not supported" in capsys.readouterr().err
    assert main(["train", "--model", "blip-tiny", "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err
    assert main(["train", "--model", "blip-tiny", "--pp", "2", "--stage-layers", "auto:foo"]) == 2
    assert "auto:measured" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_blip_resume_continues_exactly(tmp_path):
    """Save at step 2, resume to step 3: the same loss as an uninterrupted run of 3 steps."""
    base = ["train", "--model", "blip-tiny", "--global-batch", "4", "--micro-batch-size", "2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main([*base, "--steps", "3", "--out", str(whole)]) == 0
    assert main([*base, "--steps", "2", "--save-every", "2", "--out", str(part)]) == 0
    assert main([*base, "--steps", "3", "--resume", "--out", str(part)]) == 0

    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(part) == pytest.approx(losses(whole), rel=1e-6)
