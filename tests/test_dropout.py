"""Dropout under tensor parallelism: the ranks of a tensor-parallel group
must drop a value they hold replicated alike.

Before: the program drew from each process's own generator, so ranks seeded
apart (``torch.manual_seed(seed + rank)``, as many training scripts do) dropped
a replicated value differently: the group's copies of it parted, and
``train_step``, documented to return one loss on every rank, returned two.
Now ``parallelize`` agrees on a seed (rank 0's draw, broadcast) where the
program draws random numbers and ``tp > 1``; each step runs on a stream seeded
by it, the step and the rank's data replica, and the caller's generators are
restored afterwards; an op whose output the group splits (dropout of a
column-parallel layer's output) runs on a stream of the rank's own, seeded from
the shared one, as Megatron's model-parallel generator does.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.compile.fx_utils import random_ops
from distributed import run_distributed


class _Masks(TorchDispatchMode):
    """Records every dropout mask drawn (``bernoulli_``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "bernoulli" in str(func):
            self.masks.append(out.detach().clone())
        return out


class _Head(nn.Module):
    """A Megatron MLP: its hidden layer dropped split over tp (pinned ``S(1)``), its reduced
    (row-parallel) output dropped replicated (pinned ``R``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 6)
        self.drop_hidden, self.drop = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.out(self.drop_hidden(F.gelu(self.inp(x)))))


def _worker(rank: int, world: int, strategy: str) -> dict:
    import warnings
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, x, y = _Head(), torch.randn(4, 6), torch.randn(4, 6)
    pm = autopar.parallelize(model, (x,), loss_fn=F.mse_loss, example_target=y, strategy=strategy,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                             shardings={"drop": "R", "drop_hidden": "S(1)"} if "tp" in strategy else None)
    torch.manual_seed(100 + rank)       # ranks seeded apart, as many training scripts do
    rec = _Masks()
    with rec:
        losses = [pm.train_step((x,), y) for _ in range(2)]
    return {"masks": rec.masks, "losses": losses, "next": torch.rand(3), "seed": pm.rng_seed,
            "placement": {k: v for k, v in pm.param_placement.items()}}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {st: run_distributed(_worker, 2, st, timeout=300) for st in ("tp=2", "dp=2")}


def test_tensor_parallel_ranks_drop_a_replicated_value_alike(runs):
    r0, r1 = runs["tp=2"]
    assert any(p != "R" for p in r0["placement"].values()), "nothing split: not a tensor-parallel run"
    assert r0["seed"] is not None and r0["seed"] == r1["seed"]
    whole = [(a, b) for a, b in zip(r0["masks"], r1["masks"]) if a.shape == (4, 6)]
    assert len(whole) == 2                                      # one a step, whole on each rank
    assert all(torch.equal(a, b) for a, b in whole)
    assert not torch.equal(whole[0][0], whole[1][0])            # a new mask every step
    assert 0 < float(whole[0][0].mean()) < 1                    # dropout is on
    assert r0["losses"] == r1["losses"]                         # one loss, as train_step promises


def test_each_shard_of_a_split_value_draws_its_own_mask(runs):
    """As Megatron's model-parallel generator: the halves of the hidden layer were dropped with one
    pattern repeated (each rank drew from the same stream) before a split op ran on a rank's own."""
    r0, r1 = runs["tp=2"]
    split = [(a, b) for a, b in zip(r0["masks"], r1["masks"]) if a.shape == (4, 4)]
    assert len(split) == 2
    assert not any(torch.equal(a, b) for a, b in split)


def test_the_callers_generator_is_left_as_it_was(runs):
    for rank, r in enumerate(runs["tp=2"]):
        torch.manual_seed(100 + rank)
        assert torch.equal(r["next"], torch.rand(3))


def test_data_parallel_replicas_draw_as_the_caller_seeded_them(runs):
    """Without tp the program's draws are left to the caller's generator (each replica's own samples)."""
    r0, r1 = runs["dp=2"]
    assert r0["seed"] is None
    assert not torch.equal(r0["masks"][0], r1["masks"][0])


class _Drops(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(4, 4), nn.Dropout(p)

    def forward(self, x):
        return F.dropout(self.drop(self.lin(x)), 0.0) + self.lin(x)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_random_ops_are_found(frontend):
    x = torch.randn(2, 4)
    assert random_ops(autopar.trace(_Drops(0.0), (x,), frontend=frontend).gm) == []     # p = 0 draws nothing
    assert len(random_ops(autopar.trace(_Drops(0.3), (x,), frontend=frontend).gm)) == 1


def test_attention_dropout_is_found():
    class Attn(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=self.p, is_causal=True)

    q = torch.randn(2, 2, 8, 4)
    assert random_ops(autopar.trace(Attn(0.0), (q,), frontend="export").gm) == []
    assert len(random_ops(autopar.trace(Attn(0.1), (q,), frontend="export").gm)) == 1
