"""Placement strings: ``"R"``, ``"P"``, ``"S(d)"``."""
from __future__ import annotations

from functools import lru_cache

R = "R"
P = "P"


@lru_cache(maxsize=None)
def S(dim: int) -> str:  # noqa: N802 - mirrors torch.distributed.tensor.Shard
    """The placement string of a shard on ``dim`` (non-negative)."""
    return f"S({dim})"


def is_shard(p: str) -> bool:
    return p.startswith("S(")


@lru_cache(maxsize=None)
def shard_dim(p: str) -> int:
    """The dim of an ``S(d)`` placement."""
    return int(p[2:-1])


def valid(p: str) -> bool:
    return p in (R, P) or (is_shard(p) and p[2:-1].isdigit())
