"""What a user reads on the console: errors under torchrun, the start banner and end summary,
the adaptive controller's lines, validation losses, --help defaults, `plan` and `cluster status`.

    python -m pytest -q tests/test_console.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- errors under torchrun -------------------------------------------------------------------------

def test_bad_layout_under_torchrun_is_reported_once_at_the_end(tmp_path):
    """Every rank meets the bad flag; one reports it, in torchrun's summary (the job's last
    block), and the job fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "--", "commpipe", "train", "--tp", "3", "--pp", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    message = "commpipe train: error: tp=3 does not divide 4 attention heads; use tp in {1, 2}"
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(message) == 1, out
    # the message closes the output: in the root-cause block, after every other failure
    tail = out.rstrip().splitlines()
    at = next(i for i, line in enumerate(tail) if message in line)
    assert "Root Cause" in "\n".join(tail[:at]) and len(tail) - at <= 3, out[-1500:]
    assert "exitcode  : 2" in out       # the reporting rank's own exit code


def test_error_goes_to_torchruns_error_file_from_one_rank(tmp_path, monkeypatch, capsys):
    from commpipe import errors
    from commpipe.cli import main

    monkeypatch.setattr(errors, "QUIET_EXIT_DELAY_S", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    files = []
    for local_rank in (0, 1):
        f = tmp_path / f"error{local_rank}.json"
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(f))
        assert main(["train", "--tp", "3", "--pp", "2"]) == 2
        files.append(f)
    import json

    got = json.loads(files[0].read_text())["message"]["message"]
    assert got.startswith("commpipe train: error: tp=3 does not divide")
    assert not files[1].exists()
    assert capsys.readouterr().err == ""     # torchrun prints it, nobody else
    # without torchrun: on stderr
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--tp", "3", "--pp", "2"]) == 2
    assert capsys.readouterr().err.count("tp=3 does not divide") == 1
