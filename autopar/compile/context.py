"""Context parallelism (``cp=N``) in this rank's program.

The program is compiled from the model traced at the local sequence length
``T / cp`` (every view and size is then already this rank's), and
:func:`apply_cp` rewrites what depends on where the rank's tokens sit in the
sequence (its global positions, :func:`autopar.strategies.context.positions`):

* attention reads the keys and values of the whole sequence: a fused
  attention op becomes :func:`autopar.runtime.kernels.context_attention`
  (all-gathered K/V in sequence order, causal mask by global position);
  explicit attention (``softmax(q @ k^T) @ v``) has its key and value
  operands gathered (:func:`~autopar.runtime.kernels.gather_sequence`);
* ``arange(T)`` (position embeddings) becomes the rank's positions;
* a buffer sliced by the sequence length (a causal-mask buffer
  ``bias[:, :, :T, :T]``, RoPE tables ``cos.narrow(0, 0, T)``) is indexed
  by the rank's positions, the key dim of a square mask by the whole
  sequence.

What cannot be rewritten is refused with :class:`UnsupportedError` naming
the op: a mask passed to fused attention, a tensor made at the sequence
length inside the model (``torch.ones(T, T).tril()``), reshapes between the
attention scores and their softmax.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .. import ops
from ..errors import UnsupportedError
from ..graph import Graph, Node
from ..runtime import kernels as K
from ..strategies.context import Attention, attentions, positions
from .fx_utils import eliminate_dead_code

#: F.scaled_dot_product_attention's arguments after q, k, v, in order
_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class ContextAttention(nn.Module):
    """Fused attention of this rank's queries over the whole sequence."""

    def __init__(self, group: Any, order: torch.Tensor, q_pos: torch.Tensor, is_causal: bool,
                 options: dict[str, Any], gather: tuple[bool, bool] = (True, True)) -> None:
        super().__init__()
        self.group, self.order, self.q_pos, self.is_causal, self.options = group, order, q_pos, is_causal, options
        self.gather = gather      # (keys, values) still to gather here: not gathered before the layout ops

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return K.context_attention(q, k, v, self.group, self.order, self.q_pos, self.is_causal, self.gather,
                                   **self.options)


class GatherSequence(nn.Module):
    """The whole sequence of a key or value operand, in sequence order."""

    def __init__(self, group: Any, order: torch.Tensor, dim: int) -> None:
        super().__init__()
        self.group, self.order, self.dim = group, order, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.gather_sequence(x, self.dim, self.group, self.order)


class Positions(nn.Module):
    """This rank's global positions (what ``arange(T)`` gave on one device)."""

    def __init__(self, pos: torch.Tensor, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.pos, self.dtype = pos, dtype

    def forward(self) -> torch.Tensor:
        return self.pos if self.dtype is None else self.pos.to(self.dtype)


class PositionIndex(nn.Module):
    """A buffer indexed along its sequence dims: query dims by this rank's
    positions, the key dim of a square mask by the whole sequence."""

    def __init__(self, dims: dict[int, str], pos: torch.Tensor, seq: int) -> None:
        super().__init__()
        self.dims, self.pos, self.seq = dims, pos, seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for d, role in self.dims.items():
            x = x.narrow(d, 0, self.seq) if role == "k" else x.index_select(d, self.pos.to(x.device))
        return x


def apply_cp(gm: fx.GraphModule, graph: Graph, *, cp: int, rank: int, group: Any, seq: int,
             device: torch.device | str = "cpu", full: Graph | None = None) -> int:
    """Rewrite ``gm`` (this rank's program, compiled from ``graph``: the
    model traced at ``seq / cp`` positions) for context-parallel rank
    ``rank`` of ``cp`` over ``group``; ``seq`` is the whole sequence, ``device``
    this rank's. ``full``: the model traced at ``seq`` positions, whose
    shapes say which dim of a key or value runs along the sequence before
    the layout-only ops that lead to fused attention (GQA's
    ``repeat_interleave``): it is gathered there, where it is smallest;
    without it, at the attention op.
    Returns the number of ops rewritten. Raises :class:`UnsupportedError`
    naming an op it cannot rewrite."""
    local = seq // cp
    pos = torch.tensor(positions(seq, cp, rank), dtype=torch.long, device=device)
    gathered = torch.tensor([p for r in range(cp) for p in positions(seq, cp, r)], dtype=torch.long)
    order = torch.argsort(gathered).to(device)
    nodes = {n.name: n for n in gm.graph.nodes}
    _refuse_made_masks(graph, local)
    count = 0
    for att in attentions(graph):
        count += _attention(gm, graph, nodes, att, group, order, pos, full)
    for nd in graph.nodes:
        f = nodes.get(nd.name)
        if f is None:
            continue
        if nd.kind == "factory" and "arange" in str(nd.target) and nd.out is not None and \
                tuple(nd.out.shape) == (local,):
            _replace(gm, f, "cp_positions", Positions(pos, _dtype(f)), ())
            count += 1
        elif nd.kind == "index":
            roles = _position_dims(graph, nd, local)
            if roles:
                _replace(gm, f, "cp_index", PositionIndex(roles, pos, seq), (f.args[0],))
                count += 1
    eliminate_dead_code(gm)
    gm.recompile()
    return count


def _attention(gm: fx.GraphModule, graph: Graph, nodes: dict[str, fx.Node], att: Attention, group: Any,
               order: torch.Tensor, pos: torch.Tensor, full: Graph | None) -> int:
    """Rewrite one attention op (fused: one kernel, the keys and values
    gathered before it or in it; explicit: gathers before its two products)."""
    f = nodes.get(att.node)
    if f is None:
        return 0
    if att.fused:
        name = str(getattr(f.target, "__name__", f.target))
        if f.op != "call_function" or "scaled_dot_product_attention" not in name or \
                not name.lstrip("_").startswith("scaled_dot_product_attention"):
            raise UnsupportedError(f"cp: attention op {att.node} ({name}) returns more than the attention "
                                   "output; context parallelism rewrites scaled_dot_product_attention only")
        opts = dict(zip(_SDPA_ARGS, f.args[3:]))
        opts.update(f.kwargs)
        if opts.pop("attn_mask", None) is not None:
            raise UnsupportedError(f"cp: attention op {att.node} takes an explicit attn_mask; context parallelism "
                                   "builds the mask from global positions (use is_causal=True)")
        causal = bool(opts.pop("is_causal", False))
        opts = {k: v for k, v in opts.items() if v is not None and not (k == "enable_gqa" and v is False)}
        early = tuple(not _gather_early(gm, graph, full, nodes, src, reader, group, order)
                      for src, reader in att.gathered)
        _replace(gm, f, "cp_attention", ContextAttention(group, order, pos, causal, opts, early), tuple(f.args[:3]))
        return 1
    path = att.node
    while path != att.scores:
        nd = graph[path]
        info = ops.op_info(nd.target) if nd.kind == "view" else None
        if nd.kind == "view" and (info is None or info.shape_arg is not None):     # a cast is fine, a reshape not
            raise UnsupportedError(f"cp: {nd.name} ({nd.target}) reshapes attention scores before the softmax "
                                   f"{att.node}; context parallelism cannot localise it")
        ins = [i for i in nd.inputs if not graph[i].is_state and graph[i].out is not None]
        path = ins[0]
    for prod, dim in ((att.scores, att.k_dim), (att.context, att.v_dim)):
        p = nodes[prod]
        with gm.graph.inserting_before(p):
            g = gm.graph.call_module(_add(gm, "cp_gather", GatherSequence(group, order, dim)), (p.args[1],))
        p.args = (p.args[0], g, *p.args[2:])
    return 1


def _gather_early(gm: fx.GraphModule, graph: Graph, full: Graph | None, nodes: dict[str, fx.Node], src: str,
                  reader: str, group: Any, order: torch.Tensor) -> bool:
    """Gather ``src`` where ``reader`` (the first layout op on its way to the
    attention) reads it; False (gather in the attention op instead) when
    that is the attention itself, its sequence dim is not known, or the
    compiler put a collective between them."""
    if full is None or src not in full or not src or reader == "" or reader not in nodes or src not in nodes \
            or graph[reader].kind == "sdpa":
        return False
    a, b = full[src].out, graph[src].out
    dims = [d for d in range(len(b.shape)) if a.shape[d] != b.shape[d]] if a and b and \
        len(a.shape) == len(b.shape) else []
    r = nodes[reader]
    if len(dims) != 1 or nodes[src] not in r.all_input_nodes:
        return False
    with gm.graph.inserting_before(r):
        g = gm.graph.call_module(_add(gm, "cp_gather", GatherSequence(group, order, dims[0])), (nodes[src],))
    r.replace_input_with(nodes[src], g)
    return True


def _refuse_made_masks(graph: Graph, local: int) -> None:
    """A tensor created inside the model at the sequence length (other than
    ``arange(T)``) would hold local positions: refuse it."""
    for nd in graph.nodes:
        if nd.kind == "factory" and nd.out is not None and local in nd.out.shape and not (
                "arange" in str(nd.target) and len(nd.out.shape) == 1):
            raise UnsupportedError(f"cp: {nd.name} ({nd.target}) makes a tensor of shape {tuple(nd.out.shape)} at "
                                   "the sequence length inside the model (a mask built per call?); context "
                                   "parallelism rewrites arange(T), buffers sliced by T and is_causal attention")


def _position_dims(graph: Graph, nd: Node, local: int) -> dict[int, str]:
    """The dims a slice of a buffer cuts to the sequence length, each with
    its role: ``"k"`` for the last dim of a square mask, else ``"q"``."""
    src = graph[nd.inputs[0]] if nd.inputs else None
    base = src
    while base is not None and base.kind == "index" and base.inputs:
        base = graph[base.inputs[0]]
    if base is None or not base.is_state or src.out is None or nd.out is None:
        return {}
    have, got = tuple(src.out.shape), tuple(nd.out.shape)
    if len(have) != len(got):
        return {}
    changed = [d for d in range(len(got)) if have[d] != got[d]]
    if not changed or any(got[d] != local for d in changed):
        return {}
    square = len(base.out.shape) >= 2 and base.out.shape[-1] == base.out.shape[-2]
    return {d: "k" if square and d == len(got) - 1 else "q" for d in changed}


def _dtype(f: fx.Node) -> torch.dtype | None:
    d = f.kwargs.get("dtype")
    return d if isinstance(d, torch.dtype) else None


def _add(gm: fx.GraphModule, prefix: str, mod: nn.Module) -> str:
    k = 0
    while hasattr(gm, f"_autopar_{prefix}_{k}"):
        k += 1
    name = f"_autopar_{prefix}_{k}"
    gm.add_submodule(name, mod)
    return name


def _replace(gm: fx.GraphModule, f: fx.Node, prefix: str, mod: nn.Module, args: tuple) -> None:
    """Put a call of ``mod`` on ``args`` where ``f`` was."""
    with gm.graph.inserting_before(f):
        new = gm.graph.call_module(_add(gm, prefix, mod), args)
    f.replace_all_uses_with(new)
    gm.graph.erase_node(f)
