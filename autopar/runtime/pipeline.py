"""Pipeline execution: run one schedule over this rank's pipeline stages.

:class:`PipelineExecutor` runs the rank's actions of
:func:`autopar.pipeline.schedule.build_schedule` in exactly that order (the
order the cost model simulates) on :class:`StageModule` s (the compiler's
:func:`autopar.compile.stages.split_stages` cuts them): a forward receives
its boundary inputs with blocking receives and sends its outputs with
non-blocking sends; a backward receives the gradients of its outputs and
sends back the gradients of its inputs. Our own executor rather than
``torch.distributed.pipelining``: stages may exchange several tensors, skip a
stage, and contain tensor-parallel collectives. :func:`tie_groups` creates
the process groups over which the copies of a weight that several pipeline
ranks hold sum their gradients.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import UnsupportedError
from ..pipeline.schedule import Action, Event, build_schedule
from . import regather

__all__ = ["StageModule", "PipelineExecutor", "tie_groups"]

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
        self.weights: list[float] | None = None   # each microbatch's weight in the mean loss (None: alike)
        #: bound on every receive and send (gloo's blocking receive has none of its own)
        self.timeout: datetime.timedelta | None = None

    def run(self, micro: Sequence[Sequence[torch.Tensor]], t0: float) -> torch.Tensor | None:
        """One step over the microbatches ``micro`` (each the graph inputs in
        order); ``t0``: the step's start, for the event times. Returns the mean
        loss over the microbatches (weighted by :attr:`weights`) on the rank
        holding the last stage, else None."""
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
            self._wait(work)
        if not step.losses:
            return None
        losses = torch.stack(step.losses)
        if self.weights is not None:    # a microbatch with nothing counted (0/0) weighs 0
            w = torch.tensor(self.weights, dtype=losses.dtype, device=losses.device)
            losses = torch.where(w == 0, 0.0, losses * w)
        return losses.mean()

    def _wait(self, work: Any) -> None:
        """Wait for a send or receive, at most :attr:`timeout`."""
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    # -- actions ----------------------------------------------------------------
    def _forward(self, step: _Step, st: StageModule, i: int) -> tuple[float, float]:
        leaves = {name: self._recv_forward(step, st, name, src, i) for name, src in st.inputs.items()}
        start = time.perf_counter()
        env = {**step.micro[i], **leaves}
        with regather.scope():      # sequence parallel: saved as shards, gathered again in backward
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
            w = self.weights[i] if self.weights is not None else 1.0
            torch.autograd.backward(out * (self.loss_scale * w / self.m))
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
        self._wait(dist.irecv(h, self._owner(src), group=self.group, tag=self._tag(*key, 0)))
        ndim, code, grad = h[:3].tolist()
        t = torch.empty(h[3:3 + ndim].tolist(), dtype=_DTYPES[code], device=self.device)
        self._wait(dist.irecv(t, self._owner(src), group=self.group, tag=self._tag(*key, 1)))
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
                self._wait(dist.irecv(g, self._owner(c), group=self.group, tag=self._tag(*key, 1)))
            total = g if total is None else total + g
        return total


def tie_groups(tied: dict[str, list[int]], local: dict[str, torch.Tensor], *, dp: int, tp: int,
               rank: int) -> list[tuple[torch.Tensor, Any]]:
    """Process groups for weights several pipeline ranks hold a copy of (a
    tied embedding and head: Megatron's embedding group).

    ``tied``: weight name -> the pipeline ranks holding a copy (the compiler's
    :func:`autopar.compile.stages.tied_params`); ``local``: this rank's tensors
    by name; ranks form a ``(pp, dp, tp)`` mesh, tp fastest. One group per
    tied weight and (dp, tp) coordinate, over the pipeline ranks holding it;
    every rank creates every group, in the same order (``dist.new_group`` is
    collective). Returns this rank's (copy, group) pairs: the copies start
    equal and get the same summed gradient, so they stay equal."""
    out = []
    for name, pp_ranks in tied.items():
        for d in range(dp):
            for t in range(tp):
                members = [(p * dp + d) * tp + t for p in pp_ranks]
                group = dist.new_group(members)
                if rank in members:
                    out.append((local[name], group))
    return out
