"""Local kernels for vocabulary-parallel layers (vocab sharded over a tensor-parallel group)
for context-parallel attention (sequence sharded over a cp group), and batch
normalisation with statistics over the data-parallel group (:func:`sync_batch_norm`).

Rank i of the group holds rows ``[vocab_start, vocab_end)`` of the embedding /
the same columns of the logits. Under context parallelism rank i holds the
positions ``q_pos`` of the sequence (two load-balanced chunks), and
attention reads the keys and values of the whole sequence:
:func:`gather_sequence` all-gathers them (backward: reduce-scatter of their
gradients) and puts them in sequence order.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import DistributedError

from .collectives import all_gather_reduce_grad, all_reduce, group_size, reduce_grad

__all__ = ["vocab_parallel_embedding", "vocab_parallel_cross_entropy", "gather_sequence", "context_attention",
           "sync_batch_norm", "seed_of", "seeded", "in_dtype"]


def _check_range(n_local: int, vocab_start: int, vocab_end: int, what: str) -> None:
    if not 0 <= vocab_start <= vocab_end or vocab_end - vocab_start != n_local:
        raise DistributedError(
            f"{what}: vocab range [{vocab_start}, {vocab_end}) does not match the local shard size {n_local}")


def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor,
                             vocab_start: int, vocab_end: int, padding_idx: int | None = None,
                             vocab_size: int | None = None) -> torch.Tensor:
    """Embedding lookup against rows ``[vocab_start, vocab_end)`` of the vocabulary.

    Ids in the range read the local shard, other ids give zero rows, so the
    output is Partial: summing it over the group gives ``F.embedding(ids, W)``.
    No collective inside; the weight grad only touches looked-up local rows,
    and never the padding row ``padding_idx`` (as ``nn.Embedding(padding_idx=)``;
    a negative one counts from the end of the ``vocab_size`` rows).
    """
    _check_range(weight_shard.shape[0], vocab_start, vocab_end, "vocab_parallel_embedding")
    if padding_idx is not None and padding_idx < 0:
        if vocab_size is None:
            raise DistributedError("vocab_parallel_embedding: a negative padding_idx needs the vocab_size")
        padding_idx += vocab_size
    pad = padding_idx - vocab_start if padding_idx is not None and vocab_start <= padding_idx < vocab_end else None
    inside = (ids >= vocab_start) & (ids < vocab_end)
    local = torch.where(inside, ids - vocab_start, torch.zeros_like(ids))
    return F.embedding(local, weight_shard, padding_idx=pad).masked_fill(~inside.unsqueeze(-1), 0.0)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over vocab-sharded logits [N, V/tp]; returns losses [N] (R) in >= float32."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_end, group, ignore_index):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16 -> fp32
        comm = group is not None and dist.get_world_size(group) > 1
        m = x.max(dim=-1).values
        if comm:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        exp = x.exp()
        valid = target != ignore_index
        inside = valid & (target >= vocab_start) & (target < vocab_end)
        local = torch.where(inside, target - vocab_start, torch.zeros_like(target))
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        stats = torch.stack([exp.sum(-1), target_logit])  # one all-reduce for both
        if comm:
            dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        exp.div_(sum_exp.unsqueeze(-1))  # local slice of the softmax
        ctx.save_for_backward(exp, local, inside, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, inside, valid = ctx.saved_tensors
        scale = g.to(softmax.dtype) * valid
        grad = softmax * scale.unsqueeze(-1)  # new tensor: the saved softmax stays intact
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= scale * inside
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 vocab_start: int, vocab_end: int, group,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits, target)`` from vocab-sharded logits, identical on every rank.

    ``logits_shard`` is [..., V/tp] (columns ``[vocab_start, vocab_end)`` of the
    full logits), ``target`` [...] holds global class ids. Three small
    all-reduces (max, then sum-exp and target logit together); the backward is
    local (softmax - onehot on the shard). ``reduction``: "mean" (over targets
    != ignore_index; NaN when there are none, like torch, with a zero
    gradient as torch's: a part of a split batch with no counted token, which
    the runtime weights 0, leaves no NaN in the gradients), "sum" or "none".
    Computes in at least float32; returns the logits' dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    _check_range(logits_shard.shape[-1], vocab_start, vocab_end, "vocab_parallel_cross_entropy")
    if logits_shard.shape[:-1] != target.shape:
        raise DistributedError(
            f"vocab_parallel_cross_entropy: logits shape {tuple(logits_shard.shape)} and target shape "
            f"{tuple(target.shape)} do not match (expected target shape {tuple(logits_shard.shape[:-1])})")
    losses = _VocabParallelCE.apply(logits_shard.reshape(-1, logits_shard.shape[-1]), target.reshape(-1),
                                    vocab_start, vocab_end, group, ignore_index)
    if reduction == "none":
        out = losses.view(target.shape)
    elif reduction == "sum":
        out = losses.sum()
    else:
        count = (target != ignore_index).sum()
        empty = count == 0
        out = losses.sum() / torch.where(empty, 1, count) + torch.where(empty, math.nan, 0.0)
    return out.to(logits_shard.dtype)


def counted_share(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None,
                  groups: Sequence[Any]) -> torch.Tensor:
    """A rank's part of a token mean split with its samples over ``groups``:
    ``loss`` (the mean over this rank's counted targets: not
    ``ignore_index``, weighed by ``weight[target]`` if given) times this
    rank's share of the count over the groups, so that the sum over the
    ranks is the mean over all of them. A rank that counts nothing (its loss
    0/0) gives 0 and a zero gradient; where no rank counts anything, NaN.
    In at least float32."""
    counted = target != ignore_index
    if weight is not None:
        mine = (weight[torch.where(counted, target, 0)] * counted).sum().to(torch.float64)
    else:
        mine = counted.sum().to(torch.float64)
    total = mine.clone()
    for g in groups:
        dist.all_reduce(total, group=g)
    empty = total == 0
    share = (mine / torch.where(empty, 1.0, total)).to(torch.float32)   # a bf16 share would round the count
    return torch.where(mine == 0, 0.0, loss * share) + torch.where(empty, math.nan, 0.0)


def gather_sequence(x: torch.Tensor, dim: int, group, order: torch.Tensor) -> torch.Tensor:
    """The whole sequence of ``x`` (this rank's positions along ``dim``), in
    sequence order: all-gathered over the context-parallel ``group`` (rank
    order), then permuted by ``order`` (position p of the result is entry
    ``order[p]`` of the gathered tensor). Backward: the gradients of every
    rank's use summed, this rank's positions kept (a reduce-scatter)."""
    if group_size(group) == 1:
        return x
    full = all_gather_reduce_grad(x, dim, group)
    return full.index_select(dim % full.dim(), order.to(full.device))


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, order: torch.Tensor,
                      q_pos: torch.Tensor, is_causal: bool, gather: tuple[bool, bool] = (True, True),
                      **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries (at global
    positions ``q_pos``) over the keys and values of the whole sequence
    (:func:`gather_sequence` on dim -2, for each of k and v that ``gather``
    says was not gathered before); causal masking by global position (query
    p sees keys 0..p). ``kwargs``: sdpa's other options (scale, dropout_p,
    enable_gqa)."""
    if gather[0]:
        k = gather_sequence(k, -2, group, order)
    if gather[1]:
        v = gather_sequence(v, -2, group, order)
    mask = None
    if is_causal:
        keys = torch.arange(k.shape[-2], device=q.device)
        mask = q_pos.to(q.device)[:, None] >= keys[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def _sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group of a statistic every rank's loss reads: all-reduce forward,
    and all-reduce of its gradient backward (each rank's loss depends on the sum)."""
    return reduce_grad(all_reduce(x, group), group)


def sync_batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    weight: torch.Tensor | None, bias: torch.Tensor | None, momentum: float, eps: float,
                    group) -> torch.Tensor:
    """Training-mode batch normalisation of ``x[N, C, ...]`` with the mean and
    variance of the whole batch spread over ``group`` (the data-parallel
    ranks), as ``torch.nn.SyncBatchNorm``: the same values as one process on
    the global batch. Two passes (the mean, then the centred squares), each a
    sum over the group whose gradient is summed back; the running statistics
    (unbiased variance) are updated in place, as ``F.batch_norm`` does."""
    dims = [0, *range(2, x.dim())]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    local = torch.tensor([x.numel() // max(x.shape[1], 1)], dtype=x.dtype, device=x.device)
    stats = _sum_over_group(torch.cat([x.sum(dims), local]), group)
    count = stats[-1].detach()
    mean = stats[:-1] / count
    xc = x - mean.reshape(shape)
    var = _sum_over_group((xc * xc).sum(dims), group) / count
    y = xc * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            n = float(count)
            unbiased = var.detach() * (n / max(n - 1.0, 1.0))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y


def seed_of(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (ints, strings, tuples), the same in every
    process (``hash()`` of a string is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (2 ** 63 - 1)


@contextlib.contextmanager
def seeded(seed: int, cuda_devices: list[int]) -> Iterator[None]:
    """Run the block with the CPU generator and those of ``cuda_devices``
    seeded by ``seed``; restore them after."""
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def in_dtype(x: Any, dtype: torch.dtype) -> Any:
    """``x`` in ``dtype`` when it is a floating tensor of another (a list or
    tuple of them elementwise); anything else as it is."""
    if isinstance(x, (list, tuple)):
        return type(x)(in_dtype(v, dtype) for v in x)
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x
