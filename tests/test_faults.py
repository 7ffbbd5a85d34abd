"""Nothing hangs (issue 17): with parallelize(timeout_s=N) a rank that stalls
or dies makes every other rank raise DistributedError (naming itself and the
step) within the timeout plus a few seconds, on every mesh group (a tp
subgroup used to keep torch's 30-minute default)."""
import os
import signal
import time
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.runtime.launch import run_distributed

TIMEOUT = 2


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _run(rank, world, strategy, fault):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)]     # repeated: pp can cut
    model = nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 4))
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    pm = autopar.parallelize(model, (x,), loss_fn=_loss, example_target=t, strategy=strategy, timeout_s=TIMEOUT,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    pm.train_step((x,), t)
    t0 = time.monotonic()
    if rank == world - 1:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)     # dies without a word
        time.sleep(2 * TIMEOUT + 1)  # stalls past the timeout
    try:
        pm.train_step((x,), t)
        return "ok", time.monotonic() - t0, ""
    except autopar.DistributedError as e:
        return "DistributedError", time.monotonic() - t0, str(e)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, time.monotonic() - t0, str(e)


@pytest.mark.parametrize("strategy,world", [("dp=2,tp=2", 4)])
def test_a_stalled_rank_does_not_hold_the_others(strategy, world):
    results = run_distributed(_run, world, strategy, "stall", timeout=120)
    for rank, (what, took, msg) in enumerate(results[:-1]):
        assert what == "DistributedError", (rank, what, msg)
        assert f"rank {rank} of {world}, step 2" in msg
        assert took < TIMEOUT + 5, (rank, took)


def test_a_killed_rank_does_not_hold_the_others():
    results = run_distributed(_run, 2, "pp=2,microbatches=2", "kill", timeout=120, dead_ok=True)
    assert results[-1] is None          # SIGKILLed
    for rank, (what, took, msg) in enumerate(results[:-1]):
        assert what == "DistributedError", (rank, what, msg)
        assert took < TIMEOUT + 5, (rank, took)
