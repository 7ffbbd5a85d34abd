"""A NaN / inf loss never trains on silently (issue 17): every rank raises
NonFiniteLossError naming the step, or skips the step with on_nonfinite="skip";
the weights are those before the step either way."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import NonFiniteLossError, StrategyError
from autopar.runtime.launch import run_distributed


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _run(rank, world, strategy):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    pm = autopar.parallelize(model, (x,), loss_fn=_loss, example_target=t, strategy=strategy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
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


def test_nonfinite_loss_raises_or_skips_on_every_rank():
    for res in run_distributed(_run, 4, "dp=2,tp=2"):
        (outcome, same) = res["raise"]
        assert outcome[0] == "raised" and "step 2" in outcome[1] and "nan" in outcome[1]
        assert same
        assert res["skip"] == (("skipped", True, 1), True)
        assert res["next"] == res["next"]


def test_on_nonfinite_is_checked():
    with pytest.raises(StrategyError, match="on_nonfinite"):
        autopar.parallelize(nn.Linear(2, 2), (torch.randn(2, 2),), loss_fn=_loss, on_nonfinite="ignore")


def _sched(rank, world, strategy):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = _loss(ref(x), t)
        loss.backward()
        opt.step()
        sched.step()
        want.append(loss.item())
    pm = autopar.parallelize(model, (x,), loss_fn=_loss, example_target=t, strategy=strategy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    return want, [pm.train_step((x,), t) for _ in range(3)], pm.optimizer.param_groups[0]["lr"]


def test_lr_scheduler_steps_with_the_updates():
    for want, got, lr in run_distributed(_sched, 2, "dp=2,zero=1"):
        assert got == pytest.approx(want, rel=1e-5) and lr == pytest.approx(0.1 * 0.5 ** 3)
