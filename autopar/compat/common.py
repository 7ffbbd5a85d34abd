"""What the three config formats share: the result types, the source of an
export, field checks that name the field, and the strategy built from the
fields through autopar's own grammar (so every rule of
:func:`autopar.spec.parse_strategy` applies to an imported config too)."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..errors import ConfigError, StrategyError, UnsupportedError
from ..plan import Plan
from ..spec import FIELDS, ParallelConfig, divisors, parse_strategy

Source = Union[Plan, ParallelConfig, str]
# context parallelism is a strategy key (cp) only in newer trees: read where it is one, refused where not
CP = any(k.name == "cp" for k in FIELDS)


@dataclass(frozen=True)
class Imported:
    """A strategy read from another framework's config.

    ``config`` is the strategy, or ``None`` when the config asks for a search
    (MindFormers' ``parallel_mode: 2``); ``search_mode`` is the search mode
    it names, if any; ``notes`` say what was read approximately or not at all."""

    config: ParallelConfig | None
    notes: tuple[str, ...] = ()
    search_mode: str | None = None

    @property
    def strategy(self) -> str:
        """The strategy string for ``--strategy`` / ``strategy=``: ``"auto"`` or the canonical string."""
        return "auto" if self.config is None else self.config.to_string()


@dataclass(frozen=True)
class Exported:
    """A strategy written as another framework's config: ``data`` (the config
    as a dict), ``text`` (as that framework's file) and ``notes``, what the
    format cannot express (and where that framework keeps it, if anywhere)."""

    data: dict[str, Any]
    text: str
    notes: tuple[str, ...] = ()


def read_config(path: str | os.PathLike, framework: str, parse: Callable[[str], Any],
                syntax: type[Exception], language: str) -> Any:
    """``parse`` of the text of ``path``; :class:`ConfigError` for a missing or
    unreadable file, or a ``syntax`` error (the file is not valid ``language``)."""
    p = Path(path)
    try:
        return parse(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{framework} config {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{framework} config {str(p)!r} cannot be read: {e}") from None
    except syntax as e:
        raise ConfigError(f"{framework} config {str(p)!r} is not valid {language}: {e}") from None


def uneven_layers(cfg: ParallelConfig, plan: Plan | None) -> list[int] | None:
    """A pipelined plan's layers per stage when they are not all equal (no format says so), else ``None``."""
    layers = plan.data.get("pipeline", {}).get("layers") if plan is not None and cfg.pp > 1 else None
    return layers if layers and len(set(layers)) > 1 else None


def source(what: Source) -> tuple[ParallelConfig, Plan | None]:
    """The strategy to export and, for a :class:`Plan`, the plan (its batch,
    layers per stage and search mode say more than the strategy alone).
    A string is a strategy (``"dp=2,tp=4"``). Raises :class:`StrategyError`."""
    if isinstance(what, Plan):
        return what.config, what
    if isinstance(what, ParallelConfig):
        return what, None
    if isinstance(what, str):
        return parse_strategy(what), None
    raise StrategyError(f"cannot export a {type(what).__name__}: give a Plan, a ParallelConfig or a strategy "
                        "string such as 'dp=2,tp=4'")


def positive_int(value: Any, field: str, where: str) -> int:
    """``value`` as an integer >= 1 (an integral float is accepted); raises :class:`ConfigError` naming ``field``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {field} must be an integer >= 1, got {value!r}")
    return value


def boolean(value: Any, field: str, where: str) -> bool:
    """``value`` as a bool; raises :class:`ConfigError` naming ``field``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {field} must be true or false, got {value!r}")
    return value


def mapping(value: Any, field: str, where: str) -> Mapping[str, Any]:
    """``value`` as a mapping (``None``: empty); raises :class:`ConfigError` naming ``field``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {field} must be a mapping of keys to values, got {value!r}")
    return value


def cp_of(cfg: ParallelConfig) -> int:
    """The context-parallel degree of ``cfg`` (1 where the strategy has no ``cp`` key)."""
    return getattr(cfg, "cp", 1)


def context_parallel(size: int, what: str, where: str, hint: str = "") -> dict[str, int]:
    """``{"cp": size}`` for a context-parallel degree > 1 (``{}`` for 1);
    :class:`UnsupportedError` naming ``what`` where the strategy has no ``cp`` key."""
    if size == 1:
        return {}
    if not CP:
        raise UnsupportedError(f"{where}: {what}={size} is context parallelism (the sequence split over "
                               f"devices), which this autopar does not implement{hint}")
    return {"cp": size}


def check_world(degrees: Mapping[str, int], devices: int, where: str) -> None:
    """Raise :class:`ConfigError` unless the product of ``degrees`` (their
    fields' names as keys) equals ``devices``: more is the seed's rule
    (MindFormers: ``data_parallel x model_parallel x pipeline_stage <=
    total_device_num``), fewer leaves devices idle, which autopar does not plan."""
    product = 1
    for v in degrees.values():
        product *= v
    if product == devices:
        return
    terms = " x ".join(f"{k}={v}" for k, v in degrees.items())
    if product > devices:
        raise ConfigError(f"{where}: {terms} = {product} devices, more than the {devices} given; "
                          "the product of the degrees may not exceed the device count")
    first, *rest = degrees
    others = product // degrees[first]
    hint = (f"; use {first}={devices // others}" if devices % others == 0 else
            f"; the other degrees ({others}) must divide {devices}: one of {', '.join(map(str, divisors(devices)))}")
    raise ConfigError(f"{where}: {terms} = {product} devices, but {devices} are given and autopar plans every "
                      f"device (the product must equal the device count){hint}")


def build(keys: Mapping[str, Any], devices: int, where: str, spelled: Mapping[str, str]) -> ParallelConfig:
    """The strategy of ``keys`` (autopar key -> value; ``None``: not given) on
    ``devices``, through :func:`parse_strategy`, so the grammar's rules
    (schedules, ZeRO with a pipeline, sequence parallel without tp, ...)
    hold for every imported config. ``spelled`` maps autopar keys to the
    config's field names, which a :class:`ConfigError` repeats."""
    by_name = {k.name: k for k in FIELDS}
    text = ",".join(f"{k}={v if k not in by_name else by_name[k].format(v)}"
                    for k, v in keys.items() if v is not None)
    try:
        return parse_strategy(text or "tp=1", devices)
    except StrategyError as e:
        names = ", ".join(f"{k} = {v}" for k, v in spelled.items())
        raise ConfigError(f"{where}: {e} (autopar's keys; in this config {names})") from None


def search_of(plan: Plan | None) -> str | None:
    """The search mode a plan was made with (``None`` for a manual one or no plan)."""
    if plan is None:
        return None
    mode = plan.data.get("search", {}).get("mode")
    return None if mode in (None, "manual") else mode


def common_losses(cfg: ParallelConfig, plan: Plan | None, framework: str) -> list[str]:
    """The notes every export shares: the searched per-op placements of a
    plan and the gradient-communication options, which no format carries."""
    notes = []
    mode = search_of(plan)
    if mode is not None and cfg.tp > 1:
        notes.append(f"per-op placements: the plan's were searched ({mode}); {framework} lays tensor-parallel "
                     "layers out Megatron-style, so those placements are not carried")
    if cfg.copies > 1 and framework != "MindFormers":
        notes.append(f"copies={cfg.copies} (multi-copy parallel, MindSpore's micro_batch_interleave_num): no "
                     f"{framework} key")
    if cfg.fsdp_layers:
        notes.append(f"fsdp_layers={cfg.fsdp_layers} (that many layers under ZeRO-3, the rest under zero={cfg.zero}): "
                     f"no {framework} key; written as zero={cfg.zero} for every layer")
    if getattr(cfg, "tp_mode", "1d") in ("mesh", "mesh3"):
        notes.append(f"tp_mode={cfg.tp_mode} (the tp group as a {' x '.join(map(str, cfg.tp_grid))} mesh whose "
                     f"per-op placements one program decides on every axis): {framework} has no such layout, so tp={cfg.tp} "
                     f"is written as 1D")
    elif getattr(cfg, "tp_mode", "1d") != "1d" and not framework.startswith("Colossal-AI"):
        notes.append(f"tp_mode={cfg.tp_mode} (tensor parallel on a {' x '.join(map(str, cfg.tp_grid))} grid, "
                     f"Colossal-AI's): {framework} has 1D tensor parallel only, so tp={cfg.tp} is written as 1D")
    if not cfg.overlap:
        notes.append(f"overlap=false (gradients reduced after backward, not bucket by bucket): no {framework} key")
    bucket = next(k for k in FIELDS if k.name == "bucket_mb")
    if cfg.bucket_mb != bucket.default:
        notes.append(f"bucket_mb={cfg.bucket_mb:g} (gradient bucket size): no {framework} key")
    if cfg.reduce_dtype and cfg.reduce_dtype != "fp32":
        notes.append(f"reduce_dtype={cfg.reduce_dtype} (gradients reduced in low precision): no {framework} key")
    return notes
