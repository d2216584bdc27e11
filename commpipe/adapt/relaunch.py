"""Switching by checkpoint and relaunch: the fallback to switching in memory.

With `--adapt-relaunch` an admitted switch saves a checkpoint (any layout loads it), writes
OUT/adapt_relaunch.json (the plan, the checkpoint, when) and ends every rank with exit code 75.
Run the same command again (a job script can loop while OUT/adapt_relaunch.json is newer than
the last start): before any process group starts, `apply_pending` finds the request, takes its
plan and resumes from its checkpoint, so the job continues under the new layout. A request
applies while its checkpoint is the newest one (a later save supersedes it). torchrun's own
in-place restart (--max-restarts) is not used: on gloo its restarted workers can read the
previous attempt's addresses from the rendezvous store and fail to connect.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

RELAUNCH = "adapt_relaunch.json"
EXIT_CODE = 75   # EX_TEMPFAIL: run again


class RelaunchRequested(Exception):
    relaunch = True


def request(trainer, plan, decision) -> None:
    """Collective: checkpoint, write the request, stop (raises RelaunchRequested). The
    checkpoint and timing go into `decision` (a commpipe.adapt.records.Decision)."""
    from commpipe.train import checkpoint

    t0 = time.perf_counter()
    out = Path(trainer.cfg.out)
    if trainer.monitor is not None:
        trainer.monitor.close()       # collective: the records so far are written
        trainer.monitor = None
    path = checkpoint.save(trainer, checkpoint.checkpoints_dir(out))
    decision.switch_mode = "relaunch"
    decision.checkpoint = str(path)
    decision.save_time_s = time.perf_counter() - t0
    if trainer.comm.rank == 0:
        (out / RELAUNCH).write_text(json.dumps({
            "step": trainer.step, "checkpoint": str(path), "to": plan.record(),
            "from": decision.from_plan, "requested_at": time.time()}, indent=2))
    trainer.comm.barrier()
    raise RelaunchRequested(f"switching to {plan.title} by checkpoint and relaunch after step "
                            f"{trainer.step - 1}: run the same command again to continue")


def apply_pending(cfg, world: int):
    """The configuration to start with: `cfg`, or its pending relaunch's plan resuming from the
    relaunch checkpoint. Pure file reads: runs before any process group starts."""
    from commpipe.layout import Layout
    from commpipe.train import checkpoint

    if cfg.adapt is None or not cfg.out:
        return cfg
    path = Path(cfg.out) / RELAUNCH
    if not path.exists():
        return cfg
    from commpipe.jsonfile import read_json_object

    req = read_json_object(path, "relaunch request")
    fix = f"; delete {path} to start under this command's own layout"
    if not isinstance(req.get("checkpoint"), str) or not isinstance(req.get("to"), dict):
        raise ValueError(f"relaunch request {path}: expected \"checkpoint\" (a path) and \"to\" "
                         f"(the plan) keys{fix}")
    ckpt = Path(req["checkpoint"])
    if checkpoint.latest_in(checkpoint.checkpoints_dir(cfg.out)) != ckpt:
        return cfg                     # superseded by a later checkpoint
    to = req["to"]
    try:
        plan = Layout.from_record(to)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"relaunch request {path}: \"to\" is not a plan ({type(e).__name__}: "
                         f"{e}){fix}") from None
    new = plan.apply(cfg)
    new.resume = str(ckpt)
    new.adapt = dataclasses.replace(cfg.adapt, resumed_from=req)
    return new
