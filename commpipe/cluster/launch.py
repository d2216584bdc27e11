"""Launch one layout: per-node torchrun commands, on an emulated cluster or on this host.

    from commpipe.cluster.launch import plan_commands, run_commands
    cmds = plan_commands(layout, {"preset": "tiny", "steps": 4}, "runs/x", nodes=4, ranks_per_node=2,
                         master_addr="10.77.0.1")
    result = run_commands(cmds, "runs/x", cluster=cluster, timeout_s=300)

On the emulated cluster every node runs its own `torchrun --nnodes N --node-rank i --master-addr
<node 0> --master-port P -m commpipe train ...` inside its namespace, exactly as on a real
cluster. A layout whose placement is not the default rank grid (e.g. TP across nodes) cannot be
expressed by torchrun's contiguous rank blocks, so it is launched as one single-process torchrun
per rank (`--nnodes W --nproc-per-node 1 --node-rank r`), each in the namespace of the node that
the placement assigns to rank r; the training program sees the same world either way.
Without namespaces everything runs as `torchrun --standalone --nproc-per-node W` on loopback.

Each launched torchrun's output goes to OUT/logs/node<i>.log (node<i>-rank<r>.log per rank).
`run_commands` stops everything on timeout or when one node fails, and explains failures from
the log tail (out of memory, the program's ValueError message, a signal, a timeout).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from commpipe.cluster.grids import Layout, node_of_rank

REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class NodeCommand:
    node: int
    argv: list[str]
    env: dict = field(default_factory=dict)     # added to the parent's environment
    log_name: str = ""


@dataclass
class RunResult:
    status: str                  # ok | failed | timeout | invalid
    reason: str = ""
    returncode: int | None = None
    elapsed_s: float = 0.0
    logs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def flag_list(flags: dict) -> list[str]:
    """{"seq_len": 64, "trace": True, "comm_monitor": "all"} -> --seq-len 64 --trace --comm-monitor all"""
    out = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        opt = "--" + key.replace("_", "-")
        out += [opt] if value is True else [opt, str(value)]
    return out


def train_flags(layout: Layout, train: dict, out_dir) -> list[str]:
    """`commpipe train` flags for one layout: its degrees (and schedule, vpp, microbatches when
    it names them), the shared flags it does not set itself, its extra flags, then --out."""
    own = {"tp", "cp", "pp", "dp"} | set(layout.pinned) | ({"ep"} if layout.ep > 1 else set())
    shared = {k: v for k, v in {**train, **layout.extra}.items() if k not in own}
    return [*layout.train_flags(), *flag_list(shared), "--out", str(out_dir)]


def train_argv(layout: Layout, train: dict, out_dir) -> list[str]:
    """torchrun's tail: `-m -- commpipe train ...`. No `commpipe train` flag is a prefix of a
    torchrun option (a test checks it against torchrun's own parser); the `--`, which ends
    torchrun's options, keeps it so for flags passed through --train-arg too."""
    return ["-m", "--", "commpipe", "train", *train_flags(layout, train, out_dir)]


def torchrun(*args: str) -> list[str]:
    # `python -m torch.distributed.run` is `torchrun` bound to this interpreter
    return [sys.executable, "-m", "torch.distributed.run", *args]


def nodes_used(layout: Layout, ranks_per_node: int, nodes: int) -> int:
    world = layout.world_size
    if world % ranks_per_node:
        raise ValueError(f"layout {layout.name} needs {world} ranks, not a multiple of "
                         f"{ranks_per_node} ranks per node; change the layout or --ranks-per-node")
    used = world // ranks_per_node
    if used > nodes:
        raise ValueError(f"layout {layout.name} needs {world} ranks = {used} nodes x {ranks_per_node}, "
                         f"but the cluster has {nodes} nodes; add nodes or shrink the layout")
    return used


def plan_commands(layout: Layout, train: dict, out_dir, *, nodes: int, ranks_per_node: int,
                  master_addr: str, master_port: int = 29500, ifname: str | None = "eth0",
                  ) -> list[NodeCommand]:
    """The torchrun command(s) each node runs for `layout` on a multi-node cluster."""
    used = nodes_used(layout, ranks_per_node, nodes)
    inner = train_argv(layout, train, out_dir)
    env = {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
    rendezvous = ["--master-addr", master_addr, "--master-port", str(master_port)]
    placement = node_of_rank(layout, ranks_per_node)
    if placement == [r // ranks_per_node for r in range(layout.world_size)]:
        return [NodeCommand(i, torchrun("--nnodes", str(used), "--nproc-per-node", str(ranks_per_node),
                                        "--node-rank", str(i), *rendezvous, *inner), env, f"node{i}.log")
                for i in range(used)]
    world = str(layout.world_size)
    return [NodeCommand(node, torchrun("--nnodes", world, "--nproc-per-node", "1", "--node-rank", str(r),
                                       *rendezvous, *inner), env, f"node{node}-rank{r}.log")
            for r, node in enumerate(placement)]


def plan_local(layout: Layout, train: dict, out_dir) -> list[NodeCommand]:
    """Every rank on this host over loopback (placement has no meaning on one host)."""
    argv = torchrun("--standalone", "--nproc-per-node", str(layout.world_size),
                    *train_argv(layout, train, out_dir))
    return [NodeCommand(0, argv, {"GLOO_SOCKET_IFNAME": "lo"}, "node0.log")]


def child_env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"      # step lines reach the log as they happen
    env.update(extra)
    return env


def run_commands(cmds: list[NodeCommand], out_dir, cluster=None, timeout_s: float = 600.0,
                 poll=None, fail_grace_s: float = 10.0) -> RunResult:
    """Start every command (in its node's namespace when `cluster` is given), wait, clean up.

    poll(elapsed_s) is called about twice a second (progress display). When one process fails
    the others get `fail_grace_s` to fail on their own (their logs then agree), then are stopped.
    """
    log_dir = Path(out_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    start = time.monotonic()
    try:
        for cmd in cmds:
            f = open(log_dir / (cmd.log_name or f"node{cmd.node}.log"), "w")
            f.write("$ " + " ".join(cmd.argv) + "\n")
            f.flush()
            files.append(f)
            kw = dict(stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd())
            if cluster is not None:
                procs.append(cluster.popen(cmd.node, cmd.argv, env=child_env(cmd.env), **kw))
            else:
                procs.append(subprocess.Popen(cmd.argv, env=child_env(cmd.env), start_new_session=True, **kw))
        first_failed, failed_at, status = None, None, None
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            if poll is not None:
                poll(now - start)
            if first_failed is None:
                bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    first_failed, failed_at = bad[0], now
            if all(c is not None for c in codes):
                break
            if now - start > timeout_s:
                status = "timeout"
                break
            if failed_at is not None and now - failed_at > fail_grace_s:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            stop_group(p)
        for f in files:
            f.close()
    elapsed = time.monotonic() - start
    logs = [str(log_dir / (c.log_name or f"node{c.node}.log")) for c in cmds]
    codes = [p.returncode for p in procs]
    if status == "timeout":
        return RunResult("timeout", f"timeout after {timeout_s:.0f} s (see {logs[0]})", None, elapsed, logs)
    if first_failed is None and all(c == 0 for c in codes):
        return RunResult("ok", "", 0, elapsed, logs)
    culprit = first_failed if first_failed is not None else next(i for i, c in enumerate(codes) if c)
    reason = explain_failure(Path(logs[culprit]).read_text(errors="replace"), codes[culprit])
    return RunResult("failed", reason, codes[culprit], elapsed, logs)


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group we started (torchrun and its workers), SIGKILL if it lingers."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except (ProcessLookupError, PermissionError):
                break
            except subprocess.TimeoutExpired:
                continue
    try:   # workers that outlived torchrun stay in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_OOM = re.compile(r"OutOfMemoryError|out of memory|Cannot allocate memory|std::bad_alloc|MemoryError",
                  re.IGNORECASE)
_RANK_FAILED = re.compile(r"commpipe: rank (\d+) failed: (.+)")
_CLI_ERROR = re.compile(r"commpipe \w+: error: (.+)")
_EXC = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([A-Za-z_.]*(?:Error|Exception)): (.+)$")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def explain_failure(log: str, returncode: int | None) -> str:
    """One line saying why a run failed, from its log (the last 300 lines)."""
    lines = log.splitlines()[-300:]
    for line in lines:  # a failing rank announces itself once: keep which rank it was
        m = _RANK_FAILED.search(line)
        if m:
            return f"rank {m.group(1)}: {m.group(2).strip()[:300]}"
    for line in lines:
        m = _CLI_ERROR.search(line)
        if m:
            return m.group(1).strip()
    for line in reversed(lines):
        if _OOM.search(line):
            return "out of memory: " + line.strip()[:200]
    excs = [m for m in (_EXC.match(line) for line in lines) if m]
    # prefer the program's own error over the launcher's wrap-up (ChildFailedError)
    own = [m for m in excs if "ChildFailedError" not in m.group(1)]
    if own:
        m = own[-1]
        return f"{m.group(1).split('.')[-1]}: {m.group(2).strip()[:300]}"
    codes = [int(c) for c in _EXITCODE.findall("\n".join(lines))]
    code = next((c for c in codes if c), returncode)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}; no error message in the log"
