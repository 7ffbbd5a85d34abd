"""Layer regions of a compiled program: one submodule per repeated layer, for
activation recompute and ZeRO-3 (FSDP2).

:func:`layer_regions` rewrites a program :func:`autopar.compile.rewrite.compile_local`
built (the whole model + loss, or one pipeline stage's ``GraphModule`` from
:func:`autopar.runtime.pipeline.split_stages`) so that every repeated-layer
instance becomes a :class:`Region` submodule called once from the parent
graph. On it:

* :func:`apply_recompute` runs each region under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, keeping only
  its inputs (``"full"``) or also the outputs of the matmul-family ops
  (``"selective"``, torch's selective activation checkpointing);
* :func:`fully_shard_regions` applies ZeRO-3 with torch FSDP2: one
  ``fully_shard`` unit per region, then the root unit (which keeps the
  embedding, the head, the final norm and every parameter shared by several
  regions, e.g. tied weights).

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
program``; :func:`param_names` gives it for any module that contains regions.

The result shares the input program's parameter tensors (no copy); FSDP2
later replaces them with ``DTensor`` shards on the modules it wraps.

Gradient accumulation under FSDP2: every backward reduce-scatters the region's
gradients over ``dp_mesh`` and *adds* them to the sharded ``.grad``; the
reduction is the mean over the data-parallel ranks (FSDP2's default divide
factor is the dp size), so with each rank's loss the mean over its own
(equal-sized) part of the batch, the gradient is the gradient of the global
mean loss, as DDP / :class:`autopar.runtime.collectives.GradSync` give. Over
``m`` microbatches scale each loss by ``1 / m`` (as ``train_step`` does) and
the sharded gradients accumulate to the mean. To trade memory for traffic, call
``module.set_requires_gradient_sync(False)`` before all but the last
microbatch's backward (FSDP2 then keeps unsharded fp32-or-reduce_dtype
gradients and reduces once).
"""
from __future__ import annotations

import functools
import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..compile.rewrite import _get_attr
from ..errors import CompileError
from ..graph import Graph
from .pipeline import _free_nodes

__all__ = ["Region", "layer_regions", "regions", "param_names", "apply_recompute", "recompute_policy",
           "SAVE_OPS", "fully_shard_regions", "full_tensor", "full_state_dict", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = ("none", "full", "selective")
_PARENT = -1      # run id of the parent graph


def _ops(*names: str) -> frozenset:
    """The aten overload packets among ``names`` this torch has."""
    out = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            out.append(packet)
    return frozenset(out)


#: aten ops whose outputs selective recompute saves (every overload); all
#: other ops of a region (norms, activations, softmax, dropout, elementwise,
#: views) are recomputed in backward
SAVE_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                "_efficient_attention_forward")


def recompute_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective-checkpoint policy: save the outputs of :data:`SAVE_OPS`,
    recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(recompute_policy)


class Region(nn.Module):
    """One repeated-layer instance of a program, called once from its parent.

    ``forward(*inputs)`` takes the values named by ``inputs`` (program node
    names) and returns the values named by ``outputs`` (a single value when
    there is one, else a tuple). ``recompute`` (``"none"``, ``"full"``,
    ``"selective"``) says how its activations are kept for backward; set it
    with :func:`apply_recompute`. ``group`` is the layer instance
    (``"model.blocks.0"``), ``nodes`` the program nodes it runs, ``code`` its
    Python source.
    """

    def __init__(self, group: str, graph: fx.Graph, attrs: dict[str, Any], inputs: list[str],
                 outputs: list[str]) -> None:
        super().__init__()
        gm = fx.GraphModule(attrs, graph, class_name="AutoparRegion")
        # adopt the attribute tree fx built (shared objects), so that the
        # generated code, run with this module as ``self``, reads our params
        for name, mod in gm._modules.items():
            self.add_module(name, mod)
        for name, p in gm._parameters.items():
            self.register_parameter(name, p)
        for name, b in gm._buffers.items():
            self.register_buffer(name, b)
        for target in attrs:
            head = target.split(".", 1)[0]
            if head not in self._modules and head not in self._parameters and head not in self._buffers:
                setattr(self, head, getattr(gm, head))
        # the generated function, not the GraphModule: that one would keep the
        # unsharded parameters alive after FSDP2 swapped in its shards
        self._fn = type(gm).forward
        self.code = gm.code
        self.group = group
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.nodes = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        self.mutated_buffers = _mutated_buffers(gm)
        self.recompute = "none"

    def forward(self, *args: Any) -> Any:
        mode = self.recompute
        if mode == "none" or not torch.is_grad_enabled():
            return self._fn(self, *args)
        from torch.utils.checkpoint import checkpoint
        if mode not in RECOMPUTE_MODES:
            raise CompileError(f"unknown recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
        ctx = {"context_fn": _selective_context} if mode == "selective" else {}
        return checkpoint(self._recomputable(), *args, use_reentrant=False, preserve_rng_state=True, **ctx)

    def _recomputable(self) -> Any:
        """This call's function for checkpoint. Buffers the region updates in
        place (BatchNorm's running statistics) are, during the recompute,
        swapped for copies of the values they had before this call's forward:
        the recompute sees what the forward saw and does not update the real
        buffers a second time. (Swapped by module attribute, not by copying,
        so that selective recompute's dispatch mode sees no extra op.)"""
        names = self.mutated_buffers
        if not names:
            return functools.partial(self._fn, self)
        owners = []
        for name in names:
            path, _, attr = name.rpartition(".")
            owners.append((self.get_submodule(path) if path else self, attr))
        before = [mod._buffers[attr].detach().clone() for mod, attr in owners]
        ran = [False]

        def run(*args: Any) -> Any:
            if not ran[0]:
                ran[0] = True
                return self._fn(self, *args)
            now = [mod._buffers[attr] for mod, attr in owners]
            for (mod, attr), scratch in zip(owners, before):
                mod._buffers[attr] = scratch
            try:
                return self._fn(self, *args)
            finally:
                for (mod, attr), b in zip(owners, now):
                    mod._buffers[attr] = b
        return run

    def extra_repr(self) -> str:
        return f"{self.group!r}, {len(self.nodes)} nodes, recompute={self.recompute}"


#: ops that update a tensor argument in place although their name does not end with "_"
_MUTATING = {"batch_norm", "instance_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"}


def _mutated_buffers(gm: fx.GraphModule) -> list[str]:
    """Buffers of ``gm`` that an op may update in place: arguments of
    batch/instance norm and of in-place ops (names ending with one "_")."""
    out: list[str] = []
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not isinstance(_get_attr(gm, n.target), torch.Tensor) or \
                isinstance(_get_attr(gm, n.target), nn.Parameter):
            continue
        for u in n.users:
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            if u.op == "call_module" or name in _MUTATING or (name.endswith("_") and not name.endswith("__")):
                out.append(n.target)
                break
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- cutting
def _labels(gm: fx.GraphModule, graph: Graph, free: set[str]) -> dict[str, str | None]:
    """The layer instance (group) of every node that is not floating (not a
    placeholder, output, ``get_attr`` or free node); None for the parent.
    Nodes the compiler inserted take the label of their first user."""
    src = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
    label: dict[str, str | None] = {}
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    for n in reversed(gm.graph.nodes):
        if n.op in ("placeholder", "output", "get_attr") or n.name in free:
            continue
        s = src.get(n.name)
        if n.name in graph and (not src or s is not None and (s.op, s.target) == (n.op, n.target)):
            label[n.name] = graph[n.name].group
        else:
            users = sorted((u for u in n.users if u.name in label), key=lambda u: order[u.name])
            label[n.name] = label[users[0].name] if users else None
    return label


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
            reads.setdefault(id(_get_attr(gm, n.target)), []).append(n)
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


def layer_regions(gm: fx.GraphModule, graph: Graph) -> fx.GraphModule:
    """Rewrite ``gm`` (a compiled program of the whole model, or one pipeline
    stage's module) so that each repeated-layer instance runs as one
    :class:`Region` submodule.

    Returns a new ``fx.GraphModule`` (class ``AutoparRegions``) computing the
    same values and gradients as ``gm``, sharing its parameters, with
    attributes ``region_paths`` (group -> submodule path, in program order),
    ``param_names`` / ``buffer_names`` (new name -> name in ``gm``). A program
    without repeated layers comes back with no region.
    """
    free = _free_nodes(gm)
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
    at_end = {k: r for r, k in last.items()}

    # -- attribute paths: regions at their group's path, parent reads elsewhere
    parent_targets = sorted({n.target for n in nodes if run_of.get(n.name, _PARENT) == _PARENT
                             and n.op in ("get_attr", "call_module")})
    seen: dict[str, int] = {}
    region_path: list[str] = []
    run_keys: list[str] = []        # the group, then "group#k" for its k-th further run
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

    # -- region graphs
    region_mods: list[Region] = []
    region_inputs: list[list[str]] = []
    region_outputs: list[list[str]] = []
    for r, own in enumerate(members):
        names = {n.name for n in own}
        ins: list[str] = []
        outs: list[str] = []
        for n in nodes:
            if n.name in names:
                if any(u.name not in names for u in n.users):
                    outs.append(n.name)
            elif any(u.name in names for u in n.users):
                ins.append(n.name)
        group = run_groups[r]
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
            c = g.node_copy(n, lambda a: env[a.name])
            if n.op in ("get_attr", "call_module"):
                c.target = local[n.target]
                attrs[c.target] = _get_attr(gm, n.target)
            env[n.name] = c
        if not outs:
            raise CompileError(f"layer region {group!r} computes nothing the rest of the program reads")
        g.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))
        g.lint()
        region_mods.append(Region(group, g, attrs, ins, outs))
        region_inputs.append(ins)
        region_outputs.append(outs)

    # -- parent graph
    pg = fx.Graph()
    penv: dict[str, fx.Node] = {}
    pattrs: dict[str, Any] = {}
    for k, n in enumerate(nodes):
        if run_of.get(n.name, _PARENT) == _PARENT:
            c = pg.node_copy(n, lambda a: penv[a.name])
            if n.op in ("get_attr", "call_module"):
                c.target = moved.get(n.target, n.target)
                pattrs[c.target] = _get_attr(gm, n.target)
            penv[n.name] = c
        if k in at_end:
            r = at_end[k]
            path = region_path[r]
            pattrs[path] = region_mods[r]
            call = pg.create_node("call_module", path, tuple(penv[i] for i in region_inputs[r]),
                                  name=re.sub(r"\W", "_", path))
            outs = region_outputs[r]
            if len(outs) == 1:
                penv[outs[0]] = call
            else:
                for j, o in enumerate(outs):
                    penv[o] = pg.create_node("call_function", operator.getitem, (call, j), name=o)
    pg.lint()
    out = fx.GraphModule(pattrs, pg, class_name="AutoparRegions")
    original = {}
    for n in nodes:
        if n.op == "get_attr":
            original.setdefault(id(_get_attr(gm, n.target)), n.target)
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


# ----------------------------------------------------------------------------- helpers
def regions(module: nn.Module) -> dict[str, Region]:
    """The :class:`Region` submodules of ``module`` by path, in module order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Region)}


def param_names(module: nn.Module) -> dict[str, str]:
    """``new name -> name in the program`` for the parameters of ``module``
    (what :func:`layer_regions` recorded; identity where nothing was recorded)."""
    rec = getattr(module, "param_names", None)
    if not isinstance(rec, dict):
        rec = (getattr(module, "meta", None) or {}).get("autopar_regions", {}).get("param_names")
    names = [n for n, _ in module.named_parameters()]
    if isinstance(rec, dict):
        return {n: rec.get(n, n) for n in names}
    return {n: n for n in names}


def apply_recompute(module: nn.Module, mode: str) -> nn.Module:
    """Make every region of ``module`` recompute its activations in backward:
    ``"full"`` keeps only each region's inputs, ``"selective"`` also the
    outputs of :data:`SAVE_OPS` (matmuls, attention, convolutions); ``"none"``
    switches it off. Works before or after :func:`fully_shard_regions` (the
    checkpoint runs inside the FSDP unit's hooks, as torchtitan nests them).
    Returns ``module`` (changed in place)."""
    if mode not in RECOMPUTE_MODES:
        raise CompileError(f"unknown recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    found = regions(module)
    if mode != "none" and not found:
        raise CompileError("recompute needs layer regions: rewrite the program with layer_regions() first")
    for r in found.values():
        r.recompute = mode
    return module


def fully_shard_regions(module: nn.Module, dp_mesh: Any, *, param_dtype: torch.dtype | None = None,
                        reduce_dtype: torch.dtype | None = None, offload: bool = False,
                        reshard_after_forward: bool = True) -> nn.Module:
    """ZeRO-3 with torch FSDP2 over the 1-D ``dp_mesh``: ``fully_shard`` on
    every region that has parameters, then on ``module`` (the root unit, with
    the parameters outside regions and those shared by several regions).

    ``param_dtype`` / ``reduce_dtype``: FSDP2's ``MixedPrecisionPolicy``
    (compute and gradient-reduction dtypes; the sharded master weights and the
    optimizer state stay in the parameters' dtype). ``offload``: keep the
    shards (and their gradients; the optimizer step then runs on the CPU) in
    host memory (``CPUOffloadPolicy``). Parameters already sharded for tensor
    parallelism are plain local tensors and are sharded again along dp.
    Returns ``module``, now an ``FSDPModule`` (``set_requires_gradient_sync``,
    ``reshard``, ...).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if dp_mesh is None or dp_mesh.ndim != 1:
        raise CompileError("fully_shard_regions needs a 1-D DeviceMesh over the data-parallel ranks "
                           "(e.g. Mesh.device_mesh['dp'])")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    off = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for r in regions(module).values():
        if next(r.parameters(), None) is not None:
            fully_shard(r, mesh=dp_mesh, mp_policy=mp, offload_policy=off,
                        reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=dp_mesh, mp_policy=mp, offload_policy=off)
    return module


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a parameter or gradient that may be an FSDP2
    ``DTensor`` (collective over its mesh: every rank must call it), detached;
    plain tensors come back as they are (detached)."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor().detach()
    return t.detach()


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters and buffers of ``module`` by their name in the
    program ``layer_regions`` rewrote (collective over the dp mesh; tensor-
    parallel shards stay this rank's shards), on the CPU."""
    out: dict[str, torch.Tensor] = {}
    pn = getattr(module, "param_names", {}) or {}
    bn = getattr(module, "buffer_names", {}) or {}
    for name, p in module.named_parameters():
        out[pn.get(name, name)] = full_tensor(p).cpu()
    for name, b in module.named_buffers():
        out[bn.get(name, name)] = full_tensor(b).cpu()
    return out

