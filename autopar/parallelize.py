"""``autopar.parallelize``: plan (or take a plan), compile this rank's program, train.

Every rank runs the same script (under ``torchrun``, or in any process group
the user created). :func:`parallelize` is a short driver over steps that each
do one thing, in the manner of torchtitan's ``parallelize_llama``:

1. :func:`resolve_plan`: the :class:`~autopar.plan.Plan` (searched, evaluated
   from a manual strategy, or given) and its strategy;
2. :func:`apply_tp`: this tensor-parallel rank's program of the whole model
   (local shards and explicit collectives); with ``cp > 1`` compiled from the
   model traced at the local sequence length (:func:`trace_local_sequence`)
   and rewritten for this rank's positions by :func:`apply_cp`;
3. :func:`apply_pipeline`: with ``pp > 1``, the stages this pipeline rank holds;
4. :func:`apply_recompute`: layer regions that recompute their activations;
5. :func:`apply_fsdp`: ZeRO-3 with torch FSDP2 over those regions;
6. :func:`apply_optimizer`: the optimizer (ZeRO 1/2, mixed precision,
   overlapped gradient reduction) over this rank's parameters.

The result is a :class:`~autopar.runtime.parallel.ParallelModule`, which only
executes: its :meth:`~autopar.runtime.parallel.ParallelModule.train_step`
runs forward, backward and the optimizer step.
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import api, ops
from .compile.fx_utils import get_attr, matmuls_in_dtype, random_ops, retarget_devices, to_device
from .compile.context import apply_cp as _apply_cp
from .compile.copies import apply_copies as _apply_copies
from .compile.regions import layer_labels, layer_regions
from .compile.rewrite import Axis, LocalProgram, compile_local
from .compile.stages import split_stages, tied_params
from .compile.tokens import guard_empty_ratio, token_counter
from .cost import fsdp_layer_params
from .errors import CompileError, PlanError, StrategyError, UnsupportedError
from .graph import Graph
from .pipeline.partition import assign, even_layers, units
from .pipeline.schedule import Timeline
from .plan import Plan
from .runtime import collectives as C
from .runtime import regions as R_
from .runtime.dist import Mesh, init_process_group, local_device
from .runtime.optim import DistributedOptimizer, check_max_norm
from .runtime.parallel import LOW_PRECISION, BatchDim, ParallelModule, StateNames, as_tuple, batch_first_all, \
    local_tensors
from .runtime.pipeline import PipelineExecutor, StageModule, tie_groups
from .search import pins as _pins
from .sharding import AxisSharding, batch_reduction, follow_batch, grid_rows, loss_denominator, meeting_limits, \
    mislaid_batch, positions_reduced_with_samples, samples_meet, scaled_shapes
from .spec import MESH_MODES, ParallelConfig, check_grid, is_shard, parse_strategy
from .spec.placement import R, joint_placement
from .strategies.context import positions, sequence_length
from .trace import batch_meets, keyword_inputs, trace

__all__ = ["parallelize", "resolve_plan", "check_runnable", "build_mesh", "apply_tp", "apply_cp", "apply_loss_parts",
           "trace_local_sequence", "apply_copies", "apply_pipeline", "apply_stages",
           "PipelineStages", "apply_recompute", "apply_fsdp", "apply_optimizer", "default_cluster"]


def parallelize(model: nn.Module, example_inputs: Any, *, loss_fn: Callable | str, example_target: Any = None,
                optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                strategy: str | Plan | os.PathLike | ParallelConfig = "auto", cluster: Any = None,
                full_batch: bool = True, global_batch: int | None = None, backend: str | None = None,
                seed_broadcast: bool = True, search_mode: str | None = None,
                shardings: dict[str, Any] | None = None, on_nonfinite: str = "raise",
                timeout_s: float = 600, lr_scheduler: Callable[[Any], Any] | None = None,
                max_grad_norm: float | None = None, batch_dim: BatchDim = 0) -> ParallelModule:
    """Parallelize ``model`` over the current process group and return a
    :class:`~autopar.runtime.parallel.ParallelModule`.

    * ``example_inputs``: one batch of inputs as every rank would pass it to
      ``train_step`` (the global batch when ``full_batch=True``, this rank's
      data-parallel shard when ``False``). ``example_target`` defaults to a
      zero tensor shaped like the first input, enough for tracing most losses.
    * ``batch_dim``: the dim of the inputs and the target that holds the
      batch (default 0). PyTorch's ``nn.Transformer*``,
      ``nn.MultiheadAttention``, ``nn.LSTM`` and ``nn.GRU`` take ``[seq,
      batch, ...]`` by default (``batch_first=False``): pass ``batch_dim=1``
      and the batches to ``train_step`` in that layout too. It applies to
      every tensor of more dims than it; tensors of fewer dims (a label per
      sample) hold the batch at dim 0. A tuple gives one per input, then the
      target's (``nn.Transformer``'s ``src, tgt, src_key_padding_mask``:
      ``(1, 1, 0)``).
    * ``loss_fn(output, target)`` -> mean loss; it is traced with the model.
      ``loss_fn="labels"``: the model's own loss, ``model(*inputs,
      labels=target).loss`` (Hugging Face models).
    * ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (default SGD lr 0.01).
    * ``strategy``: ``"auto"`` (search the strategies this release can run),
      a manual string ``"dp=2,tp=2"``, a :class:`Plan` or a plan file.
    * ``cluster``: preset name or cluster file for the predictions (default:
      the machine this runs on).
    * ``on_nonfinite``: what a NaN / inf loss does (all ranks agree, the
      loss being all-reduced): ``"raise"`` (default) a
      :class:`NonFiniteLossError` naming the step, its update not applied;
      ``"skip"`` drops the step (``skipped_steps`` counts it). fp16's loss
      scaler skips overflowing steps by itself.
    * ``lr_scheduler``: a factory ``optimizer -> torch.optim.lr_scheduler``
      over the optimizer that updates the weights (the master weights under
      ZeRO or low precision); stepped after every applied update, not after a
      skipped one.
    * ``max_grad_norm``: clip the gradients to this global 2-norm before
      each update, as ``torch.nn.utils.clip_grad_norm_`` on the single-device
      model would (the norm over every shard, each tp replica and tied
      copy counted once; ``pm.grad_norm`` is the last step's norm before
      clipping). None (default): no clipping.
    * ``timeout_s`` (default 600): every wait of every process group this
      job uses (the world's and each mesh axis's) ends after this many
      seconds: a rank that stalls or dies makes the others raise
      :class:`DistributedError` instead of waiting torch's 30 minutes.
    * ``search_mode`` and ``shardings`` (pins; :func:`autopar.shard`
      annotations on ``model`` count too): as for :func:`autopar.plan`. With a
      manual strategy and a ``search_mode``, the per-op placements on that
      mesh are searched.

    The process group is created from the torchrun environment when none
    exists. Raises :class:`StrategyError` / :class:`PlanError` for strategies
    that do not fit this world or model, :class:`UnsupportedError` for valid
    strategies this release cannot run (fp16 with ZeRO-3).
    """
    max_grad_norm = _check_arguments(model, optimizer, on_nonfinite, lr_scheduler, max_grad_norm)
    rank, world = init_process_group(backend, timeout_s=timeout_s)
    graph, inputs, target, keys = _trace_request(model, example_inputs, example_target, loss_fn, batch_dim)
    traced_inputs = dict(zip(keys, inputs)) if keys else inputs
    plan, cfg, gbatch = resolve_plan(graph, model, strategy, world=world, cluster=cluster or default_cluster(),
                                     full_batch=full_batch, global_batch=global_batch, search_mode=search_mode,
                                     shardings=shardings)
    check_runnable(graph, cfg)
    meet = samples_cross_ranks(graph, cfg)
    batch_moves = cfg.dp > 1 and meet is not None
    mislaid = mislaid_batch(graph) if batch_moves else None
    if mislaid:
        warnings.warn(f"autopar: {mislaid}", stacklevel=2)
    graph = retrace_in_precision(graph, model, traced_inputs, loss_fn, target, cfg)
    mesh = build_mesh(cfg, timeout_s)
    if seed_broadcast and world > 1:   # every rank must start from the same weights (as DDP does)
        C.broadcast_params_(list(model.parameters()) + list(model.buffers()), dist.group.WORLD, 0)
    run_graph, cp_dims = graph, None
    if cfg.cp > 1:
        run_graph, cp_dims = trace_local_sequence(graph, model, inputs, keys, loss_fn, target, cfg)
    prog = apply_tp(run_graph, plan, cfg, mesh, gbatch, model=model, plan_graph=graph, batch_moves=batch_moves)
    if cfg.cp > 1:
        apply_cp(prog, run_graph, cfg, mesh, graph)
    counted = weighs_parts(graph, cfg, batch_moves)
    if counted:    # a part that counts nothing divides by 1, not 0
        guard_empty_ratio(prog.module, run_graph)
    if cfg.copies > 1:
        apply_copies(prog, run_graph, cfg, counted=counted)
    pipe, modules, tied, placement, comms = apply_stages(prog, run_graph, plan, cfg, mesh, rank)
    copies = grad_copies(local_tensors(modules), placement, tied, cfg.tp_grid[-1], prog.row_placement,
                         cfg.tp_grid[-2] if len(cfg.tp_grid) > 1 else 1,
                         cfg.tp_grid[0] if len(cfg.tp_grid) == 3 else 1,
                         prog.depth_placement) if max_grad_norm is not None else {}
    opt, dist_opt = apply_optimizer(modules, cfg, mesh, optimizer, tied=tied, max_grad_norm=max_grad_norm,
                                    copies=copies)
    pm = ParallelModule(
        modules, plan=plan, config=cfg, mesh=mesh, optimizer=opt, dist_optimizer=dist_opt,
        state_names=_state_names(graph, model),
        global_batch=gbatch, full_batch=full_batch, param_placement=placement, comms=comms,
        pipeline=pipe.executor(cfg, mesh) if pipe is not None else None, draw_timeline=_timeline_drawer(plan))
    pm.on_nonfinite = on_nonfinite
    pm.rng_seed = agreed_seed(run_graph, cfg, world)
    apply_loss_parts(pm, graph, run_graph, cfg, batch_moves)
    if cfg.tp_mode != "1d":
        pm.set_grid_rows(prog.row_placement, mesh.group("tp_row"), prog.depth_placement,
                         mesh.group("tp_depth") if len(cfg.tp_grid) == 3 else None)
    pm.max_grad_norm, pm.grad_copies = max_grad_norm, copies
    if cp_dims is not None:
        pm.set_context_split(*cp_dims, positions(sequence_length(graph), cfg.cp, mesh.coord("cp")))
    pm.example_inputs, pm.example_target = example_specs(graph, *batch_first_all(inputs, target, batch_dim))
    pm.input_keys, pm.batch_dim = keys, batch_dim
    if lr_scheduler is not None:
        pm.lr_scheduler = lr_scheduler(pm.optimizer)
    if pm.pipeline is not None:
        pm.pipeline.timeout = datetime.timedelta(seconds=timeout_s)
    return pm


def agreed_seed(graph: Graph, cfg: ParallelConfig, world: int) -> int | None:
    """The seed of the program's random numbers, drawn on rank 0 from its
    generator (a run the caller seeded is reproduced) and broadcast, where the
    ranks of a tensor-parallel group must draw alike: the program draws random
    numbers (dropout) and ``tp > 1``. None elsewhere: the caller's generator
    runs as it is (data-parallel replicas and pipeline stages draw for values
    of their own)."""
    if cfg.tp == 1 or world == 1 or not random_ops(graph.gm):
        return None
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
    seed = seed.to(local_device())
    dist.broadcast(seed, 0)
    return int(seed.item())


def _trace_request(model: nn.Module, example_inputs: Any, example_target: Any,
                   loss_fn: Callable | str, batch_dim: BatchDim = 0) -> tuple[Graph, tuple, Any, list[str] | None]:
    """Trace ``model`` with its loss on the example batch (its batch at
    ``batch_dim``), checked (something trains, the output is a loss):
    (graph, the inputs as a tuple, the target, the input keys of a keyword
    batch or None), the inputs and target as given."""
    keys = None
    if isinstance(example_inputs, dict):     # model(**batch): its labels are the target with loss_fn="labels"
        example_inputs, example_target, keys = keyword_inputs(example_inputs, example_target, loss_fn)
    inputs = as_tuple(example_inputs)
    target = _example_target(inputs, example_target)
    graph = trace(model, dict(zip(keys, inputs)) if keys else inputs, loss_fn=loss_fn, target=target,
                  batch_dim=batch_dim)
    api.check_trainable(graph)
    api.check_loss(graph)          # without loss_fn too: the output is the loss
    return graph, inputs, target, keys


def apply_stages(prog: LocalProgram, graph: Graph, plan: Plan, cfg: ParallelConfig, mesh: Mesh, rank: int):
    """The modules this rank runs, with recompute (and ZeRO-3 without a
    pipeline) applied: ``(pipeline stages or None, modules, tied groups,
    placement of the local parameters, collectives per step)``."""
    if cfg.pp == 1:
        modules = [apply_fsdp(apply_recompute(prog.module, graph, cfg, prog.keeps), cfg, mesh, graph)]
        return None, modules, [], prog.param_placement, prog.comms
    pipe = apply_pipeline(prog, graph, plan, cfg, mesh)
    for st in pipe.stages:
        st.module = apply_recompute(st.module, graph, cfg, prog.keeps)
    modules = [st.module for st in pipe.stages]
    local = local_tensors(modules)
    tied = tie_groups(pipe.tied, local, dp=cfg.dp * cfg.cp, tp=cfg.tp, rank=rank)
    placement = {k: v for k, v in prog.param_placement.items() if k in local}
    return pipe, modules, tied, placement, sum(st.comms for st in pipe.stages)


def _state_names(graph: Graph, model: nn.Module) -> StateNames:
    """How the program's tensors map back to ``model``'s state dict: the
    loss's prefix, each tied tensor's other names, and the entries the
    program never reads (kept as they are)."""
    aliases: dict[str, list[str]] = {}    # a tied tensor's name -> its other names
    for alias, canon in graph.aliases.items():
        aliases.setdefault(canon, []).append(alias)
    pre = graph.loss_prefix or ""
    read = {n[len(pre):] if n.startswith(pre) else n for n in [*graph.params, *graph.aliases]}
    constant = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in read}
    return StateNames(pre, aliases, frozenset(model.state_dict()), constant)


def weighs_parts(graph: Graph, cfg: ParallelConfig, batch_moves: bool) -> bool:
    """Whether each part of the split batch (a data-parallel or cp rank's, a
    microbatch, a copy) is weighted by its share of what the loss divides by
    (:func:`~autopar.sharding.loss_denominator`): the runtime weights the
    first three, the program its copies."""
    return not batch_moves and cfg.dp * cfg.microbatches * cfg.cp * cfg.copies > 1 and \
        loss_denominator(graph) is not None


def apply_loss_parts(pm: ParallelModule, graph: Graph, run_graph: Graph, cfg: ParallelConfig,
                     batch_moves: bool) -> ParallelModule:
    """Make the runtime's mean over the parts of a split batch (dp ranks,
    microbatches, copies, cp ranks) one process's loss where it is not a mean
    over the samples: with ``batch_moves`` (samples meet, the dp axis compiled
    in) each rank's gradient is its samples' part of the sum, so the backward
    is scaled by dp; a loss divided by a count over the batch (its target's
    tokens, a mask's sum: :func:`~autopar.sharding.loss_denominator`) weights
    each part by its share of the count (:attr:`ParallelModule.token_counter`);
    a loss summed over the batch adds the parts' losses. Returns ``pm``."""
    # the losses the runtime averages (cp: its ranks' positions, reduced as the samples are: check_runnable)
    parts = cfg.dp * cfg.microbatches * cfg.copies * cfg.cp
    if batch_moves:
        pm.grad_scale = float(cfg.dp)
    elif weighs_parts(graph, cfg, batch_moves):
        if cfg.dp * cfg.microbatches * cfg.cp > 1:     # the copies are weighted inside the program
            pm.token_counter = counter = token_counter(run_graph)
            if counter is not None:     # a class-weight table it reads follows the rank's device
                to_device(counter, local_device())
    elif parts > 1 and batch_reduction(graph) == "sum":
        pm.grad_scale = pm.loss_factor = float(parts)
    return pm


def _check_arguments(model: nn.Module, optimizer: Any, on_nonfinite: str, lr_scheduler: Any,
                     max_grad_norm: Any) -> float | None:
    """:func:`parallelize`'s arguments checked before any work (each a
    :class:`StrategyError` saying what would be valid); returns
    ``max_grad_norm`` as a float (or None)."""
    if on_nonfinite not in ("raise", "skip"):
        raise StrategyError(f"on_nonfinite={on_nonfinite!r} is invalid; valid: 'raise', 'skip'")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise StrategyError(f"lr_scheduler must be a factory optimizer -> scheduler, e.g. lambda o: "
                            f"torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.1, 100); got {lr_scheduler!r}")
    try:
        max_grad_norm = check_max_norm(max_grad_norm)
    except ValueError as e:
        raise StrategyError(str(e)) from None
    if optimizer is not None and not callable(optimizer):
        raise StrategyError(f"optimizer must be a factory params -> torch.optim.Optimizer, e.g. "
                            f"lambda p: torch.optim.AdamW(p, lr=1e-4); got {optimizer!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise StrategyError(f"{type(model).__name__} has no trainable parameters: there is nothing to train")
    return max_grad_norm


def example_specs(graph: Graph, inputs: tuple, target: Any) -> tuple[list, tuple | None]:
    """What :meth:`ParallelModule.check_batch` compares a batch with: per
    input and for the target, its traced shape, dtype and, for token ids, the
    rows of the embedding (the classes of the cross-entropy) they index."""
    rows: dict[str, int] = {}
    for nd in graph.nodes:
        if nd.kind not in ("embedding", "cross_entropy"):
            continue
        if nd.kind == "embedding":
            w = next((graph[i] for i in nd.inputs if graph[i].is_state), None)
            ids = [i for i in nd.inputs if not graph[i].is_state]
            n = w.out.shape[0] if w is not None and w.out is not None else None
        else:
            ids = nd.inputs[1:2]
            logits = graph[nd.inputs[0]].out
            n = logits.shape[1] if logits is not None and len(logits.shape) > 1 else None
        for i in ids:
            while graph[i].kind in ("view", "transpose") and graph[i].inputs:   # through reshapes
                i = graph[i].inputs[0]
            if n is not None and graph[i].kind == "input":
                rows[i] = n
    names = [*graph.inputs, None]      # the target has no input of its own when no loss was traced
    specs = [(tuple(t.shape), t.dtype, rows.get(name)) if isinstance(t, torch.Tensor) else ((), torch.float32, None)
             for t, name in zip([*inputs, target], names)]
    return specs[:len(inputs)], (specs[len(inputs)] if isinstance(target, torch.Tensor) else None)


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


def _example_target(inputs: tuple, target: Any) -> Any:
    """``target``, or a stand-in to trace the loss with: integer inputs are a
    language model's tokens (targets shaped like them), float inputs a
    classifier's (one class id per sample)."""
    if target is not None:
        return target
    first = inputs[0]
    shape = first.shape if not first.is_floating_point() else first.shape[:1]
    return torch.zeros(shape, dtype=torch.long)


# ----------------------------------------------------------------------------- the plan
def resolve_plan(graph: Graph, model: nn.Module, strategy: str | Plan | os.PathLike | ParallelConfig, *,
                 world: int, cluster: Any, full_batch: bool, global_batch: int | None, search_mode: str | None,
                 shardings: dict[str, Any] | None) -> tuple[Plan, ParallelConfig, int]:
    """The plan for ``graph`` on ``world`` processes, its strategy and its
    global batch: loaded (a ``.json`` path), given (a :class:`Plan`),
    searched (``"auto"``) or evaluated (a manual strategy).

    With ``full_batch=False`` the traced batch is this rank's shard: the
    global batch is that times dp. Raises :class:`PlanError` for a plan of
    another model or world size, :class:`StrategyError` for ``"auto"`` with
    ``full_batch=False`` and no ``global_batch``, and what :func:`autopar.plan`
    raises.
    """
    plan: Plan | None = None
    if isinstance(strategy, (str, os.PathLike)) and (str(strategy).endswith(".json") or os.path.isfile(strategy)) \
            or isinstance(strategy, Path):     # a plan file, whatever its extension
        plan = Plan.load(strategy)
    elif isinstance(strategy, Plan):
        plan = strategy
    if plan is not None:
        plan.check_model(graph.fingerprint, type(model).__name__)
        plan.check_graph(graph)
        cfg = plan.config
        if cfg.devices != world:
            raise PlanError(f"the plan is for {cfg.devices} devices (dp={cfg.dp}, tp={cfg.tp}, pp={cfg.pp}), "
                            f"but this job has {world} processes")
        return plan, cfg, plan.data["global_batch"]
    batch = graph.batch_size
    pins = {**_pins.annotations(model), **(shardings or {})}
    if strategy == "auto":
        if not full_batch and global_batch is None:
            raise StrategyError("strategy='auto' with full_batch=False needs global_batch=")
        plan = api.plan(graph, cluster=cluster, devices=world, global_batch=global_batch or batch,
                        executable_only=True, search_mode=search_mode, shardings=pins)
    else:
        gbatch = (global_batch or batch) if full_batch else batch * parse_strategy(str(strategy), world).dp
        plan = api.plan(graph, cluster=cluster, devices=world, global_batch=gbatch, strategy=str(strategy),
                        search_mode=search_mode, shardings=pins)
    return plan, plan.config, plan.data["global_batch"]


def check_runnable(graph: Graph, cfg: ParallelConfig) -> None:
    """Raise :class:`UnsupportedError` for a valid strategy this release
    cannot run on ``graph``: fp16 with ZeRO-3; on a model whose samples meet
    (:func:`samples_cross_ranks`), a batch split otherwise than over plain
    data parallelism (microbatches, so pipelines too, copies, a grid's rows, cp).
    (Graphs from either front end run every other strategy.)"""
    if (cfg.zero == 3 or cfg.fsdp_layers) and cfg.precision == "fp16":
        raise UnsupportedError(f"{'zero=3' if cfg.zero == 3 else 'fsdp_layers'} with precision=fp16: FSDP2 has no "
                               "dynamic loss scaling here; use bf16 (same exponent range as fp32, no scaling needed) "
                               "or zero<=2 without fsdp_layers")
    if cfg.copies > 1 and (cfg.pp > 1 or cfg.cp > 1 or cfg.zero == 3 or cfg.tp == 1):
        raise UnsupportedError(f"copies={cfg.copies} runs with tp > 1 and without pp, cp and zero=3; this plan has "
                               f"{cfg.to_string()}")
    if cfg.tp_mode != "1d":
        check_grid(cfg, cfg.dp * cfg.microbatches * cfg.copies * cfg.grid_batch_split)
    meet = samples_cross_ranks(graph, cfg)
    den = loss_denominator(graph)
    if den is not None and den[0] == "sum" and meet is None and (cfg.cp > 1 or cfg.is_grid):
        raise UnsupportedError(
            f"{cfg.to_string()}: {graph.name}'s loss is a ratio of batch sums ({den[1]} divides it, a masked "
            f"mean), which data parallelism, microbatches, pipelines and copies weight by each part's share of "
            f"{den[1]}, but cp and a tp_mode grid's rows average their parts inside the program; "
            f"leave them out")
    if cfg.cp > 1 and meet is None and (den is None or den[0] != "tokens") and \
            not positions_reduced_with_samples(graph, sequence_length(graph) or 1):
        raise UnsupportedError(
            f"{cfg.to_string()}: {graph.name}'s loss reduces each sample's positions apart from the samples "
            f"(for example a sum over the positions, then a mean over the samples), and cp, which splits the "
            f"positions, does not run such a loss yet; reduce the positions with the samples (a cross-entropy "
            f"over the flattened tokens) or leave cp out")
    if meet is None and den is None and cfg.dp * cfg.microbatches * cfg.copies * cfg.cp > 1 and \
            batch_reduction(graph) == "mixed":
        raise UnsupportedError(
            f"{cfg.to_string()} splits the batch, but {graph.name}'s loss adds terms that average the batch to "
            f"terms that sum it, which no one scale of the parts' losses makes the whole batch's; make every "
            f"term a mean (or every one a sum), or keep the batch whole (dp=1, microbatches=1)")
    limits = meeting_limits(cfg) if meet is not None else []
    if "microbatches" in limits or "copies" in limits:
        raise UnsupportedError(
            f"{cfg.to_string()} runs the batch in parts one after another, but {graph.name} mixes samples: "
            f"its value {meet} depends on several samples (an image x text similarity, a pairwise distance, a "
            f"loss of batch means), so a loss over part of the batch is another loss than one process's; use "
            f"microbatches=1 (so no pipeline) and copies=1 (data parallelism gathers what the samples share)")
    if limits:
        raise UnsupportedError(
            f"{cfg.to_string()}: {graph.name} mixes samples (its value {meet} depends on several), which this "
            f"release runs under data parallelism, ZeRO and tp, but not with {' or '.join(limits)}")


def samples_cross_ranks(graph: Graph, cfg: ParallelConfig) -> str | None:
    """Where ``graph``'s samples meet (:func:`autopar.sharding.samples_meet`;
    for an fx graph also :func:`autopar.trace.batch_meets`) when ``cfg``
    splits its batch (data parallelism, a grid's rows, microbatches, copies);
    None where they do not meet or ``cfg`` keeps every sample together."""
    split = cfg.dp * cfg.grid_batch_split
    if split == 1 and cfg.microbatches == 1 and cfg.copies == 1:
        return None
    return samples_meet(graph) or batch_meets(graph)


def retrace_in_precision(graph: Graph, model: nn.Module, inputs: tuple | dict, loss_fn: Any, target: Any,
                         cfg: ParallelConfig) -> Graph:
    """``graph``, or with bf16 / fp16 on a torch.export graph, the model
    traced again with its floating parameters, buffers and inputs in that
    dtype: export records only the dtype casts that change something
    (``inv_freq.float()`` in Hugging Face's rotary embedding is elided on
    fp32 buffers), so the fp32 graph would mix dtypes once the runtime casts
    the weights. The model's own tensors are restored afterwards; the
    compiler takes the weights from the model, not from this trace."""
    low = LOW_PRECISION.get(cfg.precision)
    if low is None or graph.frontend != "export":
        return graph
    params = [(t, t.data) for t in model.parameters() if t.is_floating_point()]
    # buffers are swapped, not given new .data: a buffer made as a view (nanoGPT's
    # tril(...).view(...)) keeps its fp32 base, which export checks against
    buffers = [(mod, name, b) for mod in model.modules() for name, b in mod._buffers.items()
               if b is not None and b.is_floating_point()]
    try:
        for t, data in params:
            t.data = data.to(low)
        for mod, name, b in buffers:
            mod._buffers[name] = b.to(low)
        def low_(x: Any) -> Any:
            return x.to(low) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        cast = {k: low_(x) for k, x in inputs.items()} if isinstance(inputs, dict) else tuple(map(low_, inputs))
        return trace(model, cast, loss_fn=loss_fn, target=target, frontend="export", name=graph.name,
                     batch_dim=graph.batch_dim)
    finally:
        for t, data in params:
            t.data = data
        for mod, name, b in buffers:
            mod._buffers[name] = b


def build_mesh(cfg: ParallelConfig, timeout_s: float | None = None) -> Mesh:
    """The ``(dp, tp)`` mesh, or ``(pp, dp, tp)`` with a pipeline (pp
    outermost, tp fastest, as Megatron lays it out), every wait on the world
    and on each of its groups bounded by ``timeout_s``; collective. With
    ``cp > 1`` a ``cp`` axis sits between dp and tp (``(pp, dp, cp, tp)``),
    with the joint ``dp_cp`` group the gradients are reduced over. A
    ``tp_mode`` grid replaces the tp axis by its own (``[tp_depth,] tp_row,
    tp``), inside ``pp`` and ``dp``."""
    # the tensor axes: 1d's one, or [the depth,] the rows and the columns of a grid or mesh
    tp_names = ("tp",) if cfg.tp_mode == "1d" else \
        (("tp_depth",) if len(cfg.tp_grid) == 3 else ()) + ("tp_row", "tp")
    outer = [(n, size) for n, size in (("pp", cfg.pp), ("dp", cfg.dp), ("cp", cfg.cp))
             if size > 1 or n == "dp"]
    return Mesh.build(tuple(size for _, size in outer) + cfg.tp_grid, tuple(n for n, _ in outer) + tp_names,
                      timeout_s=timeout_s, joint=(("dp", "cp"),) if cfg.cp > 1 else ())


# ----------------------------------------------------------------------------- the steps
def apply_tp(graph: Graph, plan: Plan, cfg: ParallelConfig, mesh: Mesh, global_batch: int, *,
             model: nn.Module, plan_graph: Graph | None = None, batch_moves: bool = False) -> LocalProgram:
    """This tensor-parallel rank's program of the whole model and loss, on
    this rank's device: the plan's placements compiled into local shards
    and explicit collectives, from either front end's graph, on the weights
    ``model`` holds. ``plan_graph``: the graph the plan was made for, when
    ``graph`` is the same program at another sequence length (``cp > 1``).

    ``batch_moves``: the model's samples meet (:func:`samples_cross_ranks`),
    so the data-parallel axis is compiled as a tensor axis too: each rank
    holds its samples, and where samples meet their values are gathered
    (the loss is then all-reduced in the program, and the runtime scales
    its backward by dp, since every rank's gradient is its samples' part of
    the sum, not of the mean).

    When the plan's ops are not this graph's (it was made with another loss
    function), the same strategy's placements are derived here. Raises
    :class:`CompileError` where the program cannot be built."""
    device = local_device()
    tp_sh = api.sharding_from_plan(plan_graph or graph, plan)
    if tp_sh is None or cfg.tp_mode in MESH_MODES:
        # a mesh is solved again as the plan was: with the plan's pins
        pins = _pins.resolve(plan_graph or graph, (plan.data.get("search") or {}).get("pins"))
        planner = api.planner_for(plan_graph or graph, plan.data["cluster"]["spec"], plan.data["optimizer"],
                                  plan.data["precision"], devices=cfg.devices, global_batch=global_batch, pins=pins)
        recorded, (tp_sh, _) = tp_sh, planner.sharding(cfg)
        if recorded is not None:     # a mesh: the plan's record of every axis must be the joint program's again
            _check_mesh_plan(recorded, tp_sh)
    # one copy's, on one data-parallel rank (whole along dp where the dp axis is compiled in)
    shapes = scaled_shapes(graph, global_batch // (cfg.microbatches * cfg.copies), 1 if batch_moves else cfg.dp)
    batch = Axis(follow_batch(graph, cfg.dp, shapes, batch_axis=True), mesh.coord("dp"), mesh.group("dp"),
                 whole_sizes=True, inputs_split=True, weight_grads_outside=True) if batch_moves else None
    gm = graph.gm
    # the weights as the model holds them now (a trace in another dtype may hold copies)
    pre = graph.loss_prefix or ""
    own = {pre + k: v for k, v in [*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)]}
    full = {n.target: own[n.target] if n.target in own else get_attr(gm, n.target)
            for n in gm.graph.nodes if n.op == "get_attr"}
    grid: list[Axis] = []
    if cfg.tp_mode in MESH_MODES:     # the mesh's outer axes, decided with the inner one by the joint program
        names = ("tp_depth", "tp_row")[-len(tp_sh.others):]
        grid.extend(Axis(o, mesh.coord(a), mesh.group(a)) for o, a in zip(tp_sh.others, names))
    elif cfg.is_grid:    # the grid's rows: the batch split, the weights stored split and gathered
        grid.append(Axis(grid_rows(graph, tp_sh, cfg.tp_grid[-2], shapes), mesh.coord("tp_row"),
                         mesh.group("tp_row"), whole_sizes=True))
    if cfg.tp_mode == "2.5d":    # the depth: the batch split again, the weights replicated
        depth = follow_batch(graph, cfg.tp_grid[0], shapes, batch_axis=False)
    elif cfg.tp_mode == "3d":    # the cube's depth: the batch split again, the rows' weight shards split again
        depth = grid_rows(graph, tp_sh, cfg.tp_grid[0], shapes, inner=grid[0].sh)
    if len(cfg.tp_grid) == 3 and cfg.is_grid:
        grid.insert(0, Axis(depth, mesh.coord("tp_depth"), mesh.group("tp_depth"), whole_sizes=True))
    # batch norm takes its statistics over the data-parallel group (SyncBatchNorm): dp computes one process's
    prog = compile_local(graph, tp_sh, shapes, tp_rank=mesh.coord("tp"), tp_group=mesh.group("tp"), params=full,
                         grid=grid, batch_group=mesh.group("dp") if cfg.dp > 1 else None, batch=batch)
    if cfg.precision in LOW_PRECISION:     # a value the model makes in fp32 meets the low-precision weights
        matmuls_in_dtype(prog.module, LOW_PRECISION[cfg.precision])
    retarget_devices(prog.module, device)     # an export graph's factory ops name the device it was traced on
    to_device(prog.module, device)     # its tensor constants too, which Module.to leaves behind
    return prog


def _check_mesh_plan(recorded: AxisSharding, solved: AxisSharding) -> None:
    """A ``tp_mode=mesh`` plan's recorded placements (every axis's; a plan
    of the first mesh release, the inner axis's) are the joint program's
    again, or the plan was edited: refuse it."""
    pairs = list(zip((*recorded.others, recorded)[::-1], (*solved.others, solved)[::-1]))
    for rec, got in pairs:
        moved = [name for name, p in rec.out.items() if got.out.get(name, R) != p]
        if moved:
            def joint(sh: AxisSharding) -> str:
                return joint_placement([ax.out.get(moved[0], R) for ax in (*sh.others, sh)])
            raise PlanError(f"the plan's tp_mode=mesh placements are not what its joint program decides "
                            f"({moved[0]}: {joint(recorded)} in the plan, {joint(solved)} decided); "
                            f"the plan was edited or made for another model: plan it again")


def trace_local_sequence(graph: Graph, model: nn.Module, inputs: tuple, keys: Any, loss_fn: Any, target: Any,
                         cfg: ParallelConfig) -> tuple[Graph, tuple[list[int | None], int | None]]:
    """The model traced again at one context-parallel rank's sequence length
    ``T / cp`` (every view, size and slice then holds this rank's sizes), and
    the sequence dim of each input and of the target (dim 1 of those of
    length ``T``, batch first; None: not split). Raises :class:`CompileError` when the
    trace's ops are not the plan's graph's."""
    seq = sequence_length(graph)
    local = seq // cfg.cp
    at = graph.batch_dim
    inputs, target = batch_first_all(inputs, target, at)

    def dim(x: Any) -> int | None:
        return 1 if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq else None

    def cut(x: Any) -> Any:
        return x.narrow(1, 0, local) if dim(x) is not None else x

    # cut batch first, traced in the caller's layout
    cut_inputs, cut_target = batch_first_all(tuple(map(cut, inputs)), cut(target), at, back=True)
    traced = dict(zip(keys, cut_inputs)) if keys else cut_inputs
    lg = trace(model, traced, loss_fn=loss_fn, target=cut_target, frontend=graph.frontend, name=graph.name,
               batch_dim=at)
    lg = retrace_in_precision(lg, model, traced, loss_fn, cut_target, cfg)
    # only reshapes and slices may differ (torch.export writes a slice to the full length as an alias)
    moved = [n for g, h in ((graph, lg), (lg, graph)) for n in g.nodes
             if n.name not in h and n.kind not in ("view", "index")]
    if moved:
        raise CompileError(f"cp={cfg.cp}: {graph.name} traced at {local} positions has other ops than at {seq}; "
                           f"its forward must not depend on the sequence length ({moved[0].name}: {moved[0].target})")
    return lg, ([dim(x) for x in inputs], dim(target))


def apply_cp(prog: LocalProgram, graph: Graph, cfg: ParallelConfig, mesh: Mesh, full: Graph) -> LocalProgram:
    """``prog`` (compiled from ``graph``, the model at ``T / cp`` positions;
    ``full`` is it at ``T``) rewritten for this context-parallel rank:
    attention over the whole sequence, positions global
    (:mod:`autopar.compile.context`). Returns ``prog``; raises
    :class:`UnsupportedError` naming an op it cannot rewrite."""
    prog.comms += _apply_cp(prog.module, graph, cp=cfg.cp, rank=mesh.coord("cp"), group=mesh.group("cp"),
                            seq=sequence_length(full), device=local_device(), full=full)
    return prog


def apply_copies(prog: LocalProgram, graph: Graph, cfg: ParallelConfig, counted: bool = False) -> LocalProgram:
    """``prog`` (compiled for one copy, ``1/copies`` of a microbatch) run as
    ``cfg.copies`` interleaved copies whose tensor-parallel collectives
    overlap each other's compute (:mod:`autopar.compile.copies`); with
    recompute the copies' segments are cut at layer changes so each layer
    stays one region. ``counted``: the loss divides by a count of the batch
    (:func:`weighs_parts`), so the copies' losses are weighted by their
    counts. Returns ``prog``."""
    labels = layer_labels(prog.module, graph) if cfg.recompute != "none" or cfg.zero == 3 or cfg.fsdp_layers \
        else None
    counter = token_counter(graph) if counted else None
    if counter is not None:
        to_device(counter, local_device())
    prog.module = _apply_copies(prog.module, cfg.copies, labels, counter)
    return prog


@dataclass
class PipelineStages:
    """The stages one pipeline rank holds (``stages``, in stage order), the
    weights several pipeline ranks hold a copy of (``tied``: name -> those
    pipeline ranks) and the program's input names."""

    stages: list[StageModule]
    tied: dict[str, list[int]]
    input_names: list[str]

    def executor(self, cfg: ParallelConfig, mesh: Mesh) -> PipelineExecutor:
        """The executor running ``cfg``'s schedule over these stages (build it
        after the stage modules are final: recompute replaces them)."""
        return PipelineExecutor(
            self.stages, schedule=cfg.schedule, pp=cfg.pp, pp_rank=mesh.coord("pp"),
            microbatches=cfg.microbatches, chunks=cfg.chunks, ranks=mesh.group_ranks("pp"), group=mesh.group("pp"),
            device=local_device(), input_names=self.input_names)


def apply_pipeline(prog: LocalProgram, graph: Graph, plan: Plan, cfg: ParallelConfig, mesh: Mesh) -> PipelineStages:
    """Cut ``prog`` into the plan's pipeline stages and keep those this
    pipeline rank holds (virtual stages ``r, r + pp, ...``); they share the
    program's parameters, so only theirs stay referenced. Raises
    :class:`PlanError` when the plan's layer counts do not fit ``cfg``."""
    layers = (plan.data.get("pipeline") or {}).get("layers") or even_layers(units(graph).layers, cfg.stages)
    if len(layers) != cfg.stages:
        raise PlanError(f"the plan's pipeline gives layer counts {list(layers)} for {len(layers)} stages, but "
                        f"pp={cfg.pp} x chunks={cfg.chunks} needs {cfg.stages}")
    stage_of = assign(graph, layers)
    held = list(range(mesh.coord("pp"), cfg.stages, cfg.pp))
    return PipelineStages(stages=split_stages(prog.module, graph, stage_of, held),
                          tied=tied_params(graph, stage_of, cfg.pp),
                          input_names=[n.name for n in prog.module.graph.nodes if n.op == "placeholder"])


def apply_recompute(module: nn.Module, graph: Graph, cfg: ParallelConfig,
                    keeps: frozenset | None = None) -> nn.Module:
    """``module`` (a program or one pipeline stage) with its repeated layers
    as regions that recompute their activations as ``cfg.recompute`` says
    (``keeps``: the nodes whose outputs selective recompute keeps, the
    program's ``LocalProgram.keeps``); ZeRO-3 needs the regions too (one
    FSDP2 unit each). Returns ``module`` itself when neither is asked for."""
    if cfg.recompute == "none" and cfg.zero != 3 and not cfg.fsdp_layers:
        return module
    return R_.apply_recompute(layer_regions(module, graph, keeps), cfg.recompute, ops.save_ops())


def apply_fsdp(module: nn.Module, cfg: ParallelConfig, mesh: Mesh, graph: Graph | None = None) -> nn.Module:
    """With ``zero=3``: ``module``'s layer regions, then the whole of it,
    sharded over the data-parallel ranks with torch FSDP2 (with context
    parallelism over ``dp x cp`` flattened into one axis, as torchtitan's
    ``dp_shard_cp``: the cp ranks hold the same weights and their gradients
    are averaged with the dp ranks'; compute in the
    low precision, gradients reduced in ``reduce_dtype`` or fp32; ``offload``
    keeps the shards on the host). With ``fsdp_layers=k``: the regions of
    ``graph``'s first k layer instances with weights of their own
    (:func:`autopar.cost.fsdp_layer_params`, as the cost model counts them;
    the rest of ``module`` stays under the distributed optimizer,
    :func:`apply_optimizer`). Returns ``module``. Raises
    :class:`UnsupportedError` when torch built no DeviceMesh."""
    if cfg.zero != 3 and not cfg.fsdp_layers:
        return module
    if mesh.device_mesh is None:
        raise UnsupportedError(f"{'zero=3' if cfg.zero == 3 else 'fsdp_layers'} runs on torch FSDP2, which needs "
                               "a torch DeviceMesh; init_device_mesh failed on this process group")
    low = LOW_PRECISION.get(cfg.precision)
    reduce = LOW_PRECISION.get(cfg.reduce_dtype) if cfg.reduce_dtype else (torch.float32 if low else None)
    dm = mesh.device_mesh
    shard_mesh = dm["dp", "cp"]._flatten("dp_cp") if cfg.cp > 1 else dm["dp"]
    layers = None
    if cfg.fsdp_layers:
        own = fsdp_layer_params(graph) if graph is not None else []
        if len(own) < cfg.fsdp_layers:
            raise StrategyError(f"fsdp_layers={cfg.fsdp_layers}: the model has {len(own)} layers with weights of "
                                "their own")
        layers = [g for g, _ in own[:cfg.fsdp_layers]]
    return R_.fully_shard_regions(module, shard_mesh, param_dtype=low, reduce_dtype=reduce,
                                  offload=cfg.offload == "optimizer", layers=layers)


def grad_copies(local: dict[str, torch.Tensor], placement: dict[str, str], tied: list[tuple[torch.Tensor, Any]],
                tp: int, rows: dict[str, str] | None = None, n_rows: int = 1, depth: int = 1,
                on_depth: dict[str, str] | None = None) -> dict[str, int]:
    """Program name -> how many ranks hold the same reduced gradient of that
    parameter besides its dp replicas: ``tp`` for a weight replicated over
    tp (with ``tp_mode=2d``: the grid's columns, and ``n_rows`` more for one
    replicated over its rows, ``rows`` holding those placements, and the
    ``depth`` of 2.5d, which replicates every weight, or of 3d, for one
    replicated there, ``on_depth`` holding those placements), times the
    ranks of its tie group for a weight tied across pipeline stages. Only
    entries above 1 (what gradient clipping must not count twice)."""
    tie = {id(t): dist.get_world_size(g) for t, g in tied}
    rows = rows or {}
    out = {}
    for name, t in local.items():
        if isinstance(t, nn.Parameter) and t.requires_grad:
            n = (1 if is_shard(placement.get(name, "R")) else tp) * tie.get(id(t), 1) * \
                (1 if is_shard(rows.get(name, "R")) else n_rows) * \
                (1 if is_shard((on_depth or {}).get(name, "R")) else depth)
            if n > 1:
                out[name] = n
    return out


def apply_optimizer(modules: list[nn.Module], cfg: ParallelConfig, mesh: Mesh,
                    factory: Callable[[Any], torch.optim.Optimizer] | None, *,
                    tied: list[tuple[torch.Tensor, Any]] = (), max_grad_norm: float | None = None,
                    copies: dict[str, int] | None = None) -> tuple[torch.optim.Optimizer,
                                                                    DistributedOptimizer | None]:
    """The optimizer over the trainable parameters of ``modules`` (``factory``
    builds the inner one; default SGD lr 0.01) and the
    :class:`~autopar.runtime.optim.DistributedOptimizer` around it, which
    reduces gradients over dp (ZeRO 1/2, mixed precision, overlap; ``tied``
    copies summed first) and clips them (``max_grad_norm``, with ``copies``
    from :func:`grad_copies`), or None under FSDP2 (``zero=3``), which
    reduces them itself (the ParallelModule clips then); with ``fsdp_layers``
    the FSDP2 shards of those layers are the inner optimizer's second param
    group (FSDP2 reduces their gradients, the distributed optimizer clips and
    steps them with the rest). With a low precision and no FSDP2, floating
    buffers (rotary tables, masks) are cast to the compute dtype here, as the
    distributed optimizer casts the parameters."""
    factory = factory or (lambda ps: torch.optim.SGD(ps, lr=0.01))
    params = [p for p in nn.ModuleList(modules).parameters() if p.requires_grad]
    if cfg.zero == 3:
        return factory(params), None
    sharded = [p for p in params if isinstance(p, DTensor)]     # fsdp_layers: FSDP2's own
    params = [p for p in params if not isinstance(p, DTensor)]
    low = LOW_PRECISION.get(cfg.precision)
    if low is not None:
        for mod in modules:
            for b in mod.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(low)
    dist_opt = DistributedOptimizer(
        params, factory, mesh.group("dp_cp" if cfg.cp > 1 else "dp"), zero=cfg.zero, precision=cfg.precision or "fp32",
        reduce_dtype=cfg.reduce_dtype or None, bucket_mb=cfg.bucket_mb, overlap=cfg.overlap,
        offload=cfg.offload == "optimizer", tied=list(tied), max_grad_norm=max_grad_norm,
        grad_copies=[(t, (copies or {}).get(name, 1)) for name, t in local_tensors(modules).items()],
        sharded=sharded, device=local_device())
    return dist_opt.optimizer, dist_opt


def _timeline_drawer(plan: Plan) -> Callable[[str | os.PathLike, Timeline], Path]:
    """``draw(path, measured)``: the plan's predicted pipeline schedule above
    ``measured``, as a PNG at ``path`` (raises :class:`PlanError` for a plan
    without a pipeline)."""
    from .pipeline.timeline import plot_timeline, predicted_timeline

    def draw(path: str | os.PathLike, measured: Timeline) -> Path:
        return plot_timeline(predicted_timeline(plan), path, title=plan.strategy, measured=measured)
    return draw
