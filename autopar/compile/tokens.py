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
process divides by all of it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import Graph
from ..sharding import loss_denominator

__all__ = ["token_counter"]


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
