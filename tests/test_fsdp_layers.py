"""The dp axis per layer (issue 16): ``fsdp_layers=k`` puts the first k
repeated layers under ZeRO-3 (FSDP2 units) and the rest of the model under
the distributed optimizer's ZeRO stage. Checked: the grammar's rules, the
cost model (memory between the two forms, falling with k past FSDP2's
prefetch; time rising with k), the search (it takes a mix where the ZeRO-1/2
form does not fit and the mix beats ZeRO-3, with the fewest layers that fit),
numerics equal to one process (fp32, tp, accumulation, recompute, clipping;
bf16 against the same precision policy) and checkpoints that resume under
another plan."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.api import as_graph
from autopar.errors import StrategyError
from autopar.search import grid as search_grid
from autopar.spec import parse_strategy
from distributed import run_distributed
from test_parallel import GPT, LLAMA, STEPS, _data, _opt

LLAMA_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"


@pytest.mark.parametrize("strategy,words", [
    ("dp=4,zero=3,fsdp_layers=2", "zero=3 already shards every layer"),
    ("dp=2,pp=2,zero=1,fsdp_layers=1", "with pp=2"),
    ("dp=4,zero=1,fsdp_layers=1,precision=fp16", "fp16"),
    ("dp=2,tp=2,zero=1,fsdp_layers=1,copies=2", "multi-copy"),
    ("dp=2,tp=4,tp_mode=2d,zero=1,fsdp_layers=1", "grid or mesh"),
    ("dp=4,zero=1,fsdp_layers=1,offload=optimizer", "host"),
    ("tp=4,zero=1,fsdp_layers=1", "one data-parallel rank"),
])
def test_rules_are_clear_errors(strategy, words):
    with pytest.raises(StrategyError, match=words):
        parse_strategy(strategy)


def test_more_layers_than_the_model_has_is_an_error():
    with pytest.raises(StrategyError, match="has 2"):
        autopar.evaluate(GPT, cluster="dgx-a100-80g", devices=4, global_batch=8, strategy="dp=4,zero=1,fsdp_layers=3")


def test_alias_and_canonical_string():
    cfg = parse_strategy("dp=4,zero=2,zero3_layers=3")
    assert cfg.fsdp_layers == 3 and cfg.to_string().endswith("zero=2,fsdp_layers=3")
    assert "fsdp_layers" not in parse_strategy("dp=4,zero=2").as_dict()      # recorded when set


def _estimates(zero: int) -> tuple[autopar.Estimate, list[autopar.Estimate], autopar.Estimate]:
    g = as_graph(LLAMA_8B)
    def ev(s):
        return autopar.evaluate(g, cluster="dgx-h100", devices=8, global_batch=64, strategy=f"dp=8,microbatches=8,{s}")
    return ev(f"zero={zero}"), [ev(f"zero={zero},fsdp_layers={k}") for k in (1, 2, 8, 16, 32)], ev("zero=3")


@pytest.mark.parametrize("zero", [1, 2])
def test_cost_lies_between_the_two_forms(zero):
    low, mixes, three = _estimates(zero)
    peaks = [e.peak_memory_bytes for e in mixes]
    times = [e.step_time_s for e in mixes]
    # each layer sharded saves its weights' (and ZeRO-1: gradients') bytes; from the second on FSDP2
    # holds two layers gathered (the running one and the prefetched one)
    assert peaks[1:] == sorted(peaks[1:], reverse=True) and peaks[-1] < low.peak_memory_bytes
    # every layer sharded: about ZeRO-3's (the root under zero=1/2 instead of gathered whole by FSDP2;
    # ZeRO-1 keeps the root's gradient whole: 1B elements of embedding and head at 128k tokens)
    assert peaks[-1] == pytest.approx(three.peak_memory_bytes, rel=0.02 if zero == 2 else 0.1)
    # every layer sharded adds its gathers and reduce-scatters: time rises with k, from the ZeRO-1/2 form
    assert low.step_time_s < times[0] and times == sorted(times)
    assert mixes[-1].dp_comm_time_s > low.dp_comm_time_s
    assert mixes[0].memory["weights"] < low.memory["weights"]


def test_search_takes_the_fewest_layers_that_fit():
    g = as_graph(LLAMA_8B)
    kw = dict(cluster="dgx-h100", devices=8, global_batch=64)
    plan = autopar.plan(g, **kw)
    cfg = parse_strategy(plan.strategy)
    assert cfg.fsdp_layers > 0 and cfg.zero in (1, 2), plan.strategy
    fewer = dataclasses.replace(cfg, fsdp_layers=cfg.fsdp_layers - 1).to_string()
    assert not autopar.evaluate(g, strategy=fewer, **kw).fits
    tries = search_grid.FSDP_TRIES
    search_grid.FSDP_TRIES = 0
    try:
        without = autopar.plan(g, **kw)
    finally:
        search_grid.FSDP_TRIES = tries
    assert "fsdp_layers" not in without.strategy
    assert plan.predicted["step_time_s"] < without.predicted["step_time_s"]


FP32 = [(GPT, "dp=4,zero=1,fsdp_layers=1"), (LLAMA, "dp=2,tp=2,zero=2,fsdp_layers=2,accumulate=2"),
        (GPT, "dp=2,tp=2,zero=0,fsdp_layers=1,recompute=full"),
        (LLAMA, "dp=2,cp=2,zero=2,fsdp_layers=2")]     # FSDP2 and the optimizer over dp x cp
BF16 = (LLAMA, "dp=4,zero=1,fsdp_layers=1,precision=bf16")
RUNS = FP32 + [BF16]
CLIP = 0.05


def _worker(rank: int, world: int, d: str) -> dict:
    out = {}
    for spec, strategy in RUNS:
        z, x, y = _data(spec)
        pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y, optimizer=_opt("adamw"),
                                 strategy=strategy, max_grad_norm=CLIP)
        losses = [pm.train_step((x,), y) for _ in range(STEPS)]
        sd = pm.full_state_dict()
        out[strategy] = {"losses": losses, "weights": sd if rank == 0 else None, "norm": pm.grad_norm,
                         "kinds": sorted({(type(p).__name__, str(p.dtype)) for p in pm.parameters()})}
    # a checkpoint of the mix, resumed under ZeRO-3 with tp
    z, x, y = _data(GPT)
    pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y, optimizer=_opt("adamw"),
                             strategy="dp=4,zero=2,fsdp_layers=1")
    first = [pm.train_step((x,), y) for _ in range(2)]
    pm.save_checkpoint(f"{d}/mix")
    z, x, y = _data(GPT)
    pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y, optimizer=_opt("adamw"),
                             strategy="dp=2,tp=2,zero=3")
    pm.load_checkpoint(f"{d}/mix")
    out["resumed"] = first + [pm.train_step((x,), y) for _ in range(2)]
    return out


def _reference(spec: str, steps: int, clip: float | None, precision: str = "fp32") -> tuple[list, dict, float]:
    """One process: losses, final weights and the last gradient norm (bf16: the
    distributed optimizer's precision policy on the plain model)."""
    from autopar.runtime.optim import DistributedOptimizer
    z, x, y = _data(spec)
    if precision == "fp32":
        opt = _opt("adamw")(list(z.model.parameters()))
    else:
        opt = DistributedOptimizer(list(z.model.parameters()), _opt("adamw"), None, precision=precision,
                                   max_grad_norm=clip)
        for b in z.model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(torch.bfloat16)
    out, norm = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = z.loss_fn(z.model(x), y)
        loss.backward()
        if precision == "fp32" and clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(z.model.parameters(), clip))
        opt.step()
        out.append(loss.item())
    return out, z.model.state_dict(), norm


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("fsdp_layers")), timeout=600)


@pytest.mark.parametrize("spec,strategy", FP32)
def test_fp32_equals_one_process(results, spec, strategy):
    ref, weights, norm = _reference(spec, STEPS, CLIP)
    for rank, res in enumerate(results):
        r = res[strategy]
        assert r["losses"] == pytest.approx(ref, rel=1e-4), (strategy, rank)
        assert r["norm"] == pytest.approx(norm, rel=1e-4)       # FSDP2's shards counted in the clip
        assert {k for k, _ in r["kinds"]} == {"DTensor", "Parameter"}     # both systems hold weights
    got = results[0][strategy]["weights"]
    for k, v in weights.items():
        if not k.endswith("k.bias"):     # a zero true gradient: AdamW amplifies its rounding noise
            assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), (strategy, k)


def test_bf16_keeps_fp32_shards_and_bf16_weights(results):
    spec, strategy = BF16
    ref, _, _ = _reference(spec, STEPS, CLIP, "bf16")
    r = results[0][strategy]
    assert r["losses"] == pytest.approx(ref, rel=2e-2)
    # FSDP2 keeps its sharded layers in fp32 (the master), the distributed optimizer the rest in bf16
    assert r["kinds"] == [("DTensor", "torch.float32"), ("Parameter", "torch.bfloat16")]


def test_checkpoint_of_the_mix_resumes_under_zero3_with_tp(results):
    ref, _, _ = _reference(GPT, 4, None)
    for res in results:
        assert res["resumed"] == pytest.approx(ref, rel=1e-4)



REAL = [("nanogpt", "dp=2,tp=2,zero=1,fsdp_layers=2"), ("tv-resnet18", "dp=4,zero=2,fsdp_layers=8")]


def test_models_as_their_authors_write_them():
    """nanoGPT (torch.export, a mask buffer sliced by T) and torchvision's
    ResNet-18, whose lone BatchNorm layers of the downsampling blocks run in
    their parent under dp (synchronised): its 8 layers with weights of their
    own are the regions FSDP2 shards."""
    from benchmarks import matrix
    res = run_distributed(matrix.worker, 4, REAL, timeout=600)
    for model, strategy in REAL:
        assert matrix.check("fsdp", strategy, matrix.reference(model), [r[(model, strategy)] for r in res]) == "ok"


def test_a_model_whose_layers_share_their_weights_is_refused():
    from autopar.cost import fsdp_layer_params
    from benchmarks.real_models import CASES
    c = CASES["hf-albert"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    assert fsdp_layer_params(g) == []
    with pytest.raises(StrategyError, match="0 with weights of their own"):
        autopar.evaluate(g, cluster="dgx-a100-80g", devices=4, global_batch=4, strategy="dp=4,zero=1,fsdp_layers=1")
