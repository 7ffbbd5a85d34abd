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
        assert f"rank {world - 1} never reached step 2" in msg, msg     # the survivors name the culprit
        assert took < TIMEOUT + 5, (rank, took)


def test_a_killed_rank_does_not_hold_the_others():
    results = run_distributed(_run, 2, "pp=2,microbatches=2", "kill", timeout=120, dead_ok=True)
    assert results[-1] is None          # SIGKILLed
    for rank, (what, took, msg) in enumerate(results[:-1]):
        assert what == "DistributedError", (rank, what, msg)
        assert "rank 1 never reached step 2 (stalled or killed)" in msg, msg
        assert took < TIMEOUT + 5, (rank, took)


def test_a_rank_that_raises_is_named_by_the_others():
    """The failed rank leaves one line on the store; a survivor's error quotes it."""
    import torch.distributed as dist

    from autopar.runtime.faults import FaultBoard
    store = dist.HashStore()
    boards = [FaultBoard(r, 3, store) for r in range(3)]
    for b in boards:
        b.start_step(1)
    assert boards[0].explain(1) == ""                   # nobody failed, nobody behind
    try:
        raise ValueError("token id 50304 is out of range\nsecond line")
    except ValueError as e:
        boards[2].record(e, step=1)
    msg = boards[0].explain(1)
    assert msg.startswith("rank 2 raised ValueError at test_faults.py:"), msg
    assert msg.endswith("step 1: token id 50304 is out of range"), msg
    try:
        raise KeyError("later")
    except KeyError as e:
        boards[1].record(e)                              # the first error of the job wins
    assert boards[0].explain(1) == msg


def test_ranks_behind_are_named_and_a_lost_store_says_nothing():
    import torch.distributed as dist

    from autopar.runtime.faults import FaultBoard
    store = dist.HashStore()
    boards = [FaultBoard(r, 4, store) for r in range(4)]
    for b in boards:
        b.start_step(1)
    for b in boards[:2]:
        b.start_step(2)
    assert boards[0].explain(2) == "ranks 2, 3 never reached step 2 (stalled or killed)"

    class Dead:
        def __getattr__(self, name):
            def fail(*a):
                raise RuntimeError("Connection refused")
            return fail
    assert FaultBoard(0, 4, Dead()).explain(2) == ""     # rank 0 hosted the store and died


def test_a_survivors_error_prints_as_one_line(capsys, monkeypatch):
    import sys

    from autopar.runtime import faults
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(faults, "_board", None)
    faults.activate(faults.FaultBoard(0, 1, store=None))
    err = autopar.DistributedError("rank 0 of 2, step 2: a collective failed after 2.0 s (x); rank 1 raised ...")
    err.one_line = True
    sys.excepthook(type(err), err, None)
    assert capsys.readouterr().err == f"autopar: {err}\n"
    monkeypatch.setenv("AUTOPAR_TRACEBACK", "1")
    sys.excepthook(type(err), err, None)
    assert capsys.readouterr().err.startswith("autopar.errors.DistributedError: rank 0 of 2")   # Python's own
