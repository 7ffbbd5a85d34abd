"""Distributed optimizer: ZeRO-1/2 sharding, mixed precision and DDP-style overlapped gradient reduction.

:class:`DistributedOptimizer` replaces ``GradSync`` + ``torch.optim``: it averages
the gradients over a data-parallel (dp) group through buckets whose
reductions start from the backward's gradient hooks (overlapped with the rest
of the backward), keeps the optimizer state sharded over dp (``zero=1``), also
keeps the gradients sharded (``zero=2``), trains in bf16/fp16 with an fp32
master copy and dynamic loss scaling, and can keep the master weights and the
optimizer state on the host (``offload``).

Use::

    opt = DistributedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, 1e-3), dp_group,
                               zero=1, precision="bf16")
    opt.zero_grad()
    for i, mb in enumerate(microbatches):
        opt.start_microbatch(last=i == len(microbatches) - 1)
        (loss_fn(model, mb) * opt.loss_scale / len(microbatches)).backward()
    applied = opt.step()

Two modes
---------
*plain* (``zero=0``, ``precision="fp32"``, no offload, ``reduce_dtype`` equal
to the parameters' dtype): DDP. Nothing is flattened; autograd accumulates
``p.grad`` as usual and the user's optimizer (all its param groups) steps the
real parameters. After the last microbatch each bucket of grads is copied into
a staging buffer (with one "had a grad" flag per parameter, as ``GradSync``
does) and all-reduced; ``step()`` writes the mean back into ``p.grad``. Result:
identical to ``GradSync.sync()`` + ``optimizer.step()``.

*flat* (every other setting): Megatron's distributed optimizer. Parameters are
grouped into buckets (reverse parameter order, ``bucket_mb`` MiB of
``reduce_dtype`` each, a parameter never split); each bucket is padded to a
multiple of the dp size ``d`` (zero>=1) times the elements of 16 bytes (each
parameter starts there too, as kernels such as ``torch._grouped_mm`` need) and the buckets are laid end to end in
ONE flat parameter buffer of the parameter dtype; every ``p.data`` becomes a
view of it. A rank's shard is its ``1/d`` contiguous chunk of every bucket
(Megatron's layout: a bucket's reduce-scatter and all-gather then deliver
exactly a rank's shard), which is contiguous in the rank's local shard buffers
(fp32 master, master grad, optimizer state): the inner optimizer gets ONE
flat tensor, the master shard, as its only parameter. An elementwise
optimizer (SGD, momentum SGD, Adam, AdamW...) then computes exactly what it
would per parameter; optimizers that look at whole tensors (LAMB, LARS,
Adafactor, per-tensor clipping inside the optimizer) and several param groups
(e.g. no weight decay on biases) are NOT supported in flat mode - use plain
mode for those. A post-accumulate-grad hook on every parameter moves ``p.grad``
into the ``reduce_dtype`` accumulation buffer (Megatron's ``main_grad``) and
sets ``p.grad = None``, so ``p.grad`` is always None after backward in flat
mode. The parameters' original values initialise the master (bf16/fp16: before
the cast, so the master keeps full precision).

* zero=0: full grad buffer, all-reduced in place per bucket; full master/state.
* zero=1: full grad buffer; once per step (last microbatch) each bucket is
  reduce-scattered into this rank's grad shard; the inner optimizer updates the
  master shard; the cast shard is all-gathered into the parameter buffer.
* zero=2: no full grad buffer: during EVERY microbatch, the hooks put the grads
  of a bucket in a staging buffer (freeing ``p.grad``) and the bucket is
  reduce-scattered (and added into the grad shard) as soon as all its
  parameters' grads for that microbatch are in. At most one staged bucket is
  in flight while the next one fills.

Gradient reduction is a MEAN over dp (sum, then divide by ``d``) computed in
``reduce_dtype``; tied weights (``tied=[(param, group)]``, e.g. embeddings
shared across pipeline stages) are first SUMMED over their group in ``step()``
(never inside a backward hook: that could deadlock a pipeline), then reduced
over dp in the last bucket(s). fp16 has dynamic loss scaling (``loss_scale``:
starts at 2**16, x2 after ``growth_interval`` = 1000 good steps in a row, x0.5
on an overflow, never below 1); an overflow (inf/nan in any rank's reduced
grads, agreed over ``world_group``) skips the update and zeroes the grads.

Overlap: with ``overlap=True`` a bucket's collective is launched
asynchronously from the hooks as soon as all its parameters got their grads
(zero 0/1: during the backward that follows ``start_microbatch(last=True)``;
zero 2: every microbatch); ``step()`` launches what is left (buckets with
unused parameters, whose missing grads count as zeros) and waits. Buckets are
always launched in bucket order, so every rank issues the same collectives in
the same order. Call ``start_microbatch(last=...)`` before every backward
(``last=True`` for the final backward of each parameter in the step; default
True, so a single-microbatch caller need not call it). ``overlap=False``
reduces everything in ``step()`` (for zero=2 this means the staging keeps the
step's full grads, i.e. zero=1's grad memory).

Memory per parameter element (bytes), for the cost model
---------------------------------------------------------
``P`` = parameter bytes (fp32 4, bf16/fp16 2), ``G`` = ``reduce_dtype`` bytes
(default 4 for bf16/fp16, else ``P``), ``K`` = optimizer state in fp32 (SGD 0,
momentum SGD 4, Adam/AdamW 8), ``d`` = dp size; shards are ``1/d`` of the
padded buckets (each parameter starts 16 bytes into the flat buffers, and each
bucket is padded to a multiple of ``d`` times that: a few elements per parameter).

=============  ==========  ======================  ============  =========  ==========================
mode           params      grads (persistent)      fp32 master   state      transient staging
=============  ==========  ======================  ============  =========  ==========================
plain (z0)     4           4 (``p.grad``)          0             K          up to 4 (+1 flag/param):
                                                                            all buckets in flight
flat z0        P           G (+4 master grad       4 (0 for      K          0
                           if G != 4)              fp32 params)
flat z1        P           G + G/d (+4/d master    4/d           K/d        P/d (all-gather input,
                           grad if G != 4)                                  only if P != 4)
flat z2        P           G/d (+4/d master grad   4/d           K/d        ~2 buckets x G + 1 bucket
                           if G != 4)                                       x G/d
=============  ==========  ======================  ============  =========  ==========================

e.g. bf16 + AdamW + zero=1: 2 + 4 + 4/d + 4/d + 8/d; zero=2: 2 + 4/d + 4/d + 8/d
plus about two buckets of fp32 staging (plus autograd's own bf16 grads of the
bucket being filled, freed by the hooks). Tied parameters keep a full ``G``
accumulation buffer in every mode (they are reduced in ``step()``).
``offload=True`` moves the master, the master grad (4/d, always separate then)
and the state to the host (pinned memory with CUDA); on a CPU-only machine
that is the same memory, but ``memory_bytes()["offloaded"]`` reports it.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from autopar.errors import DistributedError

from .collectives import (_all_gather_single, _buckets, _reduce_scatter_single, _unique, group_rank, group_size,
                          pack_grads)

__all__ = ["DistributedOptimizer", "clip_grad_norm_"]

#: where every parameter and shard starts in the flat buffers (bytes): kernels need 16-byte aligned tensors
_ALIGN_BYTES = 16
_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp64": torch.float64, "float64": torch.float64}


def _as_dtype(x: Any) -> torch.dtype | None:
    if x is None:
        return None
    if isinstance(x, str):
        if x not in _DTYPE_NAMES:
            raise ValueError(f"reduce_dtype={x!r} is not one of {sorted(_DTYPE_NAMES)} or a torch.dtype")
        return _DTYPE_NAMES[x]
    if not isinstance(x, torch.dtype) or not x.is_floating_point:
        raise ValueError(f"reduce_dtype={x!r} is not a floating-point torch.dtype")
    return x


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def check_max_norm(max_norm: float | None) -> float | None:
    """``max_norm`` as a float (None: no clipping); raises ValueError unless it is a finite number > 0."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < math.inf:
        raise ValueError(f"max_grad_norm={max_norm!r} must be a finite number > 0 (or None: no clipping)")
    return float(max_norm)


@torch.no_grad()
def clip_grad_norm_(terms: Iterable[tuple[torch.Tensor, float]], grads: Iterable[torch.Tensor], max_norm: float,
                    group: Any = None, device: torch.device | None = None) -> float:
    """Clip gradients that several ranks hold parts (and copies) of by their global 2-norm.

    ``terms``: ``(tensor, weight)`` pairs whose weighted sum of squares,
    summed over ``group`` (default: the world), is the squared global norm; a
    weight is 1 over the number of ranks holding the same values (a weight
    replicated over tp has weight ``1/tp``), so every gradient element counts
    once. ``grads``: the tensors to scale, by ``max_norm / (norm + 1e-6)`` when
    that is below 1 (as :func:`torch.nn.utils.clip_grad_norm_`); ``device``
    is where the norm is summed (default: the first grad's). Returns the
    norm before clipping, equal on every rank (collective: every rank of
    ``group`` must call it)."""
    grads = list(grads)
    device = device or (grads[0].device if grads else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for t, w in terms:
        if t.numel() and w:
            total += w * torch.linalg.vector_norm(t, dtype=torch.float32).square().to(device)
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else dist.group.WORLD
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


class _Bucket:
    """One unit of gradient communication: parameters (indices into the
    optimizer's list) and, in flat mode, their place in the flat buffers."""

    __slots__ = ("index", "params", "offsets", "numel", "start", "shard", "shard_start", "tied",
                 "acc", "staging", "arrived", "complete", "launched")

    def __init__(self, index: int, params: list[int], offsets: list[int], numel: int, tied: bool):
        self.index, self.params, self.offsets, self.numel, self.tied = index, params, offsets, numel, tied
        self.start = self.shard = self.shard_start = 0
        self.acc: torch.Tensor | None = None       # flat: accumulation region (grad buffer view)
        self.staging: torch.Tensor | None = None   # zero 2: open staging of the current round
        self.arrived: set[int] = set()             # params whose grad arrived in the current round
        self.complete = False                      # all arrived: launch when it is this bucket's turn
        self.launched = 0                          # launches this step



def _check_options(zero: Any, precision: Any, bucket_mb: Any) -> float:
    """Check :class:`DistributedOptimizer`'s ``zero``, ``precision`` and
    ``bucket_mb`` (ValueError in words); returns ``bucket_mb`` as a float."""
    if zero not in (0, 1, 2) or isinstance(zero, bool):
        raise ValueError(f"zero={zero!r} is not supported: use 0, 1 or 2")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {sorted(_PRECISIONS)}")
    try:
        bucket_mb = float(bucket_mb)
    except (TypeError, ValueError):
        raise ValueError(f"bucket_mb={bucket_mb!r} is not a number") from None
    if not bucket_mb >= 0 or math.isinf(bucket_mb):
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a finite number >= 0")
    return bucket_mb


def _trainable(params: Iterable[torch.Tensor], allow_empty: bool = False) -> list[torch.Tensor]:
    """The distinct trainable ``params``, checked: at least one (unless
    ``allow_empty``), floating point, all on one device (ValueError in words)."""
    out = [p for p in _unique(params) if p.requires_grad]
    if not out and not allow_empty:
        raise ValueError("DistributedOptimizer got no parameters with requires_grad=True")
    devices = {p.device for p in out}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device; got {sorted(map(str, devices))}")
    if any(not p.is_floating_point() for p in out):
        raise ValueError("all trainable parameters must be floating point")
    return out


def _tied_indices(tied: Iterable[tuple[torch.Tensor, Any]], index: dict[int, int]) -> list[tuple[int, Any]]:
    """``tied`` ``(param, group)`` pairs as ``(index of the param, group)``,
    ``index`` mapping a parameter's id to its position (ValueError in words)."""
    out = []
    for entry in tied:
        try:
            p, group = entry
        except (TypeError, ValueError):
            raise ValueError(f"tied entries must be (param, group) pairs; got {entry!r}") from None
        if id(p) not in index:
            raise ValueError(f"a tied parameter of shape {tuple(p.shape)} is not among the trainable params")
        out.append((index[id(p)], group))
    return out


class DistributedOptimizer:
    """Data-parallel optimizer with ZeRO-1/2 sharding, bf16/fp16 and overlapped bucketed reduction.

    See the module docstring for the design. Arguments:

    * ``params``: the trainable parameters (deduplicated, order kept, ``requires_grad`` only).
    * ``factory``: ``params -> torch.optim.Optimizer`` (None: SGD, lr 0.01). In flat
      mode it receives ``[master_shard]`` and must build an elementwise optimizer
      with a single param group.
    * ``dp_group``: group the gradients are averaged over (None / size 1: no dp).
    * ``zero``: 0 (replicated state), 1 (state + master sharded), 2 (also grads sharded).
    * ``precision``: "fp32", "bf16" or "fp16" (the params are cast in place; fp32 master).
    * ``reduce_dtype``: dtype of the grad accumulation and of the dp reduction
      (default fp32 for bf16/fp16, else the params' dtype).
    * ``bucket_mb``: bucket size in MiB (of ``reduce_dtype``).
    * ``overlap``: launch bucket reductions from the grad hooks (async).
    * ``offload``: master weights, master grads and optimizer state on the host.
    * ``tied``: ``[(param, group)]``: grads summed over ``group`` in ``step()`` before the dp mean.
    * ``world_group``: group agreeing on fp16 overflows and summing the
      gradient norm (default: the whole world).
    * ``max_grad_norm``: clip the reduced gradients to this global 2-norm
      before the update (None: no clipping); ``grad_copies``: ``[(param,
      n)]``, parameters whose reduced gradient ``n`` ranks of the world
      hold besides the dp replicas (replicated over tp, tied copies), so
      that each element counts once. ``grad_norm`` is the last step's norm
      before clipping (None without clipping).
    * ``device``: where the buffers live when there are no parameters
      (``params`` may be empty only then: a pipeline rank whose stages hold
      the input alone still takes part in the step's collectives).
    * ``sharded``: parameters another system keeps sharded over dp and
      reduces itself (FSDP2's ``DTensor`` s of ``fsdp_layers``): their
      gradients arrive reduced (the dp mean of this rank's shard); the inner
      optimizer updates them in a second param group (the factory gets
      ``[{"params": ...}, {"params": sharded}]``), clipping counts them, and
      ``zero_grad`` clears them.
    """

    growth_interval = 1000   # fp16: good steps in a row before the loss scale doubles

    def __init__(self, params: Iterable[torch.Tensor], factory: Callable[[list], torch.optim.Optimizer] | None,
                 dp_group: Any, *, zero: int = 0, precision: str = "fp32", reduce_dtype: Any = None,
                 bucket_mb: float = 25.0, overlap: bool = True, offload: bool = False,
                 tied: Iterable[tuple[torch.Tensor, Any]] = (), world_group: Any = None,
                 max_grad_norm: float | None = None, grad_copies: Iterable[tuple[torch.Tensor, int]] = (),
                 sharded: Iterable[torch.Tensor] = (), device: torch.device | None = None) -> None:
        bucket_mb = _check_options(zero, precision, bucket_mb)
        grad_copies = list(grad_copies)
        copies_of = {id(t): int(n) for t, n in grad_copies}
        self.sharded: list[torch.Tensor] = [p for p in _unique(sharded) if p.requires_grad]
        self._sharded_copies = [max(1, copies_of.get(id(p), 1)) for p in self.sharded]
        self.params: list[torch.Tensor] = _trainable(params, allow_empty=device is not None)
        self.device: torch.device = self.params[0].device if self.params else device
        self.zero, self.precision, self.overlap, self.offload = zero, precision, bool(overlap), bool(offload)
        self.bucket_mb = bucket_mb
        self.dp_group = dp_group
        self.dp = group_size(dp_group)
        self.dp_rank = group_rank(dp_group)
        if self.dp > 1 and not 0 <= self.dp_rank < self.dp:
            raise DistributedError(f"this rank (global rank {dist.get_rank()}) is not a member of dp_group")
        self.world_group = world_group
        index = {id(p): i for i, p in enumerate(self.params)}
        self.tied: list[tuple[int, Any]] = _tied_indices(tied, index)
        tied_ids = {i for i, _ in self.tied}
        self.max_grad_norm = check_max_norm(max_grad_norm)
        self.grad_norm: float | None = None
        self._copies = {index[id(p)]: int(n) for p, n in grad_copies if id(p) in index and int(n) > 1}

        cast = _PRECISIONS[precision]
        rdtype = _as_dtype(reduce_dtype)
        dtypes = {p.dtype for p in self.params} or {torch.float32}
        # no parameters: an empty flat buffer (torch optimizers refuse an empty parameter list)
        self.mode = "plain" if (zero == 0 and precision == "fp32" and not self.offload and self.params
                                and (rdtype is None or dtypes == {rdtype})) else "flat"
        if self.mode == "flat" and cast is None and len(dtypes) > 1:
            raise ValueError(f"zero={zero}/offload={offload} flattens the parameters, which needs one dtype; got "
                             f"{sorted(map(str, dtypes))} (use precision='bf16'/'fp16', or zero=0 without offload)")
        self.param_dtype: torch.dtype = cast or next(iter(dtypes))
        self.master_dtype: torch.dtype = torch.float32 if cast is not None else self.param_dtype
        self.reduce_dtype: torch.dtype = rdtype or (torch.float32 if cast is not None else self.param_dtype)
        if self.mode == "plain":
            self.reduce_dtype = self.param_dtype if len(dtypes) == 1 else self.reduce_dtype

        self._scale = 2.0 ** 16 if precision == "fp16" else 1.0
        self._good_steps = 0
        self._last = True
        self._ptr = 0                      # next overlapped bucket to launch (launch order = bucket order)
        self._inflight: list[tuple[_Bucket, Any, Any]] = []
        self._staged = 0                   # transient staging bytes alive now / at the peak
        self._staged_peak = 0
        self.launched_buckets = 0          # bucket reductions launched since zero_grad()
        self._hooks: list[Any] = []
        self.master: torch.Tensor | None = None
        self._pbuf = self._gbuf = self._tbuf = self._gshard = self._mgrad = None
        self.padded_numel = self.shard_numel = 0

        order = [i for i in reversed(range(len(self.params))) if i not in tied_ids]
        tied_order = [i for i in reversed(range(len(self.params))) if i in tied_ids]
        if self.mode == "plain":
            self._build_plain(order, tied_order, factory)
        else:
            self._build_flat(order, tied_order, factory)
        self.bucket_numels = [b.numel for b in self.buckets]
        self._register_hooks()

    def _register_hooks(self) -> None:
        """A hook on every parameter reports its gradient (:meth:`_on_grad`).
        The hooks hold this optimizer weakly: a parameter -> hook -> optimizer
        -> parameter cycle through the autograd engine's C++ hook table is not
        seen by Python's collector, and kept a dropped ParallelModule's whole
        training state alive (7 GiB of an H200 for a 350M GPT)."""
        me = weakref.ref(self)
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, i=i: (lambda o: o._on_grad(i, p) if o is not None else None)(me())))

    # ------------------------------------------------------------------ set-up
    def _make_buckets(self, order: list[int], tied: bool, first: int) -> list[_Bucket]:
        if self.mode == "plain":
            groups = [[order[k] for k in idx] for idx in _buckets([self.params[i] for i in order], self.bucket_mb)]
        else:  # one dtype: consecutive runs of <= bucket_mb MiB of reduce_dtype
            limit, item = self.bucket_mb * 2 ** 20, torch.empty((), dtype=self.reduce_dtype).element_size()
            groups, used = [], 0
            for i in order:
                nbytes = self.params[i].numel() * item
                if not groups or (groups[-1] and used + nbytes > limit):
                    groups.append([])
                    used = 0
                groups[-1].append(i)
                used += nbytes
        div = self.dp if (self.mode == "flat" and self.zero >= 1) else 1
        # flat: every parameter (and every rank's shard) starts 16 bytes into every flat buffer, as
        # kernels need (torch._grouped_mm refuses a bf16 expert weight at an odd offset)
        align = self._align() if self.mode == "flat" else 1
        out = []
        for g in groups:
            offsets, n = [], 0
            for i in g:
                offsets.append(n)
                n += -(-self.params[i].numel() // align) * align
            out.append(_Bucket(first + len(out), g, offsets, -(-n // (div * align)) * (div * align), tied))
        return out

    def _align(self) -> int:
        """Elements per 16 bytes of the narrowest flat buffer (parameters, grads, master)."""
        sizes = [torch.empty((), dtype=t).element_size() for t in (self.param_dtype, self.reduce_dtype,
                                                                     self.master_dtype)]
        return max(1, _ALIGN_BYTES // min(sizes))

    def _build_plain(self, order: list[int], tied_order: list[int], factory) -> None:
        self.overlapped = self._make_buckets(order, False, 0)
        self.tied_buckets = self._make_buckets(tied_order, True, len(self.overlapped))
        self.buckets = self.overlapped + self.tied_buckets
        self._where = {i: (b, off) for b in self.buckets for i, off in zip(b.params, b.offsets)}
        self.optimizer = self._make_optimizer(factory, self._groups(self.params))
        self.padded_numel = self.shard_numel = sum(p.numel() for p in self.params)

    @torch.no_grad()
    def _build_flat(self, order: list[int], tied_order: list[int], factory) -> None:
        d = self.dp if self.zero >= 1 else 1
        r = self.dp_rank if self.zero >= 1 else 0
        self.overlapped = self._make_buckets(order, False, 0)
        self.tied_buckets = self._make_buckets(tied_order, True, len(self.overlapped))
        self.buckets = self.overlapped + self.tied_buckets
        self._where = {i: (b, off) for b in self.buckets for i, off in zip(b.params, b.offsets)}
        start = sstart = 0
        for b in self.buckets:
            b.start, b.shard, b.shard_start = start, b.numel // d, sstart
            start += b.numel
            sstart += b.shard
        T, S = start, sstart
        self.padded_numel, self.shard_numel = T, S
        dev = self.device
        self._pbuf = torch.zeros(T, dtype=self.param_dtype, device=dev)
        mdev = torch.device("cpu") if self.offload else dev
        pin = self.offload and dev.type == "cuda"
        master_is_pbuf = (self.zero == 0 and not self.offload and self.master_dtype == self.param_dtype)
        if not master_is_pbuf:
            self.master = torch.zeros(S, dtype=self.master_dtype, device=mdev, pin_memory=pin)
        for b in self.buckets:
            vals = torch.zeros(b.numel, dtype=self.master_dtype, device=dev)
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                vals[off:off + p.numel()].copy_(p.detach().reshape(-1))
            self._pbuf[b.start:b.start + b.numel].copy_(vals)
            if self.master is not None:
                self.master[b.shard_start:b.shard_start + b.shard].copy_(vals[r * b.shard:(r + 1) * b.shard])
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                p.data = self._pbuf[b.start + off:b.start + off + p.numel()].view(p.shape)
            del vals
        if master_is_pbuf:
            self.master = self._pbuf
        # grad accumulation: full buffer (zero 0/1) or tied buckets only (zero 2)
        rd = self.reduce_dtype
        if self.zero <= 1:
            self._gbuf = torch.zeros(T, dtype=rd, device=dev)
            for b in self.buckets:
                b.acc = self._gbuf[b.start:b.start + b.numel]
        elif self.tied_buckets:
            t0 = self.tied_buckets[0].start
            self._tbuf = torch.zeros(T - t0, dtype=rd, device=dev)
            for b in self.tied_buckets:
                b.acc = self._tbuf[b.start - t0:b.start - t0 + b.numel]
        # this rank's reduced grads (the grad buffer itself when nothing is sharded)
        self._gshard = self._gbuf if (d == 1 and self._gbuf is not None) else torch.zeros(S, dtype=rd, device=dev)
        if self._gshard.dtype == self.master_dtype and not self.offload:
            self._mgrad = self._gshard
        else:
            self._mgrad = torch.zeros(S, dtype=self.master_dtype, device=mdev, pin_memory=pin)
        self.master.grad = self._mgrad
        self.optimizer = self._make_optimizer(factory, self._groups([self.master]))
        groups = self.optimizer.param_groups
        if len(groups) != 1 + bool(self.sharded) or len(groups[0]["params"]) != 1 or \
                groups[0]["params"][0] is not self.master:
            raise ValueError("in flat mode (zero>=1, bf16/fp16 or offload) the optimizer factory must build an "
                             "optimizer over exactly the one flat master tensor it is given, in one param group "
                             "(and the FSDP2 shards of fsdp_layers in a second one); "
                             f"got {len(groups)} group(s). Per-group settings need zero=0, precision='fp32'")

    def _groups(self, params: list) -> list:
        """What the factory gets: ``params``, and the sharded ones in a param group of their own."""
        return [{"params": params}, {"params": self.sharded}] if self.sharded else params

    @staticmethod
    def _make_optimizer(factory, params: list) -> torch.optim.Optimizer:
        opt = factory(params) if factory is not None else torch.optim.SGD(params, lr=0.01)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt

    # ------------------------------------------------------------------ public API
    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 except fp16, dynamic)."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        """Set the fp16 loss scale (e.g. when resuming from a checkpoint); restarts the growth count."""
        value = float(value)
        if not 1.0 <= value < math.inf:
            raise ValueError(f"loss_scale={value!r} must be a finite number >= 1")
        if self.precision != "fp16" and value != 1.0:
            raise ValueError(f"loss scaling is for precision='fp16'; this optimizer is {self.precision!r}")
        self._scale = value
        self._good_steps = 0

    def start_microbatch(self, last: bool) -> None:
        """Say whether the coming backward is the last one of the step (its grads are final)."""
        self._last = bool(last)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Reset the grads and the accumulation buffers; call before a step's first microbatch."""
        self._drain()
        for p in self.params + self.sharded:
            p.grad = None
        for b in self.buckets:
            self._unstage(_nbytes(b.staging))
            b.staging = None
            b.arrived.clear()
            b.complete, b.launched = False, 0
        for t in (self._gbuf, self._tbuf, self._gshard, self._mgrad):
            if t is not None:
                t.zero_()
        self._ptr = 0
        self._last = True
        self.launched_buckets = 0

    @torch.no_grad()
    def step(self) -> bool:
        """Finish the reductions, unscale, (fp16) check for overflows, update, write back.

        Returns whether the update was applied (False: fp16 overflow, grads zeroed).
        """
        for i, group in self.tied:  # sum over the tie group first (never inside a backward hook)
            if group_size(group) > 1:
                p = self.params[i]
                if self.mode == "plain":
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, group=group)
                else:
                    b, off = self._where[i]
                    dist.all_reduce(b.acc[off:off + p.numel()], group=group)
        n = len(self.overlapped)
        for k in range(n):   # what the hooks did not launch, in bucket order from where they stopped
            b = self.overlapped[(self._ptr + k) % n]
            if b.launched == 0 or b.staging is not None:
                self._launch(b)
        for b in self.tied_buckets:
            self._launch(b)
        self._drain()
        self._reset_step()
        if self.mode == "plain":
            if self.max_grad_norm is not None:
                self._clip_plain()
            self.optimizer.step()
            return True
        mg = self._mgrad
        if mg is not self._gshard:
            mg.copy_(self._gshard)
        if self.precision == "fp16" and self._overflow(mg):
            self._scale = max(self._scale * 0.5, 1.0)
            self._good_steps = 0
            self.zero_grad()
            return False
        if self.dp > 1:
            mg.div_(self.dp)
        if self._scale != 1.0:
            mg.div_(self._scale)
        if self.max_grad_norm is not None:
            self._clip_flat(mg)
        self.master.grad = mg
        self.optimizer.step()
        self._write_back()
        if self.precision == "fp16":
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale *= 2.0
                self._good_steps = 0
        return True

    def _clip_plain(self) -> None:
        """Clip ``p.grad`` (the dp means, equal on every dp rank) by the global norm."""
        grads = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        terms = [(g, 1.0 / (self.dp * self._copies.get(i, 1))) for i, g in grads]
        extra = self._sharded_terms()
        self.grad_norm = clip_grad_norm_(terms + extra, [g for _, g in grads] + [g for g, _ in extra],
                                         self.max_grad_norm, self.world_group, self.device)

    def _sharded_terms(self) -> list[tuple[torch.Tensor, float]]:
        """This rank's shards of the sharded parameters' reduced gradients,
        each element one dp rank's alone, weighted 1 over its other copies."""
        return [(g.to_local() if hasattr(g, "to_local") else g, 1.0 / n)
                for p, n in zip(self.sharded, self._sharded_copies) if (g := p.grad) is not None]

    def _clip_flat(self, mg: torch.Tensor) -> None:
        """Clip this rank's reduced master-grad shard ``mg`` by the global norm.

        Each shard element is one dp rank's alone with ZeRO (zero >= 1), the
        same on every dp rank without; a parameter with copies (tp
        replicas, tied) also subtracts the extra weight of its segment."""
        base = 1.0 if self.zero >= 1 else 1.0 / self.dp
        terms = [(mg, base)]
        r = self.dp_rank if self.zero >= 1 else 0
        for b in self.buckets:
            lo_b = r * b.shard                    # this rank's shard of the bucket, in bucket coordinates
            for i, off in zip(b.params, b.offsets):
                n = self._copies.get(i, 1)
                lo, hi = max(off, lo_b), min(off + self.params[i].numel(), lo_b + b.shard)
                if n > 1 and lo < hi:
                    seg = mg[b.shard_start + lo - lo_b:b.shard_start + hi - lo_b]
                    terms.append((seg, base * (1.0 / n - 1.0)))
        extra = self._sharded_terms()
        self.grad_norm = clip_grad_norm_(terms + extra, [mg] + [g for g, _ in extra], self.max_grad_norm,
                                         self.world_group, self.device)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this object holds, by kind (see the module docstring for the per-element model).

        ``master``: fp32 master weights held apart from the params (0 when they
        are the params); ``optimizer_state``: the inner optimizer's state tensors;
        ``grad_buffer``: persistent grad buffers (accumulation, shard, master
        grad; plain mode: 0, the grads are the params' own ``.grad``);
        ``bucket_staging``: the peak of transient communication buffers so far;
        ``offloaded``: the part of the above kept on the host (offload=True).
        """
        master = 0 if (self.master is None or self.master is self._pbuf) else _nbytes(self.master)
        state = sum(_nbytes(v) for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
        grads, seen = 0, set()
        for t in (self._gbuf, self._tbuf, self._gshard, self._mgrad):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                grads += _nbytes(t)
        off = 0
        if self.offload:
            off = master + state + (_nbytes(self._mgrad) if self._mgrad is not self._gshard else 0)
        return {"master": master, "optimizer_state": state, "grad_buffer": grads,
                "bucket_staging": self._staged_peak, "offloaded": off}

    def buffers(self) -> list[torch.Tensor]:
        """The persistent tensors this object allocated (flat parameters, gradient
        buffers, master), for memory trackers that only see what they are given."""
        out, seen = [], set()
        for t in (self._pbuf, self._gbuf, self._tbuf, self._gshard, self._mgrad, self.master):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (the optimizer is unusable afterwards)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ hooks
    @torch.no_grad()
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        b, off = self._where[i]
        staged = self.mode == "flat" and self.zero == 2 and not b.tied
        if not staged and b.launched:
            raise DistributedError(
                f"parameter {i} (shape {tuple(p.shape)}) received a gradient after its bucket was reduced "
                "in this step: call start_microbatch(last=False) before every backward except the last one "
                "of the step, and zero_grad() after step()")
        if self.mode == "flat":
            if staged:
                if b.staging is None:
                    b.staging = torch.zeros(b.numel, dtype=self.reduce_dtype, device=self.device)
                    self._stage(_nbytes(b.staging))
                b.staging[off:off + g.numel()].add_(g.reshape(-1))
            else:
                b.acc[off:off + g.numel()].add_(g.reshape(-1))
            p.grad = None
        if b.tied or not self.overlap or not (staged or self._last):
            return
        if self.mode == "plain" and self.dp == 1:
            return
        b.arrived.add(i)
        if len(b.arrived) == len(b.params):
            b.complete = True
            self._try_launch()

    def _try_launch(self) -> None:
        n = len(self.overlapped)
        while n:
            b = self.overlapped[self._ptr]
            if not b.complete:
                return
            self._launch(b)
            self._ptr = (self._ptr + 1) % n

    # ------------------------------------------------------------------ reductions
    def _stage(self, nbytes: int) -> None:
        self._staged += nbytes
        self._staged_peak = max(self._staged_peak, self._staged)

    def _unstage(self, nbytes: int) -> None:
        self._staged -= nbytes

    def _launch(self, b: _Bucket) -> None:
        """Start the dp reduction of bucket ``b`` (async); ``_finish`` completes it."""
        b.complete = False
        b.arrived.clear()
        b.launched += 1
        self.launched_buckets += 1
        w, group = self.dp, self.dp_group
        if self.mode == "plain":
            if w == 1:
                return
            flat, _ = pack_grads([self.params[i] for i in b.params])
            self._stage(_nbytes(flat))
            work = dist.all_reduce(flat, group=group, async_op=True)
            self._inflight.append((b, work, flat))
            return
        out_full = self._gshard[b.shard_start:b.shard_start + b.shard]
        if b.acc is not None:    # zero 0/1, or a tied bucket: reduce the accumulation region
            if w == 1:
                if out_full.data_ptr() != b.acc.data_ptr():
                    out_full.copy_(b.acc)
                return
            if self.zero == 0:
                work = dist.all_reduce(b.acc, group=group, async_op=True)
            else:
                work = _reduce_scatter_single(out_full, b.acc, group=group, async_op=True)
            self._inflight.append((b, work, None))
            return
        # zero 2: reduce-scatter this round's staging, add it into the grad shard
        self._drain()   # bound the staging: one bucket in flight while the next one fills
        st = b.staging
        b.staging = None
        if st is None:
            st = torch.zeros(b.numel, dtype=self.reduce_dtype, device=self.device)
            self._stage(_nbytes(st))
        if b.launched == 1:      # first contribution this step: write the shard directly
            out, add = out_full, False
        else:
            out, add = torch.empty_like(out_full), True
            self._stage(_nbytes(out))
        if w == 1:
            out.copy_(st)
            work = None
        else:
            work = _reduce_scatter_single(out, st, group=group, async_op=True)
        self._inflight.append((b, work, (st, out, add)))
        if w == 1:
            self._drain()

    def _drain(self) -> None:
        """Wait for every reduction in flight, in launch order, and finish it."""
        inflight, self._inflight = self._inflight, []
        for b, work, extra in inflight:
            if work is not None:
                work.wait()
            if self.mode == "plain":
                self._finish_plain(b, extra)
            elif extra is not None:
                st, out, add = extra
                if add:
                    self._gshard[b.shard_start:b.shard_start + b.shard].add_(out)
                    self._unstage(_nbytes(out))
                self._unstage(_nbytes(st))

    @torch.no_grad()
    def _finish_plain(self, b: _Bucket, flat: torch.Tensor) -> None:
        w = self.dp
        ps = [self.params[i] for i in b.params]
        pieces = flat.split([p.numel() for p in ps] + [len(ps)])
        flags = pieces[-1].tolist()   # how many ranks had a grad
        for p, piece, flag in zip(ps, pieces, flags):
            if p.grad is not None:
                torch.div(piece.view_as(p.grad), w, out=p.grad)
            elif flag > 0:
                p.grad = piece.view_as(p) / w
        self._unstage(_nbytes(flat))

    def _reset_step(self) -> None:
        for b in self.buckets:
            b.arrived.clear()
            b.complete, b.launched = False, 0
        self._ptr = 0
        self._last = True

    def _overflow(self, mg: torch.Tensor) -> bool:
        """Whether any rank of the world group found an inf/nan in its reduced grads."""
        flag = torch.tensor([0.0 if bool(torch.isfinite(mg).all()) else 1.0], device=self.device)
        group = self.world_group
        if dist.is_available() and dist.is_initialized():
            group = group if group is not None else dist.group.WORLD
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def _write_back(self) -> None:
        """Updated master -> parameters (cast; all-gather of the shards for zero>=1)."""
        if self.master is self._pbuf:
            return
        if self.zero == 0 or self.dp == 1:
            self._pbuf.copy_(self.master)
            return
        works, temps = [], 0
        for b in self.buckets:
            src = self.master[b.shard_start:b.shard_start + b.shard]
            piece = src.to(device=self.device, dtype=self.param_dtype)
            if piece.data_ptr() != src.data_ptr():
                temps += _nbytes(piece)
            works.append((_all_gather_single(self._pbuf[b.start:b.start + b.numel], piece,
                                             group=self.dp_group, async_op=True), piece))
        self._stage(temps)
        for work, _ in works:
            work.wait()
        self._unstage(temps)
