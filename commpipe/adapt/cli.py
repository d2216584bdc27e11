"""`commpipe train` options of the adaptive controller and the --slow-rank drill.

None of them is a prefix of a torchrun option (tests/test_torchrun_flags.py checks every one).
"""

from __future__ import annotations

from commpipe.adapt.config import AdaptConfig, parse_slow_rank


def add_adapt_arguments(p) -> None:
    d = AdaptConfig()
    g = p.add_argument_group("adaptive training (docs/adaptive.md)")
    g.add_argument("--adapt", action="store_true",
                   help="detect lasting link or compute changes, re-plan on measured costs and "
                        "switch layout in memory when the switch pays back; decisions in "
                        "OUT/adapt.jsonl (needs --out; turns on the monitor at sample=0.1)")
    g.add_argument("--adapt-min-steps", type=int, default=d.min_steps, metavar="N",
                   help=f"a change must persist N steps, one step back in the band allowed among them "
                        f"(default {d.min_steps})")
    g.add_argument("--adapt-min-shift", type=float, default=d.min_shift, metavar="F",
                   help=f"relative shift against the baseline that counts (default {d.min_shift})")
    g.add_argument("--adapt-horizon", type=int, default=d.horizon, metavar="STEPS",
                   help=f"steps over which a switch must pay back (default {d.horizon})")
    g.add_argument("--adapt-margin", type=float, default=d.margin, metavar="X",
                   help=f"saving over the horizon must be X times the switch cost "
                        f"(default {d.margin})")
    g.add_argument("--adapt-trials", type=int, default=d.trials, metavar="K",
                   help=f"confirm an admitted switch by measurement: run up to 2K candidates "
                        f"whose prediction interval overlaps the best prediction's for "
                        f"{d.trial_steps} steps each and keep the fastest measured; 0 trusts the "
                        f"cost model (default {d.trials})")
    g.add_argument("--adapt-switch-cost", type=float, default=None, metavar="SECONDS",
                   help="assume this switch cost instead of the predicted, then measured one")
    g.add_argument("--adapt-resplit-only", action="store_true",
                   help="consider re-splits and re-batching only: no tp/cp/pp/dp change and "
                        "no uneven DP micro-batches")
    g.add_argument("--adapt-relaunch", action="store_true",
                   help="switch by checkpoint and relaunch instead of in memory: the job "
                        "stops (ranks exit with code 75) and the same command, run again, "
                        "continues under the new layout")
    g.add_argument("--slow-rank", default=None, metavar="RANK:FACTOR[@STEP]",
                   help="fault drill: rank RANK's compute takes FACTOR times as long from step "
                        "STEP on, e.g. 1:3@20")


def adapt_options(args) -> dict:
    """TrainConfig keyword arguments `adapt` and `slow_rank` from parsed options."""
    adapt = None
    d = AdaptConfig()
    given = [flag for flag, value, default in (
        ("--adapt-min-steps", args.adapt_min_steps, d.min_steps),
        ("--adapt-min-shift", args.adapt_min_shift, d.min_shift),
        ("--adapt-horizon", args.adapt_horizon, d.horizon),
        ("--adapt-margin", args.adapt_margin, d.margin),
        ("--adapt-trials", args.adapt_trials, d.trials),
        ("--adapt-switch-cost", args.adapt_switch_cost, None),
        ("--adapt-resplit-only", args.adapt_resplit_only, False),
        ("--adapt-relaunch", args.adapt_relaunch, False)) if value != default]
    if given and not args.adapt:
        raise ValueError(f"{', '.join(given)} tune the adaptive controller, which runs with "
                         "--adapt; add --adapt or drop them")
    if args.adapt:
        adapt = AdaptConfig(min_steps=args.adapt_min_steps, min_shift=args.adapt_min_shift,
                            horizon=args.adapt_horizon, margin=args.adapt_margin,
                            switch_cost_s=args.adapt_switch_cost, trials=args.adapt_trials,
                            layouts=not args.adapt_resplit_only,
                            rebalance=not args.adapt_resplit_only,
                            relaunch=args.adapt_relaunch).validate()
    return {"adapt": adapt, "slow_rank": parse_slow_rank(args.slow_rank)}
