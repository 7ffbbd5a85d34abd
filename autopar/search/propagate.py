"""Sharding propagation on one mesh axis.

Walks the graph in topological order and gives every tensor-valued node a
:class:`~autopar.strategies.Strategy` on this axis, choosing among the
candidates of :func:`autopar.strategies.candidates` the one with the lowest
cost given the placements its inputs already have: the time the cost model
charges for it (:func:`autopar.strategies.axis_cost.op_axis_time`: the
node's own compute, collectives inside the op, the inputs' transitions from
the redistribution table), plus heuristics of the search alone
(:meth:`GreedyCost.heuristic`: memory as the tie-break, and an estimate of
what a partial or sharded output will cost its consumers later).

Repeated layers are solved once: when an instance of a layer group receives
its inputs with the same placements as the previous instance, it copies that
instance's decisions position by position, so 96 identical blocks cost about
as much as two (the walk is :func:`autopar.sharding.walk_axis`, which also
follows the batch axis).
"""
from __future__ import annotations

from typing import Callable

from ..graph import Graph, Node
from ..sharding import INF, SKIP as _SKIP, AxisSharding, Shape, instances as _instances, needs_grad
from ..sharding import numel as _numel, pin_signature, walk_axis as _solve
from ..spec.placement import P, R
from ..strategies import Strategy, is_shard
from ..strategies.axis_cost import op_axis_time
from ..strategies.redistribute import output_time
from ..strategies.rules import Ctx, candidates

#: seconds per byte of replicated weight that only breaks ties between equal times
TIE_WEIGHT = 1e-15

# AxisSharding, _instances, _numel, needs_grad, pin_signature, _SKIP and INF are
# also read from here by the ILP (search.ilp)

# --------------------------------------------------------------------------
# a tensor-parallel axis under a cost model
# --------------------------------------------------------------------------
def propagate(graph: Graph, n: int, shapes: dict[str, Shape | None], *,
              comm: Callable[[str, float], float], compute: Callable[[Node, float], float],
              itemsize: int = 4, memory_weight: float = 1e-13, pins: dict[str, str] | None = None) -> AxisSharding:
    """Decide the placements of an axis of size ``n`` (tensor parallel).

    ``shapes`` are the node shapes local to the other axes; ``comm(kind,
    nbytes)`` is the time of a collective on this axis, ``compute(node,
    fraction)`` the forward time of a node doing ``fraction`` of its work.
    The graph's output (the loss) is made replicated. ``memory_weight``
    (seconds per byte of replicated weight state) trades memory for time: the
    manual ``tp=N`` strategies use a large one, so every matrix a rule can
    split is split (Megatron-style; vectors, norm gains and biases, weigh as
    tie-breaks: :meth:`GreedyCost._weight_of`), and only the communication
    pattern is left to the cost model. ``pins`` fixes the placement of some nodes
    (parameters or op outputs); the rest is propagated from them. Only
    trainable weights weigh as memory: a buffer (rotary tables) stays where
    its consumers want it.
    """
    cost = GreedyCost(graph, n, shapes, comm=comm, compute=compute, itemsize=itemsize,
                      memory_weight=memory_weight)

    def inp(nd: Node) -> str:
        return R

    return _solve(graph, n, shapes, inp, cost, R, pins)


class GreedyCost:
    """How the greedy propagation ranks a candidate: :meth:`time`, the time
    the cost model charges for it (:func:`~autopar.strategies.axis_cost.op_axis_time`,
    and the loss made whole at the graph's output), plus :meth:`heuristic`,
    terms of the search alone that look past the node (see there). Calling
    it returns their sum, INF for an infeasible candidate."""

    def __init__(self, graph: Graph, n: int, shapes: dict[str, Shape | None], *,
                 comm: Callable[[str, float], float], compute: Callable[[Node, float], float],
                 itemsize: int = 4, memory_weight: float = 1e-13) -> None:
        self.graph, self.n, self.comm, self.compute = graph, n, comm, compute
        self.memory_weight = memory_weight
        self.grad = needs_grad(graph)
        self.sizes = _Sizes(shapes, itemsize)   # bytes per value, computed for the values a decision reads
        # the transitions the decided readers paid for (axis_cost.shared_key): a later
        # reader of the same layer instance reading a value alike shares them
        self.charged: set = set()
        self._reads: dict[str, frozenset | None] = {}     # per node: what its one reader accepts (_read_as)

    def __call__(self, nd: Node, st: Strategy, cur: list[str | None], ctx: Ctx | None = None) -> float:
        t = self.time(nd, st, cur, self.charged)
        return INF if t == INF else t + self.heuristic(nd, st, cur)

    def commit(self, nd: Node, st: Strategy, cur: list[str | None]) -> None:
        """The walk decided ``nd`` as ``st``: its input transitions are paid."""
        self.time(nd, st, cur, self.charged, commit=True)

    def time(self, nd: Node, st: Strategy, cur: list[str | None], charged: set | None = None,
             commit: bool = False) -> float:
        """Seconds per microbatch of ``nd`` as ``st`` with its inputs in ``cur``
        (None: a parameter not yet placed, which takes what ``st`` reads);
        ``charged``: the transitions earlier readers paid for, which cost
        nothing again (with ``commit``, this node's are added)."""
        t = op_axis_time(nd, st, cur, self.n, nbytes=self.sizes.get, grad=self.grad, compute=self.compute,
                         comm=self.comm, charged=charged, commit=commit).total
        if nd.name == self.graph.output:
            t += output_time(st.out, self.sizes.get(nd.name, 0.0), self.comm)
        return t

    def heuristic(self, nd: Node, st: Strategy, cur: list[str | None]) -> float:
        """The search's own terms, no time the program spends on this node:
        memory as the tie-break (a parameter this node places costs
        ``memory_weight`` per byte it holds), and a look-ahead at the output's
        consumers, which are not decided yet: a partial output will be
        all-reduced later, and a shard is often gathered again (norms,
        residuals), so half a gather keeps cheap ops from starting sharded
        chains (of the output, or of the inputs it slices where smaller:
        :meth:`_started`). The graph's output has no consumer: :meth:`time` makes it whole."""
        h = 0.0
        places = False
        for have, want, name in zip(cur, st.ins, nd.inputs):
            if have is None and self.grad.get(name, False):
                places = True
                h += self._weight_of(name) * self.sizes.get(name, 0.0) * (1.0 if want == R else 1.0 / self.n)
        if nd.name == self.graph.output:
            return h
        read_as = self._read_as(nd.name) if places and is_shard(st.out) else None
        if read_as is not None and st.out not in read_as:
            # a weight's own transpose or view (transformers' experts [E, N, K] turned [E, K, N]
            # for the grouped matmul): its one reader takes no shard of it this way but gathers it
            h += self.comm("all_gather", self.sizes.get(nd.name, 0.0))
        if st.out == P:
            h += self.comm("all_reduce", self.sizes.get(nd.name, 0.0))
        elif is_shard(st.out) and not self._continues(nd, st, cur):
            h += 0.5 * self.comm("all_gather", self._started(nd, st, cur))
        return h

    def _weight_of(self, name: str) -> float:
        """Seconds per replicated byte of parameter ``name``: ``memory_weight``
        for a matrix (or any weight of two dims or more); a vector (a norm's
        gain, a bias) weighs as a tie-break only, so that the time decides it.
        Under manual ``tp=N`` the weight is large, and a norm written out in
        its ops (Hugging Face's Gemma: ``x * (1 + weight)``) split its gain,
        14 KB, for the price of its output's layout: the residual stream
        split over the hidden dim, q, k and v then read row-parallel and
        all-reduced, where Megatron keeps the gain whole and gathers once."""
        shape = self.sizes.shapes.get(name)
        return self.memory_weight if shape is None or len(shape) >= 2 else min(self.memory_weight, TIE_WEIGHT)

    def _started(self, nd: Node, st: Strategy, cur: list[str | None]) -> float:
        """Bytes of the look-ahead's gather for a chain ``st`` starts: the
        output's, or, where the op reads a whole value as a shard (a slice,
        no collective), at most the largest such input's: an op that grows
        what it reads (attention's scores ``[B, H, T, T]`` from q and k
        ``[B, H, T, D]``, written out in eager attention) would otherwise be
        charged for gathering its output, 8x its inputs at T = 2048, D = 256,
        and stay replicated on every rank, though the chain it starts ends
        where the values are small again."""
        out = self.sizes.get(nd.name, 0.0)
        sliced = [self.sizes.get(name, 0.0) for have, want, name in zip(cur, st.ins, nd.inputs)
                  if have == R and is_shard(want) and not self.graph[name].is_state]
        return min(out, max(sliced)) if sliced else out

    def _continues(self, nd: Node, st: Strategy, cur: list[str | None]) -> bool:
        """Whether ``st`` goes on with a sharded chain: it reads a value
        (not a weight) in the shard the value already has. The look-ahead's
        half gather is for the op that starts a chain; charged again along it,
        it would turn back an op that grows its input (grouped-query
        attention's ``repeat_interleave`` of k and v to every query head,
        16x at Llama 3 405B) into gathering the input, a collective the
        chain did not need."""
        return any(have == want and is_shard(want) and not self.graph[name].is_state
                   for have, want, name in zip(cur, st.ins, nd.inputs))

    def _read_as(self, name: str) -> frozenset | None:
        """The placements ``name``'s one reader accepts for it (None, any,
        with several readers or none): the look-ahead of a weight's own
        transpose."""
        if name not in self._reads:
            readers = self.graph.consumers(name)
            got = None
            if len(readers) == 1:
                r = self.graph[readers[0]]
                shapes = self.sizes.shapes
                ctx = Ctx(r, [shapes.get(i) for i in r.inputs], [self.graph[i].kind for i in r.inputs],
                          shapes.get(r.name), self.n, self.sizes.itemsize)
                k = r.inputs.index(name)
                got = frozenset(st.ins[k] for st in candidates(ctx) if len(st.ins) == len(r.inputs))
            self._reads[name] = got
        return self._reads[name]


class _Sizes(dict):
    """``{name: bytes}`` filled on first use (a 96-layer graph decides two instances)."""

    def __init__(self, shapes: dict[str, Shape | None], itemsize: int) -> None:
        super().__init__()
        self.shapes, self.itemsize = shapes, itemsize

    def get(self, name: str, default: float = 0.0) -> float:  # type: ignore[override]
        v = dict.get(self, name)
        if v is None:
            v = self[name] = float(_numel(self.shapes.get(name)) * self.itemsize) if name in self.shapes \
                else default
        return v

