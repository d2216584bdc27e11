"""Schedule generators, string/CSV forms, the validator and the deadlock dry run.

    python -m pytest tests/test_schedules.py -q
"""

from __future__ import annotations

import pytest

from commpipe.schedules import (
    GENERATORS,
    Action,
    Program,
    ScheduleDeadlock,
    ScheduleError,
    check_program,
    dry_run,
    dump_csv,
    generate,
    gpipe,
    interleaved,
    load_csv,
    lower,
    one_f_one_b,
    zb_h1,
    zbv,
)
from commpipe.schedules.order import as_written
from commpipe.schedules.validate import channel_order_conflicts

# (name, vpp, smallest valid m for a given p)
SCHEDULES = [("gpipe", 1, lambda p: 1), ("1f1b", 1, lambda p: p), ("zbh1", 1, lambda p: p),
             ("zbv", 2, lambda p: 2 * p - 1), ("interleaved", 2, lambda p: p),
             ("interleaved", 3, lambda p: p)]


def _grid():
    for name, v, m_min in SCHEDULES:
        for p in (1, 2, 3, 4, 5):
            for m in sorted({m_min(p), m_min(p) + 1, 2 * p, 3 * p + 1, 8}):
                if m < m_min(p) or (name == "interleaved" and m % p):
                    continue
                yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_grid()))
def test_every_generated_program_is_valid_and_deadlock_free(name, p, m, v):
    prog = generate(name, p, m, v)
    assert not prog.is_lowered                    # generators return compute only
    check_program(prog)
    lowered = dry_run(prog)
    check_program(lowered)
    # each rank computes exactly its own stages: (stages per rank) x m x (F + B, or F + I + W)
    per_mb = 3 if name.startswith("zb") else 2
    for r in range(p):
        n_compute = sum(a.is_compute for a in lowered.actions[r])
        assert n_compute == len(prog.stages_of(r)) * m * per_mb


def test_placements():
    assert interleaved(4, 8, 2).stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)     # s % p
    assert zbv(3, 6).stage_to_rank == (0, 1, 2, 2, 1, 0)                    # V: r and 2p-1-r
    assert one_f_one_b(3, 3).stage_to_rank == gpipe(3, 1).stage_to_rank == (0, 1, 2)


def test_zbv_turn_and_loss_need_no_communication():
    lowered = lower(zbv(4, 8))
    for r, acts in enumerate(lowered.actions):
        comm = [a for a in acts if not a.is_compute]
        if r == 3:          # stages 3 and 4 both live here: no SEND_F 3 / RECV_F 4
            assert not any(a.op == "SEND_F" and a.stage == 3 for a in comm)
            assert not any(a.op == "RECV_F" and a.stage == 4 for a in comm)
        if r == 0:          # the last stage (7) is on rank 0 with the first: nothing to send on
            assert not any(a.stage == 7 and a.op in ("SEND_F", "RECV_B") for a in comm)


def test_interleaved_follows_megatron_grouping():
    # p=2, v=2, m=4: forwards go through chunk 0 for micro-batches 0,1, then chunk 1 for 0,1,
    # then chunk 0 for 2,3 ...; rank 0 warms up with 2(p-1) + (v-1)p = 4 forwards
    acts = [str(a) for a in interleaved(2, 4, 2).actions[0]]
    assert acts[:4] == ["0F0", "0F1", "2F0", "2F1"]
    assert acts[4:6] == ["0F2", "2B0"]          # steady state starts: one F, one B (chunk 1 first)


def test_zbh1_defers_w_by_rank():
    # rank r lets r micro-batches pass their I before their W runs (Qi et al. 2024, Sec. 2.1)
    prog = zb_h1(4, 8)
    for r, acts in enumerate(prog.actions):
        first_w = next(k for k, a in enumerate(acts) if a.op == "W")
        i_before = sum(a.op == "I" for a in acts[:first_w])
        assert i_before == r + 1


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_string_and_csv_round_trip(name):
    prog = generate(name, 3, 6, 2 if name in ("zbv", "interleaved") else 1)
    for acts in prog.actions:
        for a in acts:
            assert Action.parse(str(a)) == a
    for p in (prog, lower(prog)):
        back = load_csv(dump_csv(p))
        assert back == p


def test_csv_file_round_trip_and_headerless(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text(dump_csv(one_f_one_b(2, 3)))
    assert load_csv(str(path)) == one_f_one_b(2, 3)
    # hand-written, no header: row = rank, stage s on rank s % pp, m read off the actions
    prog = load_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert (prog.pp, prog.microbatches, prog.stage_to_rank) == (2, 2, (0, 1))
    dry_run(prog)


@pytest.mark.parametrize("call,needle", [
    (lambda: one_f_one_b(4, 3), "--microbatches >= 4"),
    (lambda: zb_h1(4, 2), "--microbatches >= 4"),
    (lambda: zbv(4, 6), "--microbatches >= 7"),
    (lambda: interleaved(4, 6, 2), "multiple of pp=4"),
    (lambda: interleaved(4, 8, 1), "--vpp 2"),
    (lambda: generate("gpipe", 2, 2, 2), "drop --vpp"),
    (lambda: generate("zbv", 2, 4, 3), "2 chunks per rank"),
    (lambda: generate("zb-h1", 2, 4), "unknown schedule"),
    (lambda: gpipe(0, 4), "pp=0"),
])
def test_constraints_rejected_with_the_fix(call, needle):
    with pytest.raises(ValueError, match=None) as e:
        call()
    assert needle in str(e.value)


def _prog(rows, pp=2, m=2, stage_to_rank=(0, 1)):
    return Program("t", pp, m, stage_to_rank, tuple(tuple(Action.parse(x) for x in r.split()) for r in rows))


@pytest.mark.parametrize("rows,needle", [
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"], "stage 1 micro-batch 1 (rank 1) has no backward"),
    (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], "1B0 (step 0) runs before its forward 1F0"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 1I1 1W1"], "has both B and I/W"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1I1"], "1I1 but no 1W1"),
    (["0F0 0F1 0B0 0W1 0I1", "1F0 1B0 1F1 1B1"], "0W1 (step 3) runs before 0I1"),
    (["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"], "belongs on rank 1"),
    (["0F0 0F1 0B0 0B1 0F1", "1F0 1B0 1F1 1B1"], "appears twice"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F2 1B1"], "micro-batch 2"),
])
def test_check_program_names_the_problem(rows, needle):
    prog = _prog(rows)
    with pytest.raises(ScheduleError) as e:
        check_program(prog)
    assert needle in str(e.value)


def test_b_and_split_backward_may_mix_across_microbatches():
    check_program(_prog(["0F0 0F1 0B0 0I1 0W1", "1F0 1B0 1F1 1B1"]))


def test_v_turn_local_order_checked():
    # stages 1 and 2 both on rank 1: 2F0 must come after 1F0 on that rank
    prog = _prog(["0F0 0B0", "2F0 1F0 2B0 1B0"], m=1, stage_to_rank=(0, 1, 1))
    with pytest.raises(ScheduleError, match="2F0 .* runs before 1F0"):
        check_program(prog)


def test_unmatched_send_and_recv_reported():
    good = lower(one_f_one_b(2, 2))
    rank1 = tuple(a for a in good.actions[1] if str(a) != "1RECV_F1")
    with pytest.raises(ScheduleError, match="unmatched send 0SEND_F1 on rank 0"):
        dry_run(Program("t", 2, 2, (0, 1), (good.actions[0], rank1)))
    rank0 = tuple(a for a in good.actions[0] if str(a) != "0SEND_F0")
    with pytest.raises(ScheduleError, match="unmatched receive 1RECV_F0 on rank 1"):
        dry_run(Program("t", 2, 2, (0, 1), (rank0, good.actions[1])))


BROKEN_ORDER = """0F0,0B0,0F1,0B1
1F1,1B1,1F0,1B0
"""


def test_rank_expecting_microbatch_1_before_0_is_a_deadlock(tmp_path):
    # rank 0 sends micro-batch 1 only after micro-batch 0's gradient returns, but rank 1 waits
    # for micro-batch 1 first: each waits on the other.
    path = tmp_path / "broken.csv"
    path.write_text(BROKEN_ORDER)
    prog = load_csv(str(path))
    check_program(prog)                         # locally each rank is fine ...
    with pytest.raises(ScheduleDeadlock) as e:  # ... together they deadlock
        dry_run(prog)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "[0RECV_B0]" in msg and "[1RECV_F1]" in msg        # stuck actions marked
    assert "rank 1 step 0 1RECV_F1 waits for 0SEND_F1 on rank 0" in msg
    assert "cycle: rank 1 -> rank 0 -> rank 1" in msg or "cycle: rank 0 -> rank 1 -> rank 0" in msg


def test_deadlock_deep_in_a_long_schedule_is_found_quickly():
    # rank 3 of a 1F1B p=8, m=256 program runs micro-batch 110's forward just before 100's
    # (locally fine: it still precedes 3B110). Rank 2 only sends 110 after the gradient of
    # micro-batch 104 comes back from rank 3, which rank 3 computes later: a cycle.
    prog = one_f_one_b(8, 256)
    acts = list(prog.actions[3])
    acts.remove(Action("F", 3, 110))
    acts.insert(acts.index(Action("F", 3, 100)), Action("F", 3, 110))
    broken = Program("broken", 8, 256, prog.stage_to_rank,
                     prog.actions[:3] + (tuple(acts),) + prog.actions[4:])
    with pytest.raises(ScheduleDeadlock, match=r"\[3RECV_F110\]"):
        dry_run(broken)


def test_in_order_matching_conflicts_are_reported():
    assert channel_order_conflicts(one_f_one_b(4, 8)) == []
    # rank 1 receives micro-batch 1 before 0 but nothing waits on rank 1 in between: fine with
    # tagged matching, wrong for a backend that matches the k-th send with the k-th receive
    prog = load_csv("0F0,0F1,0B0,0B1\n1F1,1F0,1B0,1B1\n")
    lowered = dry_run(prog)
    conflicts = channel_order_conflicts(lowered, as_written(lowered))
    assert conflicts and conflicts[0].startswith("rank 0 <-> rank 1: operation 0 of the pair")
    # the runtime's posting order receives micro-batch 0 first (both are posted before 1F1)
    assert channel_order_conflicts(prog) == []


# -- the registry (commpipe.schedules.registry) states what the generators check -------------
def test_registry_agrees_with_the_generators():
    from commpipe.schedules.registry import SCHEDULES as INFO

    assert set(INFO) == set(GENERATORS)
    for name, s in INFO.items():
        for p in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for m in range(1, 3 * p + 3):
                    try:
                        prog = s.build(p, m, v) if s.vpp_free else s.build(p, m)
                        generated = s.vpp_problem(v) is None
                    except ValueError:
                        prog, generated = None, False
                    assert (s.problem(p, v, m) is None) == generated, (name, p, v, m)
                    if prog is not None and generated:
                        assert prog.num_stages == p * s.chunks(v)
                        assert list(prog.stage_to_rank) == s.stage_to_rank(p, v)
                        assert [prog.stages_of(r) for r in range(p)] == \
                            [list(c) for c in s.rank_chunks(p, v)]
                        braided = any(a.is_braid for acts in prog.actions for a in acts)
                        split = any(a.op in ("I", "W") for acts in prog.actions for a in acts
                                    for a in a.parts)
                        assert braided == s.braided, (name, p, m)
                        assert split == s.splits_backward or p == 1, (name, p, m)


def test_registry_messages_name_the_fix():
    from commpipe.schedules.registry import info

    assert "--microbatches >= 8" in info("stp").problem(4, 2, 7)
    assert "--microbatches 8" in info("interleaved").problem(4, 2, 6)
    assert "drop --vpp" in info("1f1b").problem(2, 2, 4)
    assert info("dualpipev").chunks(1) == info("zbv").chunks(2) == 2
    assert info("interleaved").chunks(3) == 3
    with pytest.raises(ValueError, match="unknown schedule 'zb-v'.*stp"):
        info("zb-v")
