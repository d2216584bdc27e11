"""The run folder (--out), checked before any process group starts.

A folder that holds a run (config.json, metrics.jsonl or a checkpoint) is continued only with
--resume and replaced only with --overwrite; anything else is refused, naming how the two
configurations differ, so that no run silently loses its checkpoints or mixes its steps into
another run's metrics.jsonl. --overwrite removes the files a training run writes (RUN_FILES)
and leaves anything else in the folder alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from commpipe.files import check_out_dir

# everything `commpipe train` writes into OUT (what --overwrite removes)
RUN_FILES = ("config.json", "metrics.jsonl", "metrics.replaced.jsonl", "metrics.jsonl.tmp",
             "restarts.jsonl", "peer_copies.jsonl", "checkpoints", "monitor", "trace",
             "tensorboard", "adapt.jsonl", "adapt_relaunch.json")
# config.json fields that say where and how a run is observed, not what it computes
NOT_THE_RUN = {"out", "resume", "init_from", "overwrite", "timeout_s", "log_every", "fail_at", "monitor",
               "trace", "tensorboard", "strict_order", "stage_balance", "spec", "save_every",
               "eval_every", "eval_batches"}

# config.json fields an --elastic restart chooses anew for the ranks there are (elastic.restart)
ELASTIC_LAYOUT = {"tp", "cp", "pp", "dp", "schedule", "vpp", "microbatches", "micro_batch_size",
                  "dp_microbatches", "stage_layers", "slow_rank"}


def prepare_run_folder(cfg, rank: int = 0) -> None:
    """Check (and with --overwrite, empty) cfg.out before training starts: it must be a
    writable folder, and a run already in it is continued (--resume) or replaced
    (--overwrite), never mixed with this one."""
    if not cfg.out:
        if getattr(cfg, "overwrite", False):
            raise ValueError("--overwrite replaces the run in --out; give --out DIR")
        return
    out = Path(cfg.out)
    overwrite = getattr(cfg, "overwrite", False)
    if overwrite and cfg.resume == "latest":
        raise ValueError("--resume continues the run in --out, --overwrite replaces it; give one")
    if overwrite and cfg.resume and _inside(Path(cfg.resume), out):
        raise ValueError(f"--overwrite would delete {cfg.resume}, the checkpoint --resume "
                         "reads; resume without --overwrite, or copy the checkpoint elsewhere")
    check_out_dir(out, "--out")
    held = held_run(out)
    if held is None:
        return
    if overwrite:
        if rank == 0:
            for name in RUN_FILES:
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
        return
    from commpipe.train.checkpoint import checkpoints_dir, find_checkpoint

    diffs = config_differences(out, cfg)
    if cfg.elastic:   # a restart on another world re-plans the layout: still the same run
        diffs = [d for d in diffs if d[0] not in ELASTIC_LAYOUT]
    if cfg.resume and (cfg.resume == "latest" or _inside(Path(cfg.resume), out)):
        if cfg.resume != "latest" or find_checkpoint(checkpoints_dir(out)) is not None \
                or not diffs:
            return          # continue it (the checkpoint's own checks follow), or a requeue
        raise ValueError(f"{out} holds a run with {_side(diffs, 0)} and no checkpoint to "
                         f"resume; this one has {_side(diffs, 1)}. Pass --overwrite to replace "
                         "it, or give another --out")
    if cfg.resume:
        what = f"a run with {_side(diffs, 0)}" if diffs else f"a run ({held})"
        raise ValueError(f"{out} holds {what}; resuming from {cfg.resume} would write this run "
                         "into it. Pass --overwrite to replace it, or give another --out")
    if diffs:
        raise ValueError(f"{out} holds a run with {_side(diffs, 0)}, this one has "
                         f"{_side(diffs, 1)}; pass --resume to continue it or --overwrite to "
                         "replace it")
    raise ValueError(f"{out} already holds this run ({held}); pass --resume to continue it or "
                     "--overwrite to start it again")


def held_run(out: Path) -> str | None:
    """What of a training run `out` holds ("metrics up to step 9, checkpoint step_000010"), or
    None when it holds none."""
    from commpipe.train.checkpoint import checkpoints_dir, find_checkpoint

    parts = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        last = _last_step(metrics)
        parts.append(f"metrics up to step {last}" if last is not None else "metrics.jsonl")
    ckpt = find_checkpoint(checkpoints_dir(out)) if (out / "checkpoints").is_dir() else None
    if ckpt is not None:
        parts.append(f"checkpoint {ckpt.name}")
    if not parts and (out / "config.json").is_file():
        parts.append("config.json")
    return ", ".join(parts) or None


def config_differences(out: Path, cfg) -> list[tuple[str, object, object]]:
    """(field, value in OUT/config.json, value of this run) for each field that decides what
    the run computes; [] when the folder has no readable config.json."""
    try:
        old = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict):
        return []
    new = json.loads(json.dumps(cfg.to_dict(), default=str))
    a, b = _flat(old), _flat(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b), key=_order)
            if a.get(k) != b.get(k)]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if not prefix and k in NOT_THE_RUN:
            continue
        if isinstance(v, dict):
            # layout and optimizer fields read as the flags that set them: pp=2, lr=0.003
            out.update(_flat(v, "" if k in ("dims", "optim") else f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_FIRST = ("model", "tp", "cp", "pp", "dp", "schedule", "vpp", "microbatches", "global_batch",
          "seq_len", "steps")


def _order(key: str):
    return (_FIRST.index(key), key) if key in _FIRST else (len(_FIRST), key)


def _side(diffs, i: int, most: int = 4) -> str:
    shown = [f"{d[0]}={d[1 + i]}" for d in diffs[:most]]
    more = f" and {len(diffs) - most} more differences" if len(diffs) > most else ""
    return ", ".join(shown) + more


def _last_step(path: Path) -> int | None:
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _inside(path: Path, folder: Path) -> bool:
    try:
        return os.path.commonpath([path.resolve(), folder.resolve()]) == str(folder.resolve())
    except ValueError:
        return False
