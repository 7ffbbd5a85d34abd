"""Trace a model into an :class:`autopar.Graph` without spending real memory.

Two front ends:

* ``torch.fx`` symbolic tracing (fast: ~0.2 s for a 96-layer GPT-3). Known
  ``torch.nn`` leaf modules (Linear, Embedding, norms, conv, pooling, ...) are
  rewritten into their functional form with explicit parameter nodes, so every
  parameter is a node the sharding rules can place. Linear and conv biases
  become a separate ``add`` so a row-parallel linear can reduce before adding
  the bias.
* ``torch.export`` (non-strict) when fx cannot trace the model: nanoGPT-style
  ``B, T, C = x.size()`` code, every Hugging Face ``transformers`` model. The
  unlifted ATen graph (parameters as ``get_attr`` nodes, the batch size a
  symbol) is planned and compiled exactly like an fx graph.

Shapes come from running the graph on meta tensors (a model built on the meta
device) or under ``FakeTensorMode`` (a model with real weights): nothing is
allocated either way.
"""
from __future__ import annotations

import bisect
import contextlib
import dis
import hashlib
import io
import itertools
import logging
import math
import operator
import re
import sys
import warnings
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

from . import ops
from .errors import TraceError
from .graph import NO_DISPATCH, Graph, LayerGroup, Node, ParamInfo, TensorInfo, parent_module
from .inplace import out_of_place, traced_inplace_operators, updated_state, updates_state
from .runtime.parallel import BatchDim, batch_dims, batch_first_all
from .shallow_export import export_shallow, trace_shallow

# --------------------------------------------------------------------------
# Op kinds come from the op registry (autopar/ops): a new op is one record there.
# --------------------------------------------------------------------------
#: kind -> the op names filed under it (a view of the registry, for readers of the old table)
KINDS: dict[str, tuple[str, ...]] = ops.kinds()
_KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}


def op_family(kind: str) -> str:
    """The cost-model family of a node kind: ``matmul`` (compute bound) or ``other``."""
    return ops.family(kind)


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op == "call_module":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t))


# --------------------------------------------------------------------------
# Leaf modules -> functional form
# --------------------------------------------------------------------------
def _functional_form(g: fx.Graph, mod: nn.Module, x: Any, attr: Callable[[str], fx.Node]) -> Any:
    """The functional form of the well-known module ``mod`` applied to ``x``,
    inserted into ``g`` at its insertion point with ``attr(name)`` reading
    the module's parameters and buffers; None for a module without one."""
    new = None
    if isinstance(mod, nn.Linear):
        new = g.call_function(F.linear, (x, attr("weight")))
        if mod.bias is not None:
            new = g.call_function(operator.add, (new, attr("bias")))
    elif isinstance(mod, nn.Embedding):
        new = g.call_function(F.embedding, (x, attr("weight"), mod.padding_idx, mod.max_norm,
                                            mod.norm_type, mod.scale_grad_by_freq, mod.sparse))
    elif isinstance(mod, nn.LayerNorm):
        w = attr("weight") if mod.weight is not None else None
        b = attr("bias") if mod.bias is not None else None
        new = g.call_function(F.layer_norm, (x, tuple(mod.normalized_shape), w, b, mod.eps))
    elif hasattr(nn, "RMSNorm") and isinstance(mod, nn.RMSNorm):
        w = attr("weight") if mod.weight is not None else None
        new = g.call_function(F.rms_norm, (x, tuple(mod.normalized_shape), w, mod.eps))
    elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and mod.padding_mode == "zeros":
        fn = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[type(mod)]
        new = g.call_function(fn, (x, attr("weight"), None, mod.stride, mod.padding,
                                   mod.dilation, mod.groups))
        if mod.bias is not None:
            shape = (-1,) + (1,) * (mod.weight.dim() - 2)
            b = g.call_method("view", (attr("bias"), shape))
            new = g.call_function(operator.add, (new, b))
    elif isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        rm = attr("running_mean") if mod.running_mean is not None else None
        rv = attr("running_var") if mod.running_var is not None else None
        w = attr("weight") if mod.weight is not None else None
        b = attr("bias") if mod.bias is not None else None
        training = mod.training or rm is None
        momentum = 0.1 if mod.momentum is None else mod.momentum
        new = g.call_function(F.batch_norm, (x, rm, rv, w, b, training, momentum, mod.eps))
    elif isinstance(mod, nn.Dropout):
        new = g.call_function(F.dropout, (x, mod.p, mod.training))
    elif isinstance(mod, nn.GELU):
        new = g.call_function(F.gelu, (x,), {"approximate": mod.approximate})
    elif isinstance(mod, (nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid)):
        fn = {nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid}[type(mod)]
        new = g.call_function(fn, (x,))
    elif isinstance(mod, nn.MaxPool2d):
        new = g.call_function(F.max_pool2d, (x, mod.kernel_size, mod.stride, mod.padding,
                                             mod.dilation, mod.ceil_mode))
    elif isinstance(mod, nn.AvgPool2d):
        new = g.call_function(F.avg_pool2d, (x, mod.kernel_size, mod.stride, mod.padding,
                                             mod.ceil_mode, mod.count_include_pad))
    elif isinstance(mod, nn.AdaptiveAvgPool2d):
        new = g.call_function(F.adaptive_avg_pool2d, (x, mod.output_size))
    elif isinstance(mod, nn.Flatten):
        new = g.call_function(torch.flatten, (x, mod.start_dim, mod.end_dim))
    elif isinstance(mod, nn.Softmax):
        new = g.call_function(F.softmax, (x, mod.dim))
    elif isinstance(mod, nn.Identity):
        new = x
    return new


#: the torch.nn modules :func:`_functional_form` writes out (fx keeps them as leaves)
_FUNCTIONAL_LEAVES = (nn.Linear, nn.Embedding, nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
                      nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Dropout,
                      nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.MaxPool2d, nn.AvgPool2d,
                      nn.AdaptiveAvgPool2d, nn.Flatten, nn.Softmax, nn.Identity)


def _has_functional_form(mod: nn.Module) -> bool:
    """Whether :func:`_functional_form` writes ``mod`` out."""
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return type(mod) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and mod.padding_mode == "zeros"
    return isinstance(mod, _FUNCTIONAL_LEAVES)


def _functionalize_modules(gm: fx.GraphModule) -> None:
    """Replace ``call_module`` nodes of well-known torch.nn modules by their
    functional form, with every parameter read by a ``get_attr`` node, so the
    sharding rules see weights as ordinary inputs."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        path = node.target
        x = node.args[0] if node.args else node.kwargs.get("input")

        def attr(name: str):
            # the attribute exists (it is the module's): Graph.get_attr would check that
            # by walking the module path, for every weight of the model
            return g.create_node("get_attr", f"{path}.{name}")

        before = node.prev

        with g.inserting_before(node):
            new = _functional_form(g, mod, x, attr)
        if new is None:
            continue
        # the nodes just inserted (between `before` and `node`) belong to the module
        cur = before.next
        while cur is not node:
            cur.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
            cur = cur.next
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.lint()
    gm.recompile()


def _graph_module(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """A GraphModule whose Python code is generated on first call (torch's
    private ``_LazyGraphModule``), or an ordinary one where this torch has none."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:   # eager code generation: only slower
        return fx.GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


class _Proxy(fx.Proxy):
    """fx's Proxy, whose ``__iter__`` (``B, T, C = x.size()``) reads the
    caller's bytecode to find how many values are unpacked: here each
    function is disassembled once per trace, not once per call (a 96-layer
    model unpacked sizes 96 times, disassembling its attention each time).
    Python 3.11 or later (the instruction offsets fx relies on)."""

    def __iter__(self):
        caller = sys._getframe(1)
        cache = self.tracer.instructions
        insts = cache.get(caller.f_code)
        if insts is None:
            insts = cache[caller.f_code] = list(dis.get_instructions(caller.f_code))
        inst = insts[bisect.bisect_left(insts, caller.f_lasti, key=lambda x: x.offset)]
        if inst.opname == "UNPACK_SEQUENCE":
            return (self[i] for i in range(inst.argval))
        return self.tracer.iter(self)


class _Tracer(fx.Tracer):
    """fx tracer that remembers which module it was inside when tracing failed."""

    #: buffers are proxies too (fx's default hands the module's own tensor to the code, so an op on
    #: a buffer alone, ``self.ema.mul_(0.9)``, ran on the model's buffer while tracing and was not
    #: recorded: the program never updated it, and tracing itself changed the model's state)
    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        self.path_stack: list[str] = []
        self.failed_in: str | None = None   # innermost module an exception came from
        self.instructions: dict[Any, list[dis.Instruction]] = {}    # code -> its bytecode, for _Proxy

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self) if sys.version_info >= (3, 11) else super().proxy(node)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """The torch.nn modules autopar writes in functional form stay leaves;
        fx's other torch.nn leaves (``nn.MultiheadAttention``,
        ``nn.Transformer*``, ``nn.LSTM``, ``nn.GroupNorm``, ...) are traced
        through, so that their ops and weights are nodes the rules place (as
        one opaque node they ran replicated on every rank and hid the batch
        from the analysis: a data-parallel program read a local value as the
        whole batch). Where fx cannot trace one, torch.export does."""
        return super().is_leaf_module(m, module_qualified_name) and _has_functional_form(m)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        self.path_stack.append(f"{path or '<root>'} ({type(m).__name__})")
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # the stack unwinds before trace() sees the error: remember where it began
            if self.failed_in is None:
                self.failed_in = self.path_stack[-1]
            raise
        finally:
            self.path_stack.pop()


class _WithLoss(nn.Module):
    """Model and loss as one module, so the loss is traced (and sharded) too."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn


#: ``loss_fn=MODEL_LOSS``: the model computes its own loss from ``labels=target`` and
#: returns it as ``.loss`` (the Hugging Face convention: ``model(ids, labels=ids).loss``)
MODEL_LOSS = "labels"


def check_loss_fn(loss_fn: Any) -> None:
    """Raise :class:`TraceError` unless ``loss_fn`` is a callable or :data:`MODEL_LOSS`."""
    if loss_fn is None or loss_fn == MODEL_LOSS or callable(loss_fn):
        return
    raise TraceError(f"loss_fn must be a function loss_fn(output, target) -> scalar, or {MODEL_LOSS!r} for the "
                     f"model's own loss (model(*inputs, labels=target).loss); got {loss_fn!r}")


def _no_loss(out: Any) -> Any:
    return out


def _model_loss(out: Any) -> Any:
    loss = getattr(out, "loss", None)
    if loss is None:
        raise TraceError(f"loss_fn={MODEL_LOSS!r}: the model returned {type(out).__name__} without a .loss for "
                         "labels=target; pass a loss_fn(output, target) instead")
    return loss


def with_loss(model: nn.Module, loss_fn: Callable | str | None, n_inputs: int,
              keys: tuple[str, ...] | None = None,
              back: tuple[tuple[int, ...] | None, ...] | None = None) -> _WithLoss:
    """Wrap ``model`` and ``loss_fn`` into one module taking ``(*inputs, target)``
    (``loss_fn="labels"``: the model's own ``model(*inputs, labels=target).loss``;
    ``None``: just ``(*inputs)``, the model's output). With ``keys`` the model
    is called with keyword inputs, ``model(key_0=input_0, ...)``. ``back``:
    per input and for the target, the permutation that gives the model its
    own layout from the wrapper's batch-first one (``trace(batch_dim=...)``),
    None where there is none.

    fx cannot trace ``*args`` and reads ``forward`` from the class, so the
    class is made with one named argument per model input plus ``target``."""
    check_loss_fn(loss_fn)
    names = [f"input_{i}" for i in range(n_inputs)]
    back = back or (None,) * (n_inputs + 1)
    args = [f"{n}.permute{p}" if p else n for n, p in zip(names + ["target"], back)]
    call = ", ".join(f"{k}={a}" for k, a in zip(keys, args)) if keys else ", ".join(args[:n_inputs])
    if loss_fn is None:
        body, params = f"self.model({call})", names
        loss_fn = _no_loss
    else:
        body = (f"self.loss_fn(self.model({call}, labels={args[-1]}))" if loss_fn == MODEL_LOSS
                else f"self.loss_fn(self.model({call}), {args[-1]})")
        params = names + ["target"]
    if loss_fn == MODEL_LOSS:
        loss_fn = _model_loss
    src = (f"def forward(self, {', '.join(params)}):\n"
           f"    return {body}\n")
    scope: dict[str, Any] = {}
    exec(src, scope)  # noqa: S102 - a fixed template, no user text
    cls = type("WithLoss", (_WithLoss,), {"forward": scope["forward"]})
    return cls(model, loss_fn)


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------
def trace(model: nn.Module, example_inputs: Any = None, *, loss_fn: Callable | None = None,
          target: torch.Tensor | None = None, name: str | None = None,
          frontend: str = "auto", batch_dim: BatchDim = 0) -> Graph:
    """Trace ``model`` on ``example_inputs`` into a :class:`Graph`.

    ``model`` may also be a zoo string (``"gpt:layers=2,hidden=64"``); it is
    then built on the meta device with its default loss, at the example batch
    :func:`autopar.evaluate` and :func:`autopar.plan` trace it at
    (:func:`autopar.zoo.build_for_planning`: 2). With ``loss_fn`` and
    ``target``, the loss is part of the graph (its cost and sharding count).
    ``frontend`` is ``"auto"`` (fx, then export), ``"fx"`` or ``"export"``.
    ``batch_dim``: the dim of the inputs and the target that holds the batch
    (default 0; 1 for ``[seq, batch, ...]`` tensors, the layout of PyTorch's
    ``nn.Transformer*``, ``nn.MultiheadAttention``, ``nn.LSTM`` and
    ``nn.GRU`` by default); it applies to every tensor of more dims than it,
    and tensors of fewer dims (a label per sample) hold the batch at dim 0.
    A tuple gives one per input and then the target's (default 0):
    ``nn.Transformer``'s ``(src, tgt, src_key_padding_mask)`` are ``(1, 1,
    0)``. The graph's inputs hold the batch at dim 0 (each is moved back to
    the model's layout inside the traced program).

    Raises :class:`TraceError` naming the module that could not be traced and why.
    """
    if isinstance(model, str):
        from . import zoo
        z = zoo.build_for_planning(model)     # as evaluate and plan trace it (batch 2)
        model, example_inputs, name = z.model, z.example_inputs, name or z.name
        if loss_fn is None and z.loss_fn is not None:
            loss_fn, target = z.loss_fn, z.example_target
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected an nn.Module or a zoo string, got {type(model).__name__}")
    if example_inputs is None:
        raise TraceError("example_inputs are required to trace an nn.Module (a tuple of tensors)")
    keys: tuple[str, ...] | None = None
    if isinstance(example_inputs, dict):     # model(**batch), the Hugging Face way
        example_inputs, target, keys = keyword_inputs(example_inputs, target, loss_fn)
        check_call(model, len(example_inputs), keys, loss_fn)
    elif isinstance(example_inputs, (tuple, list)):
        check_call(model, len(example_inputs), None, loss_fn)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    name = name or type(model).__name__
    root: nn.Module = model
    check_loss_fn(loss_fn)
    try:
        in_dims, target_dim = batch_dims(batch_dim, len(example_inputs))
    except ValueError as e:
        raise TraceError(str(e)) from None
    back = None
    if any(in_dims) or target_dim:    # the graph takes batch-first tensors, the model its own layout back
        back = tuple(_layout_of(a, d) for a, d in zip((*example_inputs, target), (*in_dims, target_dim)))
        example_inputs, target = batch_first_all(example_inputs, target, batch_dim)
    args = example_inputs
    if loss_fn is not None:
        if target is None:
            raise TraceError("loss_fn was given without an example target to trace it with")
        root = with_loss(model, loss_fn, len(example_inputs), keys, back)
        args = example_inputs + (target,)
    elif keys is not None or back is not None:
        root = with_loss(model, None, len(example_inputs), keys, back)
    args = _unaliased(args)
    graph = _trace_frontends(root, args, name, frontend)
    graph.input_keys = keys
    graph.batch_dim = batch_dim if isinstance(batch_dim, int) else tuple(batch_dim)
    return graph


def _layout_of(x: Any, batch_dim: int) -> tuple[int, ...] | None:
    """The permutation of a batch-first view of ``x`` that gives ``x``'s own
    layout (the batch back at ``batch_dim``), or None when ``x`` is not moved."""
    if not isinstance(x, torch.Tensor) or x.dim() <= batch_dim:
        return None
    return (*range(1, batch_dim + 1), 0, *range(batch_dim + 1, x.dim()))


def check_call(model: nn.Module, n_inputs: int, keys: tuple[str, ...] | None, loss_fn: Any) -> None:
    """Refuse inputs that ``model.forward`` cannot take (before tracing,
    whose error would come from deep inside the tracer): a keyword batch
    whose keys it has no parameter for, or too many / too few positional
    inputs. Forwards whose signature Python cannot read are not checked."""
    import inspect
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    extra = {"labels": None} if loss_fn == MODEL_LOSS else {}
    try:
        if keys is not None:
            sig.bind(**dict.fromkeys(keys), **extra)
        else:
            sig.bind(*([None] * n_inputs), **extra)
    except TypeError as e:
        given = f"a keyword batch with keys {', '.join(keys)}" if keys is not None else f"{n_inputs} input(s)"
        raise TraceError(f"{type(model).__name__}.forward{sig} cannot take {given}"
                         f"{' and labels=' if extra else ''}: {e}") from None


def keyword_inputs(batch: dict, target: Any, loss_fn: Any) -> tuple[tuple, Any, tuple[str, ...]]:
    """A keyword batch (``model(**batch)``) as positional inputs in the
    batch's key order, the target and the keys. With ``loss_fn="labels"``
    and no target, the batch's ``labels`` are the target."""
    batch = dict(batch)
    bad = [k for k in batch if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise TraceError(f"a keyword batch needs identifier keys (model(**batch)); got {bad}")
    if target is None and loss_fn == MODEL_LOSS and "labels" in batch:
        target = batch.pop("labels")
    if not batch:
        raise TraceError("the keyword batch holds no model inputs")
    return tuple(batch.values()), target, tuple(batch)


@contextlib.contextmanager
def _quiet_torch_logs():
    """Silence the tracebacks torch logs when an op fails on fake tensors: a
    failed trace becomes one TraceError, not a wall of ``[rank0]:E`` lines."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes",
                                              "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


@contextlib.contextmanager
def _masks_as_given():
    """``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` / ``nn.Transformer``
    called with an attention mask and no ``is_causal`` hint compare the mask
    with a causal one to pick SDPA's causal kernel: ``bool((mask ==
    causal).all())``, a branch on tensor values that neither front end can
    trace (export stops on a data-dependent guard; PyTorch's own
    ``word_language_model`` example and its nn.Transformer tutorial call them
    so). While tracing, a missing hint reads as ``False``: the layers apply the
    mask they were given, which PyTorch documents as always correct (the hint
    only picks a kernel). An explicit hint is kept."""
    import torch.nn.modules.transformer as tm

    detect = tm._detect_is_causal_mask

    def as_given(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        return detect(mask, is_causal if is_causal is not None else False, size)

    tm._detect_is_causal_mask = as_given
    try:
        yield
    finally:
        tm._detect_is_causal_mask = detect


def _trace_frontends(root: nn.Module, args: tuple, name: str, frontend: str) -> Graph:
    """torch.fx first (``frontend="auto"``), torch.export when fx fails, or the one asked for."""
    if frontend not in ("auto", "fx", "export"):
        raise TraceError(f"unknown frontend {frontend!r}; valid: 'auto', 'fx', 'export'")
    with _quiet_torch_logs(), _masks_as_given():
        return _trace_either(root, args, name, frontend)


def _trace_either(root: nn.Module, args: tuple, name: str, frontend: str) -> Graph:

    fx_error: str | None = None
    if frontend in ("auto", "fx"):
        try:
            return _trace_fx(root, args, name)
        except TraceError as e:
            if frontend == "fx":
                raise
            fx_error = str(e)
    try:
        graph = _trace_export(root, args, name)
        if fx_error:
            graph.fallback_reason = fx_error
        return graph
    except TraceError as e:
        if fx_error:
            raise TraceError(f"{fx_error}\n  and torch.export failed too: {e}") from None
        raise


def _unaliased(args: tuple) -> tuple:
    """``args`` with every tensor sharing storage with an earlier one cloned:
    torch.export merges inputs that are one tensor, so an LM traced with its
    token ids as the example target (``target=ids``) read the target where
    the model reads its input, and trained on the wrong tensor."""
    seen: set[Any] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):     # meta and empty tensors have no storage to compare: the object
            key = id(a) if a.is_meta or not a.numel() else (a.untyped_storage().data_ptr(),
                                                              a.untyped_storage().nbytes())
            if key in seen:
                a = a.clone()
            seen.add(key)
        out.append(a)
    return tuple(out)


def _trace_fx(root: nn.Module, args: tuple, name: str) -> Graph:
    prefix = "model." if isinstance(root, _WithLoss) else ""
    graph = None
    with traced_inplace_operators():
        if _is_meta_model(root):    # only planned: its repeated layers past the first few are copies
            cache: dict[int, str] = {}
            graph = trace_shallow(root, lambda m: _Tracer().trace(m), lambda m: _module_signature(m, cache))
        if graph is None:
            tracer = _Tracer()
            try:
                graph = tracer.trace(root)
            except Exception as e:  # noqa: BLE001 - any tracing failure is reported with its module
                where = tracer.failed_in or f"<root> ({type(root).__name__})"
                raise TraceError(f"torch.fx cannot trace module {where}: {type(e).__name__}: {e}") from None
    # Python code generation for a 5000-node graph takes about 0.3 s each time the
    # graph changes; the planner never runs this module's code (shapes come from an
    # interpreter, the compiler builds its own graph), so it is generated lazily, on
    # first call, where this torch has lazy graph modules
    gm = _graph_module(root, graph, type(root).__name__)
    _check_no_folded_weights(gm)
    _functionalize_modules(gm)
    aliases = _merge_tied(gm)
    _propagate_shapes(gm, args)
    out_of_place(gm)     # after shapes: `n += 1` on a size rebinds a name, on a tensor it writes
    g = _build_graph(gm, name, "fx", args)
    g.loss_prefix = prefix
    g.aliases = aliases
    return g


def _check_no_folded_weights(gm: fx.GraphModule) -> None:
    """Raise :class:`TraceError` where torch.fx computed something from the
    weights at trace time: a computation that reads no traced input (an L2
    term of a weight written in the loss, ``1e-2 * (w ** 2).sum()``) runs
    once, eagerly, and the graph keeps its value as a constant, with no
    gradient to the weight, so training would silently drop it. torch.export
    records such terms; the automatic front end takes it instead."""
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("_tensor_constant"):
            t = getattr(gm, n.target, None)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise TraceError(f"torch.fx computed {n.target} {tuple(t.shape)} from trainable weights at trace "
                                 f"time (a term that reads no input, such as an L2 term of a weight in the loss): "
                                 f"its gradient would be lost")


def _tied_names(m: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every parameter or buffer reachable under two names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in list(m.named_parameters(remove_duplicate=False)) + \
            list(m.named_buffers(remove_duplicate=False)):
        canon = first.setdefault(id(t), name)
        if canon != name:
            aliases[name] = canon
    return aliases


def _merge_tied(gm: fx.GraphModule, aliases: dict[str, str] | None = None) -> dict[str, str]:
    """Make every read of a tied tensor (GPT-2's ``lm_head.weight`` *is*
    ``transformer.wte.weight``) one ``get_attr`` of its first name, so the
    graph has one parameter, one placement and one gradient for it. Returns
    ``{alias: canonical name}``."""
    aliases = _tied_names(gm) if aliases is None else aliases
    if not aliases:
        return aliases
    seen: dict[str, fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or not isinstance(n.target, str):
            continue
        canon = aliases.get(n.target, n.target)
        if canon in seen:
            n.replace_all_uses_with(seen[canon])
            gm.graph.erase_node(n)
        else:
            n.target = canon
            seen[canon] = n
    gm.graph.lint()
    gm.recompile()
    return aliases


def _weights_read_as_constants(gm: fx.GraphModule, root: nn.Module) -> dict[str, str]:
    """``{constant: parameter}`` for the tensor constants of an exported
    program that are a parameter of ``root`` (the same storage, shape and
    strides): torch.export lifts a weight the loss reads from a closure (an
    L2 term, ``(w ** 2).sum()``) as a constant, which would take no gradient.
    Read as the parameter, it trains as in one process."""
    params = {(p.data_ptr(), tuple(p.shape), p.stride()): name
              for name, p in root.named_parameters() if p.requires_grad and not p.is_meta}
    out = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(n.target, str) and n.target not in out:
            t = getattr(gm, n.target, None)
            if type(t) is torch.Tensor and not t.is_meta and t.numel():
                name = params.get((t.data_ptr(), tuple(t.shape), t.stride()))
                if name is not None and name != n.target:
                    out[n.target] = name
    return out


def _is_meta_model(m: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(m.parameters(), m.buffers()))


def _holding_params(root: nn.Module) -> set[str]:
    """The paths of the modules of ``root`` holding a parameter (their own
    or a descendant's, tied ones under every name): one walk, where asking
    each module for its parameters walked its subtree again."""
    held: set[str] = set()
    for name, _ in root.named_parameters(remove_duplicate=False):
        path = parent_module(name)
        while path not in held:
            held.add(path)
            if not path:
                break
            path = parent_module(path)
    return held


class _GroupShapeProp(ShapeProp):
    """ShapeProp that runs each op of a repeated layer once.

    The i-th node of the k-th instance of a repeated layer reuses the result
    of the i-th node of the first instance when its inputs have the same
    shapes and dtypes: on meta tensors the result carries no data, so this is
    exact, and it makes 96 identical blocks cost about as much as one.
    """

    def __init__(self, gm: fx.GraphModule, twin: dict[fx.Node, fx.Node], fake_mode: Any = None) -> None:
        super().__init__(gm)
        if fake_mode is not None and self.fake_mode is None:
            # the model's own weights enter the fake mode as they are read (it allows real
            # inputs), instead of ShapeProp's deep copy of the whole model into fake tensors
            # first: that copy was a quarter of tracing a zoo model for parallelize
            self.fake_mode = fake_mode
        self.twin = twin
        self.firsts = set(twin.values())
        # (inputs, result) of first-instance nodes; the interpreter frees its
        # own env entries after their last use, so keep them here
        self.seen: dict[fx.Node, tuple[list, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        t = self.twin.get(n)
        if t is not None and t in self.seen:
            theirs, result = self.seen[t]
            mine = [self.env[a] for a in n.all_input_nodes]
            if len(mine) == len(theirs) and all(_same_meta(x, y) for x, y in zip(mine, theirs)):
                for key in ("tensor_meta", "type"):
                    if key in t.meta:
                        n.meta[key] = t.meta[key]
                return result
        result = super().run_node(n)
        if n in self.firsts:
            self.seen[n] = ([self.env[a] for a in n.all_input_nodes], result)
        return result


def _same_meta(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype and x.stride() == y.stride()
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_meta(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def _twins(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Map each node of a later instance of a repeated layer to the node at the
    same position in the first instance (instances = siblings of equal structure)."""
    cache: dict[int, str] = {}
    by_key: dict[tuple[str, str], list[str]] = defaultdict(list)
    held = _holding_params(gm)
    for path, m in gm.named_modules():
        if path and path in held:
            parent = parent_module(path)
            by_key[(parent, _module_signature(m, cache))].append(path)
    inst_of = {p: paths[0] for paths in by_key.values() if len(paths) >= 2 for p in paths}
    seqs: dict[str, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        mod = None
        stack = n.meta.get("nn_module_stack")
        if stack:
            for v in stack.values():
                path = v[0] if isinstance(v, tuple) else str(v)
                if path in inst_of:
                    mod = path
                    break
        if mod is not None:
            seqs[mod].append(n)
    twin: dict[fx.Node, fx.Node] = {}
    for path, first in inst_of.items():
        if path == first:
            continue
        a, b = seqs.get(path, []), seqs.get(first, [])
        if len(a) == len(b) and all(x.op == y.op and x.target == y.target for x, y in zip(a, b)
                                    if x.op != "get_attr"):
            twin.update(zip(a, b))
    return twin


def _propagate_shapes(gm: fx.GraphModule, args: tuple) -> None:
    twin = _twins(gm)
    try:
        # torch's ShapeProp prints the traceback of a failing node before raising: the
        # failure is reported (or export takes over) from the TraceError below instead
        with contextlib.redirect_stderr(io.StringIO()):
            _run_shape_prop(gm, args, twin)
    except Exception as e:  # noqa: BLE001
        raise TraceError(f"shape propagation failed: {type(e).__name__}: {e}") from None


def _run_shape_prop(gm: fx.GraphModule, args: tuple, twin: dict[fx.Node, fx.Node]) -> None:
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    if _is_meta_model(gm):
        _GroupShapeProp(gm, twin).propagate(*meta_args)
        return
    try:
        # the real model's weights read as meta tensors: an op on meta costs a few microseconds,
        # on fake tensors about a millisecond (shape propagation was a quarter of parallelize)
        _MetaWeightsShapeProp(gm, twin).propagate(*meta_args)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: fake tensors know more ops
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        _GroupShapeProp(gm, twin, fake_mode=mode).propagate(*args)


def batch_meets(graph: Graph) -> str | None:
    """The first node of an fx graph whose value spans the batch twice (its
    shape at twice the batch has two dims that changed: an image x text
    similarity, a pairwise distance), or None; an export graph's
    :attr:`Graph.cross_sample`. The fx front end has no batch symbol, so the
    graph's shapes are propagated again, on meta tensors, with every input of
    the traced batch size doubled; a model whose forward fixes the batch size
    (or has no program) tells nothing: None. Memoised on the graph."""
    def probe() -> str | None:
        if graph.frontend != "fx" or graph.gm is None:
            return graph.cross_sample
        gm, b = graph.gm, graph.batch_size
        places = [n for n in gm.graph.nodes if n.op == "placeholder"]
        metas = [n.meta.get("tensor_meta") for n in places]
        if not b or any(not hasattr(m, "shape") for m in metas):
            return None
        # zeros on the host (valid token ids); the propagation runs them on meta tensors, or on fake
        # ones where the model makes host tensors of its own (labels from torch.arange in a loss)
        args = tuple(torch.zeros((2 * b if len(m.shape) and m.shape[0] == b else m.shape[0], *m.shape[1:]),
                                 dtype=m.dtype) for m in metas)
        kept = {n: {k: n.meta[k] for k in ("tensor_meta", "type") if k in n.meta} for n in gm.graph.nodes}
        try:
            with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _run_shape_prop(gm, args, _twins(gm))
            doubled = {n.name: _node_out(n) for n in gm.graph.nodes}
        except Exception:  # noqa: BLE001 - a forward that fixes its batch size: nothing known
            return None
        finally:
            for n, meta in kept.items():
                n.meta.pop("tensor_meta", None)
                n.meta.pop("type", None)
                n.meta.update(meta)
        for nd in graph.nodes:
            two = doubled.get(nd.name)
            if nd.out is not None and two is not None and len(two.shape) == len(nd.out.shape) and \
                    sum(x != y for x, y in zip(nd.out.shape, two.shape)) > 1:
                return nd.name
        return None

    return graph.memo(("batch_meets",), probe)


class _MetaWeightsShapeProp(_GroupShapeProp):
    """Shape propagation of a model holding real weights, on meta copies of
    them made as they are read (``get_attr`` and the leaf modules' own
    weights through ``torch.func.functional_call``); the model is not
    touched."""

    def __init__(self, gm: fx.GraphModule, twin: dict[fx.Node, fx.Node]) -> None:
        super().__init__(gm, twin)
        self._meta: dict[int, Any] = {}

    def _as_meta(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return t
        m = self._meta.get(id(t))
        if m is None:
            m = self._meta[id(t)] = t.to("meta")
        return m

    def fetch_attr(self, target: str) -> Any:
        return self._as_meta(super().fetch_attr(target))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        mod = self.module.get_submodule(target)
        state = {k: self._as_meta(v) for k, v in itertools.chain(mod.named_parameters(), mod.named_buffers())}
        return torch.func.functional_call(mod, state, args, kwargs)


def _trace_export(root: nn.Module, args: tuple, name: str) -> Graph:
    """torch.export (non-strict) -> the unlifted ATen-level GraphModule: a
    plain fx graph whose parameters and buffers are ``get_attr`` nodes, as the
    fx front end gives, so the compiler, stage cutting and layer regions run
    on it alike. Linear and addmm biases become a separate ``add`` (a
    row-parallel linear reduces before its bias), the export guard is
    dropped, and tied tensors are read under one name."""
    try:
        gm = None
        if _is_meta_model(root):
            args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
            cache: dict[int, str] = {}
            gm = export_shallow(root, lambda m: _export(m, args).module(),
                                lambda m: _module_signature(m, cache))
        if gm is None:
            gm = _export(root, args).module()
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "Cache" in msg:
            msg += " (a Hugging Face model returns its KV cache: build it with config.use_cache=False)"
        raise TraceError(f"torch.export cannot trace {type(root).__name__}: {type(e).__name__}: {msg}") from None
    _clean_export(gm)
    _merge_tied(gm, _weights_read_as_constants(gm, root))
    out_of_place(gm)
    batch_sym = _batch_symbol(gm)
    dims: dict[str, int | None] = {}
    crossing = None
    for n in gm.graph.nodes:
        dims[n.name] = _set_tensor_meta(n, batch_sym)
        if crossing is None and len(_batch_dims(n.meta.get("val"), batch_sym)) > 1:
            crossing = n.name
    aliases = _merge_tied(gm, _tied_names(root))
    graph = _build_graph(gm, name, "export", args, module_root=root)
    if batch_sym is not None:
        graph.traced_batch_dims = {nd.name: dims.get(nd.name) for nd in graph.nodes if nd.out is not None}
        graph.cross_sample = crossing if crossing in graph else None
    graph.loss_prefix = "model." if isinstance(root, _WithLoss) else ""
    graph.aliases = aliases
    return graph


def _export(root: nn.Module, args: tuple) -> Any:
    """``torch.export`` (non-strict) with the batch size (dim 0 of every
    input larger than 1) as a symbol where the model allows it, so that
    every size computed from it (``x.size(0)`` into ``view``, ``expand``,
    ``zeros``) stays a runtime value and every tensor's batch dim is known
    exactly; with fixed sizes when the model specialises on the batch, and
    for a model on the meta device, which is only planned, never run (a
    symbolic batch makes export 2-4x slower; the batch dims are then inferred
    by :func:`autopar.sharding.track_batch`)."""
    symbolic = not _is_meta_model(root)
    dyn = tuple({0: torch.export.Dim.AUTO} if symbolic and isinstance(a, torch.Tensor) and a.dim() > 0
                and a.shape[0] > 1 else None for a in args)
    # export prints the partial graph of a failure to stderr before raising: the TraceError says it
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        if any(d is not None for d in dyn):
            try:
                return torch.export.export(root, args, dynamic_shapes=dyn, strict=False)
            except Exception:  # noqa: BLE001 - data-dependent code: export again with fixed sizes
                pass
        return torch.export.export(root, args, strict=False)


def _batch_symbol(gm: fx.GraphModule) -> Any:
    """The sympy symbols of the inputs' batch sizes (a frozenset), or None
    when export fixed the first input's. Export gives each input's dim 0 a
    symbol of its own unless the model ties them: a two-tower model (CLIP's
    token ids and pixels, which meet only in the image x text logits) keeps
    two, and both are the batch. An input's symbol counts when its example
    size is the first input's."""
    def symbol(val: Any) -> Any:
        """The one free symbol of a fake tensor's dim 0, or None."""
        if isinstance(val, torch.Tensor) and val.dim() > 0 and isinstance(val.shape[0], torch.SymInt):
            free = val.shape[0].node.expr.free_symbols
            return next(iter(free)) if len(free) == 1 else None
        return None

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not vals or symbol(vals[0]) is None:
        return None
    size = _hint(vals[0].shape[0])
    return frozenset(symbol(v) for v in vals if symbol(v) is not None and _hint(v.shape[0]) == size)


def _hint(s: Any) -> int:
    """A size as an int: the example's value of a symbolic size."""
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        return int(hint) if hint is not None else int(s.node.shape_env.size_hint(s.node.expr))
    return int(s)


def _batch_dim(t: torch.Tensor | None, batch_sym: Any) -> int | None:
    """The first dim of fake tensor ``t`` whose size is a function of a batch symbol (``batch_sym``)."""
    return next(iter(_batch_dims(t, batch_sym)), None)


def _batch_dims(t: Any, batch_sym: Any) -> list[int]:
    """The dims of fake tensor ``t`` that are sizes of the batch (a function of a batch symbol each)."""
    if not isinstance(t, torch.Tensor) or batch_sym is None:
        return []
    return [d for d, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and batch_sym & s.node.expr.free_symbols]


def _set_tensor_meta(n: fx.Node, batch_sym: Any = None) -> int | None:
    """Set fx's ``tensor_meta`` (shape, dtype) from export's fake ``val``
    and return its batch dim (:func:`_batch_dim`; a split's parts share it)."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        n.meta["tensor_meta"] = _FakeMeta(tuple(_hint(s) for s in val.shape), val.dtype)
        return _batch_dim(val, batch_sym)
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) or v is None for v in val):
        n.meta["tensor_meta"] = tuple(_FakeMeta(tuple(_hint(s) for s in v.shape), v.dtype) if v is not None
                                      else None for v in val)
        return _batch_dim(next((v for v in val if v is not None), None), batch_sym)
    return None


_aten = torch.ops.aten


def _clean_export(gm: fx.GraphModule) -> None:
    """Make export's unlifted graph read like the fx front end's: no guard
    call, no runtime checks, no reads of unused state, and ``linear(x, W, b)``
    / ``addmm(b, x, W)`` split into the product and a separate bias ``add``
    (so a row-parallel product is reduced before its bias is added once); a
    one-element output tuple is the value itself."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "output" and isinstance(n.args[0], (tuple, list)) and len(n.args[0]) == 1:
            n.args = (n.args[0][0],)     # export returns a one-element tuple: the value itself
            continue
        if n.op == "call_module" and str(n.target).startswith("_guards"):
            g.erase_node(n)
            if hasattr(gm, str(n.target)):
                delattr(gm, str(n.target))
            continue
        if n.op != "call_function":
            continue
        if n.target is _aten.view.default:
            # export drops a ``.contiguous()`` that was a no-op on the example's strides, and the
            # strides at run time can differ: a non-contiguous input, or CUDA's attention kernels,
            # whose output is laid out unlike the CPU's (nn.MultiheadAttention's ``permute(...)
            # .contiguous().view(...)`` then fails on CUDA). A reshape is the same view wherever a
            # view works, and a copy where eager's contiguous() made one.
            n.target = _aten.reshape.default
            continue
        if n.target is _aten.linear.default and len(n.args) > 2 and n.args[2] is not None:
            x, w, b = n.args[:3]
            with g.inserting_before(n):
                prod = g.call_function(_aten.linear.default, (x, w))
                out = g.call_function(_aten.add.Tensor, (prod, b))
        elif n.target is _aten.addmm.default and not n.kwargs and len(n.args) == 3:
            b, x, w = n.args
            with g.inserting_before(n):
                prod = g.call_function(_aten.mm.default, (x, w))
                out = g.call_function(_aten.add.Tensor, (prod, b))
        else:
            continue
        for new in (prod, out):
            new.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        g.erase_node(n)
    for n in reversed(list(g.nodes)):
        # export's runtime checks (a buffer's dtype: wrong once bf16 casts the buffers) and
        # the get_attr of state the forward never reads: neither is part of the model
        if not n.users and (n.op == "get_attr" or n.op == "call_function" and _is_check(n)):
            g.erase_node(n)
    g.lint()
    gm.recompile()


def _is_check(n: fx.Node) -> bool:
    """An op export inserts to check what it assumed (dtypes, size ranges)."""
    name = _target_name(n)
    return name.startswith("_assert") or name.startswith("sym_constrain_range")


class _FakeMeta:
    """Just the fields of fx's TensorMetadata that autopar reads."""

    def __init__(self, shape, dtype):
        self.shape = torch.Size(shape)
        self.dtype = dtype


# --------------------------------------------------------------------------
# fx graph -> autopar Graph
# --------------------------------------------------------------------------
def _tinfo(meta: Any) -> TensorInfo | None:
    if meta is None or not hasattr(meta, "shape"):
        return None
    return TensorInfo(tuple(int(s) for s in meta.shape), str(meta.dtype).replace("torch.", ""))


def _returns_tuple(n: Any) -> bool:
    """Whether fx node ``n`` returns several tensors (its ``tensor_meta`` a
    tuple of them: ``torch.max(x, dim)``, ``topk``, ``sort``)."""
    tm = n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None
    return isinstance(tm, (tuple, list)) and not hasattr(tm, "shape")     # TensorMetadata is a tuple too


def _node_out(n: fx.Node) -> TensorInfo | None:
    tm = n.meta.get("tensor_meta")
    if _returns_tuple(n):     # its first tensor
        return _tinfo(tm[0]) if tm else None
    return _tinfo(tm)


def _flatten_inputs(n: fx.Node) -> list[fx.Node]:
    """Input nodes in argument order (nested lists flattened), duplicates kept."""
    out: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(n.args)
    visit(n.kwargs)
    return out


def _module_of(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return _strip_self(last[0] if isinstance(last, tuple) else str(last))


def _build_graph(gm: fx.GraphModule, name: str, frontend: str, args: tuple,
                 module_root: nn.Module | None = None) -> Graph:
    root = module_root if module_root is not None else gm
    named_params = dict(root.named_parameters(remove_duplicate=False))
    named_buffers = dict(root.named_buffers(remove_duplicate=False))
    params: dict[str, ParamInfo] = {}
    nodes: list[Node] = []
    tensor_nodes: set[str] = set()
    inputs: list[str] = []
    output: str | None = None
    for n in gm.graph.nodes:
        out = _node_out(n)
        pname = None
        if n.op == "get_attr" or (n.op == "placeholder" and "autopar_param" in n.meta):
            pname = n.meta.get("autopar_param", n.target)
            t = named_params.get(pname)
            is_buf = t is None
            if t is None:
                t = named_buffers.get(pname)
            if t is None:
                try:
                    t = gm.get_parameter(pname) if frontend == "fx" else None
                except AttributeError:
                    t = None
            if isinstance(t, torch.Tensor):
                out = TensorInfo(tuple(t.shape), str(t.dtype).replace("torch.", ""))
                params[pname] = ParamInfo(pname, tuple(t.shape), out.dtype,
                                          bool(t.requires_grad) and not is_buf, is_buf)
            kind = "buffer" if (pname not in params or params[pname].is_buffer) else "param"
            if out is None:  # a constant that is not a tensor
                kind = "constant"
        elif n.op == "placeholder":
            kind = "input"
            inputs.append(n.name)
        elif n.op == "output":
            kind = "output"
            outs = _flatten_inputs(n)
            output = outs[0].name if outs else None
        else:
            tname = _target_name(n)
            kind = _KIND_OF.get(tname, "other")
            if n.op == "call_module":
                kind = "module"
            if kind == "index" and out is None:
                kind = "shape"  # getitem on a tuple of sizes
            if kind in ("shape",) or (out is None and kind not in ("split",)):
                kind = "shape" if out is None else kind
        ins = [a for a in _flatten_inputs(n) if a.name in tensor_nodes]
        if out is not None or kind == "split":
            tensor_nodes.add(n.name)
        node = Node(
            name=n.name, op=n.op, target=_target_name(n) if n.op not in ("placeholder", "output") else n.op,
            kind=kind, inputs=[a.name for a in ins], out=out, param=pname,
            module=_module_of(n),
        )
        nodes.append(node)
    by_name = {nd.name: nd for nd in nodes}
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    for nd in nodes:
        nd.attrs = _attrs(fx_nodes[nd.name], nd, by_name)
        _cost_node(nd, by_name)
    _mark_norm_outputs(gm, by_name)
    _mark_fused_splits(nodes, by_name)
    _mark_updated_state(gm, nodes, fx_nodes)
    batch = 1
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            batch = int(a.shape[0])
            break
    groups = _find_groups(root if frontend == "fx" else module_root, nodes, _repeated_calls(gm))
    g = Graph(name=name, nodes=nodes, params=params, inputs=inputs, output=output, groups=groups,
              batch_size=batch, frontend=frontend, gm=gm)
    return g


def _mark_norm_outputs(gm: fx.GraphModule, by_name: dict[str, Node]) -> None:
    """Mark ``attrs["norm_output"]`` on the last op of every normalisation module
    written out in elementwise ops (its class name ends in ``Norm``, as
    ``LlamaRMSNorm`` does, and it has no layer_norm / rms_norm op of its own),
    so sequence parallelism can split it like a fused norm."""
    last: dict[str, str] = {}
    fused: set[str] = set()
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        nd = by_name.get(n.name)
        if not stack or nd is None or nd.out is None:
            continue
        path, cls = list(stack.values())[-1]
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        if not cls_name.rsplit(".", 1)[-1].endswith("Norm"):
            continue
        if nd.kind in ("layernorm", "rmsnorm"):
            fused.add(path)
        last[path] = n.name
    for path, name in last.items():
        if path not in fused:
            by_name[name].attrs["norm_output"] = True


def _equal_pieces(target: str, arg: Any, size: int) -> int | None:
    """How many equal pieces ``split`` / ``split_with_sizes`` / ``chunk`` cut a
    dim of ``size`` into (None when unequal or unknown)."""
    if target == "chunk":
        k = arg if isinstance(arg, int) else None
        return k if k and k >= 2 and size % k == 0 else None
    if isinstance(arg, int):
        return size // arg if arg > 0 and size % arg == 0 and size // arg >= 2 else None
    if isinstance(arg, (list, tuple)) and len(arg) >= 2 and all(isinstance(x, int) for x in arg) and \
            len(set(arg)) == 1 and sum(arg) == size:
        return len(arg)
    return None


def _mark_fused_splits(nodes: list[Node], by_name: dict[str, Node]) -> None:
    """Mark the chains that let tensor parallelism split a fused projection
    by its blocks: a ``linear`` / ``mm`` whose weight is a parameter, then
    bias adds and views that keep the projected dim whole, then a split of
    that dim into equal pieces (q, k and v of GPT-2's ``c_attn``, nanoGPT's
    ``qkv.split(n_embd, dim=2)``; a mixture of experts' grouped gate / up
    projection, ``chunk(2, -1)``). Each node of the chain gets
    ``attrs["blocks"] = (pieces, {input index: its dim}, output dim)``; the
    sharding rules offer ``S(d,k)`` placements along it (each rank its
    chunk of every piece), and the split hands out plain shards."""
    readers: dict[str, int] = {}
    for nd in nodes:
        for i in nd.inputs:
            readers[i] = readers.get(i, 0) + 1
    for sp in nodes:
        k = sp.attrs.get("pieces")
        if sp.kind != "split" or not k or not sp.inputs:
            continue
        d = sp.attrs["dim"] % len(by_name[sp.inputs[0]].out.shape)
        chain = [(sp, {0: d}, None)]
        cur, dim = by_name[sp.inputs[0]], d
        while cur.out is not None and readers.get(cur.name) == 1:
            shape = cur.out.shape
            ins = [by_name[i] for i in cur.inputs]
            if cur.kind == "view" and cur.target in ("view", "reshape", "_unsafe_view") and ins[0].out is not None:
                src = ins[0].out.shape
                prod_before = math.prod(shape[:dim])
                di = next((j for j in range(len(src)) if src[j] == shape[dim] and math.prod(src[:j]) == prod_before),
                          None)
                if di is None:
                    break
                chain.append((cur, {0: di}, dim))
                cur, dim = ins[0], di
            elif cur.kind == "elementwise" and cur.target in ("add", "add_", "iadd") and len(ins) == 2 and \
                    dim == len(shape) - 1:
                bias = [j for j, x in enumerate(ins) if x.kind == "param" and x.out is not None
                        and x.out.shape == (shape[dim],)]
                if len(bias) != 1:
                    break
                other = 1 - bias[0]
                chain.append((cur, {other: dim, bias[0]: 0}, dim))
                cur = ins[other]
            elif cur.kind in ("linear", "matmul") and cur.target in ("linear", "mm", "matmul") and \
                    dim == len(shape) - 1 and len(ins) == 2 and ins[1].kind == "param":
                wdim = 0 if cur.target == "linear" else 1
                chain.append((cur, {1: wdim}, dim))
                for node, ins_d, out_d in chain:
                    node.attrs["blocks"] = (k, ins_d, out_d)
                break
            elif cur.kind == "grouped_mm" and dim == len(shape) - 1 and len(ins) >= 2:
                # a mixture of experts' fused gate / up: grouped_mm(x, w[E, K, N]) with w a
                # parameter, or its transpose (transformers stores [E, N, K] and transposes)
                w = ins[1]
                if w.kind == "transpose" and readers.get(w.name) == 1 and w.inputs and \
                        by_name[w.inputs[0]].kind == "param" and w.attrs.get("perm"):
                    chain += [(cur, {1: 2}, dim), (w, {0: w.attrs["perm"][2]}, 2)]
                elif w.kind == "param":
                    chain.append((cur, {1: 2}, dim))
                else:
                    break
                for node, ins_d, out_d in chain:
                    node.attrs["blocks"] = (k, ins_d, out_d)
                break
            else:
                break


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` (counting the tensor for methods too) or keyword ``name``."""
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[i] if len(n.args) > i else default


def _attrs(n: fx.Node, node: Node, by_name: dict[str, Node]) -> dict[str, Any]:
    """The op arguments the sharding rules need (dims, permutations, ...)."""
    a: dict[str, Any] = {}
    k, t = node.kind, node.target
    ins = [by_name[i].out for i in node.inputs if i in by_name]
    x = ins[0].shape if ins and ins[0] is not None else None
    o = node.out.shape if node.out is not None else None
    nd = len(x) if x is not None else 0
    try:
        if k == "sdpa":
            a["is_causal"] = bool(_arg(n, 5, "is_causal", False))
        elif k in ("layernorm", "rmsnorm"):
            shp = _arg(n, 1, "normalized_shape", ())
            a["norm_dims"] = len(shp) if isinstance(shp, (list, tuple)) else 1
        elif k == "softmax":
            a["dim"] = int(_arg(n, 1, "dim", -1)) % max(nd, 1)
        elif k == "normalize":     # F.normalize(input, p=2.0, dim=1, eps=1e-12)
            a["dim"] = int(_arg(n, 2, "dim", 1)) % max(nd, 1)
        elif k in ("split", "cat"):
            # split(x, sizes, dim), chunk(x, n, dim); unbind(x, dim) and cat(tensors, dim)
            unbind = _target_name(n) == "unbind"
            a["dim"] = int(_arg(n, 2 if k == "split" and not unbind else 1, "dim", 0))
            if k == "split" and x is not None and t in ("split", "split_with_sizes", "chunk"):
                pieces = _equal_pieces(t, _arg(n, 1, "split_size_or_sections" if t == "split" else
                                               "split_sizes" if t == "split_with_sizes" else "chunks"),
                                       x[a["dim"] % nd])
                if pieces:
                    a["pieces"] = pieces
        elif k in ("cross_entropy", "nll_loss", "pointwise_loss"):
            a.update(_loss_attrs(n, t))
        elif k == "conv":
            a["groups"] = int(_arg(n, 6, "groups", 1))
        elif k == "einsum" and o is not None:
            a.update(_einsum_attrs(n, ins, len(o)))
        elif k == "pad" and x is not None:
            a["padded_dims"] = _padded_dims(n, t, nd)
        elif k == "scatter" and x is not None:
            a["dim"] = int(_arg(n, 2, "dim", 0)) % nd     # slice_scatter / select_scatter(base, src, dim, ...)
        elif k == "elementwise" and getattr(ops.op_info(t), "operands", "") == "quotient":
            # which side the one tensor of `x / 2` or `2 / x` is: autograd saves a divisor, not a dividend
            a["tensor_dividend"] = bool(n.args) and isinstance(n.args[0], fx.Node)
        elif k == "reduction" and x is not None:
            dims = _arg(n, 1, "dim", None)
            if dims is None:
                dims = list(range(nd))
            elif isinstance(dims, int):
                dims = [dims]
            if all(isinstance(d, int) for d in dims):
                a["reduce_dims"] = sorted(d % nd for d in dims)
                a["keepdim"] = bool(_arg(n, 2, "keepdim", False))
        elif k == "transpose" and x is not None:
            if t == "t":
                perm = [1, 0][:nd]
            elif t == "transpose":
                d0, d1 = int(n.args[1]) % nd, int(n.args[2]) % nd
                perm = list(range(nd))
                perm[d0], perm[d1] = perm[d1], perm[d0]
            else:
                dims = n.args[1:] if len(n.args) > 2 else n.args[1] if len(n.args) > 1 else n.kwargs["dims"]
                perm = [int(d) % nd for d in dims]
            a["perm"] = perm
        elif k == "expand" and x is not None and o is not None:
            if t == "unsqueeze":
                d = int(_arg(n, 1, "dim", 0)) % (nd + 1)
                a["dim_map"] = {i: (i if i < d else i + 1) for i in range(nd)}
            elif t == "squeeze":
                kept = [i for i in range(nd) if not (x[i] == 1 and len(o) < nd)]
                a["dim_map"] = {i: j for j, i in enumerate(kept)} if len(kept) == len(o) else None
            else:
                off = len(o) - nd
                a["dim_map"] = {i: i + off for i in range(nd)}
        elif k == "index" and x is not None and o is not None:
            a["dim_map"] = _index_map(n, t, nd, len(o))
        if k == "index" and node.inputs and (by_name[node.inputs[0]].kind == "split" or
                                             (t == "getitem" and _returns_tuple(n.args[0]))):
            node.kind = "item"     # a piece of a split, or of an op's tuple (max and min with a dim: values, indices)
    except (TypeError, ValueError, IndexError, KeyError):
        pass  # unusual arguments: the rule falls back to replication
    if updates_state(n):        # a buffer updated in place (an EMA, a counter): whole on every rank
        a["updates_state"] = True
    return a


def _mark_updated_state(gm: fx.GraphModule, nodes: list[Node], fx_nodes: dict[str, fx.Node]) -> None:
    """``attrs["whole_inputs"]``: the inputs of a node that are a buffer the
    program updates in place (an EMA): every rank keeps it whole, so its
    readers read it so (a rank holding a slice updated a gathered copy)."""
    updated = {t for n in gm.graph.nodes if (t := updated_state(n)) is not None}
    if not updated:
        return
    for nd in nodes:
        whole = [k for k, i in enumerate(nd.inputs) if fx_nodes[i].op == "get_attr" and fx_nodes[i].target in updated]
        if whole:
            nd.attrs["whole_inputs"] = whole


def _einsum_attrs(n: fx.Node, ins: list[Any], out_dims: int) -> dict[str, Any]:
    """``{"einsum": labels}`` of an einsum node whose labels are understood and fit its output."""
    labels = einsum_labels(_arg(n, 0, "equation"), [i.shape if i is not None else None for i in ins])
    return {"einsum": labels} if labels is not None and len(labels[1]) == out_dims else {}


def einsum_labels(equation: Any, shapes: list[tuple[int, ...] | None]) -> tuple[tuple[str, ...], str] | None:
    """The letters of ``torch.einsum(equation, *operands)``: one string per
    operand (a letter per dim) and the output's, with an ellipsis written out
    as letters of its own (right-aligned, the broadcast dims) and an implicit
    output (no ``->``) as NumPy and torch define it: the ellipsis, then the
    letters used once, sorted. None when the equation is not understood (the
    rule then replicates)."""
    if not isinstance(equation, str) or not shapes or any(s is None for s in shapes):
        return None
    eq = "".join(equation.split())
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return None
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in eq]
    widths = [len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t]
    if any(w < 0 for w in widths) or max(widths, default=0) > len(spare):
        return None
    ell = "".join(spare[:max(widths, default=0)])
    out = []
    for t, s in zip(terms, shapes):
        if "..." in t:
            t = t.replace("...", ell[len(ell) - (len(s) - (len(t) - 3)):])
        if len(t) != len(s) or not t.isalpha():
            return None
        out.append(t)
    if arrow:
        res = rhs.replace("...", ell)
    else:
        used = "".join(out)
        res = ell + "".join(sorted(c for c in set(used) if used.count(c) == 1 and c not in ell))
    if (res and not res.isalpha()) or len(set(res)) != len(res) or not set(res) <= set("".join(out)):
        return None
    return tuple(out), res


def einsum_flops(terms: tuple[str, ...], res: str, shapes: list[tuple[int, ...]]) -> float:
    """Forward FLOPs of an einsum contracted left to right, as torch does
    without opt_einsum: each pairwise product is 2 x the sizes of every letter
    it spans, keeping the letters a later operand or the output needs; one
    operand (a sum, a trace, a transpose) reads its elements once."""
    size: dict[str, int] = {}
    for t, s in zip(terms, shapes):
        for c, d in zip(t, s):
            size[c] = max(size.get(c, 1), int(d))

    def span(letters: set[str]) -> float:
        p = 1.0
        for c in letters:
            p *= size[c]
        return p

    if len(terms) == 1:
        return span(set(terms[0]))
    cur, total = set(terms[0]), 0.0
    for i, t in enumerate(terms[1:], 1):
        both = cur | set(t)
        total += 2.0 * span(both)
        later = set(res).union(*terms[i + 1:])
        cur = {c for c in both if c in later}
    return total


def _loss_attrs(n: fx.Node, t: str) -> dict[str, Any]:
    """A cross-entropy's reduction and ignored index ("unsupported": label
    smoothing or class weights); an elementwise loss's reduction."""
    if t in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"):
        # aten: (self, target, reduction: 0 none / 1 mean / 2 sum, ...); F.mse_loss: a keyword
        aten = isinstance(n.target, torch._ops.OpOverload)
        r = _arg(n, 2, "reduction", 1) if aten else n.kwargs.get("reduction", "mean")
        return {"reduction": {0: "none", 1: "mean", 2: "sum"}.get(r, "unsupported") if isinstance(r, int) else r}
    if t in ("cross_entropy_loss", "nll_loss_nd"):
        # aten: (input, target, weight, reduction: 0 none / 1 mean / 2 sum, ignore_index[, label_smoothing])
        a = {"reduction": {0: "none", 1: "mean", 2: "sum"}.get(_arg(n, 3, "reduction", 1), "unsupported"),
             "ignore_index": _arg(n, 4, "ignore_index", -100)}
        smoothing, weight = _arg(n, 5, "label_smoothing", 0.0), _arg(n, 2, "weight")
    else:   # F.cross_entropy / F.nll_loss(input, target, weight, size_average, ignore_index, reduce, reduction)
        a = {"reduction": n.kwargs.get("reduction", "mean"), "ignore_index": n.kwargs.get("ignore_index", -100)}
        smoothing, weight = n.kwargs.get("label_smoothing", 0.0), n.kwargs.get("weight", _arg(n, 2, "weight"))
    if weight is not None:
        # class weights: a tensor input of the op (the third); a mean divides by the weights of the targets
        a["class_weight"] = isinstance(weight, fx.Node)
    if smoothing or (weight is not None and not isinstance(weight, fx.Node)):
        a["reduction"] = "unsupported"
    return a


def _padded_dims(n: fx.Node, t: str, nd: int) -> list[int]:
    """The dims a pad of an ``nd``-dim tensor may pad: its (left, right)
    pairs run from the last dim backwards, and an amount the program
    computes (timm's Swin pads to whole windows by ``-H % window``) counts
    as padding."""
    amounts = list(_arg(n, 1, "padding" if t.endswith(("1d", "2d", "3d")) else "pad", ()))
    return sorted(nd - 1 - i for i in range(len(amounts) // 2)
                  if not (isinstance(amounts[2 * i], int) and isinstance(amounts[2 * i + 1], int)
                          and amounts[2 * i] == amounts[2 * i + 1] == 0))


def _index_map(n: fx.Node, t: str, nd: int, nout: int) -> dict[int, int] | None:
    """Input dim -> output dim for getitem / narrow / select (dims kept by the index)."""
    if t == "narrow":  # its start/length are global: the narrowed dim cannot be sharded
        d = int(_arg(n, 1, "dim", 0)) % nd
        return {i: i for i in range(nd) if i != d}
    if t == "select":
        d = int(_arg(n, 1, "dim", 0)) % nd
        return {i: (i if i < d else i - 1) for i in range(nd) if i != d}
    if t == "slice":   # torch.export's aten.slice (x[..., :k], x[:, ...]): every dim keeps its place; the
        # rule keeps a shard only on a dim the slice leaves whole (sizes equal: the sliced dim of a
        # full-range slice, as export writes `x[:, ...]`, whose local slice [0:end] is the shard)
        return {i: i for i in range(nd)} if nout == nd else None
    if t != "getitem":
        return None
    idx = n.args[1]
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, fx.Node) for i in idx) or any(isinstance(i, (list, torch.Tensor)) for i in idx):
        return None
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    m: dict[int, int] = {}
    di = do = 0
    for i in idx:
        if i is Ellipsis:
            for _ in range(nd - n_real):
                m[di] = do
                di += 1
                do += 1
        elif i is None:
            do += 1
        elif isinstance(i, int):
            di += 1
        elif isinstance(i, slice):
            m[di] = do
            di += 1
            do += 1
        else:
            return None
    while di < nd:
        m[di] = do
        di += 1
        do += 1
    return m if do == nout else None


def _plain(x: Any) -> Any:
    if isinstance(x, fx.Node):
        return f"%{x.name}"
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    if isinstance(x, torch.dtype):
        return str(x)
    return repr(x)


def _cost_node(nd: Node, by_name: dict[str, Node]) -> None:
    """Forward FLOPs and bytes moved for one node at the traced batch size."""
    if nd.out is None or nd.kind in NO_DISPATCH or nd.kind == "factory":
        return
    ins = [by_name[i] for i in nd.inputs]
    act = [i.out for i in ins if i.out is not None and not i.is_state]
    par = [i.out for i in ins if i.out is not None and i.is_state]
    out_numel = nd.out.numel
    k = nd.kind
    flops = 0.0
    if k == "linear":
        if nd.target == "addmm":  # addmm(bias, mat1, mat2[K, N]): K is mat2's dim 0, not the bias's
            w = ins[-1].out if ins else None
        else:
            w = par[0] if par else (ins[1].out if len(ins) > 1 else None)
        kdim = w.shape[-1] if (w is not None and nd.target == "linear") else (w.shape[0] if w else 1)
        flops = 2.0 * out_numel * kdim
    elif k in ("matmul", "grouped_mm"):     # grouped_mm: each row of x times its group's [K, N]
        a = ins[0].out if ins and ins[0].out else None
        flops = 2.0 * out_numel * (a.shape[-1] if a else 1)
    elif k == "einsum" and "einsum" in nd.attrs:
        flops = einsum_flops(*nd.attrs["einsum"], [i.out.shape for i in ins])
    elif k == "recurrent":     # every token through every weight matrix of every layer and direction
        tokens = act[0].numel // act[0].shape[-1] if act and act[0].shape else 0
        flops = 2.0 * tokens * sum(w.numel for w in par if len(w.shape) == 2)
    elif k == "sdpa":
        q, kk = ins[0].out, ins[1].out
        b_h_tq = q.numel // q.shape[-1]
        flops = 4.0 * b_h_tq * kk.shape[-2] * q.shape[-1]
        if nd.attrs.get("is_causal"):
            flops /= 2
    elif k == "conv":
        w = ins[1].out
        kern = 1
        for s in w.shape[1:]:
            kern *= s
        flops = 2.0 * out_numel * kern
    elif k in ("layernorm", "rmsnorm", "softmax", "batchnorm", "groupnorm", "cross_entropy", "pointwise_loss"):
        flops = 5.0 * (act[0].numel if act else out_numel)
    elif k in ("elementwise", "reduction", "pool"):
        flops = float(max(out_numel, act[0].numel if act else 0))
    if k in ("view", "transpose", "expand", "index", "split", "shape"):
        nd.act_bytes = 0.0
    else:
        nd.act_bytes = float(sum(t.nbytes for t in act) + nd.out.nbytes)
    nd.param_bytes = float(sum(t.nbytes for t in par))
    nd.flops = flops


# --------------------------------------------------------------------------
# Repeated layers
# --------------------------------------------------------------------------
def _module_signature(m: nn.Module, cache: dict[int, str]) -> str:
    key = id(m)
    if key not in cache:
        h = hashlib.sha256(type(m).__qualname__.encode())
        for pn, p in m.named_parameters(recurse=False):
            h.update(f"{pn}:{tuple(p.shape)}:{p.dtype}".encode())
        for bn, b in m.named_buffers(recurse=False):
            if b is not None:
                h.update(f"b{bn}:{tuple(b.shape)}".encode())
        for cn, c in m.named_children():
            h.update(f"{cn}={_module_signature(c, cache)}".encode())
        cache[key] = h.hexdigest()[:12]
    return cache[key]


def _repeated_calls(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """``{node: (module path, call)}`` for the nodes run by a module that the
    model calls several times (ALBERT's one layer, run for every layer):
    torch.export's module stack keys a module's second and later calls
    ``path@1``, ``path@2``, ...; the outermost such module of each node, the
    first call 0. Empty for fx graphs (their keys carry no call)."""
    stacks = {n.name: list(st.items()) for n in gm.graph.nodes if (st := n.meta.get("nn_module_stack"))}
    repeated = {_strip_self(v[0] if isinstance(v, tuple) else str(v))
                for st in stacks.values() for key, v in st if re.search(r"@\d+$", key)}
    if not repeated:
        return {}
    out = {}
    for name, st in stacks.items():
        for key, v in st:
            path = _strip_self(v[0] if isinstance(v, tuple) else str(v))
            if path in repeated:
                m = re.search(r"@(\d+)$", key)
                out[name] = (path, int(m.group(1)) if m else 0)
                break
    return out


def _strip_self(path: str) -> str:
    """A module path without the prefix export gives it in some versions (``L['self'].``)."""
    for prefix in ("L['self'].", "L__self__.", "self."):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _call_groups(root: nn.Module, nodes: list[Node], calls: dict[str, tuple[str, int]]) -> list[LayerGroup]:
    """The layers of a module the model calls several times, one after
    another (ALBERT: one layer module shared by all its layers): each call is
    a layer instance (``path``, ``path@1``, ...; ``Node.group`` names it),
    the calls of one op sequence a group. Their weights are the one module's:
    a pipeline holds them on every stage that runs a call, and sums their
    gradients across those stages as it does a tied embedding's."""
    by_call: dict[str, dict[int, list[Node]]] = defaultdict(lambda: defaultdict(list))
    for nd in nodes:
        if nd.name in calls and not nd.is_state:
            path, k = calls[nd.name]
            by_call[path][k].append(nd)
    groups = []
    cache: dict[int, str] = {}
    for path, per in sorted(by_call.items()):
        ks = sorted(per)
        insts = [per[k] for k in ks]
        pos = {nd.name: i for i, nd in enumerate(nodes)}
        in_order = all(pos[b[0].name] > pos[a[-1].name] for a, b in zip(insts, insts[1:]))
        if len(ks) < 2 or not in_order or len({tuple(n.kind for n in ns) for ns in insts}) > 1:
            continue
        names = [path if k == 0 else f"{path}@{k}" for k in ks]
        for name, ns in zip(names, insts):
            for nd in ns:
                nd.group = name
        m = root.get_submodule(path)
        groups.append(LayerGroup(name=f"{path}@*", instances=names, signature=_module_signature(m, cache),
                                 nodes_per_instance=len(insts[0]),
                                 params_per_instance=sum(p.numel() for p in m.parameters())))
    return groups


def _find_groups(root: nn.Module | None, nodes: list[Node],
                 calls: dict[str, tuple[str, int]] | None = None) -> list[LayerGroup]:
    """Siblings of identical structure (same parent, same signature, >= 2 of
    them, same op sequence) are one repeated-layer group; siblings of one
    signature whose op sequences differ make a group per sequence shared by
    two or more (SmolLM3's layers without rotary positions beside those with
    them). Where a parent's groups and its other children run one after
    another, the parent a numbered container (``nn.ModuleList`` or
    ``nn.Sequential``: a stack of layers, some unlike the rest, as
    DeepSeek-V3's dense first layer before its mixture-of-experts layers),
    each other child is a
    layer instance of its own (``Node.group`` names it; it is in no group):
    a pipeline unit and a recompute region like any layer, its decisions
    its own."""
    if root is None:
        return []
    cache: dict[int, str] = {}
    by_parent: dict[str, dict[str, list[str]]] = defaultdict(dict)
    held = _holding_params(root)
    for path, m in root.named_modules():
        if not path or path not in held:
            continue
        parent = parent_module(path)
        by_parent[parent].setdefault(_module_signature(m, cache), []).append(path)
    instance_nodes: dict[str, list[Node]] = defaultdict(list)
    candidates = {p for sigs in by_parent.values() for paths in sigs.values() if len(paths) >= 2 for p in paths}
    for nd in nodes:  # a node belongs to every candidate module above it
        mod = nd.module
        while mod:
            if mod in candidates:
                instance_nodes[mod].append(nd)
            mod = parent_module(mod)
    # a module called several times is a stack of layers where it holds weights (not an activation
    # or a rotary embedding every layer calls)
    groups: list[LayerGroup] = _call_groups(root, nodes, {n: c for n, c in (calls or {}).items() if c[0] in held})
    singles: list[str] = []
    taken: set[str] = {g.instances[0] for g in groups}      # a called module's sub-modules are in its layers
    # outermost groups first: a block's sub-modules are not groups of their own
    for parent in sorted(by_parent, key=lambda p: (p.count("."), p)):
        if any(parent == t or parent.startswith(t + ".") for t in taken):
            continue
        found = []
        for sig, paths in sorted(by_parent[parent].items()):
            if len(paths) >= 2:
                found += [(sig, cls) for cls in _alike(paths, instance_nodes)]
        for k, (sig, cls) in enumerate(found):
            nparams = sum(p.numel() for p in root.get_submodule(cls[0]).parameters())
            name = (f"{parent}.*" if parent else "*") + (f"[{k}]" if len(found) > 1 else "")
            groups.append(LayerGroup(name=name, instances=cls, signature=sig,
                                     nodes_per_instance=len(instance_nodes[cls[0]]), params_per_instance=nparams))
            taken.update(cls)
        children = [p for sigs in by_parent[parent].values() for p in sigs]
        if found and all(p.rsplit(".", 1)[-1].isdigit() for p in children):    # an nn.ModuleList / Sequential
            others = _layers_beside(children, taken, nodes)
            singles += others
            taken.update(others)
    for g in groups:
        for p in g.instances:
            for nd in instance_nodes.get(p, []):
                nd.group = p
    # a called module inside another group's instances (a shared module every block calls twice):
    # those instances took its nodes, so its calls are no layers of their own
    for g in [g for g in groups if g.name.endswith("@*")]:
        mine = set(g.instances)
        owned = [nd for nd in nodes if nd.group in mine]
        if len(owned) != g.nodes_per_instance * len(g.instances):
            groups.remove(g)
            for nd in owned:
                nd.group = None
    if singles:
        single = set(singles)
        for nd in nodes:    # under a layer of its own: the nearest module above it that is one
            mod = nd.module
            while mod and mod not in single:
                mod = parent_module(mod)
            if mod:
                nd.group = mod
    return groups


def _alike(paths: list[str], instance_nodes: dict[str, list[Node]]) -> list[list[str]]:
    """The classes (two instances or more) of ``paths`` with one op sequence.
    torch.export computes a size expression once and reuses it (Mixtral's
    experts view by `16 * batch` in every layer, computed in the first): a
    class is formed without the size nodes, and where its instances differ by
    those alone they are left out of its instances' nodes."""
    def kinds(nds: list[Node]) -> tuple[str, ...]:
        return tuple(n.kind for n in nds)

    classes: dict[tuple[str, ...], list[str]] = {}
    for p in paths:
        classes.setdefault(kinds(n for n in instance_nodes.get(p, []) if n.kind != "shape"), []).append(p)
    out = []
    for sized, cls in classes.items():
        if not sized or len(cls) < 2:
            continue
        if len({kinds(instance_nodes[p]) for p in cls}) > 1:
            for p in cls:
                instance_nodes[p] = [n for n in instance_nodes[p] if n.kind != "shape"]
        out.append(cls)
    return out


def _layers_beside(children: list[str], grouped: set[str], nodes: list[Node]) -> list[str]:
    """The children of a parent not in a group, when all its children that
    run ops run one after another, each reading a value made at or after the
    end of the one before (a stack of layers, not parallel branches; not only
    its first node's input: Nemotron's layers start with their norm's
    ``weight + 1``); else none."""
    pos = {nd.name: k for k, nd in enumerate(nodes) if not nd.is_state}    # weights are read, not waited on
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    reads: dict[str, int] = {}
    child_of = {c: c for c in children}
    mine: dict[str, str] = {}
    for k, nd in enumerate(nodes):
        if nd.is_state:
            continue
        mod, c = nd.module, None
        while mod and c is None:
            c = child_of.get(mod)
            mod = parent_module(mod)
        if c is None:
            continue
        mine[nd.name] = c
        first.setdefault(c, k)
        last[c] = k
        reads[c] = max(reads.get(c, -1), *(pos[i] for i in nd.inputs if i in pos and mine.get(i) != c), -1)
    order = sorted(first, key=first.__getitem__)
    if len(order) < 2 or any(first[b] <= last[a] or reads[b] < last[a] for a, b in zip(order, order[1:])):
        return []
    return [c for c in order if c not in grouped]
