"""``ParallelModule``: this rank's parallelized model, and its training step.

The module executes what :func:`autopar.parallelize` built (this rank's
compiled program, or its pipeline stages and their executor; the optimizer)
and knows nothing of how it was planned or compiled: the plan is kept as an
opaque record, the strategy as a :class:`~autopar.spec.ParallelConfig`.
:meth:`ParallelModule.train_step` runs forward, backward and the optimizer
step over the microbatches and returns the global mean loss.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import DistributedError, NonFiniteLossError, StrategyError, UnsupportedError
from ..pipeline.schedule import Timeline
from ..spec import ParallelConfig, is_shard, shard_blocks, shard_dim, unblock
from . import checkpoint
from . import collectives as C
from . import kernels as K
from . import regather
from .dist import Mesh, local_device
from .faults import FaultBoard
from .faults import activate as activate_faults
from .optim import DistributedOptimizer, clip_grad_norm_
from .pipeline import PipelineExecutor
from .regions import full_tensor, unsharded_params

__all__ = ["ParallelModule", "StateNames", "LOW_PRECISION", "local_tensors", "as_tuple", "batch_first",
           "batch_where", "batch_dims", "batch_first_all", "BatchDim"]

#: the compute dtype of each low-precision setting (fp32 computes in fp32)
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def as_tuple(x: Any) -> tuple:
    """``x`` as a tuple of inputs (a single tensor becomes a 1-tuple)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x)


#: where a caller's tensors hold the batch: one dim for every input and the target, or one per
#: input and then one for the target (``parallelize(batch_dim=...)``)
BatchDim = int | tuple[int, ...]


def batch_dims(spec: BatchDim, n_inputs: int) -> tuple[tuple[int, ...], int]:
    """``(the dim of each of n_inputs inputs, the target's)`` of a batch-dim
    ``spec`` (:data:`BatchDim`, checked: the caller raises on ValueError)."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return (spec,) * n_inputs, spec
    dims = tuple(spec) if isinstance(spec, (tuple, list)) else None
    if dims is None or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims) or \
            len(dims) not in (n_inputs, n_inputs + 1):
        raise ValueError(f"batch_dim must be a non-negative int (the dim of the inputs and the target that holds "
                         f"the batch), or a tuple of one per input ({n_inputs}), then one for the target; "
                         f"got {spec!r}")
    return dims[:n_inputs], dims[n_inputs] if len(dims) > n_inputs else 0


def batch_first(values: Any, dim: int) -> Any:
    """``values`` (a tensor, or a tuple, list or dict of them) with the batch
    moved from ``dim`` to dim 0 in every tensor of more than ``dim`` dims
    (views, no copy); tensors of fewer dims (a label per sample when the
    inputs are ``[seq, batch]``) and other values are left as they are."""
    return _each_tensor(values, lambda t: t.movedim(dim, 0) if t.dim() > dim else t) if dim else values


def batch_where(values: Any, dim: int) -> Any:
    """The inverse of :func:`batch_first`: the batch moved back from dim 0 to ``dim``."""
    return _each_tensor(values, lambda t: t.movedim(0, dim) if t.dim() > dim else t) if dim else values


def batch_first_all(inputs: tuple, target: Any, spec: BatchDim, back: bool = False) -> tuple[tuple, Any]:
    """The inputs and the target with each one's batch at dim 0 (``back``: from
    dim 0 to where ``spec`` puts it), per :func:`batch_dims`."""
    move = batch_where if back else batch_first
    dims, at = batch_dims(spec, len(inputs))
    return tuple(move(x, d) for x, d in zip(inputs, dims)), move(target, at)


def _each_tensor(values: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(values, torch.Tensor):
        return f(values)
    if isinstance(values, dict):
        return {k: _each_tensor(v, f) for k, v in values.items()}
    if isinstance(values, (tuple, list)):
        return type(values)(_each_tensor(v, f) for v in values)
    return values


@dataclass(frozen=True)
class StateNames:
    """How this rank's tensor names (those of the traced program) map to the
    keys of the user's ``model.state_dict()``.

    ``prefix``: the path the loss wrapper put before the model's names
    (stripped); ``aliases``: a tied tensor's name -> its other names (each
    also gets the tensor); ``keys``: the model's ``state_dict`` keys
    (non-persistent buffers are left out of the result); ``constant``: the
    entries the program never reads (a causal-mask buffer the model keeps
    but its fused attention does not use), saved as they were.
    """

    prefix: str = ""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    keys: frozenset[str] = frozenset()
    constant: dict[str, torch.Tensor] = field(default_factory=dict)

    def keys_of(self, name: str) -> list[str]:
        """The ``state_dict`` keys tensor ``name`` is saved under (none for a
        non-persistent buffer or a constant)."""
        out = []
        for full in [name] + self.aliases.get(name, []):
            key = full[len(self.prefix):] if self.prefix and full.startswith(self.prefix) else full
            if key in self.keys:
                out.append(key)
        return out


def local_tensors(modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters, then buffers, of ``modules`` (this rank's program or
    pipeline stages) by their names in the compiled program: each tensor
    once; names inside layer regions mapped back through the modules'
    ``param_names`` / ``buffer_names``."""
    out: dict[str, torch.Tensor] = {}
    for mod in modules:
        names = {**getattr(mod, "param_names", {}), **getattr(mod, "buffer_names", {})}
        out.update((names.get(k, k), v) for k, v in mod.named_parameters())
    for mod in modules:
        names = {**getattr(mod, "param_names", {}), **getattr(mod, "buffer_names", {})}
        out.update((names.get(k, k), v) for k, v in mod.named_buffers())
    return out


class ParallelModule(nn.Module):
    """This rank's part of a parallelized model.

    ``parameters()`` are this rank's shards (plain tensors, or FSDP2
    ``DTensor`` s with ``zero=3``; with a pipeline, only those of the stages
    this rank holds); ``plan`` is the Plan with its predictions;
    ``train_step(inputs, target)`` runs forward, backward and the optimizer
    step and returns the global mean loss (the same float on every rank);
    ``full_state_dict()`` gathers unsharded weights.

    With ``pp > 1`` the ranks form a ``(pp, dp, tp)`` mesh (pp outermost, tp
    fastest, as Megatron lays it out); pipeline rank ``r`` holds virtual stages
    ``r, r + pp, ...`` and runs them with a :class:`PipelineExecutor`.

    Built by :func:`autopar.parallelize` from: ``modules`` (the program, or
    with ``pipeline`` the modules of the stages this rank holds, in stage
    order), the ``plan`` record and its ``config``, the ``mesh``, the
    ``optimizer`` (and the ``dist_optimizer`` wrapping it, None under FSDP2),
    ``state_names`` for the state dict, the ``global_batch`` and whether
    ``train_step`` receives it whole (``full_batch``) or this rank's
    data-parallel part, ``param_placement`` (program name -> tensor-parallel
    placement), the number of collectives in the program (``comms``), and
    ``draw_timeline(path, measured) -> Path`` for :meth:`plot_timeline`.
    """

    def __init__(self, modules: Sequence[nn.Module], *, plan: Any, config: ParallelConfig, mesh: Mesh,
                 optimizer: torch.optim.Optimizer, dist_optimizer: DistributedOptimizer | None,
                 state_names: StateNames, global_batch: int, full_batch: bool, param_placement: dict[str, str],
                 comms: int, pipeline: PipelineExecutor | None = None,
                 draw_timeline: Callable[[str | os.PathLike, Timeline], Path] | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.config = cfg = config
        self.full_batch = full_batch
        self.global_batch = global_batch
        self.mesh = mesh
        self.rank, self.world = mesh.rank, dist.get_world_size() if dist.is_initialized() else 1
        #: which rank failed, for the others' one-line error (runtime/faults.py)
        self.faults = FaultBoard(self.rank, self.world)
        activate_faults(self.faults)
        self.dp_group, self.tp_group = mesh.group("dp"), mesh.group("tp")
        self.dp_rank, self.tp_rank = mesh.coord("dp"), mesh.coord("tp")
        self.pp_group = mesh.group("pp") if cfg.pp > 1 else None
        self.pp_rank = mesh.coord("pp") if cfg.pp > 1 else 0
        self.cp_group = mesh.group("cp") if cfg.cp > 1 else None
        #: context parallelism: the sequence dim of each input and of the target (None: not split)
        #: and this rank's global positions along it (set by parallelize)
        self.cp_dims: tuple[list[int | None], int | None] | None = None
        self.cp_positions: torch.Tensor | None = None
        self.device = local_device()
        self.state_names = state_names
        self.step_times: list[float] = []
        self.skipped_steps = 0     # steps skipped: fp16 gradient overflow, or a non-finite loss under "skip"
        #: what a NaN / inf loss does (not with fp16, whose loss scaler skips such steps itself):
        #: "raise" (NonFiniteLossError, the update not applied) or "skip" (the step is dropped)
        self.on_nonfinite = "raise"
        #: per input, then the target: (traced shape, dtype, embedding rows for token ids or None);
        #: set by parallelize, checked by train_step (None: unchecked)
        self.example_inputs: list[tuple[tuple[int, ...], torch.dtype, int | None]] | None = None
        self.example_target: tuple[tuple[int, ...], torch.dtype, int | None] | None = None
        #: the keys of a keyword batch the model was traced with (model(**batch)); None: positional
        self.input_keys: tuple[str, ...] | None = None
        #: stepped after every applied update (not after a skipped one); set by parallelize(lr_scheduler=...)
        self.lr_scheduler: Any = None
        #: clip the gradients to this global 2-norm before each update (None: no clipping); set by
        #: parallelize(max_grad_norm=...). ``grad_copies``: program name -> how many ranks hold the same
        #: reduced gradient besides the dp replicas (tp replicas, tied copies)
        self.max_grad_norm: float | None = None
        self.grad_copies: dict[str, int] = {}
        self.pipeline = pipeline
        self.stages_held: list[int] = sorted(pipeline.by_stage) if pipeline is not None else []
        if pipeline is not None:
            self.program = None
            self.stage_modules = nn.ModuleList(modules)
        else:
            (self.program,) = modules
        self.param_placement = param_placement
        self.row_placement: dict[str, str] = {}      # tp_mode=2d: each parameter's placement on the grid's rows
        self.row_group: Any = None
        self.depth_placement: dict[str, str] = {}    # tp_mode=3d: on the cube's depth
        self.depth_group: Any = None
        self.comms = comms
        self.compute_dtype = LOW_PRECISION.get(cfg.precision, torch.float32)
        self.fsdp = cfg.zero == 3
        self.optimizer = optimizer
        self.dist_optimizer = dist_optimizer
        self._draw_timeline = draw_timeline
        # each rank's loss backward is scaled by it: dp where the program holds the whole loss on every
        # rank and each rank's gradient is its samples' part of the sum (a model whose samples meet)
        self.grad_scale = 1.0
        # the reported loss is the ranks' and microbatches' mean times it: their number where the loss
        # sums the batch (their losses add up to one process's)
        self.loss_factor = 1.0
        # counts the loss's target tokens of a part of the batch (compile/tokens.py), where the loss
        # averages over them and the batch is split: each part is weighted by its share of the tokens
        self.token_counter: Any = None
        #: the seed of the program's random numbers (dropout), agreed by every rank (parallelize sets it
        #: where the tensor-parallel ranks must draw alike); None: the caller's generator runs as it is
        self.rng_seed: int | None = None
        self._evals = 0

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, then buffers, by their names in the program."""
        return local_tensors([self.program] if self.program is not None else list(self.stage_modules))

    # -- training -------------------------------------------------------------
    def set_grid_rows(self, placement: dict[str, str], group: Any, depth_placement: dict[str, str] | None = None,
                      depth_group: Any = None) -> None:
        """``tp_mode=2d``: each parameter's placement on the grid's rows (the
        tp axis being its columns) and the rows' process group, over which
        :meth:`full_state_dict` and checkpoints gather the shards too; with a
        depth (2.5d, 3d), the same on the depth (3d splits the weights there
        again; 2.5d replicates them)."""
        self.row_placement, self.row_group = dict(placement), group
        self.depth_placement, self.depth_group = dict(depth_placement or {}), depth_group

    def set_context_split(self, input_dims: list[int | None], target_dim: int | None, positions: Sequence[int]) -> None:
        """Context parallelism: split input ``i`` along ``input_dims[i]`` (and
        the target along ``target_dim``; None: not split) to this rank's
        global ``positions``."""
        self.cp_dims = (list(input_dims), target_dim)
        self.cp_positions = torch.tensor(list(positions), dtype=torch.long)

    def _local_batch(self, t: torch.Tensor, seq_dim: int | None = None) -> torch.Tensor:
        if seq_dim is not None and self.cp_positions is not None:
            t = t.index_select(seq_dim, self.cp_positions.to(t.device))
        if not self.full_batch or self.config.dp == 1:
            return t
        if t.shape[0] % self.config.dp:
            raise StrategyError(f"batch of {t.shape[0]} is not divisible by dp={self.config.dp}")
        return t.chunk(self.config.dp, dim=0)[self.dp_rank]

    def _mean_over_replicas(self, total: torch.Tensor) -> torch.Tensor:
        """The loss averaged over the data-parallel and context-parallel ranks
        (times :attr:`loss_factor`: a loss that sums the batch adds up)."""
        if self.config.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.config.dp
        if self.cp_group is not None:     # every cp rank holds as many tokens: the mean of the means
            dist.all_reduce(total, group=self.cp_group)
            total /= self.config.cp
        return total * self.loss_factor if self.loss_factor != 1.0 else total

    def forward(self, *inputs_and_target: torch.Tensor) -> torch.Tensor:
        """The local loss of one (local) microbatch (without a pipeline: a
        pipeline's stages only run together, in :meth:`train_step`)."""
        if self.pipeline is not None:
            raise UnsupportedError(f"pipeline rank {self.pp_rank} holds only stages {self.stages_held} of the "
                                   "model, which run together in train_step(inputs, target)")
        return self.program(*inputs_and_target)

    #: where the caller's batches hold the batch (``parallelize(batch_dim=...)``); the program's at dim 0
    batch_dim: BatchDim = 0

    def positional(self, inputs: Any, target: Any) -> tuple[tuple, Any]:
        """A batch as the program takes it: a keyword batch (``model(**batch)``,
        its ``labels`` the target when none is given) in the traced key order,
        the batch of every tensor at dim 0 (:attr:`batch_dim`)."""
        inputs, target = self._keyword(inputs, target)
        return batch_first_all(inputs, target, self.batch_dim)

    def _keyword(self, inputs: Any, target: Any) -> tuple[tuple, Any]:
        """A keyword batch in the traced key order (a positional one as a tuple), and the target."""
        if not isinstance(inputs, dict):
            return as_tuple(inputs), target
        if self.input_keys is None:
            raise StrategyError("train_step got a keyword batch, but the model was traced with positional inputs; "
                                "pass the batch to parallelize as a dict too")
        batch = dict(inputs)
        if target is None and "labels" in batch and "labels" not in self.input_keys:
            target = batch.pop("labels")
        missing = [k for k in self.input_keys if k not in batch]
        extra = [k for k in batch if k not in self.input_keys]
        if missing or extra:
            raise StrategyError(f"train_step: the batch's keys {sorted(batch)} are not the traced ones "
                                f"{list(self.input_keys)}")
        return tuple(batch[k] for k in self.input_keys), target

    def train_step(self, inputs: Any, target: torch.Tensor | None = None) -> float:
        """Forward, backward and optimizer step on this rank; returns the
        global mean loss as a Python float, equal on every rank. Raises
        :class:`StrategyError` for a batch of another size than the plan's,
        :class:`NonFiniteLossError` for a NaN / inf loss (unless
        ``on_nonfinite="skip"``), and :class:`DistributedError` naming this
        rank and the step when a collective fails (a peer stalled past the
        timeout, or died)."""
        t0 = time.perf_counter()
        step = len(self.step_times) + 1
        self.faults.start_step(step)
        try:
            # grad mode set here and restored on the way out: a step raised inside a
            # ``torch.no_grad()`` region of an export graph (its higher-order op does not restore
            # the mode on an exception) would otherwise leave the process without autograd
            with torch.enable_grad(), self._random_stream("train", step):
                return self._train_step(inputs, target, t0)
        except DistributedError:
            raise
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0]
            if not isinstance(e, dist.DistBackendError) and not any(w in first.lower() for w in (
                    "gloo", "nccl", "timed out", "timeout", "connection closed", "connection reset", "pair closure")):
                self.faults.record(e, step)
                raise
            where = first.split("] ", 1)[-1] if first.startswith("[") else first
            who = self.faults.explain(step) or "another rank stalled past the timeout or died: its own error names it"
            err = DistributedError(
                f"rank {self.rank} of {self.world}, step {step}: a collective failed after "
                f"{time.perf_counter() - t0:.1f} s ({where}); {who}")
            err.one_line = True      # printed as one line if uncaught (runtime/faults.py)
            raise err from None
        except Exception as e:    # this rank's own error: left on the store for the others to name
            self.faults.record(e, step)
            raise

    def check_batch(self, inputs: tuple, target: Any) -> None:
        """Refuse a batch unlike the example the model was traced with, in
        one line, before any rank runs it: a list instead of a tuple is fine;
        another count, a non-tensor, another dtype kind (float tokens), other
        sizes past the batch dim, token ids outside an embedding's rows."""
        if not isinstance(target, torch.Tensor):
            raise StrategyError(f"train_step: the target must be a tensor, got {type(target).__name__}")
        if len(inputs) != len(self.example_inputs):
            raise StrategyError(f"train_step: {len(inputs)} input(s), but the model was traced with "
                                f"{len(self.example_inputs)}")
        given = (*inputs, target) if self.example_target is not None else inputs
        for i, (x, (shape, dtype, rows)) in enumerate(zip(given, (*self.example_inputs, self.example_target))):
            what = f"input {i}" if i < len(inputs) else "the target"
            if not isinstance(x, torch.Tensor):
                raise StrategyError(f"train_step: {what} must be a tensor, got {type(x).__name__}")
            if x.dim() != len(shape) or tuple(x.shape[1:]) != shape[1:]:
                # in the caller's layout (the batch at its batch dim)
                dims, at = batch_dims(self.batch_dim, len(inputs))
                d = dims[i] if i < len(inputs) else at
                want = ["batch", *map(str, shape[1:])]
                if len(shape) > d:
                    want.insert(d, want.pop(0))
                has = tuple(batch_where(x, d).shape)
                raise StrategyError(f"train_step: {what} has shape {has}, but the model was traced "
                                    f"with ({', '.join(want)}); the plan's shapes are fixed past the batch dim")
            if x.is_floating_point() != dtype.is_floating_point:
                raise StrategyError(f"train_step: {what} is {x.dtype}, but the model was traced with {dtype}")
            # token ids past an embedding's rows (the target: past the classes; negative ones may be ignored)
            low = 0 if i < len(inputs) else None
            # host tensors only: on a GPU this would wait for the device every step (its kernels assert anyway)
            if rows is not None and x.numel() and x.device.type == "cpu" and (
                    int(x.max()) >= rows or low is not None and int(x.min()) < low):
                kind = "embedding's rows" if i < len(inputs) else "loss's classes"
                raise StrategyError(f"train_step: {what} holds ids in [{int(x.min())}, {int(x.max())}], outside "
                                    f"the {kind} (0..{rows - 1})")

    def _prepare(self, inputs: Any, target: Any, what: str) -> tuple[tuple, torch.Tensor]:
        """This rank's share of a batch, checked, on its device, in the compute dtype."""
        inputs, target = self.positional(inputs, target)
        if target is None:
            raise StrategyError(f"{what} needs a target (or a keyword batch holding 'labels')")
        if self.example_inputs is not None:
            self.check_batch(inputs, target)
        in_dims, tg_dim = self.cp_dims if self.cp_dims is not None else ([None] * len(inputs), None)
        inputs = tuple(self._local_batch(x, d).to(self.device) for x, d in zip(inputs, in_dims))
        target = self._local_batch(target, tg_dim).to(self.device)
        expected = self.global_batch // self.config.dp
        if inputs[0].shape[0] != expected:
            raise StrategyError(f"this plan runs a global batch of {self.global_batch} "
                                f"({expected} per data-parallel rank); got {inputs[0].shape[0]} per rank")
        if self.compute_dtype != torch.float32:
            inputs = tuple(x.to(self.compute_dtype) if x.is_floating_point() else x for x in inputs)
        return inputs, target

    def _train_step(self, inputs: Any, target: torch.Tensor, t0: float) -> float:
        inputs, target = self._prepare(inputs, target, "train_step")
        m = self.config.microbatches
        dopt = self.dist_optimizer
        if dopt is not None:
            dopt.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        scale = dopt.loss_scale if dopt is not None else 1.0
        total = torch.zeros((), device=self.device)
        micro = list(zip(zip(*(x.chunk(m, 0) for x in inputs)), target.chunk(m, 0)))
        weights = self._token_weights(micro)
        if self.pipeline is None:
            for i, (xs, tg) in enumerate(micro):
                if dopt is not None:   # the gradient buckets are reduced during the last backward
                    dopt.start_microbatch(last=i == m - 1)
                with regather.scope():      # sequence parallel: saved as shards, gathered again
                    loss = self.program(*xs, tg)
                (loss * (scale * self.grad_scale * weights[i] / m)).backward()
                if weights[i] != 0:     # a part with nothing counted: 0/0, weighed 0
                    total += loss.detach().float() * weights[i] / m
        else:
            if dopt is not None:    # a pipeline's backwards interleave: reduce after the flush
                dopt.start_microbatch(last=False)
            self.pipeline.loss_scale = scale * self.grad_scale
            self.pipeline.weights = weights
            loss = self.pipeline.run([(*xs, tg) for xs, tg in micro], t0)
            if loss is not None:   # this rank holds the last stage
                total += loss.float()
        if self.pipeline is not None:
            dist.broadcast(total, self.mesh.group_ranks("pp")[-1], group=self.pp_group)
        if self.fsdp:
            self._average_unsharded()
        total = self._mean_over_replicas(total)
        # the loss is now the same on every rank, so every rank takes the same branch
        if not math.isfinite(float(total)) and self.config.precision != "fp16":   # fp16: the scaler skips
            self._non_finite(float(total))
        elif dopt is not None:   # weights tied across pipeline ranks are summed there first
            if not dopt.step():
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            if self.max_grad_norm is not None:
                self._clip_fsdp()
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.step_times.append(time.perf_counter() - t0)
        return float(total)

    @property
    def grad_norm(self) -> float | None:
        """The global 2-norm of the last step's gradients before clipping
        (None unless ``max_grad_norm`` is set); the same on every rank."""
        return self.dist_optimizer.grad_norm if self.dist_optimizer is not None else self._fsdp_grad_norm

    _fsdp_grad_norm: float | None = None

    @torch.no_grad()
    def _token_weights(self, micro: list) -> list[float]:
        """Each microbatch's weight in the step's mean loss: 1, or where the
        loss averages its target's counted tokens (:attr:`token_counter`),
        the microbatch's share of the tokens of the whole batch (summed over
        the data- and context-parallel ranks, one small all-reduce each) times the parts, so
        that the ranks' and microbatches' mean is one process's loss. A part
        with no counted token (its loss 0/0) weighs 0 and adds a zero
        gradient; where the whole batch counts none, the weights are NaN, as
        one process's loss is."""
        m = len(micro)
        if self.token_counter is None:
            return [1.0] * m
        counts = torch.stack([self.token_counter(*xs, tg).to(torch.float64) for xs, tg in micro])
        total = counts.sum()
        if self.config.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        if self.cp_group is not None:     # a cp rank's target is its positions' share
            dist.all_reduce(total, group=self.cp_group)
        return (counts * (m * self.config.dp * self.config.cp) / total).tolist()

    def _unsharded(self) -> list[nn.Parameter]:
        """The parameters FSDP2 left whole (0-d ones), kept per step's program."""
        if self._unsharded_params is None:
            self._unsharded_params = unsharded_params(
                [self.program] if self.program is not None else list(self.stage_modules))
        return self._unsharded_params

    _unsharded_params: list[nn.Parameter] | None = None

    def _average_unsharded(self) -> None:
        """ZeRO-3: average the gradients of the parameters FSDP2 left whole
        over the data-parallel (and context-parallel) ranks, as FSDP2's
        reduce-scatter does for the others."""
        grads = [p.grad for p in self._unsharded() if p.grad is not None]
        for group in (self.dp_group if self.config.dp > 1 else None, self.cp_group):
            if group is not None and grads:
                C.all_reduce_mean_(grads, group)

    def _clip_fsdp(self) -> None:
        """Clip under FSDP2 (zero=3): each dp rank holds its own shard of every
        grad, and the whole of those FSDP2 left whole (counted once)."""
        grads = [(name, p.grad) for name, p in self._local_tensors().items()
                 if isinstance(p, nn.Parameter) and p.grad is not None]
        whole = {id(p.grad) for p in self._unsharded() if p.grad is not None}
        local = [(name, g.to_local() if hasattr(g, "to_local") else g) for name, g in grads]
        replicas = self.config.dp * self.config.cp
        terms = [(g, 1.0 / (self.grad_copies.get(name, 1) * (replicas if id(h) in whole else 1)))
                 for (name, g), (_, h) in zip(local, grads)]
        self._fsdp_grad_norm = clip_grad_norm_(terms, [g for _, g in local], self.max_grad_norm, device=self.device)

    def _non_finite(self, loss: float) -> None:
        """A NaN / inf loss: drop the step's gradients, then skip the update
        (``on_nonfinite="skip"``) or raise :class:`NonFiniteLossError`."""
        if self.dist_optimizer is not None:
            self.dist_optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"step {len(self.step_times) + 1}: the loss is {loss}; the weights are left as they were before this "
                f"step. Check the inputs and the learning rate, or pass on_nonfinite='skip' to parallelize() to skip "
                f"such steps")
        self.skipped_steps += 1

    @torch.no_grad()
    def eval_step(self, inputs: Any, target: torch.Tensor | None = None) -> float:
        """The global mean loss of one batch without a backward or an update
        (a keyword batch as for :meth:`train_step`), equal on every rank.
        It runs the traced program: ops traced in training mode (dropout)
        stay so, as ``model.eval()`` cannot change a traced graph; trace with
        dropout 0 to evaluate exactly. Not with a pipeline yet
        (:class:`UnsupportedError`)."""
        if self.pipeline is not None:
            raise UnsupportedError("eval_step with a pipeline (pp > 1) is not supported yet: its stages run only "
                                   "in train_step's schedule")
        inputs, target = self._prepare(inputs, target, "eval_step")
        m = self.config.microbatches
        total = torch.zeros((), device=self.device)
        micro = list(zip(zip(*(x.chunk(m, 0) for x in inputs)), target.chunk(m, 0)))
        self._evals += 1
        with self._random_stream("eval", self._evals):
            for (xs, tg), w in zip(micro, self._token_weights(micro)):
                total += self.program(*xs, tg).float() * w / m
        return float(self._mean_over_replicas(total))

    def _random_stream(self, kind: str, step: int) -> Any:
        """The random numbers of one step (dropout masks): with :attr:`rng_seed`
        set, drawn from a stream seeded by it, the step and this rank's data
        replica (dp, pipeline stage, cp: their samples and positions differ),
        the same on every rank of a tensor-parallel group, so a value the group
        holds replicated is dropped alike on each (ranks seeded apart, as
        ``torch.manual_seed(seed + rank)`` does, ran them apart); the caller's
        generators are restored afterwards. Without it, a no-op."""
        if self.rng_seed is None:
            return contextlib.nullcontext()
        cp = self.mesh.coord("cp") if self.cp_group is not None else 0
        seed = K.seed_of(self.rng_seed, kind, step, self.dp_rank, self.pp_rank, cp)
        cuda = self.device.type == "cuda"
        return K.seeded(seed, [self.device.index if self.device.index is not None else torch.cuda.current_device()]
                        if cuda else [])

    # -- checkpoints ----------------------------------------------------------
    #: steps taken before this module loaded a checkpoint (``steps`` counts them too)
    start_step = 0

    @property
    def steps(self) -> int:
        """Training steps taken, those before the checkpoint it resumed from included."""
        return self.start_step + len(self.step_times)

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Save weights, optimizer state (master weights, ZeRO / FSDP2 shards),
        step count and loss scale to the directory ``path``, in a form any
        plan or world size loads (collective: every rank calls it); atomic.
        See :mod:`autopar.runtime.checkpoint`."""
        return checkpoint.save(self, path)

    def load_checkpoint(self, path: str | os.PathLike, *, optimizer: bool = True) -> dict:
        """Load a checkpoint written under any plan or world size
        (collective); ``optimizer=False``: only the weights and step count.
        Returns its metadata. Raises :class:`~autopar.errors.CheckpointError`."""
        return checkpoint.load(self, path, optimizer=optimizer)

    # -- inspection -----------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights, keyed like the original model's ``state_dict()``
        (collective: every rank of the tensor-parallel group must call it;
        with a pipeline or FSDP2, every rank)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self._local_tensors().items():
            p = self.param_placement.get(name, "R")
            full = full_tensor(t)     # FSDP2's shards gathered (zero=3, fsdp_layers); plain tensors as they are
            if full.is_floating_point() and full.dtype != torch.float32:
                full = full.float()    # bf16/fp16 weights (rounded copies of the fp32 master)
            if is_shard(p) and self.config.tp > 1:
                full = unblock(C.all_gather(full, shard_dim(p), self.tp_group), shard_dim(p), self.config.tp_grid[-1],
                               shard_blocks(p))
            row = self.row_placement.get(name, "R")
            if is_shard(row):            # tp_mode=2d: the grid's rows hold the column shard split again
                full = C.all_gather(full, shard_dim(row), self.row_group)
            depth = self.depth_placement.get(name, "R")
            if is_shard(depth):          # tp_mode=3d: the cube's depth holds the rows' shard split again
                full = C.all_gather(full, shard_dim(depth), self.depth_group)
            for key in self.state_names.keys_of(name):
                out[key] = full.cpu()
        if self.pipeline is not None:
            parts: list[Any] = [None] * self.config.pp
            dist.all_gather_object(parts, out, group=self.pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        for k, v in self.state_names.constant.items():
            out.setdefault(k, v.clone())
        return out

    def measured_timeline(self) -> Timeline:
        """The last step's pipeline actions as they ran on every pipeline rank,
        times relative to each rank's step start (collective over the pipeline
        group), to compare with the schedule's simulated timeline. Raises
        :class:`StrategyError` without a pipeline."""
        if self.pipeline is None:
            raise StrategyError(f"measured_timeline() needs a pipeline (pp > 1); this module runs "
                                f"{self.config.to_string()}")
        parts: list[Any] = [None] * self.config.pp
        dist.all_gather_object(parts, self.pipeline.events, group=self.pp_group)
        return Timeline.from_events([e for part in parts for e in part], self.config.pp, self.config.chunks)

    def plot_timeline(self, path: str | os.PathLike, measured: Timeline | None = None) -> Path:
        """Draw the plan's predicted schedule above a measured one (default:
        the last step's, from :meth:`measured_timeline`, which makes this a
        collective over the pipeline group) into the PNG ``path``; returns its
        path. Raises :class:`StrategyError` when this module was built without
        a way to draw (or, from :meth:`measured_timeline`, without a pipeline)."""
        measured = measured if measured is not None else self.measured_timeline()
        if self._draw_timeline is None:
            raise StrategyError("this ParallelModule was built without draw_timeline: it cannot draw the "
                                "plan's predicted schedule")
        return self._draw_timeline(path, measured)

    def describe(self) -> str:
        """Where each parameter lives on this rank."""
        where = f"pp {self.pp_rank}/{self.config.pp} (stages {self.stages_held}), " if self.pipeline else ""
        lines = [f"rank {self.rank}: {where}dp {self.dp_rank}/{self.config.dp}, tp {self.tp_rank}/{self.config.tp}, "
                 f"{self.comms} collectives in the program"]
        for name, t in self._local_tensors().items():
            if isinstance(t, nn.Parameter):
                lines.append(f"  {name}: {tuple(t.shape)} {self.param_placement.get(name, 'R')}")
        return "\n".join(lines)
