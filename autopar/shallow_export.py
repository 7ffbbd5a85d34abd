"""Export a deep model on the meta device in time independent of its depth.

``torch.export`` spends about a quarter of a second per decoder layer of a
Llama-3-8B-shaped model (7.5 s for 32 layers here), so planning a deep
Hugging Face model was dominated by tracing it. A model on the meta device is
only planned, never run, and its repeated layers are identical: export it
with only the first :data:`KEEP` layers of its longest repeated
``nn.ModuleList``, then write the missing layers into the graph as copies of
the last exported one (its nodes, shapes and module-stack metadata, with the
layer index changed), reading the full model's parameters.

The result is the graph the full export gives: the same ops in the same
order under the same node names (fx's per-base counters are continued, so a
plan saved from the meta model names the ops of the real model's trace), the
same parameter reads. :func:`export_shallow` checks what it relies on and
returns None (the caller exports the whole model) when a layer reads
anything but the previous layer and values computed before the layers, when
code after the layers reads an inner layer, or when the kept layers differ
in structure.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

#: layers exported: the first may differ (it reads the embeddings), the second
#: and third show the steady state the copies repeat.
KEEP = 3
#: shallower models are exported whole (nothing to gain).
MIN_LAYERS = 6

_SUFFIX = re.compile(r"^(.*?)(?:_(\d+))?$")


def repeated_list(root: nn.Module, signature: Callable[[nn.Module], str]) -> tuple[str, nn.ModuleList] | None:
    """The path and value of the ``nn.ModuleList`` with the most parameters
    whose children all have one ``signature`` and number at least
    :data:`MIN_LAYERS`, or None."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, m in root.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < MIN_LAYERS:
            continue
        if len({signature(c) for c in m}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if best is None or size > best[0]:
            best = (size, path, m)
    return None if best is None else (best[1], best[2])


def export_shallow(root: nn.Module, export: Callable[[nn.Module], fx.GraphModule],
                   signature: Callable[[nn.Module], str]) -> fx.GraphModule | None:
    """``export(root)`` with the longest repeated layer list cut to
    :data:`KEEP` layers, the rest written in as copies; None when the model
    has no such list or its graph is not a plain chain of layers."""
    cut = _with_first_layers(root, signature, export)
    if cut is None:
        return None
    gm, path, layers = cut
    return _replicate(gm, path, layers, root)


def _with_first_layers(root: nn.Module, signature: Callable[[nn.Module], str], run: Callable[[nn.Module], Any]
                       ) -> tuple[Any, str, int] | None:
    """``run(root)`` with its longest repeated layer list cut to :data:`KEEP`
    layers (put back afterwards): ``(result, the list's path, its full
    length)``, or None when there is no such list or ``run`` fails on the
    cut model (e.g. a forward indexing ``range(config.layers)``: the caller
    then runs it whole)."""
    found = repeated_list(root, signature)
    if found is None:
        return None
    path, full = found
    parent = root.get_submodule(path.rsplit(".", 1)[0]) if "." in path else root
    attr = path.rsplit(".", 1)[-1]
    parent._modules[attr] = nn.ModuleList(list(full)[:KEEP])
    try:
        return run(root), path, len(full)
    except Exception:  # noqa: BLE001 - the forward needs all its layers: the caller runs it whole
        return None
    finally:
        parent._modules[attr] = full


def _layer_of(n: fx.Node, prefix: str) -> int | None:
    """The index of the layer of ``prefix`` node ``n`` belongs to."""
    if n.op == "get_attr":
        m = re.match(re.escape(prefix) + r"\.(\d+)\.", str(n.target))
        return int(m.group(1)) if m else None
    for v in (n.meta.get("nn_module_stack") or {}).values():
        p = v[0] if isinstance(v, tuple) else str(v)
        m = re.fullmatch(re.escape(prefix) + r"\.(\d+)(\..*)?", p)
        if m:
            return int(m.group(1))
    return None


def _renamed(value: Any, old: str, new: str, memo: dict[str, str] | None = None) -> Any:
    """``value`` (a module path, a tuple of them, a stack dict) with the layer path ``old`` read as ``new``.
    ``memo``: the strings already renamed from ``old`` to ``new`` (a layer's nodes share a few
    module paths, so a copy renames each once)."""
    if isinstance(value, str):
        if memo is not None:
            hit = memo.get(value)
            if hit is None:
                hit = memo[value] = _renamed(value, old, new)
            return hit
        if value == old or value.startswith(old + "."):
            return new + value[len(old):]
        key_old, key_new = old.replace(".", "_"), new.replace(".", "_")   # stack keys: L__self__model_layers_2
        return re.sub(re.escape(key_old) + r"(?=$|[._])", key_new, value) if key_old in value else value
    if isinstance(value, tuple):
        return tuple(_renamed(v, old, new, memo) for v in value)
    if isinstance(value, dict):
        return {_renamed(k, old, new, memo): _renamed(v, old, new, memo) for k, v in value.items()}
    return value


def _replicate(gm: fx.GraphModule, prefix: str, layers: int, root: nn.Module) -> fx.GraphModule | None:
    """Write layers ``KEEP..layers-1`` into ``gm`` as copies of layer
    ``KEEP-1``; None when the graph is not a chain of layers that allows it."""
    g = gm.graph
    nodes = list(g.nodes)
    layer = {n: _layer_of(n, prefix) for n in nodes}
    per = {i: [n for n in nodes if layer[n] == i] for i in range(KEEP)}
    last, prev = per[KEEP - 1], per[KEEP - 2]
    if not last or len(last) != len(prev) or any(
            a.op != b.op or (a.target != b.target and a.op != "get_attr") for a, b in zip(last, prev)):
        return None
    body = [n for n in last if n.op != "get_attr"]
    pos = {n: i for i, n in enumerate(nodes)}
    two = [n for n in prev if n.op != "get_attr"] + body
    if any(pos[b] - pos[a] != 1 for a, b in zip(two, two[1:])):
        return None     # the last two layers are not one run of the graph: code runs between them
    index_in = {n: i for i, n in enumerate(last)}
    prev_index = {n: i for i, n in enumerate(prev)}
    for n in body:      # a layer reads the previous one and what came before the layers, nothing else
        for a in n.all_input_nodes:
            if layer[a] is not None and layer[a] < KEEP - 2:
                return None
    tail = nodes[pos[body[-1]] + 1:]
    if any(layer[a] is not None and layer[a] < KEEP - 1 for n in tail for a in n.all_input_nodes):
        return None

    old_path = f"{prefix}.{KEEP - 1}"
    copies: list[list[fx.Node]] = [last]
    attr_cursor = [n for n in last if n.op == "get_attr"]
    attr_cursor = attr_cursor[-1] if attr_cursor else None
    cursor = body[-1]
    for k in range(KEEP, layers):
        new_path, src = f"{prefix}.{k}", copies[-1]
        made: list[fx.Node] = []
        env: dict[fx.Node, fx.Node] = {}
        names: dict[str, str] = {}

        def arg(a: fx.Node) -> fx.Node:
            if a in env:
                return env[a]
            if a in prev_index:        # the previous layer's value: the last copy's
                return src[prev_index[a]]
            return a

        for n in last:
            if n.op == "get_attr":
                target = _renamed(str(n.target), old_path, new_path, names)
                _copy_state(gm, root, target)
                with g.inserting_after(attr_cursor):
                    new = g.get_attr(target)
                attr_cursor = new
            else:
                with g.inserting_after(cursor):
                    new = g.node_copy(n, arg)
                cursor = new
            new.meta = {**{key: (_renamed(v, old_path, new_path, names) if key == "nn_module_stack" else v)
                           for key, v in n.meta.items()}, **({"autopar_copy": True} if n.op == "get_attr" else {})}
            env[n] = new
            made.append(new)
        copies.append(made)
    if not _order_state(g, root):
        return None
    final = copies[-1]
    for n in tail:
        n.args, n.kwargs = fx.map_arg((n.args, n.kwargs), lambda a: final[index_in[a]] if a in index_in else a)
    _rename_in_order(g, [n for n in nodes if n.op != "get_attr"])
    g.lint()
    gm.recompile()
    return gm


def _order_state(g: fx.Graph, root: nn.Module) -> bool:
    """Put the get_attr nodes in the order export gives them: the model's
    parameters, then its buffers, each in module order. False (and nothing
    moved) when the exported ones were not in that order."""
    rank = {name: i for i, name in enumerate(
        [n for n, _ in root.named_parameters(remove_duplicate=False)] +
        [n for n, _ in root.named_buffers(remove_duplicate=False)])}
    attrs = [n for n in g.nodes if n.op == "get_attr"]
    if any(str(n.target) not in rank for n in attrs):
        return False
    old = [n for n in attrs if not n.meta.get("autopar_copy")]
    if [rank[str(n.target)] for n in old] != sorted(rank[str(n.target)] for n in old):
        return False
    ordered = sorted(attrs, key=lambda n: rank[str(n.target)])
    anchor = next(n for n in g.nodes if n.op != "get_attr")
    for n in ordered:
        anchor.prepend(n)
    return True


def _copy_state(gm: fx.GraphModule, root: nn.Module, target: str) -> None:
    """Make ``gm`` hold the full model's tensor at ``target`` (nested modules created as needed)."""
    *mods, name = target.split(".")
    owner: nn.Module = gm
    for m in mods:
        if not hasattr(owner, m):
            owner.add_module(m, nn.Module())
        owner = getattr(owner, m)
    src = root.get_parameter(target) if target in dict(root.named_parameters()) else root.get_buffer(target)
    if isinstance(src, nn.Parameter):
        owner.register_parameter(name, src)
    else:
        owner.register_buffer(name, src)


def _rename_in_order(g: fx.Graph, original: list[fx.Node]) -> None:
    """Name every op node as export names it: per name base, a counter in
    graph order, continued from where the exported nodes started it (export's
    first ``slice`` is ``slice_1``); get_attr nodes take their target's name."""
    first: dict[str, int] = {}
    for n in original:
        base, num = _SUFFIX.match(n.name).groups()
        first.setdefault(base, int(num) if num else 0)
    seen: Counter[str] = Counter()
    for n in g.nodes:
        if n.op == "get_attr":
            n.name = str(n.target).replace(".", "_")
        elif n.op not in ("placeholder", "output"):
            base = _SUFFIX.match(n.name).group(1)
            num = first.get(base, 0) + seen[base]
            seen[base] += 1
            n.name = base if num == 0 else f"{base}_{num}"
    space = fx.graph._Namespace()      # the graph's own record of the names, rebuilt
    for n in g.nodes:
        if space.create_name(n.name, n) != n.name:
            raise AssertionError(f"shallow export named two nodes {n.name!r}")
    g._graph_namespace = space


# -- the same for torch.fx ---------------------------------------------------------------
def trace_shallow(root: nn.Module, trace: Callable[[nn.Module], fx.Graph],
                  signature: Callable[[nn.Module], str]) -> fx.Graph | None:
    """``trace(root)`` (a ``torch.fx`` symbolic trace) with the longest
    repeated layer list cut to :data:`KEEP` layers, the rest written in as
    copies of the last traced one; None when the model has no such list,
    its forward needs every layer, or its graph is not a plain chain of
    layers (the caller then traces it whole).

    The copies are made as the tracer makes nodes, in the order it would
    (every node made again from its target, so fx names it exactly as in a
    whole trace), with the layer's path in targets and module stacks
    changed. A 96-layer GPT-3 is traced in the time of three layers."""
    cut = _with_first_layers(root, signature, trace)
    if cut is None:
        return None
    graph, path, layers = cut
    return _extend(graph, path, layers)


def _roles(layer_nodes: list[fx.Node], before: list[fx.Node], path: str) -> list[tuple]:
    """Each node of the layer at ``path`` as a copy sees it: op, target (the
    layer's own modules by their path in it), and arguments with nodes named
    by role (this layer's ``i``-th node, the previous layer's, or a node
    before the layers)."""
    mine = {n: i for i, n in enumerate(layer_nodes)}
    theirs = {n: i for i, n in enumerate(before)}

    def role(a: fx.Node) -> Any:
        return ("in", mine[a]) if a in mine else ("prev", theirs[a]) if a in theirs else ("ext", a.name)

    return [(n.op, _renamed(n.target, path, "") if n.op in ("call_module", "get_attr") else n.target,
             repr(fx.map_arg((n.args, n.kwargs), role))) for n in layer_nodes]


def _extend(graph: fx.Graph, prefix: str, layers: int) -> fx.Graph | None:
    """``graph`` (with layers ``0..KEEP-1`` of ``prefix``) with layers
    ``KEEP..layers-1`` written in, as a new graph made node by node in a
    whole trace's order; None when the graph does not allow it."""
    nodes = list(graph.nodes)
    layer = {n: _layer_of(n, prefix) for n in nodes}
    per = {i: [n for n in nodes if layer[n] == i] for i in range(KEEP)}
    first, prev, last = per[0], per[KEEP - 2], per[KEEP - 1]
    if not first or len(last) != len(prev) or \
            _roles(last, prev, f"{prefix}.{KEEP - 1}") != _roles(prev, per[KEEP - 3], f"{prefix}.{KEEP - 2}"):
        return None     # the last two layers are not one steady state
    pos = {n: i for i, n in enumerate(nodes)}
    start, end = pos[first[0]], pos[last[-1]]
    if any(layer[n] is None for n in nodes[start:end + 1]) or \
            any(pos[b] - pos[a] != 1 for a, b in zip(prev + last, (prev + last)[1:])):
        return None     # code between the layers
    if any(layer[a] is not None and layer[a] < KEEP - 1 for n in nodes[end + 1:] for a in n.all_input_nodes):
        return None     # what follows the layers reads an inner one
    for n in last:
        if n.op in ("call_module", "get_attr") and not str(n.target).startswith(f"{prefix}.{KEEP - 1}."):
            return None     # a constant or module of the tracer's own: one per layer in a whole trace

    new = fx.Graph(tracer_cls=graph._tracer_cls)
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    traced = True       # making the nodes the trace made (named alike), not yet those after the copies

    def make(n: fx.Node, target: Any, args: Any, meta: dict) -> fx.Node:
        name = n.name if n.op == "placeholder" else None    # the tracer names the others by target
        out = new.create_node(n.op, target, *args, name=name, type_expr=n.type)
        out.meta = meta
        return out

    old_path = f"{prefix}.{KEEP - 1}"
    for n in nodes:
        env[n] = make(n, n.target, fx.map_arg((n.args, n.kwargs), env.__getitem__), dict(n.meta))
        if traced and env[n].name != n.name:
            return None     # named otherwise than the trace did: not made as the tracer makes them
        if n is not last[-1]:
            continue
        traced = False
        copy_of_prev = {p: env[q] for p, q in zip(prev, last)}
        for k in range(KEEP, layers):
            new_path = f"{prefix}.{k}"
            made: dict[fx.Node, fx.Node] = {}
            names: dict[str, str] = {}
            for m in last:
                def arg(a: fx.Node) -> fx.Node:
                    return made[a] if a in made else copy_of_prev[a] if a in copy_of_prev else env[a]
                target = _renamed(m.target, old_path, new_path, names) \
                    if m.op in ("call_module", "get_attr") else m.target
                meta = {key: _renamed(v, old_path, new_path, names) if key == "nn_module_stack" else v
                        for key, v in m.meta.items()}
                made[m] = make(m, target, fx.map_arg((m.args, m.kwargs), arg), meta)
            copy_of_prev = {p: made[q] for p, q in zip(prev, last)}
        for p, q in zip(prev, last):      # what follows reads the last copy
            env[q] = copy_of_prev[p]
    return new
