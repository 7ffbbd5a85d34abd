"""The Plan: one versioned, JSON-serialisable record of every decision.

A plan holds the model fingerprint (a plan for another model is refused),
the cluster, the mesh, the ``parallel`` section (the strategy as
:meth:`autopar.spec.ParallelConfig.as_dict` writes it, read back by
:attr:`Plan.config`; its schema is generated from the strategy keys), with a
pipeline the ``pipeline`` record (schedule, layers per stage, the simulated
bubble and per-stage times), the placement of every parameter and op on the
(dp, tp) axes, and the predictions. ``to_json`` is deterministic: the same
inputs give byte-identical text (sorted keys, rounded floats, no timestamps).

Plan version 2 (docs/plan-format.md) keys ops by module path, op and position
(:meth:`autopar.graph.Graph.op_keys`), writes the instances of a repeated
layer placed alike once as a template (:func:`collapse`; :func:`expand` on
load) and leaves default fields out. Version-1 files (ops under fx node
names) are still read, and written back as they were read.
"""
from __future__ import annotations

import json
import os
import dataclasses
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jsonschema

from . import __version__, units
from .errors import PlanError
from .spec import (FIELDS, MESH_MODES, PIPELINE_SCHEDULES, PRECISIONS, ParallelConfig, json_schema, shard_blocks,
                   shard_dim, zero_words)
from .spec.placement import SEP

PLAN_VERSION = 2
#: the versions :meth:`Plan.load` reads: 1 (ops keyed by fx node names, every layer written out) and 2
PLAN_VERSIONS = (1, 2)

# one placement, or (tp_mode=mesh) one per axis of the tp group's mesh, outermost first: S(0)|S(1)
_ONE = r"(R|P|S\([0-9]+\)|S\([0-9]+,([2-9]|[1-9][0-9]+)\))"
_PLACEMENT = {"type": "string", "pattern": rf"^{_ONE}(\|{_ONE})*$"}
_PARAMS = {"type": "object", "additionalProperties": {"type": "array", "items": _PLACEMENT}}
_OPS = {
    "type": "object",
    "additionalProperties": {
        "type": "object", "required": ["out", "in", "strategy"],
        "properties": {
            "out": {"type": "array", "items": _PLACEMENT},
            "in": {"type": "array", "items": {"type": "array", "items": _PLACEMENT}},
            "strategy": {"type": "array", "items": {"type": "string"}},
            "kernel": {"type": "string"},
            "scale": {"type": "array", "items": {"type": "number"}},
            "split": {"type": "array", "items": {"type": "boolean"}},
        },
    },
}
_STRINGS = {"type": "array", "items": {"type": "string"}}


def plan_schema(version: int = PLAN_VERSION) -> dict[str, Any]:
    """The JSON schema of a plan file of ``version`` (one of :data:`PLAN_VERSIONS`).
    Version 2 adds ``layers`` (the repeated-layer groups) and ``templates``
    (one layer's placements standing for every instance it lists)."""
    props: dict[str, Any] = {
        "plan_version": {"const": version},
        "autopar_version": {"type": "string"},
        "model": {
            "type": "object",
            "required": ["name", "fingerprint", "num_params", "num_nodes"],
            "properties": {"name": {"type": "string"}, "fingerprint": {"type": "string"},
                           "num_params": {"type": "integer"}, "num_nodes": {"type": "integer"}},
        },
        "cluster": {"type": "object", "required": ["name"]},
        "devices": {"type": "integer", "minimum": 1},
        "global_batch": {"type": "integer", "minimum": 1},
        "precision": {"enum": [*PRECISIONS, "mixed"]},   # mixed: older plans (= bf16)
        "optimizer": {"type": "string"},
        "mesh": {
            "type": "object", "required": ["shape", "axes"],
            "properties": {"shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                           "axes": _STRINGS},
        },
        "parallel": json_schema(),   # generated from the strategy keys of autopar.spec
        "pipeline": {
            "type": "object", "required": ["schedule", "chunks", "layers"],
            "properties": {
                "schedule": {"enum": list(PIPELINE_SCHEDULES)},
                "chunks": {"type": "integer", "minimum": 1},
                "layers": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "bubble_fraction": {"type": "number"},
            },
        },
        "params": _PARAMS,
        "ops": _OPS,
        "predicted": {
            "type": "object",
            "required": ["step_time_s", "peak_memory_bytes", "tflops_per_device", "fits"],
        },
        "search": {"type": "object", "required": ["mode"]},
    }
    if version >= 2:
        props["layers"] = {"type": "array", "items": {
            "type": "object", "required": ["name", "instances"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "instances": _STRINGS}}}
        props["templates"] = {"type": "array", "items": {
            "type": "object", "required": ["instances"], "additionalProperties": False,
            "properties": {"instances": _STRINGS, "params": _PARAMS, "ops": _OPS}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "autopar plan",
        "type": "object",
        "required": ["plan_version", "autopar_version", "model", "cluster", "devices", "global_batch", "mesh",
                     "parallel", "params", "ops", "predicted", "search", "precision", "optimizer"],
        "additionalProperties": False,
        "properties": props,
    }


PLAN_SCHEMA: dict[str, Any] = plan_schema()


def parallel_record(cfg: ParallelConfig) -> dict[str, Any]:
    """The plan's ``parallel`` section of ``cfg``: the keys every plan
    records, and the others only away from their defaults (no
    ``reduce_dtype: ""``; a missing key reads back as its default)."""
    d = cfg.as_dict()
    return {k.name: d[k.name] for k in FIELDS if k.name in d and (k.required or d[k.name] != k.default)}


# -- repeated layers: one template per set of equal instances -----------------------------------------------
def _owner(key: str, instances: set[str]) -> str | None:
    """The repeated-layer instance a parameter name or op key (``module:op#k``) lies in, or None."""
    path = key.split(":", 1)[0]
    while path:
        if path in instances:
            return path
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return None


def _relative(key: str, instance: str) -> str:
    """``model.blocks.3.attn.q.weight`` -> ``attn.q.weight``; ``model.blocks.3:add#1`` -> ``:add#1``."""
    return key[len(instance):].removeprefix(".")


def _absolute(instance: str, rel: str) -> str:
    """The inverse of :func:`_relative`."""
    return instance + (rel if rel.startswith(":") else "." + rel)


def collapse(data: dict[str, Any]) -> dict[str, Any]:
    """The file form of a version-2 plan's ``data``: the instances of a
    repeated layer whose placements are all equal share one template (their
    ``params`` and ``ops`` keyed relative to the instance); an instance
    equal to no other stays in the flat ``params`` and ``ops``."""
    groups = data.get("layers") or []
    instances = {i for g in groups for i in g["instances"]}
    flat: dict[str, dict[str, Any]] = {"params": {}, "ops": {}}
    per: dict[str, dict[str, dict[str, Any]]] = {}
    for section in ("params", "ops"):
        for key, value in data[section].items():
            inst = _owner(key, instances)
            if inst is None:
                flat[section][key] = value
            else:
                per.setdefault(inst, {"params": {}, "ops": {}})[section][_relative(key, inst)] = value
    templates = []
    for g in groups:
        alike: dict[str, dict[str, Any]] = {}
        for inst in g["instances"]:
            mine = per.pop(inst, {"params": {}, "ops": {}})
            alike.setdefault(_dumps(mine), {"instances": [], **mine})["instances"].append(inst)
        for t in alike.values():
            if len(t["instances"]) > 1 and (t["params"] or t["ops"]):
                templates.append({k: v for k, v in t.items() if v})
                continue
            for section in ("params", "ops"):
                flat[section].update((_absolute(t["instances"][0], r), v) for r, v in t[section].items())
    out = {**data, **flat}
    if templates:
        out["templates"] = templates
    return out


def expand(d: dict[str, Any]) -> dict[str, Any]:
    """The plan data of the file form ``d`` (:func:`collapse`'s inverse):
    every template written out for each instance it lists. An entry in the
    flat ``params`` or ``ops`` wins over a template's (so one layer of a
    template can be edited by hand)."""
    data = {k: v for k, v in d.items() if k != "templates"}
    for section in ("params", "ops"):
        merged = dict(d[section])
        for t in d.get("templates", []):
            for inst in t["instances"]:
                for rel, value in t.get(section, {}).items():
                    merged.setdefault(_absolute(inst, rel), _round(value))
        data[section] = merged
    return data


def rounded(x: Any) -> Any:
    """``x`` as a plan holds it: floats to 6 significant digits, tuples as
    lists (a copy of every container)."""
    return _round(x)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


_SPECIAL_FLOATS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _dumps(data: Any) -> str:
    """``json.dumps(_round(data), sort_keys=True, indent=1)``, byte for byte,
    in one pass. The json module formats indented text in Python, one
    generator per container; a GPT-3 175B plan (4,600 ops) took 0.3 s that
    way, plus 0.1 s to round it first. Here each container is one join, and
    the short lists of placements that make up most of a plan are formatted
    once per distinct content. Raises :class:`TypeError` for a value JSON
    cannot hold, as json does."""
    strings: dict[str, str] = {}
    leaves: dict[tuple, str] = {}
    encode_str = json.encoder.encode_basestring_ascii

    def text(x: Any, pad: str) -> str:
        t = type(x)
        if t is str:
            s = strings.get(x)
            if s is None:
                s = strings[x] = encode_str(x)
            return s
        if t is dict:
            if not x:
                return "{}"
            inner = pad + " "
            if not all(type(k) is str for k in x):     # rare: let json convert and order other keys
                return json.dumps(_round(x), sort_keys=True, indent=1).replace("\n", "\n" + pad)
            return "{\n" + ",\n".join(inner + text(k, "") + ": " + text(x[k], inner) for k in sorted(x)) + \
                "\n" + pad + "}"
        if t is list or t is tuple:
            if not x:
                return "[]"
            if all(type(v) is str for v in x):
                key = (pad, *x)
                s = leaves.get(key)
                if s is None:
                    inner = pad + " "
                    s = leaves[key] = "[\n" + ",\n".join(inner + text(v, "") for v in x) + "\n" + pad + "]"
                return s
            inner = pad + " "
            return "[\n" + ",\n".join(inner + text(v, inner) for v in x) + "\n" + pad + "]"
        if x is True:
            return "true"
        if x is False:
            return "false"
        if x is None:
            return "null"
        if t is float:
            r = repr(float(f"{x:.6g}"))
            return _SPECIAL_FLOATS.get(r, r)
        if t is int:
            return int.__repr__(x)
        return json.dumps(_round(x))      # subclasses of int, float, str: as json writes them

    return text(data, "")


@dataclass
class Plan:
    """A parallelization plan. Build with :func:`autopar.plan`; load with :meth:`Plan.load`."""

    data: dict[str, Any] = field(default_factory=dict)
    planning_time_s: float | None = field(default=None, compare=False)   # not serialised
    graph: Any = field(default=None, repr=False, compare=False)          # the traced graph, when planned here

    # -- accessors ------------------------------------------------------------
    @property
    def parallel(self) -> dict[str, Any]:
        return self.data["parallel"]

    @property
    def predicted(self) -> dict[str, Any]:
        return self.data["predicted"]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.data["mesh"]["shape"])

    @property
    def fingerprint(self) -> str:
        return self.data["model"]["fingerprint"]

    @property
    def config(self) -> ParallelConfig:
        """The :class:`ParallelConfig` this plan records, its precision resolved
        to the plan's (plans written before pipelines have no ``chunks``, those
        before the memory options none of them: they take their defaults).
        Raises :class:`StrategyError` for a value the strategy keys refuse
        (never for a plan that passed the schema)."""
        precision = self.parallel.get("precision") or self.data.get("precision", "fp32")
        return ParallelConfig.from_dict({**self.parallel, "precision": precision})

    @property
    def strategy(self) -> str:
        """The canonical strategy string (as :meth:`ParallelConfig.to_string`;
        the precision only when the plan's ``parallel`` section names one)."""
        return ParallelConfig.from_dict(self.parallel).to_string()

    # -- serialisation --------------------------------------------------------
    @property
    def version(self) -> int:
        return self.data["plan_version"]

    def to_dict(self) -> dict[str, Any]:
        """The plan's data, every layer written out (a valid plan file too,
        only not the compact one :meth:`to_json` writes)."""
        return _round(self.data)

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, floats to 6 significant
        digits), repeated layers collapsed into templates (:func:`collapse`;
        a plan read from a version-1 file is written as it was read)."""
        return _dumps(collapse(self.data) if self.version >= 2 else self.data) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan atomically: to a temporary file beside ``path``,
        then renamed over it, so a write that fails midway leaves the
        previous file whole."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.chmod(tmp, 0o644)      # mkstemp makes it private; a plan is shared like any file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "plan") -> "Plan":
        """The plan of the file form ``d`` (either version of
        :data:`PLAN_VERSIONS`), validated against its schema, templates
        written out. Raises :class:`PlanError`."""
        if not isinstance(d, dict):
            raise PlanError(f"{where}: a plan is a JSON object, got {type(d).__name__}")
        version = d.get("plan_version")
        if type(version) is not int or version not in PLAN_VERSIONS:
            raise PlanError(f"{where}: plan_version {version!r} is not supported; this autopar "
                            f"({__version__}) reads versions {', '.join(map(str, PLAN_VERSIONS))}")
        try:
            jsonschema.validate(d, PLAN_SCHEMA if version == PLAN_VERSION else plan_schema(version))
        except jsonschema.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path) or "<top>"
            why = e.message
            if e.validator == "pattern" and e.schema is _PLACEMENT:
                why = (f"{e.instance!r} is not a placement (R, P, S(d), or S(d,k) with k >= 2 blocks; under "
                       f"tp_mode=mesh one per axis joined by '|', S(0)|S(1))")
            raise PlanError(f"{where}: invalid plan at '{path}': {why}") from None
        _check_consistent(d, where)
        return cls(expand(d) if version >= 2 else d)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {str(p)!r} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file {str(p)!r} is not valid JSON: {e}") from None
        except OSError as e:      # a directory, no permission
            raise PlanError(f"plan file {str(p)!r} cannot be read: {e.strerror or e}") from None
        return cls.from_dict(d, where=f"plan file {str(p)!r}")

    def op_keys(self, graph: Any) -> dict[str, str]:
        """``{node name: the key of its entry in ops}`` for ``graph``: its
        stable op keys (:meth:`autopar.graph.Graph.op_keys`), the fx node
        names themselves for a version-1 plan."""
        if self.version >= 2:
            return graph.op_keys()
        return {nd.name: nd.name for nd in graph.nodes if not nd.is_state}

    def patterns(self) -> Callable[[str], str]:
        """A function naming a parameter or op key by its template: its
        repeated-layer instance replaced by the group's name
        (``model.blocks.7.attn.q.weight`` -> ``model.blocks.*.attn.q.weight``;
        in a plan without groups, version 1, every number of a dotted path)."""
        groups = {i: g["name"] for g in self.data.get("layers") or [] for i in g["instances"]}
        return lambda key: _pattern(key, groups)

    def upgraded(self, graph: Any) -> "Plan":
        """This plan in the current version, for ``graph``, the model it was
        made for (the fingerprints must match): a version-1 plan's ops keyed
        by their stable keys instead of fx node names (ops ``graph`` lacks,
        another loss function's, are dropped), default fields left out, the
        repeated-layer groups recorded. The placements and predictions stay
        as they are. Raises :class:`PlanError` for a plan of another model."""
        if self.version >= PLAN_VERSION:
            return self
        self.check_model(graph.fingerprint, graph.name)
        keys = graph.op_keys()
        d = {**self.data, "plan_version": PLAN_VERSION, "parallel": parallel_record(self.config)}
        d["ops"] = {keys[n]: {k: v for k, v in e.items() if k != "split" or any(v)}
                    for n, e in self.data["ops"].items() if n in keys}
        if graph.groups:
            d["layers"] = [{"name": g.name, "instances": list(g.instances)} for g in graph.groups]
        return Plan(_round(d), planning_time_s=self.planning_time_s, graph=graph)

    def placement_axes(self) -> list[str]:
        """The mesh axes the ``params`` and ``ops`` placements are given on:
        ``dp`` and ``tp`` (pp and cp hold none: a cp rank holds the weights
        whole and its part of the sequence), ``tp`` under ``tp_mode=mesh``
        holding every axis of the tp group's mesh, joined (``tp_row|tp``,
        ``tp_depth|tp_row|tp``)."""
        axes = [a for a in self.data["mesh"]["axes"] if a not in ("pp", "cp")]
        if self.config.tp_mode in MESH_MODES:
            names = (("tp_depth",) if len(self.config.tp_grid) == 3 else ()) + ("tp_row", "tp")
            axes = [SEP.join(names) if a == "tp" else a for a in axes]
        return axes

    def check_graph(self, graph: Any) -> None:
        """Refuse a plan whose placements cannot be this graph's: a parameter
        missing from ``params`` (or one the graph lacks), a shard dim a
        tensor does not have or that the tensor-parallel size does not
        divide, and a parameter placed one way in ``params`` and read another
        way by every op that reads it in ``ops`` (an edited plan would
        otherwise be run as something else than its predictions describe)."""
        where = f"plan for {self.data['model']['name']!r}"
        # tp_mode=2d: the placements are the grid's columns; tp_mode=mesh: one per axis of its mesh
        sizes = self.config.tp_grid if self.config.tp_mode in MESH_MODES else self.config.tp_grid[-1:]
        params = self.data["params"]
        names = {nd.param: nd for nd in graph.nodes if nd.param and nd.kind == "param"}
        missing = sorted(set(names) - set(params))
        extra = sorted(set(params) - {nd.param for nd in graph.nodes if nd.param})
        if missing or extra:
            raise PlanError(f"{where}: its 'params' do not match the model: "
                            + "; ".join(x for x in (f"missing {', '.join(missing[:3])}" if missing else "",
                                                    f"unknown {', '.join(extra[:3])}" if extra else "") if x))
        state = {nd.param: nd for nd in graph.nodes if nd.param}
        for pname, (_, place) in params.items():
            nd = state[pname]
            _check_shard(f"{where}: parameter {pname}", place, nd.out.shape if nd.out is not None else (), sizes)
        by_node = {nd.name: nd.param for nd in graph.nodes if nd.param}
        reads: dict[str, list[tuple[str, str]]] = {}     # parameter -> (op, placement it reads) per reader
        ops = self.data["ops"]
        for name, op in self.op_keys(graph).items():
            e = ops.get(op)
            if e is None:
                continue        # another loss function's ops: the strategy's placements are derived again
            for i, ins in zip(graph[name].inputs, e["in"]):
                if by_node.get(i) in params:
                    reads.setdefault(by_node[i], []).append((op, ins[1]))
        def stored(p: str) -> str:     # a mesh moves a weight on its outer axes, never on the inner one
            return p.split(SEP)[-1]

        for pname, readers in reads.items():
            # a reader may take a weight in another placement after a redistribution (the head of a tied
            # embedding reads it whole), but a placement no reader takes is one the plan was not made for
            if all(stored(r) != stored(params[pname][1]) for _, r in readers):
                op, r = readers[0]
                raise PlanError(f"{where}: parameter {pname} is placed {params[pname][1]} in 'params' but op "
                                f"{op} reads it as {r} in 'ops'; the plan was edited inconsistently: "
                                "make a new one with autopar.plan(...)")

    def check_model(self, fingerprint: str, name: str = "") -> None:
        """Refuse to apply this plan to a different model."""
        if fingerprint != self.fingerprint:
            raise PlanError(f"this plan was made for model {self.data['model']['name']!r} "
                            f"(fingerprint {self.fingerprint}), but the model given"
                            f"{' (' + name + ')' if name else ''} has fingerprint {fingerprint}; "
                            "make a new plan for it with autopar.plan(...)")

    def diff(self, other: "Plan") -> dict[str, Any]:
        """What changes from this plan to ``other``, as a JSON-able dict:
        ``identical`` (everything but the autopar version equal), the model
        (same fingerprint or not), the request (cluster, devices, global
        batch, precision, optimizer), every strategy key and pipeline field
        that differs (``[from, to]``), the parameters and ops placed
        otherwise summarised per template (repeated layers counted under
        their group's name, ``model.blocks.*.attn.q.weight``), each
        prediction's change (``from``, ``to``, ``delta``, ``relative``; the
        memory per device by part), and the other sections that differ."""
        a, b = self.data, other.data
        differ = sorted(k for k in set(a) | set(b) if k != "autopar_version" and a.get(k) != b.get(k))
        request = ("devices", "global_batch", "precision", "optimizer")
        pipe_a, pipe_b = a.get("pipeline") or {}, b.get("pipeline") or {}
        out = {
            "identical": not differ,
            "same_model": a["model"]["fingerprint"] == b["model"]["fingerprint"],
            "request": _changed({k: a[k] for k in request} | {"cluster": a["cluster"]["name"]},
                                {k: b[k] for k in request} | {"cluster": b["cluster"]["name"]}),
            "parallel": _changed(dataclasses.asdict(self.config), dataclasses.asdict(other.config)),
            "pipeline": _changed({k: pipe_a.get(k) for k in ("schedule", "layers", "bubble_fraction")},
                                 {k: pipe_b.get(k) for k in ("schedule", "layers", "bubble_fraction")}),
            "params": _placement_changes(self, other, "params"),
            "predicted": _prediction_changes(a["predicted"], b["predicted"]),
        }
        # said above: the cluster when its name changed (a calibrated cluster of the same name differs here)
        shown = {"params", "ops", "predicted", "parallel", "mesh", "pipeline", "layers", *out["request"]}
        out["other"] = [k for k in differ if k not in shown]
        if self.version == other.version:
            out["ops"] = _placement_changes(self, other, "ops")
        else:       # version-1 ops are keyed by fx node names: nothing to pair them with
            out["ops"] = {"changed": None, "note": f"not compared: plan versions {self.version} and "
                                                   f"{other.version} key their ops differently"}
        return out

    # -- presentation ---------------------------------------------------------
    def summary(self, width: int = 100) -> str:
        """A readable table of the plan (rich, rendered to text ``width``
        columns wide; long values wrap, nothing is cut)."""
        from rich.console import Console
        from rich.table import Table

        d = self.data
        pred = d["predicted"]
        t = Table(title=f"autopar plan: {d['model']['name']}", show_header=False, title_justify="left")
        t.add_column("key", style="bold", no_wrap=True)
        t.add_column("value", overflow="fold")
        mem = pred.get("memory", {})
        rows = [
            ("model", f"{d['model']['name']}  ({units.count(d['model']['num_params'])} params, "
                      f"fingerprint {d['model']['fingerprint']})"),
            ("cluster", f"{d['cluster']['name']}  x {d['devices']} devices"),
            ("mesh", " x ".join(f"{a}={s}" for a, s in zip(d["mesh"]["axes"], d["mesh"]["shape"]))),
            ("strategy", self.strategy),
            ("global batch", f"{d['global_batch']}  ({d['precision']} precision, {d['optimizer']})"),
            ("step time", f"{units.seconds(pred['step_time_s'])}  (compute "
                          f"{units.seconds(pred.get('compute_time_s', 0))}, tp comm "
                          f"{units.seconds(pred.get('tp_comm_time_s', 0))}, dp comm "
                          f"{units.seconds(pred.get('dp_comm_time_s', 0))}"
                          + (f", cp comm {units.seconds(pred['cp_comm_time_s'])}" if pred.get("cp_comm_time_s")
                             else "") + ")"),
            ("throughput", f"{units.flops_rate(pred['tflops_per_device'] * 1e12)} per device"),
            ("peak memory", f"{units.nbytes(pred['peak_memory_bytes'])} of "
                            f"{units.nbytes(pred.get('device_memory_bytes', 0))} "
                            f"({'fits' if pred['fits'] else 'DOES NOT FIT'})"),
        ]
        if mem:
            order = ["weights", "gradients", "optimizer", "activations", "transient"]
            keys = [k for k in order if k in mem] + sorted(k for k in mem if k not in order)
            rows.append(("memory", ", ".join(f"{k} {units.nbytes(mem[k])}" for k in keys)))
        pipe = d.get("pipeline")
        if pipe:
            span = (f", timeline {units.seconds(pipe['makespan_s'])} (the forwards and backwards; the step time "
                    "adds the dp reduction and the optimizer)" if pipe.get("makespan_s") else "")
            rows.append(("pipeline", f"{pipe['schedule']}, layers per stage {pipe['layers']}, "
                                     f"bubble {pipe.get('bubble_fraction', 0):.1%}{span}"))
        sharded = sum(1 for v in d["params"].values() if any(p != "R" for p in v))
        par = d["parallel"]
        by_zero = f"; {words}" if (words := zero_words(par)) else ""
        rows.append(("params sharded", f"{sharded} of {len(d['params'])} parameter tensors by tp{by_zero}"))
        s = d["search"]
        if s.get("candidates"):
            took = f", {self.planning_time_s:.3g} s" if self.planning_time_s is not None else ""
            rows.append(("search", f"{s['mode']}: {s['candidates']} candidates evaluated, "
                                   f"{s.get('feasible', 0)} fit{took}"))
        else:
            rows.append(("search", s["mode"]))
        if s.get("tp_axis"):
            rows.append(("tp placements", {"ilp": "per op, ILP", "ilp+memory": "per op, ILP under the memory bound",
                                           "greedy": "per op, greedy propagation",
                                           "manual": "Megatron-style (every splittable weight split)",
                                           "mesh": "per op, one ILP over every axis of the tp mesh",
                                           "mesh+memory": "per op, one ILP over every axis of the tp mesh, "
                                                          "under the memory bound"}
                         .get(s["tp_axis"], s["tp_axis"])))
        if s.get("ilp"):
            i = s["ilp"]
            rows.append(("ILP", f"{i['decisions']} decisions for {i['nodes']} nodes, {i['variables']} variables, "
                                f"{i['constraints']} constraints"))
        if s.get("pins"):
            rows.append(("pinned", ", ".join(f"{k}={v}" for k, v in s["pins"].items())))
        for k, v in rows:
            t.add_row(k, v)
        with open(os.devnull, "w") as sink:
            console = Console(width=width, record=True, file=sink)
            console.print(t)
            return console.export_text()

    def __repr__(self) -> str:
        return f"Plan({self.data['model']['name']!r}, {self.strategy}, step {self.predicted['step_time_s']:.4g} s)"


def _check_shard(what: str, place: str, shape: tuple[int, ...], sizes: tuple[int, ...]) -> None:
    """A placement on the tensor axes of ``sizes`` (one for 1d, a mesh's
    several) names one placement per axis, and each ``S(d)`` a dim of
    ``shape`` that the axes splitting it divide (``S(d,k)``: ``k`` blocks of it)."""
    parts = place.split(SEP)
    if len(parts) != len(sizes):
        raise PlanError(f"{what}: placement {place} names {len(parts)} tensor axes, but the plan's tp group has "
                        f"{len(sizes)} ({'x'.join(map(str, sizes))})")
    names = ("tp",) if len(sizes) == 1 else (("tp_depth",) if len(sizes) == 3 else ()) + ("tp_row", "tp")
    split: dict[int, list[str]] = {}      # dim -> the factors splitting it
    for part, n, axis in zip(parts, sizes, names):
        if not part.startswith("S("):
            continue
        d, k = shard_dim(part), shard_blocks(part)
        if d >= len(shape):
            raise PlanError(f"{what}: placement {place} splits dim {d}, but the tensor has {len(shape)} dims "
                            f"(shape {tuple(shape)})")
        split.setdefault(d, [f"{k} blocks"] if k > 1 else []).append(f"{axis}={n}")
    for d, factors in split.items():
        total = 1
        for f in factors:
            total *= int(f.split("=")[-1]) if "=" in f else int(f.split()[0])
        if total > 1 and shape[d] % total:
            raise PlanError(f"{what}: placement {place} splits dim {d} of size {shape[d]}, which "
                            f"{' x '.join(factors)} does not divide")


def _check_consistent(d: dict[str, Any], where: str) -> None:
    """The parts of a plan that restate each other must agree: ``parallel``
    is a valid strategy, the mesh has its axes and sizes, ``devices`` is the
    mesh's size."""
    try:
        cfg = ParallelConfig.from_dict({**d["parallel"], "precision": d["parallel"].get("precision") or "fp32"})
    except (ValueError, TypeError, KeyError) as e:
        raise PlanError(f"{where}: its 'parallel' section is not a valid strategy: {e}") from None
    sizes = {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}
    axes, shape = d["mesh"]["axes"], d["mesh"]["shape"]
    if len(axes) != len(shape) or len(set(axes)) != len(axes) or not set(axes) <= set(sizes):
        raise PlanError(f"{where}: mesh axes {axes} with shape {shape} are malformed (axes among pp, dp, cp, tp, "
                        "one size each)")
    mesh = dict(zip(axes, shape))
    for axis, n in sizes.items():
        if mesh.get(axis, 1) != n:
            raise PlanError(f"{where}: the mesh gives {axis}={mesh.get(axis, 1)} but 'parallel' says {axis}={n}; "
                            "the plan was edited inconsistently: make a new one with autopar.plan(...)")
    total = 1
    for n in shape:
        total *= n
    if d["devices"] != total:
        raise PlanError(f"{where}: 'devices' is {d['devices']} but the mesh {dict(zip(axes, shape))} has {total}")


# -- diff ---------------------------------------------------------------------------------------------------
def _changed(x: dict[str, Any], y: dict[str, Any]) -> dict[str, list]:
    """``{key: [x's value, y's value]}`` for each key whose values differ (None: absent)."""
    return {k: [x.get(k), y.get(k)] for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}


def _pattern(key: str, groups: dict[str, str]) -> str:
    """``key`` with its repeated-layer instance replaced by the group's name
    (``model.blocks.7.attn.q.weight`` -> ``model.blocks.*.attn.q.weight``);
    ``groups`` maps instances to group names. A plan without groups (version
    1) has every number in a dotted path replaced."""
    if not groups:
        return re.sub(r"(?<=\.)\d+(?=[.:]|$)", "*", key)
    inst = _owner(key, set(groups))
    return key if inst is None else _absolute(groups[inst], _relative(key, inst))


def _placement_changes(p: "Plan", q: "Plan", section: str) -> dict[str, Any]:
    """The entries of ``section`` (params or ops) that differ between ``p``
    and ``q``: how many of how many, and per template (pattern, from, to) the
    number of tensors or ops changed that way, most first."""
    x, y = p.data[section], q.data[section]
    groups = {i: g["name"] for d in (p.data, q.data) for g in d.get("layers") or [] for i in g["instances"]}
    keys = sorted(set(x) | set(y))
    changes: dict[tuple[str, str, str], dict[str, Any]] = {}
    for k in keys:
        if x.get(k) == y.get(k):
            continue
        pat = _pattern(k, groups)
        c = changes.setdefault((pat, _dumps(x.get(k)), _dumps(y.get(k))),
                               {"pattern": pat, "from": x.get(k), "to": y.get(k), "count": 0})
        c["count"] += 1
    templates = sorted(changes.values(), key=lambda c: (-c["count"], c["pattern"]))
    return {"changed": sum(c["count"] for c in templates), "of": len(keys), "templates": templates}


_PREDICTIONS = ("step_time_s", "compute_time_s", "tp_comm_time_s", "dp_comm_time_s", "cp_comm_time_s",
                "optimizer_time_s", "tflops_per_device", "peak_memory_bytes", "host_memory_bytes", "fits")


def _prediction_changes(x: dict[str, Any], y: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each prediction that differs (the memory per device by part as
    ``memory.<part>``): ``from``, ``to``, and for numbers the signed
    ``delta`` and the ``relative`` change (None from zero)."""
    flat = [{**{k: d.get(k) for k in _PREDICTIONS},
             **{f"memory.{k}": v for k, v in (d.get("memory") or {}).items()}} for d in (x, y)]
    out = {}
    for k in [*_PREDICTIONS, *sorted(set(flat[0]) | set(flat[1]) - set(_PREDICTIONS))]:
        u, v = flat[0].get(k), flat[1].get(k)
        if u == v:
            continue
        ch: dict[str, Any] = {"from": u, "to": v}
        if all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in (u, v)):
            ch["delta"] = rounded(v - u)
            ch["relative"] = rounded((v - u) / u) if u else None
        out[k] = ch
    return out
