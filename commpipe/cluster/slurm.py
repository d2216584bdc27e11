"""sbatch scripts for a layout grid on a real Slurm cluster (defaults fit NERSC Perlmutter).

    commpipe sweep --grid study --out $SCRATCH/study --cluster slurm --nodes 4 --ranks-per-node 4 \
        --account m1234 --setup "module load pytorch"
    bash $SCRATCH/study/slurm/submit_all.sh          # one sbatch job per layout
    commpipe report $SCRATCH/study                   # once the jobs have finished

Each script asks for the layout's nodes (world / GPUs per node) with one task per node and runs a
multi-node torchrun under srun with the c10d rendezvous on the first node of the allocation
(`--rdzv-backend c10d --rdzv-endpoint $head_node:29500`), as NERSC's and most sites' guides do.
When the sweep is done each job appends its exit status to OUT/sweep.jsonl, so the report shows
failed layouts with the Slurm log to look at.

A layout with a non-default placement (e.g. TP across nodes) cannot be expressed with one
torchrun per node, whose ranks form contiguous blocks; its script starts one task per GPU, each a
single-process torchrun whose --node-rank is the global rank the placement puts on that GPU
(static rendezvous at the head node, CUDA_VISIBLE_DEVICES=$SLURM_LOCALID).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from commpipe.cluster.grids import Layout, node_of_rank
from commpipe.cluster.launch import train_argv

# sbatch's --time formats (slurm.schedmd.com/sbatch.html#OPT_time)
SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE")
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.\-&|,*\[\]:]+")   # features with sbatch's operators


@dataclass
class SlurmOptions:
    account: str | None = None
    qos: str | None = "regular"
    time: str = "00:30:00"
    constraint: str | None = "gpu"           # Perlmutter: -C gpu selects the A100 nodes
    gpus_per_node: int = 4
    cpus_per_task: int | None = None         # default: every core of the node to the one task
    port: int = 29500
    python: str = "python"
    setup: list[str] = field(default_factory=list)   # lines before srun (modules, venv, env vars)

    def __post_init__(self):
        # each value lands on an #SBATCH line: one token, or a newline would start a shell line
        if not SLURM_TIME.fullmatch(self.time):
            raise ValueError(f"--time {self.time!r} is not a Slurm time limit; use minutes, MM:SS, "
                             "HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED (e.g. 00:30:00)")
        for flag, value, pattern in (("--account", self.account, SLURM_NAME),
                                     ("--qos", self.qos, SLURM_NAME),
                                     ("--constraint", self.constraint, SLURM_CONSTRAINT)):
            if value is not None and not pattern.fullmatch(value):
                raise ValueError(f"{flag} {value!r}: use letters, digits and _ . -"
                                 + (" (features joined by & | , * [ ] :)"
                                    if pattern is SLURM_CONSTRAINT else "")
                                 + "; no spaces, newlines or shell characters")


def _q(argv) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def sbatch_script(layout: Layout, train: dict, sweep_dir, opts: SlurmOptions) -> str:
    g = opts.gpus_per_node
    world = layout.world_size
    if world % g:
        raise ValueError(f"layout {layout.name} needs {world} GPUs, not a multiple of {g} GPUs per "
                         "node; change the layout or --ranks-per-node")
    nodes = world // g
    run_dir = Path(sweep_dir).resolve() / layout.name
    placement = node_of_rank(layout, g)
    contiguous = placement == [r // g for r in range(world)]
    tasks_per_node = 1 if contiguous else g
    head = [
        "#!/bin/bash",
        f"#SBATCH -J cp-{layout.name}",
        f"#SBATCH -N {nodes}",
        f"#SBATCH --ntasks-per-node {tasks_per_node}",
        f"#SBATCH --gpus-per-node {g}",
        f"#SBATCH -t {opts.time}",
        f"#SBATCH -o {run_dir}/logs/slurm-%j.out",
    ]
    if opts.constraint:
        head.append(f"#SBATCH -C {opts.constraint}")
    if opts.qos:
        head.append(f"#SBATCH -q {opts.qos}")
    if opts.account:
        head.append(f"#SBATCH -A {opts.account}")
    if opts.cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task {opts.cpus_per_task}")
    inner = _q(train_argv(layout, train, run_dir))
    body = [
        "",
        f"# {layout.label}: tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp}, "
        f"{nodes} node(s) x {g} GPUs",
        "set -uo pipefail",
        f"mkdir -p {shlex.quote(str(run_dir))}/logs",
        *opts.setup,
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
    ]
    if contiguous:
        body += [
            f"srun {opts.python} -m torch.distributed.run --nnodes {nodes} --nproc-per-node {g} \\",
            f"    --rdzv-id $SLURM_JOB_ID --rdzv-backend c10d --rdzv-endpoint $head_node:{opts.port} \\",
            f"    {inner}",
        ]
    else:
        # slot s (= SLURM_PROCID: node s // g, GPU s % g) runs global rank RANKS[s]
        slots = sorted(range(world), key=lambda r: (placement[r], r))
        body += [
            f"# placement {layout.placement}: global rank of each task, in SLURM_PROCID order",
            f"export RANKS=\"{' '.join(str(r) for r in slots)}\"",
            "export head_node",
            "srun bash -c '"
            "R=$(echo $RANKS | cut -d\" \" -f$((SLURM_PROCID + 1))); "
            "export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; "
            f"exec {opts.python} -m torch.distributed.run --nnodes {world} --nproc-per-node 1 "
            f"--node-rank $R --master-addr $head_node --master-port {opts.port} "
            + inner.replace("'", "'\\''") + "'",
        ]
    status = {"name": layout.name, "label": layout.label, "tp": layout.tp, "cp": layout.cp, "pp": layout.pp,
              "dp": layout.dp, "placement": layout.placement}
    prefix = ", ".join(f'"{k}": {json_value(v)}' for k, v in status.items())
    body += [
        "rc=$?",
        'if [ $rc -eq 0 ]; then st=ok; why=""; else st=failed; '
        'why="exit code $rc; see logs/slurm-$SLURM_JOB_ID.out"; fi',
        f"printf '{{{prefix}, \"status\": \"%s\", \"reason\": \"%s\", \"cluster\": "
        f"{{\"kind\": \"slurm\", \"job\": \"%s\"}}}}\\n' \"$st\" \"$why\" \"$SLURM_JOB_ID\" "
        f">> {shlex.quote(str(Path(sweep_dir).resolve() / 'sweep.jsonl'))}",
        "exit $rc",
    ]
    return "\n".join(head + body) + "\n"


def json_value(v) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v)


def write_scripts(layouts: list[Layout], train: dict, sweep_dir, opts: SlurmOptions) -> list[Path]:
    """OUT/slurm/<layout>.sbatch for each layout that fits, and OUT/slurm/submit_all.sh (last)."""
    folder = Path(sweep_dir) / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    paths, skipped = [], []
    for layout in layouts:
        try:
            text = sbatch_script(layout, train, sweep_dir, opts)
        except ValueError as e:
            skipped.append(f"# skipped {layout.name}: {e}")
            continue
        # Slurm opens the -o log before the script runs: its folder must exist already
        (Path(sweep_dir) / layout.name / "logs").mkdir(parents=True, exist_ok=True)
        path = folder / f"{layout.name}.sbatch"
        path.write_text(text)
        paths.append(path)
    submit = folder / "submit_all.sh"
    lines = ["#!/bin/bash", "# submit every layout of the sweep as its own job", "set -e",
             'cd "$(dirname "$0")"', *skipped]
    lines += [f"sbatch {shlex.quote(p.name)}" for p in paths]
    submit.write_text("\n".join(lines) + "\n")
    submit.chmod(0o755)
    return paths + [submit]
