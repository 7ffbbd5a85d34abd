"""Intra-operator sharding of one mesh axis as an integer linear program.

Every node that carries a placement gets a one-hot choice among the
candidates of :func:`autopar.strategies.candidates` (parameters: among the
placements their consumers can read). The objective is the time of one
microbatch on this axis, as :class:`autopar.cost.CostModel` counts it:

* per node: forward + backward compute of its local share and the
  collectives inside the op
  (:func:`~autopar.strategies.axis_cost.op_local_time`);
* per edge: the forward + backward transition between what the producer
  gives and how the consumer reads it, from the redistribution table
  (:func:`~autopar.strategies.redistribute.transition_time`). How it reads
  is the placement plus Megatron's f (a replicated value with a gradient
  feeding split work, whose backward sums the gradient: an all-reduce, or a
  reduce-scatter when the producer gives a shard, as under sequence
  parallelism), so the sum of both is
  :func:`~autopar.strategies.axis_cost.op_axis_time` over the graph. Edges
  are linearised with one continuous variable per (producer placement,
  consumer read) pair whose row and column sums equal the two one-hot
  choices (the tight "transportation" form Alpa uses).

An optional linear memory constraint bounds the model states of the local
parameter shards plus the activations saved for backward.

**Repeated layers share their variables**: the k-th node of every instance of
a layer group is one decision, with its costs multiplied by the number of
instances, and the edges between consecutive instances are one edge with a
multiplicity. So 96 identical blocks build an ILP the size of one block. An
instance that holds a user pin gets variables of its own.

The result is an :class:`AxisSharding` like the greedy propagation's, with
``ilp`` describing the program (size, times) and, per decision, the
runners-up with the extra time each would cost with its neighbours fixed.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from ..errors import StrategyError
from ..graph import Graph, Node
from ..spec.placement import P, R
from ..strategies import Strategy, candidates
from ..strategies.rules import Ctx
from ..strategies.axis_cost import op_local_time, shared_key
from ..strategies.redistribute import output_time, transition_time
from .propagate import _SKIP, INF, AxisSharding, _instances, _numel, needs_grad, pin_signature
from .solvers import BOUNDED_MIP_GAP, DEFAULT, Backend, HighsBackend, Model, backend

Shape = tuple[int, ...]
SCALE = 1e6          # the objective is in microseconds: HiGHS' tolerances suit numbers near 1
MEMORY_EPS = 1e-15   # s per byte of weight: among equal times, prefer the smaller shards


class InfeasiblePins(StrategyError):
    """The pinned placements admit no assignment. ``nodes`` names the pinned
    nodes at fault (one that no strategy allows, or two that contradict)."""

    def __init__(self, message: str, nodes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.nodes = nodes


@dataclass
class MemoryTerms:
    """A linear memory bound for the ILP: ``param(node, placement)`` bytes of
    model states, ``saved(node, strategy)`` bytes of activations kept for
    backward per instance, ``group_factor`` instances counted for a repeated
    layer's activations (1 with full recompute), ``limit`` in bytes."""

    param: Callable[[Node, str], float]
    saved: Callable[[Node, Strategy], float]
    limit: float
    group_factor: Callable[[int], float] = lambda k: float(k)


@dataclass
class IlpInfo:
    """What the program looked like and how it went."""

    nodes: int              # graph nodes with a decision
    decisions: int          # after sharing the variables of repeated layers
    variables: int
    constraints: int
    build_s: float
    solve_s: float
    status: str
    objective_s: float      # predicted time of one microbatch on this axis (as the ILP counts it)
    shared_instances: int
    memory_limited: bool
    runners_up_fn: Callable[[], dict] | None = None
    # the joint program of several axes (search.mesh_ilp): the seconds per microbatch of the
    # collectives its decisions run, on every axis (the objective less compute and weights' terms),
    # and the same per node (its own collectives and the transitions into it; a pipeline's stages sum them)
    collectives_s: float | None = None
    node_collectives_s: dict[str, float] | None = None

    def runners_up(self) -> dict[str, list[tuple[str, str, float]]]:
        """Per op decision (named by its first node), the other candidates as
        ``(strategy, output placement, extra seconds per microbatch)`` if
        only that decision changed, cheapest first (at most 3)."""
        return self.runners_up_fn() if self.runners_up_fn else {}


def solve_axis(graph: Graph, n: int, shapes: dict[str, Shape | None], *,
               comm: Callable[[str, float], float], compute: Callable[[Node, float], float],
               param_time: Callable[[Node, str], float] | None = None,
               pins: dict[str, str] | None = None,
               memory: MemoryTerms | Sequence[MemoryTerms] | None = None, time_limit_s: float = 60.0, cache: dict | None = None,
               solver: str = DEFAULT) -> AxisSharding:
    """Optimal placements of an axis of size ``n`` (see the module docstring).

    ``shapes`` are node shapes local to the other axes; ``comm(kind, nbytes)``
    the time of a collective on this axis for a tensor of ``nbytes`` (at 4
    bytes per element); ``compute(node, fraction)`` the forward time of a node
    doing ``fraction`` of its work; ``param_time(node, placement)`` the time
    per microbatch a parameter costs in that placement outside this axis (its
    share of the data-parallel gradient reduction and of the optimizer step:
    a replicated weight has more to reduce and update); ``pins`` fixes the output placement of
    nodes (parameters included). ``memory``: one linear memory row, or one
    per device kind that must fit (a pipeline's ranks). ``cache``: a dict the caller keeps across
    solves (the planner's), where the problem's structure is kept per shapes
    and pins. ``solver``: the MILP backend, one of
    :data:`autopar.search.solvers.SOLVERS` (HiGHS by default). Raises
    :class:`InfeasiblePins` when the pins leave no valid assignment,
    :class:`StrategyError` when the memory bound does or ``solver`` is not
    valid or not installed.
    """
    return start_axis(graph, n, shapes, comm=comm, compute=compute, param_time=param_time, pins=pins,
                      memory=memory, time_limit_s=time_limit_s, cache=cache, solver=solver).result()


def start_axis(graph: Graph, n: int, shapes: dict[str, Shape | None], *,
               comm: Callable[[str, float], float], compute: Callable[[Node, float], float],
               param_time: Callable[[Node, str], float] | None = None,
               pins: dict[str, str] | None = None,
               memory: MemoryTerms | Sequence[MemoryTerms] | None = None, time_limit_s: float = 60.0,
               cache: dict | None = None, solver: str = DEFAULT, background: bool = False,
               comm_key: Hashable | None = None) -> "PendingAxis":
    """:func:`solve_axis` in two steps: the program is built now, and
    solved by :meth:`PendingAxis.result` (``background``: by a worker
    thread from now on, where the backend allows it, so that the caller
    builds the next program while HiGHS, which releases the GIL, solves
    this one; the solution is the same). ``comm_key`` names what ``comm``
    prices (``comm`` functions of the same key give every collective the
    same time): the edges of a cached problem are then priced once per
    key. Raises what :func:`solve_axis` raises while building; the rest
    from :meth:`PendingAxis.result`."""
    mip = backend(solver)
    t0 = time.perf_counter()
    pins = dict(pins or {})
    # the structure (decisions, candidates, edges) depends on the shapes and
    # the pins only: the search re-solves it under many cost models
    cache = {} if cache is None else cache
    skey = (n, id(shapes), tuple(sorted(pins.items())))
    try:
        prob = cache.get(skey)
        if prob is None or prob.shapes is not shapes:
            prob = cache[skey] = _Problem(graph, n, shapes, pins)
        prob.comm, prob.compute, prob.comm_key = comm, compute, comm_key
        prob.param_time = param_time or (lambda nd, p: 0.0)
        build = time.perf_counter() - t0
        built = prob.build(memory)
    except InfeasiblePins as e:
        raise _conflict(graph, n, shapes, pins, solver) or e
    built.build_s += build
    return PendingAxis(prob, built, mip, time_limit_s, (graph, n, shapes, pins, solver), background)


class PendingAxis:
    """A built sharding program on its way to a solution (see :func:`start_axis`)."""

    def __init__(self, prob: "_Problem", built: "_Built", mip: Backend, time_limit_s: float, args: tuple,
                 background: bool) -> None:
        self.prob, self.built, self.args = prob, built, args
        self._solve = lambda: _timed(mip.solve, built.mdl, time_limit_s)
        self.future = None
        if background and isinstance(mip, HighsBackend):
            try:
                self.future = _executor().submit(self._solve)
            except RuntimeError:    # the workers were just stopped (another search ended): solve on demand
                pass

    def cancel(self) -> None:
        """Do not solve it on the worker if it has not started yet."""
        if self.future is not None:
            self.future.cancel()

    def result(self) -> AxisSharding:
        """The placements; raises as :func:`solve_axis` does."""
        try:
            sol, solve_s = self.future.result() if self.future is not None else self._solve()
        except CancelledError:      # dropped before it ran (another search stopped the workers)
            sol, solve_s = self._solve()
        try:
            res = self.prob.finish(self.built, sol)
        except InfeasiblePins as e:
            raise _conflict(*self.args) or e
        res.ilp.build_s = self.built.build_s
        res.ilp.solve_s = solve_s + self.built.finish_s
        return res


def _timed(fn: Callable, *args) -> tuple:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


_EXECUTOR: list = []
WORKERS = 2    # HiGHS solves at once in the background (each on one thread)


def _executor():
    """The worker threads background solves run on (made on first use,
    until :func:`stop_workers`)."""
    if not _EXECUTOR:
        from concurrent.futures import ThreadPoolExecutor
        _EXECUTOR.append(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="autopar-ilp"))
    return _EXECUTOR[0]


def stop_workers() -> None:
    """Let the worker threads end once their solve is done (a search is
    over: no thread outlives it, e.g. into a fork), cancelling queued solves."""
    while _EXECUTOR:
        _EXECUTOR.pop().shutdown(wait=False, cancel_futures=True)


def _conflict(graph: Graph, n: int, shapes: dict, pins: dict[str, str], solver: str) -> InfeasiblePins | None:
    """The error naming two contradicting pins, when the pins admit no
    assignment because of a pair of them (None otherwise)."""
    pair = find_conflict(graph, n, shapes, pins, solver) if len(pins) > 1 else None
    if pair is None:
        return None
    a, b = pair
    by_name = {nd.name: nd for nd in graph.nodes}
    err = InfeasiblePins(f"the pinned placements of {_label(by_name[a])} ({pins[a]}) and "
                         f"{_label(by_name[b])} ({pins[b]}) contradict on a tensor-parallel axis of "
                         f"size {n}: no sharding of the ops between them satisfies both", (a, b))
    err.__suppress_context__ = True
    return err


def coefficients(graph: Graph, n: int, shapes: dict[str, Shape | None], *,
                 comm: Callable[[str, float], float], compute: Callable[[Node, float], float],
                 param_time: Callable[[Node, str], float] | None = None) -> "_Problem":
    """The cost coefficients :func:`solve_axis` builds its program from, for
    the same arguments, without solving: ``node_cost(name, strategy)``,
    ``edge_cost(producer, placement, read(producer, strategy, slot))``,
    ``charge(node, strategy, input placements)`` (a node's cost with the
    edges into it) and ``param_cost(name, placement)``. The objective of a
    set of decisions is the sum of ``charge`` over the decided nodes plus
    ``param_cost`` over the parameters (used to check that the ILP, the
    greedy search and the cost model charge the same time)."""
    prob = _Problem(graph, n, shapes, {})
    prob.comm, prob.compute = comm, compute
    prob.param_time = param_time or (lambda nd, p: 0.0)
    return prob


def find_conflict(graph: Graph, n: int, shapes: dict, pins: dict[str, str],
                  solver: str = DEFAULT) -> tuple[str, str] | None:
    """Two pins that cannot hold together (the first such pair in pin order),
    or None. Each check is a feasibility ILP with all costs zero, solved by
    ``solver`` (as :func:`solve_axis`'s)."""
    mip = backend(solver)

    def feasible(sub: dict[str, str]) -> bool:
        try:
            prob = _Problem(graph, n, shapes, sub)
            prob.comm, prob.compute, prob.param_time = (lambda k, b: 0.0), (lambda nd, f: 0.0), (lambda nd, p: 0.0)
            prob.solve(None, 30.0, mip)
            return True
        except InfeasiblePins:
            return False

    names = list(pins)
    if not all(feasible({a: pins[a]}) for a in names):
        return None     # one pin is wrong on its own: its own error says so
    for i, b in enumerate(names):
        for a in names[:i]:
            if not feasible({a: pins[a], b: pins[b]}):
                return a, b
    return None


@dataclass
class _Built:
    """A program built by :meth:`_Problem.build`: the model, the variables of
    the op and parameter decisions, the memory rows (and whether a bound was
    given), the cost functions it
    was priced with, and the seconds spent building (and finishing) it."""

    mdl: Model
    x: dict
    xp: dict
    rows: list
    bounded: bool      # a memory bound was given
    costs: tuple
    build_s: float
    finish_s: float = 0.0


class _EdgeTerms:
    """What the edges add to a program (:meth:`_Problem._edge_terms`), with
    :class:`~autopar.search.solvers.Model`'s ``var`` / ``cost`` / ``row``:
    costs on the decision variables and the constant (``adds``, in the
    order they were added), the pair variables numbered from ``first`` on
    with their costs, and the rows. Every build of a problem numbers its
    decision variables alike, so the same transition prices give the same
    terms, added to the next program as they are (:meth:`add_to`)."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.adds: list[tuple[int | None, float]] = []
        self.costs: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self) -> int:
        self.costs.append(0.0)
        return self.first + len(self.costs) - 1

    def cost(self, v: int | None, c: float) -> None:
        if v is not None and v >= self.first:
            self.costs[v - self.first] += c
        else:
            self.adds.append((v, c))

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def add_to(self, mdl: Model) -> None:
        """Add the terms to ``mdl``, whose decision variables are numbered as
        those they were priced for (continuous pair variables in [0, 1])."""
        assert len(mdl.costs) == self.first, "the decision variables are numbered otherwise"
        costs = mdl.costs
        for v, c in self.adds:
            if v is None:
                mdl.constant += c
            else:
                costs[v] += c
        k = len(self.costs)
        costs.extend(self.costs)
        mdl.upper.extend([1.0] * k)
        mdl.integer.extend([False] * k)
        mdl.rows.extend(self.rows)


class _Problem:
    def __init__(self, graph: Graph, n: int, shapes: dict, pins: dict[str, str]) -> None:
        self.graph, self.n, self.shapes, self.pins = graph, n, shapes, pins
        # what comm prices is named by comm_key (None: unnamed, priced at every build);
        # the edges' terms are kept per name
        self.comm_key: Hashable | None = None
        self._edge_cache: dict[Hashable, _EdgeTerms] = {}
        self.grad = needs_grad(graph)
        # which nodes share a decision, and the edges between decisions, do not
        # depend on the shapes: computed once per graph and pins
        self._pins_key = tuple(sorted(pins.items()))
        self.by_name, self.key, self.mult, self.copied_from, self.edges, self.reps, self.shared = graph.memo(
            ("ilp_structure", self._pins_key), self._structure)
        self._choices()
        self._placed_nodes: tuple[list[str], dict[str, list[str]], dict[str, list[str]]] | None = None
        self._edges_planned: list[tuple] | None = None
        self._node_counts: tuple[int, int] | None = None

    def _structure(self) -> tuple:
        """(nodes by name, decision key per node, multiplicities, copied
        instances, edges, the nodes that are their own decision in graph
        order, the shared readings)."""
        self.by_name = {nd.name: nd for nd in self.graph.nodes}
        self._keys()
        shared = self._edges()
        reps = [nd for nd in self.graph.nodes if self.key[nd.name] == nd.name]
        return self.by_name, self.key, self.mult, self.copied_from, self.edges, reps, shared

    # -- which nodes share a decision ----------------------------------------
    def _keys(self) -> None:
        g = self.graph
        inst = _instances(g)
        self.key: dict[str, str] = {}
        self.mult: dict[str, int] = {}
        self.copied_from: dict[str, str] = {}
        for grp in g.groups:
            # instances pinned alike (none, or the same pins at the same places, as
            # sequence parallelism pins every layer) share their decisions
            by_sig: dict[tuple, list[str]] = {}
            for i in grp.instances:
                if i in inst:
                    by_sig.setdefault(pin_signature(inst[i], self.pins), []).append(i)
            for shared in by_sig.values():
                if len(shared) < 2:
                    continue
                template = inst[shared[0]]
                for i in shared:
                    for a, b in zip(inst[i], template):
                        self.key[a.name] = b.name
                        # a parameter read only by this instance but listed outside it (torch.export
                        # keeps the parameters apart from the layers' ops) shares its decision too
                        for ia, ib in zip(a.inputs, b.inputs):
                            pa = g[ia]
                            if ia != ib and pa.is_state and pa.group is None and g[ib].is_state and \
                                    all(g[c].group == i for c in g.consumers(ia)):
                                self.key[ia] = ib
                same = set(shared)
                for a, b, c in zip(grp.instances, grp.instances[1:], grp.instances[2:]):
                    # c costs what b costs when both read from an instance with the same decisions
                    if a in same and b in same and c in same:
                        self.copied_from[c] = b
        for nd in g.nodes:
            k = self.key.setdefault(nd.name, nd.name)
            self.mult[k] = self.mult.get(k, 0) + 1

    def _decides(self, nd: Node) -> bool:
        """Whether ``nd`` is an op with a strategy choice (not a parameter or input)."""
        return self._placed(nd) and not nd.is_state and nd.kind != "input"

    def _placed(self, nd: Node) -> bool:
        return not (nd.kind in _SKIP or (nd.out is None and nd.kind not in ("split", "input")))

    # -- the candidates of every decision --------------------------------------
    def _choices(self) -> None:
        g, n = self.graph, self.n
        self.cands: dict[str, list[Strategy]] = {}      # op decisions
        self.pplace: dict[str, list[str]] = {}          # parameter decisions: placements
        wants: dict[str, set[str]] = {}
        for nd in self.reps:
            if not self._decides(nd):
                continue
            ctx = Ctx(nd, [self.shapes.get(i) for i in nd.inputs], [self.by_name[i].kind for i in nd.inputs],
                      self.shapes.get(nd.name), n, 4)
            cs = [st for st in candidates(ctx) if len(st.ins) == len(nd.inputs)]
            pin = self.pins.get(nd.name)
            if pin is not None:
                cs = [st for st in cs if st.out == pin]
                if not cs:
                    raise InfeasiblePins(f"pinned placement {pin} for {_label(nd)} is not one this op can "
                                         f"produce on an axis of size {n}; it can produce: "
                                         f"{', '.join(sorted({s.out for s in candidates(ctx)}))}", (nd.name,))
            if not cs:
                cs = [Strategy("replicate", tuple(R for _ in nd.inputs), R, False)]
            self.cands[nd.name] = cs
            for st in cs:
                for i, w in zip(nd.inputs, st.ins):
                    wants.setdefault(self.key[i], set()).add(w)
        for nd in self.reps:
            if nd.is_state:
                opts = sorted(({R} | wants.get(nd.name, set())) - {P})
                pin = self.pins.get(nd.name)
                if pin is not None:
                    if pin not in opts:
                        raise InfeasiblePins(f"pinned placement {pin} for parameter {_label(nd)} is read by no "
                                             f"strategy of its consumers on an axis of size {n}; possible: "
                                             f"{', '.join(opts)}", (nd.name,))
                    opts = [pin]
                self.pplace[nd.name] = opts
        self._prune()

    def outs(self, k: str) -> list[str]:
        if k in self.pplace:
            return self.pplace[k]
        if k in self.cands:
            return sorted({st.out for st in self.cands[k]})
        return [R]      # graph inputs: every rank of this axis holds the same data

    def _prune(self) -> None:
        """Drop candidates that read a partial sum their producer can never give."""
        changed = True
        while changed:
            changed = False
            for k, cs in self.cands.items():
                nd = self.by_name[k]
                ok = [st for st in cs if not any(self._never_given(i, w) for i, w in zip(nd.inputs, st.ins))]
                if len(ok) != len(cs):
                    if not ok:
                        if self.pins.get(k):
                            raise InfeasiblePins(f"pinned placement {self.pins[k]} for {_label(nd)} needs a "
                                                 "partial-sum input that its producer cannot give", (k,))
                        ok = [self._replicated(nd)]
                    self.cands[k] = ok
                    changed = True

    def _value_class(self, u: str) -> str:
        """What else a transition's price depends on than the placements, the
        bytes and the gradient (a subclass may refuse some values' moves):
        nothing here. Part of the key transitions are priced once by."""
        return ""

    def _never_given(self, i: str, want: str) -> bool:
        """Whether reading ``i`` as ``want`` asks for a partial sum its producer never gives."""
        src = self.by_name[i]
        return want == P and (src.is_state or (self._placed(src) and P not in self.outs(self.key[i])))

    def _replicated(self, nd: Node) -> Strategy:
        """``nd`` run whole, every input replicated: the fallback of every op."""
        return Strategy("replicate", tuple(R for _ in nd.inputs), R, False)

    # -- costs ------------------------------------------------------------------
    def nbytes(self, name: str) -> float:
        return _numel(self.shapes.get(name)) * 4.0

    def node_cost(self, k: str, st: Strategy) -> float:
        """The time of ``k`` as ``st`` that does not depend on its neighbours
        (:func:`~autopar.strategies.axis_cost.op_local_time`; the graph's
        output also pays for being made whole). The input transitions,
        Megatron's f included, are on the edges."""
        nd = self.by_name[k]
        c = op_local_time(nd, st, self.n, self.compute, self.comm)
        if nd.name == self.graph.output:
            c += output_time(st.out, self.nbytes(k), self.comm)
        return c

    def param_cost(self, k: str, p: str) -> float:
        return self.param_time(self.by_name[k], p) + MEMORY_EPS * self.nbytes(k) * (1.0 if p == R else 1.0 / self.n)

    def _edges(self) -> dict[tuple, int]:
        """``self.edges``: (producer decision, consumer decision, input slot)
        -> multiplicity. Returns the shared readings: the edges by which
        several readers of one layer instance (or several outside the
        layers) read one value, as a sorted tuple of edges -> how many
        values are read so; a transition they read alike is inserted once
        (:func:`~autopar.strategies.axis_cost.shared_key`)."""
        self.edges: dict[tuple[str, str, int], int] = {}
        readers: dict[tuple[str, str | None], set] = {}
        for nd in self.graph.nodes:
            kv = self.key[nd.name]
            if not self._decides(self.by_name[kv]):
                continue
            for slot, i in enumerate(nd.inputs):
                if not self._placed(self.by_name[i]):
                    continue
                e = (self.key[i], kv, slot)
                self.edges[e] = self.edges.get(e, 0) + 1
                readers.setdefault((i, nd.group), set()).add(e)
        shared: dict[tuple, int] = {}
        for es in readers.values():
            if len(es) > 1:
                sig = tuple(sorted(es))
                shared[sig] = shared.get(sig, 0) + 1
        return shared

    def read(self, u: str, st: Strategy, slot: int) -> tuple[str, bool]:
        """How a consumer running ``st`` reads its input ``slot`` (produced by
        ``u``): the placement, and whether it is Megatron's f (a replicated
        value with a gradient feeding split work), whose backward depends on
        the producer's placement (all-reduce, or reduce-scatter from a shard)."""
        w = st.ins[slot]
        return w, w == R and st.split and self.grad.get(u, False)

    def edge_cost(self, u: str, have: str, read: tuple[str, bool]) -> float:
        """Forward + backward time of moving ``u``'s value from ``have`` to
        ``read`` (see :meth:`read`), from the redistribution table."""
        want, into_split = read
        return transition_time(have, want, self.nbytes(u), self.grad.get(u, False), into_split, self.comm)

    def charge(self, nd: Node, st: Strategy, have: dict[str, str], charged: set | None = None) -> float:
        """What the program charges ``nd`` run as ``st`` when its inputs are
        placed as ``have`` (graph inputs: R): its node cost and the edges into
        it. ``charged``: the transitions earlier readers paid for
        (:func:`~autopar.strategies.axis_cost.shared_key`), skipped; this
        node's are added."""
        c = self.node_cost(nd.name, st)
        for slot, i in enumerate(nd.inputs):
            if self._placed(self.by_name[i]):
                q = self.read(i, st, slot)
                t = self.edge_cost(i, have.get(i, R), q)
                if charged is not None and t:
                    key = shared_key(nd, i, q[0], st.split, self.grad)
                    if key in charged:
                        continue
                    charged.add(key)
                c += t
        return c

    def objective(self, strategy: dict[str, Strategy], out: dict[str, str]) -> float:
        """What the program charges a whole set of decisions, parameters
        apart: :meth:`charge` over the decided nodes in graph order, each
        shared transition once (what :func:`solve_axis`'s optimum is, for its
        own decisions, less the parameter terms)."""
        charged: set = set()
        return sum(self.charge(nd, strategy[nd.name], out, charged) for nd in self.graph.nodes
                   if nd.name in strategy)

    # -- the program --------------------------------------------------------------
    def _memory_row(self, mdl, memory: MemoryTerms, x: dict, xp: dict) -> None:
        """Add ``memory``'s row: model states of the parameter choices plus the
        activations each strategy saves, within ``memory.limit``."""
        row: dict[int, float] = {}
        fixed = 0.0
        mib = 2.0 ** 20

        def put(v: int | None, b: float) -> None:
            nonlocal fixed
            if v is None:
                fixed += b / mib
            else:
                row[v] = row.get(v, 0.0) + b / mib

        for k in self.pplace:
            for p, v in xp[k].items():
                put(v, memory.param(self.by_name[k], p) * self.mult[k])
        for k, cs in self.cands.items():
            nd = self.by_name[k]
            f = memory.group_factor(self.mult[k]) if nd.group is not None else self.mult[k]
            for st, v in zip(cs, x[k]):
                put(v, memory.saved(nd, st) * f)
        mdl.row(row, -INF, memory.limit / mib - fixed)

    def solve(self, memory: MemoryTerms | Sequence[MemoryTerms] | None, time_limit_s: float,
              mip: Backend) -> AxisSharding:
        """Build the program (see the module docstring) and solve it with the
        backend ``mip``."""
        built = self.build(memory)
        return self.finish(built, mip.solve(built.mdl, time_limit_s))

    def build(self, memory: MemoryTerms | Sequence[MemoryTerms] | None) -> "_Built":
        """The program under the current costs (``comm``, ``compute``,
        ``param_time``), which the :class:`_Built` keeps for the runners-up."""
        t0 = time.perf_counter()
        mdl = Model()
        ONE = None                        # a decision with a single choice: the constant 1
        x: dict[str, list] = {}           # op decision -> one binary per candidate (or [ONE])
        xp: dict[str, dict[str, int | None]] = {}   # param decision -> placement -> binary (or ONE)
        for k, cs in self.cands.items():
            x[k] = [ONE] if len(cs) == 1 else [mdl.var(integer=True) for _ in cs]
            if len(cs) > 1:
                mdl.row({v: 1.0 for v in x[k]}, 1.0, 1.0)
        for k, opts in self.pplace.items():
            xp[k] = {opts[0]: ONE} if len(opts) == 1 else {p: mdl.var(integer=True) for p in opts}
            if len(opts) > 1:
                mdl.row({v: 1.0 for v in xp[k].values()}, 1.0, 1.0)

        for k, cs in self.cands.items():
            m = self.mult[k]
            for st, v in zip(cs, x[k]):
                mdl.cost(v, m * self.node_cost(k, st) * SCALE)
        for k, opts in self.pplace.items():
            for p, v in xp[k].items():
                mdl.cost(v, self.mult[k] * self.param_cost(k, p) * SCALE)

        self._edge_terms(mdl, x, xp)

        rows = [] if memory is None else [memory] if isinstance(memory, MemoryTerms) else list(memory)
        for terms in rows:
            self._memory_row(mdl, terms, x, xp)
        if rows:
            mdl.rel_gap = BOUNDED_MIP_GAP
        return _Built(mdl, x, xp, rows, memory is not None, (self.comm, self.compute, self.param_time),
                      time.perf_counter() - t0)

    def finish(self, built: "_Built", sol) -> AxisSharding:
        """The placements of ``built``'s solution ``sol`` (a
        :class:`~autopar.search.solvers.Solution`). Raises
        :class:`InfeasiblePins` or :class:`StrategyError` when it has none."""
        t0 = time.perf_counter()
        mdl, x, xp, rows = built.mdl, built.x, built.xp, built.rows
        status, values, objective = sol.status, sol.values, sol.objective
        if status != "Optimal":
            if self.pins and not built.bounded:
                raise InfeasiblePins(f"the pinned placements admit no sharding ({status})")
            raise StrategyError(f"no sharding on this axis satisfies the memory bound of "
                                f"{rows[0].limit / 2**30:.3g} GiB ({status})" if rows else
                                f"the sharding program could not be solved ({status})")

        def val(v: int | None) -> float:
            return 1.0 if v is None else values[v]

        pick = {k: max(range(len(vs)), key=lambda j: val(vs[j])) for k, vs in x.items()}
        ppick = {k: max(d, key=lambda p: val(d[p])) for k, d in xp.items()}
        res = AxisSharding(n=self.n)
        out, strategy = res.out, res.strategy
        picked = {k: self.cands[k][j] for k, j in pick.items()}
        inputs, params, ops = self._placements()
        out.update(dict.fromkeys(inputs, R))
        for k, names in params.items():
            out.update(dict.fromkeys(names, ppick[k]))
        for k, names in ops.items():     # a decision's nodes at once: repeated layers share it
            st = picked[k]
            strategy.update(dict.fromkeys(names, st))
            out.update(dict.fromkeys(names, st.out))
        out["__output__"] = R
        res.copied_from = dict(self.copied_from)
        res.reused_instances = len(self.copied_from)
        objective = (objective + mdl.constant) / SCALE
        n_vars = len(mdl.costs)
        decided, shared = self._counts()
        res.ilp = IlpInfo(nodes=decided, decisions=len(self.cands) + len(self.pplace), variables=n_vars,
                          constraints=len(mdl.rows), build_s=0.0, solve_s=0.0, status=status,
                          objective_s=objective, shared_instances=shared, memory_limited=bool(rows))
        # the runners-up are for --explain: computed when asked for
        comm, compute, param_time = built.costs

        def runners_up() -> dict[str, list[tuple[str, str, float]]]:
            self.comm, self.compute, self.param_time = comm, compute, param_time
            return self._runners_up(pick, ppick)

        res.ilp.runners_up_fn = runners_up
        built.finish_s = time.perf_counter() - t0
        return res

    def _edge_terms(self, mdl: Model, x: dict[str, list], xp: dict[str, dict[str, int | None]]) -> None:
        """Add the edges' costs to ``mdl`` (:meth:`_price_edges`; priced once
        per ``comm_key``: the edges cost only transitions). ``x`` / ``xp``:
        the op and parameter decisions' variables (None: a single choice,
        the constant 1)."""
        terms = self._edge_cache.get(self.comm_key) if self.comm_key is not None else None
        if terms is None:
            terms = _EdgeTerms(len(mdl.costs))
            self._price_edges(terms, x, xp)
            if self.comm_key is not None:
                self._edge_cache[self.comm_key] = terms
        terms.add_to(mdl)

    def _price_edges(self, mdl: _EdgeTerms, x: dict[str, list], xp: dict[str, dict[str, int | None]]) -> None:
        """The edges' terms: linear in one side's choice when the other side
        has one, else the transportation form (see the module docstring).
        A transition the readers of a shared reading (:meth:`_edges`) read
        alike is paid once: one variable per transition, at least every
        reader's indicator of it, carries its price."""
        moves: dict[tuple, float] = {}     # the transitions repeat across edges: priced once each
        alone = dict(self.edges)           # per edge: the multiplicity no shared reading covers
        for sig, count in self.shared.items():
            for e in sig:
                alone[e] -= count
        # per edge, (given, read) -> the variables whose sum says that pair is taken (None: 1)
        taken: dict[tuple, dict[tuple, list]] = {}
        prices: dict[tuple, dict[tuple, float]] = {}
        for e, u, _m, have, want, pairs, sums in self._edge_plan(x, xp):
            cost = {}
            for p, q, key in pairs:
                c = moves.get(key)
                if c is None:
                    c = moves[key] = self.edge_cost(u, p, q)
                cost[p, q] = c
            if all(c == 0 for c in cost.values()):
                continue
            prices[e] = cost
            ind = taken[e] = {}
            if len(have) == 1 or len(want) == 1:
                # one side is fixed: the pair is the other side's choice
                for (p, q), c in cost.items():
                    ts = want[q] if len(have) == 1 else have[p]
                    if c != INF:
                        ind[p, q] = ts
                        continue
                    for t in ts:
                        if t is None:
                            raise InfeasiblePins(f"no placement of {u} can be read as {q[0]}")
                        mdl.row({t: 1.0}, 0.0, 0.0)
            else:
                for (p, q), c in cost.items():
                    if c != INF:
                        ind[p, q] = [mdl.var()]
                # transportation form: the pair variables' row and column sums are the two choices
                for side, groups in enumerate(sums):
                    by_side: dict[str, dict] = {}       # placement on this side -> its pairs' variables
                    for pq, ts in ind.items():
                        by_side.setdefault(pq[side], {})[ts[0]] = 1.0
                    for pl, (coefs, const) in groups.items():
                        row = dict(by_side.get(pl, {}))
                        for vv in coefs:
                            row[vv] = row.get(vv, 0.0) - 1.0
                        mdl.row(row, const, const)
            if alone[e]:
                for pq, ts in ind.items():
                    if cost[pq]:
                        for t in ts:
                            mdl.cost(t, alone[e] * cost[pq] * SCALE)
        for sig, count in self.shared.items():
            by_move: dict[tuple, tuple[float, list[list]]] = {}   # (given, read) -> its price, the readers
            for e in sig:
                for pq, ts in taken.get(e, {}).items():
                    if prices[e][pq]:
                        by_move.setdefault(pq, (prices[e][pq], []))[1].append(ts)
            for pq, (c, readers) in by_move.items():
                if len(readers) == 1:
                    for t in readers[0]:
                        mdl.cost(t, count * c * SCALE)
                    continue
                z = mdl.var()
                mdl.cost(z, count * c * SCALE)
                for ts in readers:     # z >= the reader's indicator of the pair
                    row = {z: 1.0}
                    ones = 0.0
                    for t in ts:
                        if t is None:
                            ones += 1.0
                        else:
                            row[t] = row.get(t, 0.0) - 1.0
                    mdl.row(row, ones, INF)

    def _edge_plan(self, x: dict[str, list], xp: dict[str, dict[str, int | None]]) -> list[tuple]:
        """Per edge ``(the edge, producer, multiplicity, {placement given: its
        variables}, {read: its variables}, [(given, read, key of the
        transition's price)], the two sides' sums as (variables, constant)
        per placement)``. Every build of this problem numbers the
        decision variables alike, so the list is made once."""
        if self._edges_planned is None:
            def out_terms(u: str) -> dict[str, list]:
                if u in xp:
                    return {p: [v] for p, v in xp[u].items()}
                if u in x:
                    t: dict[str, list] = {}
                    for st, v in zip(self.cands[u], x[u]):
                        t.setdefault(st.out, []).append(v)
                    return t
                return {R: [None]}

            def rhs(terms: list) -> tuple[dict[int, float], float]:
                """sum(terms) as (variables, constant)."""
                return {v: 1.0 for v in terms if v is not None}, float(sum(1 for v in terms if v is None))

            haves: dict[str, dict[str, list]] = {}
            plan = []
            for (u, v, slot), m in self.edges.items():
                if u not in haves:
                    haves[u] = out_terms(u)
                have = haves[u]
                want: dict[tuple[str, bool], list] = {}     # consumer side: how it reads the value
                for st, xv in zip(self.cands[v], x[v]):
                    want.setdefault(self.read(u, st, slot), []).append(xv)
                nb, gr = self.nbytes(u), self.grad.get(u, False)
                sums = tuple({pl: rhs(terms) for pl, terms in groups.items()} for groups in (have, want))
                tag = self._value_class(u)
                plan.append(((u, v, slot), u, m, have, want, [(p, q, (p, q, nb, gr, tag)) for p in have for q in want],
                             sums))
            self._edges_planned = plan
        return self._edges_planned

    def _placements(self) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
        """The nodes a solution places: the graph inputs, and per parameter
        decision and per op decision the nodes that take it (in graph
        order). The same for every solve of a problem with these pins and
        decisions (whatever the shapes), so listed once per graph for them."""
        if self._placed_nodes is None:
            self._placed_nodes = self.graph.memo(self._decisions_key("ilp_placements"), self._list_placements)
        return self._placed_nodes

    def _list_placements(self) -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
        """:meth:`_placements`, uncached."""
        inputs: list[str] = []
        params: dict[str, list[str]] = {}
        ops: dict[str, list[str]] = {}
        for nd in self.graph.nodes:
            k = self.key[nd.name]
            if nd.kind == "input":
                inputs.append(nd.name)
            elif k in self.pplace:
                params.setdefault(k, []).append(nd.name)
            elif k in self.cands:
                ops.setdefault(k, []).append(nd.name)
        return inputs, params, ops

    def _decisions_key(self, what: str) -> tuple:
        """A :meth:`Graph.memo` key of ``what`` for this problem's pins and decisions."""
        return (what, self._pins_key, frozenset(self.cands), frozenset(self.pplace))

    def _counts(self) -> tuple[int, int]:
        """Nodes with a decision, and nodes sharing another's (for :class:`IlpInfo`;
        kept as :meth:`_placements` is)."""
        if self._node_counts is None:
            key, cands, pplace = self.key, self.cands, self.pplace
            self._node_counts = self.graph.memo(self._decisions_key("ilp_counts"), lambda: (
                sum(1 for nd in self.graph.nodes if key[nd.name] in cands or key[nd.name] in pplace),
                sum(1 for nd in self.graph.nodes if key[nd.name] != nd.name)))
        return self._node_counts

    def _runners_up(self, pick: dict[str, int], ppick: dict[str, str]) -> dict[str, list[tuple[str, str, float]]]:
        """Per op decision, the other candidates with the extra time (per
        microbatch) each would cost if only it changed (its edges priced as
        its own: where it shares a transition with other readers the figure
        is approximate, the shared part counted whole on both sides)."""
        place = dict(ppick)
        for k, j in pick.items():
            place[k] = self.cands[k][j].out
        ins_of: dict[str, list[tuple[str, int, int]]] = {}
        outs_of: dict[str, list[tuple[str, int, int]]] = {}
        for (u, v, slot), m in self.edges.items():
            ins_of.setdefault(v, []).append((u, slot, m))
            outs_of.setdefault(u, []).append((v, slot, m))

        def local(k: str, st: Strategy) -> float:
            c = self.mult[k] * self.node_cost(k, st)
            for u, slot, m in ins_of.get(k, []):
                c += m * self.edge_cost(u, place.get(u, R), self.read(u, st, slot))
            for v, slot, m in outs_of.get(k, []):
                c += m * self.edge_cost(k, st.out, self.read(k, self.cands[v][pick[v]], slot))
            return c

        out: dict[str, list[tuple[str, str, float]]] = {}
        for k, cs in self.cands.items():
            if len(cs) < 2:
                continue
            base = local(k, cs[pick[k]])
            alts = []
            for j, st in enumerate(cs):
                if j == pick[k]:
                    continue
                d = local(k, st) - base
                alts.append((st.name, st.out, d if math.isfinite(d) else INF))
            alts.sort(key=lambda a: a[2])
            out[k] = alts[:3]
        return out


def _label(nd: Node) -> str:
    return f"{nd.param or nd.name} ({nd.module or 'root'})" if nd.param else f"{nd.name} ({nd.module or 'root'})"
