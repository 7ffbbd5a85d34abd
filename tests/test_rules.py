"""Sharding rules (autopar.strategies.rules): one small table per op family."""
from __future__ import annotations

import warnings

import pytest

from autopar.graph import Node, TensorInfo
from autopar.strategies import R, P, S, candidates, has_rule, is_shard, shard_dim
from autopar.spec.placement import valid
from autopar.strategies.rules import Ctx, view_map


def node(kind: str, target: str, n_in: int, out=None, name: str | None = None, **attrs) -> Node:
    return Node(name=name or target, op="call_function", target=target, kind=kind,
                inputs=[f"in{i}" for i in range(n_in)],
                out=TensorInfo(tuple(out), "float32") if out is not None else None, attrs=dict(attrs))


def ctx(nd: Node, ins, n: int, in_kinds=None) -> Ctx:
    kinds = in_kinds or ["input"] * len(ins)
    return Ctx(nd, [tuple(s) if s is not None else None for s in ins], kinds,
               nd.out.shape if nd.out is not None else None, n)


def by_name(strategies):
    return {s.name: s for s in strategies}


# ------------------------------------------------------------------ placements
def test_placement_strings():
    assert S(2) == "S(2)" and is_shard("S(2)") and shard_dim("S(11)") == 11
    assert not is_shard(R) and not is_shard(P)
    assert valid("R") and valid("P") and valid("S(0)")
    assert not valid("S(x)") and not valid("S(-1)") and not valid("Shard(0)")


# ------------------------------------------------------------------ linear
def test_linear_colwise_rowwise_when_divisible():
    nd = node("linear", "linear", 2, out=(2, 8, 16))
    c = by_name(candidates(ctx(nd, [(2, 8, 32), (16, 32)], 2, ["input", "param"])))
    assert c["replicate"].ins == (R, R) and c["replicate"].out == R and not c["replicate"].split
    assert c["colwise"].ins == (R, S(0)) and c["colwise"].out == S(2) and c["colwise"].split
    assert c["rowwise"].ins == (S(2), S(1)) and c["rowwise"].out == P and c["rowwise"].split
    # batch and sequence dims of x
    assert c["batch0"].ins == (S(0), R) and c["batch0"].out == S(0)
    assert c["batch1"].ins == (S(1), R) and c["batch1"].out == S(1)
    assert list(by_name(candidates(ctx(nd, [(2, 8, 32), (16, 32)], 2))))[0] == "replicate"


def test_linear_not_divisible():
    nd = node("linear", "linear", 2, out=(3, 5, 6))
    names = set(by_name(candidates(ctx(nd, [(3, 5, 9), (6, 9)], 4, ["input", "param"]))))
    assert names == {"replicate"}
    # out features 6 divide by 2 and 3; in features 9 by 3 only
    names = set(by_name(candidates(ctx(nd, [(3, 5, 9), (6, 9)], 2, ["input", "param"]))))
    assert "colwise" in names and "rowwise" not in names
    names = set(by_name(candidates(ctx(nd, [(3, 5, 9), (6, 9)], 3, ["input", "param"]))))
    assert {"colwise", "rowwise", "batch0"} <= names and "batch1" not in names


def test_linear_axis_larger_than_dim():
    nd = node("linear", "linear", 2, out=(2, 2))
    names = set(by_name(candidates(ctx(nd, [(2, 2), (2, 2)], 4, ["input", "param"]))))
    assert names == {"replicate"}


def test_addmm_rows_only():
    # torch.export's addmm(bias, mat1[N, K], mat2[K, M]): the token rows split (the
    # colwise / rowwise rules are written for F.linear's W[out, in] layout)
    nd = node("linear", "addmm", 3, out=(8, 16))
    c = by_name(candidates(ctx(nd, [(16,), (8, 32), (32, 16)], 2, ["param", "input", "param"])))
    assert set(c) == {"replicate", "batch0"}
    assert c["batch0"].ins == (R, S(0), R) and c["batch0"].out == S(0) and c["batch0"].split
    assert set(by_name(candidates(ctx(nd, [(16,), (3, 32), (32, 16)], 2)))) == {"replicate"}


# ------------------------------------------------------------------ views
def test_view_map_split_heads():
    # (B, T, C) -> (B, T, H, D): the hidden shard becomes a head shard
    assert view_map((2, 16, 64), (2, 16, 4, 16), 2) == {0: 0, 1: 1, 2: 2}
    assert view_map((2, 16, 64), (2, 16, 4, 16), 4)[2] == 2
    # 8 ranks cannot split 4 heads
    assert 2 not in view_map((2, 16, 64), (2, 16, 4, 16), 8)
    # and back: (B, T, H, D) -> (B, T, C)
    assert view_map((2, 16, 4, 16), (2, 16, 64), 2) == {0: 0, 1: 1, 2: 2}


def test_view_map_flatten_tokens():
    # (B, T, V) -> (B*T, V): a batch shard stays contiguous, a sequence shard does not
    assert view_map((2, 16, 128), (32, 128), 2) == {0: 0, 2: 1}
    assert view_map((2, 16, 128), (32, 128), 4) == {2: 1}
    # batch 1: the sequence is the outermost non-unit dim of the group
    assert view_map((1, 16, 128), (16, 128), 2) == {1: 0, 2: 1}
    # shapes that do not line up
    assert view_map((2, 3), (5,), 1) == {}


def test_view_rule_uses_view_map():
    nd = node("view", "view", 1, out=(2, 16, 4, 16))
    c = by_name(candidates(ctx(nd, [(2, 16, 64)], 2)))
    assert c["dim2"].ins == (S(2),) and c["dim2"].out == S(2) and not c["dim2"].split
    assert c["partial"].ins == (P,) and c["partial"].out == P
    nd = node("view", "view", 1, out=(32, 128))
    c = by_name(candidates(ctx(nd, [(2, 16, 128)], 4)))
    assert "dim0" not in c and c["dim2"].out == S(1)


def test_transpose_rule():
    nd = node("transpose", "transpose", 1, out=(2, 4, 16, 16), perm=[0, 2, 1, 3])
    c = by_name(candidates(ctx(nd, [(2, 16, 4, 16)], 2)))
    assert c["dim2"].ins == (S(2),) and c["dim2"].out == S(1)
    assert c["dim1"].out == S(2)


# ------------------------------------------------------------------ elementwise
def test_elementwise_broadcast_requires_replicate():
    # x[B, T, C] + bias[C]
    nd = node("elementwise", "add", 2, out=(2, 8, 16))
    c = by_name(candidates(ctx(nd, [(2, 8, 16), (16,)], 2, ["input", "param"])))
    assert c["dim0"].ins == (S(0), R)          # bias broadcast along the batch: every rank needs it all
    assert c["dim1"].ins == (S(1), R)
    assert c["dim2"].ins == (S(2), S(0))       # along C the bias is split with x
    assert c["partial"].ins == (P, P) and c["partial"].out == P


def test_elementwise_size_one_dim_broadcasts():
    # x[B, T, H, D] * cos[T, 1, D]
    nd = node("elementwise", "mul", 2, out=(2, 8, 4, 16))
    c = by_name(candidates(ctx(nd, [(2, 8, 4, 16), (8, 1, 16)], 2)))
    assert c["dim2"].ins == (S(2), R)
    assert c["dim1"].ins == (S(1), S(0))
    assert c["dim0"].ins == (S(0), R)
    # mul is linear in the first operand only
    assert c["partial"].ins == (P, R)


def test_elementwise_nonlinear_has_no_partial():
    nd = node("elementwise", "gelu", 1, out=(4, 8))
    c = by_name(candidates(ctx(nd, [(4, 8)], 2)))
    assert "partial" not in c
    assert c["dim0"].ins == (S(0),) and c["dim1"].ins == (S(1),)


def test_elementwise_partial_only_for_sums_of_tensors():
    # x + 1.0 on summands would add 1.0 once per rank; neg is linear in its one operand
    assert "partial" not in by_name(candidates(ctx(node("elementwise", "add", 1, out=(4, 8)), [(4, 8)], 2)))
    assert "partial" not in by_name(candidates(ctx(node("elementwise", "rsub", 1, out=(4, 8)), [(4, 8)], 2)))
    assert by_name(candidates(ctx(node("elementwise", "neg", 1, out=(4, 8)), [(4, 8)], 2)))["partial"].ins == (P,)
    assert by_name(candidates(ctx(node("elementwise", "sub", 2, out=(4, 8)), [(4, 8), (4, 8)], 2)))[
        "partial"].ins == (P, P)


def test_tril_keeps_its_matrix_dims_whole():
    # the diagonal counts from the global row and column: only leading (batch) dims split
    names = set(by_name(candidates(ctx(node("elementwise", "tril", 1, out=(4, 8, 8)), [(4, 8, 8)], 2))))
    assert names == {"replicate", "dim0"}


def test_functional_bias_goes_with_the_output_channels():
    nd = node("linear", "linear", 3, out=(2, 8, 16))
    c = by_name(candidates(ctx(nd, [(2, 8, 32), (16, 32), (16,)], 2, ["input", "param", "param"])))
    assert c["colwise"].ins == (R, S(0), S(0)) and c["batch0"].ins == (S(0), R, R)
    assert "rowwise" not in c                  # each partial sum would add the bias
    nd = node("conv", "conv2d", 3, out=(4, 8, 6, 6), groups=1)
    c = by_name(candidates(ctx(nd, [(4, 4, 6, 6), (8, 4, 3, 3), (8,)], 2, ["input", "param", "param"])))
    assert c["out_channels"].ins == (R, S(0), S(0)) and c["batch"].ins == (S(0), R, R)
    assert "in_channels" not in c


def test_baddbmm_places_the_added_term_like_the_output():
    nd = node("matmul", "baddbmm", 3, out=(4, 8, 6))
    c = by_name(candidates(ctx(nd, [(4, 1, 6), (4, 8, 10), (4, 10, 6)], 2)))
    assert c["batch0"].ins == (S(0), S(0), S(0))
    assert c["rows"].ins == (R, S(1), R)       # c broadcast along the rows
    assert c["cols"].ins == (S(2), R, S(2))
    assert "contract" not in c                 # each partial sum would add c


# ------------------------------------------------------------------ others
def test_sdpa_batch_and_heads():
    nd = node("sdpa", "scaled_dot_product_attention", 3, out=(2, 4, 16, 8))
    c = by_name(candidates(ctx(nd, [(2, 4, 16, 8)] * 3, 4)))
    assert set(c) == {"replicate", "heads"}
    assert c["heads"].ins == (S(1),) * 3 and c["heads"].out == S(1)
    c = by_name(candidates(ctx(nd, [(2, 4, 16, 8)] * 3, 2)))
    assert set(c) == {"replicate", "batch", "heads"}


def test_cross_entropy_vocab_parallel():
    nd = node("cross_entropy", "cross_entropy", 2, out=(), reduction="mean")
    c = by_name(candidates(ctx(nd, [(32, 128), (32,)], 2)))
    assert c["vocab"].ins == (S(1), R) and c["vocab"].out == R and c["vocab"].kernel == "vocab_cross_entropy"
    assert len(c["vocab"].comm) == 3
    assert c["batch"].ins == (S(0), S(0)) and c["batch"].out == P and c["batch"].scale == 0.5
    nd = node("cross_entropy", "cross_entropy", 2, out=(), reduction="unsupported")
    assert "batch" not in by_name(candidates(ctx(nd, [(32, 128), (32,)], 2)))


def test_norm_keeps_normalised_dims_whole():
    nd = node("layernorm", "layer_norm", 3, out=(2, 8, 16), norm_dims=1)
    c = by_name(candidates(ctx(nd, [(2, 8, 16), (16,), (16,)], 2, ["input", "param", "param"])))
    assert set(c) == {"replicate", "batch0", "batch1"}
    assert c["batch1"].ins == (S(1), R, R)


def test_reduction_mean_over_sharded_dim_is_partial():
    nd = node("reduction", "mean", 1, out=(4,), reduce_dims=[1], keepdim=False)
    c = by_name(candidates(ctx(nd, [(4, 8)], 2)))
    assert c["reduce1"].out == P and c["reduce1"].scale == 0.5
    assert c["dim0"].out == S(0)
    nd = node("reduction", "amax", 1, out=(4,), reduce_dims=[1], keepdim=False)
    assert "reduce1" not in by_name(candidates(ctx(nd, [(4, 8)], 2)))


# ------------------------------------------------------------------ unknown ops
def test_unknown_op_replicates_with_warning():
    nd = node("other", "my_custom_op_xyz", 2, out=(4, 8), name="custom_0")
    with pytest.warns(UserWarning, match=r"no sharding rule for op 'my_custom_op_xyz'.*custom_0"):
        out = candidates(ctx(nd, [(4, 8), (4, 8)], 2))
    assert [(s.name, s.ins, s.out, s.split) for s in out] == [("replicate", (R, R), R, False)]
    assert not has_rule("other") and has_rule("linear")


def test_unknown_op_warns_once_and_not_on_size_one_axis():
    nd = node("other", "another_custom_op_abc", 1, out=(4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert candidates(ctx(nd, [(4,)], 1))[0].name == "replicate"      # n=1: nothing to warn about
    with pytest.warns(UserWarning, match="another_custom_op_abc"):
        candidates(ctx(nd, [(4,)], 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        candidates(ctx(nd, [(4,)], 2))                                     # second time: silent
