"""Adaptive training: monitor signals -> detect (hysteresis) -> recalibrate costs -> simulate
candidates -> payback rule -> switch in memory (re-split stages, re-batch, reshard the layout).

See docs/adaptive.md. Modules:
    config     AdaptConfig (thresholds) and the --slow-rank drill's parsing (no torch)
    detect     persistent-change detection with hysteresis, and Watch: what to act on (pure)
    plan       what a switch between two running layouts (commpipe.layout.Layout) moves, and
               the payback rule (pure Python)
    model      the cost model of candidates on measured speeds, priced by the simulator
    candidates the plans considered: re-splits, re-batching, other layouts
    evaluate   one evaluation: measurements -> candidates -> payback -> a Decision
    rates      the link and collective rates measured across plans (rank 0)
    records    Decision, the typed record of adapt.jsonl
    signals    per-step signals of one rank, from the runtime's timeline and the monitor
    switch     gather the full training state through Comm and rebuild under a new layout
    drills     --slow-rank: one rank's compute made FACTOR times slower from STEP on
    controller the loop: gather signals, detect, re-plan, decide, switch, log adapt.jsonl
"""
