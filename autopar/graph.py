"""The traced model: nodes with shapes, dtypes, FLOPs and bytes; parameters; repeated layers.

A :class:`Graph` is what every later stage reads: the cost model, the search
and the compiler. It is produced by :func:`autopar.trace` and never mutated
afterwards (the compiler works on its own copy of the fx graph).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


#: node kinds of model state (parameters and buffers): read by the program, never computed
STATE_KINDS = frozenset({"param", "buffer"})
#: node kinds that run no op of their own in a training step
NO_DISPATCH = STATE_KINDS | {"input", "output", "shape", "constant"}


def parent_module(path: str) -> str:
    """The module path above ``path`` (``""`` above a top-level module)."""
    return path.rsplit(".", 1)[0] if "." in path else ""


def checkpoint_dispatches(kind: str, target: str) -> bool:
    """Whether an op of ``kind`` / ``target`` goes through selective
    recompute's dispatch mode: every op that dispatches (views included)
    but ``contiguous``, which dispatches nothing when its input already is
    (CUDA's attention output transposed back) and which ``torch.export``
    drops."""
    return kind not in NO_DISPATCH and target != "contiguous"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor value (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclass
class Node:
    """One operation of the traced program.

    ``kind`` is the op family the sharding rules and the cost model dispatch
    on (``linear``, ``matmul``, ``elementwise``, ``layernorm`` ...; see
    :mod:`autopar.ops`). ``inputs`` names the nodes whose tensors
    this node reads, in argument order. ``flops`` and ``act_bytes`` are for
    the forward pass at the traced batch size and scale linearly with the
    batch; ``param_bytes`` (weights read) does not.
    """

    name: str
    op: str
    target: str
    kind: str
    inputs: list[str]
    out: TensorInfo | None
    flops: float = 0.0
    act_bytes: float = 0.0
    param_bytes: float = 0.0
    param: str | None = None          # for parameter / buffer nodes: qualified name
    module: str = ""                  # innermost owning module ("" = root)
    group: str | None = None          # repeated-layer instance, e.g. "blocks.3"
    attrs: dict[str, Any] = field(default_factory=dict)  # op details: dims, shapes

    @property
    def normalizes(self) -> bool:
        """Whether this is a normalisation's output: a LayerNorm / RMSNorm op, or the
        last op of a norm module written out in elementwise ops (Hugging Face's
        ``LlamaRMSNorm``: pow, mean, rsqrt, mul), which the tracer marks
        ``attrs["norm_output"]``. Sequence parallelism splits these."""
        return self.kind in ("layernorm", "rmsnorm") or bool(self.attrs.get("norm_output"))

    @property
    def is_state(self) -> bool:
        """Whether this node reads a parameter or a buffer (:data:`STATE_KINDS`)."""
        return self.kind in STATE_KINDS

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["out"] = None if self.out is None else {"shape": list(self.out.shape), "dtype": self.out.dtype}
        return d


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    is_buffer: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class LayerGroup:
    """Modules of identical structure repeated in the model (e.g. transformer blocks).

    ``instances`` are module paths (``blocks.0``, ``blocks.1``, ...); every
    instance owns the same sequence of node kinds and parameter shapes, so a
    decision taken for one can be reused for all.
    """

    name: str
    instances: list[str]
    signature: str
    nodes_per_instance: int
    params_per_instance: int


@dataclass
class Graph:
    """A traced model. Build it with :func:`autopar.trace`."""

    name: str
    nodes: list[Node]
    params: dict[str, ParamInfo]
    inputs: list[str]
    output: str | None
    groups: list[LayerGroup]
    batch_size: int
    frontend: str                      # "fx" or "export"
    gm: Any = field(default=None, repr=False, compare=False)  # torch.fx.GraphModule (not serialised)
    loss_prefix: str = ""              # "model." when the loss was traced with the model
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter name -> the name it is read by
    #: the dim of each tensor node that scales with the batch (None: no such dim), when the
    #: tracer knows it exactly (torch.export with a symbolic batch size); None: inferred
    #: by following the batch through the op rules (:func:`autopar.sharding.batch_dims`)
    traced_batch_dims: dict[str, int | None] | None = field(default=None, repr=False, compare=False)
    #: the first node whose value spans the batch twice (two of its dims are batch sizes: an image x text
    #: similarity over the batch, a pairwise distance): samples meet there, so splitting the batch over
    #: data-parallel ranks would change the result. Known from torch.export's batch symbols; None: none
    cross_sample: str | None = field(default=None, repr=False, compare=False)
    #: the keys of a keyword batch (``model(**batch)``), in the order of the graph's inputs; None: positional
    input_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    #: where the caller's tensors hold the batch (``trace(batch_dim=...)``: 1 for PyTorch's
    #: ``batch_first=False`` layers' ``[seq, batch, ...]``, or one dim per input then the
    #: target's); the graph's inputs hold it at dim 0
    batch_dim: int | tuple[int, ...] = field(default=0, repr=False, compare=False)
    #: why symbolic torch.fx could not trace the model, when torch.export did ("" otherwise)
    fallback_reason: str = field(default="", repr=False, compare=False)
    _by_name: dict[str, Node] = field(default_factory=dict, repr=False, compare=False)
    #: analyses derived from the graph alone (needs_grad, the batch dims, the pipeline
    #: units, ...), filled by :meth:`memo`; the one place later stages keep state on a graph
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}
        self._fingerprint: str | None = None
        self._consumers: dict[str, list[str]] | None = None

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, computed once per graph and ``key``. Only for results
        that depend on the graph alone (the graph is never mutated, so they
        stay true); ``key`` names the analysis and its arguments, e.g.
        ``("needs_grad",)``. Returns the cached or fresh result."""
        try:
            return self._memo[key]
        except KeyError:
            out = self._memo[key] = compute()
            return out

    def __getitem__(self, name: str) -> Node:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self.nodes)

    def consumers(self, name: str) -> list[str]:
        """Names of the nodes that read ``name``'s output, in graph order."""
        if self._consumers is None:
            cons: dict[str, list[str]] = {n.name: [] for n in self.nodes}
            for n in self.nodes:
                for i in dict.fromkeys(n.inputs):
                    cons[i].append(n.name)
            self._consumers = cons
        return self._consumers[name]

    @property
    def num_params(self) -> int:
        """Number of trainable parameter elements (buffers excluded)."""
        return sum(p.numel for p in self.params.values() if not p.is_buffer and p.requires_grad)

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs at the traced batch size."""
        return sum(n.flops for n in self.nodes)

    def group_of(self, node: Node) -> LayerGroup | None:
        for g in self.groups:
            if node.group in g.instances:
                return g
        return None

    @property
    def fingerprint(self) -> str:
        """A hash of the model's structure: parameters, op sequence, input shapes
        without the batch dimension. Independent of the example batch size and
        of the weights' values, so a plan made from a zoo string matches the
        same model built in a training script."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            pre = self.loss_prefix
            params = sorted((p.name[len(pre):] if pre and p.name.startswith(pre) else p.name,
                             list(p.shape), p.dtype, p.is_buffer) for p in self.params.values())
            # a parameter node's target is its name: drop the loss wrapper's prefix there too
            # export's symbolic sizes (sym_size) are read once, by whichever module asks first
            # (the loss wrapper's root when there is one): not part of the model's structure
            ops = [(n.kind, n.target[len(pre):] if pre and n.param is not None and n.target.startswith(pre)
                    else n.target, len(n.inputs)) for n in self.nodes
                   if n.op not in ("placeholder", "output") and self.in_model(n)
                   and not (self.frontend == "export" and n.kind == "shape")]
            ins = []
            for name in (self.inputs[:-1] if pre else self.inputs):
                out = self[name].out
                ins.append(None if out is None else (["B", *out.shape[1:]], out.dtype))
            h.update(json.dumps([params, ops, ins], sort_keys=True, default=str).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def op_keys(self) -> dict[str, str]:
        """``{node name: stable key}`` for every node that is not model state:
        the owning module's path, the op, and its position among the ops of
        that name in that module (``model.blocks.3.attn:linear``,
        ``model.blocks.3:add#1``; ``:cross_entropy`` at the root). Unlike fx's
        counter names (``add_17``), a key does not change when layers are
        added before it, and the k-th layer's keys are the first layer's with
        the instance path changed, so a plan collapses repeated layers into
        one template (:mod:`autopar.plan`). A call of a module or an attribute
        read is named by its kind (its target is a path)."""
        def compute() -> dict[str, str]:
            seen: dict[tuple[str, str], int] = {}
            keys = {}
            for n in self.nodes:
                if n.is_state:
                    continue
                op = n.target if n.op in ("call_function", "call_method") else n.kind
                k = seen[n.module, op] = seen.get((n.module, op), -1) + 1
                keys[n.name] = f"{n.module}:{op}" + (f"#{k}" if k else "")
            return keys
        return self.memo(("op_keys",), compute)

    def in_model(self, node: Node) -> bool:
        """False for the nodes of a loss traced together with the model."""
        pre = self.loss_prefix
        if not pre:
            return True
        if node.param is not None:
            return node.param.startswith(pre)
        return node.module == pre[:-1] or node.module.startswith(pre)

    def summary(self) -> dict:
        """Counts for reports: nodes, parameters, FLOPs, repeated-layer groups."""
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        return {
            "name": self.name,
            "nodes": len(self.nodes),
            "params": self.num_params,
            "forward_flops": self.forward_flops,
            "batch_size": self.batch_size,
            "groups": [{"name": g.name, "instances": len(g.instances), "nodes_per_instance": g.nodes_per_instance}
                       for g in self.groups],
            "kinds": dict(sorted(kinds.items())),
            "fingerprint": self.fingerprint,
            "frontend": self.frontend,
            **({"fallback_reason": self.fallback_reason} if self.fallback_reason else {}),
        }
