"""Small helpers over fx graphs that several compile passes share."""
from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn as nn

__all__ = ["get_attr", "free_nodes"]


def get_attr(module: nn.Module, target: str) -> Any:
    """The object at the dotted ``target`` of ``module`` (what a ``get_attr``
    node reads: a parameter, buffer, constant tensor or submodule). Raises
    :class:`AttributeError` naming the first missing part."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def free_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes of ``gm`` computed from graph inputs, buffers and
    constants only (not from parameters): sizes, positions, masks, rotary
    tables. Pipeline stages and layer regions recompute these where they are
    read instead of passing them along."""
    free: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if not isinstance(get_attr(gm, n.target), nn.Parameter):
                free.add(n.name)
        elif n.op in ("call_function", "call_method") or (
                n.op == "call_module" and next(gm.get_submodule(n.target).parameters(), None) is None):
            if all(i.op == "placeholder" or i.name in free for i in n.all_input_nodes):
                free.add(n.name)
    return free
