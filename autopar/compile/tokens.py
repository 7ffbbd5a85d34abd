"""The token counter of a loss averaged over its target's tokens.

A cross-entropy with ``reduction="mean"`` divides by the tokens its target
does not ignore (``ignore_index``: padding, masked prompts). A part of the
batch (a data-parallel rank's samples, a microbatch) has its own count, so
the mean of the parts' losses, which data parallelism and gradient
accumulation take, is not the whole batch's loss when the counts differ.
:func:`token_counter` cuts from the traced program what makes the target
and counts its tokens; the runtime runs it on every part before the step
and weights each part's loss by its share of the tokens
(:meth:`autopar.runtime.parallel.ParallelModule._token_weights`), as one
process averages over all of them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import Graph
from ..sharding import token_mean_loss

__all__ = ["token_counter"]


def token_counter(graph: Graph) -> fx.GraphModule | None:
    """A program of ``graph``'s inputs (the loss program's placeholders, in
    order) returning how many tokens of the loss's target are counted (not
    ``ignore_index``); None where the loss is not one token mean
    (:func:`autopar.sharding.token_mean_loss`) or the graph has no program."""
    found = token_mean_loss(graph)
    if found is None or graph.gm is None:
        return None
    name, ignore = found
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    target = nodes[name].args[1]
    if not isinstance(target, fx.Node):
        return None
    need, todo = set(), [target]
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(n.all_input_nodes)
    new, env = fx.Graph(), {}
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder" or n in need:
            env[n] = new.node_copy(n, lambda a: env[a])
    new.output(new.call_function(torch.sum, (new.call_function(operator.ne, (env[target], ignore)),)))
    return fx.GraphModule(torch.nn.Module(), new, class_name="TokenCounter")
