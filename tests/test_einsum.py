"""``torch.einsum`` as research code writes it (lucidrains' x-transformers
style: spelled-out labels, the residual adds in the parent module's loop).

Before: einsum had no kind ("other"): no FLOPs, no activations kept for its
backward, and no sharding rule, so tensor parallelism replicated attention
(gathering q, k and v, and the softmax over ``[b, h, T, T]`` run whole on every
rank). The batch walk also decided a layer as one unit at its first node, so
with the residual add between a layer's attention and its MLP outside the
layer, the MLP read the add undecided, took it for a parameter and dropped the
batch: its activations were not scaled with the batch (a 1.3B model's plan
under-counted 25 GB). Now the labels are read, the FLOPs counted, a rule
splits along any letter (DTensor's einsum strategies), and such layers are
walked node by node.
"""
from __future__ import annotations

import sys

import pytest
import torch

import autopar
from autopar import sharding
from autopar.trace import einsum_flops, einsum_labels
from benchmarks import matrix
from benchmarks import real_models as rm
from distributed import run_distributed


@pytest.mark.parametrize("equation, shapes, want", [
    ("b h i d, b h j d -> b h i j", [(2, 4, 8, 16)] * 2, (("bhid", "bhjd"), "bhij")),
    ("bhid,bhjd", [(2, 4, 8, 16)] * 2, (("bhid", "bhjd"), "ij")),               # implicit: once-used, sorted
    ("...id,...jd->...ij", [(2, 4, 8, 16), (2, 1, 8, 16)], (("ABid", "ABjd"), "ABij")),
    ("...id,jd", [(3, 8, 16), (5, 16)], (("Aid", "jd"), "Aij")),                  # implicit: the ellipsis first
    ("ii->i", [(4, 4)], (("ii",), "i")),
    ("bd,de,ef->bf", [(2, 3), (3, 4), (4, 5)], (("bd", "de", "ef"), "bf")),
    ("ij,jk->ik", [(2, 3)], None),                  # an operand missing
    ("ij->ik", [(2, 3)], None),                     # an output letter no operand has
    ("ijk->ij", [(2, 3)], None),                    # more labels than dims
    (None, [(2, 3)], None),                         # sublist form: einsum(x, [0, 1], ...)
])
def test_einsum_labels(equation, shapes, want):
    assert einsum_labels(equation, shapes) == want
    if want is not None:     # what torch computes has the output these labels say
        got = torch.einsum(equation, *[torch.randn(s) for s in shapes])
        sizes = {c: d for t, s in zip(want[0], shapes) for c, d in zip(t, s) if d != 1}
        assert tuple(got.shape) == tuple(sizes.get(c, 1) for c in want[1])


def test_einsum_flops_contract_left_to_right():
    assert einsum_flops(("bhid", "bhjd"), "bhij", [(2, 4, 8, 16)] * 2) == 2 * 2 * 4 * 8 * 8 * 16
    # (b d) x (d e) first, keeping b e; then x (e f)
    assert einsum_flops(("bd", "de", "ef"), "bf", [(2, 3), (3, 4), (4, 5)]) == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5
    assert einsum_flops(("bhid",), "bdh", [(2, 4, 8, 16)]) == 2 * 4 * 8 * 16


def test_einsum_attention_is_costed_and_split_by_heads():
    c = rm.CASES["einsum-lm"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    einsums = [n for n in g.nodes if n.kind == "einsum"]
    assert len(einsums) == 2 * rm.LAYERS
    b, t, h = rm.BATCH, rm.SEQ, rm.HEADS
    assert all(n.flops == 2 * b * h * t * t * (rm.HIDDEN // h) for n in einsums)
    p = autopar.plan(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target, strategy="tp=2", cluster="dgx-h100",
                     devices=2, global_batch=b)
    chosen = {k: v["strategy"] for k, v in p.to_dict()["ops"].items() if k.endswith((":einsum", ":einsum#1"))}
    assert len(chosen) == 2 * rm.LAYERS and all(s == ["letter_b", "letter_h"] for s in chosen.values()), chosen


def _saved_per_layer(make, x) -> float:
    sys.path.insert(0, "tests")
    from test_cost import _saved_storage_bytes
    return _saved_storage_bytes(make(3), x) - _saved_storage_bytes(make(2), x)


def test_parent_loop_residuals_keep_the_batch(monkeypatch):
    """A model on the meta device (planned, never run) is exported at a fixed batch and its batch
    dims are inferred by the walk; its activations per layer at 4x the traced batch are what eager
    PyTorch keeps (the storages autograd saves, measured on the CPU at that batch): the softmax
    probabilities and every MLP tensor included."""
    monkeypatch.setattr(rm, "SEQ", 64)
    monkeypatch.setattr(rm, "HIDDEN", 32)

    def make(n: int, device: str = "cpu") -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            return rm.EinsumLM(layers=n)

    x = torch.randint(0, rm.VOCAB, (8, rm.SEQ))
    meta_x = torch.zeros(2, rm.SEQ, dtype=torch.long, device="meta")
    g = autopar.trace(make(2, "meta"), (meta_x,), loss_fn=rm.lm_loss, target=meta_x)
    assert g.traced_batch_dims is None      # inferred, not read off a symbol
    dims = sharding.batch_dims(g)
    assert all(dims[n.name] == 0 for n in g.nodes if n.group is not None and n.out is not None
               and len(n.out.shape) == 3), "a layer value lost the batch"
    predicted = [autopar.evaluate(make(n, "meta"), (meta_x,), cluster="cpu", devices=1, strategy="precision=fp32",
                                  global_batch=8, loss_fn=rm.lm_loss, target=meta_x).memory["activations"]
                 for n in (2, 3)]
    assert predicted[1] - predicted[0] == pytest.approx(_saved_per_layer(make, x), rel=0.02)


def test_the_einsum_model_trains_as_in_one_process():
    runs = [("einsum-lm", st) for st in ("tp=2", "pp=2,microbatches=2", "dp=2,tp=1,recompute=selective")]
    per_rank = run_distributed(matrix.worker, 2, runs, timeout=300)
    ref = matrix.reference("einsum-lm")
    for run in runs:
        verdict = matrix.check(run[1], run[1], ref, [r[run] for r in per_rank])
        assert verdict == "ok", (run, verdict)
