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

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..errors import CompileError
from ..graph import Graph
from ..runtime import collectives as C
from ..runtime import kernels as K
from ..sharding import AxisSharding, data_values, loss_denominator, needs_grad, selective_keeps
from ..spec.placement import P, R, local_chunk, shard_blocks
from ..strategies import is_shard, shard_dim
from ..strategies.redistribute import nested_moves, transition_steps
from .fx_utils import draws_random, eliminate_dead_code, get_attr


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
    def __init__(self, start: int, end: int, weight_first: bool, padding_idx: int | None = None,
                 vocab_size: int | None = None) -> None:
        super().__init__()
        self.start, self.end, self.weight_first = start, end, weight_first
        self.padding_idx, self.vocab_size = padding_idx, vocab_size

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ids, w = (b, a) if self.weight_first else (a, b)
        return K.vocab_parallel_embedding(ids, w, self.start, self.end, self.padding_idx, self.vocab_size)


def _padding_idx(fnode: fx.Node, weight_first: bool) -> int | None:
    """The padding row of an embedding node (``F.embedding(ids, w,
    padding_idx)``, or ATen's ``embedding(w, ids, padding_idx)`` where -1
    means none), None without one."""
    if weight_first:
        pad = fnode.args[2] if len(fnode.args) > 2 else fnode.kwargs.get("padding_idx", -1)
        return None if pad is None or pad == -1 else int(pad)
    pad = fnode.args[2] if len(fnode.args) > 2 else fnode.kwargs.get("padding_idx")
    return None if pad is None else int(pad)


class VocabCrossEntropy(nn.Module):
    def __init__(self, start: int, end: int, group: Any, ignore_index: int, reduction: str) -> None:
        super().__init__()
        self.start, self.end, self.group = start, end, group
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return K.vocab_parallel_cross_entropy(logits, target, self.start, self.end, self.group,
                                              self.ignore_index, self.reduction)


class CountedShare(nn.Module):
    """A token-mean loss split with its samples over tensor axes weighted by
    this rank's share of the counted targets
    (:func:`~autopar.runtime.kernels.counted_share`)."""

    def __init__(self, ignore_index: int, groups: Sequence[Any]) -> None:
        super().__init__()
        self.ignore_index, self.groups = ignore_index, list(groups)

    def forward(self, loss: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return K.counted_share(loss, target, self.ignore_index, weight, self.groups)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, axes={len(self.groups)}"


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


class RankStream(nn.Module):
    """One random op (dropout, ``randn_like``, ...) whose output the ranks of
    an axis split, run on a stream of this rank's own, as Megatron's
    model-parallel generator does: it draws a number from the stream every
    rank of the group shares (so they stay in step), seeds a forked generator
    with it and ``salt`` (this rank's coordinates on the splitting axes), and
    runs the op there. Without it every shard drew the same pattern (one
    dropout mask, one noise, repeated across the split dim). Recompute replays
    it: the shared stream is restored, so is the draw."""

    def __init__(self, op: str, target: Any, salt: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.op, self.target, self.salt = op, target, salt

    def forward(self, *args, **kwargs):
        seed = K.seed_of(int(torch.randint(0, 2 ** 62, (1,))), self.salt)
        cuda = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        with K.seeded(seed, cuda):
            if self.op == "call_method":
                return getattr(args[0], self.target)(*args[1:], **kwargs)
            return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{getattr(self.target, '__name__', self.target)}, salt={self.salt}"


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


def _size_read(fnode: fx.Node) -> tuple[str, int] | None:
    """``(value, d)`` when ``fnode`` reads size ``d`` of a value:
    ``aten.sym_size.int(v, d)``, ``v.size(d)``, and fx's ``v.shape[d]`` and
    ``v.size()[d]`` (a ``getitem`` of ``getattr(v, "shape")`` / ``v.size()``);
    else None."""
    args = fnode.args
    if fnode.target is torch.ops.aten.sym_size.int or (fnode.op == "call_method" and fnode.target == "size"):
        if len(args) >= 2 and isinstance(args[0], fx.Node) and isinstance(args[1], int):
            return args[0].name, args[1]
        return None
    if fnode.target is operator.getitem and len(args) == 2 and isinstance(args[0], fx.Node) \
            and isinstance(args[1], int):
        whole = args[0]
        if (whole.target is getattr and whole.args[1:] == ("shape",)) or \
                (whole.op == "call_method" and whole.target == "size" and len(whole.args) == 1):
            if isinstance(whole.args[0], fx.Node):
                return whole.args[0].name, args[1]
    return None


@dataclass
class LocalProgram:
    """This rank's program: the module and where each parameter came from."""

    module: fx.GraphModule
    param_placement: dict[str, str]      # param qualified name -> tp placement
    comms: int                           # collectives inserted
    row_placement: dict[str, str] = dataclasses.field(default_factory=dict)   # tp_mode=2d: on the grid's rows
    depth_placement: dict[str, str] = dataclasses.field(default_factory=dict)  # 2.5d, 3d: on the grid's depth
    keeps: frozenset = frozenset()       # nodes whose outputs selective recompute keeps (sharding.selective_keeps)


@dataclass(frozen=True)
class Axis:
    """One tensor axis of this rank's program: its decisions, this rank's
    coordinate on it and its process group. The graph's inputs arrive whole
    along every axis but one of ``inputs_split`` (the data-parallel ranks'
    own samples): one whose decisions split an input splits it first."""

    sh: AxisSharding
    rank: int
    group: Any
    whole_sizes: bool = False    # a size read off a value this axis splits is the whole one (x n)
    inputs_split: bool = False   # the inputs arrive as this rank's chunk of what the decisions split
    # the runtime reduces the weights' gradients over this axis (data parallelism): a value made from
    # weights alone reads no Megatron f (no gradient all-reduce) before split work
    weight_grads_outside: bool = False

    @property
    def n(self) -> int:
        return self.sh.n

    def out(self, name: str) -> str:
        return self.sh.out.get(name, R) if self.sh.n > 1 else R

    def strategy(self, name: str) -> Any:
        return self.sh.strategy.get(name) if self.sh.n > 1 else None


def _local_pieces(fnode: fx.Node, args: tuple, n: int) -> tuple:
    """The arguments of a split into equal pieces of a dim sharded ``n`` ways
    by blocks (``S(d,k)``: each rank holds its chunk of every piece): the
    piece sizes divided by ``n`` (``chunk`` cuts by count: unchanged)."""
    if "chunk" in str(getattr(fnode.target, "__name__", fnode.target)) or len(args) < 2:
        return args
    size = args[1]
    local = size // n if isinstance(size, int) else [s // n for s in size]
    return (args[0], local, *args[2:])


def own_chunk(x: torch.Tensor, n: int, rank: int, dim: int) -> torch.Tensor:
    """Chunk ``rank`` of ``n`` of ``x`` along ``dim``; its backward leaves the
    other chunks' gradient zero (this rank's part of a sum over the axis)."""
    return x.chunk(n, dim)[rank]


def _local_shape(shape: tuple[int, ...], placement: str, n: int) -> tuple[int, ...]:
    if is_shard(placement):
        d = shard_dim(placement)
        if shape[d] % n:
            raise CompileError(f"dim {d} of size {shape[d]} is not divisible by the tensor-parallel size {n}")
        return shape[:d] + (shape[d] // n,) + shape[d + 1:]
    return shape


def compile_local(graph: Graph, tp: AxisSharding, shapes: dict[str, tuple[int, ...] | None], *,
                  tp_rank: int, tp_group: Any, params: dict[str, torch.Tensor],
                  grid: Sequence[Axis] = (), batch_group: Any = None, batch: Axis | None = None) -> LocalProgram:
    """Build this rank's GraphModule.

    ``shapes`` are the node shapes local to the data-parallel axis (at the
    microbatch size the program will run with); ``params`` maps parameter /
    buffer qualified names to their full tensors (identical on every rank).
    ``grid``: with ``tp_mode=2d`` the grid's rows (with 2.5d and 3d its
    depth, then its rows), outermost first; ``tp`` then decides its columns. Each value
    is moved along every axis (splits outermost first, gathers innermost
    first where two axes split the same dim).
    ``batch_group``: the data-parallel group when it has several ranks; every
    training-mode batch norm then takes its statistics over the whole batch
    of that group (:class:`SyncBatchNorm`), so data parallelism computes what
    one process does on the global batch.
    ``batch``: the data-parallel axis, outermost, for a model whose samples
    meet (:func:`autopar.sharding.samples_meet`): its inputs arrive split, and
    the values its decisions gather are moved like any other axis's; then
    ``shapes`` are whole along it too.
    """
    if graph.gm is None:
        raise CompileError(f"graph {graph.name!r} has no program to compile (it was rebuilt from a summary)")
    axes = [*([batch] if batch is not None else []), *grid, Axis(tp, tp_rank, tp_group, whole_sizes=True)]
    rw = _Rewriter(graph, axes, shapes, params, batch_group)
    for fnode in graph.gm.graph.nodes:
        rw.node(fnode)
    gm = fx.GraphModule(rw.root, rw.new, class_name="AutoparLocal")
    eliminate_dead_code(gm)
    gm.recompile()
    return LocalProgram(module=gm, param_placement=rw.placement[-1], comms=rw.count,
                        row_placement=rw.placement[-2] if grid else {},
                        depth_placement=rw.placement[-3] if len(grid) > 1 else {},
                        keeps=selective_keeps(graph, tp))


class _Rewriter:
    """The state of one :func:`compile_local`: the new graph, its root
    module's attributes, and the values already moved (a transition several
    consumers read alike is inserted once)."""

    def __init__(self, graph: Graph, axes: list[Axis], shapes: dict, params: dict[str, torch.Tensor],
                 batch_group: Any = None) -> None:
        self.graph, self.axes, self.shapes, self.params = graph, axes, shapes, params
        self.batch_group = batch_group
        self.new = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.root: dict[str, Any] = {}
        self.placement: list[dict[str, str]] = [{} for _ in axes]
        self.grad = needs_grad(graph)
        self.from_data = data_values(graph)
        self.cache: dict[tuple, fx.Node] = {}
        self.count = 0

    def add_module(self, prefix: str, mod: nn.Module) -> str:
        name = f"_autopar_{prefix}_{self.count}"
        self.count += 1
        self.root[name] = mod
        return name

    def comm(self, x: fx.Node, ax: Axis, kind: str, dim: int = 0, dim2: int = 0) -> fx.Node:
        return self.new.call_module(self.add_module(kind, Comm(kind, ax.group, dim, dim2)), (x,))

    def reshard(self, name: str, wants: tuple[str, ...], splits: tuple[bool, ...]) -> fx.Node:
        """``name``'s value as the consumer reads it: per axis the steps of the
        redistribution table, one Comm module each (shared by the consumers
        that read it alike)."""
        g = self.grad.get(name, False)
        weights_only = name not in self.from_data
        if weights_only:
            splits = tuple(s and not ax.weight_grads_outside for ax, s in zip(self.axes, splits))
        key = (name, wants, tuple(s and g and w == R and ax.n > 1 for ax, w, s in zip(self.axes, wants, splits)))
        if key in self.cache:
            return self.cache[key]
        haves = [ax.out(name) for ax in self.axes]
        x = self.env[name]
        for ax, have, want, split in self._order(name, haves, wants, splits):
            try:
                steps = transition_steps(have, want, g and ax.n > 1, split)
            except CompileError as e:
                raise CompileError(f"{name}: {e}") from None
            for step in steps:
                if step.kind == "split" and weights_only and ax.weight_grads_outside:
                    # a value of the weights alone: its gradient stays this rank's part, which the
                    # runtime sums with the other ranks' (a split's backward would gather it whole)
                    x = self._inserted(own_chunk, (x, ax.n, ax.rank, *step.dims), f"{name}_own")
                else:
                    x = self.comm(x, ax, step.kind, *step.dims)
        self.cache[key] = x
        return x

    def _order(self, name: str, haves: list[str], wants: tuple[str, ...], splits: tuple[bool, ...]) -> list:
        """The axes in the order ``name`` moves along them: outermost first,
        but innermost first when an axis gathers a dim another axis splits too
        (the chunks of a dim split twice are ordered outer axis first).
        Raises :class:`CompileError` when axes sharing a dim move it both ways."""
        how = nested_moves(haves, wants)
        if how is None:
            raise CompileError(f"{name}: tensor axes sharing a dim move it unlike ({haves} -> {list(wants)})")
        order = list(zip(self.axes, haves, wants, splits))
        return order[::-1] if how == "inner first" else order

    def node(self, fnode: fx.Node) -> None:
        if fnode.op == "placeholder":
            x = self.new.placeholder(fnode.name)
            for ax in self.axes:      # inputs arrive whole: an axis that splits one takes its chunk
                if is_shard(ax.out(fnode.name)) and not ax.inputs_split:
                    x = self.comm(x, ax, "split", shard_dim(ax.out(fnode.name)))
            self.env[fnode.name] = x
        elif fnode.op == "get_attr":
            self.state(fnode)
        elif fnode.op == "output":
            self.output(fnode)
        else:
            self.op(fnode)

    def state(self, fnode: fx.Node) -> None:
        """A parameter, buffer or constant: this rank's chunk of it on every axis."""
        t = self.params.get(fnode.target)
        if t is None:   # a constant tensor the tracer kept
            t = get_attr(self.graph.gm, fnode.target)
        local = t.detach() if isinstance(t, torch.Tensor) else t
        for ax, placement in zip(self.axes, self.placement):
            p = ax.out(fnode.name)
            if is_shard(p) and isinstance(t, torch.Tensor):
                local = local_chunk(local, shard_dim(p), ax.n, ax.rank, shard_blocks(p))
            placement[fnode.target] = p
        if isinstance(t, nn.Parameter):
            local = nn.Parameter(local.clone().contiguous(), requires_grad=t.requires_grad)
        elif isinstance(t, torch.Tensor):
            local = local.clone().contiguous()
        self.root[fnode.target] = local
        self.env[fnode.name] = self.new.get_attr(fnode.target)

    def output(self, fnode: fx.Node) -> None:
        out = fnode.args[0]
        name = out.name if isinstance(out, fx.Node) else None
        if name is None:
            self.new.output(fx.map_arg(out, lambda a: self.env[a.name]))
            return
        x = self.env[name]
        for ax in reversed(self.axes):
            p = ax.out(name)
            if p == P:
                x = self.comm(x, ax, "all_reduce")
            elif is_shard(p):
                x = self.comm(x, ax, "all_gather", shard_dim(p))
        self.new.output(x)

    def op(self, fnode: fx.Node) -> None:
        graph, env = self.graph, self.env
        nd = graph[fnode.name] if fnode.name in graph else None
        sts = [ax.strategy(fnode.name) for ax in self.axes]
        remap: dict[str, fx.Node] = {}
        if nd is not None and any(st is not None for st in sts):
            reads = [st.ins if st is not None else tuple(ax.out(i) for i in nd.inputs)
                     for ax, st in zip(self.axes, sts)]
            splits = tuple(st is not None and st.split for st in sts)
            for k, i in enumerate(nd.inputs):
                remap.setdefault(i, self.reshard(i, tuple(r[k] for r in reads), splits))
        kernel = next(((ax, st) for ax, st in zip(self.axes, sts) if st is not None and st.kernel), None)
        if kernel is not None:
            env[fnode.name] = self.kernel(nd, *kernel, remap, fnode)
            return
        args = fx.map_arg(fnode.args, lambda a: remap.get(a.name, env[a.name]))
        kwargs = fx.map_arg(fnode.kwargs, lambda a: remap.get(a.name, env[a.name]))
        op, target = fnode.op, fnode.target
        blocked = [ax.n for ax, st in zip(self.axes, sts) if st is not None and st.name == "blocks"]
        if blocked and nd is not None and nd.kind == "split":
            args = _local_pieces(fnode, args, math.prod(blocked))
        info = ops.op_info(target if op == "call_function" else str(target)) \
            if op in ("call_function", "call_method") and nd is not None and nd.out is not None else None
        if info is not None and info.shape_arg is not None:
            shape = self.shapes.get(fnode.name)
            if shape is not None:
                # the traced sizes (symbolic ones included) become this rank's local sizes
                local = tuple(shape)
                for ax in self.axes:
                    local = _local_shape(local, ax.out(fnode.name), ax.n)
                if "expand" in getattr(target, "__name__", str(target)):
                    local = _keep_runtime_sizes(local, args[info.shape_arg:], nd.out.shape)
                args = (*args[:info.shape_arg], local)
                kwargs = {}
        bn = _batch_norm_args(fnode) if self.batch_group is not None and nd is not None and \
            nd.kind == "batchnorm" else None
        if bn is not None:
            # another name than the traced node's: stage cutting and regions place it by its first user
            env[fnode.name] = self.new.call_module(
                self.add_module("sync_bn", SyncBatchNorm(bn[5], bn[6], self.batch_group)),
                fx.map_arg(bn[:5], lambda a: remap.get(a.name, env[a.name])))
            return
        if op == "call_module":
            self.root[target] = graph.gm.get_submodule(target)
        salt = tuple((i, ax.rank) for i, ax in enumerate(self.axes) if ax.n > 1 and is_shard(ax.out(fnode.name)))
        if salt and op != "call_module" and draws_random(fnode, graph.gm):     # each shard draws its own
            op, target = "call_module", self.add_module("rank_stream", RankStream(op, target, salt))
        x = self.new.create_node(op, target, args, kwargs, name=fnode.name)
        env[fnode.name] = self._loss_parts(nd, self.whole_size(fnode, x), self.axes, remap)

    def _loss_parts(self, nd: Any, x: fx.Node, axes: Sequence[Axis], remap: dict[str, fx.Node]) -> fx.Node:
        """``x``, the value of ``nd`` on the ``axes`` that ran it split with
        the samples, as this rank's part of the whole value: times the
        strategies' ``scale`` (``1/n`` of a mean over the samples), or for
        the loss's token mean (:func:`~autopar.sharding.loss_denominator`)
        times this rank's share of the counted targets (:class:`CountedShare`):
        the parts' token counts differ where targets are ignored."""
        sts = [(ax, ax.strategy(nd.name)) for ax in axes] if nd is not None else []
        den = loss_denominator(self.graph) if nd is not None and nd.kind in ("cross_entropy", "nll_loss") else None
        counted = [ax for ax, st in sts if st is not None and st.name == "batch"] \
            if den is not None and den[:2] == ("tokens", nd.name) else []
        scale = math.prod(st.scale for ax, st in sts if st is not None and ax not in counted)
        if scale != 1.0:
            x = self._inserted(operator.mul, (x, scale), f"{nd.name}_scaled")
        if counted:
            mod = self.add_module("counted_share", CountedShare(den[2], [ax.group for ax in counted]))
            ins = [remap.get(i, self.env[i]) for i in nd.inputs[1:3]]
            x = self.new.create_node("call_module", mod, (x, *ins), name=f"autopar_{nd.name}_counted")
        return x

    def _inserted(self, target: Any, args: tuple, name: str) -> fx.Node:
        """A node the compiler adds, named apart from every traced node: fx
        would name it after its target (``mul_5``), and a traced node made
        later would lose that name, which stage cutting and layer regions
        find nodes by."""
        return self.new.create_node("call_function", target, args, name=f"autopar_{name}")

    def whole_size(self, fnode: fx.Node, x: fx.Node) -> fx.Node:
        """``x``, or for a size read off dim ``d`` of a value an axis with
        ``whole_sizes`` splits on ``d`` (:func:`_size_read`), that size times
        the axis's size: the batch a grid's rows split stays the whole one in
        sizes (``arange(B)`` positions, timm's ``cls_token.expand(x.shape[0],
        ...)``), as the placements of the values made from it say."""
        read = _size_read(fnode)
        if read is None:
            return x
        src, d = read
        for ax in self.axes:
            p = ax.out(src)
            if ax.whole_sizes and is_shard(p) and (shard_dim(p) == d or (d < 0 and self._rank_of(src) + d ==
                                                                          shard_dim(p))):
                x = self._inserted(operator.mul, (x, ax.n), f"{fnode.name}_whole")
        return x

    def _rank_of(self, name: str) -> int:
        nd = self.graph[name] if name in self.graph else None
        return len(nd.out.shape) if nd is not None and nd.out is not None else 0

    def kernel(self, nd: Any, ax: Axis, st: Any, remap: dict[str, fx.Node], fnode: fx.Node) -> fx.Node:
        """The vocabulary-parallel kernel ``st`` names, over ``ax``."""
        graph, n = self.graph, ax.n
        if st.kernel == "vocab_embedding":
            wi = 0 if graph[nd.inputs[0]].kind in ("param", "buffer") else 1
            vocab = graph[nd.inputs[wi]].out.shape[0]
            per = vocab // n
            # the padding row takes no gradient (BERT's pad token): before, the kernel gave it one
            mod = self.add_module("vocab_embedding", VocabEmbedding(ax.rank * per, (ax.rank + 1) * per, wi == 0,
                                                                    _padding_idx(fnode, wi == 0), vocab))
            return self.new.call_module(mod, tuple(remap.get(i, self.env[i]) for i in nd.inputs))
        if st.kernel == "vocab_cross_entropy":
            per = graph[nd.inputs[0]].out.shape[1] // n
            mod = self.add_module("vocab_ce", VocabCrossEntropy(
                ax.rank * per, (ax.rank + 1) * per, ax.group, int(nd.attrs.get("ignore_index", -100)),
                str(nd.attrs.get("reduction", "mean"))))
            x = self.new.call_module(mod, (remap[nd.inputs[0]], remap[nd.inputs[1]]))
            return self._loss_parts(nd, x, [a for a in self.axes if a is not ax], remap)
        raise CompileError(f"{nd.name}: unknown kernel {st.kernel!r}")
