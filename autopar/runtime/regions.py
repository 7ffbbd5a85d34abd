"""Layer regions at run time: activation recompute and ZeRO-3 (FSDP2).

A :class:`Region` is one repeated-layer instance of a compiled program, a
submodule called once from its parent graph (the compiler's
:func:`autopar.compile.regions.layer_regions` cuts them). On a module that
contains regions:

* :func:`apply_recompute` runs each region under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, keeping only
  its inputs (``"full"``) or also the outputs of the weight matmuls and
  attention a backward needs, marked by the compiler (``"selective"``,
  torch's selective activation checkpointing);
* :func:`fully_shard_regions` applies ZeRO-3 with torch FSDP2: one
  ``fully_shard`` unit per region, then the root unit (which keeps the
  embedding, the head, the final norm and every parameter shared by several
  regions, e.g. tied weights).

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
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import CompileError

__all__ = ["Region", "regions", "param_names", "apply_recompute", "recompute_policy", "keep_begin", "keep_end",
           "fully_shard_regions", "full_tensor", "full_state_dict", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = ("none", "full", "selective")

_keeping = [False]     # inside a node whose outputs selective recompute keeps (set by the markers below)


def keep_begin() -> None:
    """Marker the compiler puts before a node whose output selective
    recompute keeps (:func:`autopar.compile.regions.layer_regions`); it runs
    again, in the same place, when the region is recomputed."""
    _keeping[0] = True


def keep_end() -> None:
    """Marker after such a node (see :func:`keep_begin`)."""
    _keeping[0] = False


def recompute_policy(save_ops: frozenset) -> Any:
    """Selective-checkpoint policy: save the outputs of the aten overload
    packets in ``save_ops`` (the compiler passes
    :func:`autopar.ops.save_ops`: matmuls, attention, convolutions) that run
    inside a node the compiler marked as kept (between :func:`keep_begin`
    and :func:`keep_end`: a weight matmul or attention whose output a
    backward needs), recompute everything else. The markers run in the
    recompute too, so both passes decide alike."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if _keeping[0] and packet in save_ops else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Region(nn.Module):
    """One repeated-layer instance of a program, called once from its parent.

    ``forward(*inputs)`` takes the values named by ``inputs`` (program node
    names) and returns the values named by ``outputs`` (a single value when
    there is one, else a tuple). ``recompute`` (``"none"``, ``"full"``,
    ``"selective"``) says how its activations are kept for backward; set it
    with :func:`apply_recompute`. ``group`` is the layer instance
    (``"model.blocks.0"``), ``nodes`` the program nodes it runs, ``code`` its
    Python source. ``mutated_buffers``: the ``attrs`` targets of the buffers
    ``graph`` updates in place (BatchNorm's running statistics), which a
    recompute must not update a second time.
    """

    def __init__(self, group: str, graph: fx.Graph, attrs: dict[str, Any], inputs: list[str],
                 outputs: list[str], mutated_buffers: Sequence[str] = ()) -> None:
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
        self.mutated_buffers = list(mutated_buffers)
        self.recompute = "none"
        self.save_ops: frozenset = frozenset()      # what selective recompute keeps

    def forward(self, *args: Any) -> Any:
        mode = self.recompute
        if mode == "none" or not torch.is_grad_enabled():
            return self._fn(self, *args)
        from torch.utils.checkpoint import checkpoint
        if mode not in RECOMPUTE_MODES:
            raise CompileError(f"unknown recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
        ctx = {"context_fn": self._selective_context} if mode == "selective" else {}
        return checkpoint(self._recomputable(), *args, use_reentrant=False, preserve_rng_state=True, **ctx)

    def _selective_context(self) -> Any:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return create_selective_checkpoint_contexts(recompute_policy(self.save_ops))

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


# ----------------------------------------------------------------------------- helpers
def regions(module: nn.Module) -> dict[str, Region]:
    """The :class:`Region` submodules of ``module`` by path, in module order."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Region)}


def param_names(module: nn.Module) -> dict[str, str]:
    """``new name -> name in the program`` for the parameters of ``module``
    (what :func:`autopar.compile.regions.layer_regions` recorded; identity
    where nothing was recorded)."""
    rec = getattr(module, "param_names", None)
    if not isinstance(rec, dict):
        rec = (getattr(module, "meta", None) or {}).get("autopar_regions", {}).get("param_names")
    names = [n for n, _ in module.named_parameters()]
    if isinstance(rec, dict):
        return {n: rec.get(n, n) for n in names}
    return {n: n for n in names}


def apply_recompute(module: nn.Module, mode: str, save_ops: frozenset = frozenset()) -> nn.Module:
    """Make every region of ``module`` recompute its activations in backward:
    ``"full"`` keeps only each region's inputs, ``"selective"`` also the
    outputs of the aten ops in ``save_ops`` (:func:`autopar.ops.save_ops`:
    matmuls, attention, convolutions; required for it) inside the nodes the
    compiler marked as kept (:func:`recompute_policy`); ``"none"``
    switches it off. Works before or after :func:`fully_shard_regions` (the
    checkpoint runs inside the FSDP unit's hooks, as torchtitan nests them).
    Returns ``module`` (changed in place)."""
    if mode not in RECOMPUTE_MODES:
        raise CompileError(f"unknown recompute mode {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    found = regions(module)
    if mode != "none" and not found:
        raise CompileError("recompute needs layer regions: rewrite the program with "
                           "autopar.compile.regions.layer_regions() first")
    if mode == "selective" and not save_ops:
        raise CompileError("selective recompute needs the ops whose outputs it keeps: pass "
                           "save_ops=autopar.ops.save_ops()")
    for r in found.values():
        r.recompute = mode
        r.save_ops = frozenset(save_ops)
    return module


def fully_shard_regions(module: nn.Module, dp_mesh: Any, *, param_dtype: torch.dtype | None = None,
                        reduce_dtype: torch.dtype | None = None, offload: bool = False,
                        reshard_after_forward: bool = True, layers: Sequence[str] | None = None) -> nn.Module:
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
    ``reshard``, ...). FSDP2 shards no 0-d parameter (a learnable
    temperature: CLIP's ``logit_scale``): those stay whole on every rank
    (:func:`unsharded_params`), their gradients averaged by the runtime.
    ``layers``: shard only the regions of these names (the layer instances
    of ``fsdp_layers``) and not the root: the other parameters stay plain
    tensors, under the distributed optimizer's ZeRO stage; each sharded
    region is then a root of FSDP2's own. Raises :class:`CompileError`
    when one of them is not a region with parameters in ``module``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if dp_mesh is None or dp_mesh.ndim != 1:
        raise CompileError("fully_shard_regions needs a 1-D DeviceMesh over the data-parallel ranks "
                           "(e.g. Mesh.device_mesh['dp'])")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    off = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    scalars = {p for p in module.parameters() if p.dim() == 0} or None
    found = {k: r for k, r in regions(module).items() if any(p.dim() for p in r.parameters())}
    missing = [k for k in layers or () if k not in found]
    if missing:
        raise CompileError(f"fsdp_layers={len(layers)}: layer {missing[0]!r} is not a region with parameters of "
                           f"its own in this program (its regions with parameters: {', '.join(found) or 'none'})")
    for r in ([found[k] for k in layers] if layers is not None else found.values()):
        fully_shard(r, mesh=dp_mesh, mp_policy=mp, offload_policy=off,
                    reshard_after_forward=reshard_after_forward, ignored_params=scalars)
    if layers is None:
        fully_shard(module, mesh=dp_mesh, mp_policy=mp, offload_policy=off, ignored_params=scalars)
    return module


def unsharded_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters :func:`fully_shard_regions` left whole in
    ``modules`` (plain tensors among FSDP2's DTensors): their gradients are
    each rank's own until the runtime averages them over the data-parallel ranks."""
    from torch.distributed.tensor import DTensor
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and not isinstance(p, DTensor):
                seen.setdefault(id(p), p)
    return list(seen.values())


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

