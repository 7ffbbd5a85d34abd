"""Pipeline schedules, the discrete-event simulator and timeline plots (autopar.pipeline)."""
import json
from collections import Counter

import pytest

from autopar.errors import StrategyError
from autopar.pipeline.schedule import (SCHEDULES, Action, Event, Timeline, bubble_fraction, build_schedule,
                                       check_schedule, makespan_lower_bound, simulate,
                                       simulate_schedule)
from autopar.pipeline.timeline import plot_timeline

F, B = "F", "B"


def _cases(pps=(1, 2, 4, 8)):
    """(pp, m) with m in {pp, 2pp, 8, 32} and m >= pp."""
    return [(pp, m) for pp in pps for m in sorted({pp, 2 * pp, 8, 32}) if m >= pp]


def _uniform(schedule: str, pp: int, m: int, chunks: int = 1, p2p: float = 0.0) -> Timeline:
    """Stages of forward 1 and backward 2 in all, split evenly over each rank's chunks."""
    stages = pp * chunks
    return simulate(build_schedule(schedule, pp, m, chunks), [1 / chunks] * stages, [2 / chunks] * stages, p2p)


# --- schedules -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,pp,m,chunks", [
    *[(s, pp, m, 1) for s in ("gpipe", "1f1b") for pp, m in _cases()],
    *[("interleaved", pp, k * pp, c) for pp in (1, 2, 4) for c in (2, 4) for k in (1, 2, 4)],
])
def test_every_action_once_in_a_valid_order(schedule, pp, m, chunks):
    actions = build_schedule(schedule, pp, m, chunks)
    assert len(actions) == pp
    for rank_actions in actions:
        assert Counter(rank_actions) == Counter(Action(k, i, c) for k in (F, B) for i in range(m)
                                                for c in range(chunks))
        where = {a: n for n, a in enumerate(rank_actions)}
        assert all(where[Action(B, i, c)] > where[Action(F, i, c)] for i in range(m) for c in range(chunks))
        for kind in (F, B):
            for c in range(chunks):
                assert [a.microbatch for a in rank_actions if a.kind == kind and a.chunk == c] == list(range(m))
    _uniform(schedule, pp, m, chunks)          # deadlock-free: the simulator finishes


def test_action_stage_is_chunk_times_pp_plus_rank():
    assert Action(F, 0, 2).stage(rank=1, pp=4) == 9
    assert Action(B, 3).stage(rank=2, pp=4) == 2


def test_one_f_one_b_warms_up_then_alternates():
    actions = build_schedule("1f1b", 4, 6)
    assert [a.kind for a in actions[0]] == [F, F, F] + [F, B] * 3 + [B, B, B]
    assert [a.kind for a in actions[3]] == [F, B] * 6


def test_interleaved_follows_megatron_order():
    rank0 = build_schedule("interleaved", 2, 4, chunks=2)[0]
    # warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards: mb 0,1 on chunk 0, then mb 0,1 on chunk 1
    assert rank0[:4] == [Action(F, 0, 0), Action(F, 1, 0), Action(F, 0, 1), Action(F, 1, 1)]
    # then 1F1B; the backwards start on the last chunk
    assert rank0[4:6] == [Action(F, 2, 0), Action(B, 0, 1)]


# --- rules ---------------------------------------------------------------------------------------------

def test_rules():
    with pytest.raises(StrategyError, match="micro_batch_num"):
        check_schedule("1f1b", 4, 2)
    with pytest.raises(StrategyError, match="multiple"):
        check_schedule("interleaved", 4, 6, chunks=2)
    with pytest.raises(StrategyError, match="chunks >= 2"):
        check_schedule("interleaved", 4, 8, chunks=1)
    with pytest.raises(StrategyError, match="schedule=interleaved"):
        check_schedule("gpipe", 4, 8, chunks=2)
    with pytest.raises(StrategyError, match="gpipe, 1f1b, interleaved"):
        check_schedule("zero-bubble", 4, 8)
    with pytest.raises(StrategyError, match="pp=0"):
        build_schedule("1f1b", 0, 8)
    for schedule in SCHEDULES:
        check_schedule(schedule, 1, 1, 2 if schedule == "interleaved" else 1)


# --- simulator -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", _cases())
def test_uniform_bubble_makespan_and_memory(schedule, pp, m):
    tl = _uniform(schedule, pp, m)
    assert tl.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-9)
    assert tl.bubble_fraction == pytest.approx(bubble_fraction(schedule, pp, m), abs=1e-9)
    assert tl.makespan == pytest.approx((m + pp - 1) * 3, abs=1e-9)
    assert tl.busy == pytest.approx([3.0 * m] * pp)
    if schedule == "gpipe":
        assert tl.peak_in_flight == [m] * pp
    else:
        assert tl.peak_in_flight == [min(pp - r, m) for r in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaving_shrinks_the_bubble(pp, chunks, k):
    m = k * pp
    tl = _uniform("interleaved", pp, m, chunks)
    one = _uniform("1f1b", pp, m)
    assert tl.busy == pytest.approx(one.busy)
    assert tl.makespan < one.makespan
    assert tl.bubble_fraction < one.bubble_fraction
    assert bubble_fraction("interleaved", pp, m, chunks) < bubble_fraction("1f1b", pp, m)
    # Exact, not approximate: with every chunk taking 1/chunks of a stage, Megatron's warm-up keeps the
    # last rank busy from its first forward on, so the idle time is the (pp-1) chunk-slots of ramp-up.
    assert tl.bubble_fraction == pytest.approx((pp - 1) / (m * chunks + pp - 1), abs=1e-9)
    assert tl.bubble_fraction == pytest.approx(bubble_fraction("interleaved", pp, m, chunks), abs=1e-9)


def test_pp1_has_no_bubble():
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        tl = _uniform(schedule, 1, 4, chunks)
        assert tl.makespan == pytest.approx(12.0)
        assert tl.bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_slow_stage_sets_the_pace():
    # gpipe, pp=4, m=4, stage 2 twice as slow. Forwards reach the last stage after the first
    # microbatch's trip (1+1+2+1) plus 3 more of the slowest forward (2); the backwards then take
    # their trip (2+2+4+2) plus 3 more of the slowest backward (4): 5 + 6 + 10 + 12 = 33.
    fwd, bwd = [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0]
    tl = simulate(build_schedule("gpipe", 4, 4), fwd, bwd)
    assert tl.makespan == 33.0
    assert tl.busy == [12.0, 12.0, 24.0, 12.0]
    assert _uniform("gpipe", 4, 4).makespan == 21.0


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_p2p_adds_two_transfers_per_boundary(pp):
    # one microbatch (below MindFormers' m >= pp, so listed by hand): a trip down and back up
    one = [[Action(F, 0), Action(B, 0)] for _ in range(pp)]
    tl = simulate(one, [1.0] * pp, [2.0] * pp, 0.25)
    assert tl.makespan == pytest.approx(3 * pp + 2 * (pp - 1) * 0.25)
    assert simulate(one, [1.0] * pp, [2.0] * pp, [0.25] * (pp - 1)).makespan == pytest.approx(tl.makespan)
    # with m = pp on uniform stages the microbatches follow back to back: the same delay is added
    assert _uniform("gpipe", pp, pp, p2p=0.25).makespan == pytest.approx(3 * (2 * pp - 1) + 2 * (pp - 1) * 0.25)


@pytest.mark.parametrize("schedule,pp,m,chunks", [
    *[(s, pp, m, 1) for s in ("gpipe", "1f1b") for pp, m in _cases()],
    *[("interleaved", pp, k * pp, c) for pp in (2, 4) for c in (2, 4) for k in (1, 2, 4)],
])
def test_makespan_lower_bound_holds(schedule, pp, m, chunks):
    """Fill, work and drain: never above the simulated makespan (the search skips
    simulating pipelines on it), and equal to it on balanced 1F1B stages without transfers."""
    import random
    rng = random.Random(pp * 1000 + m * 10 + chunks)
    stages = pp * chunks
    actions = build_schedule(schedule, pp, m, chunks)
    for _ in range(5):
        fwd = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        bwd = [2 * f * rng.uniform(0.8, 1.2) for f in fwd]
        p2p = [rng.uniform(0.0, 0.3) for _ in range(stages - 1)]
        assert makespan_lower_bound(pp, m, fwd, bwd, p2p) <= simulate(actions, fwd, bwd, p2p).makespan * (1 + 1e-12)
    if schedule == "1f1b":
        even = simulate(actions, [1.0] * stages, [2.0] * stages).makespan
        assert makespan_lower_bound(pp, m, [1.0] * stages, [2.0] * stages, [0.0] * (stages - 1)) == \
            pytest.approx(even, rel=1e-12)


@pytest.mark.parametrize("schedule,pp,m,chunks", [
    ("gpipe", 4, 8, 1), ("1f1b", 1, 3, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 32, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 16, 2), ("interleaved", 4, 8, 4),
])
def test_simulate_schedule_equals_simulate(schedule, pp, m, chunks):
    """The kept order of a named schedule gives the timeline simulate gives its
    action lists, time for time, whatever the stage times (and on a second call,
    which reuses the order)."""
    import random
    rng = random.Random(pp * 100 + m + chunks)
    stages = pp * chunks
    for _ in range(3):
        fwd = [rng.uniform(0.1, 2.0) for _ in range(stages)]
        bwd = [rng.uniform(0.1, 4.0) for _ in range(stages)]
        p2p = [rng.uniform(0.0, 0.5) for _ in range(stages - 1)]
        want = simulate(build_schedule(schedule, pp, m, chunks), fwd, bwd, p2p)
        got = simulate_schedule(schedule, pp, m, chunks, fwd, bwd, p2p)
        assert (got.makespan, got.busy, got.peak_in_flight) == (want.makespan, want.busy, want.peak_in_flight)
        assert got.events == want.events
    with pytest.raises(ValueError, match="len\\(fwd\\)"):
        simulate_schedule(schedule, pp, m, chunks, [1.0] * (stages + 1), [1.0] * (stages + 1))

def test_backward_before_its_own_forward_deadlocks():
    actions = [[Action(F, 0), Action(B, 0)], [Action(B, 0), Action(F, 0)]]
    with pytest.raises(RuntimeError, match="rank 1"):
        simulate(actions, [1.0, 1.0], [2.0, 2.0])


def test_cross_rank_deadlock_names_both_ranks():
    # rank 0 waits for B(mb 0) from rank 1, which waits for F(mb 1) that rank 0 only runs afterwards
    actions = [[Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)],
               [Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)]]
    with pytest.raises(RuntimeError, match="rank 0.*rank 1"):
        simulate(actions, [1.0, 1.0], [2.0, 2.0])


def test_malformed_input():
    with pytest.raises(ValueError, match="more than once"):
        simulate([[Action(F, 0), Action(F, 0), Action(B, 0)]], [1.0], [1.0])
    with pytest.raises(ValueError, match="len\\(fwd\\)"):
        simulate(build_schedule("1f1b", 2, 2), [1.0], [1.0])
    with pytest.raises(ValueError, match="p2p"):
        simulate(build_schedule("1f1b", 2, 2), [1.0] * 2, [1.0] * 2, [0.1, 0.1])
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0)


# --- timelines -----------------------------------------------------------------------------------------

def test_from_events_round_trip():
    tl = simulate(build_schedule("interleaved", 4, 8, 2), [0.1, 0.2, 0.1, 0.3, 0.2, 0.1, 0.1, 0.2],
                  [0.2, 0.4, 0.2, 0.5, 0.3, 0.2, 0.2, 0.4], 0.01)
    assert len(tl.events) == 4 * 8 * 2 * 2
    again = Timeline.from_events(tl.events, pp=4, chunks=2)
    assert again.makespan == tl.makespan
    assert again.busy == pytest.approx(tl.busy)
    assert again.peak_in_flight == tl.peak_in_flight
    shifted = [Event(e.rank, e.stage, e.kind, e.microbatch, e.chunk, e.start + 100.0, e.end + 100.0)
               for e in tl.events]
    assert Timeline.from_events(shifted, pp=4, chunks=2).makespan == pytest.approx(tl.makespan)


def test_to_dict_is_json_and_rounded():
    tl = simulate(build_schedule("1f1b", 2, 2), [1 / 3, 1 / 3], [2 / 3, 2 / 3])
    d = json.loads(json.dumps(tl.to_dict()))
    assert d["pp"] == 2 and d["chunks"] == 1 and d["peak_in_flight"] == [2, 1]
    assert d["makespan"] == 3.0 and d["busy"] == [2.0, 2.0]
    assert len(d["events"]) == 8 and d["events"][0] == [0, 0, "F", 0, 0, 0.0, 0.333333]
    assert d["event_fields"][5:] == ["start", "end"]


def test_plot_timeline(tmp_path):
    tl = _uniform("interleaved", 4, 8, 2, p2p=0.05)
    single = plot_timeline(tl, tmp_path / "predicted.png", title="interleaved pp=4")
    assert single.stat().st_size > 0 and single.read_bytes()[:4] == b"\x89PNG"
    measured = Timeline.from_events([Event(e.rank, e.stage, e.kind, e.microbatch, e.chunk, e.start * 1.1,
                                           e.end * 1.1) for e in tl.events], pp=4, chunks=2)
    both = plot_timeline(tl, tmp_path / "both.png", measured=measured)
    assert both.stat().st_size > single.stat().st_size // 2


def test_large_schedule_simulates():
    tl = _uniform("1f1b", 64, 2048)
    assert tl.makespan == pytest.approx((2048 + 63) * 3)
