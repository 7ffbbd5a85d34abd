"""The public API: ``trace``, ``evaluate``, ``plan``, ``parallelize``. Thin:
each calls the stages below it."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import cost_models

from . import __version__
from .cost import Estimate, Evaluator, Sharder
from .errors import ClusterError, StrategyError
from .graph import Graph
from .plan import PLAN_VERSION, Plan
from .search import pins as _pins
from .search.grid import _Chooser, search_grid
from .search.ilp import InfeasiblePins
from .search.propagate import AxisSharding
from .search.space import ParallelConfig, parse_strategy
from .strategies.placement import R
from .strategies.rules import Strategy
from .trace import trace

ModelLike = "nn.Module | str | Graph"


def load_cluster(cluster: Any) -> cost_models.ClusterSpec:
    """A preset name, a cluster JSON file, a dict or a ClusterSpec."""
    try:
        return cost_models.load_cluster(cluster)
    except cost_models.ClusterError as e:
        raise ClusterError(str(e)) from None


def as_graph(model: Any, example_inputs: Any = None, *, loss_fn: Callable | None = None,
             target: Any = None, batch: int | None = None) -> Graph:
    """Trace ``model`` unless it already is a :class:`Graph`. A zoo string is
    built on the meta device with its default loss (batch 2 by default, so the
    batch dimension can be told apart from the others)."""
    if isinstance(model, Graph):
        return model
    if isinstance(model, str):
        from . import zoo
        family = model.split(":", 1)[0].strip().lower()
        # a zoo family is built at batch 2 so the batch dim can be told apart
        z = zoo.build(model, batch=batch or 2) if family in zoo.families() else zoo.build(model)
        return trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target, name=z.name)
    return trace(model, example_inputs, loss_fn=loss_fn, target=target)


def _config(strategy: str | ParallelConfig, devices: int) -> ParallelConfig:
    if isinstance(strategy, ParallelConfig):
        if strategy.devices != devices:
            raise StrategyError(f"strategy {strategy.to_string()} uses {strategy.devices} devices, not {devices}")
        return strategy
    return parse_strategy(strategy, devices)


def evaluate(model: Any, example_inputs: Any = None, *, cluster: Any, devices: int, strategy: str,
             global_batch: int, optimizer: str = "adamw", precision: str | None = None,
             loss_fn: Callable | None = None, target: Any = None) -> Estimate:
    """Predict one manual strategy as written (Megatron-style placements;
    with a pipeline, equal layers per stage): step time (compute and
    communication parts), TFLOP/s per device, peak memory per device and
    whether it fits.

    ``model`` is an ``nn.Module`` (with ``example_inputs``), a zoo string or a
    traced :class:`Graph` (cheapest: evaluating a strategy on a graph takes
    milliseconds). Raises :class:`StrategyError` for an invalid strategy."""
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, target=target)
    cfg = _config(strategy, devices)
    ev = _evaluator(graph, cluster, optimizer, precision)
    with _cluster_errors():   # as written: Megatron placements, equal pipeline stages
        return ev.evaluate(cfg, global_batch, devices, layers="even")


@contextlib.contextmanager
def _cluster_errors():
    """cost_models knows nothing of autopar: re-raise its errors as autopar's."""
    try:
        yield
    except cost_models.ClusterError as e:
        raise ClusterError(str(e)) from None


def _evaluator(graph: Graph, cluster: Any, optimizer: str, precision: str | None) -> Evaluator:
    spec = load_cluster(cluster)
    from cost_models.memory import model_state_bytes
    try:
        model_state_bytes(1, optimizer, "fp32")
    except ValueError as e:
        raise StrategyError(f"optimizer {optimizer!r}: {e}") from None
    key = (spec.name, hash(spec), optimizer, precision)
    cache = getattr(graph, "_evaluators", None)
    if cache is None:
        cache = {}
        graph._evaluators = cache  # type: ignore[attr-defined]
    if key not in cache:
        cache[key] = Evaluator(graph, spec, optimizer=optimizer, precision=precision)
    return cache[key]


#: MindSpore's names for the search modes, and ours
SEARCH_MODES = {
    "dynamic_programming": "ilp",      # the exact intra-operator ILP (default)
    "ilp": "ilp",
    "sharding_propagation": "greedy",  # propagate from the user's pins
    "recursive_programming": "greedy",  # the fast heuristic for very large graphs
    "greedy": "greedy",
    "grid": "grid",                     # the manual (Megatron-style) grid only
}


def plan(model: Any, example_inputs: Any = None, *, cluster: Any, devices: int, global_batch: int,
         strategy: str | ParallelConfig = "auto", optimizer: str = "adamw", precision: str | None = None,
         loss_fn: Callable | None = None, target: Any = None, executable_only: bool = False,
         memory_options: bool = True,
         search_mode: str | None = None, shardings: dict[str, Any] | None = None,
         progress: Callable[[int, int], None] | None = None) -> Plan:
    """Choose a strategy and return the :class:`Plan` with its predictions.

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

    Raises :class:`StrategyError` for an invalid strategy, search mode or
    pin (two contradicting pins are both named), and
    :class:`NoFeasibleStrategyError` when nothing fits."""
    t0 = time.perf_counter()
    if search_mode is None and strategy == "auto":
        search_mode = "dynamic_programming"
    if search_mode is not None and search_mode not in SEARCH_MODES:
        raise StrategyError(f"search_mode {search_mode!r} is invalid; valid: {', '.join(SEARCH_MODES)}")
    user_pins = {**_pins.annotations(model), **(shardings or {})}
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, target=target)
    ev = _evaluator(graph, cluster, optimizer, precision)
    pins = _pins.resolve(graph, user_pins, ev.batch.out)
    if search_mode == "sharding_propagation" and not pins:
        raise StrategyError("search_mode='sharding_propagation' propagates from pinned shardings, and none were "
                            "given: pin some with autopar.shard(module, weight='S(0)') or shardings={...}, or use "
                            "search_mode='dynamic_programming'")
    info = None
    with _cluster_errors(), _pin_errors(graph, user_pins):
        ev.cluster.check_devices(devices)
        if strategy == "auto":
            mode = SEARCH_MODES[search_mode]
            res = search_grid(ev, devices, global_batch, memory_options=memory_options, progress=progress,
                              mode=mode, pins=pins)
            est, cfg, sharder = res.best, res.best_config, res.best_sharder
            # the search time is not part of the JSON: the same inputs must give the same bytes
            search = {"mode": search_mode, "candidates": res.candidates, "feasible": res.feasible,
                      "tp_axis": sharder.label}
            info = res
        else:
            cfg = _config(strategy, devices)
            if search_mode is None:   # evaluated as written: Megatron placements, equal pipeline stages
                sharder = Sharder("manual", pins)
                est = ev.evaluate(cfg, global_batch, devices, sharder, layers="even")
                search = {"mode": "manual"}
            else:    # the mesh is the user's; the per-op placements are searched
                est, sharder = _Chooser(ev, SEARCH_MODES[search_mode], pins).best(cfg, global_batch, devices,
                                                                                  float("inf"))
                search = {"mode": search_mode, "tp_axis": sharder.label}
        sh, _ = ev.sharding(cfg, global_batch, sharder)
    if pins:
        names = _pins.keys(graph, user_pins)
        search["pins"] = {names[n]: p for n, p in pins}
    ilp = getattr(sh, "ilp", None)
    if ilp is not None:
        search["ilp"] = {"decisions": ilp.decisions, "nodes": ilp.nodes, "variables": ilp.variables,
                         "constraints": ilp.constraints}
    p = build_plan(graph, ev, cfg, est, sh, global_batch, devices, search)
    p.planning_time_s = time.perf_counter() - t0
    p.graph = graph
    p.search_result = info
    p.tp_sharding = sh
    return p


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


def build_plan(graph: Graph, ev: Evaluator, cfg: ParallelConfig, est: Estimate, tp_sharding: AxisSharding,
               global_batch: int, devices: int, search: dict) -> Plan:
    """Assemble the Plan record (per-param and per-op placements on (dp, tp))."""
    cfg = dataclasses.replace(cfg, precision=cfg.precision or ev.precision)
    dp_sh = ev.batch
    params: dict[str, list[str]] = {}
    ops: dict[str, Any] = {}
    for nd in graph.nodes:
        if nd.kind in ("param", "buffer"):
            if nd.param is not None:
                params[nd.param] = [dp_sh.out.get(nd.name, R), tp_sharding.out.get(nd.name, R)]
            continue
        sd, st = dp_sh.strategy.get(nd.name), tp_sharding.strategy.get(nd.name)
        if sd is None and st is None:
            continue
        sd = sd or Strategy("replicate", tuple(R for _ in nd.inputs), R, False)
        st = st or Strategy("replicate", tuple(R for _ in nd.inputs), R, False)
        entry: dict[str, Any] = {
            "out": [sd.out, st.out],
            "in": [[a, b] for a, b in zip(sd.ins, st.ins)],
            "strategy": [sd.name, st.name],
            "split": [sd.split, st.split],
        }
        if st.kernel:
            entry["kernel"] = st.kernel
        if st.scale != 1.0 or sd.scale != 1.0:
            entry["scale"] = [sd.scale, st.scale]
        ops[nd.name] = entry
    pred = est.to_dict()
    predicted = {k: pred[k] for k in ("step_time_s", "compute_time_s", "comm_time_s", "tp_comm_time_s",
                                      "dp_comm_time_s", "optimizer_time_s", "tflops_per_device",
                                      "peak_memory_bytes", "fits", "device_memory_bytes", "memory")}
    if est.host_memory_bytes:
        predicted["host_memory_bytes"] = pred["host_memory_bytes"]
    data = {
        "plan_version": PLAN_VERSION,
        "autopar_version": __version__,
        "model": {"name": graph.name, "fingerprint": graph.fingerprint, "num_params": graph.num_params,
                  "num_nodes": len(graph.nodes)},
        "cluster": {"name": ev.cluster.name, "spec": ev.cluster.to_dict()},
        "devices": devices,
        "global_batch": global_batch,
        "precision": cfg.precision,
        "optimizer": ev.optimizer,
        "mesh": {"shape": [cfg.pp, cfg.dp, cfg.tp], "axes": ["pp", "dp", "tp"]} if cfg.pp > 1 else
                {"shape": [cfg.dp, cfg.tp], "axes": ["dp", "tp"]},
        "parallel": cfg.as_dict(),
        "params": params,
        "ops": ops,
        "predicted": predicted,
        "search": search,
    }
    if est.pipeline is not None:
        data["pipeline"] = dict(est.pipeline)
    # rounded as the JSON will be; schema validation is for plans read from files
    # (a test validates what this builds: on GPT-3 175B validation alone took 0.9 s)
    return Plan(Plan(data).to_dict())


def config_from_plan(plan_: Plan) -> ParallelConfig:
    """The :class:`ParallelConfig` a plan records, its precision resolved to
    the plan's (plans written before pipelines have no ``chunks``, those
    before the memory options none of them)."""
    p = plan_.parallel
    precision = p.get("precision") or plan_.data.get("precision", "fp32")
    return ParallelConfig(dp=p["dp"], tp=p["tp"], pp=p["pp"], microbatches=p["microbatches"],
                          schedule=p["schedule"], recompute=p["recompute"], zero=p["zero"],
                          chunks=p.get("chunks", 1), sequence_parallel=p.get("sequence_parallel", False),
                          offload=p.get("offload", "none"), precision="bf16" if precision == "mixed" else precision,
                          reduce_dtype=p.get("reduce_dtype", ""), overlap=p.get("overlap", True),
                          bucket_mb=p.get("bucket_mb", 25.0))


def sharding_from_plan(graph: Graph, plan_: Plan) -> AxisSharding | None:
    """The tensor-parallel decisions recorded in ``plan_`` for ``graph``, or
    None when the graph's node names differ from the plan's (e.g. another
    loss function): the caller then re-derives them from the strategy."""
    ops = plan_.data["ops"]
    tp = plan_.parallel["tp"]
    sh = AxisSharding(n=tp)
    by_param = {v: k for k, v in ((nd.name, nd.param) for nd in graph.nodes if nd.param)}
    for pname, placements in plan_.data["params"].items():
        node = by_param.get(pname)
        if node is None:
            return None
        sh.out[node] = placements[1]
    for nd in graph.nodes:
        if nd.kind in ("param", "buffer"):
            continue
        e = ops.get(nd.name)
        if e is None:
            if nd.kind in ("shape", "constant", "output") or (nd.out is None and nd.kind != "split"):
                continue
            if nd.kind == "input":
                sh.out[nd.name] = R
                continue
            return None
        if len(e["in"]) != len(nd.inputs):
            return None
        scale = e.get("scale", [1.0, 1.0])[1]
        sh.strategy[nd.name] = Strategy(e["strategy"][1], tuple(p[1] for p in e["in"]), e["out"][1],
                                        bool(e.get("split", [False, False])[1]), (), scale, e.get("kernel"))
        sh.out[nd.name] = e["out"][1]
    return sh
