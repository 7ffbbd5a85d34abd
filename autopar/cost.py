"""Predict step time and memory of one strategy on a traced graph.

The model, per optimizer step with ``m`` microbatches on a ``(dp, tp)`` mesh
(``(pp, dp, tp)`` with a pipeline):

* compute: every node's roofline time (``cost_models.op_time``) for its
  local share of the work, forward + backward (2x forward), times ``m``; with
  ``recompute=full`` one more forward, with ``selective`` the cheap ops of
  the layers again.
* tensor-parallel communication: per node, :func:`autopar.strategies.axis_cost.op_axis_time`
  (the transitions of its inputs from :mod:`autopar.strategies.redistribute`
  and the collectives inside the op), times ``m``: exactly the charge the ILP
  and the greedy search weigh; a transition the readers of a layer instance
  share (the q, k and v projections reading one LayerNorm output) is paid
  once, as the compiler inserts it once; with
  ``recompute=full`` the layers' forward collectives once more (the
  checkpoint replays them).
* data-parallel communication (``_dp_tail``): ZeRO-0 an all-reduce of the
  gradients, ZeRO-1/2 reduce-scatter + all-gather, ZeRO-3 per-layer gathers
  and reduce-scatters; reduced in buckets that overlap the backward by the
  device's ``comm_overlap`` (1 on GPUs, 0 on the CPU processes here); a
  pipeline reduces after the flush, with nothing to hide behind. Hidden
  communication is not free: a collective's thread blocks hold the device's
  ``comm_compute_share`` of its SMs while it runs, so compute beside it is
  slowed by that share of the collective's time (``_beside``). Under ZeRO-3
  the backward's gather and reduce-scatter run at once on two streams,
  share the link and both hold SMs (``_fsdp_unit``).
* optimizer: memory-bound passes over the local master and state, as many as
  torch's optimizer makes (AdamW: 20 fp32 reads and writes an element, plus the
  cast of the master into bf16/fp16 weights; ``cost_models.optimizer_step_bytes``),
  or the host link and host memory with ``offload=optimizer``.
* pipelines: the simulated schedule of the per-stage times
  (:mod:`autopar.pipeline.schedule`) with the point-to-point transfers.
* context parallelism (``cp > 1``, :meth:`CostModel._estimate_cp`): every op
  but attention is per token and load-balanced causal attention over the
  gathered keys is per query, so a cp rank's compute, tensor-parallel
  traffic and activations are those of ``1/cp`` of its data-parallel share
  of samples, and its gradients are reduced over ``dp x cp``: priced as
  ``dp x cp`` data parallelism (:meth:`CostModel.token_view`), plus per
  attention op and microbatch the all-gather of its keys and values over
  cp forward and the reduce-scatter of their gradients backward, and the
  gathered keys and values attention keeps for backward.

Memory per device: weights, gradients and optimizer state of the local
shards (ZeRO divides them over ``dp``), the activations saved for backward
(times the microbatches a pipeline rank keeps in flight), and the largest
transient (e.g. the logits, or an input an op reads all-gathered); ``fits``
compares the peak against 90% of the device memory (allocator slack).

The model is pure: :meth:`CostModel.estimate` prices decisions made
elsewhere (the tensor-parallel :class:`~autopar.sharding.AxisSharding`, the
local shapes, the pipeline's layers per stage), and the primitives the search
weighs its choices with (:meth:`CostModel.param_time`,
:meth:`CostModel.param_memory`, :meth:`CostModel.saved_memory`,
:meth:`CostModel.unit_costs`, ...) are priced the same way. Choosing the
decisions is :mod:`autopar.search.planner`'s; nothing here imports the search.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import cost_models
from cost_models import (ClusterSpec, MeshTopology, model_state_bytes, op_time, optimizer_step_bytes,
                         zero_sharded_state_bytes)

from . import ops
from .errors import StrategyError
from .graph import NO_DISPATCH, Graph, Node, checkpoint_dispatches
from .sharding import AxisSharding, attention_output_aliases, backward_reads, batch_dims, data_values, \
    depth_placement, follow_batch, has_layers, needs_grad, numel as _numel, row_placement, instances, samples_meet, \
    scaled_shapes, selective_keeps, track_batch
from .pipeline import partition as pipe
from .pipeline.partition import units
from .pipeline.schedule import Timeline, makespan_lower_bound, simulate_schedule
from .spec import MESH_MODES, ParallelConfig, check_fsdp_layers, check_grid, divisors
from .spec.placement import P, R, joint_placement, mesh_pieces
from .strategies import is_shard
from .strategies.axis_cost import op_axis_time, shared_key, work_fraction
from .strategies.context import attentions, check_cp
from .strategies.redistribute import feasible, output_time, transition_steps, transition_time


MEMORY_HEADROOM = 0.9
EXTRAPOLATE = 12              # pipelines with more than 12 x pp microbatches: steady state extrapolated


@dataclass
class Estimate:
    """The prediction for one strategy. Times in seconds, memory in bytes."""

    strategy: str
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    tp_comm_time_s: float
    dp_comm_time_s: float
    optimizer_time_s: float
    tflops_per_device: float
    peak_memory_bytes: float
    memory: dict[str, float]
    fits: bool
    device_memory_bytes: float
    devices: int
    global_batch: int
    precision: str
    optimizer: str
    parallel: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None   # pp > 1: stages, schedule timeline summary
    host_memory_bytes: float = 0.0           # offload: model state kept in host memory per device
    cp_comm_time_s: float = 0.0              # cp > 1: the K/V gathers (in comm_time_s too); left out when 0

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["cp_comm_time_s"]:
            del d["cp_comm_time_s"]
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in d.items()}


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def compute_dtype(precision: str) -> str:
    """The torch dtype name compute runs in under ``precision`` (``mixed`` is bf16)."""
    return _DTYPES["bf16" if precision == "mixed" else precision]


def tp_valid_sizes(graph: Graph, limit: int | None = None) -> list[int]:
    """Tensor-parallel sizes the model allows: divisors of every attention
    layer's head counts, or, without attention, of the widths of its hidden
    linear and convolution layers."""
    heads = []
    for nd in graph.nodes:
        if nd.kind == "sdpa":
            for i in nd.inputs[:2]:
                out = graph[i].out
                if out is not None and len(out.shape) == 4:
                    heads.append(out.shape[1])
    if heads:
        g = 0
        for h in heads:
            g = math.gcd(g, h)
    else:
        last = graph[graph.output] if graph.output else None
        if last is not None and last.kind in ("cross_entropy", "nll_loss", "pointwise_loss") and last.inputs:
            last = graph[last.inputs[0]]   # a traced loss: the model's output is its logits
        while last is not None and last.kind == "elementwise" and last.inputs:     # back through a bias add
            last = next((graph[i] for i in last.inputs if not graph[i].is_state), None)
        final = None
        if last is not None and last.out is not None and last.out.shape:    # the output's features (a conv's: dim 1)
            final = last.out.shape[1] if last.kind == "conv" and len(last.out.shape) > 1 else last.out.shape[-1]
        widths = [graph[nd.inputs[1]].out.shape[0] for nd in graph.nodes
                  if nd.kind in ("linear", "conv") and len(nd.inputs) > 1 and graph[nd.inputs[1]].kind == "param"]
        widths = [w for w in widths if w != final] or widths
        g = 0
        for w in widths:
            g = math.gcd(g, w)
    g = g or 1
    out = divisors(g)
    return [d for d in out if limit is None or d <= limit]


def _tp_sizes_cached(graph: Graph) -> list[int]:
    return graph.memo(("tp_valid_sizes",), lambda: tp_valid_sizes(graph))


def _times_copies(sums: tuple, n: int) -> tuple:
    """One copy's microbatch sums (:meth:`CostModel._microbatch_sums`) for
    ``n`` copies of it: times and saved values add up (the copies' saved
    values live at once in the interleaved program); the per-instance dicts
    scaled alike. The largest transient stays one copy's: a copy's
    temporaries are freed within its segment, before the next copy's runs
    (measured on 4 processes, copies lowered the peak where the largest
    transients are most of it, while n of them put it 55-65% over)."""
    if n == 1:
        return sums
    return tuple(x if k == _TRANSIENT else {key: v * n for key, v in x.items()} if isinstance(x, dict) else x * n
                 for k, x in enumerate(sums))


_TRANSIENT = 2     # the place of the largest transient in CostModel._microbatch_sums' tuple


def fsdp_layer_params(graph: Graph) -> list[tuple[str, list[tuple[str, int]]]]:
    """Per repeated-layer instance that holds trainable parameters of its own
    (read by no node outside it: what the runtime's layer region of that name
    owns, and FSDP2 shards under ``fsdp_layers``), in graph order: the
    instance and its parameters as (node, elements). Left out: an instance
    whose weights are all shared (ALBERT's one layer applied again and again:
    they stay with the root), and one that is a lone BatchNorm (under data
    parallelism it is synchronised over dp and runs in its parent). Empty for
    a model without repeated layers. Computed once per graph."""
    def compute() -> list[tuple[str, list[tuple[str, int]]]]:
        own: dict[str, list[tuple[str, int]]] = {}
        kinds: dict[str, set[str]] = {}
        for nd in graph.nodes:
            if nd.group is not None:
                own.setdefault(nd.group, [])
                if not nd.is_state:
                    kinds.setdefault(nd.group, set()).add(nd.kind)
            info = graph.params.get(nd.param) if nd.is_state else None
            if info is None or info.is_buffer or not info.requires_grad:
                continue
            groups = {graph[c].group for c in graph.consumers(nd.name)}
            if len(groups) == 1 and (g := next(iter(groups))) is not None:
                own.setdefault(g, []).append((nd.name, info.numel))
        return [(g, ps) for g, ps in own.items() if ps and kinds.get(g) != {"batchnorm"}]
    return graph.memo(("fsdp_layer_params",), compute)


def check_config(graph: Graph, cfg: ParallelConfig, devices: int, global_batch: int) -> None:
    """Raise :class:`StrategyError` if ``cfg`` cannot run this model on ``devices``."""
    if cfg.devices != devices:
        cps = f" x cp={cfg.cp}" if cfg.cp > 1 else ""
        raise StrategyError(f"dp={cfg.dp} x tp={cfg.tp} x pp={cfg.pp}{cps} = {cfg.devices} devices, "
                            f"but {devices} were given")
    check_cp(graph, cfg.cp)
    check_grid(cfg, global_batch)
    valid = _tp_sizes_cached(graph)
    cols = cfg.tp_grid[-1]
    if cols not in valid:
        what = "attention heads" if any(n.kind == "sdpa" for n in graph.nodes) else "layer widths"
        grid = f" (the columns of tp_mode={cfg.tp_mode}'s {'x'.join(map(str, cfg.tp_grid))} grid)" \
            if cfg.tp_mode != "1d" else ""
        raise StrategyError(f"tensor parallel size {cols}{grid} does not divide the model's {what}; "
                            f"valid sizes: {', '.join(map(str, valid))}")
    if cfg.pp > 1:
        n_layers = units(graph).layers
        if cfg.stages > n_layers + 2:
            raise StrategyError(f"pp={cfg.pp} x chunks={cfg.chunks} = {cfg.stages} pipeline stages need at least "
                                f"{cfg.stages - 2} repeated layers (one a stage; the first and the last stage may "
                                f"hold the embedding and the head alone); {graph.name} has {n_layers}")
    check_fsdp_layers(cfg)
    if cfg.fsdp_layers and cfg.fsdp_layers > (n_layers := len(fsdp_layer_params(graph))):
        raise StrategyError(f"fsdp_layers={cfg.fsdp_layers} shards that many repeated layers over dp, but "
                            f"{graph.name} has {n_layers} with weights of their own" +
                            ("" if n_layers else " (layers are repeated blocks, such as a ModuleList of alike "
                                                 "transformer blocks; weights shared by every layer stay whole)"))
    if cfg.recompute != "none" and not has_layers(graph):
        raise StrategyError(f"recompute={cfg.recompute} runs each layer's forward again in its backward, but "
                            f"{graph.name} has no layers to cut it into (layers are repeated blocks, such as a "
                            f"ModuleList of alike transformer blocks); use recompute=none")
    if global_batch < 1 or global_batch % (cfg.dp * cfg.microbatches):
        raise StrategyError(f"global batch {global_batch} is not divisible by dp={cfg.dp} x "
                            f"microbatches={cfg.microbatches} = {cfg.dp * cfg.microbatches}")
    per_rank = global_batch // (cfg.dp * cfg.microbatches)
    if per_rank % cfg.copies:
        raise StrategyError(f"copies={cfg.copies}: the per-rank microbatch of {per_rank} samples (global batch "
                            f"{global_batch} / dp={cfg.dp} / microbatches={cfg.microbatches}) does not divide "
                            f"into {cfg.copies} copies; valid copies: "
                            f"{', '.join(str(c) for c in divisors(per_rank))}")


@dataclass
class CostCache:
    """What a :class:`CostModel` has summed, per decision it priced.

    The per-node sums are the expensive part of an estimate and the search
    prices the same decisions under many memory options, so they are kept;
    their keys name an :class:`AxisSharding` by ``id``, and ``held`` keeps
    every sharding priced alive so that an id is never reused for another.
    Whoever makes the cache owns it (the planner: one per planning request,
    or the warm one api keeps per graph)."""

    sums: dict[tuple, tuple] = field(default_factory=dict)               # one microbatch, pp = 1
    local_params: dict[tuple, tuple[float, int]] = field(default_factory=dict)
    units: dict[tuple, "UnitCosts"] = field(default_factory=dict)        # pipeline: per-unit sums
    unit_params: dict[tuple, tuple[list[float], list[float]]] = field(default_factory=dict)
    fsdp_elems: dict[tuple, list[float]] = field(default_factory=dict)    # fsdp_layers: each layer's own
    timelines: dict[tuple, Timeline] = field(default_factory=dict)       # simulated schedules
    tp_comm: dict[tuple, dict] = field(default_factory=dict)   # (itemsize, tp, spans nodes) -> collective times
    layer_inputs: dict[tuple, tuple] = field(default_factory=dict)    # bytes of each layer's input
    sources: dict[int, dict[str, str]] = field(default_factory=dict)  # the instance each one copies
    node_times: dict[tuple, tuple] = field(default_factory=dict)   # per node: what recompute does not change
    node_sums: dict[tuple, tuple] = field(default_factory=dict)    # per unit and instance, per recompute
    held: dict[int, AxisSharding] = field(default_factory=dict)

    def hold(self, sh: AxisSharding) -> None:
        """Keep ``sh`` alive while entries keyed by its id may exist."""
        self.held[id(sh)] = sh


class CostModel:
    """The cost model of one graph on one cluster under one optimizer and
    precision: :meth:`estimate` predicts a strategy whose decisions are
    given; the other public methods are the primitives the search weighs
    its choices with. Raises :class:`StrategyError` for an invalid precision
    or one the device has no FLOP rate for."""

    def __init__(self, graph: Graph, cluster: ClusterSpec | str, *, optimizer: str = "adamw",
                 precision: str | None = None, cache: CostCache | None = None) -> None:
        self.graph = graph
        self.cluster = cost_models.load_cluster(cluster) if not isinstance(cluster, ClusterSpec) else cluster
        self.optimizer = optimizer
        precision = precision or self.cluster.default_precision
        self.precision = "bf16" if precision == "mixed" else precision
        if self.precision not in _DTYPES:
            raise StrategyError(f"precision {precision!r} is invalid; valid: fp32, bf16, fp16 (mixed = bf16)")
        self.dtype = compute_dtype(self.precision)
        if self.dtype not in self.cluster.device.peak_flops:
            raise StrategyError(f"precision {self.precision}: device {self.cluster.device.name} of cluster "
                                f"{self.cluster.name!r} has no {self.dtype} FLOP rate "
                                f"(it lists {', '.join(sorted(self.cluster.device.peak_flops))})")
        self.itemsize = 2 if self.precision != "fp32" else 4
        self.batch = track_batch(graph)
        self.grad = needs_grad(graph)
        self.cache = cache if cache is not None else CostCache()
        self.params = {nd.name: nd for nd in graph.nodes if nd.is_state}
        self._alignment: dict[str, bool] = {}     # matrix product -> whether every dimension is 16-byte aligned
        self._reads = backward_reads(graph)
        self._aliases = attention_output_aliases(graph)    # the attention output in its own storage: saved once
        self._keeps_memo: dict[int, tuple[AxisSharding, frozenset[str]]] = {}
        self._topologies: dict[tuple[int, ...], MeshTopology] = {}
        self._p2p: dict[tuple, float] = {}      # (mesh shape, bytes) -> send_recv seconds
        self._token_shapes: dict[tuple[int, int], tuple[dict, dict]] = {}

    def _send_recv(self, mesh_shape: tuple[int, ...], nbytes: float) -> float:
        """A point-to-point transfer of ``nbytes`` on axis 0 of ``mesh_shape``
        (memoised: every cut between two layers moves the same bytes, and the
        pipeline search prices hundreds of partitions)."""
        key = (mesh_shape, nbytes)
        t = self._p2p.get(key)
        if t is None:
            t = self._p2p[key] = self.topology(mesh_shape).collective_time("send_recv", nbytes, 0)
        return t

    def topology(self, mesh_shape: tuple[int, ...]) -> MeshTopology:
        """The mesh ``mesh_shape`` laid out on the cluster (made once per shape)."""
        topo = self._topologies.get(mesh_shape)
        if topo is None:
            topo = self._topologies[mesh_shape] = MeshTopology(self.cluster, mesh_shape)
        return topo

    # -- context parallelism as token-parallel data parallelism ---------------
    @staticmethod
    def token_view(cfg: ParallelConfig) -> ParallelConfig:
        """``cfg`` with its cp ranks counted as data-parallel ones (``dp x cp``,
        ``cp=1``): what a cp rank computes, keeps and reduces, but attention's
        key and value gathers (see the module docstring); ``cfg`` itself
        without context parallelism."""
        return cfg if cfg.cp == 1 else dataclasses.replace(cfg, dp=cfg.dp * cfg.cp, cp=1)

    @staticmethod
    def grid_view(cfg: ParallelConfig) -> ParallelConfig:
        """A ``tp_mode=2d`` (or 2.5d) ``cfg`` seen from its grid's columns: a
        1d config with the columns as tp and the rows (times 2.5d's depth)
        counted as data-parallel ranks (``dp x q``, ``tp=q``), the same mesh
        laid out row-major. What a grid rank computes and sends over its
        columns is that config's; the rows' weight gathers, the depth's
        gradient sums and what they keep are :meth:`_estimate_2d`'s."""
        return dataclasses.replace(cfg, dp=cfg.dp * cfg.grid_batch_split, tp=cfg.tp_grid[-1], tp_mode="1d",
                                   tp_depth=1)

    def token_shapes(self, shapes: dict, cp: int) -> dict:
        """``shapes`` (local to dp) with the batch dim divided by ``cp``: the
        elements one cp rank holds (a fraction of a sample when ``cp`` does
        not divide the samples: the counts are what the cost sums read)."""
        if cp == 1:
            return shapes
        key = (id(shapes), cp)
        hit = self._token_shapes.get(key)
        if hit is not None and hit[0] is shapes:
            return hit[1]
        dims = batch_dims(self.graph)
        out = {}
        for name, shp in shapes.items():
            d = dims.get(name)
            if shp is None or d is None or d >= len(shp):
                out[name] = shp
            else:
                b = shp[d] / cp
                out[name] = shp[:d] + (int(b) if b == int(b) else b,) + shp[d + 1:]
        self._token_shapes[key] = (shapes, out)
        return out

    def _estimate_cp(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int, devices: int,
                     partition: Sequence[int] | None, simulate_schedule: bool) -> Estimate:
        """:meth:`estimate` of a context-parallel ``cfg``: the token view's
        estimate, plus the key/value gathers over cp (exposed: they feed the
        attention that waits for them) and the gathered keys and values kept
        for backward."""
        eff, shp = self.token_view(cfg), self.token_shapes(shapes, cfg.cp)
        if cfg.pp > 1:
            est = self._estimate_pipeline(eff, sh, shp, global_batch, devices, partition, simulate_schedule)
        elif cfg.tp_mode in MESH_MODES:
            est = self._estimate_mesh(eff, sh, shp, global_batch, devices)
        elif cfg.is_grid:
            est = self._estimate_2d(eff, sh, shp, global_batch, devices)
        else:
            est = self._estimate_flat(eff, sh, shp, global_batch, devices)
        per_mb, kv = self.cp_attention_costs(cfg, sh, shp)
        m, pp = cfg.microbatches, cfg.pp
        comm = m * per_mb / pp               # a pipeline rank gathers for its share of the layers
        if cfg.recompute == "none":          # kept for backward, per layer and microbatch in flight
            flight = max(pipe.in_flight(cfg.schedule, pp, m, cfg.chunks)) if pp > 1 else 1
            held, transient = sum(kv) / pp * flight, 0.0
        else:                                # gathered again when the layer is recomputed
            held, transient = 0.0, max(kv, default=0.0)
        memory = dict(est.memory, activations=est.memory["activations"] + held,
                      transient=est.memory["transient"] + transient, cp_kv_gathered=held + transient)
        peak = est.peak_memory_bytes + held + transient
        step = est.step_time_s + comm
        return dataclasses.replace(
            est, strategy=cfg.to_string(), parallel=cfg.as_dict(), step_time_s=step,
            comm_time_s=est.comm_time_s + comm, cp_comm_time_s=comm, memory=memory, peak_memory_bytes=peak,
            fits=est.fits and peak <= self.cluster.device.memory_bytes * MEMORY_HEADROOM,
            tflops_per_device=est.tflops_per_device * est.step_time_s / step if step > 0 else 0.0)

    def _estimate_2d(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int,
                     devices: int) -> Estimate:
        """:meth:`estimate` of a ``tp_mode=2d``, ``2.5d`` or ``3d`` ``cfg``
        (``sh``: its columns, ``shapes``: one grid rank's)."""
        view = self.grid_view(cfg)
        cube, split, whole, n_split = self._grid_params(sh, cfg)
        # the rows' collectives run in every copy (each gathers the weights it reads) and the
        # copies overlap them as the columns'
        est = self._estimate_flat(view, sh, shapes, global_batch, devices,
                                  grid_comm=self._row_comm(cfg, cube, split, whole, self._grid_counts(sh, cfg))[1])
        grid, m = cfg.tp_grid, cfg.microbatches
        cols = grid[-1]
        topo = self.topology((cfg.dp, *grid))
        isz, passes = self.itemsize, 3.0 + (1.0 if cfg.recompute == "full" else 0.0)
        # model states and the data-parallel reduction of a grid rank's own shards, over dp alone
        local, n_tensors = self._local_params(sh, cols)
        gathered = cube + split + whole - _grid_share(cfg, cube, split, whole)
        local -= gathered
        fwd = est.compute_time_s / (m * passes)
        dp_comm, opt, states = self._dp_tail(dataclasses.replace(view, dp=cfg.dp), local, n_tensors, topo, 0,
                                             fwd, (passes - 1) * fwd, self._fsdp_units())
        # the gathered weights their matmuls keep for backward (one layer's at a time when recomputed),
        # in every copy: each gathers its own
        kept = cfg.copies * gathered * isz / (1 if cfg.recompute == "none" else max(n_split, 1))
        # the view counted at the columns' share what a grid rank holds less of: the gradients the
        # backward creates as it frees the activations, and ZeRO-3's units gathered over dp
        freed_view = est.memory.get("freed_by_backward", 0.0)
        freed = max(freed_view, -states["gradients"]) if freed_view else 0.0
        units_view = self._gathered(view, sh)
        units = self._grid_units_gathered(cfg, sh) if units_view else 0.0
        memory = dict(est.memory, weights=states["weights"], gradients=states["gradients"],
                      optimizer=states["optimizer"], grid_weights_gathered=kept,
                      transient=est.memory["transient"] - units_view + units,
                      **({"freed_by_backward": freed} if freed else {}))
        old_states = est.memory["weights"] + est.memory["gradients"] + est.memory["optimizer"]
        peak = est.peak_memory_bytes - old_states + states["total"] + kept + freed - freed_view + units - units_view
        step = est.step_time_s - est.dp_comm_time_s - est.optimizer_time_s + dp_comm + opt
        return dataclasses.replace(
            est, strategy=cfg.to_string(), parallel=cfg.as_dict(), step_time_s=step,
            comm_time_s=est.tp_comm_time_s + dp_comm, tp_comm_time_s=est.tp_comm_time_s,
            dp_comm_time_s=dp_comm, optimizer_time_s=opt, memory=memory, peak_memory_bytes=peak,
            fits=peak <= self.cluster.device.memory_bytes * MEMORY_HEADROOM,
            tflops_per_device=est.tflops_per_device * est.step_time_s / step if step > 0 else 0.0)

    def _grid_params(self, sh: AxisSharding, cfg: ParallelConfig) -> tuple[float, float, float, int]:
        """Trainable elements of one grid column's share of the weights
        (summed): those a 3d cube's rows and depth both split
        (:func:`~autopar.sharding.depth_placement`), those the rows alone
        split (:func:`~autopar.sharding.grid_rows`), those the rows replicate
        (whose gradients the rows all-reduce), and the number of layer units
        holding split ones."""
        key = ("grid", id(sh), cfg.tp_grid, cfg.tp_mode)
        hit = self.cache.local_params.get(key)
        if hit is not None:
            return hit
        cube = split = whole = 0.0
        units_: set = set()
        grad = needs_grad(self.graph)
        for nd in self.graph.nodes:
            if nd.kind != "param" or not grad.get(nd.name) or nd.out is None:
                continue
            c, s_, w = self._grid_split(nd, sh, cfg)
            cube, split, whole = cube + c, split + s_, whole + w
            if c or s_:
                units_.add(nd.group)
        out = (cube, split, whole, len(units_))
        self.cache.local_params[key] = out
        return out

    def _grid_units_gathered(self, cfg: ParallelConfig, sh: AxisSharding) -> float:
        """:meth:`_gathered` for a grid under ZeRO-3: FSDP2 gathers a grid
        rank's own shards of a unit over dp (the root's and two layers')."""
        try:
            parts = [_grid_share(cfg, *unit) for unit in self._grid_unit_split(sh, cfg)]
        except StrategyError:      # no layer units: the whole model is one
            return _grid_share(cfg, *self._grid_params(sh, cfg)[:3]) * self.itemsize
        return _fsdp_peak(parts) * self.itemsize

    def _grid_split(self, nd: Node, sh: AxisSharding, cfg: ParallelConfig) -> tuple[float, float, float]:
        """One trainable parameter node's elements in one grid column, as
        ``(cube, split, whole)`` of :meth:`_grid_params` (one of the three
        non-zero)."""
        grid = cfg.tp_grid
        depth = grid[0] if len(grid) == 3 and cfg.tp_mode == "3d" else 1
        return _grid_split_of(nd.out.shape, sh.out.get(nd.name, R), grid[-2], grid[-1], depth)

    def _grid_unit_split(self, sh: AxisSharding, cfg: ParallelConfig) -> list[tuple[float, float, float]]:
        """Per pipeline unit, :meth:`_grid_params`' ``(cube, split, whole)``
        of the trainable parameters it reads (kept per decisions and grid)."""
        key = ("grid units", id(sh), cfg.tp_grid, cfg.tp_mode)
        hit = self.cache.local_params.get(key)
        if hit is not None:
            return hit
        lists = self._unit_param_lists[0]
        split_of: dict[str, tuple[float, float, float]] = {}
        out = []
        for params in lists:
            cube = split = whole = 0.0
            for name, _ in params:
                if name not in split_of:
                    split_of[name] = self._grid_split(self.graph[name], sh, cfg)
                c, s_, w = split_of[name]
                cube, split, whole = cube + c, split + s_, whole + w
            out.append((cube, split, whole))
        self.cache.hold(sh)
        self.cache.local_params[key] = out
        return out

    def _row_comm(self, cfg: ParallelConfig, cube: float, split: float, whole: float,
                  counts: tuple[int, int, int] = (1, 1, 1)) -> tuple[float, float]:
        """The grid's own communication for weights of ``(cube, split,
        whole)`` elements (:meth:`_grid_params`) per microbatch: the forward's
        weight gathers, and everything (the gathers, again when recomputed,
        the gradients' reduce-scatters and all-reduces). The program runs one
        collective per weight: ``counts`` weights of each kind
        (:meth:`_grid_counts`) each pay the collective's latency.

        Every split weight is gathered along the rows (again when
        recomputed), its gradient reduce-scattered; the gradients of the
        weights the rows replicate are all-reduced; 2.5d's depth replicates
        the weights: every gradient shard is summed over it; 3d's splits the
        rows' shards again: gathered over the rows (to the depth's chunk),
        then over the depth, the gradient reduce-scattered back the same way.
        With a pipeline, on the ``(pp, dp, [depth,] rows, cols)`` mesh."""
        grid = cfg.tp_grid
        rows = grid[-2]
        depth = grid[0] if len(grid) == 3 else 1
        lead = (cfg.pp,) if cfg.pp > 1 else ()
        topo = self.topology((*lead, cfg.dp, *grid))
        r_axis, d_axis = len(lead) + len(grid) - 1, len(lead) + 1
        isz = self.itemsize

        k_cube, k_split, k_whole = counts

        def coll(kind: str, elems: float, axis: int, k: int) -> float:
            if not elems:
                return 0.0
            return topo.collective_time(kind, elems * isz, axis) + \
                max(k - 1, 0) * topo.collective_time(kind, 0.0, axis)
        gathers = coll("all_gather", split, r_axis, k_split) + coll("all_gather", cube / depth, r_axis, k_cube) + \
            coll("all_gather", cube, d_axis, k_cube)
        total = (2 if cfg.recompute == "full" else 1) * gathers + \
            coll("reduce_scatter", split, r_axis, k_split) + coll("reduce_scatter", cube / depth, r_axis, k_cube) + \
            coll("reduce_scatter", cube, d_axis, k_cube) + coll("all_reduce", whole, r_axis, k_whole) + \
            (coll("all_reduce", split / rows + whole, d_axis, k_split + k_whole) if depth > 1 else 0.0)
        return gathers, total

    def _grid_counts(self, sh: AxisSharding, cfg: ParallelConfig,
                     names: Sequence[str] | None = None) -> tuple[int, int, int]:
        """How many trainable parameters (of ``names``; default every one)
        a grid column holds as each of :meth:`_grid_params`' ``(cube, split,
        whole)``: the grid's program gathers and reduces each on its own."""
        key = ("grid counts", id(sh), cfg.tp_grid, cfg.tp_mode, None if names is None else tuple(names))
        hit = self.cache.local_params.get(key)
        if hit is not None:
            return hit
        grad = needs_grad(self.graph)
        if names is None:
            names = [nd.name for nd in self.graph.nodes
                     if nd.kind == "param" and grad.get(nd.name) and nd.out is not None]
        counts = [0, 0, 0]
        for name in names:
            for i, part in enumerate(self._grid_split(self.graph[name], sh, cfg)):
                counts[i] += bool(part)
        out = (counts[0], counts[1], counts[2])
        self.cache.local_params[key] = out
        return out

    def _grid_unit_costs(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict,
                         global_batch: int) -> "UnitCosts":
        """:meth:`unit_costs` of a pipelined ``tp_mode`` grid: its columns'
        (:meth:`grid_view`), with each unit's own grid work added (as
        :meth:`_estimate_2d` adds the whole model's): the weight gathers in
        its forward, every row and depth collective in its time, its
        parameters the rows (and a cube's depth) split, and the gathered
        weights its matmuls keep for backward, per microbatch in flight (or
        once, while the unit is recomputed)."""
        base = self.unit_costs(self.grid_view(cfg), sh, shapes, global_batch)
        grid = cfg.tp_grid
        key = ("grid", id(base), grid, cfg.tp_mode, cfg.pp, cfg.dp, cfg.recompute)
        hit = self.cache.units.get(key)
        if hit is not None and hit[0] is base:
            return hit[1]
        n = len(base.time)
        out = UnitCosts(n)
        out.tensors, out.cut = list(base.tensors), list(base.cut)
        comms: dict[tuple, tuple[float, float]] = {}   # the layers' units alike
        lists = self._unit_param_lists[0]
        for u, (cube, split, whole) in enumerate(self._grid_unit_split(sh, cfg)):
            counts = self._grid_counts(sh, cfg, [name for name, _ in lists[u]])
            if (cube, split, whole, counts) not in comms:
                comms[cube, split, whole, counts] = self._row_comm(cfg, cube, split, whole, counts)
            gathers, total = comms[cube, split, whole, counts]
            gathered = (cube + split + whole - _grid_share(cfg, cube, split, whole)) * self.itemsize
            out.fwd[u] = base.fwd[u] + gathers
            out.comm[u] = base.comm[u] + total
            out.time[u] = base.time[u] + total
            out.params[u] = base.params[u] - gathered / self.itemsize
            out.act[u] = base.act[u] + (gathered if cfg.recompute == "none" else 0.0)
            out.fixed[u] = base.fixed[u] + (gathered if cfg.recompute != "none" else 0.0)
        self.cache.units[key] = (base, out)
        return out

    def cp_attention_costs(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict) -> tuple[float, list[float]]:
        """Per microbatch under ``cfg.cp``: the time of every attention op's
        key and value all-gathers (forward) and gradient reduce-scatters
        (backward) over the cp axis, where the runtime gathers them (before
        GQA's repeat), and per attention op the bytes of the keys and values
        from the other cp ranks it keeps for backward (as it reads them,
        repeated). ``shapes``: one cp rank's (:meth:`token_shapes`)."""
        cp, tp = cfg.cp, cfg.tp
        mesh = ((cfg.pp,) if cfg.pp > 1 else ()) + (cfg.dp, cp, tp)
        topo, axis = self.topology(mesh), len(mesh) - 2
        axes = (*sh.others, sh)     # a tp_mode=mesh group's axes (the tp axis alone for 1d)
        pieces = mesh_pieces(tuple(ax.n for ax in axes))     # of what a reader wants, not of what is stored

        def local(name: str, reader: str) -> float:
            """Bytes of ``name`` on one rank as ``reader``'s strategy reads it on the tensor axes."""
            node, wants = self.graph[reader], []
            for ax in axes:
                st = ax.strategy.get(reader)
                wants.append(st.ins[node.inputs.index(name)] if st is not None and name in node.inputs
                             else ax.out.get(name, R))
            return _numel(shapes.get(name)) * self.itemsize / pieces(joint_placement(wants))

        total, kv = 0.0, []
        for att in attentions(self.graph):
            readers = (att.node, att.node) if att.fused else (att.scores, att.context)
            kept = 0.0
            for (src, first), name, reader in zip(att.gathered, (att.k, att.v), readers):
                moved = local(src, first) * cp
                total += topo.collective_time("all_gather", moved, axis) + \
                    topo.collective_time("reduce_scatter", moved, axis)
                kept += local(name, reader) * (cp - 1)
            kv.append(kept)
        return total, kv

    # -- pieces ---------------------------------------------------------------
    def _grad_bytes(self, cfg: ParallelConfig) -> int:
        """Bytes of one accumulated (and reduced) gradient element."""
        if self.precision == "fp32":
            return 4
        return 4 if (cfg.reduce_dtype or "fp32") == "fp32" else 2

    def _state_bytes(self, cfg: ParallelConfig, local: float) -> dict[str, float]:
        """Model states of ``local`` trainable elements on one device:
        weights, gradients, optimizer state (with the fp32 master under
        bf16/fp16), ZeRO-sharded over ``dp``; ``offloaded`` is what
        ``offload=optimizer`` keeps on the host instead (the master and
        state; with ZeRO-3 also the sharded weights and gradients, as FSDP2's
        CPU offload does), and ``total`` what stays on the device."""
        n = int(local)
        st = dict(model_state_bytes(n, self.optimizer, self.precision, self._grad_bytes(cfg)))
        if cfg.zero >= 3 and self.precision != "fp32":
            # FSDP2 keeps the sharded parameter in fp32: it is the master copy
            st["optimizer"] -= 4 * n - st["weights"]
            st["weights"] = 4 * n
        st = dict(zero_sharded_state_bytes(st, cfg.dp, cfg.zero))
        if cfg.zero in (1, 2) and cfg.dp > 1:
            # the distributed optimizer's own buffers (runtime/optim.py): fp32 weights get a
            # separate fp32 master shard; ZeRO-1 keeps the reduce-scatter's output shard too
            if self.precision == "fp32":
                st["optimizer"] += -(-4 * n // cfg.dp)
            if cfg.zero == 1:
                st["gradients"] += -(-self._grad_bytes(cfg) * n // cfg.dp)
            elif cfg.microbatches > 1 or not cfg.overlap:
                # ZeRO-2 stages a bucket's gradients whole before its reduce-scatter; the last
                # bucket of a microbatch is still in flight while the next one's forward runs
                # (without overlap the staging holds the step's whole gradients)
                whole = self._grad_bytes(cfg) * n
                st["gradients"] += min(cfg.bucket_mb * (1 << 20), whole) if cfg.overlap else whole
        host = 0.0
        if cfg.offload == "optimizer":
            for k in (("weights", "gradients", "optimizer") if cfg.zero >= 3 else ("optimizer",)):
                host += st[k]
                st[k] = 0
        st["offloaded"] = host
        st["total"] = st["weights"] + st["gradients"] + st["optimizer"]
        return st

    def state_per_elem(self, cfg: ParallelConfig) -> float:
        """Device bytes of model state per local trainable element."""
        cfg = self.token_view(cfg)
        big = 1 << 30
        return self._state_bytes(cfg, big)["total"] / big

    def _reduction(self, kind: str, nbytes: float, backward_s: float, cfg: ParallelConfig, coll) -> float:
        """Exposed time of a gradient reduction of ``nbytes`` in buckets of
        ``cfg.bucket_mb``: with ``overlap``, bucket k of n is ready k/n into
        the backward of ``backward_s`` and the buckets are reduced one after
        another, so what shows is max(one bucket, n buckets - the backward
        before the last one, times the device's ``comm_overlap``), plus the
        backward's slowdown while the hidden part runs beside it
        (:meth:`_beside`); without, all n buckets after the backward."""
        n = max(1, math.ceil(nbytes / (cfg.bucket_mb * (1 << 20))))
        c = coll(kind, nbytes / n)
        if not cfg.overlap:
            return n * c
        shown = max(c, n * c - backward_s * (1 - 1 / n) * self.cluster.device.comm_overlap)
        return shown + self._beside(n * c - shown)

    def _copies_overlap(self, n: int, compute: float, tp_comm: float) -> tuple[float, float]:
        """Multi-copy parallel (``copies=n``): the tensor-parallel
        communication left exposed and the compute beside the hidden part.
        A copy's collectives run while the other ``n - 1`` copies compute, so
        up to ``(n - 1) / n`` of them hide behind as much of the compute,
        times the device's ``comm_overlap`` (0 on the CPU here: nothing
        hides, and copies only cost the smaller ops' efficiency); what hides
        slows the compute beside it (:meth:`_beside`)."""
        hidden = self.cluster.device.comm_overlap * (n - 1) / n * min(tp_comm, compute)
        return tp_comm - hidden, compute + self._beside(hidden)

    def _beside(self, resident_s: float) -> float:
        """Compute time lost to collectives resident ``resident_s`` seconds
        beside it (summed over concurrent ones): NCCL's thread blocks hold the
        device's ``comm_compute_share`` of its SMs while they run, so hidden
        communication is not free."""
        return self.cluster.device.comm_compute_share * resident_s

    def _fsdp_unit(self, g: float, r: float, f: float, b: float) -> float:
        """ZeRO-3 (FSDP2) time of one unit after the first, with overlap:
        its forward ``f`` beside the prefetch of the next unit's gather ``g``,
        its backward ``b`` beside the next gather and its own gradients'
        reduce-scatter ``r``. The gather and the reduce-scatter run on two
        streams at once and share the data-parallel link, so together they
        take ``g + r``, and both hold their SMs while they share it: the
        shorter one is resident twice its own time, the other ``g + r``.
        Each pass takes its compute slowed by what runs beside it
        (:meth:`_beside`), or the communication when that is longer."""
        fwd = max(f + self._beside(g), g)
        bwd = max(b + self._beside(g + r + 2 * min(g, r)), g + r)
        return fwd + bwd

    def _fsdp_copies(self, elems: float, pb: float, gb: float) -> tuple[float, float]:
        """The memory-bound copies FSDP2 runs around one unit's collectives of
        ``elems`` (unsharded) elements, in its forward and in its backward:
        each all-gather's copy-out (the gathered flat buffer split into the
        parameters, on the compute stream: read and written, ``pb`` bytes an
        element) and, in backward, the reduce-scatter's copy-in (the
        unsharded gradients into the flat input, ``gb`` bytes an element). On
        the device's streaming bandwidth; they slow the compute, and hide
        behind a gather that is slower than it."""
        dev = self.cluster.device
        rate = dev.memory_bandwidth * dev.memory_efficiency
        gather = 2 * elems * pb / rate
        return gather, gather + 2 * elems * gb / rate

    def _dp_tail(self, cfg: ParallelConfig, local: float, n_tensors: float, topo: MeshTopology, axis: int,
                 fwd_s: float, bwd_s: float, units_: int) -> tuple[float, float, dict[str, float]]:
        """Data-parallel communication (exposed), optimizer time and model
        states of a rank holding ``local`` trainable elements; ``fwd_s`` and
        ``bwd_s`` are one microbatch's forward and backward compute (what
        overlapped communication hides behind), ``units_`` the FSDP units of
        ZeRO-3 (the layers and the root)."""
        dp, m = cfg.dp, cfg.microbatches
        st = self._state_bytes(cfg, local)
        gb, pb = self._grad_bytes(cfg), self.itemsize
        comm = 0.0
        if dp > 1:
            def coll(kind: str, nbytes: float) -> float:
                return topo.collective_time(kind, nbytes, axis)

            comm += coll("all_reduce", 4)     # the loss, for the caller
            grads = local * gb
            if cfg.zero == 0:
                comm += self._reduction("all_reduce", grads, bwd_s, cfg, coll)
            elif cfg.zero == 1:     # reduce-scatter after the last microbatch, all-gather after the step
                comm += self._reduction("reduce_scatter", grads, bwd_s, cfg, coll) + coll("all_gather", local * pb)
            elif cfg.zero == 2:     # reduce-scatter after every microbatch
                comm += m * self._reduction("reduce_scatter", grads, bwd_s, cfg, coll) + \
                    coll("all_gather", local * pb)
            else:                   # FSDP2: per unit, gather in forward, gather + reduce-scatter in backward
                n = max(units_, 1)
                g, r = coll("all_gather", local * pb / n), coll("reduce_scatter", grads / n)
                cf, cb = self._fsdp_copies(local / n, pb, gb)
                if cfg.overlap:     # the next unit's gather is prefetched behind this one's compute
                    hide = self.cluster.device.comm_overlap
                    f, b = hide * fwd_s / n, hide * bwd_s / n
                    # the first gather of each pass waits; the last reduce-scatter runs after it
                    per = 2 * g + r + cf + cb + (n - 1) * (self._fsdp_unit(g, r, f + cf, b + cb) - f - b)
                else:
                    per = n * (2 * g + r + cf + cb)
                comm += m * per
        dev = self.cluster.device
        opt = n_tensors * dev.optimizer_overhead_s.get(self.optimizer, 0.0)
        if cfg.offload == "optimizer":
            host = self.cluster.host
            if host is None:
                raise StrategyError(f"offload=optimizer: cluster {self.cluster.name!r} does not describe its host "
                                    "(add a 'host' section: device-host link, host memory bandwidth and size)")
            shard = local / dp if cfg.zero >= 1 else local
            # grads down and updated weights up (ZeRO-3: every microbatch's shards)
            moved = shard * (gb + (4 if cfg.zero >= 3 else pb)) * (m if cfg.zero >= 3 else 1)
            opt += moved / host.link.bandwidth + 2 * host.link.latency
            # the host runs the optimizer's ops on the fp32 master and state
            opt += optimizer_step_bytes(shard, self.optimizer) / host.memory_bandwidth
        else:
            opt += self._optimizer_bytes(cfg, local) / (dev.memory_bandwidth * dev.memory_efficiency)
        return comm, opt, st

    def _dp_tails(self, cfg: ParallelConfig, sh: AxisSharding, local: float, n_tensors: float,
                  topo: MeshTopology, fwd_s: float, bwd_s: float) -> tuple[float, float, dict[str, float]]:
        """:meth:`_dp_tail` of a configuration without a pipeline. With
        ``fsdp_layers = k``: the ZeRO-3 tail of the first k layers'
        parameters (k FSDP2 units, each hiding its collectives behind its
        layer's share of the compute) plus the ``zero`` tail of the rest (one
        bucketed reduction over the whole backward), their model states
        added; the loss's all-reduce counted once."""
        k = cfg.fsdp_layers
        if not k:
            return self._dp_tail(cfg, local, n_tensors, topo, 0, fwd_s, bwd_s, self._fsdp_units())
        elems = self._fsdp_layer_elems(sh, cfg.tp, k)
        e3, t3 = sum(elems), sum(len(ps) for _, ps in fsdp_layer_params(self.graph)[:k])
        share = k / self._fsdp_units()
        c3, o3, s3 = self._dp_tail(dataclasses.replace(cfg, zero=3, fsdp_layers=0), e3, t3, topo, 0,
                                   fwd_s * share, bwd_s * share, k)
        cz, oz, sz = self._dp_tail(dataclasses.replace(cfg, fsdp_layers=0), local - e3, n_tensors - t3, topo, 0,
                                   fwd_s, bwd_s, 1)
        loss = topo.collective_time("all_reduce", 4, 0) if cfg.dp > 1 else 0.0
        return c3 + cz - loss, o3 + oz, {key: s3[key] + sz[key] for key in sz}

    def _fsdp_layer_elems(self, sh: AxisSharding, tp: int, k: int) -> list[float]:
        """Local elements of each of the first ``k`` layers' own parameters
        (:func:`fsdp_layer_params`: what ``fsdp_layers=k`` shards over dp)."""
        key = (id(sh), tp)
        if key not in self.cache.fsdp_elems:
            out = sh.out
            self.cache.hold(sh)
            self.cache.fsdp_elems[key] = [sum(numel / tp if is_shard(out.get(name, R)) else numel
                                              for name, numel in ps) for _, ps in fsdp_layer_params(self.graph)]
        return self.cache.fsdp_elems[key][:k]

    def _optimizer_bytes(self, cfg: ParallelConfig, local: float) -> float:
        """Bytes the device's optimizer step moves for ``local`` trainable
        elements: torch's ops over this rank's shard (ZeRO >= 1 splits it over
        ``dp``), and under bf16/fp16 the casts around them (FSDP2 keeps the
        sharded parameter in fp32 and casts at the gather: none)."""
        shard = local / cfg.dp if cfg.zero >= 1 else local
        precision = "fp32" if cfg.zero >= 3 else self.precision
        return optimizer_step_bytes(shard, self.optimizer, precision, self._grad_bytes(cfg))

    def _gathered(self, cfg: ParallelConfig, sh: AxisSharding) -> float:
        """ZeRO-3's unsharded weights at the peak: the root's (outside the
        layers, kept for the whole step) and two layers' (the one running and
        the one prefetched), in the compute dtype."""
        if cfg.fsdp_layers:     # the FSDP2 layers only: the root is not sharded
            layers = self._fsdp_layer_elems(sh, cfg.tp, cfg.fsdp_layers)
            return min(2, len(layers)) * max(layers) * self.itemsize
        if cfg.zero < 3 or (cfg.dp == 1 and cfg.offload == "none"):
            return 0.0
        try:
            elems, _ = self._unit_params(sh, cfg.tp)
        except StrategyError:
            return self._local_params(sh, cfg.tp)[0] * self.itemsize
        return _fsdp_peak(elems) * self.itemsize

    def _fsdp_units(self) -> int:
        try:
            return units(self.graph).layers + 1
        except StrategyError:
            return 1

    def _flops_at(self, global_batch: int) -> float:
        """Forward FLOPs of the whole model at ``global_batch``."""
        a, b = self._flops_split
        return a * global_batch + b

    @cached_property
    def _flops_split(self) -> tuple[float, float]:
        """Forward FLOPs per sample and those independent of the batch."""
        per_sample = sum(nd.flops for nd in self.graph.nodes if nd.name in self._per_sample)
        fixed = sum(nd.flops for nd in self.graph.nodes if nd.name not in self._per_sample)
        return per_sample / self.graph.batch_size, fixed

    @cached_property
    def _per_sample(self) -> frozenset[str]:
        """The nodes whose work grows with the samples: those the batch axis
        splits (or sums over), and every node reading such a value, since each
        data-parallel rank runs its program on its own samples. The batch
        analysis replicates the ops it has no rule for (a mixture of experts'
        routing: ``topk``, ``sort``, ``histc``, ``index``), and the expert
        matmuls after them were counted at the traced batch per microbatch."""
        out = {name for name, p in self.batch.out.items() if p != R}
        for nd in self.graph.nodes:    # graph order: a reader after what it reads
            if nd.name not in out and nd.out is not None and not nd.is_state and any(i in out for i in nd.inputs):
                out.add(nd.name)
        return frozenset(out)

    def per_sample_nodes(self) -> frozenset[str]:
        """The nodes whose work (and values) grow with the samples (:attr:`_per_sample`)."""
        return self._per_sample

    def scale(self, nd: Node, local_batch: float) -> float:
        """How much of ``nd``'s traced work one device does at ``local_batch`` samples."""
        return local_batch / self.graph.batch_size if nd.name in self._per_sample else 1.0

    def node_time(self, nd: Node, scale: float, frac: float) -> float:
        """Forward roofline time of ``nd`` doing ``frac`` of its work at ``scale`` times the traced batch."""
        if nd.flops == 0 and nd.act_bytes == 0:
            return 0.0
        nbytes = (nd.act_bytes * scale * self.itemsize / 4 + nd.param_bytes * self.itemsize / 4) * frac
        family = ops.family(nd.kind)
        # a misaligned product slows tensor-core kernels (bf16/fp16); fp32 runs on the vector units either way
        aligned = family != "matmul" or self.itemsize == 4 or self._aligned(nd.name)
        return op_time(self.cluster.device, nd.flops * scale * frac, nbytes, self.dtype, family, aligned)

    def _aligned(self, name: str) -> bool:
        """Whether the matrix product ``name`` has every dimension a multiple of
        16 bytes of the (bf16/fp16) compute dtype: its output's and its tensor inputs' last
        dimensions (which hold the contraction and output widths of a linear, an
        addmm or a batched product). GPT-2's vocabulary of 50257 is not; on a GPU
        its logits' GEMMs then run without vectorised loads (at about a fifth of
        the aligned rate on an H100, ``benchmarks/results/step_profile_gpu-*``)."""
        hit = self._alignment.get(name)
        if hit is None:
            step = 16 // self.itemsize
            nd = self.graph[name]
            dims = [nd.out.shape[-1]] if nd.out is not None and nd.out.shape else []
            for i in nd.inputs:
                src = self.graph[i].out if i in self.graph else None
                if src is not None and src.shape:
                    dims.append(src.shape[-1])
            hit = self._alignment[name] = all(d % step == 0 for d in dims)
        return hit

    def param_time(self, cfg: ParallelConfig, topo: MeshTopology,
                   pieces: Callable[[str], int] | None = None) -> Callable[[Node, str], float]:
        """Seconds per microbatch a weight costs in a placement, as
        :meth:`estimate` counts them per step: its share of the data-parallel
        gradient all-reduce, of the optimizer pass and, with ZeRO-3, of the
        weight all-gathers (the per-message latencies do not depend on the
        placement and are left out). ``pieces`` as :meth:`param_memory`'s."""
        big = float(1 << 30)
        m, tp, dp, isz = cfg.microbatches, cfg.tp, cfg.dp, self.itemsize
        per_elem = 0.0
        if dp > 1:
            slope = (topo.collective_time("all_reduce", big, 0) - topo.collective_time("all_reduce", 0.0, 0)) / big
            per_elem += slope * isz / m
            if cfg.zero >= 3:
                ag = (topo.collective_time("all_gather", big, 0) - topo.collective_time("all_gather", 0.0, 0)) / big
                per_elem += 2 * ag * isz
        dev = self.cluster.device
        per_elem += self._optimizer_bytes(cfg, big) / big / (dev.memory_bandwidth * dev.memory_efficiency) / m

        pieces = pieces or _tp_pieces(tp)

        def param_time(nd: Node, p: str) -> float:
            info = self.graph.params.get(nd.param) if nd.param else None
            if info is None or info.is_buffer or not info.requires_grad:
                return 0.0
            return info.numel * per_elem / pieces(p)

        return param_time

    def param_memory(self, cfg: ParallelConfig,
                     pieces: Callable[[str], int] | None = None) -> Callable[[Node, str], float]:
        """``f(parameter node, placement)``: device bytes of its model states
        under ``cfg`` (ZeRO-divided), as :meth:`estimate` counts them; 0 for
        buffers and frozen weights. ``pieces(placement)``: how many parts a
        tensor so placed is cut in, one per rank (default: ``tp`` for a
        shard; for a mesh placement, :func:`autopar.spec.placement.mesh_pieces`)."""
        per_elem = self.state_per_elem(cfg)
        pieces = pieces or _tp_pieces(cfg.tp)

        def param(nd: Node, p: str) -> float:
            info = self.graph.params.get(nd.param) if nd.param else None
            if info is None or info.is_buffer or not info.requires_grad:
                return 0.0
            return info.numel * per_elem / pieces(p)

        return param

    def saved_memory(self, cfg: ParallelConfig, shapes: dict, pieces: Callable[[str], int] | None = None,
                     partial: Callable[[str], bool] | None = None,
                     keeps: frozenset[str] | None = None) -> Callable[[Node, Any], float]:
        """``f(node, strategy)``: bytes of the activations the node keeps for
        backward per microbatch under ``cfg``'s recompute, its inputs in the
        placements the strategy reads (a value read by several nodes counts
        once per reader: an upper bound). Under selective recompute a layer's
        weight matmul or attention keeps its output as on one device
        (:func:`~autopar.sharding.selective_keeps`) unless the strategy
        leaves it partial: a reduction, not a backward, reads that first.
        ``pieces`` as :meth:`param_memory`'s; ``partial(placement)``: whether a
        value so placed is a partial sum (default: ``P``); ``keeps``: what
        selective recompute keeps (default: as on one device, what the
        decisions are not known yet to change)."""
        if cfg.recompute != "selective":
            keeps = frozenset()
        elif keeps is None:
            keeps = self._keeps(None)
        pieces = pieces or _tp_pieces(cfg.tp)
        partial = partial or (lambda p: p == P)

        def saved(nd: Node, st) -> float:
            wants = dict(zip(nd.inputs, st.ins))
            total = 0.0
            for i in self._saved_names(nd, cfg.recompute, keeps if not partial(st.out) else frozenset()):
                total += _numel(shapes.get(i)) * self.itemsize / pieces(wants.get(i, st.out))
            return total

        return saved

    def param_units(self) -> dict[str, list[int]]:
        """The pipeline units reading every trainable parameter node."""
        return {name: us for name, _, us in self._param_unit_list}

    # -- the estimate ---------------------------------------------------------
    def estimate(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int,
                 devices: int | None = None, partition: Sequence[int] | None = None,
                 simulate_schedule: bool = True) -> Estimate:
        """Predict ``cfg`` with the tensor-parallel decisions ``sh`` on the
        local ``shapes`` (:func:`autopar.sharding.scaled_shapes` at one
        microbatch, over ``dp``).

        With ``pp > 1``, ``partition`` is the layer count of every virtual
        stage (None: Megatron's equal split). With
        ``simulate_schedule=False`` the pipeline's makespan is a lower bound
        (the busiest rank after the pipeline's fill and drain, or one
        microbatch through every stage) instead of
        the simulated schedule, and ``pipeline["simulated"]`` is False: the
        search uses it to skip simulating pipelines that cannot win.

        Raises :class:`StrategyError` when ``cfg`` cannot run the model on
        ``devices`` (:func:`check_config`), names another precision than this
        model's, or ``partition`` does not cover the layers."""
        if cfg.precision and ("bf16" if cfg.precision == "mixed" else cfg.precision) != self.precision:
            raise StrategyError(f"strategy precision {cfg.precision!r}: this cost model prices "
                                f"{self.precision}; build a CostModel with precision={cfg.precision!r}")
        g = self.graph
        devices = devices or cfg.devices
        check_config(g, cfg, devices, global_batch)
        self.cluster.check_devices(devices)
        self.cache.hold(sh)
        if cfg.cp > 1:
            return self._estimate_cp(cfg, sh, shapes, global_batch, devices, partition, simulate_schedule)
        if cfg.tp_mode in MESH_MODES and cfg.pp == 1:
            return self._estimate_mesh(cfg, sh, shapes, global_batch, devices)
        if cfg.is_grid and cfg.pp == 1:
            return self._estimate_2d(cfg, sh, shapes, global_batch, devices)
        if cfg.pp > 1:
            return self._estimate_pipeline(cfg, sh, shapes, global_batch, devices, partition, simulate_schedule)
        return self._estimate_flat(cfg, sh, shapes, global_batch, devices)

    def _estimate_flat(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int,
                       devices: int, grid_comm: float = 0.0) -> Estimate:
        """:meth:`estimate` without a pipeline (``cfg`` checked). ``grid_comm``:
        a grid's own collectives per copy of a microbatch (:meth:`_row_comm`),
        tensor-parallel communication the copies overlap as the columns'.
        (Long because the Estimate's fields are assembled here, one per line.)"""
        tp, dp, m, n = cfg.tp, cfg.dp, cfg.microbatches, cfg.copies
        topo = self.topology((dp, tp))
        local_batch = global_batch / (dp * m * n)     # one copy's samples (the microbatch's without copies)
        if n > 1:
            shapes = scaled_shapes(self.graph, global_batch // (m * n), dp)
        isz = self.itemsize
        # the sums see dp only through the samples per rank and the tp axis's link
        skey = (tp, topo.spans_nodes(1), local_batch, cfg.recompute, id(sh))
        if skey not in self.cache.sums:
            self.cache.sums[skey] = self._microbatch_sums(cfg, sh, shapes, topo, local_batch)
        fwd, tp_comm, transient, saved_outside, inst_saved, inst_full, refwd, layer_comm = \
            _times_copies(self.cache.sums[skey], n)

        passes = 3.0 + (1.0 if cfg.recompute == "full" else 0.0)
        compute = m * (passes * fwd + refwd)    # selective: the cheap ops of the layers run again
        tp_comm_total = m * (tp_comm + (_comm_passes(cfg) - 1) * layer_comm) + m * n * grid_comm
        if n > 1:
            tp_comm_total, compute = self._copies_overlap(n, compute, tp_comm_total)

        # model states, data-parallel communication, optimizer
        local_params, n_tensors = self._local_params(sh, tp)
        mb_fwd = fwd + tp_comm / 2
        dp_comm, opt_time, states = self._dp_tails(cfg, sh, local_params, n_tensors, topo, mb_fwd,
                                                   (passes - 1) * fwd + tp_comm / 2)
        dp_comm += m * self._meeting_comm(cfg, global_batch // m, topo)
        activations = saved_outside + sum(inst_saved.values())
        recomputed = 0.0     # one layer's values materialised again while its backward runs
        if cfg.recompute == "full" and inst_saved:
            activations = saved_outside + n * self._layer_inputs(sh, shapes, tp)
            recomputed = max(inst_saved.values())
        elif cfg.recompute == "selective" and inst_saved:
            activations += n * self._layer_inputs(sh, shapes, tp)
            recomputed = max(inst_full[k] - inst_saved[k] for k in inst_saved)
        gathered = self._gathered(cfg, sh)
        # DDP-style (ZeRO-0, fp32, on the device) and FSDP2 (ZeRO-3) with one microbatch: the
        # gradients are created as the backward frees the activations, so the two never peak together
        ddp = (cfg.zero == 0 and self.precision == "fp32") or cfg.zero == 3
        freed = -min(activations + recomputed, states["gradients"]) if m == 1 and ddp and cfg.offload == "none" \
            else 0.0
        peak = states["total"] + activations + recomputed + 2 * transient + gathered + freed
        step = compute + tp_comm_total + dp_comm + opt_time
        model_flops = 3.0 * self._flops_at(global_batch)
        cap = self.cluster.device.memory_bytes * MEMORY_HEADROOM
        return Estimate(
            strategy=cfg.to_string(), step_time_s=step, compute_time_s=compute,
            comm_time_s=tp_comm_total + dp_comm, tp_comm_time_s=tp_comm_total, dp_comm_time_s=dp_comm,
            optimizer_time_s=opt_time,
            tflops_per_device=model_flops / step / devices / 1e12 if step > 0 else 0.0,
            peak_memory_bytes=peak,
            memory={"weights": states["weights"], "gradients": states["gradients"],
                    "optimizer": states["optimizer"], "activations": activations,
                    "transient": 2 * transient + recomputed + gathered,
                    **({"freed_by_backward": freed} if freed else {})},
            fits=peak <= cap and self._host_fits(states["offloaded"]),
            device_memory_bytes=float(self.cluster.device.memory_bytes),
            devices=devices, global_batch=global_batch, precision=self.precision, optimizer=self.optimizer,
            parallel=cfg.as_dict(), host_memory_bytes=states["offloaded"],
        )

    def _estimate_mesh(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int,
                       devices: int) -> Estimate:
        """:meth:`estimate` of a ``tp_mode=mesh`` ``cfg`` (no pipeline, cp
        or selective recompute: ``check_grid``; copies as for 1d): ``sh`` is the inner axis's
        decisions with the outer ones in ``sh.others``, all from one joint
        program (:func:`autopar.search.mesh_ilp.solve_mesh`). Compute is
        every node's share left by every axis's splits, forward and backward;
        the tensor group's collectives are what the joint program charged
        its decisions (``ilp.collectives_s``: per axis, each transition and
        inside collective on that axis's link); then the
        data-parallel tail and the model states of the local shards as for
        1d, and the activations each joint strategy keeps (full recompute: the
        layers' inputs and one layer's values, a fourth pass and the layers'
        forward collectives again). (Long because the Estimate's fields are
        assembled here, one per line.)"""
        self._mesh_sizes(cfg, sh)     # checked: the joint decisions of every axis
        dp, m, n = cfg.dp, cfg.microbatches, cfg.copies
        local_batch = global_batch / (dp * m * n)     # one copy's samples (the microbatch's without copies)
        if n > 1:
            shapes = scaled_shapes(self.graph, global_batch // (m * n), dp)
        parts = self._mesh_parts(sh)
        b = self._mesh_buckets(cfg, sh, shapes, local_batch, lambda nd: 0, 1)[0]
        fwd, outside, transient, inst_saved = b.fwd, b.outside, b.transient, b.saved
        local, n_tensors = 0.0, 0
        for nd in self.params.values():
            info = self.graph.params.get(nd.param)
            if info is not None and not info.is_buffer and info.requires_grad:
                local += info.numel / parts(nd.name)
                n_tensors += 1
        tp_comm = b.comm      # what the joint program charged its collectives (selective: the replays too)
        full = cfg.recompute == "full" and bool(inst_saved)
        selective = cfg.recompute == "selective" and bool(inst_saved)
        activations = outside + sum(inst_saved.values())
        recomputed = 0.0      # one layer's values made again while its backward runs
        if full:     # the layers' inputs are kept; their forward, collectives included, runs again
            recomputed = max(inst_saved.values())
            activations = outside + sum(self._mesh_layer_inputs(sh, shapes).values())
        elif selective:      # the layers' inputs and what the decisions keep; the rest made again
            recomputed = max(b.full[k] - inst_saved[k] for k in inst_saved)
            activations += sum(self._mesh_layer_inputs(sh, shapes).values())
        # full recompute: the layers' forward collectives again, about half of their forward and backward's
        # (as for 1d, _comm_passes); n copies' add up
        compute = m * n * ((4.0 if full else 3.0) * fwd + b.refwd)
        tp_comm_total = m * n * (tp_comm + (_comm_passes(cfg) - 1) * b.layer_comm)
        if n > 1:     # one copy's collectives beside the others' compute; the copies' values live at once
            tp_comm_total, compute = self._copies_overlap(n, compute, tp_comm_total)
            activations, recomputed = n * activations, n * recomputed    # one copy's transient (_times_copies)
        topo = self.topology((dp, cfg.tp))
        dp_comm, opt_time, states = self._dp_tail(cfg, local, n_tensors, topo, 0, fwd + tp_comm / 2,
                                                  2 * fwd + tp_comm / 2, self._fsdp_units())
        # ZeRO-3: FSDP2's units gathered at the peak; as for 1d, DDP-style and FSDP2 reductions with one
        # microbatch make the gradients as the backward frees the activations
        gathered = 0.0
        if cfg.zero >= 3 and (dp > 1 or cfg.offload != "none"):
            try:
                gathered = _fsdp_peak(self._mesh_unit_elems(cfg, sh)) * self.itemsize
            except StrategyError:     # no repeated layers: one unit, the whole model
                gathered = local * self.itemsize
        ddp = (cfg.zero == 0 and self.precision == "fp32") or cfg.zero == 3
        freed = -min(activations + recomputed, states["gradients"]) if m == 1 and ddp and cfg.offload == "none" \
            else 0.0
        peak = states["total"] + activations + recomputed + 2 * transient + gathered + freed
        step = compute + tp_comm_total + dp_comm + opt_time
        cap = self.cluster.device.memory_bytes * MEMORY_HEADROOM
        return Estimate(
            strategy=cfg.to_string(), step_time_s=step, compute_time_s=compute,
            comm_time_s=tp_comm_total + dp_comm, tp_comm_time_s=tp_comm_total, dp_comm_time_s=dp_comm,
            optimizer_time_s=opt_time,
            tflops_per_device=3.0 * self._flops_at(global_batch) / step / devices / 1e12 if step > 0 else 0.0,
            peak_memory_bytes=peak,
            memory={"weights": states["weights"], "gradients": states["gradients"],
                    "optimizer": states["optimizer"], "activations": activations,
                    "transient": 2 * transient + recomputed + gathered,
                    **({"freed_by_backward": freed} if freed else {})},
            fits=peak <= cap and self._host_fits(states["offloaded"]),
            device_memory_bytes=float(self.cluster.device.memory_bytes),
            devices=devices, global_batch=global_batch, precision=self.precision, optimizer=self.optimizer,
            parallel=cfg.as_dict(), host_memory_bytes=states["offloaded"],
        )

    @staticmethod
    def _mesh_sizes(cfg: ParallelConfig, sh: AxisSharding) -> tuple[int, ...]:
        """The axis sizes of a ``tp_mode=mesh`` ``cfg``'s decisions ``sh`` (its
        inner axis, the outer ones in ``sh.others``), checked to be one
        joint program's decisions of every axis of ``cfg``'s mesh."""
        sizes = tuple(ax.n for ax in (*sh.others, sh))
        if len(sizes) < 2 or getattr(sh.ilp, "node_collectives_s", None) is None or math.prod(sizes) != cfg.tp:
            raise StrategyError(f"{cfg.to_string()}: a mesh estimate needs the joint program's decisions of "
                                f"every axis ({'x'.join(map(str, cfg.tp_grid))})")
        return sizes

    def _mesh_buckets(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, local_batch: float,
                      bucket: Callable[[Node], int], n: int) -> list["_MeshSums"]:
        """The ops a mesh's joint decisions ``sh`` place, at ``local_batch``
        samples, summed into ``n`` buckets (``bucket(node)``: the whole model
        in one, or a pipeline's units): each op's forward time at the share of
        its work every axis's split leaves, the collectives the joint program
        charged it (``ilp.node_collectives_s``: its own and the transitions
        into it; half as much again where selective recompute replays it),
        what it keeps for backward at the placements its joint strategy
        reads (per layer instance; under selective recompute what the
        decisions keep, :meth:`_keeps`, and what no recompute would), the
        forward selective recompute runs again, and the largest output."""
        axes = (*sh.others, sh)
        sizes = tuple(ax.n for ax in axes)
        pieces = mesh_pieces(sizes)
        selective = cfg.recompute == "selective"
        keeps = self._keeps(sh) if selective else frozenset()
        tail, charged = self._replay_tail, sh.ilp.node_collectives_s
        dispatch = self.cluster.device.dispatch_overhead_s
        out = [_MeshSums() for _ in range(n)]
        # the values kept, each once however many ops read it (as 1d's sums count them): per bucket,
        # per layer instance (None: outside the layers), value -> bytes; and without recompute
        kept: list[dict] = [{} for _ in range(n)]
        whole: list[dict] = [{} for _ in range(n)]
        for nd in self.graph.nodes:
            sts = [ax.strategy.get(nd.name) for ax in axes]
            if nd.is_state or any(st is None for st in sts):
                continue
            u = bucket(nd)
            b = out[u]
            place = joint_placement([ax.out.get(nd.name, R) for ax in axes])
            kept[u].setdefault(nd.group, {}).update(
                self._mesh_saved(nd, sts, axes, pieces, shapes, cfg.recompute, keeps))
            if selective and nd.group is not None:
                whole[u].setdefault(nd.group, {}).update(self._mesh_saved(nd, sts, axes, pieces, shapes, "none", keeps))
            # the op's kernels at its share of the work, and the host's time per op as for 1d
            t = self.node_time(nd, self.scale(nd, local_batch),
                               math.prod(work_fraction(st, size) for st, size in zip(sts, sizes))) + \
                (dispatch if nd.kind not in NO_DISPATCH else 0.0)
            replayed = selective and nd.group is not None and nd.name not in tail
            b.fwd += t
            b.refwd += t if replayed and nd.name not in keeps else 0.0
            c = charged.get(nd.name, 0.0) * (1.5 if replayed else 1.0)
            b.comm += c
            b.layer_comm += c if nd.group is not None else 0.0
            if nd.group is not None:
                b.ops[nd.group] = b.ops.get(nd.group, 0) + checkpoint_dispatches(nd.kind, nd.target)
            b.transient = max(b.transient, _numel(shapes.get(nd.name)) * self.itemsize / pieces(place))
        for b, by_inst, by_inst_whole in zip(out, kept, whole):
            b.outside = sum(by_inst.pop(None, {}).values())
            b.saved = {g: sum(v.values()) for g, v in by_inst.items()}
            b.full = {g: sum(v.values()) for g, v in by_inst_whole.items()} if selective else dict(b.saved)
            if selective:     # the dispatch mode's host time per replayed layer
                b.refwd += sum(2 * k * self.cluster.device.checkpoint_dispatch_s for k in b.ops.values())
        return out

    def _mesh_saved(self, nd: Node, sts: list, axes: tuple, pieces: Callable[[str], int], shapes: dict,
                    recompute: str, keeps: frozenset[str]) -> list[tuple[str, float]]:
        """:meth:`_saved` on a mesh: the (value, local bytes) pairs ``nd``
        keeps for its backward under the joint strategy ``sts`` (one per axis
        of ``axes``; ``pieces`` as :func:`mesh_pieces` of their sizes). An
        input the op reads in another placement is kept as a tensor of its
        own (``name@placement``), except a sequence-parallel entry, kept as
        its shard on the axis that gathers it again in backward; the attention output split alike is its alias's tensor;
        under selective recompute a partial output is not kept (a reduction,
        not a backward, reads it first)."""
        if P in [ax.out.get(nd.name, R) for ax in axes]:
            keeps = frozenset()
        reads = [dict(zip(nd.inputs, st.ins)) for st in sts]     # per axis, as 1d's _saved reads them
        out = []
        for i in self._saved_names(nd, recompute, keeps):
            haves = [ax.out.get(i, R) for ax in axes]
            wants = list(haves)
            for a, st in enumerate(sts):
                if i in reads[a]:
                    w = reads[a][i]
                    sp_entry = st.split and w == R and is_shard(haves[a]) and self.grad.get(i, False)
                    wants[a] = haves[a] if sp_entry else w
            have, want = joint_placement(haves), joint_placement(wants)
            local = _numel(shapes.get(i)) * self.itemsize / pieces(want)
            if want != have:
                i = f"{i}@{want}"
            elif i in self._aliases and all(is_shard(ax.out.get(self._aliases[i], R)) == is_shard(h)
                                            for ax, h in zip(axes, haves)):
                i = self._aliases[i]
            out.append((i, local))
        return out

    @staticmethod
    def _mesh_parts(sh: AxisSharding) -> Callable[[str], int]:
        """``parts(value)``: how many parts the tensor axes of ``sh`` (a
        mesh's inner axis with its outer ones in ``sh.others``; one axis for
        1d) cut a value in, by its placement on each."""
        axes = (*sh.others, sh)
        pieces = mesh_pieces(tuple(ax.n for ax in axes))
        return lambda name: pieces(joint_placement([ax.out.get(name, R) for ax in axes]))

    def _mesh_layer_inputs(self, sh: AxisSharding, shapes: dict) -> dict[str, float]:
        """Per repeated-layer instance, the local bytes of its input at its
        mesh placement (what full and selective recompute keep of it)."""
        parts = self._mesh_parts(sh)
        return {inst: _numel(shapes.get(i)) * self.itemsize / parts(i) for inst, i in self._layer_inputs_of}

    def _mesh_unit_elems(self, cfg: ParallelConfig, sh: AxisSharding) -> list[float]:
        """Per pipeline unit (embedding, layers, head), the local trainable
        elements of a mesh rank: each parameter the unit reads at its mesh
        placement (a tied one in each unit reading it)."""
        self._mesh_sizes(cfg, sh)     # checked: the joint decisions of every axis
        parts = self._mesh_parts(sh)
        return [sum(numel / parts(name) for name, numel in params) for params in self._unit_param_lists[0]]

    def _mesh_unit_costs(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict,
                         global_batch: int) -> "UnitCosts":
        """:meth:`unit_costs` of a pipelined ``tp_mode=mesh`` ``cfg``: per
        unit, its ops' sums (:meth:`_mesh_buckets`), the parameters at their
        mesh placements, and the local bytes crossing each cut. Full
        recompute keeps a layer's input and makes its values again while its
        backward runs, selective its input and what the decisions keep, as
        for 1d."""
        self._mesh_sizes(cfg, sh)     # checked: the joint decisions of every axis
        key = ("mesh", id(sh), id(shapes), cfg.dp, cfg.microbatches, cfg.recompute, global_batch)
        hit = self.cache.units.get(key)
        if hit is not None and hit[0] is sh:
            return hit[1]

        u = units(self.graph)
        n = u.layers + 2
        layers = {inst: k + 1 for k, inst in enumerate(u.labels[1:-1])}
        unit_of = self._outside_unit()

        def unit(nd: Node) -> int:
            if nd.group is None:
                return unit_of.get(nd.name, 0)
            return layers.get(nd.group) or unit_of.get(self._first_node(nd.group), 0)

        sums = self._mesh_buckets(cfg, sh, shapes, global_batch / (cfg.dp * cfg.microbatches), unit, n)
        layer_in = self._mesh_layer_inputs(sh, shapes)
        passes = 3.0 + (1.0 if cfg.recompute == "full" else 0.0)
        out = UnitCosts(n)
        for k, b in enumerate(sums):
            layer = 0 < k < n - 1
            inner = sum(b.saved.values())
            out.fwd[k] = b.fwd + b.comm / 2
            out.comm[k] = b.comm * (_comm_passes(cfg) if layer else 1.0)
            out.time[k] = passes * b.fwd + b.refwd + out.comm[k]
            if cfg.recompute == "full" and layer:
                out.act[k] = layer_in.get(u.labels[k], 0.0) + b.outside
                out.fixed[k] = 2 * b.transient + inner
            elif cfg.recompute == "selective" and layer:
                out.act[k] = layer_in.get(u.labels[k], 0.0) + b.outside + inner
                out.fixed[k] = 2 * b.transient + sum(b.full.values()) - inner
            else:
                out.act[k] = b.outside + inner
                out.fixed[k] = 2 * b.transient
        out.params = self._mesh_unit_elems(cfg, sh)
        out.tensors = [float(len(params)) for params in self._unit_param_lists[0]]
        out.cut = self._cut_bytes(sh, shapes, cfg.tp, n, self._mesh_parts(sh))
        self.cache.hold(sh)
        self.cache.units[key] = (sh, out)
        return out

    def _meeting_comm(self, cfg: ParallelConfig, mb_global: int, topo: MeshTopology) -> float:
        """Seconds per microbatch of ``mb_global`` samples the data-parallel
        axis spends moving values where the model's samples meet
        (:func:`~autopar.sharding.samples_meet`; the compiler gathers them
        there, :func:`autopar.parallelize.apply_tp`): every transition of
        the batch walk at ``dp`` on the whole shapes that carries data (a
        weight's own do not move), forward and backward, priced by the
        redistribution table on the dp link, at the values' size before any
        tensor-parallel split (an upper bound under tp). 0 without dp or
        where samples do not meet."""
        g = self.graph
        if cfg.dp == 1 or samples_meet(g) is None:
            return 0.0
        key = ("meeting", cfg.dp, mb_global, topo.spans_nodes(0))
        if key not in self.cache.sums:
            whole = scaled_shapes(g, mb_global, 1)
            walk, data, grad = follow_batch(g, cfg.dp, whole, batch_axis=True), data_values(g), needs_grad(g)
            t = 0.0
            for nd in g.nodes:
                st = walk.strategy.get(nd.name)
                for i, want in zip(nd.inputs, st.ins if st is not None else ()):
                    have = walk.out.get(i, R)
                    if have != want and i in data:
                        t += transition_time(have, want, _numel(whole.get(i)) * self.itemsize, grad.get(i, False),
                                             st.split, lambda kind, b: topo.collective_time(kind, b, 0))
            self.cache.sums[key] = (t,)
        return self.cache.sums[key][0]

    def pipeline_lower_bound(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int) -> float:
        """A lower bound on the step time :meth:`estimate` gives the pipelined
        ``cfg`` under any ``partition`` (schedule simulated or not), from the
        per-unit sums alone: the busiest pipeline rank computes at least its
        share of every microbatch's forward and backward, and at least what
        the rank holding the most whole layers does, the embedding on the
        first rank and the head on the last included
        (:func:`~autopar.pipeline.partition.least_busiest`); the slowest
        rank's gradient reduction and optimizer step cost at least those of
        a rank holding the average parameters, or the most whole layers'
        parameters so counted (they grow with the parameters). The
        pipeline's fill and drain are added as :func:`fill_drain_bound` bounds
        them for any partition."""
        cfg, shapes = self.token_view(cfg), self.token_shapes(shapes, cfg.cp)
        per = self.unit_costs(cfg, sh, shapes, global_batch)
        topo = self.topology((cfg.pp, cfg.dp, cfg.tp))
        floor = per.layer_floor()
        busiest_rank, params_rank = per.rank_floor(cfg.pp)
        mean = max(floor.total_params / cfg.pp, params_rank) * (1 - 1e-9)
        dp_comm, opt, _ = self._dp_tail(cfg, mean, 0.0, topo, 1, 0.0, 0.0, 1)
        busiest = cfg.microbatches * max(floor.total_time / cfg.pp, busiest_rank)
        fill = fill_drain_bound(cfg.pp, cfg.chunks, cfg.microbatches, floor.total_time, per.time[0], floor.time)
        makespan = max(busiest, fill * (1 - 1e-6))
        return (makespan + dp_comm + opt) * (1 - 1e-9)

    def pipeline_memory_lower_bound(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict,
                                    global_batch: int) -> float:
        """A lower bound on the peak memory per device :meth:`estimate` gives
        the pipelined ``cfg`` under any ``partition``, from the per-unit sums
        alone, the larger of two:

        * some pipeline rank holds ``ceil(L / pp)`` of the ``L`` layers or
          more, with their model states, their activations times the fewest
          microbatches any stage keeps in flight, and a layer's transient;
        * the ranks share the layers, each layer costing at least a layer's
          model states plus its activations times the fewest microbatches in
          flight on the rank's chunks (``c_r``), on top of the embedding's
          (rank 0) and the head's (the last rank) ``o_r``: with ``B`` the
          fullest rank's, rank ``r`` holds at most ``(B - o_r) / c_r`` layers,
          so ``L <= sum_r (B - o_r) / c_r``, plus the least transient of any
          unit. (1F1B keeps ``pp - r`` microbatches on rank ``r``: this is
          the bound that sees the first ranks fill up.)

        (The model states are ZeRO-rounded up per rank, never down: the
        margin covers the rounding of the sums.)"""
        cfg, shapes = self.token_view(cfg), self.token_shapes(shapes, cfg.cp)
        per = self.unit_costs(cfg, sh, shapes, global_batch)
        floor = per.layer_floor()
        pp, last = cfg.pp, len(per.params) - 1
        most = -(-floor.layers // pp)
        flights = pipe.in_flight(cfg.schedule, pp, cfg.microbatches, cfg.chunks)
        per_elem = self.state_per_elem(cfg)
        layer = [floor.params * per_elem + min(flights[r::pp]) * floor.act for r in range(pp)]
        bound = most * min(layer) + floor.fixed
        if min(layer) > 0:
            held = [0.0] * pp      # the embedding's and the head's memory, on the first and last rank
            held[0] += per.params[0] * per_elem + flights[0] * per.act[0]
            held[-1] += per.params[last] * per_elem + flights[-1] * per.act[last]
            shared = (floor.layers + sum(o / c for o, c in zip(held, layer))) / sum(1 / c for c in layer)
            bound = max(bound, max(shared, max(held)) + min(per.fixed))
        return bound * (1 - 1e-6) - 64.0

    def _host_fits(self, offloaded: float) -> bool:
        """Whether a node's host memory holds its devices' offloaded state."""
        if not offloaded:
            return True
        host = self.cluster.host
        return host is not None and offloaded * self.cluster.devices_per_node <= host.memory_bytes * MEMORY_HEADROOM

    def _estimate_pipeline(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int,
                           devices: int, partition: Sequence[int] | None, simulate_schedule: bool) -> Estimate:
        """Predict a pipelined ``cfg``: the repeated layers are cut into
        ``pp x chunks`` virtual stages, each on a ``dp x tp`` sub-mesh; the
        step is the simulated schedule of the per-stage forward and backward
        times with the point-to-point transfers between stages, then the
        slowest stage's gradient reduction and optimizer step. Memory is
        per pipeline rank: its stages' model states, the activations of the
        microbatches its schedule keeps in flight, and the largest transient.
        (Long because the Estimate's fields are assembled here, one per line.)"""
        tp, dp, pp, m, V = cfg.tp, cfg.dp, cfg.pp, cfg.microbatches, cfg.stages
        topo = self.topology((pp, dp, tp))
        per = self.unit_costs(cfg, sh, shapes, global_batch)
        flight = pipe.in_flight(cfg.schedule, pp, m, cfg.chunks)
        cap = self.cluster.device.memory_bytes * MEMORY_HEADROOM
        n_layers = len(per.time) - 2
        if partition is None:
            split = pipe.even_layers(n_layers, V)
        else:
            split = list(partition)
            pipe.check_layers(split, n_layers)
        bounds = pipe.unit_bounds(split)

        def stage_sum(xs: list[float], v: int) -> float:
            return sum(xs[bounds[v]:bounds[v + 1]])

        fwd = [stage_sum(per.fwd, v) for v in range(V)]
        bwd = [stage_sum(per.time, v) - fwd[v] for v in range(V)]
        p2p = [self._send_recv((pp, dp, tp), per.cut[bounds[v + 1]]) for v in range(V - 1)]
        if simulate_schedule:
            tl = self._simulate(cfg, fwd, bwd, p2p)
        else:
            busy = [m * sum(fwd[v] + bwd[v] for v in range(r, V, pp)) for r in range(pp)]
            chain = sum(fwd) + sum(bwd) + 2 * sum(p2p)
            # the fill and drain too (a margin for the simulation's extrapolated makespans)
            fill = makespan_lower_bound(pp, m, fwd, bwd, p2p) * (1 - 1e-6)
            tl = Timeline(pp=pp, chunks=cfg.chunks, makespan=max(max(busy), chain, fill), busy=busy,
                          peak_in_flight=[0] * pp)
        # per pipeline rank: its chunks' model states, activations and optimizer
        ranks = range(pp)
        chunks_of = [list(range(r, V, pp)) for r in ranks]
        local = [sum(stage_sum(per.params, v) for v in chunks_of[r]) for r in ranks]
        tensors = [sum(stage_sum(per.tensors, v) for v in chunks_of[r]) for r in ranks]
        dev = self.cluster.device
        isz = self.itemsize
        rank_mem, rank_tail, parts = [], [], []
        tails: dict[tuple[float, float], tuple] = {}    # ranks holding as many parameters pay alike
        for r in ranks:
            act = sum(flight[v] * stage_sum(per.act, v) for v in chunks_of[r])
            fixed = max(max(per.fixed[bounds[v]:bounds[v + 1]]) for v in chunks_of[r])
            # the runtime reduces a pipeline's gradients after the flush: nothing hides them
            if (local[r], tensors[r]) not in tails:
                tails[local[r], tensors[r]] = self._dp_tail(cfg, local[r], tensors[r], topo, 1, 0.0, 0.0, 1)
            dp_comm, opt, states = tails[local[r], tensors[r]]
            rank_mem.append(states["total"] + act + fixed)
            parts.append((states, act, fixed))
            rank_tail.append((dp_comm, opt))
        worst = max(ranks, key=lambda r: rank_mem[r])
        slow = max(ranks, key=lambda r: sum(rank_tail[r]))
        states, act, fixed = parts[worst]
        dp_comm, opt = rank_tail[slow]
        dp_comm += self._tied_time(sh, topo, bounds, cfg)
        step = tl.makespan + dp_comm + opt
        tp_comm = m * max(sum(stage_sum(per.comm, v) for v in chunks_of[r]) for r in ranks)
        compute = max(tl.busy) - tp_comm
        model_flops = 3.0 * self._flops_at(global_batch)
        peak = rank_mem[worst]
        pipeline = {
            "schedule": cfg.schedule, "chunks": cfg.chunks, "layers": split,
            "forward_s": [round(f, 9) for f in fwd], "backward_s": [round(b, 9) for b in bwd],
            "p2p_time_s": [round(x, 9) for x in p2p],
            "bubble_fraction": round(tl.bubble_fraction, 6), "makespan_s": round(tl.makespan, 9),
            "in_flight": tl.peak_in_flight, "rank_memory_bytes": [round(x) for x in rank_mem],
        }
        if not simulate_schedule:
            pipeline["simulated"] = False
            # what the simulated step cannot undercut (the search's test whether simulating
            # could still lower its best time; a margin for the extrapolated makespans)
            pipeline["step_bound_s"] = (makespan_lower_bound(pp, m, fwd, bwd, p2p) + dp_comm + opt) * (1 - 1e-6)
        return Estimate(
            strategy=cfg.to_string(), step_time_s=step, compute_time_s=compute,
            comm_time_s=tp_comm + dp_comm + sum(p2p) * 2 * m, tp_comm_time_s=tp_comm, dp_comm_time_s=dp_comm,
            optimizer_time_s=opt,
            tflops_per_device=model_flops / step / devices / 1e12 if step > 0 else 0.0,
            peak_memory_bytes=peak,
            memory={"weights": states["weights"], "gradients": states["gradients"],
                    "optimizer": states["optimizer"], "activations": act, "transient": fixed,
        },
            fits=peak <= cap and self._host_fits(states["offloaded"]), device_memory_bytes=float(dev.memory_bytes),
            devices=devices, global_batch=global_batch, precision=self.precision, optimizer=self.optimizer,
            parallel=cfg.as_dict(), pipeline=pipeline, host_memory_bytes=states["offloaded"],
        )

    def _tied_time(self, sh: AxisSharding, topo: MeshTopology, bounds: list[int], cfg: ParallelConfig) -> float:
        """The gradient all-reduce of weights read on several pipeline ranks
        (a tied embedding and head; the runtime sums their copies'
        gradients), over those ranks on the pipeline axis's link."""
        shared = self._shared_params
        if not shared:
            return 0.0
        stage_of_unit = [v for v in range(cfg.stages) for _ in range(bounds[v + 1] - bounds[v])]
        total = 0.0
        for name, numel, us in shared:
            ranks = {stage_of_unit[u] % cfg.pp for u in us}
            if len(ranks) > 1:
                if cfg.tp_mode in MESH_MODES:     # a mesh rank's part: split on every axis placing it so
                    local = numel / self._mesh_parts(sh)(name)
                elif cfg.is_grid:     # a grid rank's part: split on its columns, rows and depth
                    local = _grid_share(cfg, *self._grid_split(self.graph[name], sh, cfg))
                else:
                    local = numel / cfg.tp if is_shard(sh.out.get(name, R)) else numel
                total += cost_models.comm.collective_time(
                    "all_reduce", local * self.itemsize, len(ranks), topo.axis_link(0),
                    self.cluster.collectives.get("inter_node" if topo.spans_nodes(0) else "intra_node"))
        return total

    def _simulate(self, cfg: ParallelConfig, fwd: list[float], bwd: list[float], p2p: list[float]) -> Timeline:
        """The simulated timeline of ``cfg``'s schedule (cached: the search
        meets the same stage times again for other ZeRO and memory options).

        Past ``EXTRAPOLATE`` x pp microbatches a schedule is usually in its
        steady state, where every ``pp`` more microbatches add the same time.
        The makespan is then extrapolated from simulations at 8, 9 and 10 pp
        when the two increments agree (to 1e-9), and simulated in full when
        they do not; so a search over hundreds of pipelines with thousands of
        microbatches stays fast and exact."""
        key = (cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks, tuple(fwd), tuple(bwd), tuple(p2p))
        cache = self.cache.timelines
        if key in cache:
            return cache[key]
        pp, m, chunks = cfg.pp, cfg.microbatches, cfg.chunks

        def run(count: int) -> Timeline:
            return simulate_schedule(cfg.schedule, pp, count, chunks, fwd, bwd, p2p)

        tl = None
        if m > EXTRAPOLATE * pp:
            t1, t2, t3 = run(8 * pp), run(9 * pp), run(10 * pp)
            step = t3.makespan - t2.makespan
            if abs(step - (t2.makespan - t1.makespan)) <= 1e-9 * t3.makespan:
                tl = Timeline(pp=pp, chunks=chunks, makespan=t3.makespan + (m - 10 * pp) / pp * step,
                              busy=[b * m / (10 * pp) for b in t3.busy],
                              peak_in_flight=[m * chunks] * pp if cfg.schedule == "gpipe" else t3.peak_in_flight)
        tl = tl or run(m)
        cache[key] = tl
        return tl

    def unit_costs(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, global_batch: int) -> "UnitCosts":
        """Per pipeline unit (embedding, each layer instance, head) and one
        microbatch: forward and forward+backward time, tensor-parallel comm,
        local parameters, the activations kept per microbatch in flight, the
        memory needed once (transients; with full recompute the one layer
        being recomputed), and the bytes crossing each cut. What the stage
        balancing of :func:`autopar.pipeline.partition.balance` weighs.
        Raises :class:`StrategyError` for a graph without pipeline units."""
        if cfg.tp_mode in MESH_MODES:
            return self._mesh_unit_costs(cfg, sh, shapes, global_batch)
        if cfg.is_grid:
            return self._grid_unit_costs(cfg, sh, shapes, global_batch)
        if cfg.cp > 1:     # a cp rank's share of the tokens, as data parallelism over dp x cp
            cfg, shapes = self.token_view(cfg), self.token_shapes(shapes, cfg.cp)
        # the (dp, tp) sub-mesh of a stage: laid out as in the full mesh, pp outermost
        topo = self.topology((cfg.dp, cfg.tp))
        # the sums see dp only through the samples per rank and the tp axis's link
        local_batch = global_batch / (cfg.dp * cfg.microbatches)
        key = (cfg.tp, topo.spans_nodes(1), local_batch, cfg.recompute, id(sh))
        cache = self.cache.units
        if key in cache:
            return cache[key]
        self.cache.hold(sh)
        outside, per_inst = self._node_sums(cfg, sh, shapes, topo, local_batch)
        u = units(self.graph)
        n = u.layers + 2
        layers = {inst: k + 1 for k, inst in enumerate(u.labels[1:-1])}
        # every unit: its nodes outside any layer, plus the instances in it (its layer,
        # and instances of smaller repeated groups, e.g. inside the embedding)
        empty = _Sums()
        parts: list[list[_Sums]] = [[outside.get(k, empty)] for k in range(n)]
        source = self._sources(sh)
        for inst in self._instances():
            src = per_inst.get(source[inst])
            if src is not None:
                parts[layers.get(inst) or u.of_node[self._first_node(inst)]].append(src)
        layer_in = self._layer_input_bytes(sh, shapes, cfg.tp)
        passes = 3.0 + (1.0 if cfg.recompute == "full" else 0.0)
        out = UnitCosts(n)
        summed: dict[tuple, tuple] = {}    # units of the same sums (the copies of a layer) add up alike
        for k in range(n):
            ids = tuple(map(id, parts[k]))
            if ids not in summed:
                summed[ids] = _unit_sums(parts[k])
            fwd, comm, saved, transient, refwd, kept, extra = summed[ids]
            out.fwd[k] = fwd + comm / 2
            out.comm[k] = comm * (_comm_passes(cfg) if 0 < k < n - 1 else 1.0)
            out.time[k] = passes * fwd + refwd + out.comm[k]
            inst = u.labels[k] if 0 < k < n - 1 else None
            if cfg.recompute == "full" and inst is not None:
                out.act[k] = layer_in.get(inst, 0.0) + kept   # outside the recomputed layer: kept
                out.fixed[k] = 2 * transient + (saved - kept)
            elif cfg.recompute == "selective" and inst is not None:
                out.act[k] = layer_in.get(inst, 0.0) + saved
                out.fixed[k] = 2 * transient + extra
            else:
                out.act[k] = saved
                out.fixed[k] = 2 * transient
        params, tensors = self._unit_params(sh, cfg.tp)
        out.params, out.tensors = params, tensors
        out.cut = self._cut_bytes(sh, shapes, cfg.tp, n)
        cache[key] = out
        return out

    @cached_property
    def _param_unit_list(self) -> list[tuple[str, int, list[int]]]:
        """(parameter node, elements, units reading it) of every trainable parameter."""
        unit_of = units(self.graph).of_node
        out = []
        for name, nd in self.params.items():
            info = self.graph.params.get(nd.param)
            if info is None or info.is_buffer or not info.requires_grad:
                continue
            us = sorted({unit_of[c] for c in self.graph.consumers(name) if c in unit_of})
            out.append((name, info.numel, us))
        return out

    @cached_property
    def _shared_params(self) -> list[tuple[str, int, list[int]]]:
        """The trainable parameters read from several pipeline units (tied)."""
        return [(name, numel, us) for name, numel, us in self._param_unit_list if len(us) > 1]

    def _unit_params(self, sh: AxisSharding, tp: int) -> tuple[list[float], list[float]]:
        """Local trainable parameter elements and tensors per unit; a weight
        read from several units (tied) counts in each."""
        cache = self.cache.unit_params
        if (id(sh), tp) in cache:
            return cache[id(sh), tp]
        lists, kinds, layer_of = self._unit_param_lists
        labels = units(self.graph).labels
        n = len(lists)
        elems, tensors = [0.0] * n, [0.0] * n
        out, source = sh.out, self._sources(sh)
        for u, params in enumerate(lists):
            # a layer copying an earlier one's decisions holds its parameters alike
            src = layer_of[source[labels[u]]] if 0 < u < n - 1 else u
            if src != u and kinds[src] == kinds[u]:
                elems[u], tensors[u] = elems[src], tensors[src]
                continue
            for name, numel in params:
                elems[u] += numel / tp if is_shard(out.get(name, R)) else numel
                tensors[u] += 1
        cache[id(sh), tp] = (elems, tensors)
        return elems, tensors

    @cached_property
    def _unit_param_lists(self) -> tuple[list[list[tuple[str, int]]], list[int], dict[str, int]]:
        """Per pipeline unit, the trainable parameters it reads (node,
        elements; in graph order), a number two units share when their
        lists match position by position (their own layer's parameters at
        the same places in it, the same ones from outside, of the same
        sizes), and the unit of every layer instance. Raises
        :class:`StrategyError` for a graph without pipeline units."""
        u = units(self.graph)
        n = u.layers + 2
        lists: list[list[tuple[str, int]]] = [[] for _ in range(n)]
        for name, numel, us in self._param_unit_list:
            for k in us:
                lists[k].append((name, numel))
        position = {nd.name: k for inst, nodes in self._by_instance.items() if inst is not None
                    for k, nd in enumerate(nodes)}
        ids: dict[tuple, int] = {}
        kinds = []
        for k, params in enumerate(lists):
            inst = u.labels[k] if 0 < k < n - 1 else None
            key = tuple((position[name] if inst is not None and self.graph[name].group == inst else name, numel)
                        for name, numel in params)
            kinds.append(ids.setdefault((inst is None, key), len(ids)))
        return lists, kinds, {inst: k + 1 for k, inst in enumerate(u.labels[1:-1])}

    def _cut_bytes(self, sh: AxisSharding, shapes: dict, tp: int, n: int,
                   share: Callable[[str], int] | None = None) -> list[float]:
        """``cut[k]``: bytes per microbatch one rank sends from the units
        before ``k`` to those from ``k`` on (values produced on one side and
        read on the other; graph inputs, weights and shape arithmetic are
        available on every stage). ``share(value)``: the parts a rank's
        share is of the whole (default: ``tp`` where ``sh`` splits it)."""
        diff = [0.0] * (n + 1)
        for name, u, last, isz in self._crossing:
            parts = share(name) if share is not None else tp if is_shard(sh.out.get(name, R)) else 1
            local = _numel(shapes.get(name)) * isz / parts
            diff[u + 1] += local
            diff[last + 1] -= local
        cut, acc = [0.0] * (n + 1), 0.0
        for k in range(n + 1):
            acc += diff[k]
            cut[k] = acc
        return cut

    @cached_property
    def _crossing(self) -> list[tuple[str, int, int, float]]:
        """(value, unit producing it, last unit reading it, bytes per element)
        of every value read in a later pipeline unit than its own."""
        unit_of = units(self.graph).of_node
        out = []
        for nd in self.graph.nodes:
            u = unit_of.get(nd.name)
            if u is None or nd.kind in ("input", "shape") or nd.out is None:
                continue
            last = max((unit_of.get(c, u) for c in self.graph.consumers(nd.name)), default=u)
            if last > u:
                isz = self.itemsize if nd.out.is_float else nd.out.nbytes / max(nd.out.numel, 1)
                out.append((nd.name, u, last, isz))
        return out

    def _layer_input_bytes(self, sh: AxisSharding, shapes: dict, tp: int) -> dict[str, float]:
        """Bytes of the input of every repeated-layer instance (what full
        recompute keeps of it; kept per decisions, shapes and tp, with the
        shapes, so that their id stays theirs)."""
        key = (id(sh), id(shapes), tp)
        hit = self.cache.layer_inputs.get(key)
        if hit is None or hit[0] is not shapes:
            self.cache.hold(sh)
            out, isz = sh.out, self.itemsize
            hit = self.cache.layer_inputs[key] = (shapes, {
                inst: _numel(shapes.get(i)) * isz / (tp if is_shard(out.get(i, R)) else 1)
                for inst, i in self._layer_inputs_of})
        return hit[1]

    def _sources(self, sh: AxisSharding) -> dict[str, str]:
        """Per repeated-layer instance, the instance whose decisions (and
        costs) it copies, itself when none (kept per decisions)."""
        hit = self.cache.sources.get(id(sh))
        if hit is None:
            self.cache.hold(sh)
            copied = sh.copied_from
            hit = {}
            for inst in self._instances():    # in graph order: a copy's source is resolved first
                prev = copied.get(inst)
                hit[inst] = inst if prev is None else hit.get(prev) or _source(copied, prev)
            self.cache.sources[id(sh)] = hit
        return hit

    @cached_property
    def _layer_inputs_of(self) -> list[tuple[str, str]]:
        """(instance, its input): per repeated-layer instance, the first value
        its first node reading one reads from outside the instance."""
        out: dict[str, str] = {}
        for nd in self.graph.nodes:
            inst = nd.group
            if inst is None or inst in out:
                continue
            for i in nd.inputs:
                src = self.graph[i]
                if not src.is_state and src.group != inst:
                    out[inst] = i
                    break
        return list(out.items())

    def _nodes_to_cost(self, copied: dict[str, str]) -> list[Node]:
        """The nodes outside repeated layers and those of the instances not
        ``copied`` from another (grouped by instance: the sums do not depend on
        the order)."""
        out: list[Node] = []
        for inst, nodes in self._by_instance.items():
            if inst is None or inst not in copied:
                out.extend(nodes)
        return out

    @cached_property
    def _by_instance(self) -> dict[str | None, list[Node]]:
        """The nodes of every layer instance (None: outside the layers)."""
        out: dict[str | None, list[Node]] = {}
        for nd in self.graph.nodes:
            out.setdefault(nd.group, []).append(nd)
        return out

    @cached_property
    def _trainable(self) -> list[tuple[str, int]]:
        """(parameter node, elements) of every trainable parameter."""
        return [(name, info.numel) for name, nd in self.params.items()
                if (info := self.graph.params.get(nd.param)) is not None
                and not info.is_buffer and info.requires_grad]

    @cached_property
    def _trainable_total(self) -> tuple[int, int]:
        """Elements and tensors of the trainable parameters."""
        return sum(numel for _, numel in self._trainable), len(self._trainable)

    @cached_property
    def _instance_params(self) -> tuple[list[tuple[str, int]], dict[str, list[tuple[str, int]]], dict[str, tuple]]:
        """The trainable parameters (node, elements) outside the repeated
        layers, those of each layer instance, and each instance's sizes."""
        outside: list[tuple[str, int]] = []
        per_inst: dict[str, list[tuple[str, int]]] = {}
        for name, numel in self._trainable:
            inst = self.graph[name].group
            (outside if inst is None else per_inst.setdefault(inst, [])).append((name, numel))
        return outside, per_inst, {inst: tuple(x for _, x in ps) for inst, ps in per_inst.items()}

    def _local_params(self, sh: AxisSharding, tp: int) -> tuple[float, int]:
        """Trainable parameter elements per device on the tp axis, and tensors."""
        key = (id(sh), tp)
        hit = self.cache.local_params.get(key)
        if hit is not None:
            return hit
        out, source = sh.out, self._sources(sh)
        outside, per_inst, sizes = self._instance_params

        def sharded_in(params: list[tuple[str, int]]) -> int:
            return sum(numel for name, numel in params if is_shard(out.get(name, R)))

        # an instance copying another's decisions holds its parameters alike: counted once
        # (whole numbers of elements: the sum is exact in any order)
        sharded = sharded_in(outside)
        counted: dict[str, int] = {}
        for inst, params in per_inst.items():
            src = source.get(inst, inst)
            if src not in per_inst or sizes[src] != sizes[inst]:
                src = inst
            if src not in counted:
                counted[src] = sharded_in(per_inst[src])
            sharded += counted[src]
        total, n = self._trainable_total
        local = total - sharded + sharded / tp
        self.cache.local_params[key] = (local, n)
        return local, n

    def _outside_unit(self) -> dict[str, int]:
        """Pipeline unit of every node outside the repeated layers (all 0 for
        a graph without them, which cannot be pipelined)."""
        return self._outside_units

    @cached_property
    def _outside_units(self) -> dict[str, int]:
        try:
            return units(self.graph).of_node
        except StrategyError:
            return {}

    def _node_sums(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, topo: MeshTopology,
                   local_batch: float) -> tuple[dict[int, _Sums], dict[str, _Sums]]:
        """Per microbatch: the sums of the nodes outside the repeated layers
        per pipeline unit, and those of every instance not copied from
        another (an instance whose decisions were copied costs what its
        source costs). Kept per decisions, shapes, tp link, samples and
        recompute mode (nothing else of it counts here): the flat and the
        pipelined estimates of the recompute choices ask alike. Inside a
        checkpointed layer (full or selective recompute) a sequence-parallel
        entry is not gathered again in backward (the checkpoint keeps
        nothing of it; its forward gather runs again with the layer, charged
        with the replay), so its regather is not charged there. Selective
        recompute replays the layer up to its last node that saves a tensor
        (:meth:`_replay_tail`): the ops whose outputs it does not keep run
        again there, and the forward collectives (half a node's comm) too."""
        tp, selective, ckpt = cfg.tp, cfg.recompute == "selective", cfg.recompute != "none"
        key = (tp, topo.spans_nodes(1), local_batch, id(sh), id(shapes), cfg.recompute)
        hit = self.cache.node_sums.get(key)
        if hit is not None and hit[0] is shapes:
            return hit[1]
        outside: dict[int, _Sums] = {}
        per_inst: dict[str, _Sums] = {}
        keeps = self._keeps(sh) if selective else frozenset()
        tail = self._replay_tail
        for nd, st, inst, unit, t, comm, transient, regather in self._node_times(tp, sh, shapes, topo, local_batch):
            acc = outside.setdefault(unit, _Sums()) if inst is None else per_inst.setdefault(inst, _Sums())
            acc.fwd += t
            replayed = inst is not None and selective and nd.name not in tail
            if replayed and nd.name not in keeps:
                acc.refwd += t
            if tp > 1:
                c = comm - (regather if ckpt and inst is not None else 0.0)
                acc.comm += 1.5 * c if replayed else c
            for name, local in self._saved(nd, st, sh, shapes, tp, cfg.recompute):
                acc.saved[name] = local
            if selective:   # what the layer holds again while it is recomputed
                for name, local in self._saved(nd, st, sh, shapes, tp, "none"):
                    acc.full[name] = local
            if transient is not None:
                acc.transient = max(acc.transient, transient)
            acc.ops += checkpoint_dispatches(nd.kind, nd.target)
        if selective:
            for acc in per_inst.values():
                acc.refwd += self._checkpoint_dispatch(acc)
        out = self.graph.output
        if tp > 1 and out:
            t_out = output_time(sh.out.get(out, R), _numel(shapes.get(out)) * 4, self._tp_collective(tp, topo))
            if t_out:   # the loss made whole on every rank
                outside.setdefault(self._outside_unit().get(out, 0), _Sums()).comm += t_out
        self.cache.hold(sh)
        self.cache.node_sums[key] = (shapes, (outside, per_inst))
        return outside, per_inst

    def _checkpoint_dispatch(self, layer: _Sums) -> float:
        """Host time selective recompute's dispatch mode adds to one layer
        instance per microbatch: ``device.checkpoint_dispatch_s`` per op, in
        the forward and again in the recompute (the ops
        :func:`~autopar.graph.checkpoint_dispatches`). It adds to the
        kernels' time rather than hiding behind it, on a GPU too: on an
        H200 a 350M GPT (26 ops per layer, 0.7 ms of kernels per layer forward) ran 73 ms
        slower per step with selective recompute than without, about the
        dispatch mode's whole host time (24 layers x 2 passes x 26 ops x
        43 us = 54 ms) and far more than what exceeds the kernels
        (``benchmarks/results/fidelity_gpu-gpu-nvidia-h200.json``)."""
        return 2 * layer.ops * self.cluster.device.checkpoint_dispatch_s

    def _node_times(self, tp: int, sh: AxisSharding, shapes: dict, topo: MeshTopology,
                    local_batch: float) -> list[tuple]:
        """``(node, strategy, instance, unit, forward time, tp comm, transient
        bytes or None, regather)`` of every node :meth:`_node_sums` adds up, in
        its order: what does not depend on recompute, kept per decisions,
        shapes, tp link and samples (the recompute choices share it).
        ``regather``: the part of the comm that gathers a sequence-parallel
        entry again in backward (:mod:`autopar.runtime.regather`)."""
        key = (tp, topo.spans_nodes(1), local_batch, id(sh), id(shapes))
        hit = self.cache.node_times.get(key)
        if hit is not None and hit[0] is shapes:
            return hit[1]
        isz, comm_tp = self.itemsize, self._tp_collective(tp, topo)

        def compute(nd: Node, frac: float) -> float:
            return self.node_time(nd, self.scale(nd, local_batch), frac)

        def nbytes(name: str) -> float:
            return _numel(shapes.get(name)) * 4

        dispatch = self.cluster.device.dispatch_overhead_s
        unit_of = self._outside_unit()
        out = []
        charged: set = set()
        for nd in self._nodes_to_cost(sh.copied_from):
            st = sh.strategy.get(nd.name)
            if st is None:
                continue
            # the op's time on the tensor-parallel axis, exactly as the searches charge it (an input
            # without a placement, shape arithmetic, arrives as read). A transition the readers of a
            # layer instance share (q, k and v reading one LayerNorm output) is charged to the first,
            # as the compiler inserts it once and the ILP and the greedy search price it
            ins = [sh.out.get(i, w) for i, w in zip(nd.inputs, st.ins)]
            fresh = [shared_key(nd, i, w, st.split, self.grad) not in charged for i, w in zip(nd.inputs, st.ins)]
            at = op_axis_time(nd, st, ins, tp, nbytes=nbytes, grad=self.grad, compute=compute, comm=comm_tp,
                              charged=charged)
            t = at.fwd + (dispatch if nd.kind not in NO_DISPATCH else 0.0)
            # the largest temporary: the op's output, or an input it reads gathered whole (the
            # logits all-gathered for a cross-entropy over the full vocabulary, a sequence-parallel
            # entry), a copy the op's backward also makes a gradient of
            transient = _numel(shapes.get(nd.name)) * isz / (tp if is_shard(sh.out.get(nd.name, R)) else 1) \
                if nd.out is not None else None
            if transient is not None:
                transient = max([transient] + [_numel(shapes.get(i)) * isz for i, have, want
                                               in zip(nd.inputs, ins, st.ins) if want == R and is_shard(have)])
            regather = sum(comm_tp("all_gather", nbytes(i)) for i, have, want, new in zip(nd.inputs, ins, st.ins, fresh)
                           if new and _regathered(have, want, self.grad.get(i, False), st.split))
            out.append((nd, st, nd.group, unit_of.get(nd.name, 0), t, at.comm, transient, regather))
        self.cache.hold(sh)
        self.cache.node_times[key] = (shapes, out)
        return out

    def _tp_collective(self, tp: int, topo: MeshTopology) -> Callable[[str, float], float]:
        """``comm(kind, nbytes)``: a collective's time on the tensor-parallel
        axis of ``topo`` (bytes at 4 per element), memoised per itemsize, tp
        size and link: the sums ask for the same few many times."""
        isz = self.itemsize
        comms = self.cache.tp_comm.setdefault((isz, tp, topo.spans_nodes(1)), {})

        def comm_tp(kind: str, nbytes: float) -> float:
            t = comms.get((kind, nbytes))
            if t is None:
                t = comms[kind, nbytes] = topo.collective_time(kind, nbytes * isz / 4, 1)
            return t

        return comm_tp

    def _first_node(self, inst: str) -> str:
        """The first non-parameter node of a layer instance."""
        return self._instance_first[inst]

    @cached_property
    def _instance_first(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for nd in self.graph.nodes:
            if nd.group is not None and not nd.is_state:
                out.setdefault(nd.group, nd.name)
        return out

    def _instances(self) -> list[str]:
        """The repeated-layer instances in graph order."""
        return self._instance_order

    @cached_property
    def _instance_order(self) -> list[str]:
        return list(dict.fromkeys(nd.group for nd in self.graph.nodes if nd.group is not None))

    def _microbatch_sums(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, topo: MeshTopology,
                         local_batch: float) -> tuple:
        """Forward time, tensor-parallel comm, largest transient and saved
        activations (outside the layers; per layer instance), and the
        tensor-parallel comm of the layers alone, of one microbatch."""
        outside, per_inst = self._node_sums(cfg, sh, shapes, topo, local_batch)
        source = self._sources(sh)
        fwd = sum(s_.fwd for s_ in outside.values())
        tp_comm = sum(s_.comm for s_ in outside.values())
        transient = max((s_.transient for s_ in outside.values()), default=0.0)
        inst_saved: dict[str, float] = {}
        inst_full: dict[str, float] = {}
        refwd = layer_comm = 0.0
        for inst in self._instances():
            s_ = per_inst.get(source[inst])
            if s_ is None:
                continue
            fwd += s_.fwd
            refwd += s_.refwd
            tp_comm += s_.comm
            layer_comm += s_.comm
            transient = max(transient, s_.transient)
            inst_saved[inst] = sum(s_.saved.values())
            inst_full[inst] = sum(s_.full.values())
        saved_outside = sum(sum(s_.saved.values()) for s_ in outside.values())
        return fwd, tp_comm, transient, saved_outside, inst_saved, inst_full, refwd, layer_comm

    @cached_property
    def _replay_tail(self) -> frozenset[str]:
        """The layer nodes a recompute does not run again: those after the
        last node of their instance whose backward saves a tensor, and that
        node itself when it saves only its inputs. Non-reentrant
        ``torch.utils.checkpoint`` stops the replay once every saved tensor
        is back, and autograd saves an op's inputs before its kernel runs
        (a GPT layer's last MLP linear, its bias and residual adds)."""
        out: list[str] = []
        for nodes in instances(self.graph).values():
            ops_ = [nd for nd in nodes if not nd.is_state and nd.out is not None]
            last = max((k for k, nd in enumerate(ops_) if self._saves(nd)), default=-1)
            out += [nd.name for nd in ops_[last + 1:]]
            if last >= 0 and ops_[last].name not in self._reads[ops_[last].name]:
                out.append(ops_[last].name)
        return frozenset(out)

    def _saves(self, nd: Node) -> bool:
        """Whether autograd saves a tensor for ``nd``'s backward (a weight counts)."""
        return bool(self._reads[nd.name]) or (
            ops.family(nd.kind) == "matmul" or nd.kind == "elementwise" and ops.is_nonlinear(nd.target)) and \
            any(self.graph[i].is_state for i in nd.inputs)

    def _keeps(self, sh: AxisSharding | None) -> frozenset[str]:
        """The layer nodes whose outputs selective recompute keeps under the
        decisions ``sh`` (:func:`autopar.sharding.selective_keeps`, as the
        runtime's checkpoint policy saves them), kept per decisions."""
        if sh is None or sh.n == 1:
            return selective_keeps(self.graph)
        hit = self._keeps_memo.get(id(sh))
        if hit is None or hit[0] is not sh:
            hit = self._keeps_memo[id(sh)] = (sh, selective_keeps(self.graph, sh))
        return hit[1]

    def _saved_names(self, nd: Node, recompute: str, keeps: frozenset[str] = frozenset()) -> list[str]:
        """The float values ``nd`` keeps for its backward. Inside a layer
        under selective recompute, its output if it is one of ``keeps``
        (:meth:`_keeps`), else nothing: the rest of what the layer's
        backwards read (norms, activations, the attention core of explicit
        matmul-softmax attention, a row-parallel linear's partial output)
        runs again in backward from those and the layer input."""
        if recompute == "selective" and nd.group is not None:
            return [nd.name] if nd.name in keeps else []
        return self._reads[nd.name]

    def _saved(self, nd: Node, st, sh: AxisSharding, shapes: dict, tp: int, recompute: str):
        """(value, local bytes) pairs this node keeps for its backward."""
        out = []
        wants = dict(zip(nd.inputs, st.ins)) if st is not None else {}
        for i in self._saved_names(nd, recompute, self._keeps(sh) if recompute == "selective" else frozenset()):
            have = sh.out.get(i, R)
            # an input resharded for this op (e.g. all-gathered before a column-parallel
            # linear) is saved in the placement the op reads, as a tensor of its own
            want = wants.get(i, have) if tp > 1 else have
            if st is not None and st.split and want == R and is_shard(have) and self.grad.get(i, False):
                want = have     # the sequence-parallel entry: the shard is kept, gathered again in backward
            local = _numel(shapes.get(i)) * self.itemsize / (tp if is_shard(want) else 1)
            if want != have:
                i = f"{i}@{want}"
            elif i in self._aliases and is_shard(sh.out.get(self._aliases[i], R)) == is_shard(have):
                i = self._aliases[i]      # the attention's own output, split alike: one tensor
            out.append((i, local))
        return out

    def _layer_inputs(self, sh: AxisSharding, shapes: dict, tp: int) -> float:
        """Bytes of the inputs of every repeated-layer instance (what full
        recompute keeps)."""
        return sum(self._layer_input_bytes(sh, shapes, tp).values())


def _grid_share(cfg: ParallelConfig, cube: float, split: float, whole: float) -> float:
    """The elements a grid rank holds of a column's ``(cube, split, whole)``
    (:meth:`CostModel._grid_params`): the rows split ``split``, the rows and
    a 3d cube's depth split ``cube``, ``whole`` stays whole."""
    grid = cfg.tp_grid
    rows, depth = grid[-2], (grid[0] if cfg.tp_mode == "3d" else 1)
    return whole + split / rows + cube / (rows * depth)


@dataclass
class _MeshSums:
    """One bucket of :meth:`CostModel._mesh_buckets` (per microbatch)."""

    fwd: float = 0.0           # forward time
    comm: float = 0.0          # the collectives charged, forward and backward (selective: replays too)
    layer_comm: float = 0.0    # the part of it inside the repeated layers (what full recompute replays)
    refwd: float = 0.0         # the forward selective recompute runs again (with its dispatch)
    outside: float = 0.0       # bytes kept by the ops outside any layer
    transient: float = 0.0     # the largest output
    saved: dict[str, float] = field(default_factory=dict)   # per layer instance, bytes kept
    full: dict[str, float] = field(default_factory=dict)    # per instance, kept without recompute
    ops: dict[str, int] = field(default_factory=dict)       # per instance, checkpointed dispatches


def _tp_pieces(tp: int) -> Callable[[str], int]:
    """How many parts a ``tp`` axis cuts a tensor of a placement in, one per rank."""
    return lambda p: tp if is_shard(p) else 1


def _fsdp_peak(elems: Sequence[float]) -> float:
    """ZeRO-3's unsharded elements at the peak, from the per-unit ``elems``
    (embedding, layers, head): the root's and two layers' (the one running,
    the one prefetched)."""
    layers = elems[1:-1]
    return elems[0] + elems[-1] + 2 * (max(layers) if layers else 0.0)


@functools.lru_cache(maxsize=4096)
def _grid_split_of(shape: tuple, col: str, rows: int, cols: int, depth: int) -> tuple[float, float, float]:
    """:meth:`CostModel._grid_split` of a parameter of ``shape`` placed
    ``col`` on the columns (a pure function of them: the layers' weights
    share a few shapes, so the search asks for the same ones again)."""
    elems = _numel(shape) / (cols if is_shard(col) else 1)
    row = row_placement(shape, col, cols, rows)
    if row == R:
        return 0.0, 0.0, elems
    if depth > 1 and depth_placement(shape, col, cols, row, rows, depth) != R:
        return elems, 0.0, 0.0
    return 0.0, elems, 0.0


def _regathered(have: str, want: str, grad: bool, into_split: bool) -> bool:
    """Whether the transition is the sequence-parallel entry whose readers
    keep the shard and gather it again in backward."""
    return have != want and feasible(have, want) and any(s.kind == "all_gather_reduce_grad"
                                for s in transition_steps(have, want, grad, into_split))


def _comm_passes(cfg: ParallelConfig) -> float:
    """Tensor-parallel communication per microbatch, in units of forward +
    backward: full recompute runs each layer's forward again in backward,
    collectives included (``torch.utils.checkpoint`` replays the region as
    traced), and a forward's transitions are half of the pair (an
    all-gather's backward is a reduce-scatter, Megatron's f and g swap)."""
    return 1.5 if cfg.recompute == "full" else 1.0


def _source(copied: dict[str, str], inst: str) -> str:
    """The instance whose decisions (and costs) ``inst`` copies."""
    while inst in copied:
        inst = copied[inst]
    return inst


def _unit_sums(parts: list[_Sums]) -> tuple[float, float, float, float, float, float, float]:
    """What :meth:`CostModel.unit_costs` reads of one unit's sums (its nodes
    outside any layer first): forward time, tp comm, saved bytes, the largest
    transient, the forward run again, the saved bytes outside the layer, and
    what selective recompute holds again."""
    return (sum(p_.fwd for p_ in parts), sum(p_.comm for p_ in parts),
            sum(sum(p_.saved.values()) for p_ in parts), max(p_.transient for p_ in parts),
            sum(p_.refwd for p_ in parts), sum(parts[0].saved.values()),
            sum(sum(p_.full.values()) - sum(p_.saved.values()) for p_ in parts[1:]))


class UnitCosts:
    """Per pipeline unit costs of one microbatch (see :meth:`CostModel.unit_costs`)."""

    def __init__(self, n: int) -> None:
        self.fwd = [0.0] * n       # forward time (with half the tp comm)
        self.time = [0.0] * n      # forward + backward (+ recompute) time with all tp comm
        self.comm = [0.0] * n      # tensor-parallel comm, forward + backward (+ the recomputed forward)
        self.act = [0.0] * n       # bytes kept per microbatch in flight
        self.fixed = [0.0] * n     # bytes needed once (transients, the recomputed layer)
        self.params = [0.0] * n    # local trainable elements
        self.tensors = [0.0] * n   # trainable tensors
        self.cut = [0.0] * (n + 1)  # bytes crossing the cut before unit k
        self._floor: LayerFloor | None = None
        self._ranks: dict[int, tuple[float, float]] = {}

    def layer_floor(self) -> "LayerFloor":
        """The least time, parameters, activations and transient of any layer
        unit, and the totals over every unit (computed once: the bounds of
        the pipeline search ask for them per configuration)."""
        if self._floor is None:
            layers = range(1, len(self.time) - 1)
            self._floor = LayerFloor(len(layers), min(self.time[u] for u in layers),
                                     min(self.params[u] for u in layers), min(self.act[u] for u in layers),
                                     min(self.fixed[u] for u in layers), sum(self.time), sum(self.params))
        return self._floor

    def rank_floor(self, pp: int) -> tuple[float, float]:
        """Lower bounds on the busiest of ``pp`` pipeline ranks' time per
        microbatch and on the largest rank's parameters, over whole layers
        (:func:`~autopar.pipeline.partition.least_busiest`; per ``pp``,
        computed once)."""
        hit = self._ranks.get(pp)
        if hit is None:
            f, last = self.layer_floor(), len(self.time) - 1
            hit = self._ranks[pp] = (
                pipe.least_busiest(f.layers, pp, f.time, self.time[0], self.time[last]),
                pipe.least_busiest(f.layers, pp, f.params, self.params[0], self.params[last]))
        return hit


@dataclass(frozen=True)
class LayerFloor:
    """See :meth:`UnitCosts.layer_floor`."""

    layers: int
    time: float
    params: float
    act: float
    fixed: float
    total_time: float
    total_params: float


def fill_drain_bound(pp: int, chunks: int, microbatches: int, total: float, first: float, layer: float) -> float:
    """A lower bound on the makespan of any schedule of ``microbatches`` on
    ``pp`` ranks (``chunks`` virtual stages each) under *any* partition of
    the units, from ``total`` (a microbatch's forward and backward through
    every unit), ``first`` (the first unit's) and ``layer`` (the least
    layer's).

    Rank ``r`` computes ``b_r`` in all, and the makespan is at least
    ``e_r + b_r``, ``e_r`` a microbatch's forward and backward through the
    stages before it (:func:`autopar.pipeline.schedule.makespan_lower_bound`).
    Without interleaving ``e_r = x_0 + .. + x_{r-1}`` and ``b_r = m x_r``
    with ``x_r`` rank ``r``'s share of ``total``: the least maximum has every
    ``e_r + b_r`` equal, so ``x_r = (B / m)(1 - 1/m)^r`` and
    ``B = total / (1 - (1 - 1/m)^pp)`` (``m + (pp - 1) / 2`` stage times for
    ``m >> pp``: half the bubble of equal stages). Interleaved, the stages
    before ``r`` are the first unit and ``r - 1`` stages of a layer at
    least, and the maximum is at least the mean of ``e_r + b_r``."""
    m = microbatches
    if chunks == 1:
        return total / (1.0 - (1.0 - 1.0 / m) ** pp) if m > 1 else total
    ramps = [0.0] + [first + (r - 1) * layer for r in range(1, pp)]
    return max(max(ramps), (m * total + sum(ramps)) / pp)


class _Sums:
    __slots__ = ("fwd", "refwd", "comm", "saved", "full", "transient", "ops")

    def __init__(self) -> None:
        self.ops = 0                         # ops through selective recompute's dispatch mode
        self.fwd = 0.0
        self.refwd = 0.0                     # selective recompute: forward time run again
        self.comm = 0.0
        self.saved: dict[str, float] = {}
        self.full: dict[str, float] = {}     # selective recompute: what no recompute would save
        self.transient = 0.0

