"""Cut this rank's compiled program into pipeline stages.

:func:`split_stages` cuts the program :func:`autopar.compile.rewrite.compile_local`
built for this tensor-parallel rank (the whole model) into one
:class:`~autopar.runtime.pipeline.StageModule` per virtual stage this
pipeline rank holds, which :class:`~autopar.runtime.pipeline.PipelineExecutor`
runs. Which node runs where:

* original nodes: the stage :func:`autopar.pipeline.partition.assign` gave them;
* collectives the compiler inserted: the stage of their first user; but a
  weight's own moves (a weight gathered on an axis that stores it split,
  computed from parameters alone) run in every stage that reads them, as
  the weight is held by every stage reading it (a tied embedding and head
  under ``tp_mode=mesh``: sending the moved weight between stages would
  leave the head's stage without the weight its gradient is summed into);
* *free* nodes (computed from graph inputs, buffers and constants only, such as
  ``x.size()``, positions, masks, rotary tables) are recomputed in every stage
  that reads them instead of being sent, as are ``get_attr`` reads; graph
  inputs (tokens, targets) are given to every stage.

Every other value read by a later stage is a *boundary* value: its producer
sends it to each consumer stage once per microbatch. :func:`tied_params` names
the weights several pipeline ranks hold a copy of.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from ..errors import CompileError, UnsupportedError
from ..graph import Graph
from ..pipeline.partition import param_stages
from ..runtime.pipeline import StageModule
from .fx_utils import free_nodes, get_attr

__all__ = ["split_stages", "tied_params"]


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
    free = free_nodes(gm)
    free |= _weight_moves(gm, stage_of, free)
    stage = _node_stages(gm, graph, stage_of, free)
    boundary = _boundary(gm, graph, stage)
    ids = {name: k for k, name in enumerate(boundary)}
    last = max(stage_of.values())
    return [_stage_module(gm, v, stage, boundary, ids, v == last) for v in stages]


def _weight_moves(gm: fx.GraphModule, stage_of: dict[str, int], free: set[str]) -> set[str]:
    """The nodes the compiler inserted that compute from parameters (and
    free values) alone: a weight's own moves, which every stage reading
    them runs (module docstring)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module") or n.name in stage_of or n.name in free:
            continue
        ins = n.all_input_nodes
        weights = [i for i in ins if i.name in out or
                   (i.op == "get_attr" and isinstance(get_attr(gm, i.target), nn.Parameter))]
        if weights and all(i in weights or i.name in free for i in ins):
            out.add(n.name)
    return out


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
