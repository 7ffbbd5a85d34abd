"""One planning request: decides what the cost model prices.

A :class:`Planner` is made per request (a graph, a cluster, the optimizer
and precision, the device count and global batch, the user's pins and the
search mode) and holds everything a search over strategies decides before
:meth:`autopar.cost.CostModel.estimate` can price one:

* the tensor-parallel axis, by the :class:`Sharder` asked for: Megatron-style
  propagation (``manual``), time-only propagation (``greedy``) or the ILP of
  :mod:`autopar.search.ilp`, re-solved under a memory bound when the
  time-optimal placements do not fit (:meth:`Planner.choose`);
* sequence parallelism, as pins on the norms and the residual stream;
* the pipeline's layers per stage (:func:`autopar.pipeline.partition.balance`);
* every cache of the search (:class:`PlannerState`): the decisions per
  configuration, the local shapes, the cost model's sums, the ILP's structure.

The state can outlive a request: :mod:`autopar.api` keeps one per graph and
cluster so that repeated requests on the same graph (benchmarks, tests, a
notebook) start warm. The grid over configurations is
:func:`autopar.search.grid.search_grid`, which asks a planner per
configuration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import cost_models
from cost_models import ClusterSpec

from ..cost import MEMORY_HEADROOM, CostCache, CostModel, Estimate, check_config
from ..errors import StrategyError
from ..graph import Graph, Node
from ..pipeline import partition as pipe
from ..pipeline.partition import units
from ..sharding import AxisSharding, scaled_shapes
from ..spec import MESH_MODES, ParallelConfig
from ..spec.placement import SEP, R, mesh_partial, mesh_pieces
from ..strategies import is_shard
from . import mesh_ilp, solvers
from .ilp import InfeasiblePins, MemoryTerms, PendingAxis, start_axis, stop_workers
from .propagate import propagate

if TYPE_CHECKING:
    from .grid import SearchResult

MANUAL_MEMORY_WEIGHT = 1e-6   # s per byte of replicated matrix: manual tp shards every matrix it can
GREEDY_MEMORY_WEIGHT = 1e-15  # the greedy heuristic weighs time; memory only breaks ties
NEAR_FIT = 1.25   # a Megatron plan within 25% of the memory: the memory-bounded ILP may still fit it
MODES = ("grid", "ilp", "greedy")


@dataclass(frozen=True)
class Sharder:
    """How the tensor-parallel axis is decided.

    ``mode``: ``"manual"`` (greedy propagation that shards every weight a rule
    can split, Megatron-style: the ``tp=N`` strategies), ``"ilp"`` (the
    optimal per-op choice of :mod:`autopar.search.ilp`) or ``"greedy"``
    (propagation weighing time only: the fast heuristic for huge graphs).
    ``pins``: ``(node, placement)`` pairs fixed by the user. ``memory_limit``:
    bytes per device the ILP must respect (model states + saved activations).
    """

    mode: str = "manual"
    pins: tuple[tuple[str, str], ...] = ()
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        # hashed once: sequence parallelism pins every norm and residual, and the
        # search looks a sharder up per configuration
        object.__setattr__(self, "_hash", hash((self.mode, self.pins, self.memory_limit)))

    def __hash__(self) -> int:
        return self._hash   # type: ignore[attr-defined]

    @property
    def label(self) -> str:
        """``ilp``, ``ilp+memory``, ``greedy`` or ``manual`` (the plan's ``search.tp_axis``)."""
        return self.mode + ("+memory" if self.memory_limit is not None else "")


MANUAL = Sharder()


@dataclass
class PlannerState:
    """The caches of planning on one graph and cluster under one optimizer
    and precision, shared by the planners built with it.

    ``models``: the cost model per precision (a strategy's ``precision=``
    key), each with its own :class:`~autopar.cost.CostCache`; ``axes``: the
    tensor-parallel decisions per (precision, tp, dp, microbatch, sharder,
    ILP inputs); ``shapes``: the local shapes per (microbatch, dp);
    ``sequence_parallel``: the pins sequence parallelism adds per (sharder,
    tp); ``ilp``: the ILP's problem structures (see
    :func:`autopar.search.ilp.solve_axis`; the meshes' too,
    :func:`autopar.search.mesh_ilp.solve_mesh`); ``comm``: the times of the
    tensor-parallel collectives per (itemsize, tp, spans nodes); ``pending``:
    the ILPs :meth:`Planner.prefetch` started, per ``axes`` key; ``partitions``:
    the balanced pipeline stages per unit costs and memory limits (with the
    unit costs they were balanced from); ``mesh_bounds``: the sharder each
    ``tp_mode=mesh`` configuration is decided with, per global batch and
    pins (:meth:`Planner._mesh_bound`), and ``mesh_estimates`` the estimates
    it and the search's refinement read, per sharder."""

    models: dict[str, CostModel] = field(default_factory=dict)
    axes: dict[tuple, AxisSharding] = field(default_factory=dict)
    shapes: dict[tuple, dict] = field(default_factory=dict)
    sequence_parallel: dict[tuple, Sharder] = field(default_factory=dict)
    ilp: dict[tuple, Any] = field(default_factory=dict)
    comm: dict[tuple, dict] = field(default_factory=dict)
    pending: dict[tuple, Any] = field(default_factory=dict)
    partitions: dict[tuple, tuple] = field(default_factory=dict)
    mesh_bounds: dict[tuple, Sharder] = field(default_factory=dict)
    mesh_estimates: dict[tuple, Estimate] = field(default_factory=dict)


@dataclass
class Tally:
    """What :meth:`Planner.choose` did over a search: per sharder label how
    many configurations its placements won, and the ILP solves and their time."""

    won: dict[str, int] = field(default_factory=dict)
    ilp_solves: int = 0
    ilp_time_s: float = 0.0
    seen: set[int] = field(default_factory=set)


@dataclass
class SearchRecord:
    """How a plan was found: what ``autopar plan --explain`` shows, returned
    beside the plan by :func:`autopar.api.plan_and_record` (none of it is in
    the plan's JSON). ``sharding``: the chosen configuration's tensor-parallel
    decisions (with ``ilp`` set when the ILP made them); ``result``: the grid
    search's outcome (None for a manual strategy)."""

    graph: Graph
    sharding: AxisSharding
    result: "SearchResult | None"
    planning_time_s: float


class Planner:
    """One planning request (see the module docstring): ``cluster`` a
    :class:`~cost_models.ClusterSpec` or a preset name, ``mode`` one of
    :data:`MODES`, ``pins`` ``(node, placement)`` pairs, ``state`` the caches
    to use (a fresh :class:`PlannerState` by default), ``solver`` the ILP's
    MILP backend (:data:`autopar.search.solvers.SOLVERS`).

    Raises :class:`StrategyError` for an invalid precision, search mode or
    solver (or one that is not installed)."""

    def __init__(self, graph: Graph, cluster: ClusterSpec | str, *, global_batch: int, devices: int,
                 optimizer: str = "adamw", precision: str | None = None, mode: str = "grid",
                 pins: Sequence[tuple[str, str]] = (), state: PlannerState | None = None,
                 solver: str = solvers.DEFAULT) -> None:
        if mode not in MODES:
            raise StrategyError(f"search mode {mode!r} is invalid; valid: {', '.join(MODES)}")
        # an unknown or missing solver fails before the search; the name as the backend spells it
        self.solver = solvers.backend(solver).name
        cluster = cluster if isinstance(cluster, ClusterSpec) else cost_models.load_cluster(cluster)
        self.graph, self.cluster, self.optimizer = graph, cluster, optimizer
        self.global_batch, self.devices, self.mode, self.pins = global_batch, devices, mode, tuple(pins)
        self.state = state if state is not None else PlannerState()
        self.tally = Tally()
        base = self.state.models.get("")
        if base is None:
            base = self.state.models[""] = CostModel(graph, cluster, optimizer=optimizer, precision=precision,
                                                     cache=CostCache())
        self.model = base
        self.precision = base.precision

    # -- the pure model, per precision ---------------------------------------------
    def cost(self, precision: str = "") -> CostModel:
        """The cost model under ``precision`` (a strategy's ``precision=``
        key; "" is the request's)."""
        key = precision or ""
        if key == self.precision:
            key = ""
        model = self.state.models.get(key)
        if model is None:
            model = self.state.models[key] = CostModel(self.graph, self.cluster, optimizer=self.optimizer,
                                                       precision=precision, cache=CostCache())
        return model

    # -- the tensor-parallel axis ---------------------------------------------------
    def sharding(self, cfg: ParallelConfig, sharder: Sharder = MANUAL) -> tuple[AxisSharding, dict]:
        """The tensor-parallel axis decisions and the local shapes for ``cfg``
        at the request's global batch (cached per configuration and sharder).

        Raises :class:`~autopar.search.ilp.InfeasiblePins` for contradictory
        pins and :class:`StrategyError` when an ILP memory bound cannot be met
        or sequence parallelism does not apply. With ``tp_mode=2d`` they are
        the grid's columns, decided as for :meth:`CostModel.grid_view` (a 1d
        config of the columns, over the rows' share of the batch), and the
        shapes are one grid rank's."""
        if cfg.tp_mode in MESH_MODES:    # the request's pins hold on every mesh (parallelize solves it again)
            pins = sharder.pins or self.pins
            for name, p in pins:
                if SEP in p and p.count(SEP) + 1 != len(cfg.tp_grid):
                    raise InfeasiblePins(f"the pinned placement {p} names {p.count(SEP) + 1} axes, but the "
                                         f"tp_mode={cfg.tp_mode} group is a {'x'.join(map(str, cfg.tp_grid))} mesh "
                                         f"of {len(cfg.tp_grid)}: give one placement per axis, outermost first, "
                                         f"or one for the inner axis", (name,))
            return self._mesh_sharding(cfg, self._mesh_bound(cfg, pins) if sharder.memory_limit is None else
                                       Sharder(sharder.mode, pins, sharder.memory_limit))
        joint = next((n for n, p in sharder.pins if SEP in p), None)
        if joint is not None:
            raise InfeasiblePins(f"a placement on several axes ({dict(sharder.pins)[joint]}) pins a tp_mode=mesh "
                                 f"tensor group; with tp_mode={cfg.tp_mode} pin one placement (e.g. S(0))", (joint,))
        if cfg.is_grid:
            return self.sharding(CostModel.grid_view(cfg), sharder)
        key, model, sharder, shapes = self._axis_key(cfg, sharder)
        axes = self.state.axes
        if key not in axes:
            pending = self.state.pending.pop(key, None)
            if pending is not None:    # started by prefetch()
                axes[key] = pending.result()
                return axes[key], shapes
            shard_pins = [n for n, p in sharder.pins if is_shard(p)]
            if cfg.tp == 1 and shard_pins:
                raise InfeasiblePins(f"a Shard pin ({shard_pins[0]}) needs a tensor-parallel axis (tp > 1)",
                                     (shard_pins[0],))
            if cfg.tp == 1 and sharder.mode != "manual" and not sharder.pins:
                # one device on the axis: every choice is the same
                axes[key] = self.sharding(cfg)[0]
                return axes[key], shapes
            axes[key] = self._decide(model, cfg, sharder, shapes)
        return axes[key], shapes

    def _mesh_bound(self, cfg: ParallelConfig, pins: tuple = ()) -> Sharder:
        """The sharder a ``tp_mode=mesh`` ``cfg`` is decided with, the same for
        every request (plan, evaluate, the search, parallelize solving the plan
        again): the joint program unbounded where its estimate fits, else
        bounded by the device's memory less its transients, as the 1d ILP
        retries. A pipeline whose unbounded decisions do not fit, or fit only
        with stages unbalanced for memory, is decided again with a memory row
        per pipeline rank at even stages (:meth:`_pipeline_rows`; not with
        full recompute, as for 1d), kept where that fits and is faster."""
        bounds, key = self.state.mesh_bounds, (cfg, self.global_batch, pins)
        if key not in bounds:
            free = Sharder("ilp", pins, None)
            est = self._mesh_estimate(cfg, free)
            bounds[key] = free
            if cfg.pp == 1:
                if not est.fits:
                    bounds[key] = Sharder("ilp", pins, est.device_memory_bytes * MEMORY_HEADROOM -
                                          est.memory["transient"])
            elif cfg.recompute != "full" and (not est.fits or est.pipeline["layers"] !=
                                              pipe.even_layers(units(self.graph).layers, cfg.stages)):
                # the stages had to give way to memory: rows per rank may fit them evenly at less cost
                bounded = Sharder("ilp", pins, est.device_memory_bytes * MEMORY_HEADROOM - est.memory["transient"])
                try:
                    got = self._mesh_estimate(cfg, bounded)
                except StrategyError:     # no placements fit the even stages
                    got = None
                if got is not None and got.fits and (not est.fits or got.step_time_s < est.step_time_s):
                    bounds[key] = bounded
        return bounds[key]

    def mesh_estimate(self, cfg: ParallelConfig) -> Estimate:
        """A ``tp_mode=mesh`` ``cfg`` estimated as its unbounded joint program
        decides it (with the request's pins), whether or not that fits."""
        return self._mesh_estimate(cfg, Sharder("ilp", self.pins, None))

    def _mesh_estimate(self, cfg: ParallelConfig, sharder: Sharder) -> Estimate:
        """A ``tp_mode=mesh`` ``cfg`` estimated as decided by ``sharder`` (its
        stages balanced), once per request: the bound and the search's
        refinement both read the unbounded one."""
        key = (cfg, self.global_batch, sharder)
        if key not in self.state.mesh_estimates:
            model = self.cost(cfg.precision)
            sh, shapes = self._mesh_sharding(cfg, sharder)
            split = self._partition(model, cfg, sh, shapes, "balanced") if cfg.pp > 1 else None
            self.state.mesh_estimates[key] = model.estimate(cfg, sh, shapes, self.global_batch, cfg.devices, split)
        return self.state.mesh_estimates[key]

    def _mesh_sharding(self, cfg: ParallelConfig, sharder: Sharder) -> tuple[AxisSharding, dict]:
        """``tp_mode=mesh``: the decisions of both axes of the tp group's
        ``a x b`` mesh from one joint program (:func:`~autopar.search.mesh_ilp.solve_mesh`,
        with the sharder's memory bound as its memory row), returned as the
        inner axis's :class:`AxisSharding` with the outer one in ``others``,
        and the shapes local to dp. Sequence parallelism's pins hold on the
        inner axis, as on a 1d tp axis."""
        if cfg.sequence_parallel:     # Megatron's sequence split on the inner axis, as on a 1d tp axis
            inner = dataclasses.replace(cfg, tp=cfg.tp_grid[-1], tp_mode="1d")
            sp_key = (self.cost(cfg.precision).precision, sharder, inner.tp)
            if sp_key not in self.state.sequence_parallel:
                self.state.sequence_parallel[sp_key] = self._sequence_parallel(inner, sharder)
            sharder = self.state.sequence_parallel[sp_key]
        model = self.cost(cfg.precision)
        mb_global = self.global_batch // (cfg.microbatches * cfg.copies)     # one copy's samples
        skey = ("mesh copy", mb_global, cfg.dp)
        if skey not in self.state.shapes:
            self.state.shapes[skey] = scaled_shapes(self.graph, mb_global, cfg.dp)
        shapes = self.state.shapes[skey]
        # the weights' terms read ZeRO and the microbatches; a memory row, the recompute too
        bound = None if sharder.memory_limit is None else \
            (sharder.memory_limit, cfg.recompute, cfg.pp, cfg.schedule, cfg.chunks)
        key = ("mesh", model.precision, cfg.tp_grid, cfg.dp, cfg.cp, cfg.microbatches, cfg.copies, mb_global,
               cfg.zero, cfg.reduce_dtype, cfg.offload, bound, sharder.pins, self.solver)
        if key not in self.state.axes:
            sizes = cfg.tp_grid
            # with cp, priced at a cp rank's tokens (its share of the work and of the values the
            # tensor axes move; the whole shapes say what divides), the weights reduced over dp x cp,
            # as the estimate counts them
            view, token_shapes = model.token_view(cfg), model.token_shapes(shapes, cfg.cp)
            per_sample = model.per_sample_nodes()
            topo = model.topology((view.dp, *sizes))
            local_batch = mb_global / view.dp

            def comm(axis: int) -> Callable[[str, float], float]:
                return lambda kind, nbytes: topo.collective_time(kind, nbytes * model.itemsize / 4, axis)

            def compute(nd: Node, frac: float) -> float:
                return model.node_time(nd, model.scale(nd, local_batch), frac)

            memory = None if sharder.memory_limit is None else MemoryTerms(
                param=model.param_memory(view, mesh_pieces(sizes)),
                saved=model.saved_memory(view, token_shapes, mesh_pieces(sizes), mesh_partial(sizes)),
                limit=sharder.memory_limit,
                **({"group_factor": lambda k: 1.0} if cfg.recompute == "full" else {}))
            if memory is not None and cfg.pp > 1:     # per pipeline rank, at even stages
                memory = self._pipeline_rows(model, cfg, pipe.even_layers(units(self.graph).layers, cfg.stages),
                                             memory)
            axes = mesh_ilp.solve_mesh(self.graph, sizes, shapes, comm=[comm(1 + a) for a in range(len(sizes))],
                                       compute=compute, param_time=model.param_time(view, topo, mesh_pieces(sizes)),
                                       pins=dict(sharder.pins), memory=memory, solver=self.solver,
                                       byte_scale=None if cfg.cp == 1 else
                                       (lambda name: 1.0 / cfg.cp if name in per_sample else 1.0),
                                       # the structure kept with the 1d ones; its edges priced once per link
                                       # layout and token share (bounded and unbounded solves alike)
                                       cache=self.state.ilp, comm_key=(model.itemsize, view.dp, sizes, cfg.cp))
            inner = axes[-1]
            inner.others = tuple(axes[:-1])
            self.state.axes[key] = inner
        return self.state.axes[key], shapes

    def prefetch(self, cfg: ParallelConfig, sharder: Sharder) -> None:
        """Start the ILP that ``sharding(cfg, sharder)`` will solve (without a
        memory bound, with HiGHS, tp > 1) now, HiGHS solving it on a worker
        thread while the search goes on; ``sharding`` then takes its
        solution, the same one. Anything that goes wrong is left for
        ``sharding`` to raise."""
        if sharder.mode != "ilp" or sharder.memory_limit is not None or cfg.tp == 1 or \
                self.solver != solvers.DEFAULT:
            return
        try:
            key, model, sharder, shapes = self._axis_key(cfg, sharder)
            if key not in self.state.axes and key not in self.state.pending:
                self.state.pending[key] = self._decide(model, cfg, sharder, shapes, background=True)
        except StrategyError:
            pass

    def prefetch_choice(self, cfg: ParallelConfig) -> None:
        """:meth:`prefetch` the ILP :meth:`choose` will solve first for
        ``cfg`` (none when the Megatron placements are too far from fitting)."""
        if self.mode != "ilp" or cfg.tp == 1 or self.solver != solvers.DEFAULT:
            return
        try:
            ref = self.evaluate(cfg, Sharder("manual", self.pins))
        except StrategyError:
            return
        if not ref.fits and ref.peak_memory_bytes > NEAR_FIT * ref.device_memory_bytes * MEMORY_HEADROOM \
                and not self.pins:
            return
        self.prefetch(cfg, Sharder(self.mode, self.pins))

    def drop_prefetched(self) -> None:
        """Forget the prefetched ILPs no configuration asked for (their
        solves are cancelled where they have not started) and let the
        worker threads end."""
        for pending in self.state.pending.values():
            pending.cancel()
        self.state.pending.clear()
        stop_workers()

    def _axis_key(self, cfg: ParallelConfig, sharder: Sharder) -> tuple[tuple, CostModel, Sharder, dict]:
        """The cache key of ``cfg``'s decisions under ``sharder``, the cost
        model, the sharder with sequence parallelism's pins, and the local shapes."""
        model = self.cost(cfg.precision)
        global_batch = self.global_batch
        if cfg.sequence_parallel:
            sp_key = (model.precision, sharder, cfg.tp)
            if sp_key not in self.state.sequence_parallel:
                self.state.sequence_parallel[sp_key] = self._sequence_parallel(cfg, sharder)
            sharder = self.state.sequence_parallel[sp_key]
        mb_global = global_batch // cfg.microbatches
        if sharder.mode == "ilp":
            # the ILP also weighs what a weight costs per step (its gradient reduction and
            # optimizer update, spread over the microbatches) and, bounded, the memory
            bound = None
            zero = 3 if cfg.fsdp_layers else cfg.zero     # a mix takes its ZeRO-3 form's decisions
            if sharder.memory_limit is not None:
                # bounded: the memory depends on the recompute and ZeRO choices and, with a
                # pipeline, on the stages and the schedule's microbatches in flight
                bound = (cfg.recompute, zero, cfg.offload, cfg.reduce_dtype) if cfg.pp == 1 else \
                    (cfg.recompute, zero, cfg.offload, cfg.reduce_dtype, cfg.pp, cfg.microbatches,
                     cfg.schedule, cfg.chunks)
            ilp_key = (global_batch, min(zero, 1) if zero < 3 else 3, bound, self.solver)
            if cfg.cp > 1:     # the weights' gradients are reduced over dp x cp
                ilp_key += (cfg.cp,)
            key = (model.precision, cfg.tp, cfg.dp, mb_global, sharder, ilp_key)
        else:
            # propagation sees the dp axis only through the local batch and the tp
            # axis's link: configurations that share both share the decisions
            key = (model.precision, cfg.tp, self._local_key(cfg), sharder, None)
        skey = self._local_key(cfg, link=False)
        if skey not in self.state.shapes:
            self.state.shapes[skey] = scaled_shapes(self.graph, mb_global, cfg.dp)
        return key, model, sharder, self.state.shapes[skey]

    def _local_key(self, cfg: ParallelConfig, link: bool = True) -> tuple:
        """What the local shapes (and with ``link`` the tensor-parallel
        collectives) of ``cfg`` depend on: the samples of one microbatch on
        one data-parallel rank (``scaled_shapes`` at ``(B / m, dp)`` equals
        it at ``(B / (m dp), 1)``), and whether a tp group spans nodes."""
        mb_global = self.global_batch // cfg.microbatches
        local = (mb_global // cfg.dp,) if mb_global % cfg.dp == 0 else (mb_global, cfg.dp)
        if link:
            local += (self.model.topology((cfg.dp, cfg.tp)).spans_nodes(1),)
        return local

    def _decide(self, model: CostModel, cfg: ParallelConfig, sharder: Sharder, shapes: dict,
                background: bool = False) -> AxisSharding | PendingAxis:
        """Run ``sharder``'s search of the tensor-parallel axis (uncached;
        ``background``: the ILP's :class:`~autopar.search.ilp.PendingAxis`)."""
        topo = model.topology((cfg.dp, cfg.tp))
        local_batch = self.global_batch // cfg.microbatches / cfg.dp
        # the searches ask for the same few collectives and ops many times: both memoised
        # (a tp collective depends on the bytes, the tp size and whether it spans nodes)
        comm_key = (model.itemsize, cfg.tp, topo.spans_nodes(1))
        comms = self.state.comm.setdefault(comm_key, {})
        computes: dict[tuple[str, float], float] = {}

        def comm(kind: str, nbytes: float) -> float:
            t = comms.get((kind, nbytes))
            if t is None:
                t = comms[kind, nbytes] = topo.collective_time(kind, nbytes * model.itemsize / 4, 1)
            return t

        def compute(nd: Node, frac: float) -> float:
            t = computes.get((nd.name, frac))
            if t is None:
                t = computes[nd.name, frac] = model.node_time(nd, model.scale(nd, local_batch), frac)
            return t

        pins = dict(sharder.pins)
        if sharder.mode == "ilp":
            memory = None
            if sharder.memory_limit is not None:
                memory = self._memory_terms(model, cfg, shapes, sharder.memory_limit) if cfg.pp == 1 else \
                    self._pipeline_memory_terms(model, cfg, shapes, sharder)
            pending = start_axis(self.graph, cfg.tp, shapes, comm=comm, compute=compute,
                                 param_time=model.param_time(cfg, topo), pins=pins, memory=memory,
                                 cache=self.state.ilp, solver=self.solver, background=background,
                                 comm_key=comm_key)
            return pending if background else pending.result()
        weight = GREEDY_MEMORY_WEIGHT if sharder.mode == "greedy" else MANUAL_MEMORY_WEIGHT
        res = propagate(self.graph, cfg.tp, shapes, comm=comm, compute=compute,
                        itemsize=4, memory_weight=weight, pins=pins)
        for name, p in pins.items():
            if res.out.get(name, R) != p:
                raise InfeasiblePins(f"pinned placement {p} of {name} cannot be kept on a tensor-parallel "
                                     f"axis of size {cfg.tp}: no strategy of the ops around it allows it "
                                     f"(the propagation gave {res.out.get(name, R)})", (name,))
        return res

    def _sequence_parallel(self, cfg: ParallelConfig, sharder: Sharder) -> Sharder:
        """``sequence_parallel=true``: Megatron's sequence parallelism as pins
        on the tensor-parallel axis: every LayerNorm / RMSNorm on a (batch,
        sequence, hidden) activation is split along the sequence. The
        propagation (or the ILP) then keeps the residual stream and dropout
        split too, and turns the all-reduces around the tensor-parallel
        blocks into reduce-scatters and all-gathers."""
        pins, lengths = self.graph.memo(("sequence_parallel", sharder.pins), lambda: self._sp_pins(sharder.pins))
        for name, length in lengths:
            if length % cfg.tp:
                raise StrategyError(f"sequence_parallel=true with tp={cfg.tp}: the sequence length "
                                    f"{length} of {name} is not divisible by {cfg.tp}")
        if len(pins) == len(sharder.pins):
            raise StrategyError(f"sequence_parallel=true: {self.graph.name} has no LayerNorm/RMSNorm on "
                                "(batch, sequence, hidden) activations to split along the sequence")
        return Sharder(sharder.mode, pins, sharder.memory_limit)

    def _sp_pins(self, user_pins: tuple) -> tuple[tuple, list[tuple[str, int]]]:
        """:meth:`_sequence_parallel`'s pins with ``user_pins`` (whatever the
        tp size: made once per graph and pins), and the norms it splits with
        their sequence lengths, in graph order."""
        pinned = dict(user_pins)
        lengths = []
        g = self.graph
        for nd in g.nodes:
            # the residual stream's norms alone: (batch, sequence, hidden). A norm over each head
            # of a [batch, sequence, heads, head_dim] query or key (Qwen3's q_norm / k_norm, OLMo 2's)
            # runs inside attention, where tensor parallelism splits the heads
            if not nd.normalizes or nd.out is None or len(nd.out.shape) != 3:
                continue
            seq = 1
            lengths.append((nd.name, nd.out.shape[seq]))
            # the norm and the residual stream into it: the elementwise ops (residual and bias
            # adds, dropout) of the same shape, back to the matmuls and embeddings producing it,
            # and the casts between them (a norm written out in ops, Hugging Face's LlamaRMSNorm,
            # computes in fp32 between two `to`s: pinned through, its ops split as a fused norm's)
            todo = [nd.name]
            while todo:
                name = todo.pop()
                if name in pinned:
                    continue
                pinned[name] = f"S({seq})"
                for i in g[name].inputs:
                    src = g[i]
                    if src.out is None or src.out.shape != nd.out.shape:
                        continue
                    # a view only where it keeps its input's shape (a cast): a reshape into
                    # (batch, sequence, hidden) cannot hold the sequence split its input lacks
                    if src.kind == "elementwise" or (src.kind == "view" and src.inputs and
                                                     g[src.inputs[0]].out is not None and
                                                     g[src.inputs[0]].out.shape == src.out.shape):
                        todo.append(i)
        return tuple(sorted(pinned.items())), lengths

    def _memory_terms(self, model: CostModel, cfg: ParallelConfig, shapes: dict, limit: float) -> MemoryTerms:
        """The ILP's linear memory model for ``cfg``: model states per local
        parameter element (ZeRO-divided) and the activations each strategy
        saves, as the cost model counts them (shared inputs counted once per
        reader: an upper bound)."""
        param, saved = model.param_memory(cfg), model.saved_memory(cfg, shapes)
        if cfg.recompute == "full":
            return MemoryTerms(param=param, saved=saved, limit=limit, group_factor=lambda k: 1.0)
        return MemoryTerms(param=param, saved=saved, limit=limit)

    def _pipeline_memory_terms(self, model: CostModel, cfg: ParallelConfig, shapes: dict,
                               sharder: Sharder) -> list[MemoryTerms]:
        """The ILP's memory rows for a pipelined ``cfg``, one per pipeline rank
        (with the stages the time-optimal placements balance to): its model
        states and its activations times the microbatches its schedule keeps
        in flight. One row per rank, because placements that relieve the
        fullest rank can make another one the fullest (1F1B keeps more
        microbatches on the first rank, the head's weights sit on the last).
        The decisions of a repeated layer are shared by all its instances, so
        a layer's terms count the share of the layers the rank holds; nodes
        of other ranks count nothing. Not for full recompute (one recomputed
        layer at a time is not linear in the choices)."""
        free = self.evaluate(cfg, Sharder("ilp", sharder.pins), devices=cfg.devices)
        return self._pipeline_rows(model, cfg, (free.pipeline or {})["layers"],
                                   self._memory_terms(model, cfg, shapes, sharder.memory_limit))

    def _pipeline_rows(self, model: CostModel, cfg: ParallelConfig, layers: Sequence[int],
                       flat: MemoryTerms) -> list[MemoryTerms]:
        """``flat``'s terms as one row per pipeline rank of ``cfg`` with the
        virtual stages of ``layers`` layers each (:meth:`_pipeline_memory_terms`)."""
        bounds = pipe.unit_bounds(list(layers))
        stage_of_unit = [v for v in range(cfg.stages) for _ in range(bounds[v + 1] - bounds[v])]
        flights = pipe.in_flight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks)
        u = units(self.graph)
        in_layers = set(u.labels[1:-1])
        param_units = model.param_units()

        def rank_terms(rank: int) -> MemoryTerms:
            held = {k for k, v in enumerate(stage_of_unit) if v % cfg.pp == rank}
            flight = max(f for v, f in enumerate(flights) if v % cfg.pp == rank)
            layer_share = sum(1 for k in held if 0 < k <= u.layers) / u.layers

            def share(nd: Node) -> float:
                if nd.group in in_layers:
                    return layer_share
                us = param_units.get(nd.name) if nd.is_state else [u.of_node.get(nd.name, 0)]
                return 1.0 if us and any(k in held for k in us) else 0.0

            return MemoryTerms(param=lambda nd, p: flat.param(nd, p) * share(nd),
                               saved=lambda nd, st: flat.saved(nd, st) * share(nd) * flight,
                               limit=flat.limit)

        return [rank_terms(r) for r in range(cfg.pp)]

    # -- one configuration ------------------------------------------------------------
    def evaluate(self, cfg: ParallelConfig, sharder: Sharder = MANUAL, *, devices: int | None = None,
                 layers: str | Sequence[int] = "balanced", simulate_schedule: bool = True) -> Estimate:
        """Predict ``cfg`` (on ``devices``, the request's by default) with the
        tensor-parallel axis decided by ``sharder``.

        With ``pp > 1``, ``layers`` says how the repeated layers are split
        into stages: ``"balanced"`` (the stage search of
        :func:`autopar.pipeline.partition.balance`), ``"even"`` (Megatron's
        equal split) or the layer count of every virtual stage.
        ``simulate_schedule``: see :meth:`autopar.cost.CostModel.estimate`.
        Raises :class:`StrategyError` for a strategy the model or cluster
        cannot run (:class:`~autopar.search.ilp.InfeasiblePins` for pins)."""
        model = self.cost(cfg.precision)
        devices = devices or self.devices or cfg.devices
        check_config(self.graph, cfg, devices, self.global_batch)
        self.cluster.check_devices(devices)
        sh, shapes = self.sharding(cfg, sharder)
        split = None
        if cfg.pp > 1:
            split = self._partition(model, cfg, sh, shapes, layers)
        return model.estimate(cfg, sh, shapes, self.global_batch, devices, split, simulate_schedule)

    def pipeline_lower_bound(self, cfg: ParallelConfig, sharder: Sharder = MANUAL, *,
                             memory: bool = False) -> float:
        """A lower bound on the step time :meth:`evaluate` gives a pipelined
        ``cfg``, without balancing its stages
        (:meth:`~autopar.cost.CostModel.pipeline_lower_bound`); with
        ``memory``, on its peak memory per device instead
        (:meth:`~autopar.cost.CostModel.pipeline_memory_lower_bound`).
        Raises as :meth:`evaluate` does."""
        model = self.cost(cfg.precision)
        check_config(self.graph, cfg, self.devices or cfg.devices, self.global_batch)
        sh, shapes = self.sharding(cfg, sharder)
        bound = model.pipeline_memory_lower_bound if memory else model.pipeline_lower_bound
        return bound(cfg, sh, shapes, self.global_batch)

    def _partition(self, model: CostModel, cfg: ParallelConfig, sh: AxisSharding, shapes: dict,
                   layers: str | Sequence[int]) -> list[int]:
        """Layers per virtual stage: balanced under the cost model (the slowest
        stage as fast as the per-stage memory allows; equal when nothing
        balances within it), equal, or as given."""
        if not isinstance(layers, str):
            return list(layers)
        per = model.unit_costs(cfg, sh, shapes, self.global_batch)
        split = None
        if layers == "balanced":
            per_elem = model.state_per_elem(cfg)
            flight = pipe.in_flight(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks)
            cap = self.cluster.device.memory_bytes * MEMORY_HEADROOM / cfg.chunks
            # the search balances a configuration again when it simulates it, and
            # configurations that differ only in what the balance does not read alike
            key = (id(per), per_elem, tuple(flight), cfg.stages, cap)
            hit = self.state.partitions.get(key)
            if hit is None or hit[0] is not per:
                states = [x * per_elem for x in per.params]
                hit = self.state.partitions[key] = (per, pipe.balance(per.time, states, per.act, per.fixed,
                                                                      cfg.stages, flight, cap))
            split = hit[1]
        return list(split) if split else pipe.even_layers(len(per.time) - 2, cfg.stages)

    def choose(self, cfg: ParallelConfig, bound: float) -> tuple[Estimate, Sharder]:
        """The best estimate of ``cfg`` (fitting first, then fastest) under the
        request's mode, and the sharder that gave it; counted in
        :attr:`tally`. ``bound``: the best fitting time found so far (a
        memory-bounded ILP that cannot beat it is not solved).

        Per mode: ``grid`` evaluates the Megatron placements only; ``ilp`` and
        ``greedy`` also their own search, and keep the Megatron placements
        where those are better (a guard against the linearised memory model);
        ``ilp`` solves again under the memory bound when the time-optimal
        placements do not fit."""
        manual = Sharder("manual", self.pins)
        if self.mode == "grid":
            return self.evaluate(cfg, manual), manual
        ref = self.evaluate(cfg, manual)
        first = Sharder(self.mode, self.pins)
        cap = ref.device_memory_bytes * MEMORY_HEADROOM
        if not ref.fits and ref.peak_memory_bytes > NEAR_FIT * cap and not self.pins:
            # Megatron placements shard every weight they can: when they are far from
            # fitting, the per-op search (which only moves towards time) will not fit either
            return ref, manual
        tries = [(self.evaluate(cfg, first), first), (ref, manual)]
        self._count(cfg, first)
        est = tries[0][0]
        best_so_far = min(bound, ref.step_time_s) if ref.fits else bound
        if self.mode == "ilp" and not (cfg.pp > 1 and cfg.recompute == "full") and not est.fits and \
                est.step_time_s < best_so_far and (ref.fits or ref.peak_memory_bytes <= NEAR_FIT * cap):
            # the time-optimal choice does not fit; the memory-bounded one lies
            # between it and the manual sharding (with a pipeline, bounded on the
            # pipeline rank that needs the most memory)
            limit = cap - est.memory["transient"]
            for _ in range(2):
                sh = Sharder("ilp", self.pins, limit)
                try:
                    e = self.evaluate(cfg, sh)
                except StrategyError:
                    break
                self._count(cfg, sh)
                tries.append((e, sh))
                if e.fits:
                    break
                limit -= e.peak_memory_bytes - cap
        tries.sort(key=lambda t: (not t[0].fits, t[0].step_time_s, t[1].mode != self.mode))
        e, sh = tries[0]
        self.tally.won[sh.label] = self.tally.won.get(sh.label, 0) + 1
        return e, sh

    def _count(self, cfg: ParallelConfig, sh: Sharder) -> None:
        """Count an ILP solve of ``cfg`` under ``sh`` once per distinct solution."""
        axis, _ = self.sharding(cfg, sh)
        info = getattr(axis, "ilp", None)
        if info is not None and id(axis) not in self.tally.seen:
            self.tally.seen.add(id(axis))
            self.tally.ilp_solves += 1
            self.tally.ilp_time_s += info.build_s + info.solve_s
