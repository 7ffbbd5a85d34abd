"""Sharding propagation on one mesh axis.

Walks the graph in topological order and gives every tensor-valued node a
:class:`~autopar.strategies.Strategy` on this axis, choosing among the
candidates of :func:`autopar.strategies.candidates` the one with the lowest
cost given the placements its inputs already have: resharding of the inputs,
the node's own compute, collectives inside the op, the backward all-reduce of
replicated inputs that feed split work, and an estimate of the all-reduce a
partial output will need later.

Repeated layers are solved once: when an instance of a layer group receives
its inputs with the same placements as the previous instance, it copies that
instance's decisions position by position, so 96 identical blocks cost about
as much as two.

Two uses:

* :func:`track_batch` follows the batch dimension from the inputs through the
  graph (the data-parallel axis; it also tells which dim of every tensor
  scales with the batch size);
* :func:`propagate` decides a tensor-parallel axis under a cost model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..graph import Graph, Node
from ..strategies import Strategy, candidates, is_shard, shard_dim
from ..strategies.placement import P, R, S
from ..strategies.rules import Ctx

Shape = tuple[int, ...]
INF = float("inf")

# kinds that carry no tensor placement
_SKIP = {"shape", "constant", "output"}


@dataclass
class AxisSharding:
    """The decisions on one mesh axis.

    ``out[name]`` is the placement of a node's output, ``strategy[name]`` the
    chosen strategy (absent for parameters, inputs and shape arithmetic), and
    ``param[name]`` the placement of each parameter node.
    """

    n: int
    out: dict[str, str] = field(default_factory=dict)
    strategy: dict[str, Strategy] = field(default_factory=dict)
    reused_instances: int = 0
    copied_from: dict[str, str] = field(default_factory=dict)  # instance -> instance it copied
    ilp: object | None = None   # search.ilp.IlpInfo when the ILP decided this axis

    def input_placement(self, graph: Graph, node: Node, i: int) -> str:
        """Placement the strategy of ``node`` needs for its i-th input."""
        st = self.strategy.get(node.name)
        return st.ins[i] if st is not None else self.out.get(node.inputs[i], R)


def needs_grad(graph: Graph) -> dict[str, bool]:
    """Which values carry a gradient in backward (float values derived from a
    trainable parameter). Cached on the graph."""
    cached = graph.__dict__.get("_needs_grad")
    if cached is not None:
        return cached
    out: dict[str, bool] = {}
    for n in graph.nodes:
        if n.kind == "param":
            out[n.name] = bool(graph.params.get(n.param) and graph.params[n.param].requires_grad)
        elif n.kind in ("input", "buffer", "factory", "constant", "shape"):
            out[n.name] = False
        else:
            is_float = n.out is not None and n.out.is_float
            out[n.name] = is_float and any(out.get(i, False) for i in n.inputs) or (
                n.kind == "split" and any(out.get(i, False) for i in n.inputs))
    graph.__dict__["_needs_grad"] = out
    return out


def _instances(graph: Graph) -> dict[str, list[Node]]:
    inst: dict[str, list[Node]] = {}
    for nd in graph.nodes:
        if nd.group is not None:
            inst.setdefault(nd.group, []).append(nd)
    return inst


def pin_signature(nodes: list[Node], pins: dict[str, str]) -> tuple:
    """The pins of a layer instance by position: instances pinned alike may share decisions."""
    return tuple(pins.get(nd.name) for nd in nodes) if pins else ()


CostFn = Callable[[Node, Strategy, list[str], "Ctx"], float]


def _solve(graph: Graph, n: int, shapes: dict[str, Shape | None], input_placement: Callable[[Node], str],
           cost: CostFn, output_placement: str | None, pins: dict[str, str] | None = None,
           batch_axis: bool = False) -> AxisSharding:
    res = AxisSharding(n=n)
    pins = pins or {}
    inst = _instances(graph)
    prev_of: dict[str, str] = {}
    for g in graph.groups:
        for a, b in zip(g.instances, g.instances[1:]):
            prev_of[b] = a
    done_instance: set[str] = set()
    by_name = {nd.name: nd for nd in graph.nodes}
    for name, p in pins.items():
        if name in by_name and by_name[name].kind in ("param", "buffer"):
            res.out[name] = p       # a pinned parameter is placed before its consumers choose

    def decide(nd: Node) -> None:
        if nd.kind in ("input",):
            res.out[nd.name] = input_placement(nd)
            return
        if nd.kind in _SKIP or nd.kind in ("param", "buffer"):
            return  # parameters are placed by their first consumer
        if nd.out is None and nd.kind != "split":
            return
        ins_cur = [res.out.get(i) for i in nd.inputs]  # None: unplaced parameter
        ctx = Ctx(nd, [shapes.get(i) for i in nd.inputs], [by_name[i].kind for i in nd.inputs],
                  shapes.get(nd.name), n, 4, batch_axis)
        best, best_cost = None, INF
        pin = pins.get(nd.name)
        for st in candidates(ctx):
            if len(st.ins) != len(nd.inputs) or (pin is not None and st.out != pin):
                continue
            c = cost(nd, st, ins_cur, ctx)
            if c < best_cost:
                best, best_cost = st, c
        if best is None:  # every candidate impossible: replicate
            best = Strategy("replicate", tuple(R for _ in nd.inputs), R, False)
        _apply(nd, best)

    def _apply(nd: Node, st: Strategy) -> None:
        res.strategy[nd.name] = st
        res.out[nd.name] = st.out
        for i, p in zip(nd.inputs, st.ins):
            if i not in res.out and by_name[i].kind in ("param", "buffer"):
                res.out[i] = p

    def external_placements(nodes: list[Node]) -> tuple:
        names = {x.name for x in nodes}
        return tuple(res.out.get(i) for x in nodes for i in x.inputs
                     if i not in names and by_name[i].kind not in ("param", "buffer"))

    for nd in graph.nodes:
        g = nd.group
        if g is not None and g not in done_instance:
            done_instance.add(g)
            prev = prev_of.get(g)
            mine = inst[g]
            if prev is not None and pin_signature(mine, pins) == pin_signature(inst[prev], pins) and \
                    external_placements(mine) == external_placements(inst[prev]):
                for a, b in zip(mine, inst[prev]):
                    if b.name in res.strategy:
                        _apply(a, res.strategy[b.name])
                    elif b.name in res.out:
                        res.out[a.name] = res.out[b.name]
                res.reused_instances += 1
                res.copied_from[g] = prev
                continue
            for x in mine:
                decide(x)
            continue
        if g is not None:
            continue  # decided with its instance
        decide(nd)
    if output_placement is not None and graph.output is not None:
        res.out["__output__"] = output_placement
    return res


# --------------------------------------------------------------------------
# the batch (data-parallel) axis
# --------------------------------------------------------------------------
def track_batch(graph: Graph) -> AxisSharding:
    """Follow the batch dimension (dim 0 of every input) through the graph.

    Returns the sharding of a data-parallel axis: the batch stays sharded
    wherever a rule allows it, the loss becomes a partial sum. Cached on the
    graph. Costs here are structural (count of collectives), not times.
    """
    cached = getattr(graph, "_batch_sharding", None)
    if cached is not None:
        return cached
    shapes = {nd.name: (nd.out.shape if nd.out is not None else None) for nd in graph.nodes}
    def inp(nd: Node) -> str:
        return S(0) if nd.out is not None and len(nd.out.shape) > 0 else R

    def cost(nd: Node, st: Strategy, cur: list[str | None], ctx: Ctx) -> float:
        c = 0.0
        for have, want, name in zip(cur, st.ins, nd.inputs):
            if have is None:         # unplaced parameter: replicated is what data parallel wants
                c += 0.0 if want == R else 0.5
            elif have != want:
                # slicing a replicated value is free of communication, but it must cost more
                # than the split bonus below: else a value with no batch dim (a positional
                # embedding of arange(T)) gets its dim 0 taken for the batch
                c += 1.0 if not (have == R and is_shard(want)) else 0.2
        c += 0.0 if st.split else 0.1          # prefer dividing the work
        c += 0.001 if st.out == P else 0.0
        c += 0.001 if st.out == R else 0.0
        if any(h is None and w == P for h, w in zip(cur, st.ins)):
            return INF
        return c

    res = _solve(graph, 1, shapes, inp, cost, None, batch_axis=True)
    graph._batch_sharding = res  # type: ignore[attr-defined]
    return res


def batch_dims(graph: Graph) -> dict[str, int | None]:
    """For every tensor node, the dim that scales with the batch (None if none). Cached on the graph."""
    cached = graph.__dict__.get("_batch_dims")
    if cached is None:
        bs = track_batch(graph)
        cached = graph.__dict__["_batch_dims"] = {k: (shard_dim(v) if is_shard(v) else None)
                                                  for k, v in bs.out.items()}
    return cached


def scaled_shapes(graph: Graph, batch: int, divide: int = 1) -> dict[str, Shape | None]:
    """Shapes of every node at batch size ``batch`` (per microbatch), with the
    batch dim further divided by ``divide`` (the data-parallel degree)."""
    bd = batch_dims(graph)
    b0 = graph.batch_size
    out: dict[str, Shape | None] = {}
    for nd in graph.nodes:
        if nd.out is None:
            out[nd.name] = None
            continue
        d = bd.get(nd.name)
        shp = nd.out.shape
        if d is not None and d < len(shp):
            shp = shp[:d] + (shp[d] * batch // (b0 * divide),) + shp[d + 1:]
        out[nd.name] = shp
    return out


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
    manual ``tp=N`` strategies use a large one, so every weight a rule can
    split is split (Megatron-style), and only the communication pattern is
    left to the cost model. ``pins`` fixes the placement of some nodes
    (parameters or op outputs); the rest is propagated from them. Only
    trainable weights weigh as memory: a buffer (rotary tables) stays where
    its consumers want it.
    """
    ng = needs_grad(graph)
    sizes = _Sizes(shapes, itemsize)   # bytes per value, computed for the values a decision reads

    def reshard(have: str, want: str, nbytes: float, grad: bool) -> float:
        return reshard_time(have, want, nbytes, grad, comm)

    def param_bytes(name: str) -> float:
        return sizes.get(name, 0.0)

    def cost(nd: Node, st: Strategy, cur: list[str | None], ctx: Ctx) -> float:
        c = 0.0
        for have, want, name in zip(cur, st.ins, nd.inputs):
            if have is None:   # an unplaced parameter takes what this op wants;
                if want == P:
                    return INF
                # memory is the tie-break: a replicated weight costs its bytes
                if ng.get(name, False):
                    c += memory_weight * param_bytes(name) * (1.0 if want == R else 1.0 / n)
                have = want
            c += reshard(have, want, sizes.get(name, 0.0), ng.get(name, False))
            if want == R and st.split and ng.get(name, False):      # backward of reduce_grad (from a
                c += comm("reduce_scatter" if is_shard(have) else "all_reduce", sizes.get(name, 0.0))  # shard: RS)
            if c == INF:
                return INF
        c += 3.0 * compute(nd, 1.0 / n if st.split else 1.0)       # forward + backward
        for kind, nbytes in st.comm:
            c += comm(kind, nbytes)
        if st.out == P:
            c += comm("all_reduce", sizes.get(nd.name, 0.0))       # will be reduced later
        elif is_shard(st.out):
            # a shard is often gathered again later (norms, residuals): charge
            # half a gather so that cheap ops do not start sharded chains
            c += 0.5 * comm("all_gather", sizes.get(nd.name, 0.0))
        return c

    def inp(nd: Node) -> str:
        return R

    return _solve(graph, n, shapes, inp, cost, R, pins)


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


def reshard_time(have: str, want: str, nbytes: float, grad: bool,
                 comm: Callable[[str, float], float]) -> float:
    """Forward + backward time of changing a value's placement on one axis.

    ``nbytes`` is the full (unsharded on this axis) size; ``grad`` whether the
    value carries a gradient (the backward of a slice is a gather)."""
    if have == want:
        return 0.0
    if want == P:
        return INF                              # never manufacture partial sums
    if have == R:                               # slice; backward gathers the grad
        return comm("all_gather", nbytes) if grad else 0.0
    if have == P:
        if want == R:
            return comm("all_reduce", nbytes)
        return comm("reduce_scatter", nbytes) + (comm("all_gather", nbytes) if grad else 0.0)
    if want == R:                               # shard -> replicate
        return comm("all_gather", nbytes)
    return comm("all_to_all", nbytes) * (2 if grad else 1)


def _numel(shape: Shape | None) -> int:
    if shape is None:
        return 0
    k = 1
    for s in shape:
        k *= s
    return k
