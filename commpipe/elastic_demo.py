"""`commpipe demo --elastic --out DIR`: a node lost, a rank hung, the node back, training on.

Two torchrun agents play two nodes of one elastic job (`--nnodes 1:2`, c10d rendezvous, two
workers each, `--pp 2 --dp 2 --elastic`), each in its own network namespace of the emulated
cluster as root (commpipe.cluster.netns), as plain local processes otherwise. Driven from the
run's metrics.jsonl:

    --kill-node 1@STEP   node 1's agent and workers are SIGKILLed after STEP: the survivors
                         restart on 2 ranks (re-planned, same global batch) from the checkpoint
    --stop-rank 1@STEP   rank 1 of the survivors is SIGSTOPped at STEP: the hang watchdog
                         (--hang-timeout-s) names it, ends it, and the job restarts on 2 ranks
    then                 a new agent starts for the lost node: the job stops at its step
                         boundary (saving), meets again on 4 ranks and takes its layout back

DIR/run is the run folder; its report.html shows the step-time figure with the loss, the
recoveries and the regrowth marked. The demo ends the job (SIGTERM: it saves and could be
resumed) a few steps after the regrowth. Each rendezvous round gets a fresh store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): torchrun's shared store is not rebuilt for a node that
joins a running job, which would wait for it forever.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from commpipe.report.elastic import world_of
from commpipe.report.tables import read_jsonl

SAVE_EVERY = 8
MODEL = "arch=llama,layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=256,vocab=256"
TRAIN = ["--pp", "2", "--dp", "2", "--model", MODEL, "--seq-len", "32", "--global-batch", "8",
         "--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "0", "--steps", "100000",
         "--save-every", str(SAVE_EVERY), "--log-every", "1000", "--elastic"]
AFTER_REGROWTH = 10     # steps on the regrown job before the demo ends it


def parse_at(text: str, flag: str) -> tuple[int, int]:
    """'1@10' -> (1, 10)."""
    m = re.fullmatch(r"(\d+)@(\d+)", text or "")
    if not m:
        raise ValueError(f"{flag} {text!r}: write WHO@STEP, like 1@10")
    return int(m.group(1)), int(m.group(2))


class Job:
    """The two agents of the demo and their logs; node 0 hosts the rendezvous."""

    def __init__(self, out: Path, cluster, hang_timeout_s: float):
        from commpipe.cluster.ports import free_port

        self.out, self.cluster, self.run = out, cluster, out / "run"
        self.port = free_port()
        self.hang_timeout_s = hang_timeout_s
        self.agents: dict[int, subprocess.Popen] = {}
        self.starts = 0

    def start(self, node: int) -> None:
        host = self.cluster.node_ip(0) if self.cluster else "127.0.0.1"
        # the address the node publishes when it is rank 0 (the host name would resolve to an
        # address outside the node's namespace)
        addr = self.cluster.node_ip(node) if self.cluster else "127.0.0.1"
        argv = [sys.executable, "-m", "torch.distributed.run", "--local-addr", addr, "--nnodes", "1:2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{host}:{self.port}", "--rdzv-id", "commpipe-elastic-demo", "--max-restarts", "3",
                "--monitor-interval", "0.5", "--rdzv-conf",
                f"last_call_timeout=2,join_timeout=300,is_host={int(node == 0)}",
                "-m", "commpipe", "train", *TRAIN, "--hang-timeout-s", f"{self.hang_timeout_s:g}",
                "--out", str(self.run.resolve())]
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "GLOO_SOCKET_IFNAME": self.cluster.ifname if self.cluster else "lo"}
        self.starts += 1
        log = open(self.out / f"node{node}-{self.starts}.log", "w")
        if self.cluster:
            self.agents[node] = self.cluster.popen(node, argv, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT)
        else:
            self.agents[node] = subprocess.Popen(argv, env=env, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True)

    def kill_node(self, node: int) -> None:
        """SIGKILL the node's agent and its workers (torchrun starts them in sessions of their
        own, so the agent's process group does not hold them)."""
        proc = self.agents.pop(node)
        _kill_tree(proc)

    def worker_pid(self, rank: int) -> int | None:
        """The live training process of `rank` (its environment says so)."""
        for proc in self.agents.values():
            for pid in _descendants(proc.pid):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID=commpipe-elastic-demo" \
                        in env and b"-m" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        return None

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.agents.values())

    def stop(self, grace_s: float = 60.0) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for proc in self.agents.values():
            try:
                proc.wait(timeout=max(end - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(x) for x in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _wait(job: Job, cond, what: str, timeout_s: float = 240.0, poll_s: float = 0.1) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if not job.alive() or time.monotonic() > end:
            logs = sorted(job.out.glob("node*.log"))
            tail = logs[0].read_text()[-2000:] if logs else ""
            raise RuntimeError(f"the job did not reach '{what}'\n{tail}")
        time.sleep(poll_s)


def run_elastic_demo(out: Path, kill=(1, 10), stop=(1, 30), hang_timeout_s: float = 10.0,
                     cluster_kind: str = "auto", log=print) -> dict:
    """Run the story; returns {events, marks, hang, report}."""
    from commpipe.cluster import netns

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)      # a rerun of the demo replaces the earlier one
    out.mkdir(parents=True)
    ok, why = netns.available() if cluster_kind != "local" else (False, "--cluster local")
    if cluster_kind == "emulated" and not ok:
        raise RuntimeError(f"no emulated cluster: {why}")
    cluster = netns.EmulatedCluster(2, 2, prefix="cpel").up() if ok else None
    log("  cluster: " + ("emulated, 2 nodes x 2 ranks (network namespaces)" if cluster
                         else f"local processes ({why})"))
    job, events = Job(out, cluster, hang_timeout_s), []
    recs = lambda: read_jsonl(job.run / "metrics.jsonl")   # noqa: E731
    try:
        job.start(0)
        time.sleep(1.0)                          # node 0 hosts the rendezvous store
        job.start(1)
        node, step = kill
        _wait(job, lambda: any(r["step"] >= step for r in recs()), f"step {step}")
        job.kill_node(node)
        events.append(("node lost", max(r["step"] for r in recs()) + 1, time.time()))
        log(f"  step {events[-1][1]}: node {node} killed (agent and workers, SIGKILL)")
        rank, step = stop
        # right after a save: the rank then freezes mid-step, and the watchdog names it after
        # --hang-timeout-s (frozen during a save, it would take the 10x allowance of saves)
        _wait(job, lambda: any(world_of(r) == 2 and r["step"] >= step
                               and (r["step"] + 1) % SAVE_EVERY == 1 for r in recs()[-1:]),
              f"step {step} on the survivors", poll_s=0.02)
        pid = job.worker_pid(rank)
        if pid is None:
            raise RuntimeError(f"no live worker of rank {rank} to stop")
        os.kill(pid, signal.SIGSTOP)
        events.append(("rank stopped", max(r["step"] for r in recs()) + 1, time.time()))
        log(f"  step {events[-1][1]}: rank {rank} frozen (SIGSTOP)")
        restarts = lambda: read_jsonl(job.run / "restarts.jsonl")   # noqa: E731
        _wait(job, lambda: len(restarts()) >= 2 and any(r["step"] >= restarts()[-1]["step"] + 2
                                                        and world_of(r) == 2 for r in recs()),
              "the restart after the hang")
        job.start(node)
        events.append(("node back", max(r["step"] for r in recs()) + 1, time.time()))
        log(f"  step {events[-1][1]}: node {node} back (a new agent joins the rendezvous)")
        _wait(job, lambda: len(restarts()) >= 3 and sum(
            world_of(r) == 4 for r in recs() if r["step"] >= restarts()[-1]["step"])
            >= AFTER_REGROWTH, "the regrown job")
        job.stop()
    finally:
        for proc in job.agents.values():
            if proc.poll() is None:
                _kill_tree(proc)
        if cluster is not None:
            cluster.teardown()
    from commpipe.report.cli import write_report
    from commpipe.report.elastic import elastic_marks

    hang = [x for p in sorted(out.glob("node*.log")) for x in p.read_text().splitlines()
            if x.startswith("commpipe: hang:")]
    report = write_report(job.run)
    return {"events": events, "marks": elastic_marks(job.run), "hang": hang[:1],
            "restarts": read_jsonl(job.run / "restarts.jsonl"), "records": recs(),
            "report": report["html"]}


def format_summary(s: dict) -> str:
    lines = ["What happened (steps of the run; a restart resumes from its last checkpoint):"]
    lines += [f"  step {step:>4}  {kind:<8} {label}" for step, kind, label in s["marks"]]
    if s["hang"]:
        lines.append("The watchdog's report: " + s["hang"][0].removeprefix("commpipe: hang: "))
    by_step = {r["step"]: r for r in s["records"]}
    for (what, _, t), r in zip(s["events"], s["restarts"]):
        first = by_step.get(r["step"])
        if first is not None and what != "node back":
            lines.append(f"  {what}: resumed {r['time'] - t:.1f} s after it, on "
                         f"{world_of(first)} ranks ({first.get('layout')})")
    return "\n".join(lines)
