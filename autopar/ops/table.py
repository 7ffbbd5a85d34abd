"""The op table: every op autopar knows, filed under its kind.

A new op is one entry here: its name (as torch.fx / torch.export spell the
target, see :mod:`autopar.ops.registry`) and, where they differ from the
defaults, its facts: ``nonlinear`` (backward reads the inputs; ``operands``
says which),
``linear_in`` (``"all"`` / ``"first"``: Partial passes through), ``saved``
(selective recompute keeps the output), ``whole_dims`` (trailing dims
that cannot be split), ``shape_arg`` (the compiler localises that shape
argument). A new kind is one :func:`_kind` block here
plus its rule in :mod:`autopar.strategies.rules`.

Both front ends meet here: ``F.linear`` from fx and ``aten.addmm`` /
``aten.mm`` from torch.export, ``Tensor.view`` and ``aten._unsafe_view``,
``F.scaled_dot_product_attention`` and the fused aten attention kernels.
"""
from __future__ import annotations

from typing import Any

from .registry import register_kind, register_op

_NL = {"nonlinear": True}
_ALL = {"linear_in": "all"}
_FIRST = {"linear_in": "first"}
_SAVED = {"saved": True}
_SHAPE = {"shape_arg": 1}
_PRODUCT = {"operands": "product"}     # backward reads an operand only for another's gradient
_QUOTIENT = {"operands": "quotient"}


def _(name: str, *facts: dict) -> tuple[str, dict]:
    """One op entry with the merged ``facts``."""
    out: dict[str, Any] = {}
    for f in facts:
        out.update(f)
    return name, out


def _kind(kind: str, entries: tuple, family: str = "other", doc: str = "") -> None:
    """Register ``kind`` and its ops (plain names or :func:`_` entries), in order."""
    register_kind(kind, family, doc)
    for e in entries:
        name, facts = (e, {}) if isinstance(e, str) else e
        register_op(name, kind, **facts)


_kind("linear", ("linear", _("addmm", _SAVED)), "matmul",
      "x @ W^T with a weight: F.linear; aten.addmm(bias, x, W^T) from export")
_kind("matmul", ("matmul", _("bmm", _SAVED), _("mm", _SAVED), _("baddbmm", _SAVED)), "matmul",
      "products of two activations (or a weight used as a plain matrix)")
# transformers' grouped_mm_fallback is a custom op of its own namespace: selective recompute
# (which keeps aten ops by packet) runs it again, so it is not listed as saved
_kind("grouped_mm", ("grouped_mm_fallback", _("_grouped_mm", _SAVED), "grouped_mm"), "matmul",
      "x[S, K] @ w[E, K, N] by groups of rows (mixture-of-experts layers: transformers' "
      "grouped_mm_fallback, torch._grouped_mm)")
# torch.einsum (fx; torch.export writes it out as bmm and permutes): the trace reads its labels
_kind("einsum", ("einsum",), "matmul",
      "Einstein summation: each operand's dims labelled by letters; a letter shared is multiplied "
      "along, one missing from the output summed over")
# per sample over groups of channels and the spatial dims (diffusion U-Nets, ConvNeXt-style models)
_kind("groupnorm", ("group_norm", "native_group_norm"), doc="normalisation of each sample over groups of channels")
# F.interpolate and the aten kernels it calls: each sample and channel on its own
_kind("resample", ("interpolate", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                   "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d", "upsample_trilinear3d",
                   "_upsample_nearest_exact2d", "_upsample_bilinear2d_aa"), doc="spatial resampling, NC... layout")
# a mean / sum (or none) over an elementwise loss of two tensors alike
_kind("pointwise_loss", ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"),
      doc="an elementwise loss of input and target, reduced over every element")
# torch.broadcast_tensors (F.mse_loss calls it): each input expanded to the common shape
_kind("broadcast", ("broadcast_tensors",), doc="tensors expanded to one shape (a tuple)")
# one op over the sequence: replicated on tp, the samples split on [seq, batch] input (rules.py)
_kind("recurrent", ("lstm", "gru", "rnn_tanh", "rnn_relu"), "matmul",
      "nn.LSTM / nn.GRU / nn.RNN as one op over the sequence (aten.lstm, ...): its weights' products per token")
_kind("sdpa", ("scaled_dot_product_attention", _("_scaled_dot_product_flash_attention", _SAVED),
               _("_scaled_dot_product_efficient_attention", _SAVED),
               _("_scaled_dot_product_flash_attention_for_cpu", _SAVED)), "matmul",
      "fused attention on [B, H, T, D]")
_kind("embedding", ("embedding",), doc="row lookup in a weight table")
_kind("layernorm", ("layer_norm", "native_layer_norm"), doc="normalisation over the trailing dims")
_kind("rmsnorm", ("rms_norm",), doc="RMS normalisation over the trailing dims")
_kind("softmax", ("softmax", "log_softmax", "_softmax", "_log_softmax"), doc="(log-)softmax along one dim")
_kind("cross_entropy", ("cross_entropy", "cross_entropy_loss"), doc="loss over logits [N, C] and targets [N]")
_kind("normalize", ("normalize",), doc="F.normalize: a p-norm over one dim (dim 1 unless given) divides each vector")
_kind("nll_loss", ("nll_loss", "nll_loss_nd"),
      doc="negative log-likelihood of log-probabilities [N, C] and targets [N]")
_kind("conv", ("conv1d", "conv2d", "conv3d", _("convolution", _SAVED)), "matmul", "convolution, NC... layout")
_kind("batchnorm", ("batch_norm", "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
                    "native_batch_norm"), doc="batch normalisation over N and the spatial dims")
_kind("pool", ("max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d",
               "adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool2d_with_indices", "_adaptive_avg_pool2d"),
      doc="spatial pooling, NC... layout")
_kind("reduction", ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod"),
      doc="reductions over some dims")
_kind("view", (_("view", _SHAPE), _("reshape", _SHAPE), "flatten", "unflatten", "view_as", _("contiguous", _FIRST),
               _("_unsafe_view", _SHAPE), _("clone", _FIRST),
               "alias", "detach", "lift_fresh_copy", "_to_copy", _("to", _FIRST), "type", _("type_as", _FIRST),
               _("float", _FIRST), "half", "bfloat16", "double", "long"),
      doc="same elements, new shape or dtype")
_kind("transpose", ("transpose", "permute", "t"), doc="dim permutations")
_kind("expand", (_("expand", _SHAPE), "unsqueeze", "squeeze", "expand_as", "repeat_interleave", "repeat"),
      doc="dims added, removed or broadcast")
_kind("index", ("getitem", "narrow", "select", "slice"), doc="basic indexing")
_kind("split", ("split", "chunk", "unbind", "split_with_sizes", "tensor_split"), doc="one tensor into a tuple")
_kind("item", (), doc="getitem on the tuple a split returned (set by the tracer, no op of its own)")
_kind("cat", ("cat", "stack", "concat", "concatenate"), doc="tensors joined along a dim")
_kind("elementwise", (
    _("add", _ALL), _("sub", _ALL), _("mul", _FIRST, _NL, _PRODUCT), _("truediv", _FIRST, _NL, _QUOTIENT),
    _("div", _FIRST, _NL, _QUOTIENT),
    _("neg", _FIRST), _("pow", _NL), _("rsqrt", _NL), _("sqrt", _NL), _("exp", _NL), _("log", _NL),
    _("gelu", _NL), _("relu", _NL), _("silu", _NL), _("sigmoid", _NL), _("tanh", _NL), _("dropout", _FIRST),
    "masked_fill", "where", "clamp", "abs", "cos", "sin", _("erf", _NL), "floordiv", _("reciprocal", _NL),
    _("square", _NL), _("iadd", _ALL), _("imul", _FIRST), _("add_", _ALL), _("mul_", _FIRST), "relu_",
    "native_dropout", "gelu_", _("leaky_relu", _NL), _("softplus", _NL), "eq", "ne", "lt", "gt", "le", "ge",
    "logical_not", "bitwise_not", "maximum", "minimum", _("mish", _NL), "hardtanh", _("elu", _NL),
    _("rsub", _ALL), _("radd", _ALL), _("rmul", _FIRST), "lerp", "addcmul", "addcdiv", "masked_fill_", "fill_",
    "copy_", "assigned", "zeros_like", "ones_like", "full_like", _("tril", {"whole_dims": 2}),
    _("triu", {"whole_dims": 2})),
    doc="one output element per aligned input elements (broadcasting)")
_kind("scatter", ("slice_scatter", "select_scatter"),
      doc="a tensor with a slice or a select of it replaced (in-place writes into parts, made out of place)")
_kind("pad", ("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
               "replication_pad1d", "replication_pad2d", "replication_pad3d"),
      doc="padding of some trailing dims (F.pad; aten.constant_pad_nd and the reflection / replication pads)")
_kind("factory", ("arange", "zeros", "ones", "full", "empty", "randn", "rand", "tensor", "scalar_tensor",
                  "new_zeros", "new_ones", "new_empty", "new_full", "linspace", "eye"),
      doc="new tensors from sizes alone")
_kind("shape", ("size", "dim", "numel", "sym_size", "getattr", "len"), doc="Python values about shapes")
# ops known only for what selective recompute keeps: no kind of their own yet, so
# the tracer files them as "other" (replicated) exactly as before they were listed
_kind("other", (
    _("_convolution", _SAVED), _("_scaled_dot_product_cudnn_attention", _SAVED),
    _("_scaled_dot_product_fused_attention_overrideable", _SAVED), _("_flash_attention_forward", _SAVED),
    _("_efficient_attention_forward", _SAVED)),
    doc="ops without a sharding rule: replicated")
