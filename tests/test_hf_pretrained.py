"""``hf:PATH``: a Hugging Face model from its checkpoint's config.json (autopar/zoo/hf_pretrained.py)."""
import json

import pytest
import torch

import autopar
from autopar import zoo
from autopar.errors import ZooError
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# the hf-llama family's defaults where the graph could see them, so the two strings build one model
LLAMA = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=64, max_position_embeddings=16, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
SAME_AS = ("hf-llama:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
           "intermediate_size=64,vocab_size=64,seq=16")


pytestmark = pytest.mark.filterwarnings("ignore")     # transformers' and the trace's, not under test


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(**LLAMA).save_pretrained(d)
    return str(d)


def test_builds_the_checkpoints_architecture(llama_dir):
    z = zoo.build(f"hf:{llama_dir}", device="cpu")
    assert type(z.model).__name__ == "LlamaForCausalLM"
    assert z.model.config.use_cache is False
    assert z.example_inputs[0].shape == (1, 16)       # seq: the smaller of 2048 and the position limit
    out = z.model(*z.example_inputs)
    assert out.logits.shape == (1, 16, 64)
    assert torch.isfinite(z.loss_fn(out, z.example_target))
    assert z.name == f"hf:{llama_dir},batch=1,seq=16"
    assert zoo.build(z.name, device="cpu").name == z.name         # the name parses back


def test_same_model_as_the_family_string(llama_dir):
    """The config file and the hf-llama string with its fields trace to one graph (one fingerprint:
    a plan made from either runs the other)."""
    a, b = autopar.trace(f"hf:{llama_dir}/config.json,seq=16"), autopar.trace(SAME_AS)
    assert a.fingerprint == b.fingerprint
    assert len(a.nodes) == len(b.nodes)


def test_overrides_take_the_files_types(llama_dir):
    z = zoo.build(f"hf:{llama_dir},num_hidden_layers=1,rms_norm_eps=1e-6,seq=8,batch=3")
    assert z.model.config.num_hidden_layers == 1 and len(z.model.model.layers) == 1
    assert z.model.config.rms_norm_eps == 1e-6
    assert z.example_inputs[0].shape == (3, 8)
    assert z.config == {"path": llama_dir, "batch": 3, "seq": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-6}
    assert zoo.build(z.name).model.config.num_hidden_layers == 1


def test_plans_and_evaluates(llama_dir):
    plan = autopar.plan(f"hf:{llama_dir}", cluster="dgx-h100", devices=8, global_batch=16)
    assert plan.predicted["fits"]
    assert plan.data["model"]["name"] == f"hf:{llama_dir},batch=2,seq=16"     # traced at the planning batch
    est = autopar.evaluate(f"hf:{llama_dir}", cluster="dgx-h100", devices=4, strategy="dp=2,tp=2", global_batch=8)
    assert est.fits and est.step_time_s > 0


def test_published_llama_3_1_8b_config_builds_on_meta(tmp_path):
    """Meta's published config.json of Llama 3.1 8B (rope_scaling of type llama3 and all): 8.03 B parameters."""
    cfg = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
           "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
           "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_cache": True, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    z = zoo.build(f"hf:{tmp_path},seq=8192")
    assert sum(p.numel() for p in z.model.parameters()) == 8_030_261_248
    assert z.example_inputs[0].shape == (1, 8192) and z.example_inputs[0].is_meta


def _t5(tmp_path):
    transformers.T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=32,
                          architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)


def _remote(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "llama",
                                                     "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))


def _not_config(tmp_path):
    (tmp_path / "weights.json").write_text("{}")


@pytest.mark.parametrize("make, suffix, match", [
    (None, "", "cannot read a configuration there"),
    (_t5, "", "T5ForConditionalGeneration is not a language-model head"),
    (_remote, "", "needs remote code"),
    (_not_config, "/weights.json", "must be named config.json"),
    ("llama", ",seq=0", "seq='0' is invalid"),
    ("llama", ",seq=99", "seq=99 exceeds the configuration's max_position_embeddings=16"),
    ("llama", ",num_hidden_layers=two", "num_hidden_layers='two' is invalid: expected int"),
    ("llama", ",seq=8,seq=4", "key 'seq' is given twice"),
    ("llama", ",seq", None),        # no '=': part of the path, which does not exist
])
def test_invalid(tmp_path, make, suffix, match):
    if make == "llama":
        transformers.LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    elif make is not None:
        make(tmp_path)
    where = str(tmp_path) if make is not None else str(tmp_path / "missing")
    with pytest.raises(ZooError, match=match or "cannot read a configuration there"):
        zoo.build(f"hf:{where}{suffix}")


def test_empty_path_and_unknown_family_name_it():
    with pytest.raises(ZooError, match="no path"):
        zoo.build("hf:")
    with pytest.raises(ZooError, match="hf:PATH"):
        zoo.build("bert:layers=2")


def _train(rank: int, world: int, spec: str, strategy: str | None):
    import torch.distributed as dist
    z = zoo.build(spec, device="cpu")
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)     # noqa: E731
    if strategy is None:
        o, out = opt(z.model.parameters()), []
        for _ in range(3):
            o.zero_grad()
            loss = z.loss_fn(z.model(*z.example_inputs), z.example_target)
            loss.backward()
            o.step()
            out.append(loss.item())
        return out, sum(p.numel() for p in z.model.parameters())
    pm = autopar.parallelize(z.model, z.example_inputs, loss_fn=z.loss_fn, example_target=z.example_target,
                             optimizer=opt, strategy=strategy)
    out = [pm.train_step(z.example_inputs, z.example_target) for _ in range(3)]
    dist.barrier()
    return out, sum(p.numel() for p in pm.parameters())


def test_trains_under_tensor_parallel_as_one_process(llama_dir):
    spec = f"hf:{llama_dir},batch=2"
    ref, full = _train(0, 1, spec, None)
    got = run_distributed(_train, 2, spec, "tp=2", timeout=300)
    for losses, local in got:
        assert losses == pytest.approx(ref, abs=1e-4)
        assert local < full         # the weights are split, not replicated


def test_attn_implementation_picks_the_kernel(llama_dir):
    """``attn_implementation=eager``: the scores written out (matmul, softmax), as from_pretrained's keyword."""
    kinds = lambda g: {nd.kind for nd in g.nodes}     # noqa: E731
    eager = autopar.trace(f"hf:{llama_dir},attn_implementation=eager,batch=2")
    assert "matmul" in kinds(eager) and "softmax" in kinds(eager) and "sdpa" not in kinds(eager)
    assert "sdpa" in kinds(autopar.trace(f"hf:{llama_dir},batch=2"))


def test_a_kernel_the_model_has_not_is_a_clear_error(tmp_path):
    transformers.Gemma2Config(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, vocab_size=32,
                              architectures=["Gemma2ForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ZooError, match="cannot build this configuration: Gemma2ForCausalLM does not support"):
        zoo.build(f"hf:{tmp_path},attn_implementation=sdpa")
    assert type(zoo.build(f"hf:{tmp_path},attn_implementation=eager").model).__name__ == "Gemma2ForCausalLM"


def test_a_bare_config_json_in_the_working_directory(llama_dir, monkeypatch):
    monkeypatch.chdir(llama_dir)
    assert zoo.build("hf:config.json,seq=8").example_inputs[0].shape == (1, 8)
