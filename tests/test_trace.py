"""autopar.trace: shapes, FLOPs, parameters, repeated-layer groups, fingerprints, errors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar import zoo
from autopar.graph import Graph

GPT = "gpt:layers=3,hidden=64,heads=4,seq=16,vocab=128,batch=2"
LLAMA = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=2"
MLP = "mlp:layers=3,inp=16,hidden=32,classes=10,batch=4"
CNN = "cnn:layers=3,channels=8,image=16,in_channels=3,classes=10,batch=2"
GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"

MATMUL_KINDS = ("linear", "matmul", "sdpa", "conv")


def _trace(spec: str, device: str = "meta", **kw) -> Graph:
    z = zoo.build(spec, device=device, **kw)
    return autopar.trace(z.model, z.example_inputs)


def _kinds(g: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in g.nodes:
        out[n.kind] = out.get(n.kind, 0) + 1
    return out


# ------------------------------------------------------------------ zoo families, CPU and meta
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("spec,expect_kinds", [
    (GPT, {"linear", "sdpa", "layernorm", "embedding", "view", "transpose"}),
    (LLAMA, {"linear", "sdpa", "rmsnorm", "embedding", "cat", "split", "expand"}),
    (MLP, {"linear", "elementwise"}),
    (CNN, {"conv", "batchnorm", "pool", "linear"}),
], ids=["gpt", "llama", "mlp", "cnn"])
def test_zoo_traces(spec, expect_kinds, device):
    z = zoo.build(spec, device=device)
    g = autopar.trace(z.model, z.example_inputs)
    assert g.frontend == "fx"
    assert expect_kinds <= set(_kinds(g)), _kinds(g)
    # every op that produces a tensor has a shape; no op of an unknown family
    for n in g.nodes:
        if n.op in ("call_function", "call_method") and n.kind not in ("shape", "split"):
            assert n.out is not None, f"{n.name} ({n.target}) has no output shape"
            assert all(isinstance(s, int) and s >= 0 for s in n.out.shape)
        assert n.kind != "other", f"{n.name} ({n.target}) has no op family"
        assert n.kind != "module", f"{n.name}: leaf module was not functionalised"
    # FLOPs for the compute-bound ops
    mm = [n for n in g.nodes if n.kind in MATMUL_KINDS]
    assert mm
    for n in mm:
        assert n.flops > 0, f"{n.name} ({n.kind}) has no FLOPs"
    assert g.forward_flops > 0
    # parameters listed with shapes, and they match the module's
    expected = {k: tuple(v.shape) for k, v in z.model.named_parameters()}
    got = {k: p.shape for k, p in g.params.items() if not p.is_buffer}
    assert got == expected
    assert g.num_params == zoo.n_params(z.model)
    # the output is the logits
    out = g[g.output].out
    assert out is not None and out.shape[0] == z.example_inputs[0].shape[0]
    assert g.batch_size == z.example_inputs[0].shape[0]


def test_gpt_shapes_and_sdpa_flops():
    g = _trace(GPT)
    B, T, C, H, V = 2, 16, 64, 4, 128
    assert g[g.output].out.shape == (B, T, V)
    sdpa = [n for n in g.nodes if n.kind == "sdpa"]
    assert len(sdpa) == 3
    for n in sdpa:
        assert n.out.shape == (B, H, T, C // H)
        assert n.attrs["is_causal"] is True
        # QK^T and PV: 2 * (2 * B*H*T*T*D), halved for causal attention
        assert n.flops == pytest.approx(4 * B * H * T * T * (C // H) / 2)
    # each q/k/v/o/fc/proj linear: 2 * tokens * in * out
    for n in g.nodes:
        if n.kind == "linear":
            w = g[n.inputs[1]].out.shape
            assert n.flops == 2 * B * T * w[0] * w[1]


def test_llama_rmsnorm_rotary_gqa():
    g = _trace(LLAMA)
    kinds = _kinds(g)
    assert kinds["rmsnorm"] == 2 * 3 + 1
    assert kinds["sdpa"] == 3
    # GQA: k and v project to kv_heads * head_dim = 2 * 16
    k_w = g.params["layers.0.attn.k.weight"]
    assert k_w.shape == (32, 64)
    # rotary buffers are listed as (non-trainable) buffers
    assert g.params["cos"].is_buffer and g.params["cos"].shape == (16, 16)
    # repeat_interleave brings k/v up to all 4 heads before attention
    for n in g.nodes:
        if n.kind == "sdpa":
            assert [g[i].out.shape for i in n.inputs[:3]] == [(2, 4, 16, 16)] * 3
    # SwiGLU: silu(w1 x) * w3 x
    assert any(n.target == "silu" for n in g.nodes)


def test_mlp_linear_flops_exact():
    B, inp, hid, cls, L = 4, 16, 32, 10, 3
    g = _trace(MLP, device="cpu")
    lin = [n for n in g.nodes if n.kind == "linear"]
    assert len(lin) == L + 1
    weights = inp * hid + (L - 1) * hid * hid + hid * cls
    assert sum(n.flops for n in lin) == 2 * B * weights
    # linear biases are separate adds (row-parallel layers reduce before the bias)
    adds = [n for n in g.nodes if n.target == "add"]
    assert len(adds) == L + 1


def test_cnn_conv_flops_and_shapes():
    g = _trace(CNN)
    convs = [n for n in g.nodes if n.kind == "conv"]
    assert [n.out.shape for n in convs] == [(2, 8, 16, 16), (2, 8, 8, 8), (2, 8, 4, 4)]
    # 2 * out_numel * (c_in * 3 * 3)
    assert [n.flops for n in convs] == [2 * 2 * 8 * 16 * 16 * 3 * 9, 2 * 2 * 8 * 8 * 8 * 8 * 9,
                                        2 * 2 * 8 * 4 * 4 * 8 * 9]
    bns = [n for n in g.nodes if n.kind == "batchnorm"]
    assert len(bns) == 3
    assert g.params["blocks.0.bn.running_mean"].is_buffer
    pools = [n for n in g.nodes if n.kind == "pool"]
    assert [n.out.shape for n in pools] == [(2, 8, 8, 8), (2, 8, 4, 4), (2, 8, 1, 1)]
    assert g[g.output].out.shape == (2, 10)


# ------------------------------------------------------------------ repeated layers
@pytest.mark.parametrize("spec,name,instances", [
    (GPT, "blocks.*", ["blocks.0", "blocks.1", "blocks.2"]),
    (LLAMA, "layers.*", ["layers.0", "layers.1", "layers.2"]),
    # the first block has another input width: only the last two are equal
    (MLP, "blocks.*", ["blocks.1", "blocks.2"]),
    (CNN, "blocks.*", ["blocks.1", "blocks.2"]),
], ids=["gpt", "llama", "mlp", "cnn"])
def test_groups(spec, name, instances):
    g = _trace(spec)
    assert len(g.groups) == 1
    grp = g.groups[0]
    assert grp.name == name
    assert grp.instances == instances
    assert grp.nodes_per_instance > 0 and grp.params_per_instance > 0
    for inst in instances:
        nodes = [n for n in g.nodes if n.group == inst]
        assert len(nodes) == grp.nodes_per_instance
        assert g.group_of(nodes[0]) is grp
    # nodes of the same position have the same kind in every instance (and the
    # same shape, but in the CNN, where pooling between blocks shrinks the image)
    per = [[(n.kind, n.target if n.param is None else None, n.out if spec != CNN else None)
            for n in g.nodes if n.group == inst] for inst in instances]
    assert all(p == per[0] for p in per)


def test_tied_weights_counted_once():
    z = zoo.build("gpt:layers=1,hidden=32,heads=2,seq=8,vocab=64,tie=1")
    g = autopar.trace(z.model, z.example_inputs)
    assert g.num_params == zoo.n_params(z.model)
    assert g.aliases == {"lm_head.weight": "wte.weight"}
    reads = [n for n in g.nodes if n.param == "wte.weight"]
    assert len(reads) == 1 and len(g.consumers(reads[0].name)) == 2   # embedding and lm_head
    assert not any(n.param == "lm_head.weight" for n in g.nodes)


def test_gpt_group_params_per_instance():
    g = _trace(GPT)
    C, F_ = 64, 256
    per_block = 4 * (C * C + C) + (C * F_ + F_) + (F_ * C + C) + 2 * 2 * C
    assert g.groups[0].params_per_instance == per_block


# ------------------------------------------------------------------ fingerprint
def test_fingerprint_stable_and_distinct():
    spec = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"
    base = _trace(spec, batch=1).fingerprint
    assert _trace(spec, batch=3).fingerprint == base                     # batch size
    assert _trace(spec, device="cpu", seed=0).fingerprint == base        # real weights
    assert _trace(spec, device="cpu", seed=7).fingerprint == base        # other weight values
    assert _trace("gpt:layers=2,hidden=128,heads=4,seq=16,vocab=128").fingerprint != base
    assert _trace("gpt:layers=3,hidden=64,heads=4,seq=16,vocab=128").fingerprint != base
    assert _trace("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=256").fingerprint != base


@pytest.mark.parametrize("spec", [GPT, LLAMA, MLP, CNN], ids=["gpt", "llama", "mlp", "cnn"])
def test_fingerprint_same_with_loss(spec):
    """A plan made without the loss must match the model traced with it
    (parallelize traces model + loss and checks the plan's fingerprint)."""
    z = zoo.build(spec)
    plain = autopar.trace(z.model, z.example_inputs)
    with_loss = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    assert with_loss.loss_prefix == "model."
    assert with_loss.fingerprint == plain.fingerprint


# ------------------------------------------------------------------ loss
@pytest.mark.parametrize("spec", [GPT, MLP], ids=["gpt", "mlp"])
def test_trace_with_loss(spec):
    z = zoo.build(spec, device="cpu")
    g = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    ce = [n for n in g.nodes if n.kind == "cross_entropy"]
    assert len(ce) == 1
    assert g.output == ce[0].name
    assert ce[0].out.shape == ()
    assert ce[0].attrs["reduction"] == "mean"
    assert ce[0].flops > 0
    assert not g.in_model(ce[0])
    assert g.inputs[-1] == "target"
    # parameters are those of the model, prefixed by the wrapper
    assert all(k.startswith("model.") for k in g.params)


def test_trace_loss_without_target_raises():
    z = zoo.build(MLP)
    with pytest.raises(autopar.TraceError, match="target"):
        autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn)


def test_trace_zoo_string_includes_loss():
    g = autopar.trace("mlp:layers=2,inp=8,hidden=16,classes=4")
    assert any(n.kind == "cross_entropy" for n in g.nodes)
    assert g.name.startswith("mlp:")


# ------------------------------------------------------------------ batch of a traced string (issue 15)
GPT_1_7B = "gpt:layers=24,hidden=2304,heads=24,seq=2048,vocab=51200"


def test_string_graph_and_module_predict_the_same():
    """A zoo string, a Graph traced from the string and a Graph traced from
    the zoo's module (batch 2, with its loss) predict the same: trace(str)
    once built batch 1 and predicted a step several times too short."""
    kw = dict(cluster="dgx-a100-80g", devices=32, strategy="dp=32,recompute=full", global_batch=512)
    by_string = autopar.evaluate(GPT_1_7B, **kw)
    traced = autopar.trace(GPT_1_7B)
    assert traced.batch_size == 2
    by_graph = autopar.evaluate(traced, **kw)
    z = zoo.build(GPT_1_7B, batch=2)
    module = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    by_module = autopar.evaluate(module, **kw)
    for est in (by_graph, by_module):
        assert est.step_time_s == pytest.approx(by_string.step_time_s, rel=1e-9)
        assert est.peak_memory_bytes == pytest.approx(by_string.peak_memory_bytes, rel=1e-9)
        assert est.tflops_per_device == pytest.approx(by_string.tflops_per_device, rel=1e-9)
    assert by_string.tflops_per_device > 50          # not ~1 TFLOP/s per A100
    assert autopar.plan(traced, cluster="dgx-a100-80g", devices=32, global_batch=512,
                        strategy="dp=32,recompute=full").data["predicted"]["step_time_s"] == \
        pytest.approx(by_string.step_time_s, rel=1e-5)     # the plan keeps 6 significant digits


def test_batch_1_graph_refuses_to_scale():
    z = zoo.build("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128")     # batch 1
    g = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    assert g.batch_size == 1
    with pytest.raises(autopar.StrategyError, match="example batch of 1.*global_batch=8.*batch 2 or more"):
        autopar.evaluate(g, cluster="dgx-a100-80g", devices=2, strategy="dp=2", global_batch=8)
    with pytest.raises(autopar.StrategyError, match="example batch of 1"):
        autopar.plan(g, cluster="dgx-a100-80g", devices=2, global_batch=8)
    # at global batch 1 there is nothing to scale
    assert autopar.evaluate(g, cluster="dgx-a100-80g", devices=1, strategy="dp=1", global_batch=1).step_time_s > 0


def test_trace_bad_arguments():
    with pytest.raises(autopar.TraceError, match="nn.Module"):
        autopar.trace(42, (torch.zeros(1),))
    with pytest.raises(autopar.TraceError, match="example_inputs"):
        autopar.trace(nn.Linear(2, 2))
    with pytest.raises(autopar.TraceError, match="frontend"):
        autopar.trace(nn.Linear(2, 2), (torch.zeros(1, 2),), frontend="jit")


# ------------------------------------------------------------------ errors
class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:            # data-dependent control flow
            return self.lin(x)
        return x


class _GateItem(_Gate):
    def forward(self, x):
        v = x.sum().item()         # a Python number from data: export cannot guard on it either
        if v > 0:
            return self.lin(x)
        return x


class _Net(nn.Module):
    def __init__(self, gate: nn.Module):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.gate = gate

    def forward(self, x):
        return self.gate(self.inp(x))


@pytest.mark.parametrize("gate_cls", [_Gate, _GateItem])
def test_data_dependent_control_flow_fx(gate_cls):
    with pytest.raises(autopar.TraceError) as ei:
        autopar.trace(_Net(gate_cls()), (torch.randn(2, 8),), frontend="fx")
    msg = str(ei.value)
    assert "gate" in msg and gate_cls.__name__ in msg          # the submodule path and class
    assert "control flow" in msg                                # and the reason


def test_data_dependent_control_flow_auto_both_fail(capfd):
    with pytest.raises(autopar.TraceError) as ei:
        autopar.trace(_Net(_GateItem()), (torch.randn(2, 8),))
    msg = str(ei.value)
    assert "module gate (_GateItem)" in msg
    assert "control flow" in msg
    assert "torch.export failed too" in msg
    assert "data-dependent" in msg


# ------------------------------------------------------------------ GPT-3 175B on meta
def test_gpt3_175b_traces_on_meta():
    g = autopar.trace(GPT3)
    assert g.frontend == "fx"
    assert len(g.groups) == 1
    grp = g.groups[0]
    assert len(grp.instances) == 96
    assert grp.name.endswith("blocks.*")
    assert g.num_params == pytest.approx(175e9, rel=0.01)
    assert g[g.output].kind == "cross_entropy"


# ------------------------------------------------------------------ Hugging Face GPT-2 (export)
class _Logits(nn.Module):
    """HF models return a ModelOutput: planning wants the logits tensor."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(ids).logits


@pytest.fixture(scope="module")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_hf_gpt2_traces(hf_gpt2):
    ids = torch.randint(0, 128, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = autopar.trace(hf_gpt2, (ids,))
    # transformers 5.x does not trace with fx; the export fallback does
    assert g.frontend in ("fx", "export")
    assert [(grp.name, len(grp.instances)) for grp in g.groups] == [("transformer.h.*", 2)]
    # lm_head.weight is tied to transformer.wte.weight: listed and counted once
    names = dict(hf_gpt2.named_parameters())
    assert {k: p.shape for k, p in g.params.items()} == {k: tuple(v.shape) for k, v in names.items()}
    assert g.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert g.num_params == sum(p.numel() for p in hf_gpt2.parameters())
    kinds = _kinds(g)
    assert kinds["sdpa"] == 2 and kinds["layernorm"] == 5 and kinds["embedding"] == 2
    # GPT-2's Conv1D is addmm(bias, x[N, K], W[K, M]), traced as mm(x, W) + bias: 2 * N * K * M
    N = 2 * 16
    products = [n for n in g.nodes if n.kind in ("linear", "matmul")]
    for n in products:
        if n.target == "mm":
            k_dim, m_dim = g[n.inputs[-1]].out.shape
            assert n.out.shape == (N, m_dim)
            assert n.flops == 2 * N * k_dim * m_dim
    assert sum(n.target == "mm" for n in products) == 2 * 4
    assert sum(n.flops for n in products) == pytest.approx(
        2 * N * (2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 64 * 128))


def test_hf_gpt2_export_with_loss(hf_gpt2):
    ids = torch.randint(0, 128, (2, 16))
    m = _Logits(hf_gpt2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = autopar.trace(m, (ids,))
        g = autopar.trace(m, (ids,), loss_fn=zoo.lm_loss, target=ids)
    assert [(grp.name, len(grp.instances)) for grp in g.groups] == [("model.m.transformer.h.*", 2)]
    ce = [n for n in g.nodes if n.kind == "cross_entropy"]
    assert len(ce) == 1 and g.output == ce[0].name
    assert ce[0].attrs["reduction"] == "mean"
    assert g.fingerprint == plain.fingerprint


def test_hf_gpt2_meta(hf_gpt2):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        m = transformers.GPT2LMHeadModel(hf_gpt2.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = autopar.trace(_Logits(m), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert len(g.groups) == 1 and len(g.groups[0].instances) == 2
    assert g[g.output].out.shape == (2, 16, 128)


# ------------------------------------------------------------------ front ends agree
def test_fx_and_export_graphs_plan_alike():
    """Nothing may depend on which front end traced a model: the zoo GPT traced by
    symbolic fx and by torch.export gets the same predictions for every strategy
    family, the same repeated layers, and export knows the batch dim of every
    tensor exactly (the batch size was a symbol)."""
    import autopar.zoo as zoo
    from autopar.sharding import batch_dims
    z = zoo.build("gpt:layers=2,hidden=64,heads=8,seq=16,vocab=128", batch=4, device="cpu")
    gs = {fe: autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target, frontend=fe)
          for fe in ("fx", "export")}
    assert gs["export"].frontend == "export" and gs["export"].traced_batch_dims is not None
    assert [len(g.instances) for g in gs["fx"].groups] == [len(g.instances) for g in gs["export"].groups] == [2]
    bd = batch_dims(gs["export"])
    assert all(bd[n.name] == 0 for n in gs["export"].nodes if n.kind in ("linear", "sdpa", "layernorm"))
    for strategy in ("dp=8", "tp=8", "dp=2,tp=4,sequence_parallel=true", "pp=2,tp=4,microbatches=4",
                     "dp=8,zero=3,recompute=selective"):
        fx, ex = (autopar.evaluate(gs[fe], cluster="dgx-a100-80g", devices=8, strategy=strategy, global_batch=64)
                  for fe in ("fx", "export"))
        assert ex.step_time_s == pytest.approx(fx.step_time_s, rel=1e-9), strategy
        assert ex.peak_memory_bytes == pytest.approx(fx.peak_memory_bytes, rel=1e-9), strategy


def test_loss_fn_labels_is_the_models_own_loss():
    """``loss_fn="labels"`` traces ``model(*inputs, labels=target).loss`` (the Hugging
    Face convention); anything else that is not a function is a clear error."""
    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, labels=None):
            logits = self.lin(x)
            out = type("Out", (), {})()
            out.logits = logits
            out.loss = F.cross_entropy(logits, labels) if labels is not None else None
            return out

    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    g = autopar.trace(OwnLoss(), (x,), loss_fn="labels", target=y)
    assert [n.kind for n in g.nodes if n.kind == "cross_entropy"] == ["cross_entropy"]
    with pytest.raises(autopar.TraceError, match="loss_fn must be a function"):
        autopar.trace(OwnLoss(), (x,), loss_fn="mean", target=y)
    with pytest.raises(autopar.TraceError, match="argument 'labels'"):    # a model without labels=
        autopar.trace(nn.Linear(8, 4), (x,), loss_fn="labels", target=y)


def _fx_rows(g: Graph) -> list[tuple]:
    """What a traced fx graph is made of: names, ops, targets, arguments, module stacks and shapes."""
    def meta(t):
        return None if t is None else (tuple(t.shape), t.dtype, tuple(t.stride)) if hasattr(t, "shape") else repr(t)
    import torch.fx as fx
    return [(n.name, n.op, n.target, fx.map_arg((n.args, n.kwargs), lambda a: f"%{a.name}"), sorted(n.meta),
             [(k, v) for k, v in (n.meta.get("nn_module_stack") or {}).items()], meta(n.meta.get("tensor_meta")))
            for n in g.gm.graph.nodes]


@pytest.mark.parametrize("spec", ["gpt:layers=8,hidden=64,heads=4,seq=16,vocab=128",
                                  "gpt:layers=7,hidden=64,heads=4,seq=16,vocab=128,tie=1",
                                  "llama:layers=7,hidden=64,heads=4,kv_heads=2,ffn=176,seq=16,vocab=128"])
def test_shallow_fx_trace_gives_the_whole_graph(monkeypatch, spec):
    """A deep model on the meta device is traced with 3 layers, the others
    written in as copies: the graph a whole trace gives, node for node (names,
    targets, arguments, module stacks, shapes, the planner's view of it)."""
    import autopar.shallow_export as se
    made = []
    extend = se._extend
    monkeypatch.setattr(se, "_extend", lambda *a: made.append(extend(*a)) or made[-1])
    graphs = []
    for min_layers in (10 ** 9, se.MIN_LAYERS):
        monkeypatch.setattr(se, "MIN_LAYERS", min_layers)
        graphs.append(autopar.trace(spec))
    whole, shallow = graphs
    assert len(made) == 1 and made[0] is not None      # the second trace was the shallow one
    assert _fx_rows(shallow) == _fx_rows(whole)
    assert shallow.gm.code == whole.gm.code
    assert shallow.fingerprint == whole.fingerprint
    assert [(n.name, n.kind, n.out, n.inputs, n.group, n.param, n.flops) for n in shallow.nodes] == \
        [(n.name, n.kind, n.out, n.inputs, n.group, n.param, n.flops) for n in whole.nodes]


class _ViewsAfterContiguous(nn.Module):
    """``x.contiguous().view(...)`` behind a branch on a size: fx cannot trace it, export can."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 4)

    def forward(self, x):
        b, t, c = x.size()
        if b > 0:
            x = x.contiguous()
        return self.lin(x.view(b, t * c))


def test_export_runs_on_other_strides():
    """export drops a ``.contiguous()`` that was a no-op on the example, so its ``view`` broke on
    a tensor laid out otherwise at run time (a non-contiguous batch here; on CUDA, the output of
    nn.MultiheadAttention's attention kernel, which failed every fp32 nn.Transformer model there):
    the program reshapes instead, and trains as eager does."""
    torch.manual_seed(0)
    model = _ViewsAfterContiguous()
    x = torch.randn(3, 8, 4).transpose(0, 1)     # [8, 3, 4], not contiguous
    y = torch.randn(8, 4)
    assert autopar.trace(model, (x.contiguous(),), loss_fn=F.mse_loss, target=y).frontend == "export"
    want = F.mse_loss(model(x), y).item()
    pm = autopar.parallelize(model, (x.contiguous(),), loss_fn=F.mse_loss, example_target=y,
                             strategy="precision=fp32")
    assert pm.train_step((x,), y) == pytest.approx(want, rel=1e-6)
