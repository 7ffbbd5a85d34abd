"""Autograd-aware collectives that move a tensor between placements.

Placements on one mesh axis: R (full copy), S(d) (this rank's contiguous chunk
along dim d, chunks in group-rank order) and P (partial sums; the value is the
sum over the group). Gradient conventions, which make tensor parallelism
correct: the grad of an R value is the full gradient (identical on all ranks),
the grad of an S(d) value is the shard of the gradient, and the grad of a P
value is the full gradient (identical on all ranks).

===============================  ============  ======================  ======================
function                         placement     forward                 backward
===============================  ============  ======================  ======================
all_reduce(x, g)                 P -> R        sum all-reduce          identity
reduce_grad(x, g)                R -> R        identity                sum all-reduce
all_gather(x, d, g)              S(d) -> R     all-gather along d      take own chunk
split(x, d, g)                   R -> S(d)     take own chunk          all-gather along d
reduce_scatter(x, d, g)          P -> S(d)     reduce-scatter along d  all-gather along d
all_to_all(x, i, o, g)           S(i) -> S(o)  all-to-all              inverse all-to-all
all_gather_reduce_grad(x, d, g)  S(d) -> R     all-gather along d      reduce-scatter along d
                                                                       (+ all-gather again)
===============================  ============  ======================  ======================

``reduce_grad`` is Megatron's "f": put it on a replicated input before
sharded compute whose output grads are partial per rank.
``all_gather_reduce_grad`` is ``reduce_grad(all_gather(x))`` fused (the
sequence-parallel entry): its backward reduce-scatters instead of
all-reducing then slicing, half the traffic. Its readers save the shard, not
the gathered tensor, and gather it again in backward (:mod:`.regather`).

Every function is the identity when ``group`` is None or has one rank.
Sharded dims must divide evenly by the group size. Works with gloo and nccl.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from autopar.errors import DistributedError

from . import regather

__all__ = ["start", "finish", "Flight", "all_reduce", "reduce_grad", "all_gather", "split", "reduce_scatter", "all_to_all",
           "all_gather_reduce_grad",
           "all_reduce_mean_", "GradSync", "broadcast_params_", "group_size", "group_rank"]

# Newer torch renamed these (the old names warn with a FutureWarning).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    """Ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _chunk_size(x: torch.Tensor, dim: int, w: int, what: str) -> int:
    if x.shape[dim] % w:
        raise DistributedError(
            f"{what}: dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"which is not divisible by the group size {w}")
    return x.shape[dim] // w


def _merge_leading(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(w, *s) -> s with s[dim] replaced by w * s[dim] (concatenate the w slabs along dim).
    Contiguous: where ``s[dim]`` is 1 the reshape is a view whose strides a
    later ``view`` cannot merge (a dim split on two mesh axes, one rank's share 1)."""
    s = t.shape[1:]
    return t.movedim(0, dim).reshape(*s[:dim], t.shape[0] * s[dim], *s[dim + 1:]).contiguous()


class Pending:
    """A collective that may still be in flight: :meth:`wait` gives its result
    (``work`` None: done already)."""

    __slots__ = ("work", "finish")

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor]) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.finish()


def _start_gather(x: torch.Tensor, dim: int, group, async_op: bool = False) -> Pending:
    w = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((w * x.shape[0], *x.shape[1:]))  # gloo: only the concat-along-dim-0 layout
    work = _all_gather_single(out, x, group=group, async_op=async_op)
    return Pending(work, lambda: _merge_leading(out.view(w, *x.shape), dim))


def _start_take(x: torch.Tensor, dim: int, group, async_op: bool = False) -> Pending:
    c = _chunk_size(x, dim, dist.get_world_size(group), "split")
    out = x.narrow(dim, dist.get_rank(group) * c, c).clone(memory_format=torch.contiguous_format)
    return Pending(None, lambda: out)


def _start_reduce_scatter(x: torch.Tensor, dim: int, group, async_op: bool = False) -> Pending:
    c = _chunk_size(x, dim, dist.get_world_size(group), "reduce_scatter")
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((c, *xt.shape[1:]))
    work = _reduce_scatter_single(out, xt, group=group, async_op=async_op)
    return Pending(work, lambda: out.movedim(0, dim).contiguous())


def _start_all_reduce(x: torch.Tensor, dim: int, group, async_op: bool = False) -> Pending:
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=group, async_op=async_op)
    return Pending(work, lambda: out)


def _start_all_to_all(x: torch.Tensor, in_dim: int, out_dim: int, group, async_op: bool = False) -> Pending:
    w = dist.get_world_size(group)
    _chunk_size(x, out_dim, w, "all_to_all")
    # send[j]: my in_dim shard of rank j's out_dim chunk (stacking keeps a channels-last
    # input's strides, and the collectives take dense buffers only)
    send = torch.stack(x.chunk(w, out_dim)).contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return Pending(work, lambda: _merge_leading(recv, in_dim))  # recv[i]: rank i's in_dim shard of my chunk


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _start_gather(x, dim, group).wait()


def _take(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _start_take(x, dim, group).wait()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return _start_reduce_scatter(x, dim, group).wait()


def _all_to_all(x: torch.Tensor, in_dim: int, out_dim: int, group) -> torch.Tensor:
    return _start_all_to_all(x, in_dim, out_dim, group).wait()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _start_all_reduce(x, 0, group).wait()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _start_all_reduce(g, 0, ctx.group).wait(), None


def _dim_collective(name: str, forward, backward) -> type:
    """An autograd Function ``(x, dim, group)`` whose forward runs
    ``forward(x, dim, group)`` and whose backward runs ``backward(g, dim, group)``."""
    def fwd(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return forward(x, dim, group)

    def bwd(ctx, g):
        return backward(g, ctx.dim, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_AllGather = _dim_collective("_AllGather", _gather, _take)                    # S(d) -> R
_Split = _dim_collective("_Split", _take, _gather)                            # R -> S(d)
_ReduceScatter = _dim_collective("_ReduceScatter", _reduce_scatter, _gather)  # P -> S(d)


def _gather_keep_shard(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """:func:`_gather`, whose readers keep ``x`` for backward instead (:mod:`.regather`)."""
    full = _gather(x, dim, group)
    regather.register(full, x, lambda t: _gather(t, dim, group))
    return full


_AllGatherReduceGrad = _dim_collective("_AllGatherReduceGrad", _gather_keep_shard, _reduce_scatter)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_dim, out_dim, group):
        ctx.dims, ctx.group = (in_dim, out_dim), group
        return _all_to_all(x, in_dim, out_dim, group)

    @staticmethod
    def backward(ctx, g):
        in_dim, out_dim = ctx.dims
        return _all_to_all(g, out_dim, in_dim, ctx.group), None, None, None


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise DistributedError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """P -> R: sum over the group. Backward: identity."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group)


def reduce_grad(x: torch.Tensor, group) -> torch.Tensor:
    """R -> R feeding sharded compute: identity forward; backward sums the grad over the group.

    The output aliases ``x`` (no copy), so it must not be modified in place.
    """
    return x if group_size(group) == 1 else _ReduceGrad.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """S(dim) -> R: concatenate the group's shards along ``dim``. Backward: own chunk of the grad."""
    return x if group_size(group) == 1 else _AllGather.apply(x, _norm_dim(x, dim), group)


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """R -> S(dim): this rank's chunk along ``dim``. Backward: all-gather of the grad."""
    return x if group_size(group) == 1 else _Split.apply(x, _norm_dim(x, dim), group)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """P -> S(dim): sum over the group, keep this rank's chunk along ``dim``. Backward: all-gather."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, _norm_dim(x, dim), group)


def all_gather_reduce_grad(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """S(dim) -> R feeding sharded compute: all-gather forward, reduce-scatter backward.

    Same result as ``reduce_grad(all_gather(x, dim, group), group)`` in one collective each way.
    """
    return x if group_size(group) == 1 else _AllGatherReduceGrad.apply(x, _norm_dim(x, dim), group)


def all_to_all(x: torch.Tensor, in_dim: int, out_dim: int, group) -> torch.Tensor:
    """S(in_dim) -> S(out_dim): input sharded on ``in_dim``, output sharded on ``out_dim``.

    Each rank splits its shard into group-size chunks along ``out_dim``, sends
    chunk j to rank j, and concatenates what it receives along ``in_dim`` (in
    the classic naming: split_dim = out_dim, concat_dim = in_dim). Backward:
    the inverse all-to-all. Identity when ``in_dim == out_dim``.
    """
    if group_size(group) == 1:
        return x
    in_dim, out_dim = _norm_dim(x, in_dim), _norm_dim(x, out_dim)
    return x if in_dim == out_dim else _AllToAll.apply(x, in_dim, out_dim, group)


# ------------------------------------------------- split collectives (multi-copy)

def _identity(x: torch.Tensor, group, async_op: bool) -> Pending:
    return Pending(None, lambda: x)


def _directions(kind: str, dim: int, dim2: int) -> tuple[Callable, Callable]:
    """The forward and the backward of the compiler's collective ``kind`` (the
    table above), each ``(x, group, async_op) -> Pending``."""
    def gather(x, g, a): return _start_gather(x, dim, g, a)
    def take(x, g, a): return _start_take(x, dim, g, a)
    def rs(x, g, a): return _start_reduce_scatter(x, dim, g, a)
    def ar(x, g, a): return _start_all_reduce(x, 0, g, a)
    def a2a(x, g, a): return _start_all_to_all(x, dim, dim2, g, a)
    def a2a_back(x, g, a): return _start_all_to_all(x, dim2, dim, g, a)
    table = {"all_reduce": (ar, _identity), "reduce_grad": (_identity, ar), "all_gather": (gather, take),
             "split": (take, gather), "reduce_scatter": (rs, gather), "all_gather_reduce_grad": (gather, rs),
             "all_to_all": (a2a, a2a_back)}
    if kind not in table:
        raise DistributedError(f"unknown collective {kind!r}")
    return table[kind]


class Flight:
    """One collective split into :func:`start` and :func:`finish`, so that
    other work runs while it is in flight, forward and backward: the
    backward's collective starts where the forward's ended (``finish``'s
    backward) and is waited for where the forward's started (``start``'s
    backward). It holds no tensor once waited for."""

    __slots__ = ("forward", "backward", "group", "fwd", "bwd", "token", "value", "regather", "local")

    def __init__(self, kind: str, dim: int, dim2: int, group) -> None:
        self.forward, self.backward = _directions(kind, dim, dim2)
        self.group, self.fwd, self.bwd, self.token, self.value = group, None, None, None, None
        # the sequence-parallel entry: its readers keep the shard (:mod:`.regather`), as in the sync path
        self.regather = (lambda t: _gather(t, dim, group)) if kind == "all_gather_reduce_grad" else None
        self.local = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        flight.fwd = flight.forward(x, flight.group, True)
        if flight.regather is not None:
            flight.local = x.detach()
        return x.new_empty(0)          # the token carrying the autograd edge to finish

    @staticmethod
    def backward(ctx, _):
        f = ctx.flight
        g, f.bwd = f.bwd.wait(), None
        return g, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, flight):
        ctx.flight = flight
        out, flight.fwd = flight.fwd.wait(), None
        if flight.regather is not None:
            regather.register(out, flight.local, flight.regather)
            flight.local = None
        return out.detach()            # a fresh tensor (or an alias of the input) whose history is this node

    @staticmethod
    def backward(ctx, g):
        f = ctx.flight
        f.bwd = f.backward(g, f.group, True)
        return g.new_zeros(0), None


def start(kind: str, x: torch.Tensor, dim: int, dim2: int, group) -> Flight:
    """Start the compiler's collective ``kind`` on ``x`` (async on the group's
    stream or worker) and return its :class:`Flight`; :func:`finish` gives the
    value ``kind``'s function above would have. Autograd-aware: the
    backward's collective is started by ``finish``'s backward and waited for
    by ``start``'s, so backward work between them overlaps it too."""
    if kind == "all_to_all" and x.dim():
        dim, dim2 = _norm_dim(x, dim), _norm_dim(x, dim2)
    elif x.dim():
        dim = _norm_dim(x, dim)
    if group_size(group) == 1 or (kind == "all_to_all" and dim == dim2):
        flight = Flight("all_reduce", 0, 0, group)
        flight.value = x               # nothing to communicate
        return flight
    flight = Flight(kind, dim, dim2, group)
    flight.token = _Start.apply(x, flight)
    return flight


def finish(flight: Flight) -> torch.Tensor:
    """The result of the collective :func:`start` began (waits for it)."""
    if flight.value is not None:
        value, flight.value = flight.value, None
        return value
    token, flight.token = flight.token, None
    return _Finish.apply(token, flight)


# ----------------------------------------------------------------- data parallel

def _buckets(tensors: list[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device) into buckets of <= bucket_mb MiB.

    Deterministic given the shapes/dtypes, so every rank builds the same buckets.
    A tensor larger than a bucket gets a bucket of its own.
    """
    limit = max(bucket_mb, 0) * 2 ** 20
    open_: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (indices, bytes)
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        idx, used = open_.get(key, ([], 0))
        if idx and used + nbytes > limit:
            done.append(idx)
            idx, used = [], 0
        idx.append(i)
        open_[key] = (idx, used + nbytes)
    return done + [idx for idx, _ in open_.values()]


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


@torch.no_grad()
def all_reduce_mean_(tensors: Iterable[torch.Tensor], group, bucket_mb: float = 25) -> None:
    """Average ``tensors`` in place over ``group`` through flattened buckets (no-op for None/size 1)."""
    tensors = _unique(tensors)
    w = group_size(group)
    if w == 1:
        return
    for idx in _buckets(tensors, bucket_mb):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=group)
        flat.div_(w)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            tensors[i].copy_(piece.view_as(tensors[i]))


def pack_grads(ps: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One flat buffer of the gradients of ``ps`` (zeros where a parameter has
    none) followed by one flag per parameter (1 where it has one), and its
    per-parameter pieces (the flags last): what a bucketed all-reduce sends."""
    sizes = [p.numel() for p in ps]
    # no zero-fill of the whole buffer and no separate pass for the
    # division: both cost a full memory pass each (~2 ms per 16 MiB on CPU)
    flat = ps[0].new_empty(sum(sizes) + len(ps))
    pieces = flat.split(sizes + [len(ps)])
    for p, piece in zip(ps, pieces):
        if p.grad is not None:
            piece.copy_(p.grad.reshape(-1))
        else:
            piece.zero_()
    pieces[-1].copy_(torch.tensor([p.grad is not None for p in ps], dtype=flat.dtype))
    return flat, pieces


class GradSync:
    """Average parameter gradients over a data-parallel group (DDP without overlap).

    Call ``sync()`` after ``backward()`` and before ``optimizer.step()``. The
    ``.grad`` of each parameter (requires_grad, deduplicated, same order on all
    ranks) is averaged through flattened buckets of ``bucket_mb`` MiB. A missing
    grad counts as zeros; one flag per parameter travels with each bucket so a
    parameter ends with ``grad=None`` only when it had no grad on any rank, and
    every rank ends with identical grads.
    """

    def __init__(self, params: Iterable[torch.Tensor], group, bucket_mb: float = 25):
        self.params = [p for p in _unique(params) if p.requires_grad]
        self.group = group
        self.buckets = _buckets(self.params, bucket_mb)

    @torch.no_grad()
    def sync(self) -> None:
        w = group_size(self.group)
        if w == 1:
            return
        for idx in self.buckets:
            ps = [self.params[i] for i in idx]
            flat, pieces = pack_grads(ps)
            dist.all_reduce(flat, group=self.group)
            flags = pieces[-1].tolist()   # how many ranks had a grad
            for p, piece, flag in zip(ps, pieces, flags):
                if p.grad is not None:
                    torch.div(piece.view_as(p.grad), w, out=p.grad)
                elif flag > 0:
                    p.grad = piece.view_as(p) / w


@torch.no_grad()
def broadcast_params_(params: Iterable[torch.Tensor], group, src_rank_in_group: int = 0,
                      bucket_mb: float = 25) -> None:
    """Copy ``params`` (or buffers) of group rank ``src_rank_in_group`` to the whole group, in place."""
    tensors = _unique(params)
    w = group_size(group)
    if w == 1:
        return
    if not 0 <= src_rank_in_group < w:
        raise DistributedError(f"src_rank_in_group={src_rank_in_group} is not in [0, {w})")
    src = dist.get_global_rank(group, src_rank_in_group)
    for idx in _buckets(tensors, bucket_mb):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        dist.broadcast(flat, src, group=group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            tensors[i].copy_(piece.view_as(tensors[i]))
