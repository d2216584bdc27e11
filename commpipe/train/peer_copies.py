"""Copies of every rank's state in the memory of another node, for elastic restarts.

    torchrun ... -m commpipe train ... --elastic --save-every 500 --peer-copy-every 10

What survives a restart. torchrun restarts the *workers*: a worker's memory goes with it, but the
agent of each surviving node lives on, and so does the node's shared memory (/dev/shm, RAM, not
disk). A copy is therefore a file there, in a folder of the node's agent:

    /dev/shm/commpipe-<run>/<host>-<agent pid>/step_000120/part3.pt    rank 3's part, step 120

Every N steps, at the step boundary, each rank takes its part of the state: what it writes into
a checkpoint (commpipe.train.checkpoint.full_state_here: full tensors of the parameters and
AdamW states it writes; under expert parallelism the experts gathered whole over each EP group,
held by its first rank, since a shard placed on this run's EP group could not be written once
the restart has new groups) with the data position. The part is kept twice:
- in its own node's folder, and
- on another node: where a DP replica of the rank runs on another node (without ZeRO-1 and
  expert parallelism it holds the same state), that replica writes the part from its own
  memory, with no traffic;
  else the part is sent (one message) to a neighbour, the rank of the same local index on the
  next node, which writes it into its node's folder.
One lost node thus leaves every part on a node that survives. A node keeps its newest copy (two
while a refresh is written); a run that ends removes its copies, and the folders of agents that
died are removed by the next copy taken on that host.

On a restart (`restore`, after the process group starts), the ranks tell each other which parts
their nodes hold. The newest step whose parts are all there, if newer than the latest
checkpoint, is written by the ranks holding its parts as checkpoint OUT/checkpoints/step_N and
loaded like any checkpoint, so the new layout reshards it: the restore costs one checkpoint
write and read, and the steps after the copy are all that is run again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from commpipe.train import checkpoint

TAG = 23                # point-to-point tag of the copies (between steps: nothing else in flight)
SHM = Path("/dev/shm")


def run_dir(out) -> Path:
    """This run's folder in shared memory (a temporary folder where there is no /dev/shm)."""
    base = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    key = hashlib.sha1(str(Path(out).resolve()).encode()).hexdigest()[:12]
    return base / f"commpipe-{key}"


def node_name() -> str:
    """The node as its copies know it: its host and its torchrun agent (the workers' parent),
    which outlives the workers it restarts."""
    return f"{socket.gethostname()}-{os.getppid()}"


def node_dir(out) -> Path:
    return run_dir(out) / node_name()


@dataclass
class Plan:
    """Who keeps which part, for one layout (computed by every rank alike)."""

    comm: object
    nodes: list[str]                  # the node of each rank
    writers: list[int]                # ranks whose part is not empty
    mirror: bool = False              # this rank writes its dp=0 twin's part from its memory
    send_to: int | None = None        # the neighbour this rank's part goes to
    recv_from: list[int] = field(default_factory=list)   # ranks whose parts come here


def make_plan(comm, nodes: list[str], writers: list[int], zero1: bool, ep: int = 1) -> Plan:
    """Each writer's part on a second node: a DP replica there where one exists (without
    ZeRO-1 and expert parallelism: a DP replica holds other experts than dp=0), else the
    neighbour of the same local index on the next node. One node: no second copy (a restart of
    this node's workers still finds the first)."""
    dims, rank = comm.dims, comm.rank
    order = list(dict.fromkeys(nodes))          # nodes in rank order
    members = {n: [r for r in range(len(nodes)) if nodes[r] == n] for n in order}
    plan = Plan(comm, nodes, writers)
    if len(order) == 1:
        return plan
    mirrored = set()
    if not zero1 and ep == 1:
        for pp in range(dims.pp):
            twin = dims.rank_of(pp=pp, dp=0, cp=0, tp=0)
            d = next((d for d in range(1, dims.dp)
                      if nodes[dims.rank_of(pp=pp, dp=d, cp=0, tp=0)] != nodes[twin]), None)
            if d is None:
                continue
            mirrored.add(twin)
            c = comm.coords
            if c["pp"] == pp and c["dp"] == d:  # the whole TP group calls full_state_here
                plan.mirror = True
    for w in writers:
        if w in mirrored:
            continue
        here = members[nodes[w]]
        after = members[order[(order.index(nodes[w]) + 1) % len(order)]]
        peer = after[here.index(w) % len(after)]
        if w == rank:
            plan.send_to = peer
        if peer == rank:
            plan.recv_from.append(w)
    return plan


class PeerCopies:
    """Takes the copies every `every` steps (`take`) and removes them when the run ends."""

    def __init__(self, out, every: int):
        self.out, self.every = out, every
        self.plan: Plan | None = None
        self.written: list[Path] = []           # this rank's files of its newest copy

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, trainer) -> None:
        """Keep this rank's part of the state at trainer.step here and on a second node
        (collective: every rank). Rank 0 appends its time to OUT/peer_copies.jsonl."""
        t0 = time.perf_counter()
        self._take(trainer)
        if trainer.comm.rank == 0:
            with open(Path(self.out) / "peer_copies.jsonl", "a") as f:
                f.write(json.dumps({"step": trainer.step, "seconds": time.perf_counter() - t0})
                        + "\n")

    def _take(self, trainer) -> None:
        comm = trainer.comm
        part = checkpoint.full_state_here(trainer, whole=True)
        if self.plan is None or self.plan.comm is not comm:
            self.plan = self._plan(trainer, bool(part))
        plan = self.plan
        twin = checkpoint.full_state_here(trainer, as_dp0=True, whole=True) if plan.mirror else {}
        head = {"step": trainer.step, "world": comm.dims.world_size, "writers": plan.writers,
                "meta": checkpoint.meta_of(trainer)}
        folder = node_dir(self.out) / checkpoint.step_dirname(trainer.step)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        blob = _pack(head, part) if part else None
        if blob is not None:
            written.append(_write(folder, comm.rank, blob))
        if twin:
            d = comm.dims
            written.append(_write(folder, d.rank_of(pp=comm.coords["pp"], dp=0, cp=0, tp=0),
                                  _pack(head, twin)))
        for src, data in _exchange(comm, blob if plan.send_to is not None else None,
                                   plan.send_to, plan.recv_from).items():
            written.append(_write(folder, src, data))
        for old in self.written:                # the newest copy is complete here
            if old.parent != folder:
                old.unlink(missing_ok=True)
                _rmdir(old.parent)
        self.written = written

    def _plan(self, trainer, writes: bool) -> Plan:
        comm = trainer.comm
        me = node_name()
        seen = comm.gather_objects((me, writes))
        nodes = [n for n, _ in seen]
        if comm.rank == nodes.index(me):        # the node's first rank tidies its folders
            _tidy(run_dir(self.out), me, trainer.step)
        return make_plan(comm, nodes, [r for r, (_, w) in enumerate(seen) if w],
                         trainer.cfg.optim.zero1, trainer.cfg.ep)

    def close(self) -> None:
        """The run is over: remove this rank's copies (and the folders left empty)."""
        for path in self.written:
            path.unlink(missing_ok=True)
            _rmdir(path.parent)
            _rmdir(path.parent.parent)
            _rmdir(path.parent.parent.parent)
        self.written = []


def _pack(head: dict, state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save({**head, "state": state}, buf)
    return buf.getvalue()


def _write(folder: Path, part: int, data: bytes) -> Path:
    path = folder / f"part{part}.pt"
    tmp = folder / f"part{part}.pt.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass                                    # not empty: another rank's files are there


def _tidy(root: Path, me: str, step: int) -> None:
    """Remove this node's copies older than `step` (a restarted job has restored from them or
    from a newer checkpoint) and the folders of this host's agents that are gone, of any run:
    only its own agent's workers read a folder."""
    host = socket.gethostname()
    # other nodes of this host tidy at the same time: a folder listed may be gone when read
    runs = [r for r in _subdirs(root.parent) if r.name.startswith("commpipe-")]
    for d in [d for r in runs for d in _subdirs(r)]:
        name, _, pid = d.name.rpartition("-")
        if d.name == me and d.parent == root:
            for s in _subdirs(d):
                if s.name.startswith("step_") and s.name < checkpoint.step_dirname(step):
                    shutil.rmtree(s, ignore_errors=True)
        elif name == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            _rmdir(d.parent)


def _subdirs(path: Path) -> list[Path]:
    """The folders in `path`; none when it is gone (removed by another node's tidying)."""
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Is process `pid` running (a zombie, killed and not yet reaped, is not)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _exchange(comm, blob: bytes | None, send_to: int | None, recv_from: list[int]) -> dict:
    """Send `blob` to `send_to` and receive one blob from each of `recv_from`: {src: bytes}."""
    if send_to is None and not recv_from:
        return {}
    dev = comm.device
    works = []
    if send_to is not None:
        out = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev)
        works.append(comm.isend(torch.tensor([out.numel()], dtype=torch.int64, device=dev),
                                send_to, dim="world", tag=TAG))
    sizes = {src: torch.zeros(1, dtype=torch.int64, device=dev) for src in recv_from}
    works += [comm.irecv(t, src, dim="world", tag=TAG) for src, t in sizes.items()]
    for w in works:
        w.wait()
    works = [comm.isend(out, send_to, dim="world", tag=TAG)] if send_to is not None else []
    got = {src: torch.empty(int(t.item()), dtype=torch.uint8, device=dev)
           for src, t in sizes.items()}
    works += [comm.irecv(t, src, dim="world", tag=TAG) for src, t in got.items()]
    for w in works:
        w.wait()
    return {src: t.cpu().numpy().tobytes() for src, t in got.items()}


# -- restoring ----------------------------------------------------------------------------------
def held_here(out) -> dict[int, dict]:
    """{step: {"writers": [...], "parts": [...]}} of the copies in this node's folder."""
    held: dict[int, dict] = {}
    folder = node_dir(out)
    for s in sorted(folder.glob("step_*")) if folder.is_dir() else ():
        parts = sorted(int(p.stem[4:]) for p in s.glob("part*.pt") if p.stem[4:].isdigit())
        if not parts:
            continue
        try:
            head = torch.load(s / f"part{parts[0]}.pt", mmap=True, weights_only=True)
        except Exception:   # noqa: BLE001 - a torn file: this step is not usable here
            continue
        held[head["step"]] = {"writers": list(head["writers"]), "parts": parts}
    return held


def newest_complete(views: list[tuple[str, dict]], after: int | None, last: int):
    """(step, {part: the rank providing it}) of the newest step, newer than checkpoint step
    `after` and not beyond `last`, whose parts are all held by some rank's node; else None."""
    holders: dict[int, dict[int, int]] = {}
    writers: dict[int, set] = {}
    for rank, (_, held) in enumerate(views):
        for step, h in held.items():
            writers[step] = set(h["writers"])
            for part in h["parts"]:
                holders.setdefault(step, {}).setdefault(part, rank)
    for step in sorted(holders, reverse=True):
        if (after is None or step > after) and step <= last and writers[step] <= holders[step].keys():
            return step, {p: r for p, r in holders[step].items() if p in writers[step]}
    return None


def restore(trainer, out, after: int | None):
    """Write the newest complete copy newer than checkpoint step `after` as a checkpoint in
    OUT/checkpoints and return its path (collective: every rank); None when there is none."""
    comm = trainer.comm
    views = comm.gather_objects((node_name(), held_here(out)))
    found = newest_complete(views, after, trainer.cfg.steps)
    if found is None:
        return None
    step, providers = found
    folder = node_dir(out) / checkpoint.step_dirname(step)
    state, meta = {}, None
    for part, rank in sorted(providers.items()):
        if rank == comm.rank:
            loaded = torch.load(folder / f"part{part}.pt", weights_only=True)
            state.update(loaded["state"])
            meta = loaded["meta"]
    meta = comm.broadcast_object(meta, src_rank=providers[min(providers)])
    return checkpoint.write_state(comm, state, checkpoint.checkpoints_dir(out), step,
                                  lambda: {**meta, "from_peer_copies": True})


def peer_copies(trainer, start, say):
    """(the copies this run takes, or None; the checkpoint written from the copies on the nodes
    that remain when they are newer than checkpoint `start`, or None): the training loop's
    entry, after the process group starts."""
    cfg = trainer.cfg
    if not (cfg.peer_copy_every and cfg.out):
        return None, None
    after = checkpoint.read_meta(start)["step"] if start is not None else None
    restored = restore(trainer, cfg.out, after) if cfg.resume == "latest" else None
    if restored is not None:
        was = f"than checkpoint step {after}" if after is not None else "with no checkpoint yet"
        say(f"commpipe: elastic: restoring step {checkpoint.read_meta(restored)['step']} from the "
            f"copies in the memory of the nodes that remain (newer {was})")
    return PeerCopies(cfg.out, cfg.peer_copy_every), restored
