"""User-pinned shardings (semi-automatic mode).

A pin fixes the tensor-parallel placement of a parameter or of a module's
output; the search decides the rest around it. Pins come from
:func:`shard` annotations on modules or from a dict in the request::

    autopar.shard(model.blocks[0].mlp.fc, weight="S(0)")        # column-parallel
    autopar.shard(model.blocks[0].mlp, output="R")
    autopar.plan(model, ..., shardings={"blocks.1.mlp.proj.weight": "Shard(1)"})

A placement is ``"R"`` / ``"Replicate()"``, ``"S(d)"`` / ``"Shard(d)"``
(``d`` may be negative), a ``torch.distributed.tensor`` placement object,
or a ``(dp, tp)`` pair whose data-parallel part must be what data
parallelism gives (replicated weights, batch-sharded activations). Under
``tp_mode=mesh`` a placement of one axis pins the mesh's inner axis, and
``"S(0)|S(1)"`` (one placement per axis, outermost first) pins every axis.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import StrategyError
from ..graph import NO_DISPATCH, Graph, Node
from ..spec.placement import SEP, R, S

_ATTR = "_autopar_shard"


def shard(module: Any, output: Any = None, **params: Any) -> Any:
    """Pin shardings on ``module``: ``output=`` for its output, and one
    keyword per parameter attribute (``weight="S(0)"``). Returns the module.
    Raises :class:`StrategyError` for an unknown parameter name or an
    unreadable placement."""
    names = {n for n, _ in module.named_parameters(recurse=False)} | \
        {n for n, _ in module.named_buffers(recurse=False)}
    spec = dict(getattr(module, _ATTR, {}))
    for k, v in params.items():
        if k not in names:
            raise StrategyError(f"autopar.shard: {type(module).__name__} has no parameter {k!r}; "
                                f"it has: {', '.join(sorted(names)) or 'none'}")
        _parse_one(v, f"{k}")
        spec[k] = v
    if output is not None:
        _parse_one(output, "output")
        spec[""] = output
    object.__setattr__(module, _ATTR, spec)
    return module


def annotations(model: Any) -> dict[str, Any]:
    """The pins set with :func:`shard` on ``model``'s modules, as
    ``{qualified name: placement}`` (a module path for an output pin)."""
    out: dict[str, Any] = {}
    named = getattr(model, "named_modules", None)
    if named is None:
        return out
    for path, mod in named():
        for k, v in getattr(mod, _ATTR, {}).items():
            out[".".join(x for x in (path, k) if x)] = v
    return out


def _parse_one(value: Any, what: str) -> str:
    """One placement on one axis, as a placement string with a possibly
    negative dim kept as ``S(-k)`` until the tensor rank is known; or a
    placement on every axis of a ``tp_mode=mesh`` tensor group, outermost
    first, joined by ``|`` (``S(0)|S(1)``)."""
    if isinstance(value, str) and SEP in value:
        return SEP.join(_parse_one(part, what) for part in value.split(SEP))
    if hasattr(value, "is_shard") and hasattr(value, "is_replicate"):   # torch.distributed.tensor placements
        if value.is_shard():
            return f"S({value.dim})"
        if value.is_replicate():
            return R
        raise StrategyError(f"pin {what}: only Shard and Replicate can be pinned, not {value!r}")
    text = str(value).strip().replace(" ", "")
    if text in ("R", "Replicate()", "Replicate", "replicate"):
        return R
    m = re.fullmatch(r"(?:S|Shard)\((-?\d+)\)", text)
    if m:
        return f"S({int(m.group(1))})"
    if text in ("P", "Partial()", "Partial"):
        raise StrategyError(f"pin {what}: a partial sum cannot be pinned; use R or S(d)")
    raise StrategyError(f"pin {what}: cannot read placement {value!r}; use 'R', 'S(d)', 'Shard(d)' or "
                        "'Replicate()'")


def resolve(graph: Graph, shardings: dict[str, Any] | None, dp_placement: dict[str, str] | None = None
            ) -> tuple[tuple[str, str], ...]:
    """``(node name, tp placement)`` pairs for ``shardings`` (see :func:`keys`)."""
    return tuple(sorted((n, p) for n, (_, p) in _resolve(graph, shardings, dp_placement).items()))


def keys(graph: Graph, shardings: dict[str, Any] | None) -> dict[str, str]:
    """Node name -> the user's key that pinned it (for error messages)."""
    return {n: k for n, (k, _) in _resolve(graph, shardings, None, check_dp=False).items()}


def _resolve(graph: Graph, shardings: dict[str, Any] | None, dp_placement: dict[str, str] | None,
             check_dp: bool = True) -> dict[str, tuple[str, str]]:
    """Turn user pins into ``(node name, tp placement)`` pairs for ``graph``.

    Keys are parameter names (as in the model's ``state_dict``, a tied alias
    included) or module paths (the module's output). Raises
    :class:`StrategyError` naming the key for an unknown name, a dim out of
    range, a data-parallel part that contradicts data parallelism, or two
    pins that reach the same tensor with different placements."""
    if not shardings:
        return {}
    pre = graph.loss_prefix
    by_param = {nd.param: nd for nd in graph.nodes if nd.param}
    by_module: dict[str, Node] = {}
    for nd in graph.nodes:   # a module's output: its last op in program order
        if nd.kind in NO_DISPATCH or nd.out is None:
            continue
        parts = nd.module.split(".") if nd.module else []
        for i in range(1, len(parts) + 1):
            by_module[".".join(parts[:i])] = nd
    out: dict[str, tuple[str, str]] = {}
    for key, value in shardings.items():
        name = graph.aliases.get(pre + key, graph.aliases.get(key, key))
        nd = by_param.get(name) or by_param.get(pre + name) or by_module.get(pre + key) or by_module.get(key)
        if nd is None:
            example = next(iter(by_param), "?")
            raise StrategyError(f"pin {key!r}: no parameter or module of that name in the traced model "
                                f"(parameters are named like {example[len(pre):] if pre else example!r}, "
                                "modules by their path)")
        dp_part = None
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise StrategyError(f"pin {key!r}: a pair (dp, tp) of placements is expected, got {value!r}")
            dp_part, value = _parse_one(value[0], key), value[1]
        rank = len(nd.out.shape) if nd.out is not None else 0
        p = SEP.join(_dim_in_range(part, rank, key, nd) for part in _parse_one(value, key).split(SEP))
        if dp_part is not None and check_dp:
            want = (dp_placement or {}).get(nd.name, R)
            if dp_part.startswith("S(") and rank:
                dp_part = S(int(dp_part[2:-1]) % rank)
            if dp_part != want:
                raise StrategyError(f"pin {key!r}: the data-parallel axis places this tensor as {want} "
                                    f"(it carries the batch; weights are replicated or ZeRO-sharded), "
                                    f"not {dp_part}")
        prev = out.get(nd.name)
        if prev is not None and prev[1] != p:
            raise StrategyError(f"pins {prev[0]!r} ({prev[1]}) and {key!r} ({p}) contradict: both name "
                                f"the same tensor")
        out[nd.name] = (key, p)
    return out


def _dim_in_range(p: str, rank: int, key: str, nd: Node) -> str:
    """``p`` with its dim taken modulo the tensor's ``rank``; raises
    :class:`StrategyError` naming ``key`` for a dim out of range."""
    if not p.startswith("S("):
        return p
    d = int(p[2:-1])
    if not -rank <= d < rank:
        raise StrategyError(f"pin {key!r}: dim {d} is out of range for a tensor of shape "
                            f"{tuple(nd.out.shape) if nd.out else ()}")
    return S(d % rank)
