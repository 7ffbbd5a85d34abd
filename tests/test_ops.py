"""The op registry (autopar.ops) and every sharding rule checked against running the op.

The registry half checks that the records reproduce the tables they replace
(the tracer's kinds, the cost model's sets, the runtime's selective-recompute
ops, the compiler's shape-argument ops) and that torch and aten targets find
their records.

The ground-truth half does what DTensor's strategy validation does, in one
process: small models are traced, every node with a sharding rule gets its
candidates on a simulated axis of 2 and 4 ranks, and for each candidate the
node's op runs once per simulated rank on the local inputs (``S(d)``: that
rank's chunk of dim ``d``; ``R``: a copy; ``P``: random summands that add up
to the value), scaled by the strategy's ``scale``, with shape arguments
localised as the compiler does. The local outputs are put back together by
the output placement (``S``: concatenated, ``R``: all equal, ``P``: summed)
and compared with the op on the whole inputs, in float64; so are the
gradients of the whole sharded computation. The vocabulary-parallel kernels
are emulated here (the real ones run collectives): the embedding zeroes ids
outside the rank's rows, the cross-entropy all-reduces the max, the sum of
exponentials and the target logit over the simulated ranks, as
``autopar.runtime.kernels`` does.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import ops
from autopar.errors import AutoparError
from autopar.graph import Graph, Node
from autopar.compile.rewrite import _local_pieces
from autopar.spec import local_chunk, shard_blocks, unblock
from autopar.strategies import P, R, S, is_shard, shard_dim
from autopar.strategies.rules import Ctx, Strategy, candidates
from autopar.trace import KINDS, op_family

# ------------------------------------------------------------------ the tables the registry replaced
OLD_KINDS = {
    "linear": ("linear", "addmm"),
    "matmul": ("matmul", "bmm", "mm", "baddbmm"),
    "grouped_mm": ("grouped_mm_fallback", "_grouped_mm", "grouped_mm"),
    "sdpa": ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"),
    "embedding": ("embedding",),
    "layernorm": ("layer_norm", "native_layer_norm"),
    "rmsnorm": ("rms_norm",),
    "softmax": ("softmax", "log_softmax", "_softmax", "_log_softmax"),
    "cross_entropy": ("cross_entropy", "cross_entropy_loss"),
    "normalize": ("normalize",),
    "nll_loss": ("nll_loss", "nll_loss_nd"),
    "conv": ("conv1d", "conv2d", "conv3d", "convolution"),
    "batchnorm": ("batch_norm", "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
                  "native_batch_norm"),
    "pool": ("max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "adaptive_avg_pool1d",
             "adaptive_avg_pool2d", "adaptive_max_pool2d", "max_pool2d_with_indices", "_adaptive_avg_pool2d"),
    "reduction": ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod"),
    "view": ("view", "reshape", "flatten", "unflatten", "view_as", "contiguous", "_unsafe_view",
             "clone", "alias", "detach", "lift_fresh_copy", "_to_copy", "to", "type", "type_as",
             "float", "half", "bfloat16", "double", "long"),
    "transpose": ("transpose", "permute", "t"),
    "expand": ("expand", "unsqueeze", "squeeze", "expand_as", "repeat_interleave", "repeat"),
    "index": ("getitem", "narrow", "select", "slice"),
    "split": ("split", "chunk", "unbind", "split_with_sizes", "tensor_split"),
    "cat": ("cat", "stack", "concat", "concatenate"),
    "elementwise": ("add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log",
                    "gelu", "relu", "silu", "sigmoid", "tanh", "dropout", "masked_fill", "where",
                    "clamp", "abs", "cos", "sin", "erf", "floordiv", "reciprocal", "square", "iadd",
                    "imul", "add_", "mul_", "relu_", "native_dropout", "gelu_", "leaky_relu", "softplus",
                    "eq", "ne", "lt", "gt", "le", "ge", "logical_not", "bitwise_not", "maximum", "minimum",
                    "mish", "hardtanh", "elu", "rsub", "radd", "rmul", "lerp", "addcmul", "addcdiv",
                    "masked_fill_", "fill_", "copy_", "assigned", "zeros_like", "ones_like", "full_like", "tril",
                    "triu"),
    "scatter": ("slice_scatter", "select_scatter"),
    "pad": ("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
            "replication_pad1d", "replication_pad2d", "replication_pad3d"),
    "factory": ("arange", "zeros", "ones", "full", "empty", "randn", "rand", "tensor", "scalar_tensor",
                "new_zeros", "new_ones", "new_empty", "new_full", "linspace", "eye"),
    "shape": ("size", "dim", "numel", "sym_size", "getattr", "len"),
}
OLD_FAMILY = {"linear": "matmul", "matmul": "matmul", "sdpa": "matmul", "conv": "matmul", "grouped_mm": "matmul"}
OLD_NONLINEAR = {"gelu", "relu", "silu", "sigmoid", "tanh", "mul", "truediv", "div", "pow", "exp", "log",
                 "rsqrt", "sqrt", "softplus", "erf", "mish", "elu", "leaky_relu", "square", "reciprocal"}
OLD_LINEAR_ADD = ("add", "sub", "iadd", "add_", "neg", "radd", "rsub")
OLD_LINEAR_FIRST = ("mul", "truediv", "div", "imul", "mul_", "rmul",
                    "dropout", "float", "to", "type_as", "contiguous", "clone")


#: kinds registered since the tables were replaced, with their family
NEW_KINDS = {"recurrent": "matmul", "einsum": "matmul", "groupnorm": "other", "resample": "other",
             "pointwise_loss": "other", "broadcast": "other"}


def test_kinds_are_the_old_table():
    old = {k: v for k, v in KINDS.items() if k not in NEW_KINDS}
    assert old == OLD_KINDS
    assert [list(v) for v in old.values()] == [list(v) for v in OLD_KINDS.values()]  # order too
    for kind in list(OLD_KINDS) + ["item", "param", "input", "other", "no-such-kind"]:
        assert op_family(kind) == OLD_FAMILY.get(kind, "other"), kind
    for kind, family in NEW_KINDS.items():
        assert op_family(kind) == family, kind
    assert ops.matmul_kinds() == {"linear", "matmul", "sdpa", "conv", "grouped_mm", "recurrent", "einsum"}


def test_op_facts_are_the_old_sets():
    assert ops.nonlinear_ops() == OLD_NONLINEAR
    # neg moved from "all" to "first": for one operand both offer the same (P,) -> P, and
    # "all" now means a sum of tensors (no partial for x + 1, see the rule's ground truth)
    assert {o.name for o in ops.ops() if o.linear_in == "all"} == set(OLD_LINEAR_ADD) - {"neg"}
    assert {o.name for o in ops.ops() if o.linear_in == "first"} == set(OLD_LINEAR_FIRST) | {"neg"}
    assert ops.is_nonlinear("gelu") and ops.is_nonlinear(F.gelu) and not ops.is_nonlinear("add")
    assert not ops.is_nonlinear("no_such_op")


# what the runtime and the compiler kept before the registry (frozen copies)
OLD_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                "_efficient_attention_forward",
                "_grouped_mm")   # added with the grouped_mm kind (mixtures of experts)
OLD_SHAPE_ARG_OPS = {"view", "reshape", "expand", "_unsafe_view"}


def test_save_ops_are_the_runtimes():
    """ops.save_ops() is what selective recompute kept in runtime/regions.py."""
    want = {getattr(torch.ops.aten, n) for n in OLD_SAVE_OPS if hasattr(torch.ops.aten, n)}
    assert ops.save_ops() == want
    assert torch.ops.aten.mm in ops.save_ops() and torch.ops.aten.gelu not in ops.save_ops()


def test_shape_arg_ops_are_the_compilers():
    """ops.shape_arg_ops() is what the compiler localised in compile/rewrite.py."""
    assert ops.shape_arg_ops() == OLD_SHAPE_ARG_OPS
    assert ops.op_info("view").shape_arg == 1 and ops.op_info("flatten").shape_arg is None
    assert ops.op_info(torch.ops.aten.view.default).shape_arg == 1


ATEN = torch.ops.aten


@pytest.mark.parametrize("target, kind", [
    (ATEN.mm.default, "matmul"), (ATEN.addmm.default, "linear"), (ATEN.bmm.default, "matmul"),
    (ATEN.linear.default, "linear"), (ATEN._unsafe_view.default, "view"), (ATEN.view.default, "view"),
    (ATEN.expand.default, "expand"), (ATEN.permute.default, "transpose"), (ATEN.transpose.int, "transpose"),
    (ATEN.split_with_sizes.default, "split"), (ATEN.slice.Tensor, "index"),
    (ATEN._scaled_dot_product_flash_attention_for_cpu.default, "sdpa"),
    (ATEN._scaled_dot_product_efficient_attention.default, "sdpa"),
    (ATEN.native_layer_norm.default, "layernorm"), (ATEN.embedding.default, "embedding"),
    (ATEN.gelu.default, "elementwise"), (ATEN.silu.default, "elementwise"), (ATEN.add.Tensor, "elementwise"),
    (ATEN.mul.Tensor, "elementwise"), (ATEN.mm, "matmul"), (F.linear, "linear"), (torch.matmul, "matmul"),
    (F.scaled_dot_product_attention, "sdpa"), (operator.add, "elementwise"), (operator.getitem, "index"),
    ("view", "view"), ("transpose", "transpose"), (torch.cat, "cat"), (F.embedding, "embedding"),
])
def test_targets_find_their_record(target, kind):
    assert ops.kind_of(target) == kind
    info = ops.op_info(target)
    assert info is not None and info.kind == kind
    assert ops.rule(kind) is not None


def test_records_list_their_torch_targets():
    assert F.linear in ops.op_info("linear").targets and ATEN.linear in ops.op_info("linear").targets
    assert set(ops.op_info("add").targets) >= {operator.add, torch.add, torch.Tensor.add, ATEN.add}
    assert ATEN._unsafe_view in ops.op_info("_unsafe_view").targets
    assert ops.kind_of("not_an_op") == "other" and ops.op_info(ATEN.cumsum.default) is None


def test_every_kind_with_ops_has_a_rule():
    without = {k for k in KINDS if ops.rule(k) is None}
    assert without == {"shape"}                      # sizes are Python values: nothing to shard
    assert ops.rule("item") is not None and ops.rule("other") is None


def test_registry_rejects_duplicates_and_unknown_kinds():
    with pytest.raises(AutoparError, match="'add' is registered twice"):
        ops.register_op("add", "elementwise")
    with pytest.raises(AutoparError, match="unknown kind 'nope'"):
        ops.register_op("brand_new_op", "nope")
    with pytest.raises(AutoparError, match="linear_in"):
        ops.register_op("brand_new_op", "elementwise", linear_in="second")
    with pytest.raises(AutoparError, match="unknown op kind 'nope'"):
        ops.register_rule("nope")(lambda ctx: [])
    with pytest.raises(AutoparError, match="two sharding rules"):
        ops.register_rule("linear")(lambda ctx: [])
    with pytest.raises(AutoparError, match="unknown cost family"):
        ops.register_kind("brand_new_kind", family="memory")
    assert ops.op_info("brand_new_op") is None and ops.kind_info("brand_new_kind") is None


# ------------------------------------------------------------------ ground truth: the cases
T, C, H, V = 8, 8, 2, 16


class _Attention(nn.Module):
    """Embedding, layer/RMS norms, a fused and an explicit attention, an MLP, a vocab head and the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.ln = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C, bias=False)
        self.rms = nn.RMSNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.head = nn.Linear(C, V, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, ids, target):
        x = self.emb(ids)
        B, S, _ = x.size()
        q, k, v = self.qkv(self.ln(x)).split(C, dim=2)
        q = q.view(B, S, H, C // H).transpose(1, 2)
        k = k.view(B, S, H, C // H).transpose(1, 2)
        v = v.reshape(B, S, H, C // H).permute(0, 2, 1, 3)
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = (y + fused).transpose(1, 2).contiguous().view(B, S, C)
        x = x + self.proj(y)
        h = F.gelu(self.fc(self.rms(x)))
        x = x + F.dropout(h[..., :C], 0.0) * torch.sigmoid(h[..., C:2 * C])
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, V), target.view(-1)), F.log_softmax(logits, -1)


class _Pointwise(nn.Module):
    """Elementwise ops with broadcasting and scalars, reductions, views, indexing, splits, joins."""

    def forward(self, x, y, z):                    # x [4, 8, 6], y [6], z [4, 1, 6]
        a = x + y
        b = x * z - y
        c = torch.where(x > 0, a, b)
        d = torch.exp(a) / (a.abs() + 1.0)
        e = (2.0 - x, 1.0 / x, x.norm(2, 1))
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        sums = (a.sum(dim=1), c.mean(-1, keepdim=True), b.amax(dim=(0, 2)), d.sum(), x.max(dim=1),
                x.var(dim=0), torch.logsumexp(a, dim=2), -a)
        joins = (torch.cat([a, b], dim=2), torch.stack([a, c], dim=1), torch.cat([x, x], dim=0))
        views = (x.reshape(4, 48), x.flatten(1), x.view(32, 6), x.unflatten(1, (2, 4)), x.permute(2, 0, 1),
                 x.transpose(0, 1), y.unsqueeze(0).t(), a.unsqueeze(1).squeeze(1), z.expand(4, 8, 6), y.expand_as(x),
                 (x * 4).long(),
                 x.repeat(1, 1, 2), x.repeat_interleave(2, dim=1), x.to(torch.float64), x.clone())
        index = (x[:, 2:6], x.narrow(1, 0, 4), x.select(2, 1), x[None, :, 0], x[..., -6:], x[:, :, 1])
        p, q = x.chunk(2, dim=2)
        s0, s1, s2, s3 = x.unbind(0)
        u, w = torch.split(x, [2, 2], dim=0)
        tri = torch.tril(x[0]) + torch.triu(x[1], 1)
        pads = (F.pad(x, (0, 0, 1, 2)), F.pad(x, (1, 1), mode="reflect"), F.pad(x, (0, 0, 0, x.shape[1] % 3)))
        parts = (torch.slice_scatter(x, torch.tanh(x[..., :2]), 2, 0, 2),    # x[..., :2] = tanh(...), made
                 torch.select_scatter(x, x[:, 3] * 2.0, 1, 3))                # out of place
        unit = (F.normalize(x), F.normalize(x, dim=-1), F.normalize(a, p=1.0, dim=0))   # dim 1 unless given
        return a, b, c, d, e, rms, sums, joins, views, index, p * q, s0 + s3, s1 - s2, u + w, tri, pads, parts, unit


def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row s of x times the weight of its group: transformers' grouped_mm_fallback, as a loop."""
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[i]
        start = end
    return out


# a custom op named as transformers registers its own (the op registry knows it by that name)
torch.library.custom_op("autopar_test::grouped_mm_fallback", _grouped_mm_loop, mutates_args=(),
                        schema="(Tensor input, Tensor weight, Tensor offs) -> Tensor")
torch.library.register_fake("autopar_test::grouped_mm_fallback",
                            lambda x, w, offs: x.new_empty(x.shape[0], w.shape[2]))


def _grouped_mm_bwd(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for i, end in enumerate(ctx.offs.tolist()):
        gx[start:end] = grad[start:end] @ w[i].T
        gw[i] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw, None


def _grouped_mm_ctx(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


torch.library.register_autograd("autopar_test::grouped_mm_fallback", _grouped_mm_bwd, setup_context=_grouped_mm_ctx)


class _Matmuls(nn.Module):
    """Functional linears with a bias, addmm / bmm / baddbmm / mm, broadcasting matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 8))
        self.b = nn.Parameter(torch.randn(12))
        self.experts = nn.Parameter(torch.randn(3, 8, 12))     # a mixture of experts' [E, K, N]

    def forward(self, x, m, a):                    # x [4, 6, 8], m [8, 12], a [4, 8, 8]
        lin = F.linear(x, self.w, self.b)
        am = torch.addmm(self.b, x.view(24, 8), self.w.t())
        offs = torch.tensor([6, 6, 24])                         # 6 rows to expert 0, none to 1, 18 to 2
        grouped = torch.ops.autopar_test.grouped_mm_fallback(x.view(24, 8), self.experts, offs)
        return (lin, am, x @ m, torch.matmul(a, x.transpose(1, 2)), torch.bmm(a, a),
                torch.baddbmm(a, a, a), torch.mm(x[0], m), torch.matmul(x, self.w.t()), grouped)


class _Einsums(nn.Module):
    """torch.einsum as research code writes it: attention with spaced labels, a weight, the
    implicit output, an ellipsis, a broadcast size-1 dim, three operands, one operand, a list."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))

    def forward(self, q, k, z):                    # q, k [4, 2, 6, 8], z [4, 1, 6, 8]
        scores = torch.einsum("b h i d, b h j d -> b h i j", q, k)
        ctx = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), k)
        return (scores, ctx, torch.einsum("bhid,de->bhie", q, self.w), torch.einsum("bhid,bhjd", q, k),
                torch.einsum("...id,...jd->...ij", q, z), torch.einsum("bhid,bhid,de->bhe", q, z, self.w),
                torch.einsum("bhid->bdh", q), torch.einsum("bhid,bhjd->bhij", [q, k]),
                torch.einsum("bhii->bhi", scores))


class _Diffusion(nn.Module):
    """What a diffusion U-Net adds: group norm, nearest / bilinear resampling, and the losses of
    a predicted noise (mean squared, L1, smooth L1, Huber; a mean, a sum, none)."""

    def __init__(self) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x, noise):                  # x, noise [4, 4, 8, 8]
        h = self.gn(x)
        up = F.interpolate(h, scale_factor=2, mode="nearest")
        lin = F.interpolate(h, size=(12, 12), mode="bilinear", align_corners=False)
        return (up, lin, F.mse_loss(h, noise), F.mse_loss(h, noise, reduction="sum"), F.l1_loss(h, noise),
                F.smooth_l1_loss(h, noise, beta=0.5), F.huber_loss(h, noise, reduction="none"))


class _Convs(nn.Module):
    """Convolution, batch norm, pooling (NCHW)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bias = nn.Parameter(torch.randn(8))
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):                          # [4, 4, 8, 8]
        h = self.pool(F.relu(self.bn(self.conv(x))))
        return self.avg(h), F.avg_pool2d(h, 2), F.conv2d(x, self.conv.weight, self.bias, padding=1)


class _Losses(nn.Module):
    """Cross-entropy with sum reduction and with ignored targets; a weight-first embedding (export's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, C))

    def forward(self, logits, target, ids):        # [8, 16], [8], [4, 4]
        return (F.cross_entropy(logits, target, reduction="sum"),
                F.cross_entropy(logits, torch.where(target > 11, -100, target)),
                F.nll_loss(F.log_softmax(logits, -1), target), F.nll_loss(logits, target, reduction="sum"),
                torch.embedding(self.table, ids), torch.arange(ids.size(1), dtype=torch.float64) * 2)


def _case_inputs(gen: torch.Generator) -> dict[str, tuple[nn.Module, tuple, bool]]:
    """name -> (model in float64, example inputs, is the axis the batch axis)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def ids(hi, *shape):
        return torch.randint(0, hi, shape, generator=gen)

    torch.manual_seed(0)
    conv_eval = _Convs().double().eval()
    with torch.no_grad():
        conv_eval.bn.running_mean.copy_(rnd(8))
        conv_eval.bn.running_var.copy_(rnd(8).abs() + 0.5)
    return {
        "attention": (_Attention().double(), (ids(V, 4, T), ids(V, 4, T)), False),
        "pointwise": (_Pointwise(), (rnd(4, 8, 6), rnd(6), rnd(4, 1, 6)), False),
        "matmuls": (_Matmuls().double(), (rnd(4, 6, 8), rnd(8, 12), rnd(4, 8, 8)), False),
        "einsums": (_Einsums().double(), (rnd(4, 2, 6, 8), rnd(4, 2, 6, 8), rnd(4, 1, 6, 8)), False),
        "diffusion": (_Diffusion().double(), (rnd(4, 4, 8, 8), rnd(4, 4, 8, 8)), False),
        "convs": (_Convs().double(), (rnd(4, 4, 8, 8),), False),
        "convs_eval_dp": (conv_eval, (rnd(4, 4, 8, 8),), True),
        "losses": (_Losses().double(), (rnd(8, V), ids(V, 8), ids(V, 4, 4)), False),
        # nn.LSTM and nn.GRU on [seq, batch, features] (their default layout): one aten op each
        "recurrent": (_Recurrent().double(), (rnd(6, 4, 8),), True),
    }


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, 2)
        self.gru = nn.GRU(8, 8)

    def forward(self, x):
        return self.gru(self.lstm(x)[0])[0]


# ------------------------------------------------------------------ ground truth: the simulated axis
class _Recorder(fx.Interpreter):
    """Runs a GraphModule and keeps every node's value (the global values each node's inputs take)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _tensors(v: Any) -> list[torch.Tensor]:
    return [v] if isinstance(v, torch.Tensor) else [t for t in v if isinstance(t, torch.Tensor)] \
        if isinstance(v, (tuple, list)) else []


def _each(v: Any, fn) -> Any:
    """``fn`` on a tensor, or on each tensor of a tuple (a split's or a max's outputs)."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, (tuple, list)):
        return tuple(fn(t) if isinstance(t, torch.Tensor) else t for t in v)
    return v


def _leaf(v: Any, grad: bool) -> Any:
    """A fresh copy of ``v`` (a tensor or a tuple of them) that is a leaf of autograd:
    requiring grad when it is a float and ``grad`` (buffers get none)."""
    return _each(v, lambda t: t.detach().clone().requires_grad_(grad and t.is_floating_point()))


def _summands(t: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` random tensors that add up to ``t`` (a Partial value's local parts)."""
    if t.dtype == torch.bool:
        raise AssertionError("a Partial placement for a bool tensor")
    if t.is_floating_point():
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-5, 5, t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
    return parts + [t - sum(parts)]


def _local(v: Any, p: str, n: int, parts: Any) -> list[Any]:
    """The local value of every rank for placement ``p`` (``parts``: the summands, for P)."""
    if p == R:
        return [v] * n
    if p == P:
        return [parts[r] if isinstance(v, torch.Tensor) else tuple(x[r] for x in parts) for r in range(n)]
    d, k = shard_dim(p), shard_blocks(p)

    def chunk(t: torch.Tensor, r: int) -> torch.Tensor:
        if t.dim() <= d or t.shape[d] % (n * k):
            raise AssertionError(f"{p} of a tensor of shape {tuple(t.shape)} on {n} ranks")
        return local_chunk(t, d, n, r, k)       # S(d,k): the rank's chunk of every block
    return [_each(v, lambda t, r=r: chunk(t, r)) for r in range(n)]


def _assemble(outs: list[Any], p: str) -> Any:
    """The global value from the ranks' local outputs under placement ``p``."""
    if isinstance(outs[0], (tuple, list)):
        return tuple(_assemble([o[i] for o in outs], p) if isinstance(outs[0][i], torch.Tensor) else outs[0][i]
                     for i in range(len(outs[0])))
    if p == R:
        for r, o in enumerate(outs[1:], 1):
            if not _close(o, outs[0]):
                raise AssertionError(f"R output differs between rank 0 and rank {r}")
        return outs[0]
    if p == P:
        return sum(outs[1:], outs[0])
    return unblock(torch.cat(outs, shard_dim(p)), shard_dim(p), len(outs), shard_blocks(p))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=1e-7, atol=1e-9, equal_nan=True)
    return torch.equal(a, b)


def _call(fnode: fx.Node, nd: Node, tensor_args: list[Any], values: dict[str, Any],
          local_shape: tuple[int, ...] | None = None, pieces_over: int = 1) -> Any:
    """Run ``fnode``'s op with its tensor inputs (``nd.inputs`` order) replaced by
    ``tensor_args`` and its other node arguments (sizes) by their recorded values;
    ``local_shape`` replaces the shape argument of the ops that have one, as the compiler does;
    ``pieces_over``: a split into equal pieces of a dim blocked over that many ranks (``S(d,k)``)
    cuts the local pieces, as the compiler does."""
    it = iter(zip(nd.inputs, tensor_args))
    pending = [next(it, None)]

    def sub(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if pending[0] is not None and pending[0][0] == a.name:
                v = pending[0][1]
                pending[0] = next(it, None)
                return v
            return values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a) if isinstance(a, tuple) else [sub(x) for x in a]
        if isinstance(a, dict):
            return {k: sub(x) for k, x in a.items()}
        return a

    args, kwargs = sub(tuple(fnode.args)), sub(dict(fnode.kwargs))
    info = ops.op_info(nd.target)
    if local_shape is not None and info is not None and info.shape_arg is not None:
        args, kwargs = args[:info.shape_arg] + (tuple(local_shape),), {}
    if pieces_over > 1:
        args = _local_pieces(fnode, args, pieces_over)
    if fnode.op == "call_method":
        return getattr(args[0], fnode.target)(*args[1:], **kwargs)
    return fnode.target(*args, **kwargs)


def _vocab_embedding(nd: Node, in_kinds: list[str], locals_: list[list[Any]], n: int) -> list[Any]:
    """Emulates ``runtime.kernels.vocab_parallel_embedding``: rank r holds rows
    [r*V/n, (r+1)*V/n); other ids give zero rows (a Partial output)."""
    wi = 0 if in_kinds[0] in ("param", "buffer") else 1
    out = []
    for r, xs in enumerate(locals_):
        ids, w = xs[1 - wi], xs[wi]
        lo = r * w.shape[0]
        inside = (ids >= lo) & (ids < lo + w.shape[0])
        out.append(F.embedding(torch.where(inside, ids - lo, 0), w).masked_fill(~inside.unsqueeze(-1), 0.0))
    return out


def _vocab_cross_entropy(nd: Node, locals_: list[list[Any]], n: int) -> list[Any]:
    """Emulates ``runtime.kernels.vocab_parallel_cross_entropy``: rank r holds
    logit columns [r*V/n, (r+1)*V/n); the max, the sum of exponentials and the
    target logit are all-reduced (here: reduced over the simulated ranks)."""
    xs = [x[0] for x in locals_]
    target = locals_[0][1]
    per = xs[0].shape[-1]
    ignore = int(nd.attrs.get("ignore_index", -100))
    m = torch.stack([x.max(-1).values for x in xs]).amax(0).detach()
    sum_exp = sum((x - m[:, None]).exp().sum(-1) for x in xs)
    valid = target != ignore
    tl = 0
    for r, x in enumerate(xs):
        inside = valid & (target >= r * per) & (target < (r + 1) * per)
        idx = torch.where(inside, target - r * per, 0)
        tl = tl + (x - m[:, None]).gather(-1, idx[:, None]).squeeze(-1) * inside
    loss = torch.where(valid, sum_exp.log() - tl, 0.0)
    red = nd.attrs.get("reduction", "mean")
    loss = loss.sum() if red == "sum" else loss if red == "none" else loss.sum() / valid.sum()
    return [loss] * n


def _check(fnode: fx.Node, nd: Node, in_kinds: list[str], st: Strategy, n: int,
           values: dict[str, Any], gen: torch.Generator) -> str | None:
    """None if ``st`` reproduces the op (value and gradients), else why not."""
    if len(st.ins) != len(nd.inputs):
        return f"{len(st.ins)} input placements for {len(nd.inputs)} tensor inputs"
    glob = [_leaf(values[i], k != "buffer") for i, k in zip(nd.inputs, in_kinds)]
    ref = _call(fnode, nd, glob, values)
    parts = [None if p != P else (_summands(v, n, gen) if isinstance(v, torch.Tensor) else
                                  [_summands(t, n, gen) for t in v]) for v, p in zip(glob, st.ins)]
    per_input = [_local(v, p, n, ps) for v, p, ps in zip(glob, st.ins, parts)]
    locals_ = [[x[r] for x in per_input] for r in range(n)]
    if st.kernel == "vocab_embedding":
        outs = _vocab_embedding(nd, in_kinds, locals_, n)
    elif st.kernel == "vocab_cross_entropy":
        outs = _vocab_cross_entropy(nd, locals_, n)
    else:
        shape = None
        if nd.out is not None:
            shape = list(nd.out.shape)
            if is_shard(st.out):
                shape[shard_dim(st.out)] //= n
        pieces = n if nd.kind == "split" and st.name == "blocks" else 1
        outs = [_call(fnode, nd, locals_[r], values, shape, pieces) for r in range(n)]
    if st.scale != 1.0:
        outs = [_each(o, lambda t: t * st.scale) for o in outs]
    got = _assemble(outs, st.out)
    if not _close(got, ref):
        return "output differs from the unsharded op"
    leaves = [t for v in glob for t in _tensors(v) if t.requires_grad]
    outs_f = [(a, b) for a, b in zip(_tensors(ref), _tensors(got)) if a.is_floating_point() and a.requires_grad]
    if not leaves or not outs_f:
        return None
    cots = [torch.randn(a.shape, generator=gen, dtype=a.dtype) for a, _ in outs_f]

    def grads(which: int) -> list[torch.Tensor | None]:
        loss = sum((o[which].nan_to_num(0.0, 0.0, 0.0) * c).sum() for o, c in zip(outs_f, cots))
        return list(torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True))
    for gr, gg in zip(grads(0), grads(1)):
        if (gr is None) != (gg is None) or (gr is not None and not _close(gg, gr)):
            return "gradient differs from the unsharded op's"
    return None


def _validate(case: str, model: nn.Module, inputs: tuple, batch_axis: bool,
              frontend: str = "fx") -> tuple[dict, set]:
    """Every candidate of every ruled node of ``case`` on 2 and 4 ranks.
    Returns ({(case, node, n, strategy): why} for the failures, the kinds seen)."""
    g: Graph = autopar.trace(model, inputs, frontend=frontend)
    rec = _Recorder(g.gm)
    # an export graph takes the parameters and buffers as placeholders, before the inputs
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    user = iter(inputs)
    rec.run(*[state[f.meta["autopar_param"]] if "autopar_param" in f.meta else next(user)
              for f in g.gm.graph.nodes if f.op == "placeholder"])
    fx_nodes = {f.name: f for f in g.gm.graph.nodes}
    gen = torch.Generator().manual_seed(1)
    failures: dict[tuple, str] = {}
    seen: set[str] = set()
    for nd in g.nodes:
        fnode = fx_nodes[nd.name]
        if ops.rule(nd.kind) is None or fnode.op not in ("call_function", "call_method"):
            continue
        seen.add(nd.kind)
        in_kinds = [g[i].kind for i in nd.inputs]
        for n in (2, 4):
            ctx = Ctx(nd, [g[i].out.shape if g[i].out is not None else None for i in nd.inputs], in_kinds,
                      nd.out.shape if nd.out is not None else None, n, itemsize=8, batch_axis=batch_axis)
            for st in candidates(ctx):
                try:
                    why = _check(fnode, nd, in_kinds, st, n, rec.values, gen)
                except Exception as e:  # noqa: BLE001 - a strategy the local op cannot even run is a failure
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if why is not None:
                    failures[(case, f"{nd.name}<{nd.target}>", n, st.name)] = why
    return failures, seen


# Rules the ground truth still refutes, each a real bug outside the rules (or an accepted
# approximation), keyed (case, node<target>, strategy). An entry that starts passing fails
# the test too, so this list stays true.
KNOWN_BUGS = {
    ("losses", "cross_entropy_1<cross_entropy>", "batch"):
        "mean cross-entropy split over the batch averages per-rank means (scale 1/n): exact only "
        "when every rank has as many non-ignored targets (the runtime weights dp, microbatches, "
        "pipelines and cp by their counted tokens: compile/tokens.py; a tp_mode grid's rows not)",
    ("pointwise", "norm<norm>", "dim1"):
        "trace._attrs reads a reduction's dims from argument 1, which is p for torch.norm(x, p, dim)",
    ("pointwise", "truediv_1<truediv>", "partial"):
        "1.0 / x: the rule sees one tensor input and cannot tell it is the divisor (trace records "
        "no operand positions), so it offers P -> P",
    ("recurrent_export", "getitem_3<getitem>", "dim0"):
        "getitem on a tuple whose tensors differ in shape (aten.gru's output [seq, batch, h] and final "
        "state [layers, batch, h]): a node's shape is its first tensor's, so the item rule offers dim 0, "
        "which the final state cannot hold; no producer of such a tuple offers it (the recurrent rule "
        "splits dim 1 only)",
    ("pointwise", "unflatten<unflatten>", "dim1"):
        "the compiler localises only view/reshape/expand/_unsafe_view shapes: unflatten's global "
        "sizes do not fit the local chunk of the unflattened dim",
}
CASES = ("attention", "pointwise", "matmuls", "convs", "convs_eval_dp", "losses",
         "attention_export", "matmuls_export", "recurrent_export", "einsums", "einsums_export", "diffusion",
         "diffusion_export")
_RESULTS: dict[str, tuple[dict, set]] = {}


def _results(case: str) -> tuple[dict, set]:
    if case not in _RESULTS:
        gen = torch.Generator().manual_seed(0)
        model, inputs, batch_axis = _case_inputs(gen)[case.removesuffix("_export")]
        frontend = "export" if case.endswith("_export") else "fx"
        _RESULTS[case] = _validate(case, model, inputs, batch_axis, frontend)
    return _RESULTS[case]


@pytest.mark.parametrize("case", CASES)
def test_rules_reproduce_the_op(case):
    """Every candidate of every rule, run per simulated rank and reassembled,
    equals the unsharded op (value and gradients), but for :data:`KNOWN_BUGS`."""
    failures, _ = _results(case)
    got = {(c, node, name) for c, node, _, name in failures}
    known = {k for k in KNOWN_BUGS if k[0] == case}
    new = [f"{node} n={n} {name}: {why}" for (c, node, n, name), why in sorted(failures.items())
           if (c, node, name) not in known]
    fixed = sorted(known - got)
    assert not new, "sharding rules that do not reproduce the op:\n" + "\n".join(new)
    assert not fixed, f"known bugs that pass now (remove them from KNOWN_BUGS): {fixed}"


def test_every_rule_is_validated():
    seen = set().union(*(_results(c)[1] for c in CASES))
    assert set(ops.rules()) <= seen, f"rules without a ground-truth case: {sorted(set(ops.rules()) - seen)}"


def test_the_check_catches_a_wrong_rule():
    """The harness is not vacuous: a strategy that claims S(0) -> S(0) for a
    softmax over dim 0, or a wrong scale, is refuted."""
    g = autopar.trace(nn.Softmax(dim=0), (torch.randn(4, 6, dtype=torch.float64),), frontend="fx")
    rec = _Recorder(g.gm)
    x = torch.randn(4, 6, dtype=torch.float64)
    rec.run(x)
    nd = next(n for n in g.nodes if n.kind == "softmax")
    fnode = next(f for f in g.gm.graph.nodes if f.name == nd.name)
    gen = torch.Generator().manual_seed(0)
    assert _check(fnode, nd, ["input"], Strategy("dim0", (S(0),), S(0), True), 2, rec.values, gen)
    assert _check(fnode, nd, ["input"], Strategy("dim1", (S(1),), S(1), True), 2, rec.values, gen) is None
    assert _check(fnode, nd, ["input"], Strategy("dim1", (S(1),), S(1), True, scale=0.5), 2, rec.values, gen)
