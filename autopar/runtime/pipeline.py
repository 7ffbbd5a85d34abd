"""Pipeline execution: cut this rank's compiled program into stages, run a schedule.

:func:`split_stages` cuts the program :func:`autopar.compile.rewrite.compile_local`
built for this tensor-parallel rank (the whole model) into one ``GraphModule``
per virtual stage this pipeline rank holds. :class:`PipelineExecutor` runs the
rank's actions of :func:`autopar.pipeline.schedule.build_schedule` in exactly
that order (the order the cost model simulates): a forward receives its
boundary inputs with blocking receives and sends its outputs with
non-blocking sends; a backward receives the gradients of its outputs and sends
back the gradients of its inputs. Our own executor rather than
``torch.distributed.pipelining``: stages may exchange several tensors, skip a
stage, and contain tensor-parallel collectives.

Which node runs where:

* original nodes: the stage :func:`autopar.pipeline.partition.assign` gave them;
* collectives the compiler inserted: the stage of their first user;
* *free* nodes (computed from graph inputs, buffers and constants only, such as
  ``x.size()``, positions, masks, rotary tables) are recomputed in every stage
  that reads them instead of being sent, as are ``get_attr`` reads; graph
  inputs (tokens, targets) are given to every stage.

Every other value read by a later stage is a *boundary* value: its producer
sends it to each consumer stage once per microbatch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..compile.rewrite import _get_attr
from ..errors import CompileError, UnsupportedError
from ..graph import Graph
from ..pipeline.partition import param_stages
from ..pipeline.schedule import Action, Event, build_schedule

__all__ = ["StageModule", "split_stages", "tied_params", "PipelineExecutor"]

#: dtypes a boundary tensor may have, by the code its header carries
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS        # ndim, dtype code, requires_grad, shape padded with zeros


@dataclass
class StageModule:
    """One virtual stage of this rank's program.

    ``module(*[value of n for n in args])`` runs the stage: ``args`` are the
    graph inputs it reads, then its boundary inputs. It returns the tuple of
    the ``outputs`` values in order, or the loss for the last stage.
    ``inputs``: boundary input -> producer stage; ``outputs``: boundary output
    -> consumer stages; ``ids``: a number per boundary value, the same on all
    ranks (message tags are built from it).
    """

    stage: int
    module: fx.GraphModule
    args: list[str]
    inputs: dict[str, int]
    outputs: dict[str, list[int]]
    ids: dict[str, int]
    last: bool
    comms: int = 0


def _free_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes computed from graph inputs, buffers and constants
    only (not from parameters), which every stage can recompute."""
    free: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if not isinstance(_get_attr(gm, n.target), nn.Parameter):
                free.add(n.name)
        elif n.op in ("call_function", "call_method") or (
                n.op == "call_module" and next(gm.get_submodule(n.target).parameters(), None) is None):
            if all(i.op == "placeholder" or i.name in free for i in n.all_input_nodes):
                free.add(n.name)
    return free


def _node_stages(gm: fx.GraphModule, graph: Graph, stage_of: dict[str, int], free: set[str]) -> dict[str, int]:
    """The stage of every node that runs in exactly one stage (not placeholders,
    ``get_attr`` reads or free nodes). Nodes the compiler inserted take the
    stage of their first user, or without users the latest stage of their inputs."""
    last = max(stage_of.values())
    fixed = {n.name: n for n in graph.gm.graph.nodes} if graph.gm is not None else {}
    stage: dict[str, int] = {}
    pending: list[fx.Node] = []
    for n in reversed(gm.graph.nodes):
        if n.op in ("placeholder", "get_attr") or n.name in free:
            continue
        if n.op == "output":
            stage[n.name] = last
        elif n.name in stage_of:
            src = fixed.get(n.name)
            if src is not None and (src.op, src.target) != (n.op, n.target):
                raise CompileError(f"node {n.name!r} of the compiled program is not the traced node of that "
                                   f"name ({n.op} {n.target} vs {src.op} {src.target}); cannot place it on a stage")
            stage[n.name] = stage_of[n.name]
        else:
            users = [stage[u.name] for u in n.users if u.name in stage]
            if users:
                stage[n.name] = min(users)
            else:
                pending.append(n)
    for n in reversed(pending):
        stage[n.name] = max((stage[i.name] for i in n.all_input_nodes if i.name in stage), default=0)
    return stage


def _boundary(gm: fx.GraphModule, graph: Graph, stage: dict[str, int]) -> dict[str, list[int]]:
    """Every value read by another stage than its producer's -> the sorted
    consumer stages, in program order. Raises for a value that would flow to
    an earlier stage or that is not a tensor."""
    out: dict[str, list[int]] = {}
    for n in gm.graph.nodes:
        if n.name not in stage:
            continue
        consumers = sorted({stage[u.name] for u in n.users if u.name in stage and stage[u.name] != stage[n.name]})
        if not consumers:
            continue
        if consumers[0] < stage[n.name]:
            raise CompileError(f"{n.name!r} is computed on pipeline stage {stage[n.name]} but read on the earlier "
                               f"stage {consumers[0]}; stages must follow the program order")
        nd = graph[n.name] if n.name in graph else None
        if nd is not None and nd.out is None:
            raise UnsupportedError(f"{n.name!r} ({nd.kind}), computed on pipeline stage {stage[n.name]} and read on "
                                   f"stage {consumers[0]}, is not a tensor; pipeline stages exchange tensors only. "
                                   "Compute such values from the inputs (e.g. the input's size) or move the cut")
        out[n.name] = consumers
    return out


def split_stages(gm: fx.GraphModule, graph: Graph, stage_of: dict[str, int], stages: list[int]) -> list[StageModule]:
    """Cut ``gm`` (this rank's whole compiled program) into one module per
    virtual stage in ``stages``.

    ``stage_of`` is :func:`autopar.pipeline.partition.assign`'s stage of every
    traced node. The stage modules share ``gm``'s parameters and submodules.
    """
    free = _free_nodes(gm)
    stage = _node_stages(gm, graph, stage_of, free)
    boundary = _boundary(gm, graph, stage)
    ids = {name: k for k, name in enumerate(boundary)}
    last = max(stage_of.values())
    return [_stage_module(gm, v, stage, boundary, ids, v == last) for v in stages]


def _stage_module(gm: fx.GraphModule, v: int, stage: dict[str, int], boundary: dict[str, list[int]],
                  ids: dict[str, int], last: bool) -> StageModule:
    """The module of stage ``v``: its nodes, the free / get_attr nodes they
    read, its boundary inputs as placeholders, its boundary outputs as result."""
    nodes = list(gm.graph.nodes)
    own = [n for n in nodes if stage.get(n.name) == v]
    shared: set[str] = set()     # placeholders, get_attr and free nodes this stage reads
    inputs: dict[str, int] = {}
    todo = list(own)
    while todo:
        for i in todo.pop().all_input_nodes:
            if i.name in stage:
                if stage[i.name] != v:
                    inputs[i.name] = stage[i.name]
            elif i.name not in shared:
                shared.add(i.name)
                todo.append(i)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    args = [n.name for n in nodes if n.op == "placeholder" and n.name in shared]
    inputs = {name: inputs[name] for name in boundary if name in inputs}    # program order
    for name in args + list(inputs):
        env[name] = g.placeholder(name)
    for n in nodes:
        if n.op not in ("placeholder", "output") and (stage.get(n.name) == v or n.name in shared):
            env[n.name] = g.node_copy(n, lambda a: env[a.name])
    outputs = {name: [c for c in cs if c != v] for name, cs in boundary.items() if stage[name] == v}
    if last:
        g.node_copy(nodes[-1], lambda a: env[a.name])
    else:
        g.output(tuple(env[name] for name in outputs))
    module = fx.GraphModule(gm, g, class_name=f"AutoparStage{v}")
    comms = sum(1 for n in g.nodes if n.op == "call_module" and str(n.target).startswith("_autopar_"))
    mine = {name: ids[name] for name in [*inputs, *outputs]}
    return StageModule(stage=v, module=module, args=args + list(inputs), inputs=inputs, outputs=outputs,
                       ids=mine, last=last, comms=comms)


def tied_params(graph: Graph, stage_of: dict[str, int], pp: int) -> dict[str, list[int]]:
    """Trainable parameters read by stages on different pipeline ranks (a
    tied embedding and head), by their ``get_attr`` target, with those
    pipeline ranks: each rank holds a copy, and their gradients must be
    summed across them (Megatron's embedding group)."""
    out: dict[str, list[int]] = {}
    for node, stages in param_stages(graph, stage_of).items():
        nd = graph[node]
        ranks = sorted({s % pp for s in stages})
        if nd.kind == "param" and len(ranks) > 1 and graph.params[nd.param].requires_grad:
            out[nd.param] = ranks
    return dict(sorted(out.items()))


def _header(t: torch.Tensor) -> torch.Tensor:
    """What a receiver needs to allocate ``t``: ndim, dtype code, requires_grad, shape."""
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise UnsupportedError(f"a pipeline boundary tensor of shape {tuple(t.shape)} and dtype {t.dtype} cannot "
                               f"be sent: at most {_MAX_DIMS} dims and dtypes {', '.join(map(str, _DTYPES))}")
    h = [t.dim(), _DTYPES.index(t.dtype), int(t.requires_grad), *t.shape]
    return torch.tensor(h + [0] * (_HEADER - len(h)), dtype=torch.int64, device=t.device)


@dataclass
class _Step:
    """State of one training step on this rank."""

    micro: list[dict[str, torch.Tensor]]
    ins: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)   # (stage, mb) -> leaves
    outs: dict[tuple[int, int], Any] = field(default_factory=dict)                      # (stage, mb) -> outputs
    local: dict[tuple, torch.Tensor] = field(default_factory=dict)                      # same-rank messages
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)                 # (work, tensor)
    losses: list[torch.Tensor] = field(default_factory=list)                            # last stage only


class PipelineExecutor:
    """Runs this pipeline rank's actions of one schedule on its stage modules.

    ``ranks[p]``: the global rank of pipeline rank ``p`` with this rank's data-
    and tensor-parallel coordinates; ``group``: the pipeline process group the
    point-to-point messages go through. :meth:`run` does one step's forwards
    and backwards (parameter gradients accumulate, scaled for the mean over
    the microbatches) and returns the mean loss on the last stage's rank.
    """

    def __init__(self, stages: Sequence[StageModule], *, schedule: str, pp: int, pp_rank: int, microbatches: int,
                 chunks: int, ranks: Sequence[int], group: Any, input_names: Sequence[str],
                 device: torch.device) -> None:
        self.by_stage = {s.stage: s for s in stages}
        self.pp, self.pp_rank, self.m, self.chunks = pp, pp_rank, microbatches, chunks
        self.num_stages = pp * chunks
        self.actions: list[Action] = build_schedule(schedule, pp, microbatches, chunks)[pp_rank]
        self.ranks, self.group = list(ranks), group
        self.input_names = list(input_names)
        self.device = device
        self.events: list[Event] = []       # the last step's actions as they ran on this rank
        self.loss_scale = 1.0               # fp16: the backward of the loss is scaled by it

    def run(self, micro: Sequence[Sequence[torch.Tensor]], t0: float) -> torch.Tensor | None:
        """One step over the microbatches ``micro`` (each the graph inputs in
        order); ``t0``: the step's start, for the event times. Returns the mean
        loss over the microbatches on the rank holding the last stage, else None."""
        step = _Step(micro=[dict(zip(self.input_names, xs)) for xs in micro])
        self.events = []
        for a in self.actions:
            # drop finished sends: a sent activation is not held until the step ends
            step.sends = [(w, t) for w, t in step.sends if not w.is_completed()]
            v = a.stage(self.pp_rank, self.pp)
            run = self._forward if a.kind == "F" else self._backward
            start, end = run(step, self.by_stage[v], a.microbatch)
            self.events.append(Event(self.pp_rank, v, a.kind, a.microbatch, a.chunk, start - t0, end - t0))
        for work, _ in step.sends:
            work.wait()
        return torch.stack(step.losses).mean() if step.losses else None

    # -- actions ----------------------------------------------------------------
    def _forward(self, step: _Step, st: StageModule, i: int) -> tuple[float, float]:
        leaves = {name: self._recv_forward(step, st, name, src, i) for name, src in st.inputs.items()}
        start = time.perf_counter()
        env = {**step.micro[i], **leaves}
        out = st.module(*[env[name] for name in st.args])
        if st.last:
            step.losses.append(out.detach())
        else:
            out = dict(zip(st.outputs, out))
            for name, consumers in st.outputs.items():
                for c in consumers:
                    self._send(step, out[name], src=st.stage, dst=c, key=(st.ids[name], c, i, 0))
        step.ins[st.stage, i], step.outs[st.stage, i] = leaves, out
        return start, time.perf_counter()

    def _backward(self, step: _Step, st: StageModule, i: int) -> tuple[float, float]:
        leaves, out = step.ins.pop((st.stage, i)), step.outs.pop((st.stage, i))
        if st.last:
            start = time.perf_counter()
            torch.autograd.backward(out * (self.loss_scale / self.m))
        else:
            tensors = [out[name] for name in st.outputs if out[name].requires_grad]
            grads = [self._recv_grad(step, st, name, out[name], i) for name in st.outputs if out[name].requires_grad]
            start = time.perf_counter()
            if tensors:
                torch.autograd.backward(tensors, grads)
        for name, src in st.inputs.items():
            t = leaves[name]
            if t.requires_grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self._send(step, g, src=st.stage, dst=src, key=(st.ids[name], st.stage, i, 1))
        return start, time.perf_counter()

    # -- messages ---------------------------------------------------------------
    def _owner(self, stage: int) -> int:
        return self.ranks[stage % self.pp]

    def _tag(self, bid: int, consumer: int, i: int, backward: int, part: int) -> int:
        """A tag per (boundary value, consumer stage, microbatch, direction, header or data)."""
        return (((bid * self.num_stages + consumer) * self.m + i) * 2 + backward) * 2 + part

    def _send(self, step: _Step, t: torch.Tensor, *, src: int, dst: int, key: tuple[int, int, int, int]) -> None:
        """Send ``t`` from stage ``src`` to stage ``dst`` (a forward value with
        a header); between two stages of this rank, hand it over directly."""
        if self._owner(dst) == self._owner(src):
            step.local[key] = t.detach().requires_grad_(t.requires_grad)
            return
        to = self._owner(dst)
        if not key[3]:
            h = _header(t)
            step.sends.append((dist.isend(h, to, group=self.group, tag=self._tag(*key, 0)), h))
        data = t.detach().contiguous()
        step.sends.append((dist.isend(data, to, group=self.group, tag=self._tag(*key, 1)), data))

    def _recv_forward(self, step: _Step, st: StageModule, name: str, src: int, i: int) -> torch.Tensor:
        """Boundary input ``name`` of microbatch ``i``, as a leaf that collects its gradient."""
        key = (st.ids[name], st.stage, i, 0)
        if self._owner(src) == self._owner(st.stage):
            return step.local.pop(key)
        h = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(h, self._owner(src), group=self.group, tag=self._tag(*key, 0))
        ndim, code, grad = h[:3].tolist()
        t = torch.empty(h[3:3 + ndim].tolist(), dtype=_DTYPES[code], device=self.device)
        dist.recv(t, self._owner(src), group=self.group, tag=self._tag(*key, 1))
        return t.requires_grad_(bool(grad))

    def _recv_grad(self, step: _Step, st: StageModule, name: str, value: torch.Tensor, i: int) -> torch.Tensor:
        """The gradient of output ``name`` of microbatch ``i``, summed over its consumer stages."""
        total: torch.Tensor | None = None
        for c in st.outputs[name]:
            key = (st.ids[name], c, i, 1)
            if self._owner(c) == self._owner(st.stage):
                g = step.local.pop(key)
            else:
                g = torch.empty_like(value, memory_format=torch.contiguous_format)
                dist.recv(g, self._owner(c), group=self.group, tag=self._tag(*key, 1))
            total = g if total is None else total + g
        return total
