"""Small helpers over fx graphs that several compile passes share."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..inplace import op_name, updates_state
from ..runtime.kernels import in_dtype

__all__ = ["get_attr", "free_nodes", "retarget_devices", "to_device", "draws_random", "random_ops",
           "eliminate_dead_code", "matmuls_in_dtype"]


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


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> int:
    """Point every op that names a device at ``device`` (this rank's), in
    ``gm`` and in the graphs nested in it, and recompile each graph that
    changed; return how many nodes changed.

    A ``torch.export`` graph writes the device it was traced on into its
    factory and copy ops (``aten.arange(..., device=cpu)``, ``full``,
    ``zeros``, ``_to_copy``, ``_assert_tensor_metadata``; ``aten.to.device``
    takes it as an argument): a Hugging Face
    model's position ids would otherwise be made on the CPU beside weights on
    the GPU. Regions under ``torch.no_grad()`` or ``torch.autocast`` are
    graphs of their own, called through the higher-order ops
    ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` (a Hugging Face
    rotary embedding is both), and the autocast region names its device type
    as its first argument. A device that flows from a tensor at run time
    (``x.device`` in a ``torch.fx`` graph) is a node, not a constant, and is
    left alone."""
    changed = 0
    autocast = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        here = 0
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            dev = node.kwargs.get("device")
            if isinstance(dev, (torch.device, str)) and torch.device(dev) != device:
                node.kwargs = {**node.kwargs, "device": device}
                here += 1
            if any(isinstance(a, torch.device) and a != device for a in node.args):   # aten.to.device(x, cpu, ..)
                node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
                here += 1
            if node.target is autocast and node.args and node.args[0] != device.type:
                node.args = (device.type, *node.args[1:])
                here += 1
        if here:
            sub.recompile()
        changed += here
    return changed


def to_device(module: nn.Module, device: torch.device) -> int:
    """``module.to(device)``, and also the plain tensor attributes of it and
    its submodules, which ``nn.Module.to`` leaves where they are: a
    ``torch.export`` graph holds the model's tensor constants (a tensor
    attribute the forward reads, a lifted constant) that way, so they stayed
    on the CPU beside weights on the GPU. Returns how many attributes moved."""
    module.to(device)
    moved = 0
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(sub, name, value.to(device))
                moved += 1
    return moved


#: ops that draw from the default random generator (dropout only with p > 0 in training)
_RANDOM = frozenset({"bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
                     "randperm", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
                     "cauchy_", "log_normal_", "random_", "poisson", "rrelu", "rrelu_with_noise"})


def draws_random(node: fx.Node, owner: nn.Module) -> bool:
    """Whether ``node`` (of a graph of ``owner``) draws random numbers when
    run: dropout with ``p > 0`` in training mode (fx's ``F.dropout`` /
    ``nn.Dropout``, export's ``aten.dropout`` / ``native_dropout`` and the
    feature / alpha variants), attention's ``dropout_p``, ``bernoulli``,
    ``rand*``, ``randperm``, in-place samplers."""
    if node.op == "call_module":        # a dropout module called as one (a leaf)
        mod = owner.get_submodule(node.target)
        return isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0 and mod.training
    if node.op not in ("call_function", "call_method"):
        return False
    name = op_name(node)
    if "dropout" in name:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        train = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2
                                                            else name.startswith(("dropout", "native"))))
        return not isinstance(p, (int, float)) or p > 0 and train is not False
    if "scaled_dot_product" in name:        # attention's own dropout (dropout_p)
        at = 3 if "flash" in name else 5 if "efficient" in name else 4
        p = node.kwargs.get("dropout_p", node.args[at] if len(node.args) > at else 0.0)
        return not isinstance(p, (int, float)) or p > 0
    return name in _RANDOM


def random_ops(gm: nn.Module) -> list[str]:
    """Names of the nodes of ``gm`` and of the graphs nested in it that draw
    random numbers (:func:`draws_random`)."""
    return [node.name for sub in gm.modules() if isinstance(sub, fx.GraphModule)
            for node in sub.graph.nodes if draws_random(node, sub)]


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    """fx's dead-code elimination, keeping the in-place updates of the
    model's state that the trace left in place (``self.ema.mul_(0.9).add_(m)``,
    a counter's ``add_(1)``): nothing reads them, and fx counts a method call
    as pure, so a sharded program dropped the update (out-of-place rewriting
    has made every other in-place op a pure one: :mod:`autopar.inplace`)."""
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or updates_state(n))


def matmuls_in_dtype(gm: fx.GraphModule, dtype: torch.dtype) -> int:
    """Make every matmul-family op of ``gm`` (linear, matmul, convolution,
    attention, einsum, grouped matmul) read its floating operands in
    ``dtype``, as ``torch.autocast`` does for them: under bf16 the weights
    are bf16, and a value the model makes in fp32 itself (a diffusion model's
    sinusoidal timestep embedding from ``torch.arange``) met them in a matmul
    of two dtypes and failed. A cast of a value already in ``dtype`` returns
    it. Returns how many ops read a cast."""
    kinds = ops.matmul_kinds() - {"recurrent"}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        info = ops.op_info(node.target)
        if info is None or info.kind not in kinds:
            continue
        with gm.graph.inserting_before(node):
            node.args = tuple(gm.graph.call_function(in_dtype, (a, dtype)) if _activation(a) else a
                              for a in node.args)
        count += 1
    if count:
        gm.recompile()
    return count


def _activation(a: Any) -> bool:
    """Whether argument ``a`` is a value the program computes (a node other
    than a weight read, or a list holding one: einsum's operands)."""
    if isinstance(a, (list, tuple)):
        return any(_activation(v) for v in a)
    return isinstance(a, fx.Node) and a.op != "get_attr"
