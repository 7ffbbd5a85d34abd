"""Turn the repeated layers of a compiled program into submodules.

:func:`layer_regions` rewrites a program :func:`autopar.compile.rewrite.compile_local`
built (the whole model + loss, or one pipeline stage's ``GraphModule`` from
:func:`autopar.compile.stages.split_stages`) so that every repeated-layer
instance becomes a :class:`~autopar.runtime.regions.Region` submodule called
once from the parent graph; the runtime recomputes
(:func:`~autopar.runtime.regions.apply_recompute`) and shards
(:func:`~autopar.runtime.regions.fully_shard_regions`) those regions.

Which node goes where:

* a traced node of a layer (its :class:`~autopar.graph.Node` has ``.group``)
  goes to that layer's region; a contiguous run (in program order) of nodes of
  one group is one region. Nodes without a group stay on the parent;
* a node the compiler inserted (tensor-parallel collectives, scale factors)
  goes where its first user goes, as in ``split_stages``;
* *free* nodes (computed from graph inputs, buffers and constants only: sizes,
  positions, rotary tables) and ``get_attr`` reads float: into the one region
  that reads them all, else they stay on the parent and are passed to the
  regions as inputs;
* a parameter (or buffer) read only inside one region becomes that region's
  own parameter; one read in several regions or by the parent stays on the
  parent (FSDP2's root unit) and reaches the regions as an input.

Parameter names (``named_parameters()`` of the result): a region sits at its
group's path (``model.blocks.0``) and holds its parameters under their path
relative to the group (``ln_1.weight``), so ``model.blocks.0.ln_1.weight``
keeps its name; the parent keeps its parameters under their program names.
Only when a path is taken (a parameter of a layer shared with another region
stays on the parent at ``model.blocks.0.x``) does the name change: the shared
parameter moves to ``_autopar_shared.<path with dots as "__">``, and a second
run of one group gets ``_autopar_region_<k>``. ``module.param_names`` (and
``module.buffer_names``) is always the exact dict ``new name -> name in the
program``; :func:`autopar.runtime.regions.param_names` gives it for any
module that contains regions.

The result shares the input program's parameter tensors (no copy); FSDP2
later replaces them with ``DTensor`` shards on the modules it wraps.
"""
from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import CompileError
from ..graph import Graph
from ..runtime.regions import Region, keep_begin, keep_end
from ..sharding import selective_keeps
from .fx_utils import free_nodes, get_attr

__all__ = ["layer_regions", "layer_labels"]

_PARENT = -1      # run id of the parent graph


#: ops that update a tensor argument in place although their name does not end with "_"
_MUTATING = {"batch_norm", "instance_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"}


def _mutated_buffers(graph: fx.Graph, attrs: dict[str, Any]) -> list[str]:
    """Targets of the buffers a region's ``graph`` may update in place
    (``attrs``: its ``get_attr`` targets' objects): arguments of batch /
    instance norm and of in-place ops (names ending with one "_")."""
    out: list[str] = []
    for n in graph.nodes:
        if n.op != "get_attr" or not isinstance(attrs[n.target], torch.Tensor) or \
                isinstance(attrs[n.target], nn.Parameter):
            continue
        for u in n.users:
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            if u.op == "call_module" or name in _MUTATING or (name.endswith("_") and not name.endswith("__")):
                out.append(n.target)
                break
    return list(dict.fromkeys(out))


def _labels(gm: fx.GraphModule, graph: Graph, free: set[str]) -> dict[str, str | None]:
    """The layer instance (group) of every node that is not floating (not a
    placeholder, output, ``get_attr`` or free node); None for the parent.
    Nodes the compiler inserted take the label of their first user."""
    src = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
    label: dict[str, str | None] = {}
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    copy_of = gm.meta.get("autopar_copy_of", {})     # multi-copy: the node each copy's node repeats
    for n in reversed(gm.graph.nodes):
        if n.op in ("placeholder", "output", "get_attr") or n.name in free:
            continue
        name = copy_of.get(n.name, n.name)
        s = src.get(name)
        if name in graph and (not src or s is not None and (s.op, s.target) == (n.op, n.target)):
            label[n.name] = graph[name].group
        else:
            users = sorted((u for u in n.users if u.name in label), key=lambda u: order[u.name])
            label[n.name] = label[users[0].name] if users else None
    return label


def layer_labels(gm: fx.GraphModule, graph: Graph) -> dict[str, str | None]:
    """The layer instance of every non-floating node of ``gm`` (None: the
    parent), as :func:`layer_regions` groups them."""
    return _labels(gm, graph, free_nodes(gm))


def _runs(gm: fx.GraphModule, label: dict[str, str | None]) -> tuple[dict[str, int], list[str]]:
    """Runs of consecutive non-floating nodes of one group: node -> run id
    (:data:`_PARENT` for parent nodes), and the group of every run."""
    run_of: dict[str, int] = {}
    groups: list[str] = []
    prev: str | None = None
    for n in gm.graph.nodes:
        if n.name not in label:
            continue
        g = label[n.name]
        if g is None:
            run_of[n.name] = _PARENT
        else:
            if g != prev:
                groups.append(g)
            run_of[n.name] = len(groups) - 1
        prev = g
    return run_of, groups


def _place_floating(gm: fx.GraphModule, run_of: dict[str, int]) -> None:
    """Free nodes and ``get_attr`` reads: into the one run that reads them
    (all the reads of one tensor count together), else the parent."""
    nodes = list(gm.graph.nodes)
    for n in reversed(nodes):
        if n.name in run_of or n.op in ("get_attr", "placeholder", "output"):
            continue
        runs = {run_of.get(u.name, _PARENT) for u in n.users}
        run_of[n.name] = runs.pop() if len(runs) == 1 else _PARENT
    reads: dict[int, list[fx.Node]] = {}     # one entry per tensor, over all its targets
    for n in nodes:
        if n.op == "get_attr":
            reads.setdefault(id(get_attr(gm, n.target)), []).append(n)
    for group in reads.values():
        runs = {run_of.get(u.name, _PARENT) for n in group for u in n.users}
        where = runs.pop() if len(runs) == 1 else _PARENT
        for n in group:
            run_of[n.name] = where


def _prefix_free(paths: list[str]) -> bool:
    s = sorted(paths)
    return all(not (b == a or b.startswith(a + ".")) for a, b in zip(s, s[1:]))


def _clashes(path: str, others: list[str]) -> bool:
    return any(o == path or o.startswith(path + ".") or path.startswith(o + ".") for o in others)


def layer_regions(gm: fx.GraphModule, graph: Graph, keep: frozenset[str] | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` (a compiled program of the whole model, or one pipeline
    stage's module) so that each repeated-layer instance runs as one
    :class:`~autopar.runtime.regions.Region` submodule.

    ``keep``: the nodes of ``graph`` whose outputs selective recompute keeps
    (:func:`autopar.sharding.selective_keeps` under the program's
    tensor-parallel decisions; None: as on one device). Each runs between
    the markers :func:`~autopar.runtime.regions.keep_begin` and
    :func:`~autopar.runtime.regions.keep_end`, which the selective policy
    reads.

    Returns a new ``fx.GraphModule`` (class ``AutoparRegions``) computing the
    same values and gradients as ``gm``, sharing its parameters, with
    attributes ``region_paths`` (group -> submodule path, in program order),
    ``param_names`` / ``buffer_names`` (new name -> name in ``gm``). A program
    without repeated layers comes back with no region. Raises
    :class:`CompileError` when the regions cannot be placed next to the
    program's attributes or one computes nothing the rest reads.
    """
    free = free_nodes(gm)
    label = _labels(gm, graph, free)
    run_of, run_groups = _runs(gm, label)
    _place_floating(gm, run_of)
    nodes = list(gm.graph.nodes)
    members: list[list[fx.Node]] = [[] for _ in run_groups]
    for n in nodes:
        r = run_of.get(n.name, _PARENT)
        if r != _PARENT:
            members[r].append(n)
    last = {r: max((k for k, n in enumerate(nodes) if run_of.get(n.name) == r and n.name in label), default=-1)
            for r in range(len(run_groups))}
    parent_targets = sorted({n.target for n in nodes if run_of.get(n.name, _PARENT) == _PARENT
                             and n.op in ("get_attr", "call_module")})
    region_path, run_keys, moved = _paths(run_groups, parent_targets)
    keep = selective_keeps(graph) if keep is None else keep
    copy_of = gm.meta.get("autopar_copy_of", {})
    marked = {n.name for n in nodes if copy_of.get(n.name, n.name) in keep and label.get(n.name) is not None}
    built = [_region(gm, nodes, own, group, marked) for own, group in zip(members, run_groups)]
    out = _parent(gm, nodes, run_of, {k: r for r, k in last.items()}, region_path, built, moved)
    original = {}
    for n in nodes:
        if n.op == "get_attr":
            original.setdefault(id(get_attr(gm, n.target)), n.target)
    for name, p in gm.named_parameters():
        original.setdefault(id(p), name)
    for name, b in gm.named_buffers():
        original.setdefault(id(b), name)
    out.region_paths = dict(zip(run_keys, region_path))
    out.param_names = {name: original[id(p)] for name, p in out.named_parameters()}
    out.buffer_names = {name: original[id(b)] for name, b in out.named_buffers()}
    out.meta["autopar_regions"] = {"region_paths": out.region_paths, "param_names": out.param_names,
                                   "buffer_names": out.buffer_names}     # survives deepcopy
    return out


def _paths(run_groups: list[str], parent_targets: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """Where each run's region sits (its group's path, unless taken), each
    run's key in ``region_paths`` (the group, then ``"group#k"`` for its k-th
    further run), and the parent attributes moved out of a region's path."""
    seen: dict[str, int] = {}
    region_path: list[str] = []
    run_keys: list[str] = []
    for r, g in enumerate(run_groups):
        k = seen.get(g, 0)
        seen[g] = k + 1
        region_path.append(g if k == 0 else f"_autopar_region_{r}")
        run_keys.append(g if k == 0 else f"{g}#{k}")
    # a parent attribute inside a region's path (a layer's weight shared with
    # another region) moves out of the way; then a region whose path still
    # clashes (a group nested in another) gets a neutral name
    moved: dict[str, str] = {}
    for t in parent_targets:
        if any(t.startswith(p + ".") for p in region_path):
            moved[t] = "_autopar_shared." + t.replace(".", "__")
    kept = [moved.get(t, t) for t in parent_targets]
    for r, p in enumerate(region_path):
        if _clashes(p, kept) or _clashes(p, region_path[:r] + region_path[r + 1:]):
            region_path[r] = f"_autopar_region_{r}"
    if not _prefix_free(kept + region_path):
        raise CompileError(f"cannot place the layer regions {region_path} next to the program's attributes")
    return region_path, run_keys, moved


def _region(gm: fx.GraphModule, nodes: list[fx.Node], own: list[fx.Node], group: str,
            marked: set[str] = frozenset()) -> Region:
    """The :class:`Region` running the nodes ``own`` of layer ``group``: its
    inputs are the values it reads from elsewhere, its outputs those read
    elsewhere; its attributes sit under their path relative to the group.
    The ``marked`` nodes run between the keep markers."""
    names = {n.name for n in own}
    ins: list[str] = []
    outs: list[str] = []
    for n in nodes:
        if n.name in names:
            if any(u.name not in names for u in n.users):
                outs.append(n.name)
        elif any(u.name in names for u in n.users):
            ins.append(n.name)
    pre = group + "."
    targets = sorted({n.target for n in own if n.op in ("get_attr", "call_module")})
    local = {t: (t[len(pre):] if t.startswith(pre) else t) for t in targets}
    if not _prefix_free(list(local.values())):
        local = {t: t for t in targets}
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in ins:
        env[name] = g.placeholder(name)
    attrs: dict[str, Any] = {}
    for n in own:
        if n.name in marked:
            g.call_function(keep_begin)
        c = g.node_copy(n, lambda a: env[a.name])
        if n.name in marked:
            g.call_function(keep_end)
        if n.op in ("get_attr", "call_module"):
            c.target = local[n.target]
            attrs[c.target] = get_attr(gm, n.target)
        env[n.name] = c
    if not outs:
        raise CompileError(f"layer region {group!r} computes nothing the rest of the program reads")
    g.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))
    g.lint()
    return Region(group, g, attrs, ins, outs, mutated_buffers=_mutated_buffers(g, attrs))


def _parent(gm: fx.GraphModule, nodes: list[fx.Node], run_of: dict[str, int], at_end: dict[int, int],
            region_path: list[str], built: list[Region], moved: dict[str, str]) -> fx.GraphModule:
    """The parent graph: ``gm``'s nodes outside regions, and a call of region
    ``r`` after its last node (``at_end``: node index -> run)."""
    pg = fx.Graph()
    penv: dict[str, fx.Node] = {}
    pattrs: dict[str, Any] = {}
    for k, n in enumerate(nodes):
        if run_of.get(n.name, _PARENT) == _PARENT:
            c = pg.node_copy(n, lambda a: penv[a.name])
            if n.op in ("get_attr", "call_module"):
                c.target = moved.get(n.target, n.target)
                pattrs[c.target] = get_attr(gm, n.target)
            penv[n.name] = c
        if k in at_end:
            r = at_end[k]
            path = region_path[r]
            pattrs[path] = built[r]
            call = pg.create_node("call_module", path, tuple(penv[i] for i in built[r].inputs),
                                  name=re.sub(r"\W", "_", path))
            outs = built[r].outputs
            if len(outs) == 1:
                penv[outs[0]] = call
            else:
                for j, o in enumerate(outs):
                    penv[o] = pg.create_node("call_function", operator.getitem, (call, j), name=o)
    pg.lint()
    return fx.GraphModule(pattrs, pg, class_name="AutoparRegions")
