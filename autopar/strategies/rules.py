"""Sharding rules: one small function per op family.

Each rule gets a :class:`Ctx` (the node, the shapes of its tensor inputs and
output on this axis, the axis size ``n``) and returns the valid strategies.
Shapes are *local to the other mesh axes* already, so divisibility is checked
against what this axis will actually split. Each rule registers itself for
its kinds with :func:`autopar.ops.register_rule`, next to its code (the kinds
and their ops are records of :mod:`autopar.ops`): a new op of a known kind is
one record there, a new kind one record there plus one rule here.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .. import ops
from ..graph import STATE_KINDS, Node
from ..spec.placement import P, R, S, is_shard, shard_dim

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on one mesh axis.

    ``ins`` is the placement each tensor input must have (in ``node.inputs``
    order), ``out`` the output's. ``split`` says whether the work is divided
    over the axis. ``comm`` lists collectives the op runs inside, as
    ``(kind, nbytes)`` with nbytes of the full tensor. ``scale`` multiplies the
    local result (a mean over a sharded dim becomes a partial sum).
    ``kernel`` names a special local implementation (vocabulary-parallel
    embedding or cross-entropy) the compiler must use.
    """

    name: str
    ins: tuple[str, ...]
    out: str
    split: bool
    comm: tuple[tuple[str, float], ...] = ()
    scale: float = 1.0
    kernel: str | None = None


@dataclass
class Ctx:
    node: Node
    ins: list[Shape | None]     # local shapes of the tensor inputs
    in_kinds: list[str]         # kinds of the input nodes ("param", "input", ...)
    out: Shape | None
    n: int
    itemsize: int = 4
    batch_axis: bool = False    # the data-parallel axis (per-replica statistics are accepted there)

    def div(self, shape: Shape | None, d: int) -> bool:
        return shape is not None and 0 <= d < len(shape) and shape[d] % self.n == 0 and shape[d] >= self.n


def _all(ctx: Ctx, p: str) -> tuple[str, ...]:
    return tuple(p for _ in ctx.ins)


def _replicated(ctx: Ctx) -> list[Strategy]:
    return [Strategy("replicate", _all(ctx, R), R, False)]


# ---------------------------------------------------------------- matmuls
@ops.register_rule("linear")
def _linear(ctx: Ctx) -> list[Strategy]:
    """F.linear(x, W[out, in][, b]) (the tracer makes a module's bias a separate add;
    a functional bias is split with the weight's rows, and rules out rowwise,
    whose partial sums would each add it)."""
    x, w = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    out = _replicated(ctx)
    if ctx.node.target == "addmm" and len(ctx.ins) == 3:
        # addmm(bias, mat1[N, K], mat2[K, N']) from torch.export: the rows of mat1 are tokens
        if ctx.div(ctx.ins[1], 0):
            out.append(Strategy("batch0", (R, S(0), R), S(0), True))
        return out
    if x is None or w is None or ctx.node.target != "linear":
        return out
    last = len(x) - 1
    extra = (R,) * (len(ctx.ins) - 2)
    if ctx.div(w, 0):
        out.append(Strategy("colwise", (R, S(0)) + (S(0),) * (len(ctx.ins) - 2), S(last), True))
    if ctx.div(w, 1) and ctx.div(x, last) and not extra:
        out.append(Strategy("rowwise", (S(last), S(1)), P, True))
    for d in range(last):
        if ctx.div(x, d):
            out.append(Strategy(f"batch{d}", (S(d), R) + extra, S(d), True))
    return out


@ops.register_rule("matmul")
def _matmul(ctx: Ctx) -> list[Strategy]:
    """matmul / mm / bmm(a, b), and baddbmm(c, a, b) = c + a @ b."""
    if len(ctx.ins) == 3:
        return _plus_product(ctx)
    a, b = ctx.ins[0], ctx.ins[1]
    o = ctx.out
    if a is None or b is None or o is None or len(a) < 2 or len(b) < 2:
        return _replicated(ctx)
    out = _replicated(ctx)
    # batch dims (broadcast aligned on the right)
    for d in range(len(o) - 2):
        da, db = d - (len(o) - len(a)), d - (len(o) - len(b))
        sa = S(da) if da >= 0 and a[da] != 1 else R
        sb = S(db) if db >= 0 and b[db] != 1 else R
        if (sa == R or ctx.div(a, da)) and (sb == R or ctx.div(b, db)) and (sa, sb) != (R, R):
            out.append(Strategy(f"batch{d}", (sa, sb), S(d), True))
    if ctx.div(a, len(a) - 2):
        out.append(Strategy("rows", (S(len(a) - 2), R), S(len(o) - 2), True))
    if ctx.div(b, len(b) - 1):
        out.append(Strategy("cols", (R, S(len(b) - 1)), S(len(o) - 1), True))
    if ctx.div(a, len(a) - 1) and ctx.div(b, len(b) - 2):
        out.append(Strategy("contract", (S(len(a) - 1), S(len(b) - 2)), P, True))
    return out


@ops.register_rule("einsum")
def _einsum(ctx: Ctx) -> list[Strategy]:
    """torch.einsum, one strategy per letter (the labels the trace read,
    ``attrs["einsum"]``): every operand holding it split along it (a
    broadcast size-1 dim whole), the output split along it where the output
    has it, Partial where it is summed over, as DTensor's einsum strategies
    do. matmul's batch, rows, cols and contraction are its special cases. A
    letter repeated within an operand (a diagonal) is not split."""
    out = _replicated(ctx)
    labels = ctx.node.attrs.get("einsum")
    if labels is None or ctx.out is None or len(ctx.ins) != len(labels[0]) or any(x is None for x in ctx.ins):
        return out
    terms, res = labels
    for c in sorted(set("".join(terms))):
        if any(t.count(c) > 1 for t in terms):
            continue
        ins = []
        for t, x in zip(terms, ctx.ins):
            d = t.find(c)
            ins.append(R if d < 0 or x[d] == 1 else S(d) if ctx.div(x, d) else None)
        if None in ins or all(p == R for p in ins):
            continue
        if c in res and not ctx.div(ctx.out, res.index(c)):
            continue
        out.append(Strategy(f"letter_{c}", tuple(ins), S(res.index(c)) if c in res else P, True))
    return out


@ops.register_rule("grouped_mm")
def _grouped_mm(ctx: Ctx) -> list[Strategy]:
    """grouped_mm(x[S, K], w[E, K, N], offs[E]): row s of x times the weight
    of its group (the experts of a mixture-of-experts layer, rows sorted by
    expert, ``offs`` their cumulative counts). The rows cannot be split (the
    offsets count all of them); the weights' columns can (each rank its
    columns of every expert) or the contraction (partial sums)."""
    x, w = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    out = _replicated(ctx)
    # a bias (torch._grouped_mm's fourth operand) would be added to every column shard or partial sum
    if x is None or w is None or len(x) != 2 or len(w) != 3 or len(ctx.ins) > 3:
        return out
    rest = (R,) * (len(ctx.ins) - 2)
    if ctx.div(w, 2):
        out.append(Strategy("colwise", (R, S(2)) + rest, S(1), True))
    if ctx.div(x, 1) and ctx.div(w, 1):
        out.append(Strategy("rowwise", (S(1), S(1)) + rest, P, True))
    return out


def _plus_product(ctx: Ctx) -> list[Strategy]:
    """baddbmm(c, a, b): the strategies of a @ b but the contraction split
    (whose partial sums would each add c), with c placed like the output
    (its broadcast dims replicated)."""
    c, o = ctx.ins[0], ctx.out
    sub = Ctx(ctx.node, ctx.ins[1:], ctx.in_kinds[1:], o, ctx.n, ctx.itemsize, ctx.batch_axis)
    out = []
    for st in _matmul(sub):
        if st.out == P:
            continue
        pc = R
        if is_shard(st.out) and c is not None and o is not None:
            d = shard_dim(st.out) - (len(o) - len(c))
            pc = S(d) if d >= 0 and c[d] == o[shard_dim(st.out)] else R
        out.append(Strategy(st.name, (pc,) + st.ins, st.out, st.split, st.comm, st.scale, st.kernel))
    return out


@ops.register_rule("sdpa")
def _sdpa(ctx: Ctx) -> list[Strategy]:
    """scaled_dot_product_attention(q, k, v[, mask]) on [B, H, T, D]: batch or heads."""
    out = _replicated(ctx)
    q = ctx.ins[0]
    if q is None or len(q) != 4:
        return out
    for d in (0, 1):
        if all(ctx.div(s, d) for s in ctx.ins[:3]):
            rest = tuple(S(d) if (s is not None and len(s) == 4 and s[d] != 1) else R for s in ctx.ins[3:])
            out.append(Strategy("batch" if d == 0 else "heads", (S(d),) * 3 + rest, S(d), True))
    return out


@ops.register_rule("conv")
def _conv(ctx: Ctx) -> list[Strategy]:
    """conv(x, W[, b]): a bias is split with the output channels and rules out
    the input-channel split (whose partial sums would each add it)."""
    x, w = ctx.ins[0], ctx.ins[1]
    out = _replicated(ctx)
    groups = ctx.node.attrs.get("groups", 1)
    bias = len(ctx.ins) - 2
    if ctx.div(x, 0):
        out.append(Strategy("batch", (S(0), R) + (R,) * bias, S(0), True))
    if ctx.div(w, 0) and groups == 1:
        out.append(Strategy("out_channels", (R, S(0)) + (S(0),) * bias, S(1), True))
    if ctx.div(w, 1) and ctx.div(x, 1) and groups == 1 and not bias:
        out.append(Strategy("in_channels", (S(1), S(1)), P, True))
    return out


@ops.register_rule("recurrent")
def _recurrent(ctx: Ctx) -> list[Strategy]:
    """aten.lstm / gru / rnn_*(input, initial states, weights, ...): one op over
    the sequence whose weights every token reads, so no split of them (it
    runs replicated on a tensor axis); the samples apart where the input is
    ``[seq, batch, features]`` (the layers' default layout): the input, the
    states ``[layers, batch, hidden]`` and every output split at dim 1. Not
    batch first: the op returns one tuple, whose output holds the batch at
    dim 0 and whose final states at dim 1, which one placement cannot say."""
    out = _replicated(ctx)
    x = ctx.ins[0] if ctx.ins else None
    states = [k for k in range(1, len(ctx.ins)) if ctx.in_kinds[k] not in STATE_KINDS and ctx.ins[k] is not None
              and len(ctx.ins[k]) == 3]
    if x is None or len(x) != 3 or not states:
        return out
    if x[0] != ctx.ins[states[0]][1] and x[1] == ctx.ins[states[0]][1] and \
            all(ctx.div(t, 1) for t in [x, *(ctx.ins[k] for k in states)]):
        out.append(Strategy("batch", tuple(S(1) if k == 0 or k in states else R for k in range(len(ctx.ins))),
                            S(1), True))
    return out


# ---------------------------------------------------------------- lookups and losses
@ops.register_rule("embedding")
def _embedding(ctx: Ctx) -> list[Strategy]:
    """F.embedding(ids, W[V, H]) (export puts the weight first)."""
    wi = 0 if ctx.in_kinds and ctx.in_kinds[0] in STATE_KINDS else 1
    ii = 1 - wi
    ids, w = ctx.ins[ii], ctx.ins[wi]
    out = _replicated(ctx)
    if ids is None or w is None:
        return out

    def mk(pid: str, pw: str) -> tuple[str, str]:
        return (pid, pw) if ii == 0 else (pw, pid)

    for d in range(len(ids)):
        if ctx.div(ids, d):
            out.append(Strategy(f"batch{d}", mk(S(d), R), S(d), True))
    if ctx.div(w, 1):
        out.append(Strategy("hidden", mk(R, S(1)), S(len(ids)), True))
    if ctx.div(w, 0) and ctx.node.op != "placeholder":
        out.append(Strategy("vocab", mk(R, S(0)), P, True, kernel="vocab_embedding"))
    return out


@ops.register_rule("nll_loss")
def _nll_loss(ctx: Ctx) -> list[Strategy]:
    """F.nll_loss(log_probs[N, C], target[N]) with mean or sum reduction: the batch split."""
    x, target = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    out = _replicated(ctx)
    reduction = ctx.node.attrs.get("reduction", "mean")
    weighted = ctx.node.attrs.get("class_weight")
    if x is not None and target is not None and len(x) == 2 and ctx.div(x, 0) and reduction in ("mean", "sum") \
            and (not weighted or ctx.batch_axis and len(ctx.ins) == 3):
        out.append(Strategy("batch", (S(0), S(0)) + ((R,) if weighted else ()), P, True,
                            scale=(1.0 / ctx.n) if reduction == "mean" else 1.0))
    return out


@ops.register_rule("cross_entropy")
def _cross_entropy(ctx: Ctx) -> list[Strategy]:
    """F.cross_entropy(logits[N, C], target[N]) with mean reduction."""
    logits, target = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    out = _replicated(ctx)
    if logits is None or target is None or len(logits) != 2:
        return out
    reduction = ctx.node.attrs.get("reduction", "mean")
    if ctx.node.attrs.get("class_weight"):
        # weighted by the targets' classes: a part's mean divides by its own targets' weights, which
        # the runtime corrects over the batch axis only (compile/tokens.py); no vocabulary kernel
        if ctx.batch_axis and ctx.div(logits, 0) and reduction in ("mean", "sum") and len(ctx.ins) == 3:
            out.append(Strategy("batch", (S(0), S(0), R), P, True,
                                scale=(1.0 / ctx.n) if reduction == "mean" else 1.0))
        return out
    if ctx.div(logits, 0) and reduction in ("mean", "sum"):
        out.append(Strategy("batch", (S(0), S(0)), P, True,
                            scale=(1.0 / ctx.n) if reduction == "mean" else 1.0))
    if ctx.div(logits, 1):
        rows = logits[0] * ctx.itemsize
        out.append(Strategy("vocab", (S(1), R), R, True,
                            comm=(("all_reduce", rows), ("all_reduce", rows), ("all_reduce", rows)),
                            kernel="vocab_cross_entropy"))
    return out


# ---------------------------------------------------------------- normalisation, softmax, pooling
@ops.register_rule("layernorm", "rmsnorm")
def _norm(ctx: Ctx) -> list[Strategy]:
    """layer_norm / rms_norm over the trailing ``len(normalized_shape)`` dims."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    k = ctx.node.attrs.get("norm_dims", 1)
    if x is None:
        return out
    for d in range(len(x) - k):
        if ctx.div(x, d):
            out.append(Strategy(f"batch{d}", (S(d),) + (R,) * (len(ctx.ins) - 1), S(d), True))
    return out


@ops.register_rule("groupnorm")
def _groupnorm(ctx: Ctx) -> list[Strategy]:
    """group_norm(x, groups, weight, bias): statistics of each sample, so its samples split."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    if ctx.div(x, 0):
        out.append(Strategy("batch", (S(0),) + (R,) * (len(ctx.ins) - 1), S(0), True))
    return out


@ops.register_rule("pointwise_loss")
def _pointwise_loss(ctx: Ctx) -> list[Strategy]:
    """mse_loss / l1_loss / smooth_l1_loss / huber_loss of two tensors of one
    shape: split along any dim, both alike; a mean becomes a partial sum
    scaled by ``1/n`` (each rank's mean of as many elements), a sum a partial
    sum, no reduction stays split."""
    out = _replicated(ctx)
    red = ctx.node.attrs.get("reduction", "mean")
    if len(ctx.ins) != 2 or ctx.ins[0] is None or ctx.ins[0] != ctx.ins[1] or red not in ("mean", "sum", "none"):
        return out
    for d in range(len(ctx.ins[0])):
        if ctx.div(ctx.ins[0], d):
            res = S(d) if red == "none" else P
            out.append(Strategy(f"dim{d}", (S(d), S(d)), res, True, scale=1.0 / ctx.n if red == "mean" else 1.0))
    return out


@ops.register_rule("broadcast")
def _broadcast(ctx: Ctx) -> list[Strategy]:
    """broadcast_tensors: a dim of the common shape splits every input that
    has it (a broadcast size-1 dim stays whole); the tuple is split alike."""
    o = ctx.out
    out = _replicated(ctx)
    if o is None or any(x is None for x in ctx.ins):
        return out
    for d in range(len(o)):
        ins = []
        for x in ctx.ins:
            dx = d - (len(o) - len(x))
            ins.append(R if dx < 0 or x[dx] == 1 else S(dx) if ctx.div(x, dx) else None)
        if None not in ins and any(p != R for p in ins):
            out.append(Strategy(f"dim{d}", tuple(ins), S(d), True))
    return out


@ops.register_rule("batchnorm")
def _batchnorm(ctx: Ctx) -> list[Strategy]:
    """batch_norm(x, running_mean, running_var, weight, bias): channels exactly;
    batch only on the data-parallel axis, where the compiler takes the
    statistics over the whole dp group in training mode (synchronised batch
    norm, :func:`autopar.runtime.kernels.sync_batch_norm`), so the result is one
    process's. On a tensor-parallel axis a batch split would change the
    statistics, so it is not offered there."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    if ctx.div(x, 0) and ctx.batch_axis:
        out.append(Strategy("batch", (S(0),) + (R,) * (len(ctx.ins) - 1), S(0), True))
    if ctx.div(x, 1):
        out.append(Strategy("channels", (S(1),) + (S(0),) * (len(ctx.ins) - 1), S(1), True))
    return out


@ops.register_rule("softmax", "normalize")
def _softmax(ctx: Ctx) -> list[Strategy]:
    """(log-)softmax, and F.normalize's p-norm, along one dim: split on any other."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    if x is None:
        return out
    dim = ctx.node.attrs.get("dim", -1) % len(x)
    for d in range(len(x)):
        if d != dim and ctx.div(x, d):
            out.append(Strategy(f"dim{d}", (S(d),), S(d), True))
    return out


@ops.register_rule("pad")
def _pad(ctx: Ctx) -> list[Strategy]:
    """Padding works on each index of the dims it leaves alone: those split."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    padded = ctx.node.attrs.get("padded_dims")
    if x is None or padded is None:
        return out
    for d in range(len(x)):
        if d not in padded and ctx.div(x, d):
            out.append(Strategy(f"dim{d}", (S(d),) + (R,) * (len(ctx.ins) - 1), S(d), True))
    return out


@ops.register_rule("scatter")
def _scatter(ctx: Ctx) -> list[Strategy]:
    """slice_scatter(base, src, dim, ...) / select_scatter(base, src, dim,
    index): split on any dim but the one written into, base, src and output
    alike (select_scatter's src lacks that dim)."""
    x, src = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    out = _replicated(ctx)
    dim = ctx.node.attrs.get("dim")
    if x is None or src is None or dim is None:
        return out
    dropped = len(src) == len(x) - 1
    for d in range(len(x)):
        sd = d - 1 if dropped and d > dim else d
        if d != dim and ctx.div(x, d) and ctx.div(src, sd) and src[sd] == x[d]:
            out.append(Strategy(f"dim{d}", (S(d), S(sd)) + (R,) * (len(ctx.ins) - 2), S(d), True))
    return out


@ops.register_rule("pool", "resample")
def _pool(ctx: Ctx) -> list[Strategy]:
    """Pooling and resampling (``F.interpolate``): each sample and channel on its own."""
    x = ctx.ins[0]
    out = _replicated(ctx)
    for d in (0, 1):
        if ctx.div(x, d):
            out.append(Strategy(f"dim{d}", (S(d),), S(d), True))
    return out


@ops.register_rule("reduction")
def _reduction(ctx: Ctx) -> list[Strategy]:
    x, o = ctx.ins[0], ctx.out
    out = _replicated(ctx)
    if x is None or o is None:
        return out
    dims = ctx.node.attrs.get("reduce_dims")
    if dims is None:
        return out
    keep = ctx.node.attrs.get("keepdim", False)
    linear = ctx.node.target in ("sum", "mean")
    for d in range(len(x)):
        if not ctx.div(x, d):
            continue
        if d in dims:
            if linear:
                scale = 1.0 / ctx.n if ctx.node.target == "mean" else 1.0
                out.append(Strategy(f"reduce{d}", (S(d),), P, True, scale=scale))
        else:
            od = d if keep else d - sum(1 for r in dims if r < d)
            out.append(Strategy(f"dim{d}", (S(d),), S(od), True))
    return out


# ---------------------------------------------------------------- elementwise
@ops.register_rule("elementwise")
def _elementwise(ctx: Ctx) -> list[Strategy]:
    o = ctx.out
    out = _replicated(ctx)
    if o is None:
        return out
    nd = len(o)
    info = ops.op_info(ctx.node.target)
    whole = info.whole_dims if info is not None else 0
    for d in range(nd - whole):
        req = []
        ok = o[d] % ctx.n == 0 and o[d] >= ctx.n
        for s in ctx.ins:
            if s is None:
                req.append(R)
                continue
            di = d - (nd - len(s))
            if di < 0 or s[di] == 1:
                req.append(R)         # broadcast along d: every rank needs all of it
            elif s[di] == o[d]:
                req.append(S(di))
            else:
                ok = False
        if ok and any(is_shard(p) for p in req):
            out.append(Strategy(f"dim{d}", tuple(req), S(d), True))
    linear_in = info.linear_in if info is not None else ""
    if linear_in == "all" and len(ctx.ins) >= 2:
        # a sum of tensors only: x + 1 on summands would add the 1 on every rank
        out.append(Strategy("partial", _all(ctx, P), P, False))
    elif linear_in == "first" and ctx.ins:
        # linear in the first operand only (x * scale, x / scale, dropout, casts)
        out.append(Strategy("partial", (P,) + (R,) * (len(ctx.ins) - 1), P, False))
    return out


# ---------------------------------------------------------------- views
def _dim_groups(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]] | None:
    """Split two shapes of equal numel into aligned runs of dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb = [], []
        pa = pb = 1
        while True:
            if pa == pb and (ga or gb) and not (i < len(a) and a[i] == 1 and pa == pb and ga) \
                    and not (j < len(b) and b[j] == 1 and gb):
                break
            if pa <= pb and i < len(a):
                pa *= a[i]
                ga.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gb.append(j)
                j += 1
            elif i < len(a):
                pa *= a[i]
                ga.append(i)
                i += 1
            else:
                break
        if pa != pb:
            return None
        groups.append((ga, gb))
    return groups


def view_map(a: Shape, b: Shape, n: int) -> dict[int, int]:
    """For a reshape from ``a`` to ``b``: input shard dim -> output shard dim,
    for the dims whose shard stays one contiguous chunk (the outermost
    non-unit dim of its group on both sides, divisible by ``n``)."""
    groups = _dim_groups(a, b)
    m: dict[int, int] = {}
    if groups is None:
        return m
    for ga, gb in groups:
        ia = [d for d in ga if a[d] != 1]
        ib = [d for d in gb if b[d] != 1]
        if ia and ib and a[ia[0]] % n == 0 and b[ib[0]] % n == 0:
            m[ia[0]] = ib[0]
    return m


@ops.register_rule("view")
def _view(ctx: Ctx) -> list[Strategy]:
    """Views, copies and dtype casts: a split dim the shapes map stays split;
    a partial sum stays one, but for a cast to an integer or boolean dtype
    (``long()`` truncates each summand)."""
    x, o = ctx.ins[0] if ctx.ins else None, ctx.out
    linear = ctx.node.out is None or ctx.node.out.is_float
    out = ([Strategy("replicate", _all(ctx, R), R, False)] +
           ([Strategy("partial", (P,) + (R,) * (len(ctx.ins) - 1), P, False)] if linear else [])) \
        if ctx.ins else _replicated(ctx)
    if x is None or o is None:
        return out
    extra = (R,) * (len(ctx.ins) - 1)
    if ctx.node.target in ("view", "reshape", "flatten", "unflatten", "view_as", "_unsafe_view"):
        for di, do in view_map(x, o, ctx.n).items():
            if ctx.div(x, di):
                out.append(Strategy(f"dim{di}", (S(di),) + extra, S(do), False))
    elif len(x) == len(o):   # contiguous, clone, to(dtype), ...
        for d in range(len(x)):
            if ctx.div(x, d):
                out.append(Strategy(f"dim{d}", (S(d),) + extra, S(d), False))
    return out


@ops.register_rule("transpose")
def _transpose(ctx: Ctx) -> list[Strategy]:
    x = ctx.ins[0]
    out = [Strategy("replicate", (R,), R, False), Strategy("partial", (P,), P, False)]
    perm = ctx.node.attrs.get("perm")
    if x is None or perm is None:
        return out
    for od, idim in enumerate(perm):
        if ctx.div(x, idim):
            out.append(Strategy(f"dim{idim}", (S(idim),), S(od), False))
    return out


@ops.register_rule("expand")
def _expand(ctx: Ctx) -> list[Strategy]:
    """unsqueeze / squeeze / expand / repeat_interleave / repeat; expand_as
    (x, other): the output has other's shape, so other is read as the
    output is placed."""
    x, o = ctx.ins[0], ctx.out
    out = [Strategy("replicate", _all(ctx, R), R, False)]
    if x is None or o is None:
        return out
    t = ctx.node.target
    extra = (R,) * (len(ctx.ins) - 1)
    dmap = ctx.node.attrs.get("dim_map")  # input dim -> output dim, computed at trace time
    if dmap is None:
        return out
    for di, do in dmap.items():
        if ctx.div(x, di) and ctx.div(o, do):
            if t in ("expand", "expand_as", "repeat") and x[di] != o[do]:
                continue
            other = (S(do),) * (len(ctx.ins) - 1) if t == "expand_as" else extra
            out.append(Strategy(f"dim{di}", (S(di),) + other, S(do), False))
    if t in ("unsqueeze", "squeeze"):
        out.append(Strategy("partial", (P,) + extra, P, False))
    return out


@ops.register_rule("index")
def _index(ctx: Ctx) -> list[Strategy]:
    """getitem / narrow / select: a dim that is kept whole keeps its shard."""
    out = [Strategy("replicate", _all(ctx, R), R, False)]
    dmap = ctx.node.attrs.get("dim_map")
    x, o = ctx.ins[0] if ctx.ins else None, ctx.out
    if x is None or o is None or dmap is None:
        return out
    extra = (R,) * (len(ctx.ins) - 1)
    for di, do in dmap.items():
        if ctx.div(x, di) and x[di] == o[do]:
            out.append(Strategy(f"dim{di}", (S(di),) + extra, S(do), False))
    return out


@ops.register_rule("split")
def _split(ctx: Ctx) -> list[Strategy]:
    x = ctx.ins[0]
    out = [Strategy("replicate", (R,), R, False)]
    dim = ctx.node.attrs.get("dim", 0)
    if x is None:
        return out
    dim %= len(x)
    unbind = ctx.node.target == "unbind"     # its pieces lose the unbound dim
    for d in range(len(x)):
        if d != dim and ctx.div(x, d):
            out.append(Strategy(f"dim{d}", (S(d),), S(d - 1 if unbind and d > dim else d), False))
    return out


@ops.register_rule("item")
def _item(ctx: Ctx) -> list[Strategy]:
    """getitem on the tuple a split returned: the placement passes through."""
    return [Strategy("pass", (p,), p, False) for p in (R, P)] + [
        Strategy(f"dim{d}", (S(d),), S(d), False) for d in range(len(ctx.out or ())) if ctx.div(ctx.out, d)]


@ops.register_rule("cat")
def _cat(ctx: Ctx) -> list[Strategy]:
    o = ctx.out
    out = [Strategy("replicate", _all(ctx, R), R, False), Strategy("partial", _all(ctx, P), P, False)]
    if o is None:
        return out
    dim = ctx.node.attrs.get("dim", 0) % len(o)
    stack = ctx.node.target == "stack"
    for d in range(len(o)):
        if d == dim:
            continue
        di = d - 1 if (stack and d > dim) else d
        if all(ctx.div(s, di) for s in ctx.ins):
            out.append(Strategy(f"dim{d}", _all(ctx, S(di)), S(d), False))
    return out


@ops.register_rule("factory")
def _source(ctx: Ctx) -> list[Strategy]:
    return [Strategy("replicate", _all(ctx, R), R, False)]


_warned: set[str] = set()
_pending: list[str] | None = None     # inside grouped_warnings(): the ops to name in one warning


@contextlib.contextmanager
def grouped_warnings() -> Iterator[None]:
    """Name every op without a sharding rule met inside in one warning at the
    end (a Hugging Face model has a dozen such ops in its mask code: one line
    each, with a source line each, buried the output)."""
    global _pending
    if _pending is not None:      # nested: the outer one reports
        yield
        return
    _pending = []
    try:
        yield
    finally:
        names, _pending = _pending, None
        if names:
            warnings.warn(f"autopar: no sharding rule for {len(names)} op kind(s), run replicated: "
                          f"{', '.join(sorted(names))}", stacklevel=3)


def has_rule(kind: str) -> bool:
    """Whether ``kind`` has a sharding rule (else its nodes run replicated)."""
    return ops.rule(kind) is not None


def candidates(ctx: Ctx) -> list[Strategy]:
    """Valid strategies of ``ctx.node`` on an axis of size ``ctx.n`` (replicate first).

    A node without a rule is replicated, with one warning per op naming it."""
    rule: Callable[[Ctx], list[Strategy]] | None = ops.rule(ctx.node.kind)
    if ctx.node.attrs.get("updates_state"):
        # the model's state written in place (self.ema.mul_(0.9).add_(m)): a rank updating its
        # slice of a buffer it holds whole would leave each rank's copy half updated
        return _replicated(ctx)
    if rule is None:
        key = f"{ctx.node.kind}:{ctx.node.target}"
        if key not in _warned and ctx.n > 1:
            _warned.add(key)
            if _pending is not None:
                _pending.append(str(ctx.node.target))
            else:
                warnings.warn(f"autopar: no sharding rule for op {ctx.node.target!r} (node {ctx.node.name}, "
                              f"kind {ctx.node.kind}); it runs replicated", stacklevel=3)
        return _replicated(ctx)
    out = rule(ctx)
    whole = ctx.node.attrs.get("whole_inputs")      # a buffer the program updates in place: kept whole
    if whole:
        out = [st for st in out if all(st.ins[k] == R for k in whole if k < len(st.ins))] or _replicated(ctx)
    blocks = ctx.node.attrs.get("blocks")
    # the blocked ones first: they cost what their plain twins cost here, and a greedy walk takes
    # the first of equals (the split at the end of the chain can only hand out blocked shards)
    return out[:1] + _blocked(ctx, out, *blocks) + out[1:] if blocks and ctx.n > 1 else out


def _blocked(ctx: Ctx, cands: list[Strategy], k: int, ins_d: dict[int, int], out_d: int | None) -> list[Strategy]:
    """The ``S(d,k)`` strategies of a node on a fused projection's chain
    (``attrs["blocks"]``, marked at trace time): the projection, its bias add
    and views take the projected dim as ``k`` blocks each sharded (each rank
    its chunk of every block) where they would shard it plainly; the split
    into the ``k`` pieces then hands each piece out as a plain shard."""
    def fits(shape: Shape | None, d: int) -> bool:
        return shape is not None and 0 <= d < len(shape) and shape[d] % (k * ctx.n) == 0

    if not all(fits(ctx.ins[i], d) for i, d in ins_d.items()):
        return []
    if out_d is None:     # the split into the pieces
        d = ins_d[0]
        return [Strategy("blocks", (S(d, k),), S(d), False)]
    if not fits(ctx.out, out_d):
        return []
    out = []
    for st in cands:
        if st.out == S(out_d) and all(st.ins[i] == S(d) for i, d in ins_d.items()):
            out.append(Strategy(f"{st.name}_blocks", tuple(S(ins_d[i], k) if i in ins_d else p
                                                           for i, p in enumerate(st.ins)),
                                S(out_d, k), st.split, st.comm, st.scale, st.kernel))
    return out


def rule_names() -> Sequence[str]:
    """The kinds that have a sharding rule, sorted."""
    return sorted(ops.rules())
