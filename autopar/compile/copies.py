"""Multi-copy parallel (``copies=N``, MindSpore's ``micro_batch_interleave_num``).

:func:`apply_copies` rewrites a program :func:`~autopar.compile.rewrite.compile_local`
built for ``1/N`` of a microbatch into one that runs ``N`` copies of it on
the microbatch's ``N`` slices (every input cut along dim 0, as the
microbatches are), with the copies' nodes interleaved so that one copy's
tensor-parallel collectives are in flight while another copy computes:

* every ``Comm`` node becomes a :func:`~autopar.runtime.collectives.start`
  (the collective launched asynchronously) and a
  :func:`~autopar.runtime.collectives.finish` placed just before the
  copy's first node that reads the result;
* the single-copy program is cut into segments, each ending with a
  collective's start (and, when ``labels`` are given, at every change of
  layer, so that layer regions stay contiguous for recompute); the program
  runs segment ``k`` of copy 0, segment ``k`` of copy 1, ..., then segment
  ``k + 1`` of copy 0: copy 0's ``k``-th collective runs while the other
  copies compute their segment ``k``, and copy ``N - 1``'s while copy 0
  computes its segment ``k + 1``;
* backward: autograd runs ready nodes in the reverse order of their
  creation, so it meets the copies in the same interleaving reversed. The
  backward collective of a split collective starts in ``finish``'s backward
  and is waited for in ``start``'s, so the other copies' backward of the
  nodes between them runs while it is in flight (Megatron's *f* all-reduce
  and the reduce-scatter / all-gather of sequence parallelism included).
  Collectives inside kernels (vocabulary-parallel cross-entropy) stay
  synchronous.

The result's value is the mean of the copies' losses (each copy a mean over
an equal share of the samples): the loss of the whole microbatch, so the
numerics are those of ``N`` microbatches of gradient accumulation. Where the
loss divides by a count of the batch (tokens a cross-entropy does not
ignore, a mask's sum: :mod:`autopar.compile.tokens`), each copy's loss is
weighted by its share of the count, run in the program on the copy's
inputs (:func:`counted_mean_of`), as one process divides by all of it.
Parameters and buffers are read once and shared by the copies.
``gm.meta["autopar_copy_of"]`` maps every copied node to the node of the
single-copy program (:func:`autopar.compile.regions.layer_regions` reads it
to put both copies of a layer into one region).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import CompileError
from ..runtime import collectives as C
from .rewrite import Comm

__all__ = ["apply_copies", "CommStart", "copy_input", "mean_of", "counted_mean_of"]


class CommStart(nn.Module):
    """Start of one collective (the ``Comm`` it splits) as a graph node: returns a
    :class:`~autopar.runtime.collectives.Flight`."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.kind, self.group, self.dim, self.dim2 = comm.kind, comm.group, comm.dim, comm.dim2

    def forward(self, x: torch.Tensor) -> C.Flight:
        return C.start(self.kind, x, self.dim, self.dim2, self.group)

    def extra_repr(self) -> str:
        return f"{self.kind}, dim={self.dim}"


def copy_input(x: Any, copy: int, copies: int) -> Any:
    """Copy ``copy``'s slice of the input ``x`` (dim 0 cut into ``copies``)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    if x.shape[0] % copies:
        raise CompileError(f"copies={copies}: an input of {x.shape[0]} samples (shape {tuple(x.shape)}) does not "
                           f"split into {copies} equal copies")
    k = x.shape[0] // copies
    return x.narrow(0, copy * k, k)


def mean_of(*losses: torch.Tensor) -> torch.Tensor:
    """The mean of the copies' losses."""
    return torch.stack(losses).mean() if losses[0].dim() == 0 else sum(losses) / len(losses)


def counted_mean_of(losses: tuple[torch.Tensor, ...], counts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The copies' losses, each a mean over its own count, as one mean over
    all of it: ``sum(loss_c * count_c) / sum(count_c)``. A copy that counts
    nothing (its loss 0/0) adds 0 and a zero gradient; where none counts
    anything the value is NaN, as one process's loss, with a zero gradient.
    In at least float32."""
    n = torch.stack([c.detach().to(torch.float32) for c in counts])    # in bf16 a count of 257 is 256
    parts = torch.stack(losses)
    total = n.sum()
    empty = total == 0
    summed = torch.where(n == 0, 0.0, parts * n).sum()
    return summed / torch.where(empty, 1.0, total) + torch.where(empty, math.nan, 0.0)


def _segments(body: list[fx.Node], comm: set[str], labels: dict[str, Any] | None) -> list[list[fx.Node]]:
    """``body`` cut after every collective and, with ``labels``, where the label changes."""
    out: list[list[fx.Node]] = [[]]
    for n in body:
        if labels is not None and out[-1] and labels.get(n.name) != labels.get(out[-1][-1].name):
            out.append([])
        out[-1].append(n)
        if n.name in comm:
            out.append([])
    return [s for s in out if s]


def apply_copies(gm: fx.GraphModule, copies: int, labels: dict[str, Any] | None = None,
                 counter: fx.GraphModule | None = None) -> fx.GraphModule:
    """``gm`` (the program of one copy) run as ``copies`` interleaved copies
    (module doc). ``labels``: node -> layer instance, to cut segments where
    the layer changes (needed when layer regions are built afterwards).
    ``counter``: what the loss divides by, a program of ``gm``'s inputs
    (:func:`autopar.compile.tokens.token_counter`): the copies' losses are
    weighted by it. Raises :class:`CompileError` when the program's value is
    not one tensor."""
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    if not isinstance(out_node.args[0], fx.Node):
        raise CompileError(f"copies={copies} needs a program whose value is the loss, one tensor; this one returns "
                           f"{out_node.args[0]!r}")
    comm = {n.name for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Comm)}
    for n in nodes:
        if n.name in comm and f"{n.target}_start" not in dict(gm.named_children()):
            gm.add_submodule(f"{n.target}_start", CommStart(gm.get_submodule(n.target)))
    new = fx.Graph()
    env: list[dict[str, fx.Node]] = [{} for _ in range(copies)]
    flights: list[dict[str, fx.Node]] = [{} for _ in range(copies)]
    copy_of: dict[str, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            ph = new.placeholder(n.name)
            for c in range(copies):
                env[c][n.name] = new.call_function(copy_input, (ph, c, copies), name=f"{n.name}_copy{c}")
        elif n.op == "get_attr":
            shared = new.get_attr(n.target)
            for c in range(copies):
                env[c][n.name] = shared

    def read(c: int, a: fx.Node) -> fx.Node:
        if a.name in flights[c]:      # the collective's result: wait for it here, just before its first reader
            env[c][a.name] = new.call_function(C.finish, (flights[c].pop(a.name),), name=f"{a.name}_wait{c}")
            copy_of[env[c][a.name].name] = a.name
        return env[c][a.name]

    body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    for seg in _segments(body, comm, labels):
        for c in range(copies):
            for n in seg:
                args = fx.map_arg(n.args, lambda a: read(c, a))
                kwargs = fx.map_arg(n.kwargs, lambda a: read(c, a))
                if n.name in comm:
                    x = new.create_node("call_module", f"{n.target}_start", args, name=f"{n.name}_start{c}")
                    flights[c][n.name] = x
                else:
                    x = env[c][n.name] = new.create_node(n.op, n.target, args, kwargs,
                                                         name=n.name if c == 0 else f"{n.name}_c{c}")
                copy_of[x.name] = n.name
    losses = tuple(read(c, out_node.args[0]) for c in range(copies))
    if counter is None:
        new.output(new.call_function(mean_of, losses))
    else:
        gm.add_submodule("autopar_token_counter", counter)
        inputs = [n.name for n in nodes if n.op == "placeholder"]
        counts = tuple(new.create_node("call_module", "autopar_token_counter", tuple(env[c][i] for i in inputs),
                                       name=f"autopar_count_c{c}") for c in range(copies))
        new.output(new.call_function(counted_mean_of, (losses, counts)))
    out = fx.GraphModule(gm, new, class_name="AutoparCopies")
    out.meta["autopar_copy_of"] = copy_of
    out.meta["autopar_copies"] = copies
    return out
