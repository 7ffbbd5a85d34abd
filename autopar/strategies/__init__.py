"""Candidate shardings per op family.

A placement on one mesh axis is a string, as in ``torch.distributed.tensor``:
``"R"`` (Replicate: every rank holds the whole tensor), ``"S(d)"`` (Shard:
each rank holds its contiguous chunk of dim ``d``) or ``"P"`` (Partial: each
rank holds a summand of the true value).

:func:`candidates` returns, for one node and the size of one mesh axis, the
valid :class:`Strategy` objects: the placement each tensor input must have,
the placement of the output, whether the work is divided over the axis, and
any communication the op needs inside (vocabulary-parallel cross-entropy).
The rules live in :mod:`autopar.strategies.rules`, one small function per op
family; an op without a rule is replicated (with a warning naming it).
"""
from ..spec.placement import P, R, S, is_shard, shard_dim
from .rules import Strategy, candidates, has_rule

__all__ = ["Strategy", "candidates", "has_rule", "R", "P", "S", "is_shard", "shard_dim"]
