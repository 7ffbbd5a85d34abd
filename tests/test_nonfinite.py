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
