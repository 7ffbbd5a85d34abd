"""Predict step time and memory of one strategy on a traced graph.

The model, per optimizer step with ``m`` microbatches on a ``(dp, tp)`` mesh:

* compute: every node's roofline time (``cost_models.op_time``) for its
  local share of the work, forward + backward (2x forward), times ``m``; with
  ``recompute=full`` one more forward.
* tensor-parallel communication: the reshards between neighbours that
  disagree, the backward all-reduce of replicated values feeding split work,
  and collectives inside ops (vocabulary-parallel cross-entropy), times ``m``.
* data-parallel communication: one all-reduce of the local gradients over
  ``dp`` (ZeRO-3 adds the weight all-gathers of forward and backward). It is
  not overlapped with compute in this model (DDP overlaps part of it, so the
  prediction is pessimistic there).
* optimizer: a memory-bound pass over the local optimizer state.

Memory per device: weights, gradients and optimizer state of the local
shards (ZeRO divides them over ``dp``), the activations saved for backward
for one microbatch, and the largest transient (e.g. the logits); ``fits``
compares the peak against 90% of the device memory (allocator slack).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import cost_models
from cost_models import ClusterSpec, MeshTopology, model_state_bytes, op_time, zero_sharded_state_bytes

from .errors import StrategyError
from .graph import NO_DISPATCH, Graph, Node
from .search.ilp import InfeasiblePins, MemoryTerms, solve_axis
from .search.propagate import AxisSharding, _numel, needs_grad, propagate, reshard_time, scaled_shapes, track_batch
from .search.space import ParallelConfig, divisors
from .strategies import is_shard
from .strategies.placement import P, R
from .trace import op_family

MEMORY_HEADROOM = 0.9
MANUAL_MEMORY_WEIGHT = 1e-6   # s per byte of replicated weight: manual tp shards every weight it can
GREEDY_MEMORY_WEIGHT = 1e-15  # the greedy heuristic weighs time; memory only breaks ties


@dataclass(frozen=True)
class Sharder:
    """How the tensor-parallel axis is decided.

    ``mode``: ``"manual"`` (greedy propagation that shards every weight a rule
    can split, Megatron-style: the ``tp=N`` strategies), ``"ilp"`` (the
    optimal per-op choice of :mod:`autopar.search.ilp`) or ``"greedy"``
    (propagation weighing time only: the fast heuristic for huge graphs).
    ``pins``: ``(node, placement)`` pairs fixed by the user. ``memory_limit``:
    bytes per device the ILP must respect (model states + saved activations).
    """

    mode: str = "manual"
    pins: tuple[tuple[str, str], ...] = ()
    memory_limit: float | None = None

    @property
    def label(self) -> str:
        """``ilp``, ``ilp+memory``, ``greedy`` or ``manual`` (the plan's ``search.tp_axis``)."""
        return self.mode + ("+memory" if self.memory_limit is not None else "")


MANUAL = Sharder()

_NONLINEAR = {"gelu", "relu", "silu", "sigmoid", "tanh", "mul", "truediv", "div", "pow", "exp", "log",
              "rsqrt", "sqrt", "softplus", "erf", "mish", "elu", "leaky_relu", "square", "reciprocal"}
_MATMUL_KINDS = {"linear", "matmul", "sdpa", "conv"}


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

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in d.items()}


def compute_dtype(precision: str) -> str:
    return "bfloat16" if precision == "mixed" else "float32"


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
        if last is not None and last.kind == "cross_entropy" and last.inputs:
            last = graph[last.inputs[0]]   # a traced loss: the model's output is its logits
        final = last.out.shape[-1] if last is not None and last.out is not None and last.out.shape else None
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
    sizes = getattr(graph, "_tp_sizes", None)
    if sizes is None:
        sizes = tp_valid_sizes(graph)
        graph._tp_sizes = sizes
    return sizes


def check_config(graph: Graph, cfg: ParallelConfig, devices: int, global_batch: int) -> None:
    """Raise :class:`StrategyError` if ``cfg`` cannot run this model on ``devices``."""
    if cfg.devices != devices:
        raise StrategyError(f"dp={cfg.dp} x tp={cfg.tp} x pp={cfg.pp} = {cfg.devices} devices, "
                            f"but {devices} were given")
    valid = _tp_sizes_cached(graph)
    if cfg.tp not in valid:
        what = "attention heads" if any(n.kind == "sdpa" for n in graph.nodes) else "layer widths"
        raise StrategyError(f"tensor parallel size {cfg.tp} does not divide the model's {what}; "
                            f"valid sizes: {', '.join(map(str, valid))}")
    if global_batch < 1 or global_batch % (cfg.dp * cfg.microbatches):
        raise StrategyError(f"global batch {global_batch} is not divisible by dp={cfg.dp} x "
                            f"microbatches={cfg.microbatches} = {cfg.dp * cfg.microbatches}")


class Evaluator:
    """Evaluates strategies of one graph on one cluster; caches the
    tensor-parallel propagation per (tp, dp, microbatch size)."""

    def __init__(self, graph: Graph, cluster: ClusterSpec | str, *, optimizer: str = "adamw",
                 precision: str | None = None) -> None:
        self.graph = graph
        self.cluster = cost_models.load_cluster(cluster) if not isinstance(cluster, ClusterSpec) else cluster
        self.optimizer = optimizer
        self.precision = precision or self.cluster.default_precision
        if self.precision not in ("fp32", "mixed"):
            raise StrategyError(f"precision {self.precision!r} is invalid; valid: 'fp32', 'mixed'")
        self.dtype = compute_dtype(self.precision)
        self.itemsize = 2 if self.precision == "mixed" else 4
        self.batch = track_batch(graph)
        self.grad = needs_grad(graph)
        self._tp_cache: dict[tuple, AxisSharding] = {}
        self._shapes_cache: dict[tuple, dict] = {}
        self._sums_cache: dict[tuple, tuple] = {}
        self._params_cache: dict[tuple, tuple[float, int]] = {}
        self.params = {nd.name: nd for nd in graph.nodes if nd.kind in ("param", "buffer")}

    # -- pieces ---------------------------------------------------------------
    def _flops_at(self, global_batch: int) -> float:
        """Forward FLOPs of the whole model at ``global_batch``."""
        if not hasattr(self, "_flops_split"):
            per_sample = sum(nd.flops for nd in self.graph.nodes if self.batch.out.get(nd.name, R) != R)
            fixed = sum(nd.flops for nd in self.graph.nodes if self.batch.out.get(nd.name, R) == R)
            self._flops_split = (per_sample / self.graph.batch_size, fixed)
        a, b = self._flops_split
        return a * global_batch + b

    def _scale(self, nd: Node, local_batch: float) -> float:
        return local_batch / self.graph.batch_size if self.batch.out.get(nd.name, R) != R else 1.0

    def _node_time(self, nd: Node, scale: float, frac: float) -> float:
        if nd.flops == 0 and nd.act_bytes == 0:
            return 0.0
        nbytes = (nd.act_bytes * scale * self.itemsize / 4 + nd.param_bytes * self.itemsize / 4) * frac
        return op_time(self.cluster.device, nd.flops * scale * frac, nbytes, self.dtype, op_family(nd.kind))

    def sharding(self, cfg: ParallelConfig, global_batch: int, sharder: Sharder = MANUAL
                 ) -> tuple[AxisSharding, dict]:
        """The tensor-parallel axis decisions and the local shapes for ``cfg``.

        Raises :class:`~autopar.search.ilp.InfeasiblePins` for contradictory
        pins and :class:`StrategyError` when an ILP memory bound cannot be met."""
        mb_global = global_batch // cfg.microbatches
        if sharder.mode == "ilp":
            # the ILP also weighs what a weight costs per step (its gradient reduction and
            # optimizer update, spread over the microbatches) and, bounded, the memory
            ilp_key = (global_batch, min(cfg.zero, 1) if cfg.zero < 3 else 3,
                       (cfg.recompute, cfg.zero) if sharder.memory_limit is not None else None)
        else:
            ilp_key = None
        key = (cfg.tp, cfg.dp, mb_global, sharder, ilp_key)
        skey = (mb_global, cfg.dp)
        if skey not in self._shapes_cache:
            self._shapes_cache[skey] = scaled_shapes(self.graph, mb_global, cfg.dp)
        shapes = self._shapes_cache[skey]
        if key not in self._tp_cache:
            shard_pins = [n for n, p in sharder.pins if is_shard(p)]
            if cfg.tp == 1 and shard_pins:
                raise InfeasiblePins(f"a Shard pin ({shard_pins[0]}) needs a tensor-parallel axis (tp > 1)",
                                     (shard_pins[0],))
            if cfg.tp == 1 and sharder.mode != "manual" and not sharder.pins:
                # one device on the axis: every choice is the same
                self._tp_cache[key] = self.sharding(cfg, global_batch)[0]
                return self._tp_cache[key], shapes
            topo = MeshTopology(self.cluster, (cfg.dp, cfg.tp))
            local_batch = mb_global / cfg.dp

            def comm(kind: str, nbytes: float) -> float:
                return topo.collective_time(kind, nbytes * self.itemsize / 4, 1)

            def compute(nd: Node, frac: float) -> float:
                return self._node_time(nd, self._scale(nd, local_batch), frac)

            pins = dict(sharder.pins)
            if sharder.mode == "ilp":
                memory = self._memory_terms(cfg, shapes, sharder.memory_limit) \
                    if sharder.memory_limit is not None else None
                self._tp_cache[key] = solve_axis(self.graph, cfg.tp, shapes, comm=comm, compute=compute,
                                                 param_time=self._param_time(cfg, topo), pins=pins,
                                                 memory=memory)
            else:
                weight = GREEDY_MEMORY_WEIGHT if sharder.mode == "greedy" else MANUAL_MEMORY_WEIGHT
                res = propagate(self.graph, cfg.tp, shapes, comm=comm, compute=compute,
                                itemsize=4, memory_weight=weight, pins=pins)
                for name, p in pins.items():
                    if res.out.get(name, R) != p:
                        raise InfeasiblePins(f"pinned placement {p} of {name} cannot be kept on a tensor-parallel "
                                             f"axis of size {cfg.tp}: no strategy of the ops around it allows it "
                                             f"(the propagation gave {res.out.get(name, R)})", (name,))
                self._tp_cache[key] = res
        return self._tp_cache[key], shapes

    def _param_time(self, cfg: ParallelConfig, topo: MeshTopology):
        """Seconds per microbatch a weight costs in a placement, as
        :meth:`evaluate` counts them per step: its share of the data-parallel
        gradient all-reduce, of the optimizer pass and, with ZeRO-3, of the
        weight all-gathers (the per-message latencies do not depend on the
        placement and are left out)."""
        big = float(1 << 30)
        m, tp, dp, isz = cfg.microbatches, cfg.tp, cfg.dp, self.itemsize
        per_elem = 0.0
        if dp > 1:
            slope = (topo.collective_time("all_reduce", big, 0) - topo.collective_time("all_reduce", 0.0, 0)) / big
            per_elem += slope * isz / m
            if cfg.zero >= 3:
                ag = (topo.collective_time("all_gather", big, 0) - topo.collective_time("all_gather", 0.0, 0)) / big
                per_elem += 2 * ag * isz
        opt_bytes = zero_sharded_state_bytes(model_state_bytes(1 << 30, self.optimizer, self.precision),
                                             dp, cfg.zero)["optimizer"] / big
        dev = self.cluster.device
        per_elem += opt_bytes * 2 / (dev.memory_bandwidth * dev.memory_efficiency) / m

        def param_time(nd: Node, p: str) -> float:
            info = self.graph.params.get(nd.param) if nd.param else None
            if info is None or info.is_buffer or not info.requires_grad:
                return 0.0
            return info.numel * per_elem / (tp if is_shard(p) else 1)

        return param_time

    def _memory_terms(self, cfg: ParallelConfig, shapes: dict, limit: float) -> MemoryTerms:
        """The ILP's linear memory model for ``cfg``: model states per local
        parameter element (ZeRO-divided) and the activations each strategy
        saves, as :meth:`evaluate` counts them (shared inputs counted once per
        reader: an upper bound)."""
        big = 1 << 30
        per_elem = zero_sharded_state_bytes(model_state_bytes(big, self.optimizer, self.precision),
                                            cfg.dp, cfg.zero)["total"] / big
        tp = cfg.tp

        def param(nd: Node, p: str) -> float:
            info = self.graph.params.get(nd.param) if nd.param else None
            if info is None or info.is_buffer or not info.requires_grad:
                return 0.0
            return info.numel * per_elem / (tp if is_shard(p) else 1)

        def saved(nd: Node, st) -> float:
            wants = dict(zip(nd.inputs, st.ins))
            total = 0.0
            for i in self._saved_names(nd, cfg.recompute):
                total += _numel(shapes.get(i)) * self.itemsize / (tp if is_shard(wants.get(i, st.out)) else 1)
            return total

        if cfg.recompute == "full":
            return MemoryTerms(param=param, saved=saved, limit=limit, group_factor=lambda k: 1.0)
        return MemoryTerms(param=param, saved=saved, limit=limit)

    # -- the estimate ---------------------------------------------------------
    def evaluate(self, cfg: ParallelConfig, global_batch: int, devices: int | None = None,
                 sharder: Sharder = MANUAL) -> Estimate:
        """Predict ``cfg`` with the tensor-parallel axis decided by ``sharder``."""
        g = self.graph
        devices = devices or cfg.devices
        check_config(g, cfg, devices, global_batch)
        self.cluster.check_devices(devices)
        tp, dp, m = cfg.tp, cfg.dp, cfg.microbatches
        topo = MeshTopology(self.cluster, (dp, tp))
        sh, shapes = self.sharding(cfg, global_batch, sharder)
        local_batch = global_batch / (dp * m)
        isz = self.itemsize
        skey = (tp, dp, global_batch // m, cfg.recompute == "selective", id(sh))
        if skey not in self._sums_cache:
            self._sums_cache[skey] = self._microbatch_sums(cfg, sh, shapes, topo, local_batch)
        fwd, tp_comm, transient, saved_outside, inst_saved = self._sums_cache[skey]

        passes = 3.0 + (1.0 if cfg.recompute == "full" else 0.0)
        compute = m * passes * fwd
        if cfg.recompute == "selective":
            compute += m * 0.1 * fwd   # the cheap elementwise ops run again
        tp_comm_total = m * tp_comm

        # model states
        local_params, n_tensors = self._local_params(sh, tp)
        states = model_state_bytes(int(local_params), self.optimizer, self.precision)
        states = zero_sharded_state_bytes(states, dp, cfg.zero)
        grad_bytes = local_params * isz
        # the gradients, and the loss for the caller (one scalar per step)
        dp_comm = topo.collective_time("all_reduce", grad_bytes, 0) + topo.collective_time("all_reduce", 4, 0) \
            if dp > 1 else 0.0
        if cfg.zero >= 3 and dp > 1:
            dp_comm += m * 2 * topo.collective_time("all_gather", local_params * isz, 0)
        opt_time = states["optimizer"] * 2 / (self.cluster.device.memory_bandwidth *
                                               self.cluster.device.memory_efficiency)
        opt_time += n_tensors * self.cluster.device.optimizer_overhead_s.get(self.optimizer, 0.0)
        activations = saved_outside + sum(inst_saved.values())
        if cfg.recompute == "full" and inst_saved:
            activations = saved_outside + self._layer_inputs(sh, shapes, tp) + max(inst_saved.values())
        peak = states["total"] + activations + 2 * transient
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
                    "optimizer": states["optimizer"], "activations": activations, "transient": 2 * transient},
            fits=peak <= cap, device_memory_bytes=float(self.cluster.device.memory_bytes),
            devices=devices, global_batch=global_batch, precision=self.precision, optimizer=self.optimizer,
            parallel=cfg.as_dict(),
        )

    def _nodes_to_cost(self, copied: dict[str, str]) -> list[Node]:
        """The nodes outside repeated layers and those of the instances not
        ``copied`` from another (grouped by instance: the sums do not depend on
        the order)."""
        if not hasattr(self, "_by_instance"):
            self._by_instance: dict[str | None, list[Node]] = {}
            for nd in self.graph.nodes:
                self._by_instance.setdefault(nd.group, []).append(nd)
        out: list[Node] = []
        for inst, nodes in self._by_instance.items():
            if inst is None or inst not in copied:
                out.extend(nodes)
        return out

    def _local_params(self, sh: AxisSharding, tp: int) -> tuple[float, int]:
        """Trainable parameter elements per device on the tp axis, and tensors."""
        key = (id(sh), tp)
        hit = self._params_cache.get(key)
        if hit is not None:
            return hit
        if not hasattr(self, "_trainable"):
            self._trainable = [(name, info.numel) for name, nd in self.params.items()
                               if (info := self.graph.params.get(nd.param)) is not None
                               and not info.is_buffer and info.requires_grad]
            self._trainable_total = sum(numel for _, numel in self._trainable)
        out = sh.out
        sharded = sum(numel for name, numel in self._trainable if is_shard(out.get(name, R)))
        local, n = self._trainable_total - sharded + sharded / tp, len(self._trainable)
        self._params_cache[key] = (local, n)
        return local, n

    def _microbatch_sums(self, cfg: ParallelConfig, sh: AxisSharding, shapes: dict, topo: MeshTopology,
                         local_batch: float) -> tuple:
        """Forward time, tensor-parallel comm, largest transient and saved
        activations (outside the layers; per layer instance) of one
        microbatch. An instance of a repeated layer whose decisions were
        copied from the previous one costs what that one cost."""
        g, tp, isz = self.graph, cfg.tp, self.itemsize

        def comm_tp(kind: str, nbytes: float) -> float:
            return topo.collective_time(kind, nbytes * isz / 4, 1)

        dispatch = self.cluster.device.dispatch_overhead_s
        outside = _Sums()
        per_inst: dict[str, _Sums] = {}
        copied = sh.copied_from
        for nd in self._nodes_to_cost(copied):
            st = sh.strategy.get(nd.name)
            if st is None:
                continue
            inst = nd.group
            acc = outside if inst is None else per_inst.setdefault(inst, _Sums())
            frac = 1.0 / tp if st.split else 1.0
            acc.fwd += self._node_time(nd, self._scale(nd, local_batch), frac)
            if nd.kind not in NO_DISPATCH:
                acc.fwd += dispatch
            if tp > 1:
                for i, want in zip(nd.inputs, st.ins):
                    have = sh.out.get(i, want)
                    if have == want and not (want == R and st.split):
                        continue
                    nbytes = _numel(shapes.get(i)) * 4
                    acc.comm += reshard_time(have, want, nbytes, self.grad.get(i, False), comm_tp)
                    if want == R and st.split and self.grad.get(i, False):
                        acc.comm += comm_tp("all_reduce", nbytes)
                for kind, nbytes in st.comm:
                    acc.comm += comm_tp(kind, nbytes)
            for name, local in self._saved(nd, st, sh, shapes, tp, cfg.recompute):
                acc.saved[name] = local
            if nd.out is not None:
                acc.transient = max(acc.transient, _numel(shapes.get(nd.name)) * isz /
                                    (tp if is_shard(sh.out.get(nd.name, R)) else 1))

        def source(inst: str) -> str:
            while inst in copied:
                inst = copied[inst]
            return inst

        inst_saved: dict[str, float] = {}
        fwd, tp_comm, transient = outside.fwd, outside.comm, outside.transient
        for inst in {nd.group for nd in g.nodes if nd.group is not None}:
            s_ = per_inst.get(source(inst))
            if s_ is None:
                continue
            fwd += s_.fwd
            tp_comm += s_.comm
            transient = max(transient, s_.transient)
            inst_saved[inst] = sum(s_.saved.values())
        if tp > 1 and g.output and sh.out.get(g.output) == P:
            tp_comm += comm_tp("all_reduce", 4)
        saved_outside = sum(outside.saved.values())

        return fwd, tp_comm, transient, saved_outside, inst_saved

    def _saved_names(self, nd: Node, recompute: str) -> list[str]:
        """The float values ``nd`` keeps for its backward."""
        k = nd.kind
        if k in _MATMUL_KINDS:
            names = [i for i in nd.inputs if self.params.get(i) is None]
            if k == "sdpa":
                names.append(nd.name)
        elif recompute == "selective":
            return []
        elif k in ("layernorm", "rmsnorm", "batchnorm", "cross_entropy", "pool"):
            names = nd.inputs[:1]
        elif k == "softmax":
            names = [nd.name]
        elif k == "elementwise" and nd.target in _NONLINEAR:
            names = [i for i in nd.inputs if self.params.get(i) is None]
        else:
            return []
        out = []
        for i in names:
            src = self.graph[i] if i in self.graph else None
            if src is not None and src.out is not None and src.out.is_float:
                out.append(i)
        return out

    def _saved(self, nd: Node, st, sh: AxisSharding, shapes: dict, tp: int, recompute: str):
        """(value, local bytes) pairs this node keeps for its backward."""
        out = []
        wants = dict(zip(nd.inputs, st.ins)) if st is not None else {}
        for i in self._saved_names(nd, recompute):
            have = sh.out.get(i, R)
            # an input resharded for this op (e.g. all-gathered before a column-parallel
            # linear) is saved in the placement the op reads, as a tensor of its own
            want = wants.get(i, have) if tp > 1 else have
            local = _numel(shapes.get(i)) * self.itemsize / (tp if is_shard(want) else 1)
            out.append((i if want == have else f"{i}@{want}", local))
        return out

    def _layer_inputs(self, sh: AxisSharding, shapes: dict, tp: int) -> float:
        """Bytes of the inputs of every repeated-layer instance (what full
        recompute keeps)."""
        total = 0.0
        seen: set[str] = set()
        for nd in self.graph.nodes:
            inst = nd.group
            if inst is None or inst in seen:
                continue
            seen.add(inst)
            for i in nd.inputs:
                src = self.graph[i]
                if src.kind not in ("param", "buffer") and src.group != inst:
                    total += _numel(shapes.get(i)) * self.itemsize / (tp if is_shard(sh.out.get(i, R)) else 1)
                    break
        return total


class _Sums:
    __slots__ = ("fwd", "comm", "saved", "transient")

    def __init__(self) -> None:
        self.fwd = 0.0
        self.comm = 0.0
        self.saved: dict[str, float] = {}
        self.transient = 0.0

