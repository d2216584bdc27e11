"""A resumed `--adapt` run keeps what the controller learned: its layout and its baselines.

Every checkpoint of an adaptive run carries, in commpipe.json under "adapt":
  plan          the plan running when it was saved (the one before a trial phase, if one was
                under way: an interrupted trial phase starts again after its detection)
  command_plan  the plan the command asked for when the run started
  baselines     per plan name, the levels its signals first settled at ({"kind|key": ms}):
                for the command's plan, the healthy ones from before any fault
  stragglers    ranks whose slowdown was detected and not yet recovered

`--resume` with the same command (the same layout flags, so the same `command_plan`) restarts
in the checkpoint's plan. A command that asks for another layout than the run started with is
taken as the user's choice and runs as given. Either way the detector re-arms with the baselines
recorded for the plan it starts in, so a fault that is still there, or that went away, is seen
against the levels from before it, not taken as the new normal. Pure file reads: runs before
any process group starts.
"""

from __future__ import annotations

import dataclasses

from commpipe.layout import Layout


def saved_state(cfg) -> dict | None:
    """The "adapt" block of the checkpoint `cfg.resume` names, if it has one."""
    from commpipe.train import checkpoint

    if not cfg.resume:
        return None
    where = checkpoint.checkpoints_dir(cfg.out) if cfg.resume == "latest" else cfg.resume
    found = checkpoint.find_checkpoint(where)
    if found is None:
        return None
    state = checkpoint.read_meta(found).get("adapt")
    return state if isinstance(state, dict) and isinstance(state.get("plan"), dict) else None


def resume_adapted(cfg, world: int):
    """The configuration to start with when resuming an adaptive run: `cfg`, or `cfg` under the
    checkpoint's plan when the command asks for the layout the run started with. Its
    AdaptConfig carries the checkpoint's state for the controller (`resume_state`)."""
    if cfg.adapt is None:
        return cfg
    state = saved_state(cfg)
    if state is None:
        return cfg
    try:
        saved, started = Layout.from_record(state["plan"]), Layout.from_record(state["command_plan"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--resume {cfg.resume}: the checkpoint's adaptive state is not a plan "
                         f"({type(e).__name__}: {e}); resume without --adapt, or from an "
                         "earlier checkpoint") from None
    asked = Layout.of(cfg)
    same_world = saved.world_size == world
    new, note = cfg, None
    if cfg.adapt.resumed_from is not None:   # a relaunch: its request chose the plan
        note = "the plan of the relaunch request"
    elif asked == started and saved != asked and same_world:
        new = saved.apply(cfg)
        note = (f"the checkpoint's adapted plan; layout flags other than the run started with "
                f"({started.title}) choose another")
    elif asked != started:
        note = (f"the command's layout: the run started in {started.title}, the checkpoint "
                f"ran {saved.title}")
    new.adapt = dataclasses.replace(cfg.adapt, resume_state=state | {"note": note})
    return new
