"""Strategies: :class:`ParallelConfig`, its keys, and the grammar that reads them.

Every strategy key is described once, as the metadata of its
:class:`ParallelConfig` field (a :class:`Key`: type, default, allowed values,
aliases, documentation). The canonical string (:meth:`ParallelConfig.to_string`),
the dict form (:meth:`~ParallelConfig.as_dict` / :meth:`~ParallelConfig.from_dict`),
the grammar's key and alias tables and the ``parallel`` section of the plan's
JSON schema (:func:`json_schema`) are all generated from these descriptions,
so a new key is one new field here (plus its rules in :func:`parse_strategy`
when it constrains other keys).

Grammar (whitespace ignored, keys case-insensitive, in any order, each at most
once)::

    strategy := item ("," item)*
    item     := key "=" value

with the keys of :data:`KEYS` (``describe()`` prints each with its values and
meaning) and the Colossal-AI / MindFormers / Megatron spellings of
:data:`ALIASES`. ``accumulate`` is a key without a field of its own: gradient
accumulation without a pipeline, stored as ``microbatches``.

Defaults that depend on other keys: ``dp`` is what the devices leave after
``tp`` and ``pp``; ``microbatches`` is ``pp``; ``schedule`` is ``1f1b`` with
``pp > 1``; ``chunks`` is 2 for ``schedule=interleaved``. The seeds' pipeline
rules are enforced (:func:`check_schedule`): MindFormers' ``micro_batch_num >=
pipeline_stage``, and for the interleaved schedule Colossal-AI's microbatches
as a multiple of the stages.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import StrategyError

RECOMPUTE = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
TP_MODES = ("1d", "2d", "2.5d", "3d", "mesh", "mesh3")
MESH_MODES = ("mesh", "mesh3")     # the tp group as a mesh whose placements one program decides
GRID_MODES = ("2d", "2.5d", "3d")     # the layouts written out: their rows split the batch
ZERO_STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOAD = ("none", "optimizer")
BUCKET_MB = 25.0
ACCUMULATE = "accumulate"
ACCUMULATE_ALIASES = ("gradient_accumulation_steps", "accumulate_grad_batches")
_BOOL = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


@dataclass(frozen=True)
class Key:
    """The description of one strategy key; everything else about the key is derived from it.

    ``name`` and ``type`` are filled in from the :class:`ParallelConfig` field
    that carries the key (the type is the default's). ``minimum`` bounds
    numbers (``>=`` for integers, ``>`` for floats); ``choices`` lists the
    allowed values besides the default; ``value_aliases`` maps other spellings
    of a value onto it; ``shown`` says when :meth:`ParallelConfig.to_string`
    writes the key (``"always"`` or only when ``"changed"`` from its default),
    ``pipeline`` that it is written only with ``pp > 1``; ``required`` that
    every plan records it (keys added after the first plans are optional there);
    ``recorded="changed"`` that :meth:`ParallelConfig.as_dict` leaves it out at its
    default (so plans made before the key existed stay byte-identical).
    """

    default: Any
    doc: str
    aliases: tuple[str, ...] = ()
    choices: tuple = ()
    minimum: float | None = None
    value_aliases: tuple[tuple[str, str], ...] = ()
    shown: str = "changed"
    pipeline: bool = False
    required: bool = False
    recorded: str = "always"       # "changed": as_dict (the plan) records it only away from its default
    unit: str = ""
    valid_label: str = "valid"     # the words before the list of choices in an error
    name: str = ""
    type: type = object

    # -- reading values ------------------------------------------------------
    def parse(self, text: str) -> Any:
        """The value of the strategy text ``text`` (case-insensitive).

        Raises :class:`StrategyError` naming the key, the text and what would be valid."""
        if self.type is bool:
            try:
                return _BOOL[text.lower()]
            except KeyError:
                raise StrategyError(f"strategy key {self.name!r} needs true or false, got {text!r}") from None
        if self.type is int:
            try:
                value = int(text)
            except ValueError:
                raise StrategyError(f"strategy key {self.name!r} needs an integer, got {text!r}") from None
            return self.check(value)
        if self.type is float:
            try:
                value = float(text)
            except ValueError:
                raise StrategyError(f"{self.name} needs {self._number()}, got {text!r}") from None
            return self.check(value)
        return self.check(text.lower())

    def check(self, value: Any) -> Any:
        """``value`` checked against the key's type, bounds and choices, in its canonical form
        (value aliases resolved, integral floats as ints, ints as floats for float keys).

        Raises :class:`StrategyError` naming the key, the value and what would be valid."""
        if self.type is bool:
            if not isinstance(value, bool):
                raise StrategyError(f"strategy key {self.name!r} needs true or false, got {value!r}")
            return value
        if self.type is int:
            if isinstance(value, float) and value.is_integer():
                value = int(value)      # JSON integers may arrive as 2.0 (the schema allows it)
            if isinstance(value, bool) or not isinstance(value, int):
                raise StrategyError(f"strategy key {self.name!r} needs an integer, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                raise StrategyError(f"strategy key {self.name!r} must be >= {self.minimum}, got {value}")
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StrategyError(f"{self.name} needs {self._number()}, got {value!r}")
            value = float(value)
            if self.minimum is not None and not value > self.minimum:   # `not >`: NaN is refused too
                raise StrategyError(f"{self.name} must be > {self.minimum:g}, got {value:g}")
        elif isinstance(value, str):
            value = dict(self.value_aliases).get(value, value)
        elif not self.choices:
            raise StrategyError(f"strategy key {self.name!r} needs a string, got {value!r}")
        if self.choices and value != self.default and value not in self.choices:
            hint = "".join(f" ({a} = {v})" for a, v in self.value_aliases)
            raise StrategyError(f"{self.name}={value!r} is invalid; {self.valid_label}: "
                                f"{', '.join(map(str, self.choices))}{hint}")
        return value

    def _number(self) -> str:
        return f"a number of {self.unit}" if self.unit else "a number"

    # -- writing values ------------------------------------------------------
    def format(self, value: Any) -> str:
        """``value`` as the strategy grammar spells it."""
        if self.type is bool:
            return "true" if value else "false"
        if self.type is float:
            return f"{value:g}"
        return str(value)

    def schema(self) -> dict[str, Any]:
        """The JSON-schema property of this key in a plan's ``parallel`` section."""
        if self.type is bool:
            return {"type": "boolean"}
        if self.choices:
            return {"enum": ([] if self.default in self.choices else [self.default]) + list(self.choices)}
        bound = {} if self.minimum is None else \
            {"minimum" if self.type is int else "exclusiveMinimum": self.minimum}
        if self.type is int:
            return {"type": "integer", **bound}
        if self.type is float:
            return {"type": "number", **bound}
        return {"type": "string"}


def _key(default: Any, doc: str, **kw: Any) -> Any:
    """A :class:`ParallelConfig` field whose metadata is its :class:`Key`."""
    return dataclasses.field(default=default, metadata={"key": Key(default, doc, **kw)})


@dataclass(frozen=True)
class ParallelConfig:
    """A complete strategy: every key resolved. Fields are in the canonical string's order."""

    dp: int = _key(1, "data-parallel degree", minimum=1, required=True, shown="always",
                   aliases=("data_parallel", "data"))
    tp: int = _key(1, "tensor-parallel degree", minimum=1, required=True, shown="always",
                   aliases=("model_parallel", "tensor", "tensor_parallel"))
    tp_mode: str = _key(
        "1d", "how the tp group is laid out: 1d (Megatron: one axis of tp ranks), 2d (Colossal-AI's SUMMA: a "
              "q x q grid, tp = q^2; the batch split over its rows, the hidden dims over its columns, every "
              "weight over both), 2.5d (tp_depth grids of q x q, tp = depth x q^2), 3d (a q x q x q cube, "
              "tp = q^3; the batch split over its depth and rows, the hidden dims over its columns, every weight "
              "over all three), mesh (the tp group as a two-axis a x b mesh, a the largest divisor of tp up to "
              "its square root, whose per-op placements on both axes one ILP decides together), mesh3 (the same "
              "on three axes, a x b x c as near a cube as tp allows)",
        choices=TP_MODES, recorded="changed", aliases=("tensor_mode", "tensor_parallel_mode"))
    tp_depth: int = _key(1, "depth of tp_mode=2.5d: the number of q x q grids (tp = tp_depth x q^2)", minimum=1,
                         recorded="changed", aliases=("tensor_depth",))
    pp: int = _key(1, "pipeline stages", minimum=1, required=True, shown="always",
                   aliases=("pipeline_stage", "pipeline", "pipeline_parallel"))
    cp: int = _key(1, "context-parallel degree: the sequence split over cp ranks (load-balanced causal chunks), "
                      "attention over all-gathered keys and values, parameters replicated and their gradients "
                      "reduced over dp x cp", minimum=1, recorded="changed",
                   aliases=("context_parallel", "sequence"))
    microbatches: int = _key(
        1, "microbatches per optimizer step: gradient accumulation without a pipeline, the pipeline's "
           "microbatches with one", minimum=1, required=True, shown="always",
        aliases=("micro_batch_num", "micro_batches", "grad_accum", "num_microbatches"))
    schedule: str = _key(
        "none", "pipeline schedule: none without a pipeline; gpipe, 1f1b or interleaved with pp > 1",
        choices=PIPELINE_SCHEDULES, required=True, shown="always", pipeline=True, aliases=("pipeline_schedule",))
    chunks: int = _key(
        1, "model chunks per pipeline rank (virtual stages), for schedule=interleaved only", minimum=1,
        pipeline=True, aliases=("num_model_chunks", "vpp", "virtual_pipeline_stages"))
    copies: int = _key(
        1, "multi-copy parallel (MindSpore's micro_batch_interleave_num): each microbatch split into this many "
           "copies inside one step, one copy's tensor-parallel collectives running while the other copy computes; "
           "the per-rank microbatch must divide by it; needs tp > 1", minimum=1, recorded="changed",
        aliases=("micro_batch_interleave_num", "multi_copy", "interleave_num"))
    recompute: str = _key(
        "none", "none | full (every repeated layer keeps only its input and runs again in backward) | selective "
                "(matmul outputs kept; norms, activations, softmax, dropout recomputed)",
        choices=RECOMPUTE, required=True, shown="always", aliases=("recompute_granularity",))
    zero: int = _key(
        0, "ZeRO stage: optimizer state (1), plus gradients (2), plus weights (3) sharded over dp "
           "(MindSpore's optimizer parallel)", minimum=0, choices=ZERO_STAGES, required=True, shown="always",
        valid_label="valid stages", aliases=("zero_stage",))
    fsdp_layers: int = _key(
        0, "the first N repeated layers sharded over dp as FSDP2 units (ZeRO-3: weights, gradients and optimizer "
           "state), the rest of the model under the zero stage given (0-2): a per-layer choice between ZeRO-3 "
           "and ZeRO-1/2 on the dp axis; 0: none", minimum=0, recorded="changed",
        aliases=("zero3_layers", "fsdp_units"))
    sequence_parallel: bool = _key(
        False, "Megatron sequence parallelism inside the tensor-parallel group (norms, dropout and residual adds "
               "split along the sequence); needs tp > 1",
        aliases=("use_seq_parallel", "seq_parallel", "sp", "enable_sequence_parallelism"))
    offload: str = _key(
        "none", "none | optimizer (fp32 master weights and optimizer state in host memory, the step on the host)",
        choices=OFFLOAD, aliases=("optimizer_offload",))
    precision: str = _key(
        "", "weights and compute: fp32, bf16 or fp16 (fp32 master weights, fp16 with dynamic loss scaling); "
            "empty: the plan's precision (the cluster's default)",
        choices=PRECISIONS, value_aliases=(("mixed", "bf16"),), aliases=("dtype",))
    reduce_dtype: str = _key(
        "", "the dtype gradients are accumulated and reduced in under bf16/fp16; empty: fp32 under bf16/fp16, "
            "the weights' dtype under fp32", choices=PRECISIONS, aliases=("grad_reduce_dtype",))
    overlap: bool = _key(True, "reduce gradients bucket by bucket during backward (true) or all after it",
                         aliases=("overlap_grad_reduce",))
    bucket_mb: float = _key(
        BUCKET_MB, "gradient bucket size (communication fusion, MindFormers' gradient_aggregation_group)",
        minimum=0.0, unit="MiB", aliases=("bucket_size_mb",))

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def low_precision(self) -> bool:
        return self.precision in ("bf16", "fp16")

    @functools.cached_property
    def tp_grid(self) -> tuple[int, ...]:
        """The shape of the tp group's sub-mesh, outermost first: ``(tp,)`` for
        1d, ``(q, q)`` for 2d (rows: the batch; columns: the hidden dims),
        ``(depth, q, q)`` for 2.5d, ``(q, q, q)`` for 3d (computed once: the
        cost model asks per parameter)."""
        return tp_grid(self.tp, self.tp_mode, self.tp_depth)

    @property
    def is_grid(self) -> bool:
        """Whether the tp group is one of the layouts written out (2d, 2.5d,
        3d), whose rows (and depth) split the batch."""
        return self.tp_mode in GRID_MODES

    @property
    def grid_batch_split(self) -> int:
        """The tp ranks that split a microbatch's samples: 1 for 1d (and for
        a mesh, whose program splits what it decides), the rows of a 2d grid,
        depth x rows for 2.5d (every grid axis but the columns)."""
        if not self.is_grid:
            return 1
        k = 1
        for n in self.tp_grid[:-1]:
            k *= n
        return k

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: ``pp x chunks``."""
        return self.pp * self.chunks

    @property
    def executable(self) -> bool:
        """Whether this release can run it (not only evaluate it): every
        strategy the grammar accepts."""
        return True

    def to_string(self) -> str:
        """Canonical strategy string (round-trips through :func:`parse_strategy`):
        the degrees, microbatches, recompute and zero always, the pipeline keys
        with ``pp > 1``, the other options when not at their default."""
        items = []
        for k in FIELDS:
            value = getattr(self, k.name)
            if k.pipeline and self.pp == 1:
                continue
            if k.shown == "always" or value != k.default:
                items.append(f"{k.name}={k.format(value)}")
        return ",".join(items)

    def as_dict(self) -> dict[str, Any]:
        """Every key with its value (the plan's ``parallel`` section); a key
        recorded only when changed (``cp``) is left out at its default."""
        # the values are scalars: no deep copy (dataclasses.asdict) needed; the search
        # records one per configuration it prices
        return {k.name: v for k in FIELDS
                if (v := getattr(self, k.name)) != k.default or k.recorded != "changed"}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParallelConfig:
        """The config of ``d`` (as :meth:`as_dict` writes it; missing keys take their defaults).

        Each value is checked on its own (type, bounds, choices; value aliases
        such as ``precision="mixed"`` resolved), not the combination rules of
        :func:`parse_strategy`: a plan records a resolved config (its precision
        filled in) that the grammar would read differently. Raises
        :class:`StrategyError` for an unknown key or an invalid value."""
        unknown = sorted(k for k in d if k not in _BY_NAME)
        if unknown:
            raise StrategyError(f"unknown strategy key {unknown[0]!r}; valid keys: {', '.join(_BY_NAME)}")
        return cls(**{k: _BY_NAME[k].check(v) for k, v in d.items()})


FIELDS: tuple[Key, ...] = tuple(dataclasses.replace(f.metadata["key"], name=f.name, type=type(f.default))
                                for f in dataclasses.fields(ParallelConfig))
_BY_NAME = {k.name: k for k in FIELDS}
KEYS: tuple[str, ...] = tuple(n for k in FIELDS for n in ((k.name, ACCUMULATE) if k.name == "microbatches"
                                                            else (k.name,)))
ALIASES: dict[str, str] = {**{a: k.name for k in FIELDS for a in k.aliases},
                           **{a: ACCUMULATE for a in ACCUMULATE_ALIASES}}


def key(name: str) -> Key:
    """The description of strategy key ``name``. Raises :class:`StrategyError` for an unknown one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise StrategyError(f"unknown strategy key {name!r}; valid keys: {', '.join(_BY_NAME)}") from None


def json_schema() -> dict[str, Any]:
    """The JSON schema of a plan's ``parallel`` section (a :meth:`ParallelConfig.as_dict`)."""
    return {"type": "object", "additionalProperties": False,
            "required": [k.name for k in FIELDS if k.required],
            "properties": {k.name: k.schema() for k in FIELDS}}


def describe() -> str:
    """One line per strategy key: its name, aliases, default and meaning (for help texts)."""
    lines = []
    for k in FIELDS:
        also = f" (also {', '.join(k.aliases)})" if k.aliases else ""
        choices = f" [{' | '.join(map(str, k.choices))}]" if k.choices else ""
        unit = f" {k.unit}" if k.unit else ""
        lines.append(f"{k.name}{also}{choices}, default {k.format(k.default) or 'unset'}{unit}: {k.doc}")
    lines.append(f"{ACCUMULATE} (also {', '.join(ACCUMULATE_ALIASES)}): microbatches without a pipeline")
    return "\n".join(lines)


# ------------------------------------------------------------------ the grammar
def parse_strategy(text: str, devices: int | None = None) -> ParallelConfig:
    """Parse ``"dp=2,tp=4"`` into a :class:`ParallelConfig`.

    With ``devices``, a missing ``dp`` is inferred and the product of the
    degrees must equal it. Raises :class:`StrategyError` saying what is wrong
    and what would be valid.
    """
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise StrategyError(f"devices must be a positive integer, got {devices!r}")
    given = _items(text)
    accumulate = ACCUMULATE in given
    if accumulate:
        if "microbatches" in given:
            raise StrategyError("give either accumulate= or microbatches=, not both (without a pipeline they "
                                "are the same: gradient accumulation over that many microbatches)")
        given["microbatches"] = given.pop(ACCUMULATE)
    schedule = given.pop("schedule", None)          # valid values depend on pp: read by _pipeline
    vals = {k.name: k.parse(given[k.name]) for k in FIELDS if k.name in given}
    tp, pp, cp = vals.setdefault("tp", 1), vals.setdefault("pp", 1), vals.get("cp", 1)
    if "dp" not in vals:
        if devices is not None and devices % (tp * pp * cp):
            what, names = (f"tp={tp} x pp={pp}", "tp x pp") if cp == 1 else \
                (f"tp={tp} x pp={pp} x cp={cp}", "tp x pp x cp")
            raise StrategyError(f"{what} does not divide {devices} devices; "
                                f"{names} must be one of {', '.join(map(str, divisors(devices)))}")
        vals["dp"] = 1 if devices is None else devices // (tp * pp * cp)
    if accumulate and pp > 1:
        raise StrategyError(f"accumulate= is gradient accumulation without a pipeline; with pp={pp} the "
                            "pipeline's microbatches= already accumulate the gradients of the whole batch")
    vals.setdefault("microbatches", pp)
    vals["schedule"], vals["chunks"] = _pipeline(pp, vals["microbatches"], schedule, vals.get("chunks"))
    _check_rules(vals)
    cfg = ParallelConfig(**vals)
    if devices is not None and cfg.devices != devices:
        cps = f" x cp={cp}" if cp > 1 else ""
        raise StrategyError(f"dp={cfg.dp} x tp={tp} x pp={pp}{cps} = {cfg.devices} devices, but the world has "
                            f"{devices}; the product of the degrees must equal the number of devices")
    return cfg


def _items(text: str) -> dict[str, str]:
    """The ``key=value`` items of ``text``: aliases resolved, keys lower-case, values as written."""
    if not isinstance(text, str) or not text.strip():
        raise StrategyError(f"empty strategy; expected e.g. 'dp=2,tp=4' with keys {', '.join(KEYS)}")
    given: dict[str, str] = {}
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        if "=" not in item:
            raise StrategyError(f"strategy item {item!r} is not key=value; valid keys: {', '.join(KEYS)}")
        k, v = item.split("=", 1)
        k = ALIASES.get(k.lower(), k.lower())
        if k not in KEYS:
            raise StrategyError(f"unknown strategy key {k!r}; valid keys: {', '.join(KEYS)} "
                                f"(aliases: {', '.join(sorted(ALIASES))})")
        if k in given:
            raise StrategyError(f"strategy key {k!r} given twice")
        given[k] = v
    return given


def _check_rules(vals: dict[str, Any]) -> None:
    """The rules between keys (``vals`` holds the given ones and the inferred
    degrees); raises :class:`StrategyError` naming the clash and a way out."""
    pp, zero = vals["pp"], vals.get("zero", 0)
    if pp > 1 and zero > 1:
        raise StrategyError(f"zero={zero} with pp={pp}: ZeRO stages 2 and 3 shard gradients and weights that every "
                            "pipeline microbatch would reduce or gather again (DeepSpeed refuses the combination "
                            "too); with a pipeline use zero=0 or zero=1")
    if vals.get("sequence_parallel") and vals["tp"] == 1:
        raise StrategyError("sequence_parallel=true splits the norm and dropout regions along the sequence inside "
                            "the tensor-parallel group: it needs tp > 1")
    _check_copies(vals)
    _check_fsdp_layers(vals)
    tp_grid(vals["tp"], vals.get("tp_mode", "1d"), vals.get("tp_depth", 1))
    reduce_dtype = vals.get("reduce_dtype", "")
    if reduce_dtype and reduce_dtype != "fp32" and vals.get("precision") == "fp32":
        raise StrategyError(f"reduce_dtype={reduce_dtype} with precision=fp32: gradients are never reduced in a "
                            "lower precision than the weights; use precision=bf16 or fp16")


def _check_copies(vals: dict[str, Any]) -> None:
    """The rules of ``copies`` (multi-copy parallel): it hides tensor-parallel
    collectives, so it needs tp > 1 (with tp = 1 it would only make the
    GEMMs smaller); it runs without a pipeline or context parallelism, and
    not under ZeRO-3 (FSDP2's hooks around the copies' interleaved layers)."""
    copies = vals.get("copies", 1)
    if copies == 1:
        return
    if vals["tp"] == 1:
        raise StrategyError(f"copies={copies} overlaps one copy's tensor-parallel collectives with the other "
                            "copy's compute: it needs tp > 1 (with tp=1 there is nothing to overlap and the "
                            "smaller matmuls only cost time); use microbatches= to split the batch instead")
    for name, why in (("pp", "a pipeline"), ("cp", "context parallelism")):
        if vals.get(name, 1) > 1:
            raise StrategyError(f"copies={copies} with {name}={vals[name]}: multi-copy parallel is not "
                                f"implemented with {why} yet; use {name}=1 or copies=1")
    if vals.get("zero", 0) == 3:
        raise StrategyError(f"copies={copies} with zero=3: multi-copy parallel is not implemented under FSDP2 "
                            "yet; use zero<=2 or copies=1")


def check_fsdp_layers(cfg: ParallelConfig) -> None:
    """The rules of ``fsdp_layers`` for a configuration built without the
    parser (the search's): :class:`StrategyError` where it breaks one."""
    if cfg.fsdp_layers:
        _check_fsdp_layers(cfg.as_dict())


def _check_fsdp_layers(vals: dict[str, Any]) -> None:
    """The rules of ``fsdp_layers`` (some layers under ZeRO-3, the rest
    under ``zero``): as ZeRO-3 itself, no pipeline and no fp16; the layers
    not sharded need a ZeRO stage below 3 to be under; on the 1d tp axis
    (and dp > 1, or nothing is sharded)."""
    n = vals.get("fsdp_layers", 0)
    if not n:
        return
    zero = vals.get("zero", 0)
    if zero == 3:
        raise StrategyError(f"fsdp_layers={n} with zero=3: zero=3 already shards every layer; give the stage "
                            "the other layers run under (zero=0, 1 or 2) with fsdp_layers, or drop fsdp_layers")
    clashes = [("pp", vals["pp"] > 1, "a pipeline (ZeRO-3 gathers every microbatch's weights again)"),
               ("precision", vals.get("precision") == "fp16", "fp16 (FSDP2 has no dynamic loss scaling here)"),
               ("copies", vals.get("copies", 1) > 1, "multi-copy parallel"),
               ("offload", vals.get("offload", "none") != "none", "the optimizer state on the host"),
               ("tp_mode", vals.get("tp_mode", "1d") != "1d", "a tp group laid out as a grid or mesh"),
               ("dp", vals["dp"] * vals.get("cp", 1) == 1, "one data-parallel rank (nothing to shard over)")]
    for key, bad, why in clashes:
        if bad:
            raise StrategyError(f"fsdp_layers={n} with {key}={vals.get(key)}: layers under ZeRO-3 are not "
                                f"implemented with {why}; use fsdp_layers=0")


ZERO_SHARDS = {1: "optimizer state", 2: "gradients and optimizer state", 3: "weights, gradients and optimizer state"}


def zero_words(parallel: dict[str, Any]) -> str:
    """What a plan's ``parallel`` section shards over dp besides the tp
    placements, in words ("" for none): the ZeRO stage's states of every
    parameter, and with ``fsdp_layers`` the first layers' weights too."""
    zero, dp, layers = parallel.get("zero", 0), parallel.get("dp", 1), parallel.get("fsdp_layers", 0)
    if dp * parallel.get("cp", 1) == 1 or not (zero or layers):
        return ""
    words = f"ZeRO-{zero} shards the {ZERO_SHARDS[zero]} over dp={dp}" if zero else ""
    if layers:
        words += ("; " if words else "") + f"the first {layers} layers are under ZeRO-3 (FSDP2: their " \
                 f"{ZERO_SHARDS[3]} sharded over dp={dp})"
    return words


def int_root(n: int, k: int) -> int | None:
    """The integer ``q`` with ``q ** k == n``, or None."""
    q = round(n ** (1.0 / k))
    return next((r for r in (q - 1, q, q + 1) if r >= 1 and r ** k == n), None)


def tp_grid(tp: int, mode: str, depth: int = 1) -> tuple[int, ...]:
    """The sub-mesh of ``tp`` ranks under ``mode`` (see :attr:`ParallelConfig.tp_grid`).

    Raises :class:`StrategyError` when ``tp`` does not make that shape (2d: a
    square, 2.5d: ``depth x q^2``, 3d: a cube), naming the sizes that would."""
    if mode == "1d":
        if depth != 1:
            raise StrategyError(f"tp_depth={depth} is for tp_mode=2.5d only (tp_mode={mode})")
        return (tp,)
    if tp == 1:
        raise StrategyError(f"tp_mode={mode} lays the tensor-parallel group out as a grid: it needs tp > 1 "
                            f"(e.g. tp={ {'2d': 4, '2.5d': 8, '3d': 8}.get(mode, 4)})")
    if mode == "mesh" and depth == 1:
        a = max(d for d in range(1, int_root_floor(tp, 2) + 1) if tp % d == 0)
        if a == 1:
            raise StrategyError(f"tp={tp} with tp_mode=mesh: a prime tp makes no two-axis mesh; e.g. tp=4, 6 or 8")
        return (a, tp // a)
    if mode == "mesh3" and depth == 1:
        a = max(d for d in range(1, int_root_floor(tp, 3) + 1) if tp % d == 0)
        rest = tp // a
        b = max(d for d in range(1, int_root_floor(rest, 2) + 1) if rest % d == 0)
        if a == 1 or b == 1:
            raise StrategyError(f"tp={tp} with tp_mode=mesh3: three axes need tp a product of three factors > 1; "
                                f"e.g. tp=8, 12 or 16")
        return (a, b, rest // b)
    if mode == "2d" and depth == 1:
        q = int_root(tp, 2)
        if q is None:
            raise StrategyError(f"tp={tp} with tp_mode=2d must be a square (a q x q grid, Colossal-AI's rule): "
                                f"e.g. tp={int_root_floor(tp, 2) ** 2} or {(int_root_floor(tp, 2) + 1) ** 2}")
        return (q, q)
    if mode == "2.5d":
        if depth < 2:
            raise StrategyError(f"tp_mode=2.5d needs tp_depth >= 2 (tp = tp_depth x q^2; depth 1 is tp_mode=2d), "
                                f"e.g. tp={tp},tp_mode=2.5d,tp_depth=2")
        q = int_root(tp // depth, 2) if tp % depth == 0 else None
        if q is None:
            raise StrategyError(f"tp={tp} with tp_mode=2.5d, tp_depth={depth} must be tp_depth x q^2 (depth grids "
                                f"of q x q): e.g. tp={depth * 4} or {depth * 9}")
        return (depth, q, q)
    if mode == "3d" and depth == 1:
        q = int_root(tp, 3)
        if q is None:
            raise StrategyError(f"tp={tp} with tp_mode=3d must be a cube (a q x q x q grid, Colossal-AI's rule): "
                                f"e.g. tp=8 or 27")
        return (q, q, q)
    raise StrategyError(f"tp_depth={depth} is for tp_mode=2.5d only (tp_mode={mode})")


def check_grid(cfg: ParallelConfig, global_batch: int) -> None:
    """The rules of a tensor-parallel grid (``tp_mode`` other than 1d): a
    mesh runs with whatever a 1d group runs with; 2d, 2.5d and 3d need the
    samples of a copy of a microbatch on a data-parallel rank divisible by
    the ranks that split them (the rows, times the depth of 2.5d and 3d:
    :attr:`ParallelConfig.grid_batch_split`)."""
    if cfg.tp_mode == "1d":
        return
    mode = cfg.tp_mode
    if mode in MESH_MODES:
        return
    rows = cfg.grid_batch_split
    per = global_batch // max(cfg.dp * cfg.microbatches * cfg.copies, 1)
    if per % rows:
        who = "rows" if mode == "2d" else "depth x rows"    # 3d: the cube's depth and rows
        raise StrategyError(f"tp_mode={mode} splits each microbatch's {per} samples on a data-parallel rank over "
                            f"the grid's {rows} {who}: they must be divisible by {rows} (global batch "
                            f"{global_batch} / (dp={cfg.dp} x microbatches={cfg.microbatches}"
                            + (f" x copies={cfg.copies}" if cfg.copies > 1 else "") + "))")


def int_root_floor(n: int, k: int) -> int:
    """The largest ``q`` with ``q ** k <= n``."""
    q = max(1, round(n ** (1.0 / k)))
    while q ** k > n:
        q -= 1
    while (q + 1) ** k <= n:
        q += 1
    return q


def _pipeline(pp: int, microbatches: int, schedule: str | None, chunks: int | None) -> tuple[str, int]:
    """The schedule and chunks of a strategy (``None``: not given), checked against the seeds' rules."""
    schedule = (schedule if schedule is not None else "1f1b" if pp > 1 else "none").lower()
    if pp == 1:
        if schedule != "none":
            raise StrategyError(f"schedule={schedule} needs a pipeline (pp > 1); with pp=1 leave it out")
        if chunks is not None and chunks != 1:
            raise StrategyError("chunks > 1 needs a pipeline (pp > 1) with schedule=interleaved")
        return "none", 1
    if schedule not in PIPELINE_SCHEDULES:
        raise StrategyError(f"schedule {schedule!r} is invalid with pp={pp}; valid: {', '.join(PIPELINE_SCHEDULES)}")
    if chunks is None:
        chunks = 2 if schedule == "interleaved" else 1
    check_schedule(schedule, pp, microbatches, chunks)
    return schedule, chunks


def check_schedule(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> None:
    """Raise :class:`StrategyError` unless ``schedule`` can run ``microbatches`` over ``pp`` ranks
    with ``chunks`` model chunks each.

    The message names the offending value and what would be valid.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise StrategyError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(PIPELINE_SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise StrategyError(f"{name}={value!r} is invalid; it must be an integer >= 1")
    if pp > 1 and microbatches < pp:
        raise StrategyError(
            f"microbatches={microbatches} < pp={pp}: every pipeline stage needs a microbatch to work on "
            f"(MindFormers' rule micro_batch_num >= pipeline_stage); use microbatches >= {pp}")
    if schedule == "interleaved":
        if chunks < 2:
            raise StrategyError(
                f"schedule=interleaved needs chunks >= 2 model chunks per rank, got chunks={chunks}; "
                f"use chunks >= 2, or schedule=1f1b for one chunk per rank")
        if microbatches % pp:
            lower, upper = microbatches // pp * pp, (microbatches // pp + 1) * pp
            raise StrategyError(
                f"schedule=interleaved needs microbatches to be a multiple of pp (Megatron's and "
                f"Colossal-AI's rule for interleaved schedules), got microbatches={microbatches}, pp={pp}; "
                f"use microbatches={lower} or {upper}")
    elif chunks != 1:
        raise StrategyError(
            f"chunks={chunks} > 1 needs schedule=interleaved; schedule={schedule} runs one model chunk "
            f"per rank (chunks=1)")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
