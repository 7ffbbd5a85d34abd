"""Model zoo: model strings, the four families, factories and losses."""
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from autopar import zoo
from autopar.errors import ZooError
from autopar.zoo.models import LlamaAttention, LlamaConfig, rope_cache

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "gpt": ("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=50,batch=2", (2, 8, 50)),
    "llama": ("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=8,vocab=50,batch=2",
              (2, 8, 50)),
    "mlp": ("mlp:layers=3,inp=12,hidden=16,classes=5,batch=4", (4, 5)),
    "cnn": ("cnn:layers=3,channels=4,image=8,classes=5,batch=2", (2, 5)),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_family_builds_runs_and_traces(family):
    spec, shape = TINY[family]
    z = zoo.build(spec, device="cpu")
    z.model.eval()  # BatchNorm: eager and traced must use the same statistics
    out = z.model(*z.example_inputs)
    assert out.shape == shape
    loss = z.loss_fn(out, z.example_target)
    assert loss.dim() == 0 and torch.isfinite(loss)

    gm = fx.symbolic_trace(z.model)
    torch.testing.assert_close(gm(*z.example_inputs), out)
    # the loss traces too
    fx.symbolic_trace(lambda o, t: z.loss_fn(o, t))


@pytest.mark.parametrize("family", sorted(TINY))
def test_meta_build_has_no_data_and_shapes_propagate(family):
    z = zoo.build(TINY[family][0])
    assert all(p.is_meta for p in z.model.parameters())
    assert all(x.is_meta for x in z.example_inputs)
    assert z.model(*z.example_inputs).shape == TINY[family][1]


def test_canonical_name_round_trips():
    z = zoo.build("gpt:vocab=50,heads=4,hidden=32,layers=1,seq=8")
    assert z.name == "gpt:batch=1,bias=1,ffn=128,heads=4,hidden=32,layers=1,seq=8,tie=0,vocab=50"
    assert zoo.build(z.name).name == z.name
    assert zoo.build("llama").name == zoo.build(zoo.build("llama").name).name


def test_defaults_and_batch_override():
    z = zoo.build("gpt", batch=3)
    assert z.config["layers"] == 12 and z.config["ffn"] == 4 * 768
    assert z.example_inputs[0].shape == (3, 1024)
    assert zoo.families()["llama"]["rope_theta"] == 500000.0


def test_init_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a = zoo.build(TINY["gpt"][0], device="cpu")
    b = zoo.build(TINY["gpt"][0], device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])


def test_tie():
    m = zoo.build("gpt:layers=1,hidden=32,heads=4,seq=8,vocab=50,tie=1").model
    assert m.lm_head.weight is m.wte.weight


def test_gpt3_175b_on_meta():
    z = zoo.build("gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    n = zoo.n_params(z.model)
    assert abs(n - 175e9) / 175e9 < 0.02


def test_llama3_8b_params():
    z = zoo.build("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256")
    assert abs(zoo.n_params(z.model) - 8.03e9) / 8.03e9 < 0.005


def test_llama_reset_rope_after_to_empty():
    spec = TINY["llama"][0]
    ref = zoo.build(spec, device="cpu").model
    m = zoo.build(spec).model.to_empty(device="cpu")
    m.reset_rope()
    torch.testing.assert_close(m.cos, ref.cos)
    torch.testing.assert_close(m.sin, ref.sin)


def _naive_gqa_attention(attn, x, theta):
    """Loop-and-complex-number reference for RoPE + GQA + causal attention."""
    B, T, _ = x.shape
    H, KV, hd = attn.heads, attn.kv_heads, attn.head_dim
    q = attn.q(x).view(B, T, H, hd)
    k = attn.k(x).view(B, T, KV, hd)
    v = attn.v(x).view(B, T, KV, hd)
    # rotate-half RoPE == complex rotation of (x[j], x[j + hd/2]) by t * freq_j
    freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    rot = torch.polar(torch.ones(T, hd // 2), torch.arange(T).float()[:, None] * freq)

    def rope(t):
        z = torch.complex(t[..., : hd // 2], t[..., hd // 2:]) * rot[None, :, None, :]
        return torch.cat((z.real, z.imag), dim=-1)

    q, k = rope(q), rope(k)
    y = torch.zeros(B, T, H, hd)
    for b in range(B):
        for h in range(H):
            kh = h // (H // KV)
            for t in range(T):
                s = (k[b, : t + 1, kh] @ q[b, t, h]) / hd ** 0.5
                y[b, t, h] = torch.softmax(s, 0) @ v[b, : t + 1, kh]
    return attn.o(y.reshape(B, T, H * hd))


def test_rope_gqa_attention_matches_naive_reference():
    torch.manual_seed(0)
    cfg = LlamaConfig(layers=1, hidden=48, heads=6, kv_heads=2, ffn=32, seq=16, vocab=10,
                      rope_theta=10000.0)
    attn = LlamaAttention(cfg)
    T = 7  # shorter than seq: checks that positions are cut, not broadcast
    x = torch.randn(3, T, 48)
    cos, sin = rope_cache(cfg.seq, 8, cfg.rope_theta)
    with torch.no_grad():
        got = attn(x, cos[:T], sin[:T])
        want = _naive_gqa_attention(attn, x, cfg.rope_theta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_losses_match_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    target = torch.randint(7, (2, 5), generator=g)
    torch.testing.assert_close(zoo.lm_loss(logits, target),
                               F.cross_entropy(logits.reshape(10, 7), target.reshape(10)))
    torch.testing.assert_close(zoo.classification_loss(logits[:, 0], target[:, 0]),
                               F.cross_entropy(logits[:, 0], target[:, 0]))


# ------------------------------------------------------------------------- errors

def test_unknown_key_lists_valid_keys():
    with pytest.raises(ZooError, match="layerz.*heads.*hidden.*layers"):
        zoo.build("gpt:layerz=2")


def test_unknown_family_lists_families():
    with pytest.raises(ZooError, match="bert.*gpt.*llama.*mlp.*cnn"):
        zoo.build("bert:layers=2")
    with pytest.raises(ZooError, match="gpt"):
        zoo.build("bert")


@pytest.mark.parametrize("spec, match", [
    ("gpt:hidden=100,heads=12", "heads=12 does not divide hidden=100.*1, 2, 4, 5"),
    ("llama:heads=32,kv_heads=5", "kv_heads=5 does not divide heads=32"),
    ("gpt:layers=0", "layers=0.*positive"),
    ("gpt:layers=abc", "layers='abc'.*integer"),
    ("gpt:tie=2", "tie=2.*0 or 1"),
    ("llama:rope_theta=x", "rope_theta='x'"),
    ("cnn:layers=6,image=8", "image=8.*layers=6"),
    ("gpt:layers", "layers.*no value"),
])
def test_invalid_values(spec, match):
    with pytest.raises(ZooError, match=match):
        zoo.build(spec)


# ----------------------------------------------------------------------- factories

def test_factory_from_file():
    z = zoo.build(str(ROOT / "examples" / "custom_model.py") + ":make")
    assert z.model(*z.example_inputs).shape == (8, 10)
    assert z.loss_fn is None and z.example_target is None and z.config == {}
    fx.symbolic_trace(z.model)


def test_factory_from_relative_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    model, inputs = zoo.load("examples/custom_model.py:make")
    assert isinstance(inputs, tuple) and inputs[0].shape == (8, 64)


def test_factory_from_module(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg_zoo_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(
        "import torch\n"
        "import torch.nn.functional as F\n"
        "def make():\n"
        "    m = torch.nn.Linear(4, 3)\n"
        "    return m, torch.ones(2, 4), F.cross_entropy, torch.tensor([0, 1])\n"
        "VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="batch=5 is ignored"):
        z = zoo.build("userpkg_zoo_test.models:make", batch=5)
    assert z.example_inputs[0].shape == (2, 4)  # a single tensor is wrapped
    assert z.loss_fn is F.cross_entropy and z.example_target.tolist() == [0, 1]
    with pytest.raises(ZooError, match="no attribute 'nope'.*make"):
        zoo.build("userpkg_zoo_test.models:nope")
    with pytest.raises(ZooError, match="not a callable"):
        zoo.build("userpkg_zoo_test.models:VALUE")
    sys.modules.pop("userpkg_zoo_test.models", None)
    sys.modules.pop("userpkg_zoo_test", None)


def test_factory_missing_things(tmp_path):
    with pytest.raises(ZooError, match="does not exist"):
        zoo.build(str(tmp_path / "missing.py") + ":make")
    with pytest.raises(ZooError, match="no zoo family or module named 'no_such_pkg.mod'"):
        zoo.build("no_such_pkg.mod:make")
    bad = tmp_path / "bad.py"
    bad.write_text("def make():\n    return 3\n")
    with pytest.raises(ZooError, match="must return"):
        zoo.build(f"{bad}:make")
