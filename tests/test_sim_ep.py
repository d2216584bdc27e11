"""The simulator's expert-parallel stream (commpipe/sim/units.py): a MoE stage's all-to-alls
(`ep_comm` per pass) block plain passes and run beside the other pass of a braid. Times are
worked by hand below; the planner's use of it is in tests/test_plan_moe.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commpipe.schedules import generate, load_csv
from commpipe.schedules.actions import UNITS
from commpipe.sim import CostTable, simulate


def one_stage(rows: str, m: int):
    return load_csv(f"#name,t,pp,1,microbatches,{m},stage_to_rank,0\n{rows}\n")


def test_braid_hides_the_all_to_alls_behind_the_other_pass():
    # 0F0 plain: compute 0-4, its all-to-alls 4-6 (exposed). 0F1&0B0 from 6, units alternating
    # (F first), a quarter of 4 each; EP after F.pre_mlp and F.mlp (dispatch, combine) and after
    # B.mlp and B.pre_mlp (their adjoints), half of 2 each:
    #   F.pre_attn 6-7 | B.mlp 7-8, EP 8-9 | F.attn 8-9 | B.pre_mlp 9-10, EP 10-11 |
    #   F.pre_mlp 10-11, EP 11-12 | B.attn 11-12 | F.mlp 12-13, EP 13-14 | B.pre_attn 13-14
    # so the compute never waits; 0B1 plain from 14: compute 14-18, all-to-alls 18-20.
    res = simulate(one_stage("0F0,0F1&0B0,0B1", 2), CostTable(f=[4.0], b=[4.0], ep_comm=[2.0]))
    assert res.makespan == 20.0 and res.ep_exposed == [4.0] and res.tp_bubble == [0.0]
    assert [(s, e) for _, _, s, e in res._ep] == [(4, 6), (8, 9), (10, 11), (11, 12), (13, 14),
                                                 (18, 20)]
    plain = simulate(one_stage("0F0,0F1,0B0,0B1", 2), CostTable(f=[4.0], b=[4.0], ep_comm=[2.0]))
    assert plain.makespan == 24.0 and plain.ep_exposed == [8.0]


def test_tp_and_ep_streams_run_side_by_side():
    # As above with TP collectives too (after F.attn, F.mlp, B.pre_mlp, B.pre_attn). 0F0 plain:
    # 0-4, TP 4-6, EP 6-8. The braid from 8:
    #   F.pre_attn 8-9 | B.mlp 9-10, EP 10-11 | F.attn 10-11, TP 11-12 |
    #   B.pre_mlp 11-12, TP 12-13 and EP 12-13 | F.pre_mlp 12-13, EP 13-14 | B.attn 13-14 |
    #   F.mlp 14-15, TP 15-16 and EP 15-16 | B.pre_attn 15-16, TP 16-17 (after F.mlp's)
    # 0B1 plain from 16 (its input, F1's output, is ready at 16): 16-20, TP 20-22, EP 22-24.
    costs = CostTable(f=[4.0], b=[4.0], tp_comm=[2.0], ep_comm=[2.0])
    res = simulate(one_stage("0F0,0F1&0B0,0B1", 2), costs)
    assert res.makespan == 24.0 and res.tp_bubble == [4.0] and res.ep_exposed == [4.0]
    assert [(s, e) for _, k, s, e in res._ep if k == 1] == [(10, 11), (12, 13), (13, 14), (15, 16)]
    assert [(s, e) for _, k, s, e in res._tp if k == 1] == [(11, 12), (12, 13), (15, 16), (16, 17)]
    assert [(s, e) for _, k, s, e in res._tp if k != 1] == [(4, 6), (20, 22)]


def test_unit_actions_wait_for_their_own_all_to_alls():
    # One pass written unit by unit exposes what the whole pass exposes: F pre_attn 0-1, attn
    # 1-2, pre_mlp 2-3 (EP 3-4), mlp waits 4-5 (EP 5-6); B.mlp waits for the forward's output
    # 6-7 (EP 7-8), pre_mlp waits 8-9 (EP 9-10), attn waits 10-11, pre_attn 11-12.
    rows = ",".join([f"0F0.{u}" for u in UNITS] + [f"0B0.{u}" for u in UNITS[::-1]])
    costs = CostTable(f=[4.0], b=[4.0], ep_comm=[2.0])
    res = simulate(one_stage(rows, 1), costs)
    whole = simulate(one_stage("0F0,0B0", 1), costs)
    assert res.makespan == whole.makespan == 12.0 and res.ep_exposed == whole.ep_exposed == [4.0]
    assert res.tp_bubble == [0.0]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_unbraided_schedules_expose_every_all_to_all(name):
    # plain passes block on their all-to-alls: the same step as passes that long, and every
    # F, B and I of a rank exposes its ep_comm (W none)
    vpp = 1 if name == "1f1b" else 2
    prog = generate(name, 2, 8, vpp)
    with_ep = simulate(prog, CostTable.for_program(prog, f=1.0, b=2.0, w=1.0, ep_comm=0.5))
    longer = simulate(prog, CostTable.for_program(prog, f=1.5, b=2.5, i=1.5, w=1.0))
    assert with_ep.makespan == pytest.approx(longer.makespan)
    passes = [sum(1 for a in acts if a.op in "FBI") for acts in prog.compute_only().actions]
    assert with_ep.ep_exposed == pytest.approx([n * 0.5 / vpp for n in passes])


def test_dualpipev_exposes_less_than_1f1b_and_json_says_so():
    def run(schedule, vpp, costs):
        out = subprocess.run([sys.executable, "-m", "commpipe", "simulate", "--schedule", schedule,
                              "--pp", "2", "--microbatches", "8", "--vpp", str(vpp), "--costs",
                              costs, "--json"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    one, dual = run("1f1b", 1, "f=1,b=2,ep_comm=1"), run("dualpipev", 2, "f=1,b=2,ep_comm=1")
    assert one["ep_exposed"] == one["ep_exposed_per_rank"][0] == 16.0     # 2m passes x 1
    assert dual["ep_exposed"] < one["ep_exposed"] / 1.5
    assert dual["makespan"] < one["makespan"]
    dense = run("1f1b", 1, "f=1,b=2")           # dense tables print what they printed before
    assert "ep_exposed" not in dense


def test_a_negative_all_to_all_time_is_refused():
    with pytest.raises(ValueError, match="ep_comm"):
        CostTable(f=[1.0], b=[2.0], ep_comm=[-1.0])
