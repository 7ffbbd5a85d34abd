"""Shallow export (autopar/shallow_export.py): a deep meta-device model is
exported with 3 layers and the rest written in; the graph must be the one the
full export gives (names, ops, shapes, layers, predictions)."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.shallow_export as se
from autopar import zoo
from benchmarks.real_models import NanoGPT, lm_loss

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _summary(g):
    return [(n.name, n.target, n.kind, n.out, tuple(n.inputs), n.module, n.group, n.param) for n in g.nodes]


def _both(monkeypatch, build):
    """(full export, shallow export) of the model ``build()`` returns on the meta device."""
    out = []
    for min_layers in (10 ** 9, se.MIN_LAYERS):
        monkeypatch.setattr(se, "MIN_LAYERS", min_layers)
        model, args, loss_fn, target = build()
        out.append(autopar.trace(model, args, loss_fn=loss_fn, target=target, frontend="export"))
    return out


def _zoo(spec):
    def build():
        z = zoo.build_for_planning(spec)
        return z.model, z.example_inputs, z.loss_fn, z.example_target
    return build


def _nanogpt():
    with torch.device("meta"):
        model = NanoGPT(vocab=64, block_size=16, n_layer=7, n_head=4, n_embd=32, tied=True)
    x = torch.randint(0, 64, (2, 16))
    return model, (x,), lm_loss, x


@pytest.mark.parametrize("build", [
    _zoo("hf-llama:num_hidden_layers=7,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
         "intermediate_size=64,vocab_size=64,seq=16"),
    _zoo("hf-gpt2:n_layer=7,n_embd=32,n_head=4,vocab_size=64,seq=16"),
    _nanogpt,
], ids=["hf-llama", "hf-gpt2", "nanogpt-tied"])
def test_shallow_export_gives_the_full_graph(monkeypatch, build):
    full, shallow = _both(monkeypatch, build)
    assert shallow.frontend == full.frontend == "export"
    assert _summary(shallow) == _summary(full)
    assert shallow.fingerprint == full.fingerprint
    assert [(g.name, len(g.instances)) for g in shallow.groups] == [(g.name, len(g.instances)) for g in full.groups]
    assert len(full.groups[0].instances) == 7
    for strategy in ("dp=2,tp=2,pp=2,microbatches=2", "tp=4,sequence_parallel=true,recompute=selective"):
        a = autopar.evaluate(full, strategy=strategy, cluster="dgx-h100", devices=8, global_batch=8)
        b = autopar.evaluate(shallow, strategy=strategy, cluster="dgx-h100", devices=8, global_batch=8)
        assert a.to_dict() == b.to_dict()


def test_shallow_export_is_used_and_only_for_meta_models(monkeypatch):
    calls = []
    real = se._replicate

    def spy(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(se, "_replicate", spy)
    model, args, loss_fn, target = _nanogpt()
    autopar.trace(model, args, loss_fn=loss_fn, target=target)
    assert calls == ["model.transformer.h"]
    calls.clear()
    torch.manual_seed(0)
    real_model = NanoGPT(vocab=64, block_size=16, n_layer=7, n_head=4, n_embd=32)
    autopar.trace(real_model, args, loss_fn=loss_fn, target=target)
    assert calls == []      # a model that runs is exported whole: its graph is executed


class _Skip(nn.Module):
    """Layer i also reads layer i-2's output: not a chain, exported whole."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(7))

    def forward(self, x):
        outs = [x, x]
        for layer in self.layers:
            outs.append(torch.relu(layer(outs[-1])) + outs[-2])
        return outs[-1]


def test_shallow_export_refuses_a_graph_that_is_not_a_chain(monkeypatch):
    def build():
        with torch.device("meta"):
            m = _Skip()
        return m, (torch.randn(4, 8),), None, None
    results = []
    real = se._replicate
    monkeypatch.setattr(se, "_replicate", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    full, shallow = _both(monkeypatch, build)
    assert results == [None]
    assert _summary(shallow) == _summary(full)


class _Indexed(nn.Module):
    """The forward indexes its layers by a count of its own: a cut list fails, the full export runs."""

    def __init__(self):
        super().__init__()
        self.n = 7
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(self.n))

    def forward(self, x):
        for i in range(self.n):
            x = torch.relu(self.layers[i](x))
        return x


def test_shallow_export_falls_back_when_the_cut_model_fails(monkeypatch):
    def build():
        with torch.device("meta"):
            m = _Indexed()
        return m, (torch.randn(4, 8),), None, None
    full, shallow = _both(monkeypatch, build)
    assert _summary(shallow) == _summary(full)
    assert len(full.groups[0].instances) == 7
