"""The JSON that `commpipe plan`, `estimate` and `simulate` print for a fixed set of commands,
one file per command, so a refactoring can show its outputs are byte-identical.

    python benchmarks/cli_snapshot.py OUT_DIR          # writes OUT_DIR/NN-<verb>.json
    python benchmarks/cli_snapshot.py /tmp/after && diff -r /tmp/before /tmp/after

Each file holds the command line, its exit status, stdout and stderr (a command that is
refused is recorded too: its message is part of the behaviour). LLaMA, GPT and BLIP shapes;
fused and eager kernels, per-op recompute, FP8, tied heads, commpipe's own runtime priced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPT = "arch=gpt,layers=24,hidden=2048,heads=16,vocab=51200 --global-batch 512 --seq-len 2048"
LLAMA = "--global-batch 512 --seq-len 4096"
COMMANDS = [
    f"plan --model llama3-8b {LLAMA} --gpus 16 --gpu h100 --json",
    f"plan --model llama3-70b {LLAMA} --gpus 64 --gpu h100 --precision fp8 --json",
    f"plan --model llama3-8b {LLAMA} --gpus 8 --framework torchtitan --eager-ops --recompute op "
    "--json",
    f"plan --model llama3-8b {LLAMA} --gpus 8 --recompute selective --no-sequence-parallel --json",
    f"plan --model {GPT} --gpus 16 --gpu h100 --json",
    f"plan --model {GPT} --gpus 16 --gpu h100 --recompute op --precision fp8 --json",
    f"plan --model {GPT} --gpus 8 --gpu h100 --eager-ops --json",
    "plan --model small --global-batch 16 --seq-len 128 --gpus 4 --framework commpipe --json",
    "plan --model blip-base --global-batch 256 --gpus 8 --gpu h100 --json",
    "plan --model blip-large --global-batch 512 --gpus 16 --gpu h100 --json",
    "plan --model blip-base --global-batch 256 --gpus 8 --gpu h100 --eager-ops --json",
    f"estimate --model llama3-8b {LLAMA} --gpus 16 --tp 2 --pp 4 --json",
    f"estimate --model {GPT} --gpus 16 --tp 2 --pp 4 --recompute op --json",
    "simulate --schedule 1f1b --pp 4 --microbatches 8 --json",
    "simulate --schedule interleaved --pp 4 --microbatches 8 --vpp 2 --json",
    "simulate --schedule zbv --pp 4 --microbatches 8 --costs f=1,b=2,w=1,tp_comm=0.2 --json",
    "simulate --schedule dualpipev --pp 4 --microbatches 8 --json",
]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.splitlines()[0] + "\nusage: cli_snapshot.py OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for i, cmd in enumerate(COMMANDS):
        argv = [sys.executable, "-m", "commpipe", *cmd.split()]
        p = subprocess.run(argv, capture_output=True, text=True)
        path = out / f"{i:02d}-{cmd.split()[0]}.json"
        path.write_text(json.dumps({"command": cmd, "rc": p.returncode, "stdout": p.stdout,
                                    "stderr": p.stderr}, indent=1) + "\n")
        print(f"{path.name}: rc {p.returncode}, {len(p.stdout)} bytes")


if __name__ == "__main__":
    main()
