"""The counter of what a loss divides by, per part of the batch.

A cross-entropy with ``reduction="mean"`` divides by the tokens its target
does not ignore (``ignore_index``: padding, masked prompts), and a masked
mean written out (``(loss * mask).sum() / mask.sum()``) by its mask's sum.
A part of the batch (a data-parallel rank's samples, a microbatch) divides
by its own share, so the mean of the parts' losses, which data parallelism
and gradient accumulation take, is not the whole batch's loss when the
shares differ. :func:`token_counter` cuts from the traced program what
makes that count (:func:`autopar.sharding.loss_denominator`); the runtime
runs it on every part before the step and weights each part's loss by its
share of the whole batch's count
(:meth:`autopar.runtime.parallel.ParallelModule._token_weights`), as one
process divides by all of it. A part whose count is 0 (every target of a
rank's samples ignored) has the loss 0/0 and the weight 0:
:func:`guard_empty_ratio` makes a written-out ratio's backward give it a
zero gradient, as torch's cross-entropy does, instead of NaN.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import Graph
from ..sharding import loss_denominator, loss_ratio

__all__ = ["token_counter", "guard_empty_ratio"]


def token_counter(graph: Graph) -> fx.GraphModule | None:
    """A program of ``graph``'s inputs (the loss program's placeholders, in
    order) returning what the loss divides by on those inputs: the tokens of
    a cross-entropy's target not ``ignore_index``, or a ratio's denominator.
    None where the loss divides by no such count or the graph has no program."""
    found = loss_denominator(graph)
    if found is None or graph.gm is None:
        return None
    how, name, ignore = found
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    source = nodes[name].args[1] if how == "tokens" else nodes[name]
    weight = _class_weight(nodes[name]) if how == "tokens" and graph[name].attrs.get("class_weight") else None
    if not isinstance(source, fx.Node):
        return None
    need, todo = set(), [source] + ([weight] if weight is not None else [])
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)
    new, env = fx.Graph(), {}
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder" or n in need:
            env[n] = new.node_copy(n, lambda a: env[a])
    value = env[source]
    if how == "tokens":
        counted = new.call_function(operator.ne, (value, ignore))
        if weight is not None:   # the class weights of the counted targets
            classes = new.call_function(torch.where, (counted, value, 0))
            counted = new.call_function(operator.mul, (new.call_function(operator.getitem, (env[weight], classes)),
                                                       counted))
        value = new.call_function(torch.sum, (counted,))
    new.output(value)
    return fx.GraphModule(graph.gm, new, class_name="TokenCounter")


def _class_weight(fnode: fx.Node) -> fx.Node | None:
    """The class-weight operand of a cross-entropy / nll_loss node (the third
    argument, or ``weight=``)."""
    w = fnode.kwargs.get("weight", fnode.args[2] if len(fnode.args) > 2 else None)
    return w if isinstance(w, fx.Node) else None


def guard_empty_ratio(gm: fx.GraphModule, graph: Graph) -> bool:
    """In the compiled program ``gm`` of ``graph``, divide the loss's ratio of
    batch sums (:func:`~autopar.sharding.loss_denominator` ``"sum"``) by its
    denominator where that is not 0, else by 1: a part of the batch whose
    mask is all 0 then has the loss 0 and a zero gradient (the runtime weights
    it 0), where 0/0 put NaN in every gradient. Exact wherever the
    denominator is not 0. Returns whether a ratio was found."""
    found = loss_denominator(graph)
    if found is None or found[0] != "sum":
        return False
    ratios = {nd.name for nd in graph.nodes if loss_ratio(graph, nd)}
    done = False
    for n in list(gm.graph.nodes):
        if n.name in ratios and len(n.args) == 2 and isinstance(n.args[1], fx.Node):
            den = n.args[1]
            with gm.graph.inserting_before(n):
                empty = gm.graph.call_function(operator.eq, (den, 0))
                safe = gm.graph.call_function(torch.where, (empty, 1, den))
            n.args = (n.args[0], safe)
            done = True
    if done:
        gm.recompile()
    return done
