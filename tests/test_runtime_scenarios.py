"""Runtime behaviours checked against one process, all in one spawn of 4 gloo
processes (each scenario parallelizes its own model on the same world; one
spawn instead of five keeps the suite inside its time budget):

* in-place ops rewritten out of place train like eager (issue 17);
* a NaN loss raises NonFiniteLossError naming the step on every rank, or is
  skipped with on_nonfinite="skip", the weights untouched either way (issue 17);
* lr_scheduler steps with the updates (issue 18);
* keyword batches (model(**batch), labels in the batch) train and evaluate
  like one process (issue 18);
* gradient clipping (max_grad_norm) gives one process's norms and losses under
  tp replicas, ZeRO-1 shards, FSDP2 and weights tied across pipeline stages (issue 18);
* windows padded by an amount computed from the shape (timm's Swin) train like
  one process under dp x tp (the batch analysis lost the batch at the pad, and
  the window view then took the whole batch's size).
"""
import torch.nn.functional as F
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import NonFiniteLossError
from autopar.runtime.launch import run_distributed

transformers = pytest.importorskip("transformers")


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1)


# ----------------------------------------------------------------------------- scenarios
def inplace_model():
    from test_inplace import InPlace
    torch.manual_seed(0)
    return InPlace(), torch.randn(8, 8), torch.randn(8, 4)


def _inplace(strategy):
    m, x, t = inplace_model()
    ref = _mse(m(x), t).item()
    pm = autopar.parallelize(m, (x,), loss_fn=_mse, example_target=t, optimizer=_sgd, strategy=strategy)
    return ref, pm.train_step((x,), t)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 8), torch.randn(8, 4)


def _nonfinite(strategy):
    model, x, t = _mlp()
    pm = autopar.parallelize(model, (x,), loss_fn=_mse, example_target=t, strategy=strategy, optimizer=_sgd)
    pm.train_step((x,), t)
    bad = x.clone()
    bad[0, 0] = float("nan")     # one sample on one data-parallel rank: every rank must agree
    out = {}
    for mode in ("raise", "skip"):
        pm.on_nonfinite = mode
        before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        try:
            loss = pm.train_step((bad,), t)
            outcome = ("skipped", loss != loss, pm.skipped_steps)
        except NonFiniteLossError as e:
            outcome = ("raised", str(e))
        after = pm.full_state_dict()
        out[mode] = (outcome, all(torch.equal(before[k], after[k]) for k in before))
    out["next"] = pm.train_step((x,), t)      # and training goes on
    return out


def _eager_losses(model, x, t, sched=None, steps=3):
    """``steps`` SGD steps of ``model`` in this process (``sched``: an lr
    scheduler factory, stepped after each): the losses."""
    opt = _sgd(model.parameters())
    sched = sched(opt) if sched else None
    want = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _mse(model(x), t)
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        want.append(loss.item())
    return want


def _scheduler(strategy):
    model, x, t = _mlp()
    ref, _, _ = _mlp()
    want = _eager_losses(ref, x, t, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    pm = autopar.parallelize(model, (x,), loss_fn=_mse, example_target=t, strategy=strategy, optimizer=_sgd,
                             lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    return want, [pm.train_step((x,), t) for _ in range(3)], pm.optimizer.param_groups[0]["lr"]


def _keyword(strategy):
    from test_keyword_batches import _bert
    model, batch = _bert()
    ref_model, _ = _bert()
    first = ref_model(**batch).loss.item()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = []
    for _ in range(2):
        opt.zero_grad()
        loss = ref_model(**batch).loss
        loss.backward()
        opt.step()
        ref.append(loss.item())
    pm = autopar.parallelize(model, batch, loss_fn="labels", strategy=strategy, optimizer=_sgd)
    before = pm.full_state_dict()
    evaluated = pm.eval_step(batch)
    after = pm.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"first": first, "eval": evaluated, "unchanged": unchanged, "ref": ref,
            "got": [pm.train_step(batch) for _ in range(2)], "keys": pm.input_keys}


CLIP_GPT = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64,tie=1"
# tp replicas counted once on ZeRO-1's flat shards; FSDP2's shards; a head tied across pipeline stages
# (plain, unflattened grads) with tp replicas
CLIP_STRATEGIES = ["dp=2,tp=2,zero=1", "dp=4,zero=3", "pp=2,tp=2,microbatches=2"]


def _clip(strategies):
    from test_parallel import _data
    z, x, y = _data(CLIP_GPT)
    opt = torch.optim.SGD(z.model.parameters(), lr=0.1)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = z.loss_fn(z.model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(z.model.parameters(), 0.05)
        opt.step()
        want.append((loss.item(), norm.item()))
    got = {}
    for strategy in strategies:
        z, x, y = _data(CLIP_GPT)
        pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y, strategy=strategy,
                                 optimizer=_sgd, max_grad_norm=0.05)
        got[strategy] = [(pm.train_step((x,), y), pm.grad_norm) for _ in range(3)]
    return want, got


class WindowPad(nn.Module):
    """timm's Swin window partition: pad H and W up to whole windows by an
    amount read off the shape, view the windows, attend within each, unpad."""

    def __init__(self, c: int = 8, win: int = 4):
        super().__init__()
        self.win, self.proj, self.head = win, nn.Linear(c, c), nn.Linear(c, 4)

    def forward(self, x):                               # x [B, H, W, C]
        B, H, W, C = x.shape
        w = self.win
        x = F.pad(self.proj(x), (0, 0, 0, (w - W % w) % w, 0, (w - H % w) % w))
        _, Hp, Wp, _ = x.shape
        win = x.view(B, Hp // w, w, Wp // w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, C)
        win = torch.softmax(win @ win.transpose(1, 2), dim=-1) @ win
        x = win.view(B, Hp // w, Wp // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)
        return self.head(x[:, :H, :W, :].mean(dim=(1, 2)))


def _window_pad(strategy):
    torch.manual_seed(0)
    m, x, t = WindowPad(), torch.randn(8, 6, 6, 8), torch.randn(8, 4)
    ref_m = WindowPad()
    ref_m.load_state_dict(m.state_dict())
    want = _eager_losses(ref_m, x, t)
    pm = autopar.parallelize(m, (x,), loss_fn=_mse, example_target=t, optimizer=_sgd, strategy=strategy)
    return want, [pm.train_step((x,), t) for _ in range(3)]


SCENARIOS = {"window_pad": (_window_pad, "dp=2,tp=2"), "inplace": (_inplace, "dp=2,tp=2"),
             "nonfinite": (_nonfinite, "dp=2,tp=2"), "scheduler": (_scheduler, "dp=4,zero=1"),
             "keyword": (_keyword, "dp=2,tp=2"), "clip": (_clip, CLIP_STRATEGIES)}


def _worker(rank, world):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))      # the scenario models live in the test modules
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    return {name: fn(strategy) for name, (fn, strategy) in SCENARIOS.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=600)


def test_inplace_model_trains_like_one_process(results):
    for r in results:
        ref, got = r["inplace"]
        assert got == pytest.approx(ref, rel=1e-6)


def test_nonfinite_loss_raises_or_skips_on_every_rank(results):
    for r in results:
        outcome, same = r["nonfinite"]["raise"]
        assert outcome[0] == "raised" and "step 2" in outcome[1] and "nan" in outcome[1]
        assert same
        assert r["nonfinite"]["skip"] == (("skipped", True, 1), True)
        assert r["nonfinite"]["next"] == r["nonfinite"]["next"]


def test_lr_scheduler_steps_with_the_updates(results):
    for r in results:
        want, got, lr = r["scheduler"]
        assert got == pytest.approx(want, rel=1e-5) and lr == pytest.approx(0.1 * 0.5 ** 3)


def test_keyword_batch_trains_and_evaluates_like_one_process(results):
    for r in results:
        k = r["keyword"]
        assert k["eval"] == pytest.approx(k["first"], rel=1e-5) and k["unchanged"]
        assert k["got"] == pytest.approx(k["ref"], rel=1e-5)
        assert k["keys"] == ("input_ids", "attention_mask")      # labels became the target


def test_gradient_clipping_matches_one_process(results):
    for r in results:
        want, got = r["clip"]
        assert want[0][1] > 0.05 * 2           # the clipping is active
        for strategy, steps in got.items():
            assert [s[0] for s in steps] == pytest.approx([w[0] for w in want], rel=1e-4), strategy
            assert [s[1] for s in steps] == pytest.approx([w[1] for w in want], rel=1e-4), strategy


def test_windows_padded_by_a_computed_amount_train_like_one_process(results):
    for r in results:
        want, got = r["window_pad"]
        assert got == pytest.approx(want, rel=1e-5)
