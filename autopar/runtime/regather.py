"""Keep the shard, gather again in backward: the sequence-parallel entry's memory, as Megatron has it.

Under sequence parallelism the input of each column-parallel linear is
all-gathered along the sequence (``all_gather_reduce_grad``) and the linear
saves its input for the weight's gradient: autograd would keep the gathered
tensor, ``tp`` times this rank's shard. Megatron keeps the shard and gathers
it again in backward (Korthikanti et al. 2022, section 4.2.2). So do we:
``all_gather_reduce_grad`` registers its output here, and while
:func:`scope` is active (around each forward of the compiled program) a
tensor saved for backward that is that output, or a view of it, is packed as
the shard plus the view's geometry; unpacking gathers the shard again. The
readers of one gathered tensor (q, k and v projections) share one gather in
backward: it is kept until the last of them has unpacked it.

A value changed in place after the gather is saved as usual (its version
counter moved). The cost model counts the shard as what the reader keeps and
charges the second gather in the redistribution table
(:mod:`autopar.strategies.redistribute`: the entry's backward is a
reduce-scatter and an all-gather). Inside layers checkpointed by recompute
(full or selective) no reader keeps the value in this scope (the checkpoint's own hooks
are innermost): the gather replays with the layer, and the cost model charges
no regather there. Multi-copy's
asynchronous collectives (``start`` / ``finish``) register alike.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

_registry: dict[int, tuple[weakref.ref, "_Gathered"]] = {}   # storage address -> (gathered tensor, how)
regathers = 0      # gathers run again in backward (read by the tests)


class _Gathered:
    """How to rebuild one gathered tensor: ``gather(local)``; ``pending`` packed readers."""

    __slots__ = ("local", "gather", "version", "pending", "full")

    def __init__(self, local: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor], version: int):
        self.local, self.gather, self.version = local, gather, version
        self.pending, self.full = 0, None


def register(full: torch.Tensor, local: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``full`` was made by ``gather(local)``: readers saving it may keep ``local`` instead."""
    key = full.untyped_storage().data_ptr()

    def gone(ref, key=key):
        if _registry.get(key, (None,))[0] is ref:
            del _registry[key]

    _registry[key] = (weakref.ref(full, gone), _Gathered(local.detach(), gather, full._version))


def _pack(t: torch.Tensor):
    if not _registry or t.layout != torch.strided or t.device.type == "meta":
        return t
    hit = _registry.get(t.untyped_storage().data_ptr())
    if hit is None:
        return t
    full, how = hit[0](), hit[1]
    if full is None or full._version != how.version or t.dtype != full.dtype:
        return t
    how.pending += 1
    return how, t.size(), t.stride(), t.storage_offset()


def _unpack(packed):
    if not isinstance(packed, tuple):
        return packed
    how, size, stride, offset = packed
    global regathers
    full = how.full
    if full is None:
        full = how.gather(how.local)
        regathers += 1
    how.pending -= 1
    how.full = full if how.pending > 0 else None     # the next reader of the same tensor reuses it
    return full.as_strided(size, stride, offset)


def scope() -> torch.autograd.graph.saved_tensors_hooks:
    """The context in which saved gathered tensors are kept as their shards."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)

