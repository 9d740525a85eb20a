"""Pipeline schedules as data: completeness, matched communication, no deadlock, memory, bubble."""
from collections import Counter, defaultdict

import pytest

from hpcpar.parallel.pipeline import (Action, DeadlockError, ScheduleError, format_grid,
                                      make_schedule, one_f_one_b, peak_activations, simulate,
                                      theoretical_bubble)

PLAIN_CASES = [(p, m) for p in (1, 2, 4) for m in (1, 2, 3, 4, 6, 8)]  # m < p, m = p, m > p
INTERLEAVED_CASES = [(p, m, v) for p in (1, 2, 4) for v in (1, 2) for m in (p, 2 * p, 3 * p)]
ALL_CASES = ([("gpipe", p, m, 1) for p, m in PLAIN_CASES] + [("1f1b", p, m, 1) for p, m in PLAIN_CASES]
             + [("zb1", p, m, 1) for p, m in PLAIN_CASES]
             + [("interleaved", p, m, v) for p, m, v in INTERLEAVED_CASES])


def ids(case):
    return "{}-p{}-m{}-v{}".format(*case)


@pytest.mark.parametrize("case", ALL_CASES, ids=ids)
def test_every_microbatch_runs_once_per_stage_on_its_rank(case):
    name, p, m, v = case
    schedule = make_schedule(name, p, m, v)
    assert len(schedule) == p
    counts = Counter((a.kind, a.microbatch, a.stage) for actions in schedule for a in actions if a.is_compute)
    kinds = "FBW" if name == "zb1" else "FB"
    assert counts == Counter({(k, i, s): 1 for k in kinds for i in range(m) for s in range(p * v)})
    for r, actions in enumerate(schedule):
        assert all(a.stage % p == r for a in actions), "every action on the rank holding its stage"


@pytest.mark.parametrize("case", ALL_CASES, ids=ids)
def test_sends_match_receives_in_order_and_sit_next_to_their_compute(case):
    name, p, m, v = case
    schedule = make_schedule(name, p, m, v)
    sent, received = defaultdict(list), defaultdict(list)
    for actions in schedule:
        for j, a in enumerate(actions):
            if a.kind.startswith("SEND"):
                sent[(a.stage, a.peer_stage)].append((a.kind[-1], a.microbatch))
                assert actions[j - 1] == Action(a.kind[-1], a.microbatch, a.stage), "right after its compute"
            elif a.kind.startswith("RECV"):
                received[(a.peer_stage, a.stage)].append((a.kind[-1], a.microbatch))
                assert actions[j + 1] == Action(a.kind[-1], a.microbatch, a.stage), "right before its compute"
    assert sent == received
    # between ranks, every activation and every gradient crosses exactly once
    expected = 2 * m * (p * v - 1) if p > 1 else 0
    assert sum(len(q) for q in sent.values()) == expected


@pytest.mark.parametrize("case", ALL_CASES, ids=ids)
def test_simulation_finishes_and_respects_dependencies(case):
    name, p, m, v = case
    result = simulate(make_schedule(name, p, m, v), forward_time=1, backward_time=2)
    when = {(a.kind, a.microbatch, a.stage): (start, end)
            for line in result.timelines for start, end, a in line}
    last = p * v - 1
    for i in range(m):
        for s in range(1, last + 1):
            assert when[("F", i, s)][0] >= when[("F", i, s - 1)][1]
        for s in range(last):
            assert when[("B", i, s)][0] >= when[("B", i, s + 1)][1]
        for s in range(last + 1):
            assert when[("B", i, s)][0] >= when[("F", i, s)][1]
            if ("W", i, s) in when:
                assert when[("W", i, s)][0] >= when[("B", i, s)][1]
    for line in result.timelines:  # one compute at a time on each rank
        assert all(a[1] <= b[0] for a, b in zip(line, line[1:]))
    assert sum(result.busy) == pytest.approx(p * m * 3)  # all the work, whatever the split


@pytest.mark.parametrize("p, m", PLAIN_CASES)
def test_peak_activations(p, m):
    assert peak_activations(make_schedule("gpipe", p, m)) == [m] * p
    one_f_one_b_peaks = peak_activations(make_schedule("1f1b", p, m))
    assert one_f_one_b_peaks == [min(m, p - r) for r in range(p)]
    zb = make_schedule("zb1", p, m)
    assert peak_activations(zb) == one_f_one_b_peaks  # F done, B not: unchanged
    assert max(peak_activations(zb, held_until="W")) <= max(one_f_one_b_peaks)  # ZB-H1: 1F1B's peak memory


@pytest.mark.parametrize("p, m, v", INTERLEAVED_CASES)
def test_interleaved_peak_within_megatron_bound(p, m, v):
    peaks = peak_activations(make_schedule("interleaved", p, m, v))
    # Megatron's warm-up (v-1)*p + 2*(p-r-1) forwards plus the first steady-state one, in chunks
    bound = [min(m * v, (v - 1) * p + 2 * (p - r - 1) + 1) if v > 1 else min(m, p - r) for r in range(p)]
    assert peaks == bound


@pytest.mark.parametrize("p, m", PLAIN_CASES)
def test_uniform_bubble_of_gpipe_and_1f1b_is_theoretical(p, m):
    for name in ("gpipe", "1f1b"):
        for backward_time in (1, 2):
            measured = simulate(make_schedule(name, p, m), forward_time=1, backward_time=backward_time).bubble
            assert measured == pytest.approx(theoretical_bubble(p, m)) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(p, m, v) for p, m, v in INTERLEAVED_CASES if p > 1 and v > 1])
def test_interleaving_shrinks_the_bubble(p, m, v):
    interleaved = simulate(make_schedule("interleaved", p, m, v), 1, 1).bubble
    assert interleaved < simulate(make_schedule("1f1b", p, m), 1, 1).bubble
    assert interleaved == pytest.approx((p - 1) / (v * m + p - 1))  # Megatron's bubble time / v, exactly
    assert theoretical_bubble(p, m, v) == pytest.approx((p - 1) / (m + p - 1) / v)


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in ((2, 4), (4, 4), (4, 8)):
        assert make_schedule("interleaved", p, m, 1) == one_f_one_b(p, m)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8)])
def test_zero_bubble_h1_beats_1f1b(p, m):
    # F = B(input) = W = 1: the 1F1B bubble lasts (p-1)(F+B+W), ZB-H1's (p-1)(F+B-W) (Qi et al.)
    zb = simulate(make_schedule("zb1", p, m), forward_time=1, backward_time=2, weight_time=1)
    plain = simulate(make_schedule("1f1b", p, m), forward_time=1, backward_time=2)
    assert plain.makespan == 3 * m + 3 * (p - 1)
    assert zb.makespan == 3 * m + (p - 1)


def test_format_grid_shows_every_rank():
    schedule = make_schedule("interleaved", 4, 4, 2)
    grid = format_grid(schedule)
    header = grid.splitlines()[0]
    assert all(f"rank {r}" in header for r in range(4))
    assert len(grid.splitlines()) == 1 + 2 * 4 * 2  # header + 16 compute steps per rank
    assert "SEND" not in grid and "SEND_F0@s0->s1" in format_grid(schedule, comms=True)


def test_action_strings():
    assert str(Action("F", 3, 1)) == "F3@s1"
    assert str(Action("SEND_F", 3, 1, 2)) == "SEND_F3@s1->s2"
    assert str(Action("RECV_B", 0, 2, 3)) == "RECV_B0@s2<-s3"


def test_swapped_receives_are_reported_with_the_rank():
    schedule = make_schedule("1f1b", 4, 6)
    actions = schedule[2]
    first, second = (actions.index(Action("RECV_F", i, 2, 1)) for i in (1, 2))
    actions[first], actions[second] = actions[second], actions[first]
    with pytest.raises(ScheduleError, match=r"rank 2: RECV_F2@s2<-s1 does not match") as info:
        simulate(schedule)
    assert "rank 3" in str(info.value) and ">>" in str(info.value), "the grid comes with the error"


def test_dropped_send_deadlocks_naming_the_stuck_rank():
    schedule = make_schedule("1f1b", 4, 6)
    schedule[1].remove(Action("SEND_F", 5, 1, 2))
    with pytest.raises(DeadlockError, match=r"rank 2 waits at RECV_F5@s2<-s1") as info:
        simulate(schedule)
    assert ">>RECV_F5@s2<-s1" in str(info.value), "the grid marks where the rank is stuck"


def test_receive_before_own_send_deadlocks():
    schedule = make_schedule("1f1b", 2, 2)
    rank0 = schedule[0]
    rank0.remove(Action("RECV_B", 0, 0, 1))
    rank0.insert(0, Action("RECV_B", 0, 0, 1))  # waits for a gradient of a forward it never sent
    with pytest.raises(DeadlockError, match=r"rank 0 waits at RECV_B0@s0<-s1.*"
                                            r"rank 1 waits at RECV_F0@s1<-s0"):
        simulate(schedule)


def test_missing_compute_and_unreceived_send_are_errors():
    schedule = make_schedule("gpipe", 2, 2)
    schedule[1].remove(Action("B", 1, 1))
    schedule[1].remove(Action("SEND_B", 1, 1, 0))
    schedule[0].remove(Action("RECV_B", 1, 0, 1))
    schedule[0].remove(Action("B", 1, 0))
    with pytest.raises(ScheduleError, match="missing from the schedule: B1@s0, B1@s1"):
        simulate(schedule)
    schedule = make_schedule("gpipe", 2, 2)
    schedule[1].remove(Action("RECV_F", 1, 1, 0))
    schedule[1].insert(len(schedule[1]), Action("RECV_F", 1, 1, 0))
    with pytest.raises(DeadlockError, match="rank 1 waits at F1@s1"):
        simulate(schedule)
    schedule = make_schedule("gpipe", 2, 2)
    schedule[0].insert(2, Action("SEND_F", 0, 0, 1))  # the activation of micro-batch 0 sent twice
    with pytest.raises(ScheduleError, match=r"rank 1: RECV_F1@s1<-s0 does not match the send order; "
                                            r"the next message on channel s0->s1 is F0"):
        simulate(schedule)
    schedule = make_schedule("gpipe", 2, 2)
    schedule[0].append(Action("SEND_F", 1, 0, 1))  # sent again after everything is done
    with pytest.raises(ScheduleError, match=r"sends that no rank receives: s0->s1: \['F1'\]"):
        simulate(schedule)
    schedule = make_schedule("gpipe", 2, 2)
    schedule[0].append(Action("SEND_B", 1, 0, 1))  # a gradient sent the wrong way
    with pytest.raises(ScheduleError, match="does not go to the neighbouring stage"):
        simulate(schedule)


def test_communication_time_delays_the_receiver():
    # one micro-batch through two ranks: F, message, F, B, message, B
    result = simulate(make_schedule("1f1b", 2, 1), forward_time=1, backward_time=2, comm_time=0.5)
    assert result.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    starts = [(start, a) for start, _, a in result.timelines[1]]
    assert starts == [(1.5, Action("F", 0, 1)), (2.5, Action("B", 0, 1))]


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'; "
                                         "known: gpipe, 1f1b, interleaved, zb1"):
        make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        make_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        make_schedule("gpipe", 0, 4)
    with pytest.raises(ValueError, match="divisible by num_stages.*m=6, p=4; use m = 8"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="divisible"):
        make_schedule("interleaved", 4, 2, 2)  # m < p
    with pytest.raises(ValueError, match="chunks=2 needs 'interleaved'"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="chunks must be"):
        make_schedule("interleaved", 2, 4, 0)
