"""Units, braided actions, the stp and dualpipev generators, and the simulator's TP stream.

    python -m pytest tests/test_braided.py -q

Costs in the hand-derived tests: one stage with f = b = 4 and tp_comm = 2, so each unit computes
for 1 and each unit that carries a TP collective (F: attn, mlp; B/I: pre_mlp, pre_attn) holds
the TP stream for 1 (docs/schedules.md, "The simulator's TP stream").
"""

from __future__ import annotations

from collections import Counter

import pytest

from commpipe.parallel.dims import ParallelDims
from commpipe.schedules import (
    Action,
    ScheduleDeadlock,
    ScheduleError,
    check_program,
    dry_run,
    dualpipev,
    dump_csv,
    generate,
    load_csv,
    lower,
    stp,
)
from commpipe.schedules.actions import UNITS
from commpipe.schedules.order import posting_order
from commpipe.schedules.validate import channel_order_conflicts
from commpipe.sim import CostTable, simulate
from commpipe.sim.costs import parse_costs
from commpipe.train.config import TrainConfig

TABLE_COSTS = "f=1,b=2,i=1,w=1,tp_comm=0.3"     # F = I = W = 1 per rank share (0.5 per chunk)


def one_stage(rows: str, m: int):
    return load_csv(f"#name,t,pp,1,microbatches,{m},stage_to_rank,0\n{rows}\n")


# -- the language -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["1F3.attn", "0I2.pre_mlp", "2F5&5B1", "1F3.attn&1I0.pre_mlp",
                                  "0F1&0W0"])
def test_unit_and_braid_strings_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text and Action.parse(str(a)) == a
    if "&" in text:
        fwd, other = a.parts
        assert a.is_braid and fwd.op == "F" and a.op == "F&" + other.op


@pytest.mark.parametrize("text,needle", [("1F3.ffn", "unknown unit"), ("0B1&0F2", "pairs a forward"),
                                         ("0F1&0F2", "pairs a forward"), ("0SEND_F1.attn", "take no unit")])
def test_bad_unit_or_braid_rejected(text, needle):
    with pytest.raises(ValueError, match=needle):
        Action.parse(text)


@pytest.mark.parametrize("name", ["stp", "dualpipev"])
def test_braided_programs_round_trip_through_csv(name):
    prog = generate(name, 3, 7)
    for p in (prog, lower(prog)):
        assert load_csv(dump_csv(p)) == p


def test_units_lowered_at_the_first_and_last_unit():
    fw = ",".join(f"0F0.{u}" for u in UNITS)
    prog = load_csv(f"#name,u,pp,2,microbatches,1,stage_to_rank,0 1\n{fw},0B0\n1F0,1B0\n")
    acts = [str(a) for a in lower(prog).actions[0]]
    assert acts == ["0F0.pre_attn", "0F0.attn", "0F0.pre_mlp", "0F0.mlp", "0SEND_F0", "0RECV_B0", "0B0"]
    dry_run(prog)


@pytest.mark.parametrize("rows,needle", [
    ("0F0.pre_attn,0F0.attn,0F0.mlp,0B0", "missing pre_mlp"),
    ("0F0.attn,0F0.pre_attn,0F0.pre_mlp,0F0.mlp,0B0", "pre_attn -> attn -> pre_mlp -> mlp"),
    ("0F0,0F0.attn,0B0", "both whole"),
    ("0F1&0B0,0F0,0B1", "before its forward"),
    ("0F0&0B0", "one stage and micro-batch"),
    ("0F0,0B0.mlp,0B0.pre_mlp,0B0.attn,0B0.pre_attn,0F1,0I1.mlp,0I1.pre_mlp,0I1.attn,0W1,0I1.pre_attn",
     "units run out of dependency order"),
])
def test_unit_and_braid_validation(rows, needle):
    with pytest.raises(ScheduleError, match=needle):
        check_program(one_stage(rows, 2))


def test_braid_that_blocks_a_send_deadlocks():
    # Rank 0 braids F1 with B0: B0's gradient must arrive before the braid, but rank 1 runs B0
    # only after F1, whose input rank 0 sends after the braid. Unbraided, the same order runs.
    head = "#name,d,pp,2,microbatches,2,stage_to_rank,0 1\n"
    with pytest.raises(ScheduleDeadlock):
        dry_run(load_csv(head + "0F0,0F1&0B0,0B1\n1F0,1F1,1B0,1B1\n"))
    dry_run(load_csv(head + "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"))


# -- the generators -----------------------------------------------------------------------------
@pytest.mark.parametrize("gen", [stp, dualpipev])
@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 5), (3, 6), (4, 8), (4, 16), (5, 13)])
def test_generators_complete_valid_and_legal_under_strict_order(gen, p, m):
    prog = gen(p, m)
    assert prog.vpp == 2 and prog.stage_to_rank == tuple(range(p)) + tuple(range(p - 1, -1, -1))
    counts = Counter((x.op, x.stage, x.microbatch) for acts in prog.actions for a in acts
                     for x in a.parts)
    assert set(counts.values()) == {1}
    for s in range(2 * p):
        for mb in range(m):
            has_b = counts[("B", s, mb)] == 1
            assert counts[("F", s, mb)] == 1
            assert has_b != (counts[("I", s, mb)] == 1 and counts[("W", s, mb)] == 1)
    assert any(a.is_braid for acts in prog.actions for a in acts)
    lowered = dry_run(prog)                                   # dependencies + deadlock
    assert channel_order_conflicts(lowered, posting_order(lowered)) == []


def test_stp_braids_every_steady_state_forward():
    # the steady state pairs each forward with an input gradient (F&I); F&W only in the ramp
    ops = Counter(a.op for acts in stp(4, 16).actions for a in acts)
    assert ops["F&I"] > ops["F&W"] > 0 and ops["F&B"] == 0 and ops["B"] == 0
    assert Counter(a.op for acts in dualpipev(4, 16).actions for a in acts)["F&B"] > 0


@pytest.mark.parametrize("name", ["stp", "dualpipev"])
def test_unsupported_sizes_name_the_valid_values(name):
    with pytest.raises(ValueError, match=r"microbatches >= 2\*pp = 8.*--microbatches 8"):
        generate(name, 4, 7)
    with pytest.raises(ValueError, match="2 chunks per rank"):
        generate(name, 4, 8, 3)


def test_trainer_refuses_what_the_runtime_cannot_run(tmp_path):
    # braids run (tests/test_braided_training.py); single-unit actions and whole-layer
    # recomputation of braided layers are refused before any process group starts
    fw = ",".join(f"0F0.{u}" for u in UNITS)
    path = tmp_path / "units.csv"
    path.write_text(f"#name,u,pp,2,microbatches,1,stage_to_rank,0 1\n{fw},0B0\n1F0,1B0\n")
    cfg = TrainConfig(model="tiny", dims=ParallelDims(pp=2), schedule=str(path), microbatches=1)
    with pytest.raises(ValueError, match="addresses single units of a stage"):
        cfg.program()
    cfg = TrainConfig(model="tiny", dims=ParallelDims(pp=2), schedule="stp", microbatches=4,
                      recompute="full")
    with pytest.raises(ValueError, match="use --recompute\nselective|use --recompute selective"):
        cfg.program()
    assert TrainConfig(model="tiny", dims=ParallelDims(pp=2), schedule="stp", microbatches=4,
                       recompute="selective").program().name == "stp"


# -- the simulator: hand-derived times ----------------------------------------------------------
def test_braid_hides_tp_behind_the_other_pass():
    # 0F0 plain: compute 4, then its collectives exposed: 0..6.
    # 0F1&0B0 from 6, units alternating (F first):
    #   F.pre_attn 6-7 | B.mlp 7-8 | F.attn 8-9, AR 9-10 | B.pre_mlp 9-10, AR 10-11 |
    #   F.pre_mlp 10-11 (its AR is done) | B.attn 11-12 | F.mlp 12-13, AR 13-14 |
    #   B.pre_attn 13-14, AR 14-15: compute never waits; the stream is free at 14.
    # 0B1 plain: 14 + 4 + 2 = 20. Exposed TP: 2 + 0 + 2 = 4 (unbraided: 4 * 2 = 8, makespan 24).
    costs = CostTable(f=[4.0], b=[4.0], tp_comm=[2.0])
    res = simulate(one_stage("0F0,0F1&0B0,0B1", 2), costs)
    assert res.makespan == 20.0 and res.tp_bubble == [4.0] and res.busy == [20.0]
    assert [(u, s, e) for _, k, _, u, s, e in res._units] == [
        ("pre_attn", 6, 7), ("mlp", 7, 8), ("attn", 8, 9), ("pre_mlp", 9, 10),
        ("pre_mlp", 10, 11), ("attn", 11, 12), ("mlp", 12, 13), ("pre_attn", 13, 14)]
    assert [(s, e) for _, k, s, e in res._tp if k == 1] == [(9, 10), (10, 11), (13, 14), (14, 15)]
    assert res.peak_activations == [2.0]
    plain = simulate(one_stage("0F0,0F1,0B0,0B1", 2), costs)
    assert plain.makespan == 24.0 and plain.tp_bubble == [8.0]


def test_unit_actions_wait_for_their_own_collectives():
    # One pass written unit by unit exposes what the whole pass exposes: F pre_attn 0-1, attn
    # 1-2 (AR 2-3), pre_mlp waits 3-4, mlp 4-5 (AR 5-6); B.mlp waits for the forward's output
    # 6-7, pre_mlp 7-8 (AR 8-9), attn waits 9-10, pre_attn 10-11 (AR 11-12): makespan 12, TP
    # exposed 4 - the same as 0F0,0B0 written whole (6 + 6).
    rows = ",".join([f"0F0.{u}" for u in UNITS] + [f"0B0.{u}" for u in UNITS[::-1]])
    costs = CostTable(f=[4.0], b=[4.0], tp_comm=[2.0])
    res = simulate(one_stage(rows, 1), costs)
    whole = simulate(one_stage("0F0,0B0", 1), costs)
    assert res.makespan == whole.makespan == 12.0 and res.tp_bubble == whole.tp_bubble == [4.0]


def test_braid_without_tp_is_its_two_passes_back_to_back():
    costs = CostTable(f=[1.0], b=[2.0])
    res = simulate(one_stage("0F0,0F1&0B0,0B1", 2), costs)
    assert res.makespan == 6.0 and res.tp_bubble == [0.0] and res.bubble_fraction == 0.0


# -- the simulator: STP's qualitative table (p = 4) -------------------------------------------
def _sim(name, m, vpp=1):
    prog = generate(name, 4, m, vpp)
    return simulate(prog, parse_costs(TABLE_COSTS, prog)).to_dict()


def test_stp_table_p4():
    res = {(name, m): _sim(name, m, 2 if name == "interleaved" else 1)
           for name in ("interleaved", "zbv", "stp", "dualpipev") for m in (8, 16)}
    for m in (8, 16):
        # interleaved 1F1B exposes every collective: 2m chunk passes F and B per rank, each
        # 0.3 / 2 = 0.15 -> 0.6 m (the STP paper's 2m T_AR with T_AR = F + B per chunk)
        assert res[("interleaved", m)]["tp_bubble"] == pytest.approx(0.6 * m)
        assert res[("zbv", m)]["tp_bubble"] == pytest.approx(0.6 * m)    # W carries none
        assert res[("stp", m)]["makespan"] < min(res[("interleaved", m)]["makespan"],
                                                 res[("zbv", m)]["makespan"])
        peak_chunks = max(res[("stp", m)]["peak_activations"]) * 2       # units -> chunks
        assert 2 * 4 < peak_chunks <= 3 * 4                              # above ZB-V, <= 3p
    # STP's exposed TP time is the ramp's and the drain's: it does not grow with m
    assert res[("stp", 16)]["tp_bubble"] == pytest.approx(res[("stp", 8)]["tp_bubble"])
    assert res[("stp", 8)]["tp_bubble"] < res[("interleaved", 8)]["tp_bubble"] / 1.5
    assert res[("dualpipev", 16)]["tp_bubble"] == pytest.approx(res[("dualpipev", 8)]["tp_bubble"])
