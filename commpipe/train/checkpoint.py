"""Checkpoints that load under any layout: torch.distributed.checkpoint (DCP) of full tensors.

Layout of a run folder:

    OUT/checkpoints/step_000200/      one complete checkpoint (after 200 optimizer steps)
        .metadata, __<rank>_0.distcp  DCP: tensors
        commpipe.json                 step, model shape, layout, data position, LR settings
    OUT/checkpoints/step_000400.tmp/  a save in progress (never read)
    OUT/checkpoints/latest            name of the newest complete checkpoint, written last

What is saved, under the parameter's logical name (`layers.<i>.…`, whatever stage holds it):
    model.<name>               the full tensor: TP shards all-gathered (through Comm) along the
                               parameter's placement `tp_dim`, written by the dp=0, cp=0, tp=0
                               rank only
    optim.<name>.exp_avg       AdamW first and second moments, full tensors, and its step count,
    optim.<name>.exp_avg_sq    written by the rank holding them (dp=0, or the ZeRO-1 owner of
    optim.<name>.step          the parameter), cp=0, tp=0
    rng.rank<r>.cpu (.cuda)    each rank's torch RNG state
The routed experts of a MoE layer under expert parallelism are the exception: each rank of
one EP group writes its own rows of the stacked [experts, ...] tensors (and of their moments) as
a DCP shard at its global offset, so the checkpoint still holds the full tensor
(commpipe.train.checkpoint_shards). Loading reads, on each rank, the full tensors of the
parameters its stages hold and keeps its TP slice (of an expert tensor only the rows of its own
experts), so tp, cp, pp (stage split, schedule, vpp), dp, ep and ZeRO-1 may all differ between
save and load. What cannot be resharded (another model shape or vocabulary, a missing tensor)
is refused, before any process group starts, with the difference named.

Atomic: every rank writes into step_N.tmp; after a barrier rank 0 adds commpipe.json, renames
the folder to step_N and then rewrites `latest`. A crash during a save leaves a .tmp folder
that is ignored, and the previous checkpoint stays the one `--resume` picks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from commpipe.files import StorageError
from commpipe.models.spec import ModelSpec
from commpipe.parallel.placement import placement
from commpipe.train.checkpoint_io import SafeReader, damaged, load_failure, read_metadata, save_failure
from commpipe.train.checkpoint_shards import (  # noqa: F401 - gather_tp, shard_tp: adapt.switch
    ep_sharded,
    for_load,
    full_shape,
    gather_ep,
    gather_tp,
    local_part,
    shard_tp,
    to_save,
    writes_model,
)

FORMAT = 1
META = "commpipe.json"
LATEST = "latest"


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_dir(out) -> Path:
    return Path(out) / "checkpoints"


# -- finding checkpoints ---------------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    return (path.is_dir() and not path.name.endswith(".tmp") and (path / META).is_file()
            and (path / ".metadata").is_file())


def latest_in(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (the `latest` marker, else a scan)."""
    marker = root / LATEST
    if marker.is_file():
        name = marker.read_text(errors="replace").strip()
        named = root / name
        if name and named.name == name and is_complete(named):   # a plain name inside root
            return named
    found = sorted((p for p in root.glob("step_*") if is_complete(p)), key=lambda p: p.name)
    return found[-1] if found else None


def find_checkpoint(path) -> Path | None:
    """A checkpoint folder from a checkpoint, a checkpoints folder or a run folder."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir():
            found = latest_in(root)
            if found is not None:
                return found
    return None


def resolve_resume(cfg, source=None) -> Path | None:
    """The checkpoint `cfg.resume` names, checked against the run's model and data (and against
    `source`, the opened batch source, if given); None for `--resume` (latest) when OUT has no
    checkpoint yet, so a requeued job may always pass it."""
    if not cfg.resume:
        return None
    if cfg.resume == "latest":
        found = find_checkpoint(checkpoints_dir(cfg.out))
        if found is None:
            return None
    else:
        found = find_checkpoint(cfg.resume)
    if found is None:
        raise FileNotFoundError(f"--resume {cfg.resume}: no complete checkpoint there (a folder "
                                f"with {META} and .metadata, or a run folder holding checkpoints/)")
    meta = read_meta(found)
    check_compatible(meta, cfg, found)
    read_metadata(found)   # refused or damaged: said now, before any process group starts
    if source is None and not cfg.data:
        from commpipe.models.family import family_of
        from commpipe.train.families import training_for

        source = training_for(family_of(cfg.spec)).synthetic_source(cfg)
    if source is not None:
        try:  # the same tokenizer, corpus, --seq-len and --seed (the position is set again on load)
            source.load_state_dict(meta["data"])
        except ValueError as e:
            raise ValueError(f"cannot resume from {found}: {e}") from None
    return found


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(path, META, f"cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise damaged(path, META, "holds no JSON object")
    missing = [k for k in ("format", "step", "model", "data", "world_size") if k not in meta]
    if missing and meta.get("format") == FORMAT:
        raise damaged(path, META, f"lacks {', '.join(missing)}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} has checkpoint format {meta.get('format')}, this commpipe "
                         f"reads format {FORMAT}")
    return meta


def check_compatible(meta: dict, cfg, path: Path) -> None:
    """Refuse what resharding cannot bridge: another model shape, vocabulary or data kind."""
    if meta["data"] is None:   # commpipe.train.weights: converted weights, no training state
        raise ValueError(f"{path} holds model weights only (no optimizer or data position); "
                         f"start a run from it with --init-from {path}")
    spec: ModelSpec = cfg.spec
    saved = meta["model"]
    # every field but the preset's name decides the parameters' shapes and meaning (LLaMA or BLIP)
    current = spec.to_dict()
    diffs = [f"{k}={saved.get(k)} (checkpoint) vs {current[k]} (this run)"
             for k in current if k != "name" and saved.get(k) != current[k]]
    if diffs:
        hint = " (with --data the vocabulary is the tokenizer's padded to 64; resume with the " \
               "same tokenizer)" if saved.get("vocab") != spec.vocab else ""
        raise ValueError(f"cannot load {path}: the model differs: {'; '.join(diffs)}{hint}. "
                         f"A checkpoint reshards across layouts, not across model shapes")
    kind = "corpus" if cfg.data else "synthetic"
    if meta["data"].get("kind") != kind:
        raise ValueError(f"cannot load {path}: it was trained on {meta['data'].get('kind')} data, "
                         f"this run reads {kind} data; resume with the same --data")
    if meta["step"] > cfg.steps:
        raise ValueError(f"{path} is at step {meta['step']}, beyond --steps {cfg.steps}; "
                         f"give a larger --steps")


# -- who holds the optimizer states ----------------------------------------------------------------
def adam_and_holder(trainer):
    """(the AdamW holding this rank's states, predicate: does this rank hold p's states)."""
    from commpipe.parallel.data import Zero1

    opt = trainer.optimizer
    if isinstance(opt, Zero1):
        return opt.optimizer, opt.owns
    dp0 = trainer.comm.local_rank("dp") == 0
    edp0 = trainer.comm.local_rank("edp") == 0     # experts: the first replica of these rows
    return opt, lambda p: edp0 if ep_sharded(p) else dp0


def reads_sharded_states(trainer) -> bool:
    """ZeRO-1: each DP rank loads the states of the parameters it owns; otherwise every DP
    replica runs the full AdamW and loads every state its stages hold."""
    from commpipe.parallel.data import Zero1

    return isinstance(trainer.optimizer, Zero1)


def _rng_keys(rank: int) -> dict[str, torch.Tensor]:
    keys = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        keys[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return keys


# -- save -------------------------------------------------------------------------------------------
def full_state_here(trainer, as_dp0: bool = False, whole: bool = False) -> dict[str, torch.Tensor]:
    """The whole-tensor state this rank writes (collective over TP): `model.<name>` from dp=0,
    cp=0, tp=0 of the stage holding it, `optim.<name>.exp_avg|exp_avg_sq|step` (step a 0-d
    float32) from tp=0, cp=0 of the DP rank keeping its AdamW state (dp=0, or the ZeRO-1 owner).
    A checkpoint save writes it; an adaptive switch gathers it everywhere. `as_dp0` (without
    ZeRO-1, where every DP replica holds the same state): what the dp=0 rank of these
    coordinates writes, from this replica (commpipe.train.peer_copies keeps it on another node).
    `whole`: expert rows are all-gathered over their EP group and kept, as plain whole tensors,
    by its first rank only (a peer copy outlives the process groups a DTensor shard names)."""
    comm = trainer.comm
    c = comm.coords
    state: dict[str, torch.Tensor] = {}

    def keep(key: str, full: torch.Tensor, p) -> None:
        if whole and ep_sharded(p):        # every rank of the EP group gathers
            full = gather_ep(full, p, comm)
            if comm.local_rank("ep") == 0:
                state[key] = full.cpu()
        else:
            state[key] = to_save(full, p, comm)

    for name, p in trainer.named_params:
        if writes_model(p, comm, as_dp0):     # the TP group gathers; tp=0 writes
            full = gather_tp(p, placement(p).tp_dim, comm)
            if c["tp"] == 0:
                keep(f"model.{name}", full, p)
    adam, holds = adam_and_holder(trainer)
    if as_dp0 and not reads_sharded_states(trainer):
        holds = lambda p: True   # noqa: E731 - every replica steps with every state
    for name, p in trainer.named_params:
        st = adam.state.get(p) if holds(p) and c["cp"] == 0 else None
        if not st:
            continue  # same answer on every rank of this TP group: the gathers stay matched
        tp_dim = placement(p).tp_dim
        for key in ("exp_avg", "exp_avg_sq"):
            full = gather_tp(st[key], tp_dim, comm)
            if c["tp"] == 0:
                keep(f"optim.{name}.{key}", full, p)
        if c["tp"] == 0 and (not ep_sharded(p) or comm.local_rank("ep") == 0):  # one step count
            state[f"optim.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(())
    return state


def save(trainer, root) -> Path:
    """Save `trainer` after `trainer.step` steps into root/step_N (collective: every rank)."""
    state = full_state_here(trainer)
    state.update(_rng_keys(trainer.comm.rank))
    return write_state(trainer.comm, state, root, trainer.step, lambda: meta_of(trainer))


def write_state(comm, state: dict[str, torch.Tensor], root, step: int, meta) -> Path:
    """Write a checkpoint root/step_N from each rank's part of the state (`full_state_here`'s
    keys; collective: every rank); `meta()` gives commpipe.json's content on rank 0."""
    root = Path(root)
    final = root / step_dirname(step)
    tmp = root / f"{final.name}.tmp"
    if comm.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)          # left by a save that crashed
    comm.barrier()
    state = {k: v.reshape(1) if k.endswith(".step") else v for k, v in state.items()}
    try:
        with _quiet_single_process():
            dcp.save(state, storage_writer=FileSystemWriter(tmp),
                     no_dist=comm.dims.world_size == 1)
        comm.barrier()                                  # every rank's files are on disk
        if comm.rank == 0:
            _write_json(tmp / META, meta())
            if final.exists():                          # a rerun reached this step again
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_text(root / LATEST, final.name + "\n")
    except BaseException as e:   # noqa: BLE001 - DCP wraps a disk-full error in a BaseException
        error = save_failure(e, tmp, latest_in(root) if root.is_dir() else None)
        if error is None:
            raise
        if comm.rank == 0:       # every rank's writes have ended: free the space they took
            shutil.rmtree(tmp, ignore_errors=True)
        raise error from None
    comm.barrier()
    return final


def meta_of(trainer) -> dict:
    """commpipe.json of a checkpoint of `trainer` at its current step."""
    from commpipe.train.optim import lr_at

    cfg, d = trainer.cfg, trainer.cfg.dims
    meta = {
        "format": FORMAT, "step": trainer.step, "model": cfg.spec.to_dict(),
        "layout": {"tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "ep": cfg.ep,
                   "schedule": cfg.schedule,
                   "vpp": cfg.vpp, "stage_layers": cfg.stage_layers, "zero1": cfg.optim.zero1},
        "world_size": d.world_size, "seed": cfg.seed, "seq_len": cfg.seq_len,
        "global_batch": cfg.global_batch,
        "lr": {"steps": cfg.steps, "lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr,
               "warmup_steps": cfg.optim.warmup_steps,
               "last": lr_at(trainer.step - 1, cfg) if trainer.step else None},
        "data": trainer.source.state_dict(),
    }
    adapt = getattr(trainer, "adapt_state", None)   # --adapt: its plan and baselines (JSON)
    if adapt is not None:
        meta["adapt"] = adapt()
    return meta


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when no process group exists: that is the case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_json(path: Path, obj) -> None:
    _write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- load -------------------------------------------------------------------------------------------
def load(trainer, path) -> dict:
    """Load a checkpoint saved under any layout into `trainer` (collective: every rank)."""
    path = Path(path)
    comm, cfg = trainer.comm, trainer.cfg
    meta = read_meta(path)
    check_compatible(meta, cfg, path)
    stored = read_metadata(path).state_dict_metadata
    adam, holds = adam_and_holder(trainer)
    # one rank wrote each state; without ZeRO-1 every DP replica steps with all of them
    reads = holds if reads_sharded_states(trainer) else (lambda p: True)
    want = model_wants(trainer, path, stored)
    for name, p in trainer.named_params:
        if reads(p) and f"optim.{name}.exp_avg" in stored:
            for k in ("exp_avg", "exp_avg_sq"):
                want[f"optim.{name}.{k}"] = for_load(p, comm)
            want[f"optim.{name}.step"] = torch.empty(1)
    same_world = meta["world_size"] == comm.dims.world_size
    if same_world:  # RNG streams are per rank: restored when the ranks are the same ones
        want.update({k: torch.empty_like(v) for k, v in _rng_keys(comm.rank).items()
                     if k in stored})
    read_tensors(want, path, comm.dims.world_size == 1)
    copy_params(trainer, want)
    with torch.no_grad():
        for name, p in trainer.named_params:
            if f"optim.{name}.step" in want:
                adam.state[p] = {
                    "step": want[f"optim.{name}.step"].reshape(()).clone(),
                    **{k: local_part(want[f"optim.{name}.{k}"], p, comm).to(p.device).clone()
                       for k in ("exp_avg", "exp_avg_sq")},
                }
    if f"rng.rank{comm.rank}.cpu" in want:
        torch.set_rng_state(want[f"rng.rank{comm.rank}.cpu"])
    if f"rng.rank{comm.rank}.cuda" in want:
        torch.cuda.set_rng_state(want[f"rng.rank{comm.rank}.cuda"])
    trainer.source.load_state_dict(meta["data"])
    trainer.step = meta["step"]
    return meta


def model_wants(trainer, path: Path, stored) -> dict[str, torch.Tensor]:
    """Empty full tensors `model.<name>` for the parameters this rank holds (of an expert
    weight under ep, its rows at their offset), each checked against the checkpoint's entry
    (`stored`: its DCP state_dict_metadata)."""
    want: dict[str, torch.Tensor] = {}
    for name, p in trainer.named_params:
        key, shape = f"model.{name}", full_shape(p, trainer.comm)
        if key not in stored:
            raise ValueError(f"cannot load {path}: it holds no parameter {name}")
        if tuple(stored[key].size) != shape:
            raise ValueError(f"cannot load {path}: parameter {name} is {tuple(stored[key].size)} "
                             f"there, {shape} in this model")
        want[key] = for_load(p, trainer.comm)
    return want


def read_tensors(want: dict[str, torch.Tensor], path: Path, single_process: bool) -> None:
    """Fill `want` from checkpoint `path` (DCP through the restricted metadata reader)."""
    try:
        with _quiet_single_process():
            dcp.load(want, storage_reader=SafeReader(path), no_dist=single_process)
    except StorageError:
        raise
    except BaseException as e:   # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise load_failure(e, path) from None


def copy_params(trainer, want: dict[str, torch.Tensor]) -> None:
    """Each parameter's part of what `model_wants` asked for: its TP slice, its expert rows."""
    with torch.no_grad():
        for name, p in trainer.named_params:
            p.copy_(local_part(want[f"model.{name}"], p, trainer.comm))
