"""The decisions on one mesh axis, and the batch axis every plan shares.

Below both the cost model and the search: :class:`AxisSharding` is what a
search decides for one axis and what the cost model prices; the batch (data
parallel) axis is not searched but followed (:func:`track_batch`), and with
it the shapes every node has at a given batch (:func:`scaled_shapes`).

:func:`walk_axis` is the engine of the one-pass decisions: it walks the graph
in topological order and gives every tensor-valued node the candidate of
:func:`autopar.strategies.candidates` that a caller's cost function ranks
cheapest given its inputs' placements. Repeated layers are decided once: an
instance of a layer group that receives its inputs with the same placements
(and pins) as the previous instance copies that instance's decisions position
by position, so 96 identical blocks cost about as much as two. The batch
axis uses it with a structural cost (:func:`track_batch`); the greedy
tensor-parallel search (:func:`autopar.search.propagate.propagate`) with
times.

Analyses of the graph alone (:func:`needs_grad`, :func:`track_batch`,
:func:`batch_dims`) are memoised on it through :meth:`Graph.memo`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .graph import Graph, Node
from . import ops
from .spec.placement import P, R, S
from .strategies import Strategy, candidates, is_shard, shard_dim
from .strategies.rules import Ctx

if TYPE_CHECKING:
    from .spec import ParallelConfig

Shape = tuple[int, ...]
INF = float("inf")

#: kinds that carry no tensor placement
SKIP = frozenset({"shape", "constant", "output"})


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
    # tp_mode=mesh: the decisions of the mesh's outer axes, outermost first (this one is its last);
    # one program decided all of them (search.mesh_ilp), whose objective ilp holds
    others: tuple["AxisSharding", ...] = ()

    def input_placement(self, graph: Graph, node: Node, i: int) -> str:
        """Placement the strategy of ``node`` needs for its i-th input."""
        st = self.strategy.get(node.name)
        return st.ins[i] if st is not None else self.out.get(node.inputs[i], R)


def numel(shape: Shape | None) -> int:
    """Elements of a tensor of ``shape`` (0 for None: no tensor)."""
    if shape is None:
        return 0
    k = 1
    for s in shape:
        k *= s
    return k


def needs_grad(graph: Graph) -> dict[str, bool]:
    """Which values carry a gradient in backward (float values derived from a
    trainable parameter). Memoised on the graph."""
    return graph.memo(("needs_grad",), lambda: _needs_grad(graph))


def _needs_grad(graph: Graph) -> dict[str, bool]:
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
    return out


def instances(graph: Graph) -> dict[str, list[Node]]:
    """The nodes of every repeated-layer instance, in graph order."""
    inst: dict[str, list[Node]] = {}
    for nd in graph.nodes:
        if nd.group is not None:
            inst.setdefault(nd.group, []).append(nd)
    return inst


def has_layers(graph: Graph) -> bool:
    """Whether ``graph`` has a layer instance (a repeated layer, or an unlike
    one of a numbered stack): the recompute regions and FSDP units. Memoised."""
    return graph.memo(("has_layers",), lambda: any(nd.group is not None for nd in graph.nodes))


def pin_signature(nodes: list[Node], pins: dict[str, str]) -> tuple:
    """The pins of a layer instance by position, its nodes' and those of what they read (a layer's
    parameters are outside its instance in torch.export graphs): instances pinned alike may share
    decisions."""
    if not pins:
        return ()
    return tuple((pins.get(nd.name), tuple(pins.get(i) for i in nd.inputs)) for nd in nodes)


CostFn = Callable[[Node, Strategy, list[str], "Ctx"], float]


def _pin_signatures(graph: Graph, walk: "_Walk", pins: dict[str, str]) -> dict[str, tuple]:
    """The pins of each repeated-layer instance of ``walk`` by position
    (instances pinned alike may share decisions), from the pins alone:
    O(pins), not O(nodes). A parameter outside the instances (torch.export
    lists them apart) counts for the instances that read it, at the
    reader's position and input slot."""
    by_name = graph._by_name
    signature: dict[str, tuple] = {}
    read_pins: dict[str, list[tuple]] = {}
    for name, p in sorted(pins.items(), key=lambda kv: walk.position.get(kv[0], (None, -1))[1]):
        g, k = walk.position.get(name, (None, -1))
        if g is not None:
            signature[g] = signature.get(g, ()) + ((k, p),)
        elif name in by_name and by_name[name].is_state:
            for c in graph.consumers(name):
                gc, kc = walk.position.get(c, (None, -1))
                if gc is not None:
                    read_pins.setdefault(gc, []).append(((kc, by_name[c].inputs.index(name)), p))
    for g, entries in read_pins.items():
        signature[g] = signature.get(g, ()) + tuple(sorted(entries))
    return signature


def walk_axis(graph: Graph, n: int, shapes: dict[str, Shape | None], input_placement: Callable[[Node], str],
              cost: CostFn, output_placement: str | None, pins: dict[str, str] | None = None,
              batch_axis: bool = False) -> AxisSharding:
    """Decide an axis of size ``n`` in one pass (see the module docstring).

    ``input_placement(node)`` places the graph inputs; ``cost(node, strategy,
    input placements, ctx)`` ranks a candidate (None for a parameter not yet
    placed: its first consumer places it), and ``cost.commit(node, strategy,
    input placements)``, where it has one, is told each decision; ``output_placement`` is recorded
    for the graph's output; ``pins`` fix the output placement of nodes;
    ``batch_axis`` tells the rules this is the batch axis. A node whose every
    candidate costs infinity is replicated. Returns the decisions. (One
    function: its small helpers share the decisions being built.)"""
    res = AxisSharding(n=n)
    pins = pins or {}
    commit = getattr(cost, "commit", None)    # told each decision (a cost that shares transitions)
    walk = _walk_structure(graph)
    inst, prev_of, by_name = walk.inst, walk.prev_of, graph._by_name
    for name, p in pins.items():
        if name in by_name and by_name[name].is_state:
            res.out[name] = p       # a pinned parameter is placed before its consumers choose

    def decide(nd: Node) -> None:
        if nd.kind in ("input",):
            res.out[nd.name] = input_placement(nd)
            return
        if nd.kind in SKIP or nd.is_state:
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
        if commit is not None:
            commit(nd, best, ins_cur)

    def _apply(nd: Node, st: Strategy) -> None:
        res.strategy[nd.name] = st
        res.out[nd.name] = st.out
        for i, p in zip(nd.inputs, st.ins):
            if i not in res.out and by_name[i].is_state:
                res.out[i] = p

    signature = _pin_signatures(graph, walk, pins)

    def external_placements(g: str) -> tuple:
        return tuple(map(res.out.get, walk.external[g]))

    for item in walk.order:     # the graph's nodes, an instance's all at its first
        if type(item) is not str:
            decide(item)
            continue
        g = item
        prev = prev_of.get(g)
        if prev is not None and signature.get(g) == signature.get(prev) and \
                external_placements(g) == external_placements(prev):
            _copy(res, walk.pairs[g], walk.copies.get(g))
            res.reused_instances += 1
            res.copied_from[g] = prev
            continue
        for x in walk.span.get(g, inst[g]):
            decide(x)
    if output_placement is not None and graph.output is not None:
        res.out["__output__"] = output_placement
    return res


@dataclass(frozen=True)
class _Walk:
    """What :func:`walk_axis` needs of a graph's repeated layers, computed once
    per graph: the nodes of each instance, the instance before it, the values
    it reads from outside itself (parameters excepted), and, position by
    position, how it copies the instance before it."""

    inst: dict[str, list[Node]]
    prev_of: dict[str, str]
    external: dict[str, tuple[str, ...]]
    # per instance: (node, node of the previous instance, [(input of node, input slot)] of its state inputs)
    pairs: dict[str, tuple[tuple[str, str, tuple[tuple[str, int], ...]], ...]]
    position: dict[str, tuple[str, int]]        # node -> (its instance, its position in it)
    copies: dict[str, "_CopyPlan"]              # per instance: the pairs sorted for a bulk copy
    order: tuple[Node | str, ...]               # the nodes outside instances, and each instance at its first
    span: dict[str, list[Node]]                 # per instance: its nodes and the others between them


@dataclass(frozen=True)
class _CopyPlan:
    """How :func:`_copy` gives an instance the decisions of the one before it
    in bulk: the nodes a walk decides (``ops``: this instance's and the
    previous one's, position by position), the other nodes (``rest``), and
    the parameters the ops read (``reads``: parameter, op, input slot). None
    of its parameters belongs to the previous instance, so the order of the
    three steps cannot change what the pair by pair copy gives."""

    ops: tuple[tuple[str, ...], tuple[str, ...]]
    rest: tuple[tuple[str, ...], tuple[str, ...]]
    reads: tuple[tuple[str, str, int], ...]


def _decided(nd: Node) -> bool:
    """Whether :func:`walk_axis` gives ``nd`` a strategy."""
    return nd.kind != "input" and nd.kind not in SKIP and not nd.is_state and \
        (nd.out is not None or nd.kind == "split")


def _copy_plan(nodes: list[Node], prev: list[Node],
               pairs: tuple[tuple[str, str, tuple[tuple[str, int], ...]], ...]) -> "_CopyPlan | None":
    """The :class:`_CopyPlan` of an instance (``nodes``) copying ``prev``;
    None where the bulk copy could differ from the pair by pair one (a
    parameter of ``prev`` read here, or positions decided unlike)."""
    before = {x.name for x in prev}
    ops_a, ops_b, rest_a, rest_b, reads = [], [], [], [], []
    for x, y, (a, b, state_inputs) in zip(nodes, prev, pairs):
        if _decided(x) != _decided(y):
            return None
        if _decided(x):
            ops_a.append(a)
            ops_b.append(b)
            for i, k in state_inputs:
                if i in before:
                    return None
                reads.append((i, a, k))
        else:
            rest_a.append(a)
            rest_b.append(b)
    return _CopyPlan((tuple(ops_a), tuple(ops_b)), (tuple(rest_a), tuple(rest_b)), tuple(reads))


def _walk_structure(graph: Graph) -> _Walk:
    def build() -> _Walk:
        inst = instances(graph)
        span, broken = _spans(graph, inst)
        walked = {g: span.get(g, nodes) for g, nodes in inst.items()}
        prev_of = {b: a for g in graph.groups for a, b in zip(g.instances, g.instances[1:])
                   if a in span and b in span and _alike(span[a], span[b])}
        external, pairs = {}, {}
        for g, nodes in walked.items():
            names = {x.name for x in nodes}
            external[g] = tuple(i for x in nodes for i in x.inputs if i not in names and not graph[i].is_state)
            if g in prev_of:
                pairs[g] = tuple((a.name, b.name, tuple((i, k) for k, i in enumerate(a.inputs) if graph[i].is_state))
                                 for a, b in zip(nodes, walked[prev_of[g]]))
        position = {x.name: (g, k) for g, nodes in walked.items() for k, x in enumerate(nodes)}
        copies = {g: plan for g in pairs
                  if (plan := _copy_plan(walked[g], walked[prev_of[g]], pairs[g])) is not None}
        in_span = {x.name for g, nodes in span.items() for x in nodes if x.group is None}
        order: list[Node | str] = []
        for nd in graph.nodes:
            if nd.group in broken or (nd.group is None and nd.name not in in_span):
                order.append(nd)
            elif nd.group is not None and walked[nd.group][0] is nd:
                order.append(nd.group)
        return _Walk(inst, prev_of, external, pairs, position, copies, tuple(order), span)

    return graph.memo(("walk_axis",), build)


def _spans(graph: Graph, inst: dict[str, list[Node]]) -> tuple[dict[str, list[Node]], set[str]]:
    """What the walk decides of each instance, in graph order: its nodes and
    the nodes of no instance between its first and last (the residual adds of
    a parent module's loop, ``x = x + attn(norm(x)); x = x + ff(norm(x))``,
    lie between a layer's attention and its MLP: walked at the instance's
    first node, the MLP read the add undecided, took it for an unplaced
    parameter and replicated it); and the instances interleaved with another
    one's decided nodes, walked node by node."""
    pos = {nd.name: k for k, nd in enumerate(graph.nodes)}
    span, broken = {}, set()
    for g, nodes in inst.items():
        seq = graph.nodes[pos[nodes[0].name]:pos[nodes[-1].name] + 1]
        if any(nd.group not in (None, g) and _decided(nd) for nd in seq):
            broken.add(g)
        else:
            span[g] = [nd for nd in seq if nd.group == g or nd.group is None and _decided(nd)]
    return span, broken


def _alike(a: list[Node], b: list[Node]) -> bool:
    """Whether two instances' walked nodes match position by position (kind,
    op, shape, in an instance or between), so one copies the other's decisions."""
    return len(a) == len(b) and all(
        x.kind == y.kind and (x.target == y.target or x.is_state and y.is_state) and
        (x.group is None) == (y.group is None) and
        (x.out.shape if x.out is not None else None) == (y.out.shape if y.out is not None else None)
        for x, y in zip(a, b))


def _copy(res: AxisSharding, pairs, plan: _CopyPlan | None = None) -> None:
    """Give an instance the decisions of the one before it, position by
    position (a parameter takes the placement its first reader wants, as in
    :func:`walk_axis`). With its ``plan``, the ops' decisions are copied in
    bulk (a walk copies 94 of a 96-layer GPT-3's blocks, dozens of times per
    search), then the other nodes, then the parameters first read here."""
    strategy, out = res.strategy, res.out
    if plan is not None:
        mine, theirs = plan.ops
        try:
            sts = list(map(strategy.__getitem__, theirs))
        except KeyError:        # not decided like this instance: pair by pair
            sts = None
        if sts is not None:
            strategy.update(zip(mine, sts))
            out.update(zip(mine, [st.out for st in sts]))
            rest_a, rest_b = plan.rest
            out.update([(a, p) for a, p in zip(rest_a, map(out.get, rest_b)) if p is not None])
            for i, a, k in plan.reads:
                if i not in out:
                    out[i] = strategy[a].ins[k]
            return
    for a, b, state_inputs in pairs:
        st = strategy.get(b)
        if st is not None:
            strategy[a] = st
            out[a] = st.out
            for i, k in state_inputs:
                if i not in out:
                    out[i] = st.ins[k]
        elif b in out:
            out[a] = out[b]


# --------------------------------------------------------------------------
# the batch (data-parallel) axis
# --------------------------------------------------------------------------
def track_batch(graph: Graph) -> AxisSharding:
    """Follow the batch dimension (dim 0 of every input) through the graph.

    Returns the sharding of a data-parallel axis: the batch stays sharded
    wherever a rule allows it, the loss becomes a partial sum. Memoised on
    the graph. Costs here are structural (count of collectives), not times.
    """
    return graph.memo(("track_batch",), lambda: _track_batch(graph))


def samples_meet(graph: Graph) -> str | None:
    """The first value where ``graph``'s samples meet, or None: a node that
    reads a value the batch axis splits (or holds as a partial sum) in
    another placement (:func:`track_batch`), as an image x text similarity
    reads the text features whole, or a loss built from batch means (a
    mixture of experts' balance loss) reduces them before a product; with
    torch.export, also a value whose shape spans the batch twice
    (:attr:`Graph.cross_sample`). Where samples meet, a rank that holds some
    samples computes another value than one process does unless the
    batch axis moves them (:func:`autopar.parallelize.apply_tp` compiles it
    so). Memoised on the graph."""
    def find() -> str | None:
        sh, data = track_batch(graph), data_values(graph)
        partial: set[str] = set()     # batch sums, and what is affine in them (a loss plus constants)
        for nd in graph.nodes:
            st = sh.strategy.get(nd.name)
            if st is None:
                continue
            haves = [sh.out.get(i, R) for i in nd.inputs]
            split = [is_shard(h) or h == P for h in haves]
            if nd.attrs.get("updates_state") and any(split) and graph.batch_size > 1:
                return nd.name      # state updated from the samples (an EMA of batch means): one process's
            if sh.out.get(nd.name) == P:
                partial.add(nd.name)
            for k, (i, have, want, s) in enumerate(zip(nd.inputs, haves, st.ins, split)):
                if i in partial and not have == want == P:
                    # a batch sum read otherwise than as one: affinely with weights or constants it
                    # stays one under the ranks' averaging; any other way (a square, a product) not,
                    # but for the loss's ratio over a count the runtime weights (loss_denominator)
                    if not _affine_in(nd, k, data) and not loss_ratio(graph, nd):
                        return nd.name
                    partial.add(nd.name)
                # a product of two batch-split operands whose batch dims do not meet (aligned ones
                # keep the batch split: a batched matmul)
                elif s and have != want and nd.kind in ("matmul", "einsum") and sum(split) > 1:
                    return nd.name
                # attention reading a batch-split query, key or value otherwise: the batch is on
                # the sequence (``[seq, batch, ...]`` inputs traced with dim 0 as the batch; traced
                # at batch 1 the walk cannot tell the batch dim from the other size-1 dims)
                elif is_shard(have) and have != want and i in data and nd.kind == "sdpa" and graph.batch_size > 1:
                    return nd.name
        return graph.cross_sample

    return graph.memo(("samples_meet",), find)


def mislaid_batch(graph: Graph) -> str | None:
    """Why the inputs' dim 0 looks like the sequence, not the batch (for a
    warning), or None: the samples meet where an attention reads the batch
    dim as its sequence (:func:`samples_meet`) and the caller said nothing of
    the batch's dim (``batch_dim``)."""
    meet = samples_meet(graph)
    said = graph.batch_dim if isinstance(graph.batch_dim, tuple) else (graph.batch_dim,)
    if meet is None or meet not in graph or graph[meet].kind != "sdpa" or any(said):
        return None
    return (f"attention ({meet}) reads the batch dim of its inputs as the sequence: dim 0 of {graph.name}'s "
            "inputs looks like the sequence, not the batch. PyTorch's nn.Transformer*, nn.MultiheadAttention, "
            "nn.LSTM and nn.GRU take [seq, batch, ...] unless batch_first=True: pass batch_dim=1 (autopar "
            "--batch-dim 1). As traced, a split batch is gathered whole on every data-parallel rank (correct, "
            "not data parallel)")


def data_values(graph: Graph) -> frozenset[str]:
    """The values the graph's inputs flow into; a size read off an input is no
    data (an expand of a weight to the batch's size is made of the weight
    alone, whose gradient the data-parallel reduction owns). Memoised."""
    def build() -> frozenset[str]:
        out: set[str] = set()
        for nd in graph.nodes:
            if nd.kind == "input" or nd.kind != "shape" and any(i in out for i in nd.inputs):
                out.add(nd.name)
        return frozenset(out)

    return graph.memo(("data_values",), build)


def _affine_in(nd: Node, k: int, data: frozenset[str]) -> bool:
    """Whether ``nd`` is affine in its input ``k`` given its other inputs are
    no data (weights, constants): a sum with them (a loss plus an L2 term of
    the weights) or, in its first operand, a product or quotient by them. A
    batch sum read so is still one once each rank's value is averaged over
    the ranks, as data parallelism does."""
    info = ops.op_info(nd.target)
    lin = info.linear_in if info is not None else ""
    others_constant = all(i not in data for j, i in enumerate(nd.inputs) if j != k)
    return others_constant and (lin == "all" or lin == "first" and k == 0)


def batch_reduction(graph: Graph) -> str | None:
    """How ``graph``'s loss reduces the batch, from the batch walk at two
    ranks (:func:`follow_batch` on twice the traced batch): ``"mean"``
    (every batch reduction a mean: each rank's loss averaged over the ranks
    is the whole batch's), ``"sum"`` (every one a sum: the ranks' losses
    add up to it), ``"mixed"``, or None where the walk sees no batch
    reduction (a loss op without a rule). Memoised."""
    def find() -> str | None:
        if not graph.batch_size:
            return None
        scales = {st.scale for _, st in _batch_reductions(graph)}
        if not scales:
            return None
        return "mean" if scales == {0.5} else "sum" if scales == {1.0} else "mixed"

    return graph.memo(("batch_reduction",), find)


def _batch_reductions(graph: Graph) -> list[tuple[Node, Strategy]]:
    """The nodes that reduce the batch (a batch-split input, a partial
    output) on the batch walk at two ranks, with their strategies."""
    def find() -> list[tuple[Node, Strategy]]:
        walk = follow_batch(graph, 2, scaled_shapes(graph, 2 * graph.batch_size, 1), batch_axis=True)
        return [(nd, st) for nd in graph.nodes if (st := walk.strategy.get(nd.name)) is not None and
                st.out == P and any(is_shard(walk.out.get(i, R)) for i in nd.inputs)]

    return graph.memo(("batch_reductions",), find) if graph.batch_size else []


def positions_reduced_with_samples(graph: Graph, seq: int) -> bool:
    """Whether every reduction of the batch by ``graph``'s loss reduces the
    ``seq`` positions of each sample with it (a cross-entropy over the
    flattened tokens, a sum of a (batch, positions) tensor): its input has a
    multiple of batch x ``seq`` elements. Then the positions are reduced as
    the samples are (:func:`batch_reduction`), which context parallelism,
    splitting the positions, relies on."""
    reductions = _batch_reductions(graph)
    b = graph.batch_size
    return bool(reductions) and all(
        any(graph[i].out is not None and numel(graph[i].out.shape) % (b * seq) == 0 for i in nd.inputs)
        for nd, _ in reductions)


def loss_denominator(graph: Graph) -> tuple[str, str, int | None] | None:
    """What ``graph``'s loss divides by, where that is a count over the batch
    made of the inputs alone, so that a part of the batch (a data-parallel
    rank's samples, a microbatch) divides by its own share of it:

    * ``("tokens", cross-entropy node, ignored index)``: one cross-entropy
      averaged over its target's tokens (reduction ``mean``, no label
      smoothing; with class weights, over the targets' weights), which
      differ between parts where the target ignores some (padding, masked
      prompts) or where its classes weigh differently;
    * ``("sum", denominator node, None)``: a ratio of two batch sums whose
      denominator reads no weight (a masked mean written out,
      ``(loss * mask).sum() / mask.sum()``).

    The loss is that value up to sums and products with weights or
    constants. None otherwise. Memoised."""
    def target_only(name: str) -> bool:
        todo, seen = [name], set()
        while todo:
            nd = graph[todo.pop()]
            if nd.name in seen:
                continue
            if nd.kind not in ("input", "shape") and not nd.inputs or nd.is_state:
                return False     # a weight, buffer or constant among what makes it
            seen.add(nd.name)
            todo.extend(nd.inputs)
        return True

    def find() -> tuple[str, str, int | None] | None:
        data, sh = data_values(graph), track_batch(graph)
        cur = graph.output   # down from the output through what is affine with weights or constants
        while cur is not None and cur in graph:
            nd = graph[cur]
            ins = [i for i in nd.inputs if i in data]
            if nd.kind in ("cross_entropy", "nll_loss"):
                weighted = bool(nd.attrs.get("class_weight"))
                ok = nd.attrs.get("reduction", "mean") == "mean" and len(nd.inputs) == 2 + weighted and \
                    batch_reduction(graph) == "mean" and \
                    sum(n.kind in ("cross_entropy", "nll_loss") for n in graph.nodes) == 1 and \
                    target_only(nd.inputs[1]) and (not weighted or _frozen(graph, nd.inputs[2]))
                return ("tokens", nd.name, int(nd.attrs.get("ignore_index", -100))) if ok else None
            if nd.kind == "elementwise" and str(nd.target) in ("truediv", "div") and len(nd.inputs) == 2 and \
                    all(sh.out.get(i) == P for i in nd.inputs) and target_only(nd.inputs[1]):
                return "sum", nd.inputs[1], None
            if len(ins) != 1 or not _affine_in(nd, nd.inputs.index(ins[0]), data):
                return None
            cur = ins[0]
        return None

    return graph.memo(("loss_denominator",), find)


def loss_ratio(graph: Graph, nd: Node) -> bool:
    """Whether ``nd`` is the loss's ratio of batch sums over a count of the
    target (:func:`loss_denominator`), which the runtime weights: no meeting."""
    den = loss_denominator(graph)
    return den is not None and den[0] == "sum" and nd.target in ("truediv", "div") and nd.inputs[1] == den[1]


def _frozen(graph: Graph, name: str) -> bool:
    """Whether ``name`` is a tensor no training changes (a buffer, a constant, a frozen parameter)."""
    nd = graph[name]
    return nd.kind in ("buffer", "constant") or nd.kind == "param" and not (
        graph.params.get(nd.param) and graph.params[nd.param].requires_grad)


def meeting_limits(cfg: "ParallelConfig") -> list[str]:
    """What of ``cfg`` does not run a model whose samples meet: microbatches
    (so pipelines too) and copies (a loss over part of the batch is another
    loss), and what is not run yet with it (a tp_mode grid's rows, cp).
    Empty: it runs (dp, tp, ZeRO)."""
    return [k for k, on in (("microbatches", cfg.microbatches > 1), ("copies", cfg.copies > 1),
                            ("a tp_mode grid", cfg.tp_mode != "1d"), ("cp", cfg.cp > 1)) if on]


def _track_batch(graph: Graph) -> AxisSharding:
    shapes = {nd.name: (nd.out.shape if nd.out is not None else None) for nd in graph.nodes}
    return follow_batch(graph, 1, shapes, batch_axis=True)


def follow_batch(graph: Graph, n: int, shapes: dict[str, Shape | None], batch_axis: bool) -> AxisSharding:
    """An axis of size ``n`` that splits the batch (dim 0 of every input)
    wherever a rule allows it, on the local ``shapes``: the data-parallel axis
    (``n=1``, ``batch_axis``: per-replica statistics allowed) and the rows of
    a 2-D tensor-parallel grid (:func:`grid_rows`)."""

    def inp(nd: Node) -> str:
        return S(0) if nd.out is not None and len(nd.out.shape) > 0 else R

    traced = graph.traced_batch_dims

    def cost(nd: Node, st: Strategy, cur: list[str | None], ctx: Ctx) -> float:
        c = 0.0
        if traced is not None:      # the tracer knows the batch dim: follow it wherever a rule allows
            d = traced.get(nd.name)
            c += 0.0 if st.out == (S(d) if d is not None else R) or (d is None and st.out == P) else 2.0
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

    return walk_axis(graph, n, shapes, inp, cost, None, batch_axis=batch_axis)


def grid_rows(graph: Graph, cols: AxisSharding, q: int, shapes: dict[str, Shape | None],
              inner: AxisSharding | None = None) -> AxisSharding:
    """The rows of a ``q x q`` tensor-parallel grid (``tp_mode=2d``) whose
    columns are decided by ``cols``: the batch split over the rows wherever a
    rule allows (:func:`follow_batch` on the column-local ``shapes``; the loss
    a scaled partial sum), and every trainable parameter of two or more dims
    stored split over the rows too, on a dim the columns do not split (the
    largest that ``q`` divides), so each rank holds ``1/q^2`` of it. Its
    readers still read it whole along the rows: the compiler all-gathers it
    there before use and reduce-scatters its gradient (SUMMA's broadcast of the
    weight blocks along a grid column).

    ``inner``: the rows of the same grid when these are the depth of a
    ``tp_mode=3d`` cube: the depth splits the batch again and stores every
    weight the rows split split once more (on a dim the columns leave whole,
    the rows' own when it divides), so each rank holds ``1/q^3`` of it."""
    rows = follow_batch(graph, q, shapes, batch_axis=False)
    grad = needs_grad(graph)
    for nd in graph.nodes:
        if nd.kind == "param" and grad.get(nd.name) and nd.out is not None:
            col = cols.out.get(nd.name, R)
            if inner is None:
                p = row_placement(nd.out.shape, col, cols.n, q)
            else:
                p = depth_placement(nd.out.shape, col, cols.n, inner.out.get(nd.name, R), inner.n, q)
            if p != R:
                rows.out[nd.name] = p
    return rows


def row_placement(shape: Shape, col: str, n_cols: int, q: int) -> str:
    """Where :func:`grid_rows` stores a trainable parameter of ``shape``
    placed ``col`` on ``n_cols`` columns on ``q`` rows: split on the largest
    other dim ``q`` divides (of two or more dims), else replicated."""
    if len(shape) < 2:
        return R
    taken = shard_dim(col) if is_shard(col) else None
    local = [s // n_cols if d == taken else s for d, s in enumerate(shape)]
    dims = [d for d in range(len(local)) if d != taken and local[d] % q == 0]
    return S(max(dims, key=lambda d: (local[d], -d))) if dims else R


def depth_placement(shape: Shape, col: str, n_cols: int, row: str, n_rows: int, q: int) -> str:
    """Where the depth of a ``tp_mode=3d`` cube stores a trainable parameter
    the columns place ``col`` and the rows ``row`` (:func:`row_placement`):
    only one the rows split (the others stay replicated, as on the rows), on
    the largest dim the columns leave whole that ``q`` divides after both
    splits; the rows' own dim is allowed (split twice, the depth's chunks
    outermost), as both axes gather it before use. Replicated when none."""
    if row == R:
        return R
    taken = shard_dim(col) if is_shard(col) else None
    by_rows = shard_dim(row)
    local = [s // (n_cols if d == taken else n_rows if d == by_rows else 1) for d, s in enumerate(shape)]
    dims = [d for d in range(len(local)) if d != taken and local[d] % q == 0]
    return S(max(dims, key=lambda d: (local[d], d != by_rows, -d))) if dims else R


def batch_dims(graph: Graph) -> dict[str, int | None]:
    """For every tensor node, the dim that scales with the batch (None if none). Memoised on the graph."""
    if graph.traced_batch_dims is not None:     # exact: the tracer saw the batch size as a symbol
        return graph.traced_batch_dims
    return graph.memo(("batch_dims",), lambda: {k: (shard_dim(v) if is_shard(v) else None)
                                                for k, v in track_batch(graph).out.items()})


def scaled_shapes(graph: Graph, batch: int, divide: int = 1) -> dict[str, Shape | None]:
    """Shapes of every node at batch size ``batch`` (per microbatch), with the
    batch dim further divided by ``divide`` (the data-parallel degree)."""
    b0 = graph.batch_size
    return {name: shp if d is None else shp[:d] + (shp[d] * batch // (b0 * divide),) + shp[d + 1:]
            for name, shp, d in _batch_shapes(graph)}


def _batch_shapes(graph: Graph) -> list[tuple[str, Shape | None, int | None]]:
    """(node, traced shape, its batch dim or None) of every node, in graph
    order: what :func:`scaled_shapes` scales (memoised on the graph)."""
    def build() -> list[tuple[str, Shape | None, int | None]]:
        bd = batch_dims(graph)
        out = []
        for nd in graph.nodes:
            shp = nd.out.shape if nd.out is not None else None
            d = bd.get(nd.name) if shp is not None else None
            out.append((nd.name, shp, d if d is not None and d < len(shp) else None))
        return out

    return graph.memo(("batch_shapes",), build)


# --------------------------------------------------------------------------- what backward reads
#: norms, losses and pooling read their (first) input in backward
_READS_FIRST = ("layernorm", "rmsnorm", "batchnorm", "groupnorm", "cross_entropy", "pool", "pointwise_loss")


def backward_reads(graph: Graph) -> dict[str, list[str]]:
    """Per node, the float values its backward reads (what autograd saves
    for it, parameters aside): a matmul's activation inputs (attention also
    its output), a norm's or loss's input, a softmax's output, a nonlinear
    elementwise op's inputs. Memoised on the graph."""
    return graph.memo(("backward_reads",), lambda: {nd.name: _backward_reads(graph, nd) for nd in graph.nodes})


def _backward_reads(graph: Graph, nd: Node) -> list[str]:
    k = nd.kind
    if ops.family(k) == "matmul":
        names = [i for i in nd.inputs if not graph[i].is_state]
        if k == "sdpa":
            names.append(nd.name)
    elif k in _READS_FIRST:
        names = nd.inputs[:1]
    elif k == "softmax":
        names = [nd.name]
    elif k == "elementwise" and ops.is_nonlinear(nd.target):
        names = [i for i in _operands_read(graph, nd) if not graph[i].is_state]
    else:
        return []
    return [i for i in names if i in graph and graph[i].out is not None and graph[i].out.is_float]


#: view ops that return their input's storage when it is already laid out as they need
_NO_COPY_VIEWS = frozenset({"contiguous", "view", "reshape", "_unsafe_view", "flatten", "view_as", "alias",
                            "detach"})
#: ops whose output takes the memory layout of their first input of the same shape
_LAYOUT_KEEPING = frozenset({"elementwise", "cat"})


def _swaps_heads(nd: Node) -> bool:
    """Whether ``nd`` is a transpose of dims 1 and 2 of a 4-dim value
    ([batch, heads, seq, head dim] <-> [batch, seq, heads, head dim])."""
    return nd.kind == "transpose" and list(nd.attrs.get("perm", ())) == [0, 2, 1, 3]


def _sequence_major(graph: Graph, name: str) -> bool:
    """Whether the 4-dim value ``name`` ([batch, heads, seq, head dim]) lies
    in memory sequence-major, as [batch, seq, heads, head dim]: it is a
    transpose of dims 1 and 2, reached back through ops that keep their
    input's layout (elementwise ops such as RoPE's, ``cat``) and views that
    keep its shape; a ``contiguous``, ``clone`` or reshape into the 4 dims
    lays it out heads-major."""
    nd = graph[name]
    while True:
        if nd.kind == "transpose":
            return _swaps_heads(nd)
        same = [graph[i] for i in nd.inputs if graph[i].out is not None and nd.out is not None
                and graph[i].out.shape == nd.out.shape]
        if not same or not (nd.kind in _LAYOUT_KEEPING or (nd.kind == "view" and nd.target in _NO_COPY_VIEWS
                                                           and nd.target != "contiguous")):
            return False
        nd = same[0]


def attention_output_aliases(graph: Graph) -> dict[str, str]:
    """The values that are an attention's output in its own storage: fused
    attention (flash, cuDNN, memory-efficient on CUDA; flash on the CPU)
    writes its output in its query's layout, so where the query is
    sequence-major (:func:`_sequence_major`: the usual
    ``q.view(B, T, heads, hd).transpose(1, 2)``) the heads moved back behind
    the sequence (a transpose of dims 1 and 2, after views that keep the
    output's shape, as torch.export writes them) and the ``contiguous`` /
    ``view`` / ``reshape`` after it copy nothing. Each is mapped to the
    attention node: the output projection's saved input and the attention's
    saved output are one tensor. Memoised on the graph."""
    def views(name: str) -> list[Node]:
        return [u for u in map(graph.__getitem__, graph.consumers(name))
                if u.kind == "view" and u.target in _NO_COPY_VIEWS]

    def build() -> dict[str, str]:
        out: dict[str, str] = {}
        for nd in graph.nodes:
            if nd.kind != "sdpa" or nd.out is None or len(nd.out.shape) != 4 or \
                    not _sequence_major(graph, nd.inputs[0]):
                continue
            before = [nd] + [u for u in views(nd.name) if u.out is not None and u.out.shape == nd.out.shape]
            todo = [u for b in before for u in map(graph.__getitem__, graph.consumers(b.name)) if _swaps_heads(u)]
            if todo:
                out.update((b.name, nd.name) for b in before[1:])
            while todo:
                u = todo.pop()
                out[u.name] = nd.name
                todo += views(u.name)
        return out

    return graph.memo(("attention_output_aliases",), build)


def _operands_read(graph: Graph, nd: Node) -> list[str]:
    """The inputs a nonlinear elementwise op's backward reads, as autograd
    saves them (:attr:`autopar.ops.OpInfo.operands`): a product's operand only
    for another operand's gradient, a quotient's divisor for either's and its
    dividend for the divisor's."""
    info = ops.op_info(nd.target)
    how = info.operands if info is not None else "all"
    if how == "all":
        return list(nd.inputs)
    grad = needs_grad(graph)
    if how == "product":
        return [i for j, i in enumerate(nd.inputs)
                if any(grad.get(o, False) for k, o in enumerate(nd.inputs) if k != j)]
    if len(nd.inputs) < 2:   # a Python number on one side: `x / 2` keeps nothing, `2 / x` keeps x
        divisor = not nd.attrs.get("tensor_dividend", False)
        return [i for i in nd.inputs if divisor and grad.get(i, False)]
    num, den = nd.inputs[0], nd.inputs[1]
    return [x for x, keep in ((num, grad.get(den, False)), (den, grad.get(num, False) or grad.get(den, False)))
            if keep]


def selective_candidate(graph: Graph, nd: Node) -> bool:
    """Whether ``nd`` is an op selective recompute may keep rather than run
    again: a weight matmul (a matmul-family op reading a parameter) or
    attention. The attention core of explicit matmul-softmax attention is
    not: Megatron's selective recompute runs exactly that again."""
    return nd.kind == "sdpa" or (ops.family(nd.kind) == "matmul" and any(graph[i].is_state for i in nd.inputs))


def selective_keeps(graph: Graph, sh: AxisSharding | None = None) -> frozenset[str]:
    """The nodes of the repeated layers whose outputs selective recompute
    keeps (the runtime's checkpoint policy saves them, the cost model counts
    them): every :func:`selective_candidate` whose output a backward of its
    layer needs, read directly or through ops that run again cheaply and
    locally (views, bias adds, activations, norms) and do not communicate
    in forward on the tensor-parallel axis ``sh`` (None: one device; a
    ``tp_mode=mesh`` group's inner axis, its outer ones in ``sh.others``). Not
    kept, and run again with the layer: a row-parallel linear's partial
    output, whose readers (a reduce-scatter or all-reduce, then adds) keep
    nothing for backward, and any output no backward reads.

    Everything else the layer's backwards read is run again from these and
    the layer's inputs, so selective never keeps more than no recompute
    keeps of the same values, and keeps a matmul's output instead of the
    values computed from it. Memoised on the graph per decisions: the
    placements of the layer nodes (many searched shardings share them)."""
    if sh is None or (sh.n == 1 and not sh.others):
        return graph.memo(("selective_keeps", None), lambda: _selective_keeps(graph, None))
    # an instance copied from another has its decisions position by position, so it keeps what
    # its source keeps: the key and the search run over the other instances alone (flat in depth)
    inst, copied = _walk_structure(graph).inst, sh.copied_from
    key = ("selective_keeps", tuple(sorted(copied.items())),
           tuple((ax.out.get(x.name), ax.strategy.get(x.name)) for ax in (*sh.others, sh)
                 for g, nodes in inst.items() if g not in copied for x in nodes))
    return graph.memo(key, lambda: _selective_keeps(graph, sh))


def _selective_keeps(graph: Graph, sh: AxisSharding | None) -> frozenset[str]:
    read = graph.memo(("layer_backward_reads",), lambda: _layer_backward_reads(graph))
    inst = _walk_structure(graph).inst
    copied = sh.copied_from if sh is not None else {}

    def moves(value: str, reader: Node) -> bool:
        """Whether the value reaches ``reader`` through a forward collective
        (on any axis of a ``tp_mode=mesh`` group)."""
        if sh is None:
            return False
        for ax in (*sh.others, sh):
            st = ax.strategy.get(reader.name)
            have = ax.out.get(value, R)
            want = st.ins[reader.inputs.index(value)] if st is not None else have
            if have != want and have != R:     # R -> S(d) is a local slice
                return True
        return False

    def kept(nd: Node) -> bool:
        todo, seen = [nd], {nd.name}
        while todo:
            v = todo.pop()
            if (nd.group, v.name) in read:
                return True
            for u in graph.consumers(v.name):
                un = graph[u]
                if u in seen or un.group != nd.group or selective_candidate(graph, un) or moves(v.name, un) \
                        or un.kind != "split" and (un.out is None or not un.out.is_float):
                    continue
                seen.add(u)
                todo.append(un)
        return False

    positions: dict[str, list[int]] = {}     # per instance, the positions it keeps
    keep = []
    for g, nodes in inst.items():
        source = g
        while source in copied:
            source = copied[source]
        if source not in positions:
            positions[source] = [k for k, nd in enumerate(inst[source]) if selective_candidate(graph, nd) and kept(nd)]
        keep += [nodes[k].name for k in positions[source]]
    return frozenset(keep)


def _layer_backward_reads(graph: Graph) -> frozenset[tuple[str, str]]:
    """(layer instance, value) pairs where a backward of that instance reads
    the value (the next layer keeps its input itself)."""
    reads = backward_reads(graph)
    return frozenset((nd.group, v) for nd in graph.nodes if nd.group is not None for v in reads[nd.name])
