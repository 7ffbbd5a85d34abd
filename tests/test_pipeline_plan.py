"""Pipeline planning: stage units, the balanced partition, the schedules'
memory multipliers, the pipelined cost model and the search."""
from __future__ import annotations

import itertools
import random

import pytest

import autopar
from autopar import api
from autopar.errors import StrategyError
from autopar.pipeline import partition as pipe
from autopar.pipeline.schedule import build_schedule, simulate
from autopar.search.grid import pipeline_configs, search_grid
from autopar.spec import parse_strategy

GPT = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16"
HEAVY_HEAD = "gpt:layers=8,hidden=128,heads=4,vocab=65536,seq=64"


@pytest.fixture(scope="module")
def gpt():
    return api.as_graph(GPT)


def test_units_follow_the_layers(gpt):
    u = pipe.units(gpt)
    assert u.labels[0] == "<embed>" and u.labels[-1] == "<head>" and u.layers == 4
    first = {nd.name: u.of_node[nd.name] for nd in gpt.nodes if nd.name in u.of_node}
    assert first[next(nd.name for nd in gpt.nodes if nd.kind == "embedding")] == 0
    assert first[gpt.output] == 5
    stages = pipe.assign(gpt, [1, 2, 1])
    assert stages[gpt.output] == 2
    assert sorted(set(stages.values())) == [0, 1, 2]


def test_partition_errors(gpt):
    with pytest.raises(StrategyError, match="sum to the model's 4"):
        pipe.assign(gpt, [1, 1])
    with pytest.raises(StrategyError, match="stage 1 holds no layer"):
        pipe.assign(gpt, [2, 0, 2])
    with pytest.raises(StrategyError, match="at least 5 repeated layers"):
        pipe.even_layers(4, 7)
    # one or two stages more than layers: the embedding (and the head) alone, as Llama 3's model chunks
    assert pipe.even_layers(4, 5) == [0, 1, 1, 1, 1] and pipe.even_layers(4, 6) == [0, 1, 1, 1, 1, 0]
    mlp = api.as_graph("mlp:layers=1,hidden=32")
    if not mlp.groups:
        with pytest.raises(StrategyError, match="has none"):
            pipe.units(mlp)


def _brute_force(time, states, act, fixed, stages, flight, cap):
    """The best min-max partition by enumerating every cut."""
    n, best = len(time), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        ok, worst = True, 0.0
        for v in range(stages):
            lo, hi = b[v], b[v + 1]
            mem = sum(states[lo:hi]) + flight[v] * sum(act[lo:hi]) + max(fixed[lo:hi])
            ok &= mem <= cap
            worst = max(worst, sum(time[lo:hi]))
        if ok and (best is None or worst < best):
            best = worst
    return best


def test_balance_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        n = rng.randint(4, 9)
        stages = rng.randint(2, min(4, n))
        time = [rng.uniform(0.5, 3) for _ in range(n)]
        states = [rng.uniform(0, 2) for _ in range(n)]
        act = [rng.uniform(0, 1) for _ in range(n)]
        fixed = [rng.uniform(0, 1) for _ in range(n)]
        flight = [float(stages - v) for v in range(stages)]
        cap = rng.uniform(3, 15)
        want = _brute_force(time, states, act, fixed, stages, flight, cap)
        got = pipe.balance(time, states, act, fixed, stages, flight, cap)
        if want is None:
            assert got is None
            continue
        assert got is not None and sum(got) == n - 2
        b = pipe.unit_bounds(got)
        worst = max(sum(time[b[v]:b[v + 1]]) for v in range(stages))
        assert worst <= want * (1 + 1e-5)


def test_least_busiest_is_the_least_maximum_over_whole_layers():
    rng = random.Random(5)
    for _ in range(300):
        layers, ranks = rng.randint(1, 8), rng.randint(2, 4)
        size = rng.choice([0.0, 1.0, rng.uniform(0.01, 2)])
        first, last = (rng.uniform(0, 1) * rng.choice([0, 1, 4, 20]) for _ in range(2))
        offsets = [first] + [0.0] * (ranks - 2) + [last]
        want = min(max(k * size + o for k, o in zip(split, offsets))
                   for split in itertools.product(range(layers + 1), repeat=ranks) if sum(split) == layers)
        got = pipe.least_busiest(layers, ranks, size, first, last)
        assert want * (1 - 1e-6) - 1e-12 <= got <= want * (1 + 1e-12)


def test_pipeline_lower_bounds_hold():
    """The bounds the search prunes pipelines with never exceed what
    evaluating them gives (balanced or even stages, simulated or not), for
    every pipelined configuration of a model with a heavy head."""
    g = api.as_graph(HEAVY_HEAD)
    ev = api.planner_for(g, "dgx-a100-80g", "adamw", None, devices=16, global_batch=64)
    by_line: dict[tuple, list] = {}
    for c in pipeline_configs(g, 16, 64):
        by_line.setdefault((c.tp, c.pp, c.schedule, c.sequence_parallel, c.recompute, c.zero), []).append(c)
    assert len(by_line) > 40
    for cfg in (c for line in by_line.values() for c in {line[0], line[-1]}):    # the fewest and most microbatches
        time, memory = ev.pipeline_lower_bound(cfg), ev.pipeline_lower_bound(cfg, memory=True)
        for layers, simulated in (("balanced", True), ("balanced", False), ("even", True)):
            est = ev.evaluate(cfg, layers=layers, simulate_schedule=simulated)
            assert time <= est.step_time_s and memory <= est.peak_memory_bytes, (cfg.to_string(), layers)



def test_fill_drain_bound_holds_for_every_partition_and_schedule():
    """The pipeline search prunes with :func:`autopar.cost.fill_drain_bound`
    before any partition is chosen: it must not exceed the simulated makespan
    of any partition (each middle stage holding a layer at least) under any
    schedule, and without interleaving it is the fill and drain's least
    maximum over partitions, not far below the best partition's."""
    from autopar.cost import fill_drain_bound
    rng = random.Random(11)
    for _ in range(60):
        chunks = rng.choice([1, 1, 2])
        pp = rng.randint(2, 3)
        stages = pp * chunks
        layers = rng.randint(stages, stages + 4)
        m = rng.choice([pp, pp + 1, 4, 8]) if chunks == 1 else pp * rng.randint(1, 2)
        t = [rng.uniform(0.2, 1.0)] + [rng.uniform(0.5, 2.0) for _ in range(layers)] + [rng.uniform(0.2, 1.0)]
        bound = fill_drain_bound(pp, chunks, m, sum(t), t[0], min(t[1:-1]))
        schedules = ["gpipe", "1f1b"] if chunks == 1 else ["interleaved"]
        best = float("inf")
        for split in itertools.product(range(1, layers + 1), repeat=stages):
            if sum(split) != layers:
                continue
            b = pipe.unit_bounds(list(split))
            per = [sum(t[b[v]:b[v + 1]]) for v in range(stages)]
            fwd, bwd = [x / 3 for x in per], [2 * x / 3 for x in per]
            for sched in schedules:
                made = simulate(build_schedule(sched, pp, m, chunks), fwd, bwd).makespan
                assert bound <= made * (1 + 1e-12), (pp, chunks, m, split, sched)
                best = min(best, made)
        if chunks == 1:
            assert bound >= 0.5 * best


@pytest.mark.parametrize("schedule,pp,m,chunks", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1),
                                                   ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)])
def test_in_flight_matches_the_simulated_peak(schedule, pp, m, chunks):
    tl = simulate(build_schedule(schedule, pp, m, chunks), [1.0] * pp * chunks, [2.0] * pp * chunks)
    flight = pipe.in_flight(schedule, pp, m, chunks)
    per_rank = [sum(flight[v] for v in range(pp * chunks) if v % pp == r) for r in range(pp)]
    assert per_rank == pytest.approx([float(x) for x in tl.peak_in_flight])


def test_pipeline_work_is_the_unpipelined_work(gpt):
    """The stages split the same nodes: their busy time adds up to the
    unpipelined compute and tp comm of the same microbatches."""
    ev = api.planner_for(gpt, "dgx-a100-80g", "adamw", None, devices=4, global_batch=8)
    flat = ev.evaluate(parse_strategy("tp=2,microbatches=4", 2), devices=2)
    piped = ev.evaluate(parse_strategy("tp=2,pp=2,microbatches=4", 4))
    p = piped.pipeline
    busy = 4 * (sum(p["forward_s"]) + sum(p["backward_s"]))
    assert busy == pytest.approx(flat.compute_time_s + flat.tp_comm_time_s, rel=1e-6)
    assert 0 < p["bubble_fraction"] < 1
    # each rank holds about half the weights
    assert piped.memory["weights"] < 0.75 * flat.memory["weights"]


def test_balanced_stages_beat_even_ones_with_a_heavy_head():
    g = api.as_graph(HEAVY_HEAD)
    ev = api.planner_for(g, "dgx-a100-80g", "adamw", None, devices=4, global_batch=64)
    cfg = parse_strategy("pp=4,microbatches=16", 4)
    even = ev.evaluate(cfg, layers="even")
    bal = ev.evaluate(cfg)
    assert even.pipeline["layers"] == [2, 2, 2, 2]
    assert bal.pipeline["layers"][-1] < 2, bal.pipeline["layers"]
    assert bal.step_time_s < even.step_time_s
    fixed = ev.evaluate(cfg, layers=[3, 2, 2, 1])
    assert fixed.pipeline["layers"] == [3, 2, 2, 1]
    # the pure cost model takes the split as an input: the planner's balanced one prices the same
    sh, shapes = ev.sharding(cfg)
    assert ev.model.estimate(cfg, sh, shapes, 64, 4, bal.pipeline["layers"]) == bal
    assert ev.model.estimate(cfg, sh, shapes, 64, 4).pipeline["layers"] == [2, 2, 2, 2]
    with pytest.raises(StrategyError):
        ev.model.estimate(cfg, sh, shapes, 64, 4, [3, 2, 2])


def test_manual_pipeline_plan_records_the_stages(gpt, tmp_path):
    p = autopar.plan(gpt, cluster="cpu", devices=4, global_batch=8, strategy="pp=2,tp=2,microbatches=4")
    assert p.data["mesh"] == {"shape": [2, 1, 2], "axes": ["pp", "dp", "tp"]}
    assert p.data["pipeline"]["layers"] == [2, 2] and p.data["pipeline"]["schedule"] == "1f1b"
    assert p.config.chunks == 1 and "chunks" not in p.parallel      # a default: left out of the plan
    assert "schedule=1f1b" in p.strategy
    loaded = autopar.Plan.load(p.save(tmp_path / "p.json"))
    assert loaded.config == parse_strategy("pp=2,tp=2,microbatches=4,precision=fp32", 4)
    # 4 layers: 6 stages hold the embedding alone, one layer each, the head alone; 7 are too many
    six = autopar.plan(gpt, cluster="cpu", devices=6, global_batch=6, strategy="pp=6")
    assert six.data["pipeline"]["layers"] == [0, 1, 1, 1, 1, 0]
    with pytest.raises(StrategyError, match="7 pipeline stages need at least 5"):
        autopar.plan(gpt, cluster="cpu", devices=7, global_batch=7, strategy="pp=7")


def test_search_finds_pipelines_where_they_pay():
    """Few samples per device and a slow inter-node link: a large model on
    many small-memory devices is pipelined, and the pipelined configuration
    space respects the seeds' rules."""
    g = api.as_graph("gpt:layers=24,hidden=2048,heads=16,vocab=51200,seq=2048")
    cfgs = pipeline_configs(g, 64, 512)
    assert cfgs and all(c.microbatches >= c.pp for c in cfgs)
    assert all(c.microbatches % c.pp == 0 for c in cfgs if c.schedule == "interleaved")

    def planner(mode: str):
        return api.planner_for(g, "dgx-a100-80g", "adamw", None, devices=64, global_batch=512, mode=mode)

    res = search_grid(planner("ilp"))
    grid = search_grid(planner("grid"))
    assert res.best.step_time_s <= grid.best.step_time_s * (1 + 1e-9)
    flat = search_grid(planner("ilp"), pipeline=False)
    assert res.best.step_time_s <= flat.best.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_extrapolated_timeline_equals_the_full_simulation(schedule, chunks):
    """The cost model extrapolates the steady state of long pipelines; on
    uneven stages with transfers it must equal simulating every microbatch."""
    from autopar.cost import CostModel
    from autopar.spec import ParallelConfig
    ev = CostModel(api.as_graph(GPT), "cpu")
    rng = random.Random(3)
    for pp in (2, 4, 8):
        v = pp * chunks
        fwd = [rng.uniform(0.5, 2) for _ in range(v)]
        bwd = [f * rng.uniform(1.5, 3) for f in fwd]
        p2p = [rng.uniform(0, 0.3) for _ in range(v - 1)]
        m = 16 * pp
        cfg = ParallelConfig(pp=pp, microbatches=m, schedule=schedule, chunks=chunks)
        got = ev._simulate(cfg, fwd, bwd, p2p)
        full = simulate(build_schedule(schedule, pp, m, chunks), fwd, bwd, p2p)
        assert got.makespan == pytest.approx(full.makespan, rel=1e-9)
        assert got.busy == pytest.approx(full.busy, rel=1e-9)
        assert got.peak_in_flight == full.peak_in_flight


def test_tied_weights_across_stages_cost_an_all_reduce():
    ev_tied = api.planner_for(api.as_graph(GPT + ",tie=1"), "dgx-a100-80g", "adamw", None, devices=2,
                              global_batch=8)
    ev = api.planner_for(api.as_graph(GPT), "dgx-a100-80g", "adamw", None, devices=2, global_batch=8)
    cfg = parse_strategy("pp=2,microbatches=4", 2)
    tied, untied = ev_tied.evaluate(cfg), ev.evaluate(cfg)
    # both ranks hold a copy of the tied weight, and pay for summing its gradients
    assert tied.dp_comm_time_s > 0 == untied.dp_comm_time_s
    flat = ev_tied.evaluate(parse_strategy("microbatches=4", 1), devices=1)
    assert flat.dp_comm_time_s == 0


def test_memory_bounded_ilp_on_a_pipeline():
    """When the time-optimal placements of a pipeline do not fit, the ILP is
    solved again under the memory of the pipeline rank that needs the most;
    the search keeps the fastest plan that fits, that one or the Megatron one.
    (Here the Megatron plan wins: the ILP prices a transition per reader, the
    estimate once per value as the compiler inserts it, and Megatron's q, k
    and v share one reduction of their input's gradient.)"""
    import dataclasses

    from autopar.search.planner import Planner, Sharder
    g = api.as_graph("gpt:layers=8,hidden=512,heads=8,vocab=8192,seq=256")
    ev = api.planner_for(g, "dgx-a100-80g", "adamw", None, devices=8, global_batch=32)
    cfg = parse_strategy("pp=2,tp=4,microbatches=8", 8)
    manual, free = ev.evaluate(cfg), ev.evaluate(cfg, Sharder("ilp"))
    assert free.step_time_s < manual.step_time_s and free.peak_memory_bytes > manual.peak_memory_bytes
    limit = (manual.peak_memory_bytes + free.peak_memory_bytes) / 2
    bounded = ev.evaluate(cfg, Sharder("ilp", (), limit - free.memory["transient"]))
    assert bounded.peak_memory_bytes <= limit
    assert free.step_time_s <= bounded.step_time_s
    # the search does the same on a device with that much memory, and keeps the faster
    small = dataclasses.replace(ev.cluster, device=dataclasses.replace(ev.cluster.device,
                                                                       memory_bytes=int(limit / 0.9)))
    est, sh = Planner(g, small, devices=8, global_batch=32, mode="ilp").choose(cfg, float("inf"))
    assert est.fits and est.step_time_s == pytest.approx(min(manual.step_time_s, bounded.step_time_s))
