"""Context parallelism (``cp=N``): what a graph's attention looks like to it.

Under ``cp=N`` the sequence is split over ``N`` ranks, load-balanced for
causal attention: the ``T`` positions are cut into ``2N`` equal chunks and
rank ``i`` holds chunks ``i`` and ``2N - 1 - i`` (:func:`positions`), so every
rank does the same causal work. Everything but attention is local per token;
attention reads the keys and values of the whole sequence (all-gathered, as
Llama 3 does). This module finds the attention ops a graph has and the keys
and values they read (:func:`attentions`), on either front end:

* fused attention (``F.scaled_dot_product_attention``, the aten kernels):
  keys and values are its 2nd and 3rd inputs, sequence on dim -2;
* explicit attention: a softmax over ``q @ k^T`` (masked, scaled) whose
  result multiplies ``v``: keys on dim -1 of the score product's second
  operand, values on dim -2 of the context product's second operand.

The cost model prices the gathers from these, the compiler rewrites them;
neither needs a model class.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..errors import StrategyError
from ..graph import Graph, Node

#: kinds an explicit attention's scores pass through between the product and the softmax (scale, mask, dtype)
_SCORE_PATH = frozenset({"elementwise", "view"})
#: kinds that only move or repeat elements: keys and values are gathered before them, where they are
#: smallest (grouped-query attention's repeat_interleave), when they have no size argument of their own
_LAYOUT = frozenset({"transpose", "expand", "view"})
#: below this many positions context parallelism is not searched (explicit ``cp=N`` still runs)
SEARCH_MIN_SEQ = 16384


@dataclass(frozen=True)
class Attention:
    """One attention op: ``node`` (the fused op, or the softmax of explicit
    attention), the values its keys and values come from (``k``, ``v``) and
    the dim of each that runs along the sequence; ``seq`` the keys' length
    (the whole sequence); for explicit attention the score and context
    products (``scores``, ``context``). ``gathered`` holds, for the keys and
    the values, where they are gathered: ``(value, reader)``, the value before
    the layout-only ops between it and the attention (GQA's
    ``repeat_interleave``, transposes) and the op of that chain reading it."""

    node: str
    fused: bool
    k: str
    v: str
    k_dim: int
    v_dim: int
    seq: int
    scores: str | None = None
    context: str | None = None
    masked: bool = False        # fused attention given an explicit mask (attn_mask=): cp cannot rebuild it
    gathered: tuple[tuple[str, str], tuple[str, str]] = (("", ""), ("", ""))


def positions(seq: int, cp: int, rank: int) -> list[int]:
    """The global positions rank ``rank`` of ``cp`` holds, in the order it
    holds them: chunk ``rank`` then chunk ``2 cp - 1 - rank`` of ``2 cp``
    equal chunks (every rank gets as much causal attention work)."""
    c = seq // (2 * cp)
    return [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def attentions(graph: Graph) -> list[Attention]:
    """The attention ops of ``graph`` in graph order (memoised on it)."""
    return graph.memo(("cp_attentions",), lambda: _find(graph))


def _activation(graph: Graph, name: str) -> bool:
    nd = graph[name]
    return not nd.is_state and nd.kind not in ("constant", "shape", "factory") and nd.out is not None


def _find(graph: Graph) -> list[Attention]:
    out = []
    for nd in graph.nodes:
        if nd.kind == "sdpa" and len(nd.inputs) >= 3:
            k, v = graph[nd.inputs[1]], graph[nd.inputs[2]]
            if k.out is not None and len(k.out.shape) >= 2:
                out.append(Attention(nd.name, True, k.name, v.name, -2, -2, k.out.shape[-2],
                                     masked=len(nd.inputs) > 3,
                                     gathered=(_source(graph, k.name, nd.name), _source(graph, v.name, nd.name))))
        elif nd.kind == "softmax":
            att = _explicit(graph, nd)
            if att is not None:
                out.append(att)
    return out


def _explicit(graph: Graph, soft: Node) -> Attention | None:
    """The explicit attention around ``soft``, or None when the softmax is
    not one (no product of two activations before it)."""
    x = soft.inputs[0] if soft.inputs else None
    while x is not None and graph[x].kind in _SCORE_PATH:
        ins = [i for i in graph[x].inputs if _activation(graph, i)]
        x = ins[0] if ins else None
    if x is None or graph[x].kind != "matmul":
        return None
    scores = graph[x]
    if len(scores.inputs) < 2 or not all(_activation(graph, i) for i in scores.inputs[:2]):
        return None
    y, context = soft.name, None
    while context is None:
        nxt = [c for c in graph.consumers(y) if c in graph]
        if len(nxt) != 1:
            break
        c = graph[nxt[0]]
        if c.kind == "matmul" and c.inputs and c.inputs[0] == y and len(c.inputs) >= 2:
            context = c
        elif c.kind in _SCORE_PATH:
            y = c.name
        else:
            break
    k = graph[scores.inputs[1]]
    if context is None or k.out is None:
        return None
    return Attention(soft.name, False, k.name, context.inputs[1], -1, -2, k.out.shape[-1],
                     scores=scores.name, context=context.name,
                     gathered=((k.name, scores.name), (context.inputs[1], context.name)))


def _source(graph: Graph, name: str, reader: str) -> tuple[str, str]:
    """``(value, its reader)``: walking back from ``name`` (read by
    ``reader``) through ops that only move or repeat elements and have no
    size argument (transpose, repeat_interleave, contiguous), each read by
    the next alone, to the value they start from."""
    while True:
        nd = graph[name]
        if nd.kind not in _LAYOUT or len(graph.consumers(name)) != 1:
            return name, reader
        info = ops.op_info(nd.target)
        ins = [i for i in nd.inputs if _activation(graph, i)]
        if info is None or info.shape_arg is not None or len(ins) != 1:
            return name, reader
        name, reader = ins[0], name


def sequence_length(graph: Graph) -> int | None:
    """The sequence length attention runs over (that of the first attention op), None without attention."""
    found = attentions(graph)
    return found[0].seq if found else None


def check_cp(graph: Graph, cp: int) -> None:
    """Raise :class:`StrategyError` unless ``graph`` can run under ``cp``:
    it has attention, none given an explicit mask, and ``2 cp`` divides its
    sequence length (the load-balanced chunks)."""
    if cp == 1:
        return
    seq = sequence_length(graph)
    if seq is None:
        raise StrategyError(f"cp={cp}: context parallelism splits the sequence of attention, but {graph.name} has "
                            "no attention op (scaled_dot_product_attention, or softmax(q @ k^T) @ v); use dp or tp")
    masked = next((a.node for a in attentions(graph) if a.masked), None)
    if masked is not None:
        raise StrategyError(f"cp={cp}: attention op {masked} takes an explicit attn_mask (Hugging Face models build "
                            "one per call); context parallelism builds the causal mask from global positions and "
                            "needs is_causal=True attention or a mask buffer sliced by the sequence length")
    if seq % (2 * cp):
        valid = [c for c in range(1, seq // 2 + 1) if seq % (2 * c) == 0][:8]
        raise StrategyError(f"cp={cp}: the sequence of {seq} positions must split into 2 x cp = {2 * cp} equal "
                            f"chunks (load-balanced causal attention); valid cp: {', '.join(map(str, valid))}")


def cp_choices(graph: Graph, devices: int, min_seq: int = SEARCH_MIN_SEQ, small_batch: bool = False) -> list[int]:
    """The cp degrees the automatic search tries: 1, and for a model with
    attention (and no explicit attention mask) over ``min_seq`` positions or
    more, or whose batch is too small to give every device a part
    (``small_batch``: MindSpore's dataset slicing, the sequence split where the
    batch cannot be), every power of two that divides ``devices`` and splits the
    sequence into ``2 cp`` chunks (short sequences at ample batches keep the
    grid as it was)."""
    seq = sequence_length(graph)
    if seq is None or (seq < min_seq and not small_batch) or any(a.masked for a in attentions(graph)):
        return [1]
    out, c = [1], 2
    while c <= devices and devices % c == 0 and seq % (2 * c) == 0:
        out.append(c)
        c *= 2
    return out
