"""Nothing lost: checkpoints (issue 17). A checkpoint written under one plan and
world size resumes training under another with the loss trajectory of an
uninterrupted single-process run; the optimizer state (ZeRO shards, fp32
masters, FSDP2 shards) matters and is kept; writes are atomic; clear errors."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.zoo
from autopar.errors import CheckpointError
from autopar.runtime.launch import run_distributed

GPT = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64,tie=1"
K, M = 2, 2           # steps before the checkpoint, steps after it


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _mlp_batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _gpt():
    return autopar.zoo.build(GPT, device="cpu", seed=0)


def _gpt_batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return x, torch.randint(0, 64, (4, 8), generator=g)


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _nanogpt() -> nn.Module:
    """nanoGPT as its author writes it (torch.export; a fused c_attn split into q, k, v)."""
    from benchmarks.real_models import NanoGPT
    torch.manual_seed(0)
    return NanoGPT(n_layer=2)


def _nanogpt_batch(i: int):
    from benchmarks.real_models import SEQ, VOCAB
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _lm_loss(out, target):
    from benchmarks.real_models import lm_loss
    return lm_loss(out, target)


CASES = {"mlp": (_mlp, _mlp_batch, _loss, _adamw), "mlp_sgd": (_mlp, _mlp_batch, _loss, _sgd),
         "gpt": (None, _gpt_batch, None, _sgd), "nanogpt": (_nanogpt, _nanogpt_batch, _lm_loss, _sgd)}


def _case(kind):
    make, batch, loss, opt = CASES[kind]
    if kind == "gpt":
        z = _gpt()
        return z.model, batch, z.loss_fn, opt
    return make(), batch, loss, opt


def _reference(kind: str, steps: int) -> list[float]:
    """Losses of an uninterrupted single-process run."""
    model, batch, loss_fn, opt = _case(kind)
    optim = opt(list(model.parameters()))
    out = []
    for i in range(steps):
        x, t = batch(i)
        optim.zero_grad()
        loss = loss_fn(model(x), t)
        loss.backward()
        optim.step()
        out.append(loss.item())
    return out


def _parallel(kind: str, strategy: str):
    model, batch, loss_fn, opt = _case(kind)
    x, t = batch(0)
    return autopar.parallelize(model, (x,), loss_fn=loss_fn, example_target=t, strategy=strategy, optimizer=opt), batch


def _train(pm, batch, steps: range) -> list[float]:
    return [pm.train_step((batch(i)[0],), batch(i)[1]) for i in steps]


def _save(pm, batch, path) -> tuple[list[float], dict]:
    losses = _train(pm, batch, range(K))
    pm.save_checkpoint(path)
    return losses, pm.full_state_dict()


def _resume(pm, batch, path) -> list[float]:
    pm.load_checkpoint(path)
    assert pm.steps == K
    return _train(pm, batch, range(K, K + M))


def _errors(pm, calls) -> dict[str, str]:
    out = {}
    for what, call in calls.items():
        try:
            call(pm)
            out[what] = "no error"
        except CheckpointError as e:
            out[what] = str(e)
    return out


def _world4(rank, world, d):
    """dp=4,zero=1 (mlp, AdamW): save; dp=2,tp=2,zero=1 (tied gpt, momentum SGD): save, resume as pp=2,dp=2,zero=1."""
    warnings.simplefilter("ignore")
    out = {"mlp": _save(*_parallel("mlp", "dp=4,zero=1"), f"{d}/mlp")}
    out["gpt"] = _save(*_parallel("gpt", "dp=2,tp=2,zero=1"), f"{d}/gpt")
    out["gpt_resumed"] = _resume(*_parallel("gpt", "pp=2,dp=2,zero=1"), f"{d}/gpt")
    # nanoGPT's fused q, k, v projection split by blocks over tp (each rank its heads of q, k and v)
    pm, batch = _parallel("nanogpt", "dp=2,tp=2")
    out["nanogpt_blocks"] = sorted({p for n, p in pm.param_placement.items() if "c_attn" in n})
    out["nanogpt"] = _save(pm, batch, f"{d}/nanogpt")
    return out


class _FailingWriter:
    """Writes its share, then fails on rank 1 (a full disk, a lost node)."""

    def __new__(cls, path):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        class W(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                if dist.get_rank() == 1:
                    fut.wait()
                    raise OSError("No space left on device (injected)")
                return fut
        return W(path)


def _world2(rank, world, d):
    """tp=2 resumes the dp=4,zero=1 checkpoint (with and without its optimizer state);
    atomic writes; dp=2,zero=3 (momentum SGD): save, resume as dp=2, and back; errors."""
    import autopar.runtime.checkpoint as ckpt
    warnings.simplefilter("ignore")
    pm, batch = _parallel("mlp", "tp=2")
    out = {"resumed": _resume(pm, batch, f"{d}/mlp")}
    pm.optimizer.state.clear()       # a fresh optimizer, the weights of the checkpoint
    pm.load_checkpoint(f"{d}/mlp", optimizer=False)
    out["no_optimizer_state"] = _train(pm, batch, range(K, K + M))
    # atomic: a save that fails midway (on one rank) leaves the previous checkpoint whole
    pm.save_checkpoint(f"{d}/atomic")
    before = pm.full_state_dict()
    _train(pm, batch, range(1))
    writer, ckpt.storage_writer = ckpt.storage_writer, _FailingWriter
    out["failed_save"] = _errors(pm, {"save": lambda pm: pm.save_checkpoint(f"{d}/atomic")})["save"]
    ckpt.storage_writer = writer
    pm.load_checkpoint(f"{d}/atomic")
    after = pm.full_state_dict()
    out["atomic"] = all(torch.equal(before[k], after[k]) for k in before)
    # ZeRO-3 (FSDP2) -> plain dp
    zero3, batch = _parallel("mlp_sgd", "dp=2,zero=3")
    out["zero3"] = _save(zero3, batch, f"{d}/zero3")
    pm, batch = _parallel("mlp_sgd", "dp=2")
    out["zero3_resumed"] = _resume(pm, batch, f"{d}/zero3")
    # and back: ZeRO-3 loads what plain dp wrote
    pm.save_checkpoint(f"{d}/dp")
    zero3.load_checkpoint(f"{d}/dp")
    out["zero3_loaded"] = _train(zero3, batch, range(K + M, K + M + 1))
    # nanoGPT saved under dp=2,tp=2 with its fused projection split by blocks, resumed without tp
    nano, nano_batch = _parallel("nanogpt", "dp=2")
    out["nanogpt_resumed"] = _resume(nano, nano_batch, f"{d}/nanogpt")
    # and back: tp=2 cuts the blocked shards out of what plain dp wrote
    nano.save_checkpoint(f"{d}/nanogpt-dp")
    nano, nano_batch = _parallel("nanogpt", "tp=2")
    nano.load_checkpoint(f"{d}/nanogpt-dp")
    out["nanogpt_tp_loaded"] = _train(nano, nano_batch, range(K + M, K + M + 1))
    out["errors"] = _errors(pm, {
        "missing": lambda pm: pm.load_checkpoint(f"{d}/nothing"),
        "other model": lambda pm: pm.load_checkpoint(f"{d}/gpt"),
        "other optimizer": lambda pm: pm.load_checkpoint(f"{d}/mlp"),
        "weights only": lambda pm: pm.load_checkpoint(f"{d}/mlp", optimizer=False),
    })
    return out


def _close(a, b, tol=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt"))
    w4 = run_distributed(_world4, 4, d, timeout=300)
    w2 = run_distributed(_world2, 2, d, timeout=300)
    return d, w4, w2


def test_zero1_on_4_resumes_as_tp_on_2(runs):
    d, w4, w2 = runs
    ref = _reference("mlp", K + M)
    assert _close(w4[0]["mlp"][0], ref[:K])
    for r in w2:
        assert _close(r["resumed"], ref[K:]), (r["resumed"], ref)
        # the optimizer state matters: without it the trajectory differs
        assert not _close(r["no_optimizer_state"], ref[K:], tol=1e-3)


def test_dp_tp_resumes_as_pipeline_with_tied_weights(runs):
    d, w4, _ = runs
    ref = _reference("gpt", K + M)
    for r in w4:
        assert _close(r["gpt"][0], ref[:K]) and _close(r["gpt_resumed"], ref[K:]), (r["gpt"][0], r["gpt_resumed"], ref)


def test_blocked_tp_shards_resume_without_tp(runs):
    """nanoGPT's c_attn (weight and bias) held as S(0,3) under tp=2 (each rank its chunk of q, of k
    and of v: head-parallel attention), checkpointed with its momentum, resumed under dp=2 without
    tp, and that saved again and loaded under tp=2 (the blocked shards cut out of whole tensors):
    the uninterrupted single-process trajectory, and whole weights equal to one process's."""
    d, w4, w2 = runs
    ref = _reference("nanogpt", K + M + 1)
    assert w4[0]["nanogpt_blocks"] == ["S(0,3)"]
    for r in w4:
        assert _close(r["nanogpt"][0], ref[:K]), (r["nanogpt"][0], ref)
    for r in w2:
        assert _close(r["nanogpt_resumed"], ref[K:K + M]), (r["nanogpt_resumed"], ref)
        assert _close(r["nanogpt_tp_loaded"], ref[K + M:]), (r["nanogpt_tp_loaded"], ref)
    model, batch, loss_fn, opt = _case("nanogpt")
    optim = opt(list(model.parameters()))
    for i in range(K):
        optim.zero_grad()
        loss_fn(model(batch(i)[0]), batch(i)[1]).backward()
        optim.step()
    full = w4[0]["nanogpt"][1]
    for k, v in model.state_dict().items():
        assert torch.allclose(full[k], v, rtol=1e-4, atol=1e-6), k


def test_zero3_resumes_as_dp_and_back(runs):
    d, _, w2 = runs
    ref = _reference("mlp_sgd", K + M + 1)
    for r in w2:
        assert _close(r["zero3"][0], ref[:K]) and _close(r["zero3_resumed"], ref[K:K + M]), (r["zero3"], ref)
        assert _close(r["zero3_loaded"], ref[K + M:]), (r["zero3_loaded"], ref)


def test_load_full_state_dict_is_the_plain_models(runs):
    d, w4, _ = runs
    full = w4[0]["mlp"][1]
    weights = autopar.load_full_state_dict(f"{d}/mlp")
    assert weights.keys() == full.keys() and all(torch.equal(weights[k], full[k]) for k in full)
    _mlp().load_state_dict(weights)
    _, optim = autopar.load_full_state_dict(f"{d}/mlp", optimizer=True)
    assert set(optim["state"]) == set(full)
    assert set(optim["state"]["0.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    assert optim["state"]["0.weight"]["exp_avg"].shape == full["0.weight"].shape
    assert optim["state"]["0.weight"]["step"] == K
    assert optim["param_groups"][0]["lr"] == 1e-2 and set(optim["param_groups"][0]["params"]) == set(full)
    # tied weights: both names, one tensor
    gpt = autopar.load_full_state_dict(f"{d}/gpt")
    assert torch.equal(gpt["wte.weight"], gpt["lm_head.weight"]) and gpt.keys() == _gpt().model.state_dict().keys()


def test_a_failed_save_leaves_the_previous_checkpoint(runs):
    d, _, w2 = runs
    for r in w2:
        assert "rank 1: OSError: No space left on device" in r["failed_save"], r["failed_save"]
        assert "unchanged" in r["failed_save"]
        assert r["atomic"]


def test_checkpoint_errors(runs, tmp_path):
    d, _, w2 = runs
    for r in w2:
        e = r["errors"]
        assert "no checkpoint" in e["missing"] and "does not exist" in e["missing"]
        assert "another model" in e["other model"] or "fingerprint" in e["other model"], e["other model"]
        assert "AdamW" in e["other optimizer"] and "optimizer=False" in e["other optimizer"]
        assert e["weights only"] == "no error"
    with pytest.raises(CheckpointError, match="does not exist"):
        autopar.load_full_state_dict(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no autopar checkpoint"):
        autopar.load_full_state_dict(tmp_path / "empty")


def test_fp16_keeps_the_fp32_masters_the_loss_scale_and_the_lr_schedule(tmp_path):
    x, t = _mlp_batch(0)
    pm = autopar.parallelize(_mlp(), (x,), loss_fn=_loss, example_target=t, strategy="dp=1,precision=fp16",
                             optimizer=_adamw, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    _train(pm, _mlp_batch, range(K))
    dopt = pm.dist_optimizer
    dopt.loss_scale = 1024.0
    pm.save_checkpoint(tmp_path / "c")
    master, state = dopt.master.clone(), dopt.optimizer.state[dopt.master]["exp_avg"].clone()
    # the checkpoint holds the fp32 masters, not their fp16 copies
    weights = autopar.load_full_state_dict(tmp_path / "c")
    assert any(not torch.equal(w, w.half().float()) for w in weights.values())
    _train(pm, _mlp_batch, range(K, K + 1))
    dopt.loss_scale = 2.0
    pm.load_checkpoint(tmp_path / "c")
    assert torch.equal(dopt.master, master) and torch.equal(dopt.optimizer.state[dopt.master]["exp_avg"], state)
    assert dopt.loss_scale == 1024.0 and pm.steps == K
    assert pm.lr_scheduler.last_epoch == K and pm.lr_scheduler.get_last_lr() == [1e-2 * 0.5 ** K]
    assert dopt.optimizer.param_groups[0]["lr"] == 1e-2 * 0.5 ** K
    assert torch.equal(dopt._pbuf, master.half())       # the fp16 parameters: rounded masters
