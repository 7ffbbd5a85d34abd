"""The op registry: one :class:`OpInfo` per op, one :class:`KindInfo` per kind, and their lookups.

An op is named as torch.fx and torch.export spell its target: ``"linear"``
covers ``F.linear`` and ``aten.linear`` (every overload), ``"view"`` the
``Tensor.view`` method and ``aten.view``, ``"add"`` ``operator.add``,
``torch.add``, ``Tensor.add`` and ``aten.add``. The tracer files every node
under the kind of its op; the kind picks the sharding rule (registered by
:func:`register_rule`, next to the rule in :mod:`autopar.strategies.rules`)
and the cost family. Everything else the later stages need to know about an
op (is it linear, does selective recompute keep its output, where its shape
argument is) is a field of its record, so a new op is one record in
:mod:`autopar.ops.table`.
"""
from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import AutoparError

FAMILIES = ("matmul", "other")
LINEAR_IN = ("", "all", "first")


@dataclass(frozen=True)
class KindInfo:
    """An op kind: the unit the sharding rules and the cost model dispatch on.

    ``family`` is the cost-model family (``"matmul"``: compute bound, priced
    with the matmul roofline; ``"other"``: everything else)."""

    name: str
    family: str = "other"
    doc: str = ""


@dataclass(frozen=True)
class OpInfo:
    """What autopar knows about one op.

    ``kind``: the :class:`KindInfo` it is filed under.
    ``nonlinear``: an elementwise op whose backward reads its inputs (gelu,
    mul, exp, ...), so the cost model counts them as saved activations.
    ``linear_in``: ``"all"`` when the op adds its operands (add, sub: Partial
    tensors give a Partial sum; not with a Python number among them),
    ``"first"`` when linear in its first operand (neg, mul or divide by a
    replicated value, dropout, dtype casts), ``""`` otherwise.
    ``saved``: selective recompute keeps its output (matmuls, convolutions,
    fused attention; matched on the aten overload packet).
    ``whole_dims``: trailing dims an elementwise op must see whole (tril and
    triu: the matrix dims, their diagonal counts from the global index).
    ``shape_arg``: position of its target-shape argument (for methods called
    with the sizes spread out, the sizes from there on), which the compiler
    rewrites to the local shape; ``None`` when it has none.
    ``operands``: which inputs a ``nonlinear`` op's backward reads, as
    autograd saves them: ``"all"``; ``"product"`` (mul: an operand only when
    another one needs a gradient, so ``x * cos`` with a constant ``cos``
    keeps ``cos`` alone and ``x * 0.5`` keeps nothing); ``"quotient"`` (div:
    the divisor when either needs a gradient, the dividend only when the
    divisor does).
    """

    name: str
    kind: str
    nonlinear: bool = False
    linear_in: str = ""
    saved: bool = False
    whole_dims: int = 0
    shape_arg: int | None = None
    operands: str = "all"

    @property
    def targets(self) -> tuple[Any, ...]:
        """The torch objects of this name this torch has: torch and
        ``torch.nn.functional`` functions, ``Tensor`` methods, ``operator`` /
        builtin functions and the aten overload packet."""
        import torch
        import torch.nn.functional as F
        out: list[Any] = []
        for ns in (torch, F, operator, builtins, torch.Tensor):
            obj = getattr(ns, self.name, None)
            if callable(obj) and getattr(obj, "__name__", None) == self.name and obj not in out:
                out.append(obj)
        packet = aten_packet(self.name)
        if packet is not None:
            out.append(packet)
        return tuple(out)


_KINDS: dict[str, KindInfo] = {}
_OPS: dict[str, OpInfo] = {}
_RULES: dict[str, Callable] = {}


def register_kind(name: str, family: str = "other", doc: str = "") -> KindInfo:
    """Add the kind ``name``. Returns its record.

    Raises :class:`AutoparError` if it exists already or ``family`` is not one of :data:`FAMILIES`."""
    if name in _KINDS:
        raise AutoparError(f"op kind {name!r} is registered twice")
    if family not in FAMILIES:
        raise AutoparError(f"op kind {name!r}: unknown cost family {family!r}; valid: {', '.join(FAMILIES)}")
    info = _KINDS[name] = KindInfo(name, family, doc)
    return info


#: which operands a nonlinear op's backward reads (:attr:`OpInfo.operands`)
OPERANDS = ("all", "product", "quotient")


def register_op(name: str, kind: str, **fields: Any) -> OpInfo:
    """Add the op ``name`` under ``kind`` with the :class:`OpInfo` ``fields``. Returns its record.

    Raises :class:`AutoparError` if the op exists already, the kind is not
    registered, or ``linear_in`` is not one of :data:`LINEAR_IN`."""
    if name in _OPS:
        raise AutoparError(f"op {name!r} is registered twice (as {_OPS[name].kind!r} and {kind!r})")
    if kind not in _KINDS:
        raise AutoparError(f"op {name!r}: unknown kind {kind!r}; register it first (known: {', '.join(_KINDS)})")
    if fields.get("linear_in", "") not in LINEAR_IN:
        raise AutoparError(f"op {name!r}: linear_in={fields['linear_in']!r}; valid: {LINEAR_IN}")
    if fields.get("operands", "all") not in OPERANDS:
        raise AutoparError(f"op {name!r}: operands={fields['operands']!r}; valid: {OPERANDS}")
    info = _OPS[name] = OpInfo(name, kind, **fields)
    return info


def register_rule(*kinds: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is the sharding rule of each of ``kinds`` (DTensor's
    ``register_op_strategy`` in spirit). Returns ``fn`` unchanged.

    Raises :class:`AutoparError` for a kind that is not registered or that has a rule already."""
    def deco(fn: Callable) -> Callable:
        for k in kinds:
            if k not in _KINDS:
                raise AutoparError(f"sharding rule {fn.__name__}: unknown op kind {k!r}; "
                                   f"known: {', '.join(_KINDS)}")
            if k in _RULES:
                raise AutoparError(f"op kind {k!r} has two sharding rules: {_RULES[k].__name__} and {fn.__name__}")
            _RULES[k] = fn
        return fn
    return deco


# ---------------------------------------------------------------- lookups
def target_name(target: Any) -> str:
    """The op name of an fx/export node target: the string of a method call,
    the op name of an aten overload or packet (``aten.mm.default`` -> ``"mm"``),
    else the callable's ``__name__``."""
    if isinstance(target, str):
        return target
    import torch
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def op_info(target: Any) -> OpInfo | None:
    """The record of ``target`` (an op name or a torch object, see
    :func:`target_name`), or ``None`` for an op autopar does not know."""
    return _OPS.get(target if isinstance(target, str) else target_name(target))


def kind_of(target: Any) -> str:
    """The kind of ``target``'s op; ``"other"`` for an unknown op."""
    info = op_info(target)
    return info.kind if info is not None else "other"


def kind_info(kind: str) -> KindInfo | None:
    """The record of ``kind``, or ``None`` if it is not registered."""
    return _KINDS.get(kind)


def family(kind: str) -> str:
    """The cost-model family of ``kind``: ``"matmul"`` (compute bound) or ``"other"``."""
    info = _KINDS.get(kind)
    return info.family if info is not None else "other"


def rule(kind: str) -> Callable | None:
    """The sharding rule registered for ``kind`` (``None`` when there is none;
    the rules register when :mod:`autopar.strategies` is imported)."""
    return _RULES.get(kind)


def rules() -> dict[str, Callable]:
    """kind -> sharding rule, for every kind that has one (a copy)."""
    return dict(_RULES)


def kinds() -> dict[str, tuple[str, ...]]:
    """kind -> its op names in registration order, for every kind with ops
    except ``"other"`` (ops filed there only carry recompute facts): the
    table the tracer classifies nodes with."""
    out: dict[str, list[str]] = {k: [] for k in _KINDS if k != "other"}
    for op in _OPS.values():
        if op.kind in out:
            out[op.kind].append(op.name)
    return {k: tuple(v) for k, v in out.items() if v}


def ops() -> tuple[OpInfo, ...]:
    """Every registered op, in registration order."""
    return tuple(_OPS.values())


def matmul_kinds() -> frozenset[str]:
    """The kinds of the ``matmul`` cost family (linear, matmul, attention, convolution)."""
    return frozenset(k for k, info in _KINDS.items() if info.family == "matmul")


def nonlinear_ops() -> frozenset[str]:
    """Names of the ops whose backward reads their inputs (:attr:`OpInfo.nonlinear`)."""
    return frozenset(op.name for op in _OPS.values() if op.nonlinear)


def is_nonlinear(target: Any) -> bool:
    """Whether ``target``'s backward reads its inputs (:attr:`OpInfo.nonlinear`); False for unknown ops."""
    info = op_info(target)
    return info is not None and info.nonlinear


def shape_arg_ops() -> frozenset[str]:
    """Names of the ops with a target-shape argument the compiler localises (:attr:`OpInfo.shape_arg`)."""
    return frozenset(op.name for op in _OPS.values() if op.shape_arg is not None)


def aten_packet(name: str) -> Any:
    """``torch.ops.aten.<name>`` (an overload packet), or ``None`` if this torch has no such op."""
    import torch
    return getattr(torch.ops.aten, name, None)


def save_ops() -> frozenset:
    """The aten overload packets whose outputs selective recompute saves
    (:attr:`OpInfo.saved`; those this torch has)."""
    out = (aten_packet(op.name) for op in _OPS.values() if op.saved)
    return frozenset(p for p in out if p is not None)
