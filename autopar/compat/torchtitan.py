"""torchtitan job TOML out (and back in): ``[parallelism]``, ``[activation_checkpoint]``, ``[training]``.

Key names follow torchtitan's ``JobConfig`` (``torchtitan/config/job_config.py``):
``data_parallel_replicate_degree`` (DDP), ``data_parallel_shard_degree`` (FSDP;
-1: what the other degrees leave), ``fsdp_reshard_after_forward``,
``tensor_parallel_degree``, ``pipeline_parallel_degree``, ``context_parallel_degree``,
``pipeline_parallel_schedule`` (``GPipe``, ``1F1B``, ``Interleaved1F1B``),
``pipeline_parallel_microbatch_size`` (samples per microbatch: torchtitan
counts microbatches as ``training.local_batch_size`` / it), and
``[activation_checkpoint] mode``.

ZeRO maps onto FSDP: ``zero=0`` is DDP (replicate), ``zero=3`` FSDP resharding
after forward, ``zero=2`` FSDP that keeps the weights gathered
(``fsdp_reshard_after_forward = "never"``); torchtitan has no ZeRO-1, which is
written as ZeRO-2 with a note. torchtitan's tensor parallel always splits the
norms along the sequence: ``tp > 1`` reads back as ``sequence_parallel=true``.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, UnsupportedError
from ..plan import Plan
from ..spec import ParallelConfig
from .common import (Exported, Imported, Source, build, check_world, common_losses, context_parallel, cp_of, mapping,
                     positive_int, read_config, source, uneven_layers)

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
PRECISIONS = {"bf16": "bfloat16", "fp32": "float32"}
SPELLED = {"dp": "data_parallel_replicate_degree x data_parallel_shard_degree", "tp": "tensor_parallel_degree",
           "pp": "pipeline_parallel_degree", "schedule": "pipeline_parallel_schedule",
           "microbatches": "training.local_batch_size / pipeline_parallel_microbatch_size",
           "recompute": "activation_checkpoint.mode", "zero": "data_parallel_shard_degree",
           "cp": "context_parallel_degree"}


# ------------------------------------------------------------------ strategy -> config
def to_torchtitan(what: Source, global_batch: int | None = None) -> Exported:
    """A plan or strategy as a torchtitan job TOML: ``data`` maps section ->
    keys, ``text`` is the TOML; ``notes`` what torchtitan cannot say.

    The batch sizes (``[training]``, and the pipeline's microbatch size) are
    written when the batch is known: a plan's, or ``global_batch``."""
    cfg, plan = source(what)
    batch = global_batch if global_batch is not None else plan.data.get("global_batch") if plan else None
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": cfg.dp if cfg.zero == 0 else 1,
        "data_parallel_shard_degree": cfg.dp if cfg.zero else 1,
        "tensor_parallel_degree": cfg.tp,
        "enable_async_tensor_parallel": False,
        "pipeline_parallel_degree": cfg.pp,
        "context_parallel_degree": cp_of(cfg),
    }
    if cfg.zero:
        par["fsdp_reshard_after_forward"] = "default" if cfg.zero == 3 else "never"
    training: dict[str, Any] = {}
    if cfg.precision in PRECISIONS:
        training["mixed_precision_param"] = PRECISIONS[cfg.precision]
    notes = _losses(cfg, plan, batch)
    if cfg.pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULES[cfg.schedule]
        layers = plan.data.get("pipeline", {}).get("layers") if plan else None
        if layers and len(set(layers)) == 1:
            par["pipeline_parallel_layers_per_stage"] = layers[0]
    if batch is not None:
        if positive_int(batch, "global_batch", "torchtitan export") % (cfg.dp * cfg.microbatches):
            raise ConfigError(f"torchtitan export: global batch {batch} is not a multiple of dp={cfg.dp} x "
                              f"microbatches={cfg.microbatches}, so no whole local and microbatch sizes exist")
        local = batch // cfg.dp if cfg.pp > 1 else batch // (cfg.dp * cfg.microbatches)
        training.update(global_batch_size=batch, local_batch_size=local)
        if cfg.pp > 1:
            par["pipeline_parallel_microbatch_size"] = local // cfg.microbatches
    ac = {"mode": cfg.recompute}
    if cfg.recompute == "selective":
        ac["selective_ac_option"] = "op"
    data = {"parallelism": par, "activation_checkpoint": ac}
    if training:
        data["training"] = training
    head = f"# torchtitan job config ([parallelism] and friends) written by autopar for {cfg.to_string()}\n"
    return Exported(data, head + _toml(data), tuple(notes))


def _toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    """Sections of scalars as TOML (strings as JSON strings, which TOML reads alike)."""
    def value(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)
    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                     for name, keys in data.items())


def _losses(cfg: ParallelConfig, plan: Plan | None, batch: int | None) -> list[str]:
    """What a torchtitan job config does not carry."""
    notes = common_losses(cfg, plan, "torchtitan")
    if cfg.zero == 1 and cfg.dp > 1:
        notes.append("zero=1: torchtitan has no ZeRO-1; written as FSDP that keeps the weights gathered "
                     "(fsdp_reshard_after_forward = \"never\"), which also shards gradients (ZeRO-2)")
    if cfg.zero and cfg.dp == 1:
        notes.append(f"zero={cfg.zero} with dp=1 shards nothing: written as no data parallelism")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.append("sequence_parallel=false: torchtitan's tensor parallel always splits the norms along the "
                     "sequence (sequence_parallel=true)")
    if cfg.precision == "fp16":
        notes.append("precision=fp16: torchtitan's mixed_precision_param is bfloat16 or float32")
    if not cfg.precision:
        notes.append("precision unset: torchtitan's default is mixed_precision_param = \"bfloat16\"")
    if cfg.offload != "none":
        notes.append(f"offload={cfg.offload}: torchtitan's training.enable_cpu_offload offloads weights, gradients "
                     "and optimizer state under FSDP (more than the optimizer); not written")
    if cfg.recompute == "selective":
        notes.append("recompute=selective written as torchtitan's per-op selective checkpointing "
                     "(selective_ac_option = \"op\"), whose op list differs from autopar's")
    if batch is None and cfg.microbatches > 1:
        notes.append(f"microbatches={cfg.microbatches}: torchtitan derives them from training.local_batch_size "
                     + ("/ pipeline_parallel_microbatch_size" if cfg.pp > 1 else "and global_batch_size")
                     + "; give the global batch (a plan, or --global-batch) to write them")
    if layers := uneven_layers(cfg, plan):
        notes.append(f"layers per stage {layers} are uneven: set pipeline_parallel_split_points to the first "
                     "module of each stage")
    return notes


# ------------------------------------------------------------------ config -> strategy
def from_torchtitan(cfg_or_path: str | os.PathLike | Mapping[str, Any], devices: int | None = None) -> Imported:
    """The strategy of a torchtitan job config (a TOML file or its dict) on
    ``devices`` (needed when ``data_parallel_shard_degree`` is -1, torchtitan's
    default). Missing keys take torchtitan's defaults.

    Raises :class:`ConfigError` for invalid degrees, :class:`UnsupportedError`
    for HSDP, expert parallel (context parallel where the strategy has no
    ``cp``), and schedules autopar does not run."""
    where, cfg = ("torchtitan config", cfg_or_path) if isinstance(cfg_or_path, Mapping) else \
        (f"torchtitan config {str(cfg_or_path)!r}", _read_toml(cfg_or_path))
    par = mapping(cfg.get("parallelism"), "parallelism", where)
    training = mapping(cfg.get("training"), "training", where)
    notes: list[str] = []
    rep = positive_int(par.get("data_parallel_replicate_degree", 1), "data_parallel_replicate_degree", where)
    tp = positive_int(par.get("tensor_parallel_degree", 1), "tensor_parallel_degree", where)
    pp = positive_int(par.get("pipeline_parallel_degree", 1), "pipeline_parallel_degree", where)
    if positive_int(par.get("expert_parallel_degree", 1), "expert_parallel_degree", where) > 1:
        raise UnsupportedError(f"{where}: expert_parallel_degree={par['expert_parallel_degree']}: expert parallel "
                               "is not implemented in autopar; use 1")
    cp = positive_int(par.get("context_parallel_degree", 1), "context_parallel_degree", where)
    context = context_parallel(cp, "context_parallel_degree", where)
    shard = par.get("data_parallel_shard_degree", -1)
    if shard == -1:
        if devices is None:
            raise ConfigError(f"{where}: data_parallel_shard_degree=-1 takes what the devices leave: give the "
                              "device count")
        shard = max(1, devices // (rep * tp * pp * cp))
    shard = positive_int(shard, "data_parallel_shard_degree", where)
    devices = rep * shard * tp * pp * cp if devices is None else positive_int(devices, "the device count", where)
    check_world({"data_parallel_shard_degree": shard, "data_parallel_replicate_degree": rep,
                 "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
                 **({"context_parallel_degree": cp} if cp > 1 else {})}, devices, where)
    if rep > 1 and shard > 1:
        raise UnsupportedError(f"{where}: data_parallel_replicate_degree={rep} with data_parallel_shard_degree="
                               f"{shard} is HSDP (shard within groups, replicate across); autopar's ZeRO shards "
                               "over the whole data-parallel axis: use one of the two")
    zero = 0 if shard == 1 else 2 if par.get("fsdp_reshard_after_forward", "default") == "never" else 3
    if zero > 1 and pp > 1:
        notes.append(f"FSDP with a pipeline read as zero=1 (autopar allows at most ZeRO-1 with pp > 1; FSDP was "
                     f"zero={zero})")
        zero = 1
    keys = {"dp": rep * shard, "tp": tp, "pp": pp, **context, "zero": zero, "sequence_parallel": tp > 1,
            **_pipeline(par, training, pp, rep * shard, where, notes),
            "recompute": _recompute(mapping(cfg.get("activation_checkpoint"), "activation_checkpoint", where), where,
                                    notes),
            "precision": _precision(training, where, notes)}
    if par.get("enable_async_tensor_parallel"):
        notes.append("enable_async_tensor_parallel is not read: autopar's tensor parallel collectives are not "
                     "overlapped that way")
    return Imported(build(keys, devices, where, SPELLED), tuple(notes))


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        raise UnsupportedError("reading a torchtitan TOML needs Python 3.11 or later (tomllib)") from None
    return read_config(path, "torchtitan", tomllib.loads, tomllib.TOMLDecodeError, "TOML")


def _pipeline(par: Mapping[str, Any], training: Mapping[str, Any], pp: int, dp: int, where: str,
              notes: list[str]) -> dict[str, Any]:
    """Schedule, chunks and microbatches from the pipeline keys and the batch sizes (torchtitan's defaults
    for those missing: 1F1B, local batch 8, microbatch size 1)."""
    local = positive_int(training.get("local_batch_size", 8), "training.local_batch_size", where)
    total = training.get("global_batch_size", -1)
    accumulate = 1 if total == -1 else positive_int(total, "training.global_batch_size", where) // (local * dp)
    if total != -1 and (accumulate < 1 or total % (local * dp)):
        raise ConfigError(f"{where}: training.global_batch_size={total} is not a multiple of local_batch_size="
                          f"{local} x data-parallel degree {dp}")
    if pp == 1:
        return {"microbatches": accumulate}
    name = par.get("pipeline_parallel_schedule", "1F1B")
    ours = {v.lower(): k for k, v in SCHEDULES.items()}.get(str(name).lower())
    if ours is None:
        raise UnsupportedError(f"{where}: pipeline_parallel_schedule={name!r} is not run by autopar; valid: "
                               f"{', '.join(SCHEDULES.values())}")
    size = positive_int(par.get("pipeline_parallel_microbatch_size", 1), "pipeline_parallel_microbatch_size", where)
    if local % size:
        raise ConfigError(f"{where}: training.local_batch_size={local} is not a multiple of "
                          f"pipeline_parallel_microbatch_size={size}")
    keys: dict[str, Any] = {"schedule": ours, "microbatches": local // size * accumulate}
    if accumulate > 1:
        notes.append(f"gradient accumulation ({accumulate} steps) over the pipeline read as "
                     f"microbatches={keys['microbatches']}")
    if ours == "interleaved":
        notes.append("Interleaved1F1B: the stages per rank follow from the model's layers and "
                     "pipeline_parallel_layers_per_stage, which the config alone does not give: read as chunks=2")
    return keys


def _recompute(ac: Mapping[str, Any], where: str, notes: list[str]) -> str:
    """``[activation_checkpoint]`` as autopar's recompute (torchtitan's default: selective, every 2nd layer)."""
    mode = ac.get("mode", "selective")
    if mode not in ("none", "full", "selective"):
        raise ConfigError(f"{where}: activation_checkpoint.mode={mode!r} is invalid; valid: none, selective, full")
    if mode != "selective":
        return mode
    option = str(ac.get("selective_ac_option", "2"))
    if option == "op":
        return "selective"
    if option != "1":
        notes.append(f"activation_checkpoint selective_ac_option={option} (every {option}th layer checkpointed "
                     "whole) has no autopar equivalent: read as recompute=full (every layer), which saves more "
                     "memory and costs more time")
    return "full"


def _precision(training: Mapping[str, Any], where: str, notes: list[str]) -> str | None:
    name = training.get("mixed_precision_param")
    if name is None:
        notes.append("training.mixed_precision_param not given (torchtitan's default: bfloat16): the precision is "
                     "left to the cluster's default; add precision=bf16 to the strategy to match")
        return None
    ours = {v: k for k, v in PRECISIONS.items()}.get(name)
    if ours is None:
        raise ConfigError(f"{where}: training.mixed_precision_param={name!r} is invalid; valid: bfloat16, float32")
    return ours
