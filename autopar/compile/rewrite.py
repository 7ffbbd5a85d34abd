"""Rewrite the traced fx graph into this rank's program.

Input: the traced :class:`~autopar.graph.Graph` (its fx ``GraphModule`` with
global shapes), the decisions of the tensor-parallel axis and of the batch
(data-parallel) axis, and this rank's coordinates. Output: a ``GraphModule``
whose parameters are this rank's shards and whose graph contains, between
ops whose placements disagree, explicit autograd-aware collectives
(:mod:`autopar.runtime.collectives`):

==========  ===========  ===================================
have        want         inserted (forward / backward)
==========  ===========  ===================================
P           R            all_reduce / identity
S(d)        R            all_gather(d) / take own chunk
R           S(d)         take own chunk / all_gather(d)
P           S(d)         reduce_scatter(d) / all_gather(d)
S(d)        S(e)         all_to_all / all_to_all
R -> split work          reduce_grad: identity / all_reduce
==========  ===========  ===================================

Shape arguments of views (``view``, ``reshape``, ``expand``, ...) are
replaced by the local shapes the plan implies, so a model never written for
tensor parallelism (``x.view(B, T, n_head, C // n_head)`` with the global
``n_head``) runs on its shards. Nothing here knows a model class: only op
families and placements.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..errors import CompileError
from ..graph import Graph
from ..runtime import collectives as C
from ..runtime import kernels as K
from ..sharding import AxisSharding, needs_grad
from ..spec.placement import P, R
from ..strategies import is_shard, shard_dim
from ..strategies.redistribute import transition_steps
from .fx_utils import get_attr


class Comm(nn.Module):
    """One collective on the tensor-parallel group, as a graph node."""

    def __init__(self, kind: str, group: Any, dim: int = 0, dim2: int = 0) -> None:
        super().__init__()
        self.kind, self.group, self.dim, self.dim2 = kind, group, dim, dim2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "all_reduce":
            return C.all_reduce(x, self.group)
        if k == "reduce_grad":
            return C.reduce_grad(x, self.group)
        if k == "all_gather":
            return C.all_gather(x, self.dim, self.group)
        if k == "all_gather_reduce_grad":
            return C.all_gather_reduce_grad(x, self.dim, self.group)
        if k == "split":
            return C.split(x, self.dim, self.group)
        if k == "reduce_scatter":
            return C.reduce_scatter(x, self.dim, self.group)
        if k == "all_to_all":
            return C.all_to_all(x, in_dim=self.dim, out_dim=self.dim2, group=self.group)
        raise CompileError(f"unknown collective {k!r}")

    def extra_repr(self) -> str:
        return f"{self.kind}, dim={self.dim}" + (f"->{self.dim2}" if self.kind == "all_to_all" else "")


class VocabEmbedding(nn.Module):
    def __init__(self, start: int, end: int, weight_first: bool) -> None:
        super().__init__()
        self.start, self.end, self.weight_first = start, end, weight_first

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ids, w = (b, a) if self.weight_first else (a, b)
        return K.vocab_parallel_embedding(ids, w, self.start, self.end)


class VocabCrossEntropy(nn.Module):
    def __init__(self, start: int, end: int, group: Any, ignore_index: int, reduction: str) -> None:
        super().__init__()
        self.start, self.end, self.group = start, end, group
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return K.vocab_parallel_cross_entropy(logits, target, self.start, self.end, self.group,
                                              self.ignore_index, self.reduction)


class SyncBatchNorm(nn.Module):
    """Training-mode batch norm with statistics over the data-parallel group
    (:func:`~autopar.runtime.kernels.sync_batch_norm`)."""

    def __init__(self, momentum: float, eps: float, group: Any) -> None:
        super().__init__()
        self.momentum, self.eps, self.group = momentum, eps, group

    def forward(self, x, running_mean, running_var, weight, bias):
        return K.sync_batch_norm(x, running_mean, running_var, weight, bias, self.momentum, self.eps, self.group)

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}, eps={self.eps}"


def _batch_norm_args(fnode: fx.Node) -> tuple | None:
    """``(x, running_mean, running_var, weight, bias, momentum, eps)`` of a
    training-mode ``F.batch_norm`` / ``aten.batch_norm`` node, else None."""
    t = fnode.target
    name = getattr(t, "__name__", str(t))
    if fnode.op != "call_function" or name not in ("batch_norm", "batch_norm.default"):
        return None
    if t is torch.nn.functional.batch_norm:
        keys = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    else:   # aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
        keys = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        defaults = {}
    a = {**defaults, **dict(zip(keys, fnode.args)), **fnode.kwargs}
    if not all(k in a for k in keys) or a["training"] is not True:
        return None
    return (a["input"], a["running_mean"], a["running_var"], a["weight"], a["bias"], float(a["momentum"]),
            float(a["eps"]))


def _keep_runtime_sizes(local: tuple[int, ...], given: tuple, traced: tuple[int, ...]) -> tuple:
    """An ``expand``'s local sizes, keeping a size the program computes at run
    time (an fx node: ``x.shape[0]``) where the analysis left the traced size
    as it was: there the runtime value is this rank's own (timm's
    ``cls_token.expand(x.shape[0], -1, -1)``, whose batch dim the batch
    analysis of an fx graph cannot see, reads the local batch). Only for
    ``expand``: a view's runtime sizes may be read off a tensor of another
    placement (a size computed from a sharded value), so views take the
    analysis' local sizes."""
    sizes = given[0] if len(given) == 1 and isinstance(given[0], (tuple, list)) else given
    if len(sizes) != len(local) or len(traced) != len(local):
        return local
    return tuple(g if isinstance(g, fx.Node) and loc == t else loc for loc, g, t in zip(local, sizes, traced))


@dataclass
class LocalProgram:
    """This rank's program: the module and where each parameter came from."""

    module: fx.GraphModule
    param_placement: dict[str, str]      # param qualified name -> tp placement
    comms: int                           # collectives inserted




def _local_shape(shape: tuple[int, ...], placement: str, n: int) -> tuple[int, ...]:
    if is_shard(placement):
        d = shard_dim(placement)
        if shape[d] % n:
            raise CompileError(f"dim {d} of size {shape[d]} is not divisible by the tensor-parallel size {n}")
        return shape[:d] + (shape[d] // n,) + shape[d + 1:]
    return shape


def compile_local(graph: Graph, tp: AxisSharding, shapes: dict[str, tuple[int, ...] | None], *,
                  tp_rank: int, tp_group: Any, params: dict[str, torch.Tensor],
                  batch_group: Any = None) -> LocalProgram:
    """Build this rank's GraphModule.

    ``shapes`` are the node shapes local to the data-parallel axis (at the
    microbatch size the program will run with); ``params`` maps parameter /
    buffer qualified names to their full tensors (identical on every rank).
    ``batch_group``: the data-parallel group when it has several ranks; every
    training-mode batch norm then takes its statistics over the whole batch
    of that group (:class:`SyncBatchNorm`), so data parallelism computes what
    one process does on the global batch.
    """
    if graph.gm is None:
        raise CompileError(f"graph {graph.name!r} has no program to compile (it was rebuilt from a summary)")
    n = tp.n
    src = graph.gm.graph
    new = fx.Graph()
    env: dict[str, fx.Node] = {}
    root: dict[str, Any] = {}
    param_placement: dict[str, str] = {}
    grad = needs_grad(graph)
    reshard_cache: dict[tuple[str, str, bool], fx.Node] = {}
    counter = {"comm": 0}

    def add_module(prefix: str, mod: nn.Module) -> str:
        name = f"_autopar_{prefix}_{counter['comm']}"
        counter["comm"] += 1
        root[name] = mod
        return name

    def comm(x: fx.Node, kind: str, dim: int = 0, dim2: int = 0) -> fx.Node:
        return new.call_module(add_module(kind, Comm(kind, tp_group, dim, dim2)), (x,))

    def reshard(name: str, want: str, into_split: bool) -> fx.Node:
        """``name``'s value as the consumer reads it: the steps of the
        redistribution table, one Comm module each (shared by the consumers
        that read it alike)."""
        have = tp.out.get(name, R)
        g = grad.get(name, False) and into_split and want == R and n > 1
        key = (name, want, g)
        if key in reshard_cache:
            return reshard_cache[key]
        try:
            steps = transition_steps(have, want, grad.get(name, False) and n > 1, into_split)
        except CompileError as e:
            raise CompileError(f"{name}: {e}") from None
        x = env[name]
        for step in steps:
            x = comm(x, step.kind, *step.dims)
        reshard_cache[key] = x
        return x

    fx_nodes = {nd.name: nd for nd in src.nodes}
    for fnode in src.nodes:
        nd = graph[fnode.name] if fnode.name in graph else None
        if fnode.op == "placeholder":
            env[fnode.name] = new.placeholder(fnode.name)
            continue
        if fnode.op == "get_attr":
            t = params.get(fnode.target)
            if t is None:   # a constant tensor the tracer kept
                t = get_attr(graph.gm, fnode.target)
            p = tp.out.get(fnode.name, R) if n > 1 else R
            local = t.detach()
            if is_shard(p) and isinstance(t, torch.Tensor):
                local = t.detach().chunk(n, dim=shard_dim(p))[tp_rank]
            if isinstance(t, nn.Parameter):
                local = nn.Parameter(local.clone().contiguous(), requires_grad=t.requires_grad)
            elif isinstance(t, torch.Tensor):
                local = local.clone().contiguous()
            root[fnode.target] = local
            param_placement[fnode.target] = p
            env[fnode.name] = new.get_attr(fnode.target)
            continue
        if fnode.op == "output":
            out = fnode.args[0]
            name = out.name if isinstance(out, fx.Node) else None
            if name is not None and tp.out.get(name, R) == P:
                x = comm(env[name], "all_reduce")
            elif name is not None and is_shard(tp.out.get(name, R)):
                x = comm(env[name], "all_gather", shard_dim(tp.out[name]))
            else:
                x = fx.map_arg(out, lambda a: env[a.name])
            new.output(x)
            continue
        st = tp.strategy.get(fnode.name) if n > 1 else None
        # inputs: reshard each tensor input to what the strategy wants
        remap: dict[str, fx.Node] = {}
        if st is not None and nd is not None:
            for i, want in zip(nd.inputs, st.ins):
                remap.setdefault(i, reshard(i, want, st.split))
        args = fx.map_arg(fnode.args, lambda a: remap.get(a.name, env[a.name]))
        kwargs = fx.map_arg(fnode.kwargs, lambda a: remap.get(a.name, env[a.name]))
        target = fnode.target
        op = fnode.op
        if st is not None and st.kernel == "vocab_embedding":
            wi = 0 if graph[nd.inputs[0]].kind in ("param", "buffer") else 1
            V = graph[nd.inputs[wi]].out.shape[0]
            per = V // n
            mod = add_module("vocab_embedding", VocabEmbedding(tp_rank * per, (tp_rank + 1) * per, wi == 0))
            a = [remap.get(i, env[i]) for i in nd.inputs]
            env[fnode.name] = new.call_module(mod, tuple(a))
            continue
        if st is not None and st.kernel == "vocab_cross_entropy":
            V = graph[nd.inputs[0]].out.shape[1]
            per = V // n
            mod = add_module("vocab_ce", VocabCrossEntropy(
                tp_rank * per, (tp_rank + 1) * per, tp_group, int(nd.attrs.get("ignore_index", -100)),
                str(nd.attrs.get("reduction", "mean"))))
            env[fnode.name] = new.call_module(mod, (remap[nd.inputs[0]], remap[nd.inputs[1]]))
            continue
        info = ops.op_info(fnode.target if op == "call_function" else str(fnode.target)) \
            if op in ("call_function", "call_method") and nd is not None and nd.out is not None else None
        if info is not None and info.shape_arg is not None:
            shape = shapes.get(fnode.name)
            if shape is not None:
                # the traced sizes (symbolic ones included) become this rank's local sizes
                local = _local_shape(tuple(shape), tp.out.get(fnode.name, R) if n > 1 else R, n)
                given = args[info.shape_arg:]
                if "expand" in getattr(fnode.target, "__name__", str(fnode.target)):
                    local = _keep_runtime_sizes(tuple(local), given, nd.out.shape)
                args = (*args[:info.shape_arg], tuple(local))
                kwargs = {}
        bn = _batch_norm_args(fnode) if batch_group is not None and nd is not None and \
            nd.kind == "batchnorm" else None
        if bn is not None:
            # another name than the traced node's: stage cutting and regions place it by its first user
            x = new.call_module(add_module("sync_bn", SyncBatchNorm(bn[5], bn[6], batch_group)),
                                fx.map_arg(bn[:5], lambda a: remap.get(a.name, env[a.name])))
            env[fnode.name] = x
            continue
        if op == "call_module":
            root[target] = graph.gm.get_submodule(target)
        x = new.create_node(op, target, args, kwargs, name=fnode.name)
        if st is not None and st.scale != 1.0:
            x = new.call_function(operator.mul, (x, st.scale))
        env[fnode.name] = x
    gm = fx.GraphModule(root, new, class_name="AutoparLocal")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    del fx_nodes
    return LocalProgram(module=gm, param_placement=param_placement, comms=counter["comm"])
