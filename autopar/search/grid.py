"""The search over the mesh and the memory options, with the per-op
choice of the tensor-parallel axis made by a selectable :class:`Sharder`.

For every way the devices factor into ``dp x tp`` (tp sizes the model
allows; tp inside a node first, as :class:`cost_models.MeshTopology` lays
the mesh out), the fewest microbatches that fit are kept for each
(recompute, zero) choice: more microbatches only lower activation memory
and add per-microbatch overheads in this cost model, so the count is found
by bisection on the Megatron placements, and the per-op search runs at that
count and one below. Per configuration, the request's
:class:`~autopar.search.planner.Planner` decides the tensor-parallel axis
(:meth:`~autopar.search.planner.Planner.choose`) by its mode:

* ``mode="grid"``: the Megatron-style manual sharding only (the exhaustive
  manual grid);
* ``mode="ilp"``: the intra-operator ILP (:mod:`autopar.search.ilp`), first
  for time alone; if that plan does not fit, again under the memory bound.
  The manual sharding of the same configuration is evaluated too and kept
  where it is better (the ILP optimum includes it, so this only guards
  against the linearised memory model; ``SearchResult.won`` counts it);
* ``mode="greedy"``: greedy propagation by time (the fast heuristic), with
  the manual sharding as the same guard.

User pins (``(node, placement)`` pairs) constrain every sharder.

Pipelines (``pp > 1``) add lines per (tp, pp, recompute, zero, schedule).
More microbatches shrink the bubble there, so the time is not monotone in
the count: every count is evaluated (Megatron placements, stages balanced by
:func:`autopar.pipeline.partition.balance`), first with a lower bound on the
makespan, then, in bound order, with the simulated schedule until the bound
passes the best time found. The per-op search then runs on the pipelined
configurations within ``PIPE_MARGIN`` of the best time found, the
``PIPE_SEARCHED`` fastest first.
The schedules searched are 1F1B and interleaved 1F1B with two chunks; GPipe
has 1F1B's timeline with more activations in flight, so it never wins and is
only searched when asked (``schedules=``). ZeRO 2 and 3 are not combined with
pipelines (their per-microbatch gradient and weight traffic is what
DeepSpeed refuses there too).

Every line with ``tp > 1`` comes with and without Megatron sequence
parallelism. Offloading the optimizer state to the host is the last resort,
as in MindSpore: it is searched only when nothing fits without it. When
nothing fits even then, :func:`smallest_fitting_devices` finds the fewest
devices of the cluster's kind that would, for the error message.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from ..cost import MEMORY_HEADROOM, Estimate, fsdp_layer_params, tp_valid_sizes
from ..errors import NoFeasibleStrategyError, StrategyError
from ..graph import Graph
from ..pipeline.partition import units
from ..sharding import has_layers, meeting_limits, samples_meet
from ..spec import MESH_MODES, ParallelConfig, divisors
from ..strategies.context import cp_choices
from .ilp import InfeasiblePins
from .planner import MANUAL, Planner, Sharder, Tally

PIPE_SCHEDULES = ("1f1b", "interleaved")
PIPE_MARGIN = 1.10     # pipelined configurations this close to the best time get the per-op search
PIPE_SEARCHED = 8      # and at most this many of them
PIPE_PROGRESS = 10     # progress steps the pipelined configurations count for
COPIES = (2, 4)        # multi-copy counts tried (on flat configurations whose bound may win)


@dataclass
class SearchResult:
    """The outcome of :func:`search_grid`: the best strategy, its
    configuration and sharder, how many were evaluated and fit, the five
    best, and what the per-op search did (``won``: per sharder label, the
    configurations whose best placements it gave)."""

    best: Estimate
    best_config: ParallelConfig
    candidates: int
    feasible: int
    time_s: float
    top: list[Estimate] = field(default_factory=list)
    best_sharder: Sharder = MANUAL
    mode: str = "grid"
    won: dict[str, int] = field(default_factory=dict)     # configs searched per op: whose plan was best
    ilp_solves: int = 0
    ilp_time_s: float = 0.0


def _sp_choices(graph: Graph, tp: int, options: bool = True) -> tuple[bool, ...]:
    """Sequence parallelism where it applies: tp > 1 and norms on (batch, sequence, hidden) values
    whose sequence length tp divides (a ViT's 197 tokens: never; the search skips it, it does
    not fail on it)."""
    if tp == 1 or not options:
        return (False,)
    seqs = graph.memo(("sequence_norms",), lambda: {
        nd.out.shape[-2] for nd in graph.nodes
        if nd.normalizes and nd.out is not None and len(nd.out.shape) >= 3})
    return (False, True) if seqs and all(t % tp == 0 for t in seqs) else (False,)


def grid_configs(graph: Graph, devices: int, global_batch: int, *,
                 offload: str = "none", memory_options: bool = True) -> list[list[ParallelConfig]]:
    """The grid, as lists of configs ordered by increasing microbatches (one
    list per tp x cp x sequence parallel x recompute x zero choice; with
    ``memory_options=False`` only the plain ones: no recompute, ZeRO or
    sequence parallelism). Context parallelism (cp > 1) only for attention
    over long sequences (:func:`autopar.strategies.context.cp_choices`:
    16k positions or more), or where the batch is too small for data and
    tensor parallelism to give every device a part (dataset slicing), so
    short-sequence grids at ample batches are unchanged."""
    tps = [t for t in tp_valid_sizes(graph) if devices % t == 0]
    recomputes = ("none", "selective", "full") if memory_options and has_layers(graph) else ("none",)
    zeros = (0, 1, 2, 3) if memory_options else (0,)
    cps = cp_choices(graph, devices, small_batch=bool(tps) and global_batch * max(tps) < devices)
    out = []
    for tp in tps:
        for cp in cps:
            if devices % (tp * cp):
                continue
            dp = devices // (tp * cp)
            if global_batch % dp:
                continue
            mbs = divisors(global_batch // dp)
            for sp in _sp_choices(graph, tp, memory_options):
                for rc in recomputes:
                    for z in zeros:
                        if z and dp * cp == 1:     # nothing to shard over
                            continue
                        out.append([ParallelConfig(dp=dp, tp=tp, cp=cp, microbatches=m, recompute=rc, zero=z,
                                                   sequence_parallel=sp, offload=offload) for m in mbs])
    return out


GRID_DEPTHS = (2, 4)     # the depths of 2.5d grids the search tries


def grid2d_configs(graph: Graph, devices: int, global_batch: int, *, offload: str = "none",
                   memory_options: bool = True, mode: str = "2d") -> list[list[ParallelConfig]]:
    """The ``tp_mode=2d`` lines: ``tp = q^2`` on a ``q x q`` grid for every
    ``q > 1`` the model allows as a 1d tp size (its columns split the heads),
    with the microbatches whose samples per data-parallel rank the grid's rows
    divide, times context parallelism (where :func:`cp_choices` offers it),
    Megatron's sequence parallelism on the columns (where their size divides
    the sequence), recompute and ZeRO 0-3 (their pipelines are
    :func:`pipeline_configs`').
    ``mode="2.5d"``: the same grids ``d`` deep (``tp = d q^2``, ``d`` of
    :data:`GRID_DEPTHS`), the samples split over depth x rows; ``mode="3d"``:
    the ``q x q x q`` cubes (``tp = q^3``), the samples split over depth x rows."""
    recomputes = ("none", "selective", "full") if memory_options and has_layers(graph) else ("none",)
    zeros = (0, 1, 2, 3) if memory_options else (0,)
    out = []
    for q in tp_valid_sizes(graph):
        for d in (GRID_DEPTHS if mode == "2.5d" else (q,) if mode == "3d" else (1,)):
            tp = d * q * q
            if q == 1 or devices % tp:
                continue
            for cp in cp_choices(graph, devices // tp):     # each divides devices // tp
                if global_batch % (devices // (tp * cp)):
                    continue
                dp = devices // (tp * cp)
                mbs = [m for m in divisors(global_batch // dp) if (global_batch // dp // m) % (d * q) == 0]
                keys = {"tp_mode": mode, **({"tp_depth": d} if mode == "2.5d" else {})}
                for sp in _sp_choices(graph, q, memory_options):    # Megatron's split on the columns
                    for rc in recomputes:
                        for z in zeros:
                            if mbs and not (z and dp * cp == 1):
                                out.append([ParallelConfig(dp=dp, tp=tp, cp=cp, microbatches=m, recompute=rc,
                                                           zero=z, sequence_parallel=sp, offload=offload, **keys)
                                            for m in mbs])
    return out


def pipeline_configs(graph: Graph, devices: int, global_batch: int, *,
                     schedules: tuple[str, ...] = PIPE_SCHEDULES, offload: str = "none",
                     memory_options: bool = True, devices_per_node: int | None = None,
                     tp_modes: tuple[str, ...] = ("1d",)) -> list[ParallelConfig]:
    """Pipelined configurations: ``pp`` up to the number of repeated layers,
    every schedule of ``schedules`` (interleaved with 2 chunks), and the
    microbatch counts ``m >= pp`` dividing the per-replica batch (a
    multiple of ``pp`` when interleaved); context parallelism (cp > 1) where
    :func:`autopar.strategies.context.cp_choices` offers it (attention over
    long sequences: Llama 3 trained 405B at 128k positions with cp=16 and
    pp=16). With ``devices_per_node``, a
    stage of more devices than a node that are not whole nodes is left out
    (its groups would straddle nodes, which the cluster model does not
    describe: 1920 A100 at pp=32 gives stages of 60). ``tp_modes``: the
    tensor-parallel grids (``2d``, ``2.5d``, ``3d``) are pipelined too, each
    stage on a ``dp x grid`` sub-mesh (sequence parallelism on the grid's
    columns; the samples of a microbatch divisible by the grid's rows, times
    its depth)."""
    try:
        n_layers = units(graph).layers
    except StrategyError:   # no repeated layers in sequence: nothing to pipeline
        return []
    recomputes = ("none", "selective", "full") if memory_options else ("none",)
    zeros = (0, 1) if memory_options else (0,)
    out = []
    for mode, tp, grid_keys, rows in _pipelined_tp(graph, devices, tp_modes):
        for cp in cp_choices(graph, devices // tp):
            for pp in divisors(devices // (tp * cp)):
                if pp == 1 or pp > n_layers:
                    continue
                stage = devices // pp
                if devices_per_node and stage > devices_per_node and stage % devices_per_node:
                    continue
                dp = devices // (tp * pp * cp)
                if global_batch % dp:
                    continue
                # sequence parallelism splits the norms over a grid's columns (tp / rows of them)
                got = _pipelines(graph, n_layers, dp, tp, pp, cp, global_batch // dp, schedules, recomputes,
                                 zeros, offload, memory_options, sp_size=tp // rows)
                if mode != "1d":
                    got = [dataclasses.replace(c, **grid_keys) for c in got
                           if (global_batch // dp // c.microbatches) % rows == 0]
                out.extend(got)
    return out


def _pipelined_tp(graph: Graph, devices: int, tp_modes: tuple[str, ...]) -> list[tuple[str, int, dict, int]]:
    """``(mode, tp, the grid's strategy keys, the ranks a microbatch's
    samples are split over)`` of every tensor-parallel layout a pipeline
    stage may take: the 1d sizes, then the grids of ``tp_modes`` (as
    :func:`grid2d_configs` lays them out)."""
    out = [("1d", t, {}, 1) for t in tp_valid_sizes(graph) if devices % t == 0]
    for mode in ("2d", "2.5d", "3d"):
        if mode not in tp_modes:
            continue
        for q in tp_valid_sizes(graph):
            for d in (GRID_DEPTHS if mode == "2.5d" else (q,) if mode == "3d" else (1,)):
                tp = d * q * q
                if q > 1 and devices % tp == 0:
                    out.append((mode, tp, {"tp_mode": mode, **({"tp_depth": d} if mode == "2.5d" else {})},
                                d * q))
    return out


def _pipelines(graph: Graph, n_layers: int, dp: int, tp: int, pp: int, cp: int, per_replica: int,
               schedules: tuple[str, ...], recomputes: tuple[str, ...], zeros: tuple[int, ...], offload: str,
               memory_options: bool, sp_size: int | None = None) -> list[ParallelConfig]:
    """The pipelined configurations of one ``dp x tp x pp x cp`` split (see
    :func:`pipeline_configs`): every schedule, sequence parallel choice (over
    ``sp_size`` ranks: ``tp``, or a grid's columns),
    recompute, ZeRO stage and microbatch count ``m >= pp`` dividing the
    per-replica batch (a multiple of ``pp`` when interleaved)."""
    out = []
    counts = [m for m in divisors(per_replica) if m >= pp]
    for sched in schedules:
        chunks = 2 if sched == "interleaved" else 1
        if pp * chunks > n_layers:
            continue
        for sp in _sp_choices(graph, sp_size or tp, memory_options):
            for rc in recomputes:
                for z in zeros:
                    if z and dp * cp == 1:
                        continue
                    out.extend(ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, microbatches=m, schedule=sched,
                                              recompute=rc, zero=z, chunks=chunks, sequence_parallel=sp,
                                              offload=offload)
                               for m in counts if sched != "interleaved" or m % pp == 0)
    return out


def search_grid(planner: Planner, *, progress: Callable[[int, int], None] | None = None,
                pipeline: bool = True, schedules: tuple[str, ...] = PIPE_SCHEDULES,
                memory_options: bool = True, tp_modes: tuple[str, ...] = ("1d",)) -> SearchResult:
    """Best fitting strategy of ``planner``'s request (lowest predicted step
    time; ties go to the smaller pp, then smaller tp, then fewer
    microbatches; ``pipeline=False`` leaves pipelines out), the
    tensor-parallel axis decided as the planner's mode says (see the module
    docstring). ``memory_options=False`` searches the plain strategies only
    (no recompute, ZeRO, sequence parallelism or offload). ``tp_modes``:
    the tensor-parallel layouts tried, ``("1d",)`` by default; with ``"2d"``
    also the q x q grids, with ``"2.5d"`` the grids 2 and 4 deep, with
    ``"3d"`` the q x q x q cubes (:func:`grid2d_configs`). Raises
    :class:`NoFeasibleStrategyError` when nothing fits, naming the closest
    and the fewest devices that would fit."""
    t0 = time.perf_counter()
    cluster, global_batch = planner.cluster, planner.global_batch
    try:
        return _search(planner, progress, pipeline, schedules, "none", t0, memory_options, tp_modes)
    except NoFeasibleStrategyError as first:
        if not memory_options:
            raise
        if cluster.host is None:
            raise
        try:   # the last resort: the optimizer state in host memory
            return _search(planner, progress, pipeline, schedules, "optimizer", t0, True, tp_modes)
        except NoFeasibleStrategyError:
            pass
        need = smallest_fitting_devices(planner)
        hint = (f"; the smallest number of {cluster.device.name} devices on which {planner.graph.name} fits at "
                f"global batch {global_batch} is {need[0]} ({need[1].strategy}, "
                f"{need[1].peak_memory_bytes / 2**30:.3g} GiB per device)" if need else
                f"; it does not fit on any number of {cluster.device.name} devices up to {MAX_DEVICES} at "
                f"global batch {global_batch} either")
        raise NoFeasibleStrategyError(str(first) + " (also with recompute, every ZeRO stage, sequence parallelism "
                                      "and the optimizer state offloaded to the host)" + hint) from None


MAX_DEVICES = 1 << 17


def smallest_fitting_devices(planner: Planner) -> tuple[int, Estimate] | None:
    """The fewest devices (a power of two above the request's the cluster can
    have) on which a strategy fits, with that strategy: per count, the
    configurations that save the most memory (the largest tensor-parallel
    size with sequence parallelism, full recompute, microbatches of one
    sample, optimizer state offloaded, ZeRO-3 without a pipeline or ZeRO-1
    with the deepest one). None when none fits up to ``MAX_DEVICES``."""
    graph, cluster, global_batch, devices = planner.graph, planner.cluster, planner.global_batch, planner.devices
    try:
        n_layers = units(graph).layers
    except StrategyError:
        n_layers = 1
    offload = "optimizer" if cluster.host is not None else "none"
    n = 1
    while n <= devices:
        n *= 2
    while n <= MAX_DEVICES:
        try:
            cluster.check_devices(n)
        except Exception:   # more nodes than the cluster has
            return None
        tps = [t for t in tp_valid_sizes(graph) if n % t == 0]
        for tp in sorted(tps, reverse=True)[:2]:
            for pp in sorted({1, max(d for d in divisors(n // tp) if d <= n_layers)}):
                dp = n // (tp * pp)
                if global_batch % dp:
                    continue
                m = global_batch // dp
                cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=m, schedule="1f1b" if pp > 1 else "none",
                                     recompute="full", zero=3 if pp == 1 else 1,
                                     sequence_parallel=True in _sp_choices(graph, tp), offload=offload)
                try:
                    est = planner.evaluate(cfg, MANUAL, devices=n, simulate_schedule=False)
                except (StrategyError, InfeasiblePins):
                    continue
                if est.fits:
                    return n, est
        n *= 2
    return None


def _search(planner: Planner, progress, pipeline: bool, schedules: tuple[str, ...], offload: str, t0: float,
            memory_options: bool, tp_modes: tuple[str, ...] = ("1d",)) -> SearchResult:
    """One pass of :func:`search_grid` with ``offload`` (see its docstring)."""
    graph, devices, global_batch, mode = planner.graph, planner.devices, planner.global_batch, planner.mode
    planner.tally = Tally()
    lines = grid_configs(graph, devices, global_batch, offload=offload, memory_options=memory_options)
    for grid in ("2d", "2.5d", "3d"):
        if grid in tp_modes:
            lines += grid2d_configs(graph, devices, global_batch, offload=offload, memory_options=memory_options,
                                    mode=grid)
    piped = pipeline_configs(graph, devices, global_batch, schedules=schedules, offload=offload,
                             memory_options=memory_options, devices_per_node=planner.cluster.devices_per_node,
                             tp_modes=tp_modes) if pipeline else []
    meet = samples_meet(graph)
    if meet is not None:    # a split batch only by data parallelism (autopar.parallelize)
        lines = [kept for line in lines if (kept := [c for c in line if not meeting_limits(c)])]
        piped = [c for c in piped if not meeting_limits(c)]
    steps = len(lines) + (PIPE_PROGRESS if piped else 0)
    if not lines and not piped:
        raise StrategyError(f"no dp x tp split of {devices} devices divides global batch {global_batch}; "
                            f"valid tp sizes for this model: {tp_valid_sizes(graph)}")
    feasible: list = []
    closest: Estimate | None = None
    bound = float("inf")
    manual = Sharder("manual", planner.pins)
    errors: list[InfeasiblePins | None] = [None] * len(lines)
    try:
        found, evaluated = _first_fits(planner, lines, manual, errors)
        for k, (line, hit) in enumerate(zip(lines, found)):
            try:
                for i in hit[1] if hit else ():
                    cfg = line[i]
                    est, sh = planner.choose(cfg, bound) if mode != "grid" else \
                        (_ref(planner, line, hit[0], i, manual), manual)
                    if est.fits:
                        feasible.append((est, cfg, sh))
                        bound = min(bound, est.step_time_s)
                        break
                    if closest is None or est.peak_memory_bytes < closest.peak_memory_bytes:
                        closest = est
            except InfeasiblePins as e:   # the pins do not hold at this tp size: try the others
                errors[k] = e
            if progress:
                progress(k + 1, steps)
    finally:
        planner.drop_prefetched()
    pin_error = next((e for e in errors if e is not None), None)
    evaluated += _try_copies(planner, feasible, manual)
    evaluated += _try_fsdp_layers(planner, feasible)
    if piped:
        def tick(fraction: float) -> None:
            if progress:
                progress(len(lines) + round(fraction * PIPE_PROGRESS), steps)

        evaluated, closest, pin_error = _search_pipelines(planner, piped, manual, feasible, evaluated, closest,
                                                          pin_error, tick)
    meshes = tuple(m for m in ("mesh", "mesh3") if m in tp_modes)
    if meshes:     # the fastest flat and pipelined ones, as meshes
        evaluated += _try_mesh(planner, feasible, meshes)
    if not feasible and closest is None and pin_error is not None:
        raise pin_error
    if not feasible:
        assert closest is not None
        raise NoFeasibleStrategyError(
            f"no strategy fits in device memory ({closest.device_memory_bytes / 2**30:.3g} GiB); the closest, "
            f"{closest.strategy}, needs {closest.peak_memory_bytes / 2**30:.3g} GiB per device" +
            (f" (microbatches, so pipelines, and copies were left out: {graph.name}'s samples meet at "
             f"{meet}, so a loss over part of the batch would be another loss)" if meet is not None else ""))
    feasible.sort(key=lambda ec: (ec[0].step_time_s, ec[1].pp, ec[1].tp, ec[1].microbatches, ec[1].zero,
                                  ec[1].recompute, ec[1].copies))
    best, cfg, sh = feasible[0]
    return SearchResult(best=best, best_config=cfg, candidates=evaluated, feasible=len(feasible),
                        time_s=time.perf_counter() - t0, top=[e for e, _, _ in feasible[:5]],
                        best_sharder=sh, mode=mode, won=planner.tally.won, ilp_solves=planner.tally.ilp_solves,
                        ilp_time_s=planner.tally.ilp_time_s)


MESH_TRIES = 2     # the fastest configurations tp_mode=mesh refines


def _try_mesh(planner: Planner, feasible: list, modes: tuple[str, ...] = ("mesh",)) -> int:
    """``tp_mode=mesh`` (and ``mesh3``: ``modes``) as a refinement of the 1d
    configurations that fit: for the :data:`MESH_TRIES` fastest whose tp
    is not prime, the same dp, tp, pipeline, cp, microbatches, ZeRO and
    offload with the tp group as a mesh (two axes, or three
    where tp makes them) the joint program decides, with the copies and
    the sequence parallelism (on the inner axis) the configuration ran
    and without each (its recompute kept; a mesh whose unbounded program
    does not fit is solved under the memory bound,
    :meth:`Planner._mesh_bound`). One joint
    program each (a line of every microbatch count would solve one per
    count: 14 programs and 12 s for Llama-3 70B's 8 layers on 64 H100,
    against 0.8 s without). The request's pins hold on the meshes (a pin of
    one axis on the inner one). Appends
    what fits to ``feasible``; returns how many were evaluated."""
    if samples_meet(planner.graph) is not None:
        return 0
    bases: set = set()      # the flat configurations refined, their copies apart
    count = 0
    for est, cfg, _ in sorted(feasible, key=lambda f: f[0].step_time_s):
        if len(bases) >= MESH_TRIES:
            break
        if cfg.tp < 4 or cfg.tp_mode != "1d" or cfg.fsdp_layers or all(cfg.tp % d for d in range(2, cfg.tp)):
            continue
        base = dataclasses.replace(cfg, copies=1, sequence_parallel=False)
        if base in bases:
            continue
        bases.add(base)
        # with the copies and sequence parallelism the configuration ran, and without: a mesh has
        # fewer collectives to hide, and splits the norms where its program finds it pays
        variants = []
        for mode in modes:
            try:
                dataclasses.replace(base, tp_mode=mode).tp_grid     # a tp that makes this mesh
            except StrategyError:
                continue
            variants += [dataclasses.replace(base, tp_mode=mode, copies=c, sequence_parallel=sp)
                         for c in dict.fromkeys((cfg.copies, 1))
                         for sp in dict.fromkeys((cfg.sequence_parallel, False))]
        for mesh in variants:
            if mesh.pp == 1:
                # a flat mesh whose unbounded program does not fit is solved again under the memory
                # bound, which only adds to the program's time: not where the unbounded one is slower
                # than the best found already (Llama-3 70B's shape at 8 layers on 64 H100: 10.7 s -> 3.1 s)
                try:
                    free = planner.mesh_estimate(mesh)
                except StrategyError:     # e.g. pins this mesh cannot hold: as _mesh_estimate counts it
                    count += 1
                    continue
                if not free.fits and free.step_time_s >= min(f[0].step_time_s for f in feasible):
                    count += 1
                    continue
            found, n = _mesh_estimate(planner, mesh)
            count += n
            if found is not None:
                feasible.append(found)
    return count


def _mesh_estimate(planner: Planner, mesh: ParallelConfig) -> tuple[tuple | None, int]:
    """``mesh`` evaluated (under the memory bound where its unbounded
    program does not fit: :meth:`Planner._mesh_bound`): ``((estimate,
    config, sharder) or None where it does not fit, evaluations)``."""
    sharder = Sharder("ilp", planner.pins, None)     # the planner bounds it as every request does (_mesh_bound)
    try:
        est = planner.evaluate(mesh, sharder)
    except StrategyError:
        return None, 1
    return ((est, mesh, sharder) if est.fits else None), 1


def _try_copies(planner: Planner, feasible: list, manual: Sharder) -> int:
    """Multi-copy parallel (``copies``) on the fitting 1d and grid
    configurations without a pipeline, with tp > 1 and no ZeRO-3 (a mesh is
    tried with copies by :func:`_try_mesh`): every count in ``COPIES`` that
    divides the per-rank microbatch (times a grid's rows, which split each
    copy's samples), with the placements that won there and with the Megatron
    ones (``manual``). The per-op search picks placements for one copy, and
    those that cut the tensor-parallel communication most leave copies the
    least to hide, so the Megatron placements can win once copies hide
    their collectives (6.7B on 64 A100: 8.43 s against 8.65 s with the
    ILP's); nothing is solved again.
    Branch and bound: copies can at most hide ``comm_overlap * (n - 1) / n``
    of a configuration's tensor-parallel communication (no more than its
    compute; :meth:`~autopar.cost.CostModel._copies_overlap`) and cost the
    rest in the smaller ops' efficiency and the compute slowed beside the
    collectives, so (configuration, placements) pairs are tried in order of
    that bound and the search stops at the first whose bound is no faster
    than the best step found. Only where the device overlaps communication
    with compute (``comm_overlap > 0``): elsewhere copies only cost time.
    Appends what fits to ``feasible``; returns how many were evaluated."""
    overlap = planner.cluster.device.comm_overlap
    if overlap <= 0 or not feasible:
        return 0
    most = max(COPIES)
    count = 0
    pairs = []
    for est, cfg, sh in feasible:
        if cfg.tp == 1 or cfg.pp > 1 or cfg.cp > 1 or cfg.zero == 3 or cfg.tp_mode in MESH_MODES or \
                cfg.copies > 1 or samples_meet(planner.graph) is not None:
            continue
        if not any(planner.global_batch // (cfg.dp * cfg.microbatches) % (n * cfg.grid_batch_split) == 0
                   for n in COPIES):
            continue
        pairs.append((est, cfg, sh))
        if sh.mode != "manual":
            pairs.append((planner.evaluate(cfg, manual), cfg, manual))
            count += 1

    def bound(pair) -> float:
        est = pair[0]
        return est.step_time_s - overlap * (most - 1) / most * min(est.tp_comm_time_s, est.compute_time_s)

    best = min(f[0].step_time_s for f in feasible)
    for pair in sorted(pairs, key=bound):
        if bound(pair) >= best:
            break
        _, cfg, sh = pair
        per_rank = planner.global_batch // (cfg.dp * cfg.microbatches)
        for n in COPIES:
            if per_rank % (n * cfg.grid_batch_split):     # a grid's rows split each copy's samples
                continue
            c = dataclasses.replace(cfg, copies=n)
            est = planner.evaluate(c, sh)
            count += 1
            if est.fits:
                feasible.append((est, c, sh))
                best = min(best, est.step_time_s)
    return count


FSDP_TRIES = 2     # the fastest ZeRO-3 configurations fsdp_layers refines


def _try_fsdp_layers(planner: Planner, feasible: list) -> int:
    """The dp axis per layer (``fsdp_layers``): for the :data:`FSDP_TRIES`
    fastest ZeRO-3 configurations without a pipeline that fit (1d tp, no
    copies or offload), the same with ZeRO-2 and ZeRO-1 for the parameters
    outside the fewest leading layers that still fit under ZeRO-3 (where
    the ZeRO-1/2 form fits whole, its own line has it, and a mix only adds
    gathers to it). Memory falls with each layer sharded (past the second,
    whose gather FSDP2 prefetches) and time rises, so the count is found by
    bisection; the placements are the ZeRO-3 configuration's
    (:meth:`Planner._axis_key` keys a mix as ZeRO-3: nothing is solved
    again, which is also why the ZeRO-1/2 form itself is not evaluated
    here). Appends what fits to ``feasible``; returns how many were
    evaluated."""
    layers = len(fsdp_layer_params(planner.graph))     # the layers with weights of their own
    if not feasible or not layers:
        return 0
    bases = [(cfg, sh) for est, cfg, sh in sorted(feasible, key=lambda f: f[0].step_time_s)
             if cfg.zero == 3 and cfg.pp == 1 and cfg.tp_mode == "1d" and cfg.copies == 1 and
             cfg.offload == "none" and cfg.dp * cfg.cp > 1][:FSDP_TRIES]
    count = 0
    for cfg, sh in bases:
        for z in (2, 1):
            found, n = _fewest_layers(planner, dataclasses.replace(cfg, zero=z), sh, layers)
            count += n
            if found is not None:
                feasible.append(found)
    return count


def _fewest_layers(planner: Planner, low: ParallelConfig, sh: Sharder, layers: int) -> tuple[tuple | None, int]:
    """``(estimate, configuration, sharder)`` of ``low`` with the fewest
    leading layers under ZeRO-3 that fit (None where even all do not), and
    how many were evaluated: bisection over 1..``layers``, and 1 apart
    (FSDP2 gathers one layer there, two from 2 on)."""
    def fits(k: int) -> Estimate:
        return planner.evaluate(dataclasses.replace(low, fsdp_layers=k), sh)
    lo, hi, found, count = 1, layers, fits(layers), 1
    if not found.fits:
        return None, count
    while lo < hi:
        mid = (lo + hi) // 2
        e, count = fits(mid), count + 1
        if e.fits:
            hi, found = mid, e
        else:
            lo = mid + 1
    if lo > 1:
        e, count = fits(1), count + 1
        found = e if e.fits else found
    return (found, dataclasses.replace(low, fsdp_layers=found.parallel["fsdp_layers"]), sh), count


def _first_fits(planner: Planner, lines: list[list[ParallelConfig]], manual: Sharder,
                errors: list[InfeasiblePins | None]) -> tuple[list, int]:
    """Per line, the microbatch counts the per-op search tries, and the
    configurations evaluated. Memory falls as microbatches grow (activations
    are per microbatch), so the first count at which the Megatron placements
    fit is found by bisection; the per-op search then runs there and one
    count below, where it may fit by sharding activations the Megatron
    pattern leaves whole. Their ILPs are started here, HiGHS solving them on
    worker threads while the search goes on (:meth:`Planner.prefetch_choice`).
    Returns per line ``(the Megatron estimates by index, the indices to
    try)``, None where the pins do not hold (its error in ``errors``)."""
    found: list[tuple[dict[int, Estimate], list[int]] | None] = []
    evaluated = 0
    for k, line in enumerate(lines):
        try:
            memo: dict[int, Estimate] = {}
            lo, hi = 0, len(line)
            while lo < hi:
                mid = (lo + hi) // 2
                if _ref(planner, line, memo, mid, manual).fits:
                    hi = mid
                else:
                    lo = mid + 1
            first = lo if lo < len(line) else len(line) - 1
            tries = [i for i in (first - 1, first) if i >= 0]
            evaluated += len(set(memo) | set(tries))
            found.append((memo, tries))
        except InfeasiblePins as e:   # the pins do not hold at this tp size: try the others
            errors[k] = e
            found.append(None)
            continue
        if planner.mode == "ilp":
            for i in tries:
                planner.prefetch_choice(line[i])
    return found, evaluated


def _ref(planner: Planner, line: list[ParallelConfig], memo: dict[int, Estimate], i: int,
         manual: Sharder) -> Estimate:
    """The Megatron placements' estimate of ``line[i]`` (kept in ``memo``)."""
    if i not in memo:
        memo[i] = planner.evaluate(line[i], manual)
    return memo[i]


def _search_pipelines(planner: Planner, configs: list[ParallelConfig], manual: Sharder, feasible: list,
                      evaluated: int, closest: Estimate | None, pin_error: InfeasiblePins | None,
                      tick: Callable[[float], None]):
    """Evaluate the pipelined ``configs`` with the Megatron placements (the
    schedule simulated only where its lower bound can still beat the best),
    then run the per-op search on the fastest that come within
    ``PIPE_MARGIN`` of the best time so far. Appends to ``feasible``; returns the updated
    count, closest misfit and first pin error; ``tick(fraction done)``
    reports progress."""
    mode = planner.mode
    margin = 1.0 if mode == "grid" else PIPE_MARGIN   # the per-op search may still win by that much
    # Bound first (memory is exact, the makespan a lower bound), then simulate the
    # fitting ones in bound order until the bound passes the best simulated time.
    # A configuration whose bound cannot come within the margin of a fitting one
    # already found, or, once one was found, whose memory bound exceeds the
    # device's (a misfit then only named the closest misfit, for the error that
    # nothing fits), is counted without balancing its stages: it would be cut there.
    cut = margin * min((e.step_time_s for e, _, _ in feasible), default=float("inf"))
    cap = planner.cluster.device.memory_bytes * MEMORY_HEADROOM
    bounded: list[tuple[Estimate, ParallelConfig]] = []
    every = max(1, len(configs) // PIPE_PROGRESS)
    for k, cfg in enumerate(configs):
        if k % every == 0:
            tick(0.8 * k / len(configs))   # bounding is most of the work
        try:
            if planner.pipeline_lower_bound(cfg, manual) > cut or \
                    (feasible and planner.pipeline_lower_bound(cfg, manual, memory=True) > cap):
                evaluated += 1
                continue
            est = planner.evaluate(cfg, manual, simulate_schedule=False)
        except InfeasiblePins as e:
            pin_error = pin_error or e
            continue
        evaluated += 1
        if est.fits:
            bounded.append((est, cfg))
        elif closest is None or est.peak_memory_bytes < closest.peak_memory_bytes:
            closest = est
    bounded.sort(key=lambda ec: ec[0].step_time_s)
    fitting, best = _simulate_close(planner, bounded, manual, feasible, margin)
    fitting.sort(key=lambda ec: ec[0].step_time_s)
    for k, (est, cfg) in enumerate(fitting):
        if mode == "grid" or k >= PIPE_SEARCHED or est.step_time_s > PIPE_MARGIN * best:
            feasible.append((est, cfg, manual))
            continue
        e, sh = planner.choose(cfg, best)
        feasible.append((e, cfg, sh) if e.fits else (est, cfg, manual))
    tick(1.0)
    return evaluated, closest, pin_error


def _simulate_close(planner: Planner, bounded: list[tuple[Estimate, ParallelConfig]], manual: Sharder,
                    feasible: list, margin: float) -> tuple[list[tuple[Estimate, ParallelConfig]], float]:
    """The fitting pipelined configurations the search keeps, and the best
    time: ``bounded`` (bound estimates, in bound order) is simulated in turn
    until the bound passes ``margin`` times the best time found so far.

    One whose tighter bound (``pipeline["step_bound_s"]``: the fill and drain
    of the pipeline, :func:`autopar.pipeline.schedule.makespan_lower_bound`)
    cannot beat the best so far is put aside: it could not have changed the
    best, so the loop stops where it would have. After the loop, those put
    aside are simulated, in the order of their tighter bound, while they
    could still matter: within ``PIPE_MARGIN`` of the best (the per-op
    search may run on them) or among the five best so far
    (:attr:`SearchResult.top`). The others keep their bound
    estimate, timed at the tighter bound so that they stay behind those
    (they are counted as fitting, and no one reads them): the search's
    record is the same as when every one was simulated (a 96-layer GPT-3
    simulated 116 pipelines for about ten that matter)."""
    best = min((e.step_time_s for e, _, _ in feasible), default=float("inf"))
    fitting: list[tuple[Estimate, ParallelConfig]] = []
    aside: list[int] = []
    for bound, cfg in bounded:
        if bound.step_time_s > margin * best:
            break
        if bound.pipeline["step_bound_s"] >= best:
            aside.append(len(fitting))
            fitting.append((bound, cfg))
            continue
        est = planner.evaluate(cfg, manual)
        fitting.append((est, cfg))
        best = min(best, est.step_time_s)
    put = set(aside)
    known = sorted([e.step_time_s for e, _, _ in feasible] +
                   [e.step_time_s for k, (e, _) in enumerate(fitting) if k not in put])
    # in the order of their tighter bound: once one cannot matter, none after it can
    aside.sort(key=lambda k: fitting[k][0].pipeline["step_bound_s"])
    for k in aside:
        bound, cfg = fitting[k]
        tighter = bound.pipeline["step_bound_s"]
        if tighter <= max(PIPE_MARGIN * best, known[4] if len(known) > 4 else float("inf")):
            est = planner.evaluate(cfg, manual)
            bisect.insort(known, est.step_time_s)
            fitting[k] = (est, cfg)
        else:
            fitting[k] = (dataclasses.replace(bound, step_time_s=tighter), cfg)
    return fitting, best
