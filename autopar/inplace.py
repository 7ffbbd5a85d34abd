"""In-place ops made out of place, on both front ends' graphs.

``h = self.a(x); h.add_(1.0)`` traces to an ``add_`` node nobody reads (the
mutation is its effect): dead-code elimination in the per-rank rewrite
dropped it, and the sharded program computed another function than the
model. :func:`out_of_place` rewrites every in-place op of a traced graph
(``Tensor.add_``, ``aten.add_.Tensor``, ``operator.iadd``, ``F.relu(...,
inplace=True)``) into its out-of-place form and makes every later read of the
mutated tensor read the new value instead, which is what the mutation meant.

That is exact when nothing else sees the old storage. A write into a slice
or a select of a tensor that is read afterwards (``q = x.new_empty(...);
q[..., :k] = a; q[..., k:] = b``) becomes a scatter of the new part into a
new tensor, which every later reader reads. Otherwise it refuses, with a
:class:`TraceError` naming the op, an in-place op on a view whose base or
sibling views are read later (the mutation would show through them). Updates
of the model's state (``num_batches_tracked.add_(1)`` in BatchNorm) stay as
they are; a model input written in place is left unchanged (the program reads
the new value, the caller's tensor keeps the old one).
"""
from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any, Iterator

import torch
import torch.fx as fx

from .errors import TraceError

#: in-place Python operators and their out-of-place forms
_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
              operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_}
#: in-place methods whose out-of-place form is a function of the same arguments
_METHOD_FUNCS = {"fill_": torch.full_like, "zero_": torch.zeros_like}
#: ops whose output shares the input's storage (method / function / aten names)
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "view_as", "transpose", "t", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "slice", "split", "split_with_sizes",
    "chunk", "unbind", "getitem", "__getitem__", "movedim", "diagonal", "as_strided", "detach", "alias",
    "contiguous", "real", "imag", "view_as_real", "view_as_complex", "swapaxes", "swapdims"})


@contextlib.contextmanager
def traced_inplace_operators() -> Iterator[None]:
    """While it is open, symbolic ``torch.fx`` records ``x += y`` as
    ``operator.iadd`` (fx's Proxy has no in-place operators, so Python falls
    back to ``x = x + y`` and another name for ``x`` keeps the old value)."""
    def method(op: Any) -> Any:
        return lambda self, other: self.tracer.create_proxy("call_function", op, (self, other), {})
    names = {f"__{op.__name__}__": op for op in _OPERATORS}       # iadd -> __iadd__
    saved = {k: fx.Proxy.__dict__.get(k) for k in names}
    for k, op in names.items():
        setattr(fx.Proxy, k, method(op))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                delattr(fx.Proxy, k)
            else:
                setattr(fx.Proxy, k, v)


def op_name(n: fx.Node) -> str:
    """The bare name of the op ``n`` runs: a method's name, an ATen
    overload's (``aten.native_dropout.default`` -> ``native_dropout``), a
    function's ``__name__``."""
    t = n.target
    if n.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def assigned(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """What ``dst.copy_(src)`` leaves in ``dst``, as a new tensor (``aten.copy``,
    its out-of-place form, has no derivative)."""
    return src.to(dst.dtype).expand_as(dst)


def _inplace_form(n: fx.Node) -> tuple[str, Any, dict] | None:
    """``(description, out-of-place target, kwargs)`` of an in-place op, or None."""
    if op_name(n) == "copy_" and n.op in ("call_function", "call_method") and len(n.args) >= 2:
        return "copy_", assigned, {}
    if n.op == "call_function" and n.target in _OPERATORS:
        return op_name(n), _OPERATORS[n.target], dict(n.kwargs)
    if n.op == "call_function" and n.kwargs.get("inplace") is True:
        return f"{op_name(n)}(inplace=True)", n.target, {**n.kwargs, "inplace": False}
    name = op_name(n)
    if not name.endswith("_") or name.endswith("__") or name.startswith("_"):
        return None
    base = name[:-1]
    if n.op == "call_method":
        if name in _METHOD_FUNCS:       # fill_ / zero_ have no Tensor method without the "_"
            return name, _METHOD_FUNCS[name], dict(n.kwargs)
        if hasattr(torch.Tensor, base):
            return name, base, dict(n.kwargs)
        if not n.users:                 # copy_ and the like: kept, but say so (nothing reads them)
            warnings.warn(f"autopar: in-place {name} (node {n.name}) has no out-of-place form here; it is kept as "
                          "written, and a sharded program may drop it: write it out of place", stacklevel=4)
        return None
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        packet = getattr(torch.ops.aten, base, None)
        overload = getattr(packet, n.target._overloadname, None) if packet is not None else None
        return (name, overload, dict(n.kwargs)) if overload is not None else None
    if n.op == "call_function" and hasattr(torch, base) and getattr(torch, name, None) is n.target:
        return name, getattr(torch, base), dict(n.kwargs)
    return None


def updated_state(n: fx.Node) -> str | None:
    """The state (``get_attr`` target) that ``n`` writes in place (a buffer's
    update that :func:`out_of_place` keeps as written), or None."""
    if _inplace_form(n) is None or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    base = _base_of(n.args[0])
    return str(base.target) if base.op == "get_attr" else None


def updates_state(n: fx.Node) -> bool:
    """Whether ``n`` writes the model's state in place (:func:`updated_state`)."""
    return updated_state(n) is not None


def _is_tensor(n: fx.Node) -> bool:
    """Whether ``n`` is a tensor, from the shapes the front end recorded."""
    tm = n.meta.get("tensor_meta")
    return hasattr(tm, "shape") or isinstance(n.meta.get("val"), torch.Tensor)


def _is_view(n: fx.Node) -> bool:
    """Whether ``n`` shares the storage of its first argument. Taking an item
    of a tuple is a view only where the tuple holds views (``split``,
    ``chunk``, ``unbind``): the outputs of ``topk``, ``sort`` or ``max(dim)``
    are tensors of their own."""
    if n.op not in ("call_method", "call_function") or op_name(n) not in VIEWS or not n.args \
            or not isinstance(n.args[0], fx.Node):
        return False
    if op_name(n) in ("getitem", "__getitem__"):
        src = n.args[0]
        return _is_tensor(src) or op_name(src) in VIEWS
    return True


def _base_of(t: fx.Node) -> fx.Node:
    """The node whose storage ``t`` views (``t`` itself when it is no view);
    an in-place op returns its first argument's storage, so a chain of them
    (``self.ema.mul_(0.9).add_(m, alpha=0.1)``) updates the buffer it starts from."""
    while _is_view(t) or (_inplace_form(t) is not None and t.args and isinstance(t.args[0], fx.Node)):
        t = t.args[0]
    return t


def _views_of(base: fx.Node) -> set[fx.Node]:
    """``base`` and every node viewing its storage."""
    out, todo = {base}, [base]
    while todo:
        for u in todo.pop().users:
            if u not in out and _is_view(u) and u.args[0] in out:
                out.add(u)
                todo.append(u)
    return out


#: aten views whose write-back is a scatter: (view, its scatter)
_SCATTERS = {"slice": torch.ops.aten.slice_scatter.default, "select": torch.ops.aten.select_scatter.default}


def _slices_up(t: fx.Node, base: fx.Node) -> list[fx.Node] | None:
    """The view chain from ``t`` up to ``base`` when every step is an aten
    ``slice`` or ``select`` (``x[..., :k] = y`` in torch.export: a fresh
    tensor filled in parts, as DeepSeek-V3's attention builds its queries);
    else None."""
    chain = []
    while t is not base:
        if not (isinstance(t.target, torch._ops.OpOverload) and op_name(t) in _SCATTERS):
            return None
        chain.append(t)
        t = t.args[0]
    return chain


def _scatter_back(g: fx.Graph, n: fx.Node, new: fx.Node, chain: list[fx.Node], base: fx.Node,
                  order: dict[fx.Node, int]) -> None:
    """Make the in-place write ``n`` into the view ``chain[0]`` of ``base``
    (its new value ``new``) a new ``base``: scatter it back up the chain, then
    every later reader of ``base``, of the chain, or of another view of
    ``base`` taken before the write reads the new value (the view taken
    again)."""
    now = {chain[0]: new}
    cur = new
    with g.inserting_before(n):
        for v in chain:
            parent = v.args[0]
            cur = g.call_function(_SCATTERS[op_name(v)], (parent, cur, *v.args[1:]), dict(v.kwargs))
            cur.meta = dict(parent.meta)
            order[cur] = order[n]
            now[parent] = cur
        for v in sorted(_views_of(base) - set(chain) - {base}, key=lambda x: order.get(x, -1)):
            if order.get(v, -1) < order[n] and v.args[0] in now:
                again = g.create_node(v.op, v.target, (now[v.args[0]], *v.args[1:]), dict(v.kwargs))
                again.meta = dict(v.meta)
                order[again] = order[n]
                now[v] = again
    for old_node, value in now.items():
        for u in list(old_node.users):
            if order.get(u, -1) > order[n]:
                u.replace_input_with(old_node, value)


def out_of_place(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s in-place ops out of place (module docstring); return how many."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    done = 0
    for n in list(g.nodes):
        form = _inplace_form(n)
        if form is None:
            continue
        what, target, kwargs = form
        t = n.args[0] if n.args else None
        if not isinstance(t, fx.Node):
            continue
        base = _base_of(t)
        if base.op == "get_attr":
            # a state update (an EMA, BatchNorm's num_batches_tracked): it stays as written, and a later
            # read of the state reads it, so the graph says what the read depends on (fx reads the
            # buffer again by name: the analysis saw no path from the update to the read)
            for u in [u for u in g.nodes if order.get(u, -1) > order[n]]:
                for a in u.all_input_nodes:
                    if a is not n and (a.op == "get_attr" and a.target == base.target or
                                       updated_state(a) == str(base.target) and order.get(a, -1) < order[n]):
                        u.replace_input_with(a, n)
            continue
        seen_later = [u for a in _views_of(base) - {t} for u in a.users if order.get(u, -1) > order[n]]
        chain = _slices_up(t, base) if seen_later and _is_tensor(t) else None
        if seen_later and chain is None:
            raise TraceError(f"in-place op {what} (node {n.name}) writes a view of {base.name}, which "
                             f"{seen_later[0].name} reads afterwards; write it out of place")
        if not _is_tensor(t):     # `n += 1` on a size: only the name moves, the graph has it already
            n.target = target if n.op == "call_function" else n.target
            continue
        with g.inserting_before(n):
            new = g.create_node("call_method" if isinstance(target, str) else "call_function", target,
                                n.args[:2] if target is assigned else n.args, kwargs)
        new.meta = dict(n.meta)
        order[new] = order[n]
        for u in list(t.users):
            if u is not n and order.get(u, -1) > order[n]:
                u.replace_input_with(t, new)
        if chain:
            _scatter_back(g, n, new, chain, base, order)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done
