"""``autopar.parallelize``: plan (or take a plan), compile this rank's program, train.

Every rank runs the same script (under ``torchrun``, or in any process group
the user created). The returned :class:`ParallelModule` holds this rank's
shards as its parameters and runs a whole training step with
:meth:`ParallelModule.train_step`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import api
from ..compile.rewrite import LocalProgram, _get_attr, compile_local
from ..errors import PlanError, StrategyError, UnsupportedError
from ..pipeline.partition import assign, even_layers, units
from ..pipeline.schedule import Timeline
from ..plan import Plan
from ..search.propagate import scaled_shapes
from ..search.space import ParallelConfig
from ..strategies import is_shard, shard_dim
from ..trace import trace, with_loss
from . import collectives as C
from . import regions as R_
from .dist import Mesh, init_process_group, local_device
from .optim import DistributedOptimizer
from .pipeline import PipelineExecutor, split_stages, tied_params

_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def default_cluster() -> str:
    """The preset matching the machine this runs on (``cpu`` without CUDA)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        if "h100" in name or "h200" in name:
            return "dgx-h100"
        if "a100" in name:
            return "dgx-a100-80g"
        return "dgx-a100-80g"
    return "cpu"


def _as_tuple(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x)


def parallelize(model: nn.Module, example_inputs: Any, *, loss_fn: Callable, example_target: Any = None,
                optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                strategy: str | Plan | os.PathLike | ParallelConfig = "auto", cluster: Any = None,
                full_batch: bool = True, global_batch: int | None = None, backend: str | None = None,
                seed_broadcast: bool = True, search_mode: str | None = None,
                shardings: dict[str, Any] | None = None) -> "ParallelModule":
    """Parallelize ``model`` over the current process group and return a
    :class:`ParallelModule`.

    * ``example_inputs``: one batch of inputs as every rank would pass it to
      ``train_step`` (the global batch when ``full_batch=True``, this rank's
      data-parallel shard when ``False``). ``example_target`` defaults to a
      zero tensor shaped like the first input, enough for tracing most losses.
    * ``loss_fn(output, target)`` -> mean loss; it is traced with the model.
    * ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (default SGD lr 0.01).
    * ``strategy``: ``"auto"`` (search the strategies this release can run),
      a manual string ``"dp=2,tp=2"``, a :class:`Plan` or a plan file.
    * ``cluster``: preset name or cluster file for the predictions (default:
      the machine this runs on).
    * ``search_mode`` and ``shardings`` (pins; :func:`autopar.shard`
      annotations on ``model`` count too): as for :func:`autopar.plan`. With a
      manual strategy and a ``search_mode``, the per-op placements on that
      mesh are searched.

    The process group is created from the torchrun environment when none
    exists. Raises :class:`StrategyError` / :class:`PlanError` for strategies
    that do not fit this world or model, :class:`UnsupportedError` for valid
    strategies this release cannot run (pipelines, recompute or ZeRO-3 over a
    torch.export graph; fp16 with ZeRO-3).
    """
    rank, world = init_process_group(backend)
    inputs = _as_tuple(example_inputs)
    if example_target is None:
        # integer inputs: a language model, targets shaped like the tokens;
        # float inputs: a classifier, one class id per sample
        first = inputs[0]
        shape = first.shape if not first.is_floating_point() else first.shape[:1]
        example_target = torch.zeros(shape, dtype=torch.long)
    cluster = cluster or default_cluster()
    plan_obj: Plan | None = None
    if isinstance(strategy, (str, os.PathLike)) and str(strategy).endswith(".json") or \
            isinstance(strategy, Path):
        plan_obj = Plan.load(strategy)
    elif isinstance(strategy, Plan):
        plan_obj = strategy
    # Trace model + loss. With full_batch=False, the inputs are this rank's
    # shard: the global batch is that times dp, known once dp is.
    graph = trace(model, inputs, loss_fn=loss_fn, target=example_target)
    batch = graph.batch_size
    from ..search import pins as _pins
    pins = {**_pins.annotations(model), **(shardings or {})}
    if plan_obj is not None:
        plan_obj.check_model(graph.fingerprint, type(model).__name__)
        cfg = api.config_from_plan(plan_obj)
        if cfg.devices != world:
            raise PlanError(f"the plan is for {cfg.devices} devices (dp={cfg.dp}, tp={cfg.tp}, pp={cfg.pp}), "
                            f"but this job has {world} processes")
        gbatch = plan_obj.data["global_batch"]
    else:
        gbatch = global_batch or batch
        if strategy == "auto":
            if not full_batch and global_batch is None:
                raise StrategyError("strategy='auto' with full_batch=False needs global_batch=")
            plan_obj = api.plan(graph, cluster=cluster, devices=world, global_batch=gbatch,
                                executable_only=True, search_mode=search_mode, shardings=pins)
        else:
            plan_obj = api.plan(graph, cluster=cluster, devices=world, global_batch=gbatch
                                if full_batch else batch * _dp_of(str(strategy), world),
                                strategy=str(strategy), search_mode=search_mode, shardings=pins)
        cfg = api.config_from_plan(plan_obj)
        gbatch = plan_obj.data["global_batch"]
    if graph.frontend != "fx" and (cfg.recompute != "none" or cfg.zero == 3):
        raise UnsupportedError(f"recompute={cfg.recompute},zero={cfg.zero} needs a model traced by torch.fx (its "
                               "layers become regions to recompute or shard); this one was traced with torch.export: "
                               "use recompute=none and zero<=2")
    if cfg.zero == 3 and cfg.precision == "fp16":
        raise UnsupportedError("zero=3 with precision=fp16: FSDP2 has no dynamic loss scaling here; use bf16 "
                               "(same exponent range as fp32, no scaling needed) or zero<=2")
    return ParallelModule(model, graph, plan_obj, cfg, loss_fn=loss_fn, optimizer=optimizer,
                          full_batch=full_batch, global_batch=gbatch, rank=rank, world=world,
                          seed_broadcast=seed_broadcast)


def _dp_of(strategy: str, world: int) -> int:
    from ..search.space import parse_strategy
    return parse_strategy(strategy, world).dp


class ParallelModule(nn.Module):
    """This rank's part of a parallelized model.

    ``parameters()`` are this rank's shards (plain tensors; with a pipeline,
    only those of the stages this rank holds); ``plan`` is the Plan with its
    predictions; ``train_step(inputs, target)`` runs forward, backward and the
    optimizer step and returns the global mean loss (the same float on every
    rank); ``full_state_dict()`` gathers unsharded weights.

    With ``pp > 1`` the ranks form a ``(pp, dp, tp)`` mesh (pp outermost, tp
    fastest, as Megatron lays it out); pipeline rank ``r`` holds virtual stages
    ``r, r + pp, ...`` and runs them with a :class:`PipelineExecutor`.
    """

    def __init__(self, model: nn.Module, graph, plan: Plan, cfg: ParallelConfig, *, loss_fn: Callable,
                 optimizer: Callable | None, full_batch: bool, global_batch: int, rank: int, world: int,
                 seed_broadcast: bool) -> None:
        super().__init__()
        self.plan = plan
        self.config = cfg
        self.full_batch = full_batch
        self.global_batch = global_batch
        self.rank, self.world = rank, world
        if cfg.pp > 1:
            self.mesh = Mesh.build((cfg.pp, cfg.dp, cfg.tp), ("pp", "dp", "tp"))
        else:
            self.mesh = Mesh.build((cfg.dp, cfg.tp), ("dp", "tp"))
        self.dp_group, self.tp_group = self.mesh.group("dp"), self.mesh.group("tp")
        self.dp_rank, self.tp_rank = self.mesh.coord("dp"), self.mesh.coord("tp")
        self.pp_group = self.mesh.group("pp") if cfg.pp > 1 else None
        self.pp_rank = self.mesh.coord("pp") if cfg.pp > 1 else 0
        self.device = local_device()
        self._prefix = graph.loss_prefix
        self._tied: dict[str, list[str]] = {}    # a tied tensor's name -> its other names
        for alias, canon in graph.aliases.items():
            self._tied.setdefault(canon, []).append(alias)
        self._state_keys = set(model.state_dict().keys())   # non-persistent buffers are left out
        self.step_times: list[float] = []
        self.skipped_steps = 0     # fp16: steps skipped on a gradient overflow
        self.pipeline: PipelineExecutor | None = None
        self._tie_groups: list[tuple[torch.Tensor, Any]] = []
        self.stages_held: list[int] = []
        if seed_broadcast and world > 1:
            # every rank must start from the same weights (as DDP does)
            C.broadcast_params_(list(model.parameters()) + list(model.buffers()), dist.group.WORLD, 0)
        if cfg.pp > 1:
            self._build_pipeline(graph, plan, global_batch)
        elif cfg.tp == 1 and graph.frontend != "fx":
            self.program = with_loss(model, loss_fn, len(graph.inputs) - 1).to(self.device)
            self.param_placement = {n: "R" for n, _ in self.program.named_parameters()}
            self.comms = 0
        else:
            prog = self._compile(graph, plan, global_batch)
            self.program = prog.module.to(self.device)
            self.param_placement = prog.param_placement
            self.comms = prog.comms
            if cfg.recompute != "none" or cfg.zero == 3:
                self.program = R_.apply_recompute(R_.layer_regions(self.program, graph), cfg.recompute)
        self.compute_dtype = _LOW.get(cfg.precision, torch.float32)
        factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.01))
        self.fsdp = cfg.zero == 3
        if self.fsdp:
            if self.mesh.device_mesh is None:
                raise UnsupportedError("zero=3 runs on torch FSDP2, which needs a torch DeviceMesh; "
                                       "init_device_mesh failed on this process group")
            R_.fully_shard_regions(self.program, self.mesh.device_mesh["dp"],
                                   param_dtype=_LOW.get(cfg.precision),
                                   reduce_dtype=_LOW.get(cfg.reduce_dtype) if cfg.reduce_dtype else
                                   (torch.float32 if cfg.precision in _LOW else None),
                                   offload=cfg.offload == "optimizer")
            params = [p for p in self.parameters() if p.requires_grad]
            self.dist_optimizer = None
            self.optimizer = factory(params)
        else:
            if self.compute_dtype != torch.float32:
                for mod in ([self.program] if self.program is not None else list(self.stage_modules)):
                    for b in mod.buffers():   # rotary tables, masks: in the compute dtype too
                        if b.is_floating_point():
                            b.data = b.data.to(self.compute_dtype)
            params = [p for p in self.parameters() if p.requires_grad]
            self.dist_optimizer = DistributedOptimizer(
                params, factory, self.dp_group, zero=cfg.zero, precision=cfg.precision or "fp32",
                reduce_dtype=cfg.reduce_dtype or None, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap,
                offload=cfg.offload == "optimizer", tied=self._tie_groups)
            self.optimizer = self.dist_optimizer.optimizer

    def _compile(self, graph, plan: Plan, global_batch: int) -> LocalProgram:
        """This tensor-parallel rank's program of the whole model."""
        cfg = self.config
        tp_sh = api.sharding_from_plan(graph, plan)
        if tp_sh is None:  # the plan was made with another loss: derive the same strategy here
            ev = api._evaluator(graph, plan.data["cluster"]["spec"], plan.data["optimizer"],
                                plan.data["precision"])
            tp_sh, _ = ev.sharding(cfg, global_batch)
        shapes = scaled_shapes(graph, global_batch // cfg.microbatches, cfg.dp)
        gm = graph.gm
        full = {n.target: _get_attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        return compile_local(graph, tp_sh, shapes, tp_rank=self.tp_rank, tp_group=self.tp_group, params=full)

    def _build_pipeline(self, graph, plan: Plan, global_batch: int) -> None:
        """Compile the whole program, keep the stages of this pipeline rank and
        their executor; only those stages' parameters stay on this rank."""
        cfg = self.config
        if graph.frontend != "fx":
            raise UnsupportedError(f"pipeline parallelism (pp={cfg.pp}) needs a model traced by torch.fx; this one "
                                   "was traced with torch.export, which this release runs data-parallel only: "
                                   "use pp=1,tp=1")
        layers = (plan.data.get("pipeline") or {}).get("layers") or even_layers(units(graph).layers, cfg.stages)
        if len(layers) != cfg.stages:
            raise PlanError(f"the plan's pipeline gives layer counts {list(layers)} for {len(layers)} stages, but "
                            f"pp={cfg.pp} x chunks={cfg.chunks} needs {cfg.stages}")
        stage_of = assign(graph, layers)
        prog = self._compile(graph, plan, global_batch)
        self.stages_held = list(range(self.pp_rank, cfg.stages, cfg.pp))
        stages = split_stages(prog.module.to(self.device), graph, stage_of, self.stages_held)
        if cfg.recompute != "none":
            for s in stages:
                s.module = R_.apply_recompute(R_.layer_regions(s.module, graph), cfg.recompute)
        self.program = None
        self.stage_modules = nn.ModuleList(s.module for s in stages)
        local = self._local_tensors()
        self.param_placement = {k: v for k, v in prog.param_placement.items() if k in local}
        self.comms = sum(s.comms for s in stages)
        self._tie_groups = self._tie(tied_params(graph, stage_of, cfg.pp), local)
        self.pipeline = PipelineExecutor(
            stages, schedule=cfg.schedule, pp=cfg.pp, pp_rank=self.pp_rank, microbatches=cfg.microbatches,
            chunks=cfg.chunks, ranks=self.mesh.group_ranks("pp"), group=self.pp_group, device=self.device,
            input_names=[n.name for n in prog.module.graph.nodes if n.op == "placeholder"])

    def _tie(self, tied: dict[str, list[int]], local: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """A group per tied weight and (dp, tp) coordinate over the pipeline
        ranks holding a copy (every rank creates every group, in the same
        order); returns this rank's (copy, group) pairs. The copies start equal
        and get the same summed gradient, so they stay equal."""
        cfg = self.config
        out = []
        for name, pp_ranks in tied.items():
            for d in range(cfg.dp):
                for t in range(cfg.tp):
                    members = [(p * cfg.dp + d) * cfg.tp + t for p in pp_ranks]
                    group = dist.new_group(members)
                    if self.rank in members:
                        out.append((local[name], group))
        return out

    def _local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, then buffers, by their names in the program
        (each once; names inside layer regions mapped back)."""
        mods = [self.program] if self.program is not None else list(self.stage_modules)
        out: dict[str, torch.Tensor] = {}
        for mod in mods:
            names = {**getattr(mod, "param_names", {}), **getattr(mod, "buffer_names", {})}
            out.update((names.get(k, k), v) for k, v in mod.named_parameters())
        for mod in mods:
            names = {**getattr(mod, "param_names", {}), **getattr(mod, "buffer_names", {})}
            out.update((names.get(k, k), v) for k, v in mod.named_buffers())
        return out

    # -- training -------------------------------------------------------------
    def _local_batch(self, t: torch.Tensor) -> torch.Tensor:
        if not self.full_batch or self.config.dp == 1:
            return t
        if t.shape[0] % self.config.dp:
            raise StrategyError(f"batch of {t.shape[0]} is not divisible by dp={self.config.dp}")
        return t.chunk(self.config.dp, dim=0)[self.dp_rank]

    def forward(self, *inputs_and_target: torch.Tensor) -> torch.Tensor:
        """The local loss of one (local) microbatch (without a pipeline: a
        pipeline's stages only run together, in :meth:`train_step`)."""
        if self.pipeline is not None:
            raise UnsupportedError(f"pipeline rank {self.pp_rank} holds only stages {self.stages_held} of the "
                                   "model, which run together in train_step(inputs, target)")
        return self.program(*inputs_and_target)

    def train_step(self, inputs: Any, target: torch.Tensor) -> float:
        """Forward, backward and optimizer step on this rank; returns the
        global mean loss as a Python float, equal on every rank."""
        t0 = time.perf_counter()
        inputs = tuple(self._local_batch(x).to(self.device) for x in _as_tuple(inputs))
        target = self._local_batch(target).to(self.device)
        m = self.config.microbatches
        expected = self.global_batch // self.config.dp
        if inputs[0].shape[0] != expected:
            raise StrategyError(f"this plan runs a global batch of {self.global_batch} "
                                f"({expected} per data-parallel rank); got {inputs[0].shape[0]} per rank")
        if self.compute_dtype != torch.float32:
            inputs = tuple(x.to(self.compute_dtype) if x.is_floating_point() else x for x in inputs)
        dopt = self.dist_optimizer
        if dopt is not None:
            dopt.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        scale = dopt.loss_scale if dopt is not None else 1.0
        total = torch.zeros((), device=self.device)
        micro = list(zip(zip(*(x.chunk(m, 0) for x in inputs)), target.chunk(m, 0)))
        if self.pipeline is None:
            for i, (xs, tg) in enumerate(micro):
                if dopt is not None:   # the gradient buckets are reduced during the last backward
                    dopt.start_microbatch(last=i == m - 1)
                loss = self.program(*xs, tg)
                (loss * (scale / m)).backward()
                total += loss.detach().float() / m
        else:
            if dopt is not None:    # a pipeline's backwards interleave: reduce after the flush
                dopt.start_microbatch(last=False)
            self.pipeline.loss_scale = scale
            loss = self.pipeline.run([(*xs, tg) for xs, tg in micro], t0)
            if loss is not None:   # this rank holds the last stage
                total += loss.float()
        if dopt is not None:   # weights tied across pipeline ranks are summed there first
            if not dopt.step():
                self.skipped_steps += 1
        else:
            self.optimizer.step()
        if self.pipeline is not None:
            dist.broadcast(total, self.mesh.group_ranks("pp")[-1], group=self.pp_group)
        if self.config.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.config.dp
        self.step_times.append(time.perf_counter() - t0)
        return float(total)

    # -- inspection -----------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights, keyed like the original model's ``state_dict()``
        (collective: every rank of the tensor-parallel group must call it;
        with a pipeline, every rank)."""
        out: dict[str, torch.Tensor] = {}
        pre = self._prefix

        def strip(name: str) -> str:
            return name[len(pre):] if pre and name.startswith(pre) else name

        for name, t in self._local_tensors().items():
            p = self.param_placement.get(name, "R")
            full = R_.full_tensor(t) if self.fsdp else t.detach()
            if full.is_floating_point() and full.dtype != torch.float32:
                full = full.float()    # bf16/fp16 weights (rounded copies of the fp32 master)
            if is_shard(p) and self.config.tp > 1:
                full = C.all_gather(full, shard_dim(p), self.tp_group)
            for full_name in [name] + self._tied.get(name, []):
                key = strip(full_name)
                if key in self._state_keys:
                    out[key] = full.cpu()
        if self.pipeline is not None:
            parts: list[Any] = [None] * self.config.pp
            dist.all_gather_object(parts, out, group=self.pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def measured_timeline(self) -> Timeline:
        """The last step's pipeline actions as they ran on every pipeline rank,
        times relative to each rank's step start (collective over the pipeline
        group), to compare with the schedule's simulated timeline."""
        if self.pipeline is None:
            raise StrategyError(f"measured_timeline() needs a pipeline (pp > 1); this module runs "
                                f"{self.config.to_string()}")
        parts: list[Any] = [None] * self.config.pp
        dist.all_gather_object(parts, self.pipeline.events, group=self.pp_group)
        return Timeline.from_events([e for part in parts for e in part], self.config.pp, self.config.chunks)

    def plot_timeline(self, path: str | os.PathLike, measured: Timeline | None = None) -> Path:
        """Draw the plan's predicted schedule above a measured one (default:
        the last step's, from :meth:`measured_timeline`, which makes this a
        collective over the pipeline group) into the PNG ``path``."""
        from ..pipeline.timeline import plot_timeline, predicted_timeline
        measured = measured if measured is not None else self.measured_timeline()
        return plot_timeline(predicted_timeline(self.plan), path, title=self.plan.strategy, measured=measured)

    def describe(self) -> str:
        """Where each parameter lives on this rank."""
        where = f"pp {self.pp_rank}/{self.config.pp} (stages {self.stages_held}), " if self.pipeline else ""
        lines = [f"rank {self.rank}: {where}dp {self.dp_rank}/{self.config.dp}, tp {self.tp_rank}/{self.config.tp}, "
                 f"{self.comms} collectives in the program"]
        for name, t in self._local_tensors().items():
            if isinstance(t, nn.Parameter):
                lines.append(f"  {name}: {tuple(t.shape)} {self.param_placement.get(name, 'R')}")
        return "\n".join(lines)
