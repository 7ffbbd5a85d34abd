"""The public API: ``trace``, ``evaluate``, ``plan`` (and
``plan_and_record``, which also returns the search record), ``parallelize``.
Thin: each builds one :class:`~autopar.search.planner.Planner` per request
and calls the stages below it; :data:`WARM` keeps the planners' caches per
graph between requests."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import cost_models

from . import __version__
from .cost import CostModel, Estimate
from .errors import ClusterError, StrategyError
from .graph import Graph
from .plan import PLAN_VERSION, Plan, parallel_record, rounded
from .search import pins as _pins
from .search.grid import search_grid
from .search.ilp import InfeasiblePins
from .search.planner import Planner, PlannerState, SearchRecord, Sharder
from .sharding import AxisSharding, mislaid_batch, track_batch
from .spec import MESH_MODES, ParallelConfig, parse_strategy
from .spec.placement import SEP, R, axis_placements, joint_placement
from .strategies.rules import Strategy, grouped_warnings
from .trace import trace

ModelLike = "nn.Module | str | Graph"


def load_cluster(cluster: Any) -> cost_models.ClusterSpec:
    """A preset name, a cluster JSON file, a dict or a ClusterSpec."""
    try:
        return cost_models.load_cluster(cluster)
    except cost_models.ClusterError as e:
        raise ClusterError(str(e)) from None


@contextlib.contextmanager
def _collector_paused():
    """Pause the cyclic garbage collector (:func:`gc.disable`) until exit.
    Tracing and planning allocate millions of short-lived objects, so the
    collector would run its passes thousands of times, and each full pass
    walks torch's modules and the traced graph again: a cost that grows with
    the model's depth (about a fifth of planning a 96-layer GPT-3). They
    make almost no reference cycles (tracing a 96-layer GPT-3 leaves about
    13,000 cyclic garbage objects, planning it 9), which a later full pass
    frees. On exit the objects made meanwhile go straight to the oldest
    generation (:func:`gc.freeze` then :func:`gc.unfreeze`: two list splices):
    otherwise the first young pass after exit walked every one of them, the
    traced graph included, a cost that grew with the depth (0.3 s for a
    96-layer GPT-3, within the request). Left alone when the collector is
    already off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.enable()


@_collector_paused()
def as_graph(model: Any, example_inputs: Any = None, *, loss_fn: Callable | None = None,
             target: Any = None, batch: int | None = None, batch_dim: int | tuple[int, ...] = 0) -> Graph:
    """Trace ``model`` unless it already is a :class:`Graph` (its inputs'
    batch at ``batch_dim``, as :func:`trace` takes it). A zoo string is
    built on the meta device with its default loss (batch 2 by default, so the
    batch dimension can be told apart from the others), as :func:`trace` builds it."""
    if isinstance(model, Graph):
        return model
    if isinstance(model, str):
        from . import zoo
        z = zoo.build_for_planning(model, batch=batch)
        return trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target, name=z.name,
                     batch_dim=batch_dim)
    return trace(model, example_inputs, loss_fn=loss_fn, target=target, batch_dim=batch_dim)


def check_sizes(devices: Any, global_batch: Any) -> None:
    """Refuse a device count or global batch that is not a positive integer
    (clear :class:`StrategyError` before any tracing)."""
    for name, v in (("devices", devices), ("global_batch", global_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise StrategyError(f"{name} must be a positive integer, got {v!r}")


def check_trainable(graph: Graph) -> None:
    """Refuse a graph with nothing to train (no trainable parameter), and a
    loss traced with the model that is not one number (``reduction='none'``):
    both would be planned and then fail, or train wrongly, at run time."""
    if not any(p.requires_grad and not p.is_buffer for p in graph.params.values()):
        raise StrategyError(f"{graph.name} has no trainable parameters: there is nothing to train or parallelize")
    if graph.loss_prefix:
        check_loss(graph)


def check_loss(graph: Graph) -> None:
    """The traced program must end in one number: a loss that is not reduced
    (``reduction='none'``, or no ``loss_fn`` on a model returning a tensor)
    cannot be back-propagated as a training loss."""
    out = graph[graph.output] if graph.output else None
    if out is None or out.out is None:
        return
    if math.prod(out.out.shape) != 1:
        raise StrategyError(f"the loss has shape {tuple(out.out.shape)}, not a single number: make loss_fn return "
                            "the mean (e.g. F.cross_entropy(..., reduction='mean')); without loss_fn the model's "
                            "output is taken as the loss")


def check_batch(graph: Graph, global_batch: int) -> None:
    """Refuse to scale a graph whose batch dimension is ambiguous: traced at
    batch 1, the batch dim cannot be told apart from the other size-1 dims,
    and a prediction at another global batch would be silently wrong
    (and, through :func:`check_trainable`, a graph with nothing to train)."""
    check_trainable(graph)
    if graph.batch_size == 1 and global_batch != 1:
        raise StrategyError(
            f"{graph.name} was traced with an example batch of 1: its batch dimension cannot be told apart "
            f"from the other size-1 dims, so it cannot be scaled to global_batch={global_batch}. Trace it "
            "with example inputs of batch 2 or more (zoo.build(spec, batch=2); autopar.trace of a model "
            "string does this)")


def _config(strategy: str | ParallelConfig, devices: int) -> ParallelConfig:
    if isinstance(strategy, ParallelConfig):
        if strategy.devices != devices:
            raise StrategyError(f"strategy {strategy.to_string()} uses {strategy.devices} devices, not {devices}")
        return strategy
    return parse_strategy(strategy, devices)


def evaluate(model: Any, example_inputs: Any = None, *, cluster: Any, devices: int, strategy: str,
             global_batch: int, optimizer: str = "adamw", precision: str | None = None,
             loss_fn: Callable | None = None, target: Any = None, batch_dim: int | tuple[int, ...] = 0) -> Estimate:
    """Predict one manual strategy as written (Megatron-style placements;
    with a pipeline, equal layers per stage): step time (compute and
    communication parts), TFLOP/s per device, peak memory per device and
    whether it fits.

    ``model`` is an ``nn.Module`` (with ``example_inputs``, their batch at
    ``batch_dim``), a zoo string or a
    traced :class:`Graph` (cheapest: evaluating a strategy on a graph takes
    milliseconds). Raises :class:`StrategyError` for an invalid strategy."""
    check_sizes(devices, global_batch)
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, target=target, batch_dim=batch_dim)
    check_batch(graph, global_batch)
    cfg = _config(strategy, devices)
    planner = planner_for(graph, cluster, optimizer, precision, devices=devices, global_batch=global_batch)
    with _cluster_errors(), grouped_warnings():   # as written: Megatron placements, equal pipeline stages
        return planner.evaluate(cfg, layers="even")


@contextlib.contextmanager
def _cluster_errors():
    """cost_models knows nothing of autopar: re-raise its errors as autopar's."""
    try:
        yield
    except cost_models.ClusterError as e:
        raise ClusterError(str(e)) from None


class WarmStates:
    """The planner state (:class:`~autopar.search.planner.PlannerState`)
    kept between requests on the same graph, per cluster, optimizer and
    precision: a second :func:`plan` or :func:`evaluate` on a graph reuses
    the decisions and sums of the first (benchmarks and tests plan one graph
    many times). Only the state's caches are shared; every request gets its
    own :class:`~autopar.search.planner.Planner`. A graph's states go when
    the graph does; :meth:`clear` drops them sooner (a cold measurement)."""

    def __init__(self) -> None:
        self._by_graph: dict[int, dict[tuple, PlannerState]] = {}

    def get(self, graph: Graph, key: tuple) -> PlannerState:
        """The state of ``graph`` under ``key`` (made empty on first use)."""
        states = self._by_graph.get(id(graph))
        if states is None:
            states = self._by_graph[id(graph)] = {}
            weakref.finalize(graph, self._by_graph.pop, id(graph), None)
        return states.setdefault(key, PlannerState())

    def clear(self, graph: Graph | None = None) -> None:
        """Forget ``graph``'s states (every graph's when None)."""
        if graph is None:
            self._by_graph.clear()
        else:
            self._by_graph.pop(id(graph), None)


#: the warm states of this process (see :class:`WarmStates`)
WARM = WarmStates()


def _state(graph: Graph, cluster: Any, optimizer: str, precision: str | None
           ) -> tuple[cost_models.ClusterSpec, PlannerState]:
    """The cluster spec and the warm planner state of a request, its cost
    model built: raises :class:`ClusterError` or :class:`StrategyError` for
    an unknown cluster, optimizer or precision."""
    spec = load_cluster(cluster)
    from cost_models.memory import model_state_bytes
    try:
        model_state_bytes(1, optimizer, "fp32")
    except ValueError as e:
        raise StrategyError(f"optimizer {optimizer!r}: {e}") from None
    state = WARM.get(graph, (spec.name, hash(spec), optimizer, precision))
    if "" not in state.models:
        state.models[""] = CostModel(graph, spec, optimizer=optimizer, precision=precision)
    return spec, state


def planner_for(graph: Graph, cluster: Any, optimizer: str, precision: str | None, *, devices: int,
                global_batch: int, mode: str = "grid", pins: tuple[tuple[str, str], ...] = ()) -> Planner:
    """A :class:`~autopar.search.planner.Planner` for one request on
    ``graph``, warm from earlier requests on it (:data:`WARM`). Raises
    :class:`ClusterError` or :class:`StrategyError` for an unknown cluster,
    optimizer, precision or search mode."""
    spec, state = _state(graph, cluster, optimizer, precision)
    return Planner(graph, spec, global_batch=global_batch, devices=devices, optimizer=optimizer,
                   precision=precision, mode=mode, pins=pins, state=state)


#: MindSpore's names for the search modes, and ours
SEARCH_MODES = {
    "dynamic_programming": "ilp",      # the exact intra-operator ILP (default)
    "ilp": "ilp",
    "sharding_propagation": "greedy",  # propagate from the user's pins
    "recursive_programming": "greedy",  # the fast heuristic for very large graphs
    "greedy": "greedy",
    "grid": "grid",                     # the manual (Megatron-style) grid only
}


#: the tensor-parallel layouts the automatic search can try
SEARCH_TP_MODES = ("1d", "2d", "2.5d", "3d", "mesh", "mesh3")


def check_tp_modes(tp_modes: Sequence[str]) -> tuple[str, ...]:
    """``tp_modes`` as a tuple, checked: each one the search can try, 1d among them.
    Raises :class:`StrategyError` naming the bad one."""
    modes = (tp_modes,) if isinstance(tp_modes, str) else tuple(tp_modes)
    for m in modes:
        if m not in SEARCH_TP_MODES:
            raise StrategyError(f"tp_modes: {m!r} is not a layout the search tries; valid: "
                                f"{', '.join(SEARCH_TP_MODES)}")
    if "1d" not in modes:
        raise StrategyError(f"tp_modes={list(modes)} must include '1d' (tp=1 and every 1d tp size are its lines)")
    return modes


def plan(model: Any, example_inputs: Any = None, *, cluster: Any, devices: int, global_batch: int,
         strategy: str | ParallelConfig = "auto", optimizer: str = "adamw", precision: str | None = None,
         loss_fn: Callable | None = None, target: Any = None, executable_only: bool = False,
         memory_options: bool = True,
         search_mode: str | None = None, shardings: dict[str, Any] | None = None,
         progress: Callable[[int, int], None] | None = None, solver: str = "highs",
         tp_modes: Sequence[str] = ("1d",), batch_dim: int | tuple[int, ...] = 0) -> Plan:
    """Choose a strategy and return the :class:`Plan` with its predictions
    (:func:`plan_and_record` also returns how the search got there).

    ``strategy="auto"`` searches the mesh (dp x tp), microbatches, recompute
    and ZeRO; per configuration the tensor-parallel axis is decided per op by
    ``search_mode``: ``"dynamic_programming"`` (the exact ILP, default),
    ``"sharding_propagation"`` (propagation from pinned shardings; needs
    pins), ``"recursive_programming"`` (a fast greedy heuristic) or
    ``"grid"`` (Megatron-style sharding only). A manual strategy
    (``"dp=2,tp=4"``) is only evaluated, with Megatron-style placements;
    given a ``search_mode`` too, the per-op placements on that fixed mesh
    are searched (MindSpore's semi-automatic mode).

    ``shardings`` pins placements: ``{parameter or module path: placement}``
    (see :mod:`autopar.search.pins`), merged with :func:`autopar.shard`
    annotations on ``model``. ``memory_options=False`` searches the plain
    strategies only (no recompute, ZeRO, sequence parallelism or offload);
    ``executable_only`` restricts the search to what :func:`parallelize`
    can run (every strategy the grammar accepts; kept for callers).
    ``solver``: the MILP solver of the ILP, ``"highs"`` (default) or
    ``"pulp:CBC"``, ``"pulp:GLPK"``, ``"pulp:GUROBI"``, ``"pulp:CPLEX"``
    through PuLP (``pip install autopar[pulp]``); recorded in the plan's
    ``search.ilp.solver`` when not HiGHS. ``tp_modes``: the tensor-parallel
    layouts the search tries, ``("1d",)`` by default; add ``"2d"`` for
    Colossal-AI's q x q grids (``tp_mode=2d``), ``"2.5d"`` for them 2 and
    4 deep and ``"3d"`` for the q x q x q cubes, which the cost model prices,
    and ``"mesh"`` for tp groups as two-axis meshes whose placements one
    program decides on both axes (``tp_mode=mesh``; ``"mesh3"`` on three).
    ``batch_dim``: where an ``nn.Module``'s example inputs hold the batch
    (1 for ``[seq, batch, ...]``; see :func:`autopar.trace`).

    Raises :class:`StrategyError` for an invalid strategy, search mode,
    solver (or one not installed) or pin (two contradicting pins are both
    named), and :class:`NoFeasibleStrategyError` when nothing fits."""
    return plan_and_record(model, example_inputs, cluster=cluster, devices=devices, global_batch=global_batch,
                           strategy=strategy, optimizer=optimizer, precision=precision, loss_fn=loss_fn,
                           target=target, executable_only=executable_only, memory_options=memory_options,
                           search_mode=search_mode, shardings=shardings, progress=progress,
                           solver=solver, tp_modes=tp_modes, batch_dim=batch_dim)[0]


@_collector_paused()
def plan_and_record(model: Any, example_inputs: Any = None, *, cluster: Any, devices: int, global_batch: int,
                    strategy: str | ParallelConfig = "auto", optimizer: str = "adamw",
                    precision: str | None = None, loss_fn: Callable | None = None, target: Any = None,
                    executable_only: bool = False, memory_options: bool = True, search_mode: str | None = None,
                    shardings: dict[str, Any] | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    solver: str = "highs", tp_modes: Sequence[str] = ("1d",),
                    batch_dim: int | tuple[int, ...] = 0) -> tuple[Plan, SearchRecord]:
    """:func:`plan`, and beside the plan the
    :class:`~autopar.search.planner.SearchRecord` of how it was found (the
    configurations compared, the ILP's runners-up: what
    :func:`autopar.explain.explain` and ``autopar plan --explain`` show).
    Same arguments and errors as :func:`plan`."""
    t0 = time.perf_counter()
    if search_mode is None and strategy == "auto":
        search_mode = "dynamic_programming"
    if search_mode is not None and search_mode not in SEARCH_MODES:
        raise StrategyError(f"search_mode {search_mode!r} is invalid; valid: {', '.join(SEARCH_MODES)}")
    check_sizes(devices, global_batch)
    tp_modes = check_tp_modes(tp_modes)
    user_pins = {**_pins.annotations(model), **(shardings or {})}
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, target=target, batch_dim=batch_dim)
    check_batch(graph, global_batch)
    spec, state = _state(graph, cluster, optimizer, precision)
    mislaid = mislaid_batch(graph) if devices > 1 else None
    if mislaid:
        warnings.warn(f"autopar: {mislaid}", stacklevel=3)
    pins = _pins.resolve(graph, user_pins, track_batch(graph).out)
    if search_mode == "sharding_propagation" and not pins:
        raise StrategyError("search_mode='sharding_propagation' propagates from pinned shardings, and none were "
                            "given: pin some with autopar.shard(module, weight='S(0)') or shardings={...}, or use "
                            "search_mode='dynamic_programming'")
    info = None
    planner = Planner(graph, spec, global_batch=global_batch, devices=devices, optimizer=optimizer,
                      precision=precision, mode=SEARCH_MODES[search_mode] if search_mode else "grid",
                      pins=tuple(pins), state=state, solver=solver)
    with _cluster_errors(), _pin_errors(graph, user_pins), grouped_warnings():
        spec.check_devices(devices)
        if strategy == "auto":
            res = search_grid(planner, memory_options=memory_options, progress=progress, tp_modes=tp_modes)
            est, cfg, sharder = res.best, res.best_config, res.best_sharder
            # the search time is not part of the JSON: the same inputs must give the same bytes
            search = {"mode": search_mode, "candidates": res.candidates, "feasible": res.feasible,
                      "tp_axis": sharder.label}
            info = res
        else:
            cfg = _config(strategy, devices)
            if search_mode is None:   # evaluated as written: Megatron placements, equal pipeline stages
                sharder = Sharder("manual", tuple(pins))
                est = planner.evaluate(cfg, sharder, layers="even")
                search = {"mode": "manual"}
            else:    # the mesh is the user's; the per-op placements are searched
                est, sharder = planner.choose(cfg, float("inf"))
                search = {"mode": search_mode, "tp_axis": sharder.label}
        sh, _ = planner.sharding(cfg, sharder)
    if cfg.tp_mode in MESH_MODES:    # one joint program decides a mesh, in every mode (a manual one too)
        search["tp_axis"] = "mesh" + ("+memory" if getattr(sh.ilp, "memory_limited", False) else "")
    if pins:
        names = _pins.keys(graph, user_pins)
        search["pins"] = {names[n]: p for n, p in pins}
    ilp = getattr(sh, "ilp", None)
    if ilp is not None:
        search["ilp"] = {"decisions": ilp.decisions, "nodes": ilp.nodes, "variables": ilp.variables,
                         "constraints": ilp.constraints}
        if planner.solver != "highs":   # HiGHS plans keep their bytes
            search["ilp"]["solver"] = planner.solver
    p = build_plan(graph, planner.model, cfg, est, sh, global_batch, devices, search)
    p.planning_time_s = time.perf_counter() - t0
    p.graph = graph
    return p, SearchRecord(graph=graph, sharding=sh, result=info, planning_time_s=p.planning_time_s)


@contextlib.contextmanager
def _pin_errors(graph: Graph, user_pins: dict[str, Any]):
    """Name the user's keys in errors about pinned nodes."""
    try:
        yield
    except InfeasiblePins as e:
        if not e.nodes:
            raise
        names = _pins.keys(graph, user_pins)
        raise StrategyError(f"pin {' and '.join(repr(names.get(n, n)) for n in e.nodes)}: {e}") from None


def build_plan(graph: Graph, model: CostModel, cfg: ParallelConfig, est: Estimate, tp_sharding: AxisSharding,
               global_batch: int, devices: int, search: dict) -> Plan:
    """Assemble the Plan record (per-param and per-op placements on (dp, tp),
    ops under their stable keys, the repeated-layer groups); ``model`` is the
    request's cost model (its cluster, optimizer and precision are recorded)."""
    cfg = dataclasses.replace(cfg, precision=cfg.precision or model.precision)
    dp_sh = model.batch
    params: dict[str, list[str]] = {}
    ops: dict[str, Any] = {}
    keys = graph.op_keys()
    axes = (*tp_sharding.others, tp_sharding)     # tp_mode=mesh: the tp column holds every axis, S(0)|S(1)
    for nd in graph.nodes:
        if nd.is_state:
            if nd.param is not None:
                params[nd.param] = [dp_sh.out.get(nd.name, R),
                                    joint_placement([ax.out.get(nd.name, R) for ax in axes])]
            continue
        sd, st = dp_sh.strategy.get(nd.name), _joint_strategy(axes, nd.name)
        if sd is None and st is None:
            continue
        sd = sd or Strategy("replicate", tuple(R for _ in nd.inputs), R, False)
        st = st or Strategy("replicate", tuple(R for _ in nd.inputs), R, False)
        entry: dict[str, Any] = {
            "out": [sd.out, st.out],
            "in": [[a, b] for a, b in zip(sd.ins, st.ins)],
            "strategy": [sd.name, st.name],
        }
        if sd.split or st.split:
            entry["split"] = [sd.split, st.split]
        if st.kernel:
            entry["kernel"] = st.kernel
        if st.scale != 1.0 or sd.scale != 1.0:
            entry["scale"] = rounded([sd.scale, st.scale])
        ops[keys[nd.name]] = entry
    pred = est.to_dict()
    predicted = {k: pred[k] for k in ("step_time_s", "compute_time_s", "comm_time_s", "tp_comm_time_s",
                                      "dp_comm_time_s", "optimizer_time_s", "tflops_per_device",
                                      "peak_memory_bytes", "fits", "device_memory_bytes", "memory")}
    if est.host_memory_bytes:
        predicted["host_memory_bytes"] = pred["host_memory_bytes"]
    if est.cp_comm_time_s:
        predicted["cp_comm_time_s"] = pred["cp_comm_time_s"]
    data = {
        "plan_version": PLAN_VERSION,
        "autopar_version": __version__,
        "model": {"name": graph.name, "fingerprint": graph.fingerprint, "num_params": graph.num_params,
                  "num_nodes": len(graph.nodes)},
        "cluster": {"name": model.cluster.name, "spec": model.cluster.to_dict()},
        "devices": devices,
        "global_batch": global_batch,
        "precision": cfg.precision,
        "optimizer": model.optimizer,
        "mesh": _mesh_record(cfg),
        "parallel": parallel_record(cfg),
        "params": params,
        "ops": ops,
        "predicted": predicted,
        "search": search,
    }
    if est.pipeline is not None:
        data["pipeline"] = dict(est.pipeline)
    if graph.groups:
        data["layers"] = [{"name": g.name, "instances": list(g.instances)} for g in graph.groups]
    # rounded as the JSON will be (params and ops are made so: placements, names, flags and
    # rounded scales); schema validation is for plans read from files (a test validates
    # what this builds: on GPT-3 175B validation alone took 0.9 s)
    return Plan({k: v if k in ("params", "ops") else rounded(v) for k, v in data.items()})


def _joint_strategy(axes: tuple[AxisSharding, ...], name: str) -> Strategy | None:
    """The strategy ``name`` runs on the tensor axes ``axes`` (one for 1d) as
    the plan records it: on a mesh, each field joined over the axes
    (``S(0)|S(1)``, ``colwise|rowwise``), split if any axis splits, the
    scales multiplied, the one special kernel."""
    sts = [ax.strategy.get(name) for ax in axes]
    if len(sts) == 1 or any(st is None for st in sts):
        return sts[-1]
    return Strategy(SEP.join(st.name for st in sts),
                    tuple(joint_placement([st.ins[i] for st in sts]) for i in range(len(sts[-1].ins))),
                    joint_placement([st.out for st in sts]), any(st.split for st in sts), (),
                    math.prod(st.scale for st in sts), next((st.kernel for st in sts if st.kernel), None))


def sharding_from_plan(graph: Graph, plan_: Plan) -> AxisSharding | None:
    """The tensor-parallel decisions recorded in ``plan_`` for ``graph``, or
    None when the graph's ops differ from the plan's (e.g. another loss
    function): the caller then re-derives them from the strategy. A
    ``tp_mode=mesh`` plan records every axis joined (``S(0)|S(1)``): the
    inner axis is returned with the outer ones in ``others`` (their
    placements and strategy names; ``parallelize`` solves the mesh again
    and compares, :func:`autopar.parallelize._check_mesh_plan`)."""
    ops = plan_.data["ops"]
    keys = plan_.op_keys(graph)
    grid = plan_.config.tp_grid
    k = len(grid) if plan_.config.tp_mode in MESH_MODES else 1
    axes = [AxisSharding(n=n) for n in grid[-k:]]     # tp_mode=2d: the grid's columns
    by_param = {v: k for k, v in ((nd.name, nd.param) for nd in graph.nodes if nd.param)}

    def parts(p: str) -> tuple[str, ...]:
        return axis_placements(p, k) if k > 1 else (p,)

    for pname, placements in plan_.data["params"].items():
        node = by_param.get(pname)
        if node is None:
            return None
        for ax, p in zip(axes, parts(placements[1])):
            ax.out[node] = p
    for nd in graph.nodes:
        if nd.is_state:
            continue
        e = ops.get(keys[nd.name])
        if e is None:
            if nd.kind in ("shape", "constant", "output") or (nd.out is None and nd.kind != "split"):
                continue
            if nd.kind == "input":
                for ax in axes:
                    ax.out[nd.name] = R
                continue
            return None
        if len(e["in"]) != len(nd.inputs):
            return None
        names, outs = e["strategy"][1].split(SEP) if k > 1 else [e["strategy"][1]], parts(e["out"][1])
        ins = list(zip(*[parts(p[1]) for p in e["in"]])) or [()] * k
        if len(names) != k or len(outs) != k or len(ins) != k:
            return None
        split = bool(e.get("split", [False, False])[1])
        for a, ax in enumerate(axes):     # a mesh's scales and kernel are recorded for the whole strategy
            ax.strategy[nd.name] = Strategy(names[a], tuple(ins[a]), outs[a], split, (),
                                            e.get("scale", [1.0, 1.0])[1] if k == 1 else 1.0,
                                            e.get("kernel") if k == 1 else None)
            ax.out[nd.name] = outs[a]
    sh = axes[-1]
    sh.others = tuple(axes[:-1])
    return sh


def _mesh_record(cfg: ParallelConfig) -> dict[str, list]:
    """The plan's mesh: ``(dp, tp)``, pp outermost with a pipeline, cp between dp and tp with context parallelism."""
    axes = (["pp"] if cfg.pp > 1 else []) + ["dp"] + (["cp"] if cfg.cp > 1 else []) + ["tp"]
    return {"shape": [getattr(cfg, a) for a in axes], "axes": axes}
