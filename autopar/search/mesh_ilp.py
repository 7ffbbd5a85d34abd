"""Intra-operator sharding of several tensor axes of a mesh at once.

:mod:`autopar.search.ilp` decides one axis. Here every op's choice is one
strategy per axis, taken together: the candidates of a node are the
cartesian product of its single-axis candidates
(:func:`autopar.strategies.candidates` on each axis's size), as DTensor
builds an op's strategies on an N-D mesh from those of one mesh dim, less
the products whose sizes do not divide (a dim split on two axes must be
divisible by both) and those that would run two special kernels. A
placement on the mesh is the axes' placements joined by ``|`` (``S(0)|R``:
split on the first axis, replicated on the second); a weight's choices are
the placements its consumers read. One program decides all of them:

* per node: the forward + backward compute of the share left after every
  axis's split (the product of the work fractions) and the collectives
  inside the op on each axis, on the bytes local to the other axes;
* per weight: what its placement costs outside the mesh (the data-parallel
  gradient reduction and the optimizer update of its local shard), as the
  single-axis ILP weighs it;
* per edge: per axis, the transition of the redistribution table
  (:func:`~autopar.strategies.redistribute.transition_time`, Megatron's f
  included) on that axis's link, for the tensor as the other axes hold it;
  a move no order of the axes runs (two axes sharing a dim moving it
  unlike: :func:`~autopar.strategies.redistribute.nested_moves`) is not
  offered, nor, on two axes or more, a weight read on the inner axis other
  than as it is stored there (a weight is moved on the outer axes only, as
  a plan's check of its readers assumes), nor a move of a
  tuple (a split's pieces, read as they are made).

So a weight split on one axis and split another way on the other (2D
tensor parallelism), or a batch split on one axis under column-parallel
matmuls on the other, are choices of one objective, not layouts written
out. The program is :class:`~autopar.search.ilp._Problem`'s (transportation
edges, repeated layers sharing their decisions, HiGHS), over these joint
candidates, with an optional memory row (model states of the weights'
shards and the activations each joint strategy keeps, as the cost model
counts them for the mesh's shares).

:func:`solve_mesh` returns one :class:`~autopar.sharding.AxisSharding` per
axis, which :func:`autopar.compile.rewrite.compile_local` runs as its
axes (the first ones as ``grid``, the last as ``tp``).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from ..errors import StrategyError
from ..graph import Graph, Node
from ..spec.placement import P, R, SEP, axis_placements, is_shard, joint_placement, shard_blocks, shard_dim
from ..strategies import Strategy, candidates
from ..strategies.axis_cost import inside_time, work_fraction
from ..strategies.redistribute import nested_moves, output_time, transition_collectives
from ..strategies.rules import Ctx
from .ilp import MEMORY_EPS, InfeasiblePins, MemoryTerms, _label, _Problem
from .propagate import INF, AxisSharding
from .solvers import DEFAULT, backend

Shape = tuple[int, ...]
Comm = Callable[[str, float], float]

__all__ = ["JointStrategy", "joint_strategy", "solve_mesh"]


@dataclass(frozen=True)
class JointStrategy(Strategy):
    """One strategy per mesh axis (``parts``), seen as one: ``ins`` and
    ``out`` are the axes' placements joined by ``|``."""

    parts: tuple[Strategy, ...] = ()


def joint_strategy(parts: Sequence[Strategy]) -> JointStrategy:
    """The joint strategy of one strategy per axis."""
    return JointStrategy(name=SEP.join(s.name for s in parts),
                         ins=tuple(joint_placement([s.ins[i] for s in parts]) for i in range(len(parts[0].ins))),
                         out=joint_placement([s.out for s in parts]), split=any(s.split for s in parts),
                         parts=tuple(parts))


def _divides(shape: Shape | None, places: Sequence[str], sizes: Sequence[int]) -> bool:
    """Whether every dim of ``shape`` divides into the shards ``places`` (one per axis) cut it in."""
    if shape is None:
        return True
    cut = [1] * len(shape)
    for p, n in zip(places, sizes):
        if is_shard(p):
            d = shard_dim(p)
            if not -len(shape) <= d < len(shape):
                return False
            cut[d] *= n * shard_blocks(p)
    return all(s % c == 0 for s, c in zip(shape, cut))


class _MeshProblem(_Problem):
    """:class:`~autopar.search.ilp._Problem` over joint candidates (module doc)."""

    def __init__(self, graph: Graph, sizes: Sequence[int], shapes: dict, pins: dict[str, str]) -> None:
        self.sizes = tuple(sizes)
        self.k = len(self.sizes)
        self.comms: list[Comm] = []
        self.byte_scale: Callable[[str], float] = lambda name: 1.0
        # per move, the collectives edge_cost prices (_edge_collectives)
        self._edge_memo: dict[tuple, tuple | None] = {}
        super().__init__(graph, math.prod(self.sizes), shapes, pins)

    # -- candidates -----------------------------------------------------------------
    def _choices(self) -> None:
        self.cands: dict[str, list[Strategy]] = {}
        self.pplace: dict[str, list[str]] = {}
        wants: dict[str, set[str]] = {}
        whole = joint_placement([R] * self.k)
        for nd in self.reps:
            if not self._decides(nd):
                continue
            ins = [self.shapes.get(i) for i in nd.inputs]
            kinds = [self.by_name[i].kind for i in nd.inputs]
            per_axis = []
            for n in self.sizes:
                cs = [st for st in candidates(Ctx(nd, ins, kinds, self.shapes.get(nd.name), n, 4))
                      if len(st.ins) == len(nd.inputs)]
                per_axis.append(cs or [super()._replicated(nd)])
            cs = [joint_strategy(c) for c in itertools.product(*per_axis) if self._valid(nd, c)]
            pin = self.pins.get(nd.name)
            if pin is not None:
                cs = [st for st in cs if self._pinned(st.out, pin)]
                if not cs:
                    raise InfeasiblePins(f"pinned placement {pin} for {_label(nd)} is not one this op can "
                                         f"produce on a mesh of {'x'.join(map(str, self.sizes))}", (nd.name,))
            self.cands[nd.name] = cs or [self._replicated(nd)]
            for st in self.cands[nd.name]:
                for i, w in zip(nd.inputs, st.ins):
                    wants.setdefault(self.key[i], set()).add(w)
        for nd in self.reps:
            if nd.is_state:
                opts = sorted({whole} | {w for w in wants.get(nd.name, set())
                                         if P not in axis_placements(w, self.k)})
                pin = self.pins.get(nd.name)
                if pin is not None:
                    kept = [o for o in opts if self._pinned(o, pin)]
                    if not kept:
                        raise InfeasiblePins(f"pinned placement {pin} for parameter {_label(nd)} is read by no "
                                             f"strategy of its consumers; possible: {', '.join(opts)}", (nd.name,))
                    opts = kept
                self.pplace[nd.name] = opts
        self._prune()

    def _pinned(self, place: str, pin: str) -> bool:
        """Whether the mesh placement ``place`` keeps ``pin``: a mesh placement
        (``S(0)|R``) is kept as written; a single-axis one (``S(1)``, a
        user's pin or sequence parallelism's) on the inner axis, the tp axis
        a 1d plan would have."""
        return place == pin if SEP in pin else axis_placements(place, self.k)[-1] == pin

    def _valid(self, nd: Node, parts: Sequence[Strategy]) -> bool:
        """A product of single-axis strategies the compiler can run: at most
        one special kernel, and every input and the output divisible into
        the shards the axes cut it in."""
        if sum(1 for s in parts if s.kernel) > 1:
            return False
        shapes = [self.shapes.get(i) for i in nd.inputs]
        if not all(_divides(sh, [s.ins[j] for s in parts], self.sizes) for j, sh in enumerate(shapes)):
            return False
        return _divides(self.shapes.get(nd.name), [s.out for s in parts], self.sizes)

    def outs(self, k: str) -> list[str]:
        if k in self.cands or k in self.pplace:
            return super().outs(k)
        return [joint_placement([R] * self.k)]

    def _never_given(self, i: str, want: str) -> bool:
        """Whether reading ``i`` as ``want`` asks, on some axis, for a partial sum its producer never gives there."""
        src = self.by_name[i]
        for a, p in enumerate(axis_placements(want, self.k)):
            if p == P and (src.is_state or (self._placed(src) and
                                            all(axis_placements(o, self.k)[a] != P for o in self.outs(self.key[i])))):
                return True
        return False

    def _replicated(self, nd: Node) -> Strategy:
        return joint_strategy([super()._replicated(nd)] * self.k)

    # -- costs ------------------------------------------------------------------------
    def _local(self, places: Sequence[str], skip: int) -> float:
        """The share of a tensor placed ``places`` one rank holds on the axes but ``skip``."""
        return math.prod(1.0 / n for a, (p, n) in enumerate(zip(places, self.sizes)) if a != skip and is_shard(p))

    def node_cost(self, k: str, st: Strategy) -> float:
        nd = self.by_name[k]
        parts = st.parts
        frac = math.prod(work_fraction(s, n) for s, n in zip(parts, self.sizes))
        c = 3.0 * self.compute(nd, frac)
        outs = [s.out for s in parts]
        scale = self.byte_scale(k)
        for a, s in enumerate(parts):
            if s.comm:
                share = self._local(outs, a) * scale
                c += inside_time(s, lambda kind, nb, a=a, share=share: self.comms[a](kind, nb * share))
        if nd.name == self.graph.output:
            for a, p in enumerate(outs):
                c += output_time(p, self.nbytes(k) * scale * self._local(outs, a), self.comms[a])
        return c

    def param_cost(self, k: str, p: str) -> float:
        places = axis_placements(p, self.k)
        return self.param_time(self.by_name[k], p) + MEMORY_EPS * self.nbytes(k) * self._local(places, -1)

    def read(self, u: str, st: Strategy, slot: int) -> tuple[str, tuple[bool, ...]]:
        w = st.ins[slot]
        grad = self.grad.get(u, False)
        return w, tuple(s.ins[slot] == R and s.split and grad for s in st.parts)

    def _value_class(self, u: str) -> str:
        """Weights and tuples apart: :meth:`edge_cost` refuses some of their
        moves, so their prices are not another value's of the same size."""
        nd = self.by_name[u]
        return "weight" if nd.is_state else "tuple" if nd.kind == "split" or nd.out is None else ""

    def _edge_collectives(self, have: str, want: str, into: tuple[bool, ...], grad: bool,
                          kind: str) -> tuple[tuple[int, float, tuple], ...] | None:
        """The collectives of moving a ``kind`` value placed ``have`` to ``want``
        read as ``into``, or None where the move is not offered (memoised: the edges meet the
        same moves hundreds of thousands of times in a three-axis search).
        Per axis ``(axis, the share of the value a rank holds on the other
        axes, its (collective, fraction of that share) pairs)``."""
        key = (have, want, into, grad, kind)
        if key in self._edge_memo:
            return self._edge_memo[key]
        haves, wants = axis_placements(have, self.k), axis_placements(want, self.k)
        out: tuple | None = None
        if nested_moves(haves, wants) is None:
            pass        # no order of the axes runs it (the compiler refuses it too)
        elif self.k > 1 and kind == "weight" and haves[-1] != wants[-1]:
            pass        # a weight is read on the inner axis as stored there: the plan records that axis
        elif kind == "tuple" and haves != wants:
            pass        # a tuple (a split's pieces) is not moved: its readers take it as it is made
        else:
            steps = []
            for a in range(self.k):
                h, w = haves[a], wants[a]
                if h == w and not (into[a] and grad and w == R):
                    continue
                colls = transition_collectives(h, w, grad, into[a])
                if colls is None:
                    steps = None
                    break
                steps.append((a, self._local(haves, a), tuple(colls)))
            out = None if steps is None else tuple(steps)
        self._edge_memo[key] = out
        return out

    def edge_cost(self, u: str, have: str, read: tuple) -> float:
        want, into = read
        steps = self._edge_collectives(have, want, into, self.grad.get(u, False), self._value_class(u))
        if steps is None:
            return INF
        nb = self.nbytes(u) * self.byte_scale(u)
        t = 0.0
        for a, share, colls in steps:     # summed as transition_time sums them, axis by axis
            comm, local, on_axis = self.comms[a], nb * share, 0.0
            for kind, frac in colls:
                on_axis += comm(kind, local * frac)
            t += on_axis
        return t


def _memoised(comm: Comm) -> Comm:
    """``comm`` remembering its times: the edges of a three-axis program ask
    for the same collectives of the same sizes tens of thousands of times."""
    seen: dict[tuple[str, float], float] = {}

    def timed(kind: str, nbytes: float) -> float:
        t = seen.get((kind, nbytes))
        if t is None:
            t = seen[kind, nbytes] = comm(kind, nbytes)
        return t

    return timed


def solve_mesh(graph: Graph, sizes: Sequence[int], shapes: dict[str, Shape | None], *,
               comm: Sequence[Comm], compute: Callable[[Node, float], float],
               param_time: Callable[[Node, str], float] | None = None, pins: dict[str, str] | None = None,
               memory: MemoryTerms | Sequence[MemoryTerms] | None = None, time_limit_s: float = 60.0,
               solver: str = DEFAULT, byte_scale: Callable[[str], float] | None = None,
               cache: dict | None = None, comm_key: Hashable | None = None) -> list[AxisSharding]:
    """The placements of every node on each axis of a mesh of ``sizes``,
    decided together (module docstring). ``shapes``: node shapes (local to
    any axis outside the mesh); ``comm[a](kind, nbytes)``: the time of a
    collective on axis ``a`` for ``nbytes`` (at 4 bytes per element);
    ``compute(node, fraction)``: the forward time of a node doing that
    fraction of its work; ``param_time(node, mesh placement)``: what a
    weight so placed costs per microbatch outside the mesh (its gradient
    reduction over dp, its optimizer update: a weight the mesh keeps whole
    has more of both); ``pins``: placements fixed for nodes, on the mesh
    (``S(0)|R``) or, written for one axis (``S(1)``), on the inner axis;
    ``memory``: a memory row (or one per pipeline rank) whose ``param`` and ``saved`` read mesh
    placements and joint strategies (:meth:`autopar.cost.CostModel.param_memory`
    and ``saved_memory`` with :func:`~autopar.spec.placement.mesh_pieces`
    and ``mesh_partial``); ``byte_scale(node)``: the share of its value's
    bytes (and of those its op moves inside) a rank moves (with context
    parallelism a cp rank's tokens: ``1 / cp`` for the values that grow
    with the samples; the shapes stay whole, for what divides them). ``cache``: where
    the program's structure (candidates, edges) is kept per sizes, shapes and pins,
    to be solved again under another memory row or cost; ``comm_key``
    names what ``comm`` and ``byte_scale`` price (calls of one key give every edge
    the same price), so that a cached program prices its edges once per key, as
    :func:`~autopar.search.ilp.start_axis` does. Returns one
    :class:`AxisSharding` per axis (its ``ilp`` the program's); raises
    :class:`InfeasiblePins` when the pins admit none, :class:`StrategyError`
    when the program (or the memory bound) has no solution."""
    if len(comm) != len(sizes) or not sizes or any(n < 1 for n in sizes):
        raise StrategyError(f"solve_mesh: a mesh of sizes {tuple(sizes)} needs one comm per axis "
                            f"(got {len(comm)})")
    pins = dict(pins or {})
    skey = ("mesh", tuple(sizes), id(shapes), tuple(sorted(pins.items())))
    prob = cache.get(skey) if cache is not None else None
    if prob is None or prob.shapes is not shapes:
        prob = _MeshProblem(graph, sizes, shapes, pins)
        if cache is not None:
            cache[skey] = prob
    prob.comms, prob.comm, prob.compute = [_memoised(c) for c in comm], comm[0], compute
    prob.comm_key = comm_key
    prob.param_time = param_time or (lambda nd, p: 0.0)
    prob.byte_scale = byte_scale or (lambda name: 1.0)
    built = prob.build(memory)
    built.mdl.relax_first = True    # its relaxation is usually integral: HiGHS's simplex alone is faster
    whole = prob.finish(built, backend(solver).solve(built.mdl, time_limit_s))
    per_node: dict[str, float] = {}
    charged: set = set()
    for nd in graph.nodes:     # what the program charges each decision, less its compute (objective's order)
        st = whole.strategy.get(nd.name)
        if st is not None:
            own = 3.0 * compute(nd, math.prod(work_fraction(p, n) for p, n in zip(st.parts, sizes)))
            per_node[nd.name] = prob.charge(nd, st, whole.out, charged) - own
    whole.ilp.node_collectives_s = per_node
    whole.ilp.collectives_s = max(0.0, sum(per_node.values()))
    out = []
    for a, n in enumerate(sizes):
        sh = AxisSharding(n=n)
        sh.out = {name: axis_placements(p, len(sizes))[a] for name, p in whole.out.items()}
        sh.strategy = {name: st.parts[a] for name, st in whole.strategy.items()}
        sh.ilp = whole.ilp
        out.append(sh)
    return out
