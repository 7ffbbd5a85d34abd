"""Vision models (issue 15, item 3): torchvision's ResNet and a timm ViT, as
zoo strings (``tv-resnet18``, ``tv-resnet50``, ``timm-vit``), trace, plan at
full size on the meta device, and run dp, tp, pp and ZeRO-3 with the numerics
of one process (fp32: every step's loss within a relative 1e-4, the final
weights ``rtol 1e-4, atol 1e-5``).

BatchNorm in training mode: under data parallelism the compiler takes the
statistics over the whole dp group (synchronised batch norm), so dp equals one
process on the global batch; with several microbatches (a pipeline) the
statistics are each microbatch's, and the reference accumulates the same
microbatches in one process (``benchmarks.matrix.split_of``).

Skipped, saying why, where torchvision or timm is missing or fails to import
(``make`` installs both; see :mod:`autopar.zoo.vision` for the workaround
beside the CPU wheel). One spawn of 2 gloo processes at tiny sizes; ResNet-50
and every strategy family are in ``make matrix``.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

from autopar import parse_strategy, zoo
from autopar.errors import ZooError
from autopar.zoo import vision

try:
    vision.torchvision()
    vision.timm()
except ZooError as e:
    pytest.skip(f"vision tests skipped: {e}", allow_module_level=True)

from benchmarks import matrix  # noqa: E402
from distributed import run_distributed  # noqa: E402

# 64x64 images, batch 8: at 32x32 and batch 4 layer4's BatchNorm normalises 2-4 values per channel
# (1x1 maps), and rounding noise of 1e-7 grows past 1e-4 in two steps even between two one-process runs
RESNET = "tv-resnet18:num_classes=10,image=64"
VIT = "timm-vit:arch=vit_tiny_patch16_224,img_size=32,patch_size=8,num_classes=10,depth=2,embed_dim=64,num_heads=4"
# SGD lr: ResNet's BatchNorm over few samples makes larger steps chaotic (rounding noise grows)
LR = {RESNET: 1e-3, VIT: 0.05}
BATCH, STEPS = 8, 2
# dp runs as ZeRO-3 (FSDP2 over the dp group: synchronised BatchNorm and the sharded weights at once);
# plain dp, pipelines of ViT and ResNet-50 are in `make matrix`
RUNS = [(RESNET, "dp=2,zero=3"), (RESNET, "tp=2"), (RESNET, "pp=2,microbatches=2"),
        (VIT, "tp=2"), (VIT, "dp=2,zero=3")]


def _case(spec: str):
    z = zoo.build(spec, device="cpu", batch=BATCH)
    z.inputs, z.target = z.example_inputs, z.example_target    # as benchmarks.matrix.microbatches reads them
    return z


def _sgd(spec: str):
    return functools.partial(torch.optim.SGD, lr=LR[spec], momentum=0.9)


def _worker(rank: int, world: int, runs: list[tuple[str, str]]) -> dict:
    import autopar
    out = {}
    for spec, strategy in runs:
        z = _case(spec)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = autopar.parallelize(z.model, z.inputs, loss_fn=z.loss_fn, example_target=z.target,
                                     optimizer=_sgd(spec), strategy=strategy)
        losses = [pm.train_step(z.inputs, z.target) for _ in range(STEPS)]
        state = pm.full_state_dict()        # a collective: every rank gathers
        out[(spec, strategy)] = {
            "losses": losses, "state": state if rank == 0 else None,
            "local": sum(p.numel() for p in pm.parameters()), "full": sum(p.numel() for p in z.model.parameters()),
            "warnings": [str(w.message).splitlines()[0] for w in caught if "replicated" in str(w.message)]}
    return out


def _reference(spec: str, strategy: str) -> tuple[list[float], dict]:
    z = _case(spec)
    opt = _sgd(spec)(list(z.model.parameters()))
    cfg = parse_strategy(strategy)      # BatchNorm: the runtime's microbatches, as one process accumulates them
    mbs = matrix.microbatches(z, (cfg.dp, cfg.microbatches) if spec == RESNET else (1, 1))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.zeros(())
        for x, t in mbs:
            part = z.loss_fn(z.model(*x), t) / len(mbs)
            part.backward()
            loss += part.detach()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in z.model.state_dict().items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, RUNS, timeout=600)


@pytest.mark.parametrize("spec,strategy", RUNS, ids=[f"{s.split(':')[0]}-{t}" for s, t in RUNS])
def test_vision_model_matches_one_process(results, spec, strategy):
    ref_losses, ref_state = _reference(spec, strategy)
    for rank, res in enumerate(results):
        got = res[(spec, strategy)]["losses"]
        assert got == pytest.approx(ref_losses, rel=1e-4), (rank, got, ref_losses)
    r0 = results[0][(spec, strategy)]
    state = r0["state"]
    for k, v in ref_state.items():
        if v.is_floating_point():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    if "tp=" in strategy:
        assert r0["local"] < r0["full"], "tensor parallelism left every weight whole"
    # at most one warning line per op kind that runs replicated
    assert len(r0["warnings"]) == len(set(r0["warnings"])), r0["warnings"]


def test_zoo_strings_build_on_meta_and_plan_at_full_size():
    import autopar
    r50 = zoo.build("tv-resnet50")
    assert sum(p.numel() for p in r50.model.parameters()) == pytest.approx(25.56e6, rel=0.01)
    assert r50.example_inputs[0].is_meta and zoo.build(r50.name).name == r50.name
    vit = zoo.build("timm-vit", batch=3)
    assert sum(p.numel() for p in vit.model.parameters()) == pytest.approx(86.57e6, rel=0.01)
    assert vit.example_inputs[0].shape == (3, 3, 224, 224)
    g = autopar.trace("tv-resnet50")
    assert g.frontend == "fx" and max(len(gr.instances) for gr in g.groups) == 5   # layer3's bottlenecks
    plan = autopar.plan("timm-vit", cluster="dgx-a100-80g", devices=8, global_batch=256)
    assert plan.config.devices == 8
    for strategy in ("dp=4,tp=2", "pp=2,dp=4,microbatches=4", "dp=8,zero=3"):
        est = autopar.evaluate("tv-resnet50", strategy=strategy, devices=8, cluster="dgx-a100-80g",
                               global_batch=256)
        assert est.fits and est.step_time_s > 0


def test_bad_vision_strings():
    with pytest.raises(ZooError, match="unknown key 'layers' for tv-resnet18"):
        zoo.build("tv-resnet18:layers=3")
    with pytest.raises(ZooError, match="patch_size=5 does not divide img_size=32"):
        zoo.build("timm-vit:img_size=32,patch_size=5")
    with pytest.raises(ZooError, match="timm.create_model"):
        zoo.build("timm-vit:arch=no_such_vit")


def test_torchvision_shim_keeps_transformers_working():
    """Where torchvision's C extension cannot load (the CPU wheel), the shim leaves its
    meta registrations empty; transformers, which imports torchvision, still builds models."""
    transformers = pytest.importorskip("transformers")
    if vision.SHIM_REASON is not None:
        assert "torchvision::" in vision.SHIM_REASON
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    assert transformers.GPT2LMHeadModel(cfg)(torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 16)
