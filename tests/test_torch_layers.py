"""Models on PyTorch's own transformer layers, written as PyTorch's examples
and documentation write them: ``nn.TransformerEncoder`` called with a mask
and no ``is_causal`` hint, ``nn.MultiheadAttention`` inside, and the
``[seq, batch]`` layout those layers take by default (``batch_first=False``).

Before: torch.export stopped on the layers' causal-mask detection (a branch on
the mask's values), symbolic fx kept the layers as opaque leaves (run
replicated, hiding the batch from the analysis), and ``[seq, batch]`` inputs
were split along the sequence by data parallelism, silently training another
model. Now ``batch_dim=1`` runs them as they are written, and a mislaid batch
is found where attention reads it (the program then moves the samples, correct
if not data parallel, with a warning saying what to pass).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import StrategyError, TraceError
from benchmarks import matrix
from benchmarks.real_models import CASES, HEADS, HIDDEN, VOCAB, _tokens
from distributed import eager_steps, run_distributed


def test_a_transformer_encoder_with_a_mask_and_no_hint_traces():
    c = CASES["torch-word-lm"]()
    graph = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target, batch_dim=1)
    assert graph.frontend == "export"
    # the mask the model was given is applied (the hint only picks a kernel)
    assert torch.nn.modules.transformer._detect_is_causal_mask.__name__ == "_detect_is_causal_mask"
    assert graph.batch_size == c.inputs[0].shape[1]
    assert [graph[i].out.shape for i in graph.inputs] == [tuple(c.inputs[0].t().shape), tuple(c.target.t().shape)]
    assert graph.batch_dim == 1


class _MHABlock(nn.Module):
    """A residual block around ``nn.MultiheadAttention`` (batch first), fx-traceable code around it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.attn(x, x, x, need_weights=False)[0])


def test_torch_nn_layers_without_a_functional_form_are_traced_through():
    torch.manual_seed(0)
    x, _ = _tokens()
    graph = autopar.trace(_MHABlock(), (x,))
    assert not [n for n in graph.nodes if n.kind == "module"], "nn.MultiheadAttention kept as one opaque node"
    assert "attn.in_proj_weight" in graph.params and "attn.out_proj.weight" in graph.params


def test_batch_dim_is_checked():
    c = CASES["torch-word-lm"]()
    for bad in (-1, "1", 1.0, True, (1, -1), (1, 1, 1)):
        with pytest.raises(TraceError, match="batch_dim"):
            autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target, batch_dim=bad)


class _SeqFirstEncoder(nn.Module):
    """A bidirectional encoder on ``[seq, batch]`` token ids (PyTorch's default layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


class _LSTMLM(nn.Module):
    """examples/word_language_model's RNNModel (a 2-layer LSTM on ``[seq, batch]`` ids), no carried state."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = nn.LSTM(HIDDEN, HIDDEN, 2)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        output, _ = self.rnn(self.encoder(x))
        return self.decoder(output)


def _flat_ce(out, y):
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _seq_first_case(kind: str = "encoder"):
    torch.manual_seed(0)
    x, y = _tokens()
    return (_SeqFirstEncoder() if kind == "encoder" else _LSTMLM()), x.t().contiguous(), y.t().contiguous()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _seq_first_steps(model, x, y, pm=None, steps=3):
    if pm is not None:
        return [pm.train_step((x,), y) for _ in range(steps)]
    return eager_steps(model, (x,), y, _flat_ce, _sgd, steps)


def _seq_first_worker(rank: int, world: int, runs: list) -> dict:
    out = {}
    for kind, strategy, batch_dim in runs:
        model, x, y = _seq_first_case(kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = autopar.parallelize(model, (x,), loss_fn=_flat_ce, example_target=y, strategy=strategy,
                                     batch_dim=batch_dim, optimizer=_sgd)
        losses = _seq_first_steps(model, x, y, pm)
        shape_error = ""
        try:
            pm.train_step((x[:8],), y[:8])
        except StrategyError as e:
            shape_error = str(e)
        state = pm.full_state_dict()     # a collective: every rank gathers
        out[(kind, strategy, batch_dim)] = {"losses": losses, "warnings": [str(w.message) for w in caught],
                                      "state": state if rank == 0 else None,
                                      "local": sum(p.numel() for p in pm.parameters()), "shape_error": shape_error}
    return out


# the LSTM is one op without a sharding rule (replicated under tp), the batch at its dim 1
RUNS = [("encoder", "dp=2", 1), ("encoder", "tp=2", 1), ("encoder", "dp=2", 0), ("lstm", "dp=2", 1)]


@pytest.fixture(scope="module")
def seq_first():
    return run_distributed(_seq_first_worker, 2, RUNS, timeout=300)


@pytest.mark.parametrize("kind,strategy,batch_dim", RUNS)
def test_seq_first_inputs_train_as_in_one_process(seq_first, kind, strategy, batch_dim):
    model, x, y = _seq_first_case(kind)
    ref = _seq_first_steps(model, x, y)
    got = [r[(kind, strategy, batch_dim)] for r in seq_first]
    for r in got:
        assert r["losses"] == pytest.approx(ref, rel=1e-5)
    state = got[0]["state"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-4)
    if strategy == "tp=2":   # the attention's in-projection and the MLP split over tp, not opaque
        assert got[0]["local"] < sum(p.numel() for p in model.parameters()) * 0.75
    warned = any("batch_dim=1" in w for w in got[0]["warnings"])
    # a mislaid batch: attention reads it as the sequence; the program moves the samples and says so
    assert warned == (batch_dim == 0)
    if batch_dim == 1:     # a batch of another sequence length is named in the caller's layout
        assert "shape (8, 8)" in got[0]["shape_error"] and "(16, batch)" in got[0]["shape_error"]


def test_the_word_language_model_example_trains_as_in_one_process():
    """PyTorch's examples/word_language_model TransformerModel, ``[seq, batch]``
    token ids and its NLL loss, under dp x tp (4 processes)."""
    strategy = "dp=2,tp=2"
    per_rank = run_distributed(matrix.worker, 4, [("torch-word-lm", strategy)], timeout=300)
    ref = matrix.reference("torch-word-lm")
    verdict = matrix.check("dp x tp", strategy, ref, [r[("torch-word-lm", strategy)] for r in per_rank])
    assert verdict == "ok", verdict


def test_a_keyword_batch_and_the_plan_api_take_batch_dim():
    c = CASES["torch-word-lm"]()
    graph = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target, batch_dim=1)
    p = autopar.plan(graph, cluster="cpu", devices=2, global_batch=graph.batch_size, strategy="dp=2")
    assert p.strategy.startswith("dp=2")
    est = autopar.evaluate(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target, batch_dim=1, cluster="cpu",
                           devices=2, strategy="dp=2", global_batch=8)
    assert est.fits



#: src and tgt hold the batch at dim 1, the padding mask at dim 0, the target at dim 1
TRANSLATOR_DIMS = (1, 1, 0, 1)


def _translator_case():
    """The translation tutorial's ``nn.Transformer`` of the real-model cases."""
    c = CASES["torch-translator"]()
    assert c.batch_dim == TRANSLATOR_DIMS
    return c.model, c.inputs, c.target


def _translator_worker(rank: int, world: int, strategies: list[str]) -> dict:
    out = {}
    for strategy in strategies:
        model, inputs, y = _translator_case()
        pm = autopar.parallelize(model, inputs, loss_fn=_flat_ce, example_target=y, strategy=strategy,
                                 batch_dim=TRANSLATOR_DIMS, optimizer=_sgd)
        out[strategy] = [pm.train_step(inputs, y) for _ in range(3)]
    return out


def test_an_encoder_decoder_with_a_batch_first_padding_mask_trains_as_in_one_process():
    """A batch dim per input: the padding mask is ``[batch, seq]`` where the
    ids are ``[seq, batch]`` (as ``nn.Transformer`` takes them)."""
    model, inputs, y = _translator_case()
    graph = autopar.trace(model, inputs, loss_fn=_flat_ce, target=y, batch_dim=TRANSLATOR_DIMS)
    assert graph.batch_size == 8 and graph.batch_dim == TRANSLATOR_DIMS
    ref = eager_steps(model, inputs, y, _flat_ce, _sgd)
    got = run_distributed(_translator_worker, 2, ["dp=2", "pp=2,microbatches=2"], timeout=300)
    for per_rank in got:
        for strategy, losses in per_rank.items():
            assert losses == pytest.approx(ref, rel=1e-5), strategy
    with pytest.raises(TraceError, match="one per input"):
        autopar.trace(model, inputs, loss_fn=_flat_ce, target=y, batch_dim=(1, 1))


def test_a_recurrent_layer_counts_its_weights_products():
    """``nn.LSTM`` is one op over the sequence (aten.lstm): the planner counts
    every token through each of its weight matrices (it counted nothing, so an
    LSTM model looked like its embedding and decoder alone)."""
    model, x, y = _seq_first_case("lstm")
    graph = autopar.trace(model, (x,), loss_fn=_flat_ce, target=y, batch_dim=1)
    (rnn,) = [n for n in graph.nodes if n.kind == "recurrent"]
    matrices = sum(p.numel() for n, p in model.rnn.named_parameters() if n.startswith("weight"))
    assert rnn.flops == 2.0 * x.numel() * matrices


def test_planning_a_mislaid_batch_warns():
    model, x, y = _seq_first_case()
    with pytest.warns(UserWarning, match="batch_dim=1"):
        autopar.plan(model, (x,), loss_fn=_flat_ce, target=y, cluster="cpu", devices=2, global_batch=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        autopar.plan(model, (x,), loss_fn=_flat_ce, target=y, cluster="cpu", devices=2, global_batch=8, batch_dim=1)


def test_the_fx_leaves_are_the_modules_written_out():
    """``_FUNCTIONAL_LEAVES`` (what fx keeps as leaves) and ``_functional_form``
    (what the tracer writes out) list the same modules: a leaf without a form
    would be an opaque node again."""
    import torch.fx as fx

    from autopar.trace import _FUNCTIONAL_LEAVES, _functional_form, _has_functional_form
    for cls in _FUNCTIONAL_LEAVES:
        args = {nn.Linear: (4, 4), nn.Embedding: (4, 4), nn.LayerNorm: (4,), nn.Conv1d: (4, 4, 1),
                nn.Conv2d: (4, 4, 1), nn.Conv3d: (4, 4, 1), nn.BatchNorm1d: (4,), nn.BatchNorm2d: (4,),
                nn.BatchNorm3d: (4,), nn.MaxPool2d: (2,), nn.AvgPool2d: (2,), nn.AdaptiveAvgPool2d: (1,),
                nn.Softmax: (-1,)}.get(cls, (4,) if cls.__name__ == "RMSNorm" else ())
        mod = cls(*args)
        g = fx.Graph()
        x = g.placeholder("x")
        assert _has_functional_form(mod) and _functional_form(g, mod, x, lambda n: g.placeholder(n)) is not None, cls
    assert not _has_functional_form(nn.MultiheadAttention(4, 2)) and not _has_functional_form(nn.LSTM(4, 4))
