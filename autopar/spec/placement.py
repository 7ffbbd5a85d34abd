"""Placement strings: ``"R"``, ``"P"``, ``"S(d)"`` and ``"S(d,k)"`` (``k`` blocks, each sharded)."""
from __future__ import annotations

from functools import lru_cache

R = "R"
P = "P"


@lru_cache(maxsize=None)
def S(dim: int, blocks: int = 1) -> str:  # noqa: N802 - mirrors torch.distributed.tensor.Shard
    """The placement string of a shard on ``dim`` (non-negative). With
    ``blocks`` > 1 the dim is ``blocks`` equal blocks, each sharded: a rank
    holds its chunk of every block, end to end (``"S(d,k)"``; a fused q, k,
    v projection split over the heads of each; DTensor's ``_StridedShard``)."""
    return f"S({dim})" if blocks == 1 else f"S({dim},{blocks})"


def is_shard(p: str) -> bool:
    return p.startswith("S(")


@lru_cache(maxsize=None)
def shard_dim(p: str) -> int:
    """The dim of an ``S(d)`` / ``S(d,k)`` placement."""
    return int(p[2:-1].split(",")[0])


@lru_cache(maxsize=None)
def shard_blocks(p: str) -> int:
    """The blocks of an ``S(d,k)`` placement (1 for ``S(d)`` and the others)."""
    return int(p[2:-1].split(",")[1]) if is_shard(p) and "," in p else 1


def valid(p: str) -> bool:
    if p in (R, P):
        return True
    if not (is_shard(p) and p.endswith(")")):
        return False
    parts = p[2:-1].split(",")
    return len(parts) <= 2 and all(x.isdigit() for x in parts) and (len(parts) == 1 or int(parts[1]) >= 2)


def local_chunk(t, dim: int, n: int, rank: int, blocks: int = 1):
    """Rank ``rank``'s part of the whole tensor ``t`` split ``n`` ways on
    ``dim``: its chunk, or with ``blocks`` its chunk of every block, end to end."""
    if blocks == 1:
        return t.chunk(n, dim=dim)[rank]
    import torch
    return torch.cat([b.chunk(n, dim=dim)[rank] for b in t.chunk(blocks, dim=dim)], dim=dim)


def unblock(gathered, dim: int, n: int, blocks: int):
    """The whole tensor from the ``n`` ranks' parts concatenated on ``dim``
    (an all-gather of :func:`local_chunk` with ``blocks``): block by block."""
    if blocks == 1:
        return gathered
    import torch
    parts = [p.chunk(blocks, dim=dim) for p in gathered.chunk(n, dim=dim)]
    return torch.cat([parts[r][b] for b in range(blocks) for r in range(n)], dim=dim)


# -- placements on a mesh of several tensor axes (tp_mode=mesh) ---------------------------
SEP = "|"


def joint_placement(parts) -> str:
    """The mesh placement of per-axis placements (outermost first): ``S(0)|R``."""
    return SEP.join(parts)


def axis_placements(p: str, k: int) -> tuple[str, ...]:
    """The ``k`` per-axis placements of a mesh placement (a bare ``R``, as
    the graph inputs are given, is replicated on every axis)."""
    return tuple(p.split(SEP)) if SEP in p else (p,) * k


def mesh_pieces(sizes):
    """``f(mesh placement)``: how many parts a mesh of ``sizes`` cuts a
    tensor so placed in, one per rank."""
    k = len(sizes)

    def pieces(p: str) -> int:
        out = 1
        for q, n in zip(axis_placements(p, k), sizes):
            if is_shard(q):
                out *= n
        return out

    return pieces


def mesh_partial(sizes):
    """``f(mesh placement)``: whether a value so placed is a partial sum on some axis."""
    k = len(sizes)
    return lambda p: P in axis_placements(p, k)
