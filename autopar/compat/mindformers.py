"""MindFormers YAML configs in and out: the ``parallel`` context and ``parallel_config``.

Mapping (the seed's MindFormers parallel manual):

* ``parallel_mode`` 0 (data parallel) is ``dp`` alone; 1 (semi-automatic) is
  the strategy of ``parallel_config``, and with a ``search_mode`` autopar
  searches the per-op placements on that mesh (its semi-automatic mode); 2
  (automatic) is ``strategy="auto"`` with ``search_mode`` as autopar's search
  mode (``dynamic_programming``, ``sharding_propagation``,
  ``recursive_programming``); 3 (hybrid) is the strategy of ``parallel_config``
  as written. The names ``data_parallel`` ... ``hybrid_parallel`` are read too.
* ``data_parallel``, ``model_parallel``, ``pipeline_stage`` are ``dp``, ``tp``,
  ``pp`` (``context_parallel``: ``cp``); ``micro_batch_num`` the pipeline's microbatches (without a pipeline,
  ``runner_config.gradient_accumulation_steps`` accumulates);
  ``use_seq_parallel`` is ``sequence_parallel``; ``enable_parallel_optimizer``
  (MindSpore's optimizer parallel, which shards the weight update over the
  data-parallel devices) is ``zero=1``; ``recompute_config`` (or
  ``parallel_config.recompute``) gives ``recompute``.

The seed's rules are :class:`ConfigError` naming the field: ``parallel_mode``
and ``search_mode`` values, ``full_batch`` true in data-parallel mode,
``micro_batch_num >= pipeline_stage``, ``data_parallel x model_parallel x
pipeline_stage`` against the device count (autopar also refuses fewer: it
plans every device). ``micro_batch_interleave_num`` (MindSpore's multi-copy
parallel, at the top level or in ``parallel_config``) is ``copies``, and is
written back as it; its rules (tp > 1, no pipeline) are the grammar's.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from ..errors import ConfigError, UnsupportedError
from ..plan import Plan
from ..spec import ParallelConfig
from .common import (Exported, Imported, Source, boolean, build, check_world, common_losses, context_parallel, cp_of,
                     mapping, positive_int, read_config, search_of, source, uneven_layers)

PARALLEL_MODES = ("data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel")
SEARCH_MODES = ("dynamic_programming", "sharding_propagation", "recursive_programming")
SPELLED = {"dp": "parallel_config.data_parallel", "tp": "parallel_config.model_parallel",
           "pp": "parallel_config.pipeline_stage",
           "microbatches": "parallel_config.micro_batch_num (runner_config.gradient_accumulation_steps without a "
                           "pipeline)",
           "sequence_parallel": "parallel_config.use_seq_parallel", "zero": "parallel.enable_parallel_optimizer",
           "recompute": "recompute_config", "cp": "parallel_config.context_parallel",
           "copies": "micro_batch_interleave_num"}


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The MindFormers YAML file ``path`` as a dict (``yaml.safe_load``: no
    Python objects are built). Raises :class:`ConfigError`."""
    data = read_config(path, "MindFormers", yaml.safe_load, yaml.YAMLError, "YAML")
    if not isinstance(data, dict):
        raise ConfigError(f"MindFormers config {str(path)!r} is not a mapping of keys to values")
    return data


# ------------------------------------------------------------------ config -> strategy
def from_mindformers(cfg_or_path: str | os.PathLike | Mapping[str, Any], devices: int | None = None) -> Imported:
    """The strategy of a MindFormers config (a YAML file or its dict) on ``devices``.

    A missing ``data_parallel`` is what the devices leave; without
    ``devices`` the degrees' product is the device count (``data_parallel`` is then needed). ``parallel_mode: 2``
    gives ``Imported(config=None, search_mode=...)``: a search.

    Raises :class:`ConfigError` for a config that breaks one of the seed's
    rules (naming the field), :class:`UnsupportedError` for expert parallel."""
    if isinstance(cfg_or_path, Mapping):
        where, cfg = "MindFormers config", cfg_or_path
    else:
        where, cfg = f"MindFormers config {str(cfg_or_path)!r}", read_yaml(cfg_or_path)
    par = mapping(cfg.get("parallel"), "parallel", where)
    pc = mapping(cfg.get("parallel_config"), "parallel_config", where)
    notes: list[str] = []
    mode = _parallel_mode(par.get("parallel_mode"), where, notes)
    search = par.get("search_mode")
    if search is not None and search not in SEARCH_MODES:
        raise ConfigError(f"{where}: parallel.search_mode={search!r} is invalid; valid: {', '.join(SEARCH_MODES)}")
    if mode == 0 and boolean(par.get("full_batch", False), "parallel.full_batch", where):
        raise ConfigError(f"{where}: parallel.full_batch=true with parallel_mode 0 (data parallel): each device "
                          "loads its own part of the batch there, so full_batch must be false")
    tp = positive_int(pc.get("model_parallel", 1), "parallel_config.model_parallel", where)
    pp = positive_int(pc.get("pipeline_stage", 1), "parallel_config.pipeline_stage", where)
    if mode == 0 and (tp > 1 or pp > 1):
        raise ConfigError(f"{where}: parallel_mode 0 (data parallel) splits only the batch, but "
                          f"parallel_config has model_parallel={tp}, pipeline_stage={pp}; use parallel_mode 1 "
                          "(semi-automatic) for them")
    _refuse(cfg, pc, where)
    pc = _dataset_strategy(par, pc, mode, where, notes)
    if mode == 2:
        if any(k in pc for k in ("data_parallel", "model_parallel", "pipeline_stage")):
            notes.append("parallel_mode 2 (automatic): parallel_config's degrees are not read; autopar searches "
                         "dp, tp and pp")
        return Imported(None, tuple(notes + _notes(cfg, par, pc, mode, tp)), search or "dynamic_programming")
    if devices is None:
        if "data_parallel" not in pc:
            raise ConfigError(f"{where}: without parallel_config.data_parallel, give the device count (data "
                              "parallel takes what the other degrees leave)")
        devices = positive_int(pc["data_parallel"], "parallel_config.data_parallel", where) * tp * pp * \
            positive_int(pc.get("context_parallel", 1), "parallel_config.context_parallel", where)
    positive_int(devices, "the device count", where)
    cp = positive_int(pc.get("context_parallel", 1), "parallel_config.context_parallel", where)
    context = context_parallel(cp, "parallel_config.context_parallel", where)
    dp = pc.get("data_parallel", devices // (tp * pp * cp) or 1)
    check_world({"parallel_config.data_parallel": positive_int(dp, "parallel_config.data_parallel", where),
                 "model_parallel": tp, "pipeline_stage": pp, **({"context_parallel": cp} if cp > 1 else {})},
                devices, where)
    keys = {"dp": dp, "tp": tp, "pp": pp, **context, "microbatches": _microbatches(cfg, pc, pp, where, notes),
            "sequence_parallel": boolean(pc.get("use_seq_parallel", False), "parallel_config.use_seq_parallel", where),
            "zero": 1 if _parallel_optimizer(par, pc, where) else 0, "recompute": _recompute(cfg, pc, where, notes),
            "copies": _copies(cfg, pc, where)}
    if search is not None and mode == 1:
        notes.append(f"search_mode={search} with parallel_mode 1: MindSpore applies search_mode in automatic mode "
                     "only; autopar searches the per-op placements on your mesh with it (its semi-automatic mode)")
    elif search is not None:
        notes.append(f"search_mode={search} is not read with parallel_mode {mode} (the seed: automatic mode only)")
    config = build(keys, devices, where, SPELLED)
    return Imported(config, tuple(notes + _notes(cfg, par, pc, mode, tp)), search if mode == 1 else None)


def _parallel_mode(value: Any, where: str, notes: list[str]) -> int:
    """``parallel_mode`` as 0-3 (an int or MindSpore's mode name)."""
    if value is None:
        notes.append("parallel.parallel_mode not given: read as 1 (semi-automatic, parallel_config as written)")
        return 1
    if isinstance(value, str) and value.lower() in PARALLEL_MODES:
        return PARALLEL_MODES.index(value.lower())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(PARALLEL_MODES):
        return value
    raise ConfigError(f"{where}: parallel.parallel_mode={value!r} is invalid; valid: "
                      + ", ".join(f"{i} ({n})" for i, n in enumerate(PARALLEL_MODES)))


def _refuse(cfg: Mapping[str, Any], pc: Mapping[str, Any], where: str) -> None:
    """:class:`UnsupportedError` for what autopar does not run: expert parallel."""
    if positive_int(pc.get("expert_parallel", 1), "parallel_config.expert_parallel", where) > 1:
        raise UnsupportedError(f"{where}: parallel_config.expert_parallel={pc['expert_parallel']}: expert "
                               "parallel (MoE) is not implemented in autopar; use expert_parallel: 1")


def _dataset_strategy(par: Mapping[str, Any], pc: Mapping[str, Any], mode: int, where: str,
                      notes: list[str]) -> Mapping[str, Any]:
    """``parallel.dataset_strategy`` (MindSpore's dataset slicing) folded into ``pc``.

    ``"data_parallel"`` and ``"full_batch"`` are the two spellings of
    ``full_batch``; per-input shard counts such as ``[[2, 4], [2, 4]]`` (inputs
    of shape ``[batch, sequence, ...]``) give ``data_parallel`` from the batch's
    count and ``context_parallel`` from the sequence's: each device loads a
    slice of the sequence. Slicing a third dim (an image's height) is
    :class:`UnsupportedError` (convolutions would need halo exchange)."""
    ds = par.get("dataset_strategy")
    if ds is None or ds == "data_parallel":
        return pc
    if ds == "full_batch":
        if mode == 0:
            raise ConfigError(f"{where}: parallel.dataset_strategy='full_batch' with parallel_mode 0 (data "
                              "parallel): each device loads its own part of the batch there")
        return pc
    if isinstance(ds, str) or not isinstance(ds, (list, tuple)) or not ds or \
            not all(isinstance(s, (list, tuple)) and s for s in ds):
        raise ConfigError(f"{where}: parallel.dataset_strategy={ds!r} is invalid; valid: 'data_parallel', "
                          "'full_batch', or one list of shard counts per input, e.g. [[2, 4], [2, 4]]")
    shards = [tuple(positive_int(n, f"parallel.dataset_strategy[{i}]", where) for n in s) for i, s in enumerate(ds)]
    for i, s in enumerate(shards):
        if any(n > 1 for n in s[2:]):
            raise UnsupportedError(f"{where}: parallel.dataset_strategy[{i}]={list(s)} slices dim "
                                   f"{2 + next(j for j, n in enumerate(s[2:]) if n > 1)} (e.g. an image's height): "
                                   "autopar slices inputs along the batch (dp) and the sequence (cp) only; a "
                                   "convolution over a sliced image would need halo exchange")
    heads = {s[:2] + (1,) * (2 - len(s[:2])) for s in shards}
    if len(heads) > 1:
        raise ConfigError(f"{where}: parallel.dataset_strategy={ds!r}: every input must be sliced alike along the "
                          "batch and the sequence")
    (dp, cp), = heads
    if mode == 0 and cp > 1:
        raise ConfigError(f"{where}: parallel.dataset_strategy={ds!r} slices the sequence, but parallel_mode 0 "
                          "(data parallel) splits only the batch; use parallel_mode 1")
    for key, value in (("data_parallel", dp), ("context_parallel", cp)):
        if key in pc and positive_int(pc[key], f"parallel_config.{key}", where) != value:
            raise ConfigError(f"{where}: parallel.dataset_strategy={ds!r} gives {key}={value}, but "
                              f"parallel_config.{key}={pc[key]}")
    if cp > 1:
        notes.append(f"parallel.dataset_strategy slices each input's sequence in {cp}: context parallel cp={cp}")
    return {**pc, "data_parallel": dp, "context_parallel": cp}


def _copies(cfg: Mapping[str, Any], pc: Mapping[str, Any], where: str) -> int:
    """``micro_batch_interleave_num`` (top level, or in ``parallel_config``) as ``copies``."""
    return positive_int(cfg.get("micro_batch_interleave_num", pc.get("micro_batch_interleave_num", 1)),
                        "micro_batch_interleave_num", where)


def _microbatches(cfg: Mapping[str, Any], pc: Mapping[str, Any], pp: int, where: str, notes: list[str]) -> int:
    """The microbatches per step: ``micro_batch_num`` with a pipeline (the seed's rule: >= pipeline_stage),
    times ``runner_config.gradient_accumulation_steps``."""
    runner = mapping(cfg.get("runner_config"), "runner_config", where)
    accumulate = positive_int(runner.get("gradient_accumulation_steps", 1),
                              "runner_config.gradient_accumulation_steps", where)
    micro = positive_int(pc.get("micro_batch_num", 1), "parallel_config.micro_batch_num", where)
    if pp == 1:
        if micro != 1:
            notes.append(f"micro_batch_num={micro} is for a pipeline; with pipeline_stage 1 it is not read "
                         "(runner_config.gradient_accumulation_steps accumulates)")
        return accumulate
    if micro < pp:
        raise ConfigError(f"{where}: parallel_config.micro_batch_num={micro} < pipeline_stage={pp}: every stage "
                          f"needs a microbatch (micro_batch_num >= pipeline_stage); use micro_batch_num >= {pp}")
    if accumulate > 1:
        notes.append(f"gradient_accumulation_steps={accumulate} over a pipeline of {micro} microbatches: read as "
                     f"microbatches={micro * accumulate} (the same samples per optimizer step)")
    return micro * accumulate


def _parallel_optimizer(par: Mapping[str, Any], pc: Mapping[str, Any], where: str) -> bool:
    on = boolean(par.get("enable_parallel_optimizer", False), "parallel.enable_parallel_optimizer", where)
    return on or boolean(pc.get("optimizer_shard", False), "parallel_config.optimizer_shard", where)


def _recompute(cfg: Mapping[str, Any], pc: Mapping[str, Any], where: str, notes: list[str]) -> str:
    """``recompute_config`` (or ``parallel_config.recompute``, a bool or that dict) as full, selective or none."""
    inner = pc.get("recompute")
    if isinstance(inner, bool):
        rc, field = {"recompute": inner}, "parallel_config.recompute"
    else:
        field = "recompute_config" if inner is None else "parallel_config.recompute"
        rc = mapping(cfg.get("recompute_config") if inner is None else inner, field, where)
    if boolean(rc.get("recompute", False), f"{field}.recompute", where):
        return "full"
    select = rc.get("select_recompute", False)
    if isinstance(select, bool):
        return "selective" if select else "none"
    if select:
        notes.append(f"{field}.select_recompute lists layers or ops: read as recompute=selective (autopar "
                     "recomputes norms, activations, softmax and dropout)")
        return "selective"
    return "none"


def _notes(cfg: Mapping[str, Any], par: Mapping[str, Any], pc: Mapping[str, Any], mode: int, tp: int) -> list[str]:
    """Notes on keys that are read but have no autopar meaning."""
    notes = []
    if cfg.get("use_parallel") is False:
        notes.append("use_parallel: false (MindFormers would run on one device): the parallel settings are read "
                     "as if it were true")
    if mode == 3:
        notes.append("parallel_mode 3 (hybrid): autopar lays the model out from the degrees; hand-written "
                     "communication in the model is not read")
    if pc.get("vocab_emb_dp") is True and tp > 1:
        notes.append("vocab_emb_dp: true (embedding replicated over model_parallel): autopar decides the "
                     "embedding's placement itself (usually vocabulary-sharded); pin it replicated with "
                     "--pin <embedding>.weight=R")
    if "gradient_aggregation_group" in pc:
        notes.append(f"gradient_aggregation_group={pc['gradient_aggregation_group']} counts gradients per fused "
                     "all-reduce; autopar fuses by size (bucket_mb)")
    if par.get("enable_alltoall"):
        notes.append("enable_alltoall (MoE all-to-all) is not read: autopar has no expert parallel")
    if par.get("strategy_ckpt_save_file"):
        notes.append("strategy_ckpt_save_file: autopar records its strategy as plan.json (`autopar plan --out`)")
    if mode == 0 and par.get("gradients_mean") is False:
        notes.append("gradients_mean: false: autopar always averages the gradients over the global batch")
    return notes


# ------------------------------------------------------------------ strategy -> config
def to_mindformers(what: Source) -> Exported:
    """A plan or strategy as a MindFormers config: ``data`` (``use_parallel``,
    ``parallel``, ``parallel_config``, ``micro_batch_interleave_num``,
    ``recompute_config``, with accumulation ``runner_config``), ``text`` its
    YAML; ``notes`` what it cannot say. Data parallel alone is
    ``parallel_mode: 0``, anything else ``1`` (semi-automatic), with the
    plan's ``search_mode`` where the plan was searched."""
    cfg, plan = source(what)
    mode = 0 if cfg.tp == cfg.pp == 1 else 1
    par: dict[str, Any] = {"parallel_mode": mode, "gradients_mean": mode == 0, "full_batch": mode == 1,
                           "enable_parallel_optimizer": cfg.zero > 0}
    search = search_of(plan)
    if mode == 1 and search in SEARCH_MODES:
        par["search_mode"] = search
    data: dict[str, Any] = {
        "use_parallel": cfg.devices > 1,
        "parallel": par,
        "parallel_config": {"data_parallel": cfg.dp, "model_parallel": cfg.tp, "pipeline_stage": cfg.pp,
                            "use_seq_parallel": cfg.sequence_parallel,
                            "micro_batch_num": cfg.microbatches if cfg.pp > 1 else 1, "vocab_emb_dp": cfg.tp == 1},
        "micro_batch_interleave_num": cfg.copies,
        "recompute_config": {"recompute": cfg.recompute == "full", "select_recompute": cfg.recompute == "selective"},
    }
    if cp_of(cfg) > 1:
        data["parallel_config"]["context_parallel"] = cp_of(cfg)
    if cfg.pp == 1 and cfg.microbatches > 1:
        data["runner_config"] = {"gradient_accumulation_steps": cfg.microbatches}
    text = f"# MindFormers parallel config written by autopar for {cfg.to_string()}\n" + \
        yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    return Exported(data, text, tuple(_losses(cfg, plan)))


def _losses(cfg: ParallelConfig, plan: Plan | None) -> list[str]:
    """What MindFormers' parallel config does not carry."""
    notes = common_losses(cfg, plan, "MindFormers")
    if cfg.zero > 1:
        notes.append(f"zero={cfg.zero} written as enable_parallel_optimizer: true, MindSpore's optimizer "
                     "parallel (the weight update sharded over data_parallel); gradient and weight sharding "
                     "beyond it have no key in the seed")
    if cfg.pp > 1 and cfg.schedule != "1f1b":
        notes.append(f"schedule={cfg.schedule}" + (f", chunks={cfg.chunks}" if cfg.chunks > 1 else "")
                     + ": parallel_config has no schedule key; MindSpore's pipeline runs 1F1B")
    if cfg.precision:
        notes.append(f"precision={cfg.precision}: MindFormers sets it per model (model_config.compute_dtype, "
                     "param_init_type), not in the parallel config")
    if cfg.offload != "none":
        notes.append(f"offload={cfg.offload}: MindSpore's host/device heterogeneous storage is set outside "
                     "parallel and parallel_config")
    if layers := uneven_layers(cfg, plan):
        notes.append(f"layers per stage {layers}: MindFormers splits the layers evenly over pipeline_stage "
                     "(its model_config.offset shifts them)")
    return notes
