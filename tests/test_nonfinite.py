"""A NaN / inf loss never trains on silently (issue 17): every rank raises
NonFiniteLossError naming the step, or skips the step with on_nonfinite="skip";
the weights are those before the step either way."""
import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import StrategyError


def _loss(out, target):
    return ((out - target) ** 2).mean()


def test_on_nonfinite_is_checked():
    with pytest.raises(StrategyError, match="on_nonfinite"):
        autopar.parallelize(nn.Linear(2, 2), (torch.randn(2, 2),), loss_fn=_loss, on_nonfinite="ignore")

# the distributed runs (raise / skip on every rank, lr_scheduler) are in test_runtime_scenarios.py


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_max_grad_norm_is_checked(bad):
    with pytest.raises(StrategyError, match="max_grad_norm"):
        autopar.parallelize(nn.Linear(2, 2), (torch.randn(2, 2),), loss_fn=_loss, max_grad_norm=bad)


def test_clip_grad_norm_counts_replicas_once():
    """One process: weights 1/copies make a replicated piece count once, and the scale is torch's."""
    from autopar.runtime.optim import clip_grad_norm_
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_grad_norm_([(a, 1.0), (b, 0.5), (b, 0.5)], [a, b], 1.0)
    assert norm == pytest.approx(5.0)
    assert torch.allclose(a, torch.tensor([0.6, 0.0]), atol=1e-6) and torch.allclose(b, torch.tensor([0.8]), atol=1e-6)
