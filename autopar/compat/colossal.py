"""Colossal-AI configs in and out: ``parallel = dict(data=, pipeline=, tensor=dict(size=, mode=, depth=))``.

A config file is read with :mod:`ast`, never run: a config from elsewhere
cannot execute code here. What is read are the top-level assignments whose
values are literals (numbers, strings, ``dict(...)``, ``{...}``, lists, simple
arithmetic, names assigned earlier in the file, dotted names such as
``AMP_TYPE.TORCH`` kept as their text); anything else is left out, and a
``parallel`` that is not such a literal is an error naming its line.

The seed's rules (Colossal-AI's "Configure the Combination of
Parallelization") are each a :class:`ConfigError` naming the field: a tensor
size without a mode, a mode without a size, 2D on a non-square size, 2.5D
whose size is not ``depth x q^2``, 3D on a non-cube, pipeline x tensor not
dividing the world, a data size that is not what the world leaves. ``1d`` is
autopar's ``tp``, ``sequence`` (ring self-attention: the sequence split over
the group) its context parallel ``cp``; ``2d``, ``2.5d`` and ``3d`` are
``tp_mode=`` (with ``tp_depth=`` for 2.5D).
"""
from __future__ import annotations

import ast
import math
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnsupportedError
from ..plan import Plan
from ..spec import ParallelConfig, divisors
from .common import (Exported, Imported, Source, build, common_losses, context_parallel, cp_of, mapping,
                     positive_int, read_config, source, uneven_layers)

MODES = ("1d", "2d", "2.5d", "3d", "sequence")
SPELLED = {"dp": "parallel.data", "tp": "parallel.tensor.size", "pp": "parallel.pipeline",
           "microbatches": "NUM_MICRO_BATCHES (or gradient_accumulation without a pipeline)",
           "chunks": "NUM_CHUNKS", "precision": "fp16"}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Pow: operator.pow, ast.Mod: operator.mod}


# ------------------------------------------------------------------ reading the file
def read_python_config(path: str | os.PathLike) -> dict[str, Any]:
    """The literal top-level assignments of the Colossal-AI config file ``path``
    (name -> value), read with :mod:`ast`; the file is not executed.

    Raises :class:`ConfigError` for a missing or unparsable file, and for a
    ``parallel`` assignment that is not a literal (naming its line)."""
    p = Path(path)
    tree = read_config(p, "Colossal-AI", lambda text: ast.parse(text, str(p)), SyntaxError, "Python")
    names: dict[str, Any] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            try:
                names[target.id] = _literal(node.value, names)
            except ValueError as e:
                if target.id == "parallel":
                    raise ConfigError(f"Colossal-AI config {str(p)!r}, line {node.lineno}: parallel is not a "
                                      f"literal autopar can read without running the file ({e}); write the "
                                      "sizes as numbers, e.g. parallel = dict(pipeline=2, tensor=dict(size=4, "
                                      "mode='1d'))") from None
                names.pop(target.id, None)
    return names


def _literal(node: ast.AST, names: Mapping[str, Any]) -> Any:
    """The value of a literal expression; raises ValueError (with the offending text) for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"          # AMP_TYPE.TORCH and the like, kept as text
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, names) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k, names): _literal(v, names) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args \
            and all(k.arg is not None for k in node.keywords):
        return {k.arg: _literal(k.value, names) for k in node.keywords}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand, names)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _literal(node.left, names), _literal(node.right, names)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (left, right)):
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 2 ** 32):
                raise ValueError(f"`{ast.unparse(node)}` (a power too large to be a size)")   # 10**10**9 would hang
            try:
                return _BINOPS[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError) as e:
                raise ValueError(f"`{ast.unparse(node)}` ({e})") from None
    raise ValueError(f"`{ast.unparse(node)}`")


# ------------------------------------------------------------------ config -> strategy
def from_colossal(cfg_or_path: str | os.PathLike | Mapping[str, Any], devices: int | None = None) -> Imported:
    """The strategy of a Colossal-AI config on ``devices``.

    ``cfg_or_path`` is a config file (read with :mod:`ast`, never run), a
    config dict holding ``parallel`` (and optionally ``NUM_MICRO_BATCHES``,
    ``NUM_CHUNKS``, ``schedule=dict(num_microbatches=)``,
    ``gradient_accumulation``, ``fp16``), or the ``parallel`` dict itself.
    ``devices`` is the world size; without it ``parallel.data`` must be given.

    Raises :class:`ConfigError` for a config that breaks one of the seed's
    rules (naming the field), :class:`UnsupportedError` for the sequence mode
    where the strategy has no ``cp``. The 2D, 2.5D and 3D tensor modes become
    ``tp_mode=`` (and ``tp_depth=``)."""
    if isinstance(cfg_or_path, Mapping):
        where = "Colossal-AI config"
        cfg = dict(cfg_or_path) if "parallel" in cfg_or_path or not set(cfg_or_path) <= {"data", "pipeline", "tensor"} \
            else {"parallel": dict(cfg_or_path)}
    else:
        where = f"Colossal-AI config {str(cfg_or_path)!r}"
        cfg = read_python_config(cfg_or_path)
    par = mapping(cfg.get("parallel"), "parallel", where)
    unknown = sorted(set(par) - {"data", "pipeline", "tensor"})
    if unknown:
        raise ConfigError(f"{where}: parallel.{unknown[0]} is not a Colossal-AI parallel key; valid: data, "
                          "pipeline, tensor")
    pp = _size(par.get("pipeline"), "parallel.pipeline", where)
    tp, mode = _tensor(par.get("tensor"), where)
    if devices is None:
        if "data" not in par:
            raise ConfigError(f"{where}: give the device count (Colossal-AI infers parallel.data from the world "
                              "size), or parallel.data")
        devices = _size(par["data"], "parallel.data", where) * pp * tp
    positive_int(devices, "the device count", where)
    if devices % (pp * tp):
        raise ConfigError(f"{where}: parallel.pipeline={pp} x parallel.tensor.size={tp} = {pp * tp} does not "
                          f"divide the {devices} devices; their product must be one of "
                          f"{', '.join(map(str, divisors(devices)))}")
    dp = devices // (pp * tp)
    if "data" in par and _size(par["data"], "parallel.data", where) != dp:
        raise ConfigError(f"{where}: parallel.data={_size(par['data'], 'parallel.data', where)}, but {devices} "
                          f"devices / (pipeline {pp} x tensor {tp}) leave {dp}; leave data out (Colossal-AI "
                          f"infers it) or write data={dp}")
    keys, notes = _extras(cfg, pp, where)
    if mode in ("2d", "2.5d", "3d"):     # the grid's shape was checked by _check_mode
        keys["tp_mode"] = mode
        if mode == "2.5d":
            keys["tp_depth"] = positive_int(par["tensor"]["depth"], "parallel.tensor.depth", where)
        if mode == "3d":
            notes.append("tensor mode '3d' runs as autopar's cube: Colossal-AI's layout at rest (1/q^3 of "
                         "every matrix per rank of the q x q x q cube, the samples over depth x rows), its matmuls "
                         "as 1D tensor parallelism on the columns with each weight gathered over rows x depth, "
                         "not Bian et al.'s matmul schedule; tp_mode=mesh3 lets one program pick Bian's layout "
                         "per linear where it pays (benchmarks/mesh3_bian.py)")
    if mode == "sequence":    # Li et al. 2021: the sequence split over the group, ring self-attention
        keys.update(context_parallel(tp, "parallel.tensor.size with mode='sequence' (ring self-attention)", where,
                                     "; autopar's sequence_parallel=true is Megatron's (norms and dropout split "
                                     "along the sequence inside a 1D tensor-parallel group): use "
                                     "tensor=dict(size=N, mode='1d') and add sequence_parallel=true"))
        notes.append(f"tensor mode 'sequence' read as cp={tp} (context parallel): the same split of the sequence, "
                     "weights replicated; autopar's attention all-gathers keys and values instead of passing "
                     "them around a ring")
        tp = 1
    return Imported(build({"dp": dp, "tp": tp, "pp": pp, **keys}, devices, where, SPELLED), tuple(notes))


def _tensor_out(cfg: ParallelConfig) -> dict[str, Any]:
    """The ``tensor`` dict of a strategy with ``tp > 1``: its size, mode (and 2.5D's depth)."""
    mode = getattr(cfg, "tp_mode", "1d")
    if mode in ("mesh", "mesh3"):      # no Colossal-AI mode: written as 1D (common.lost_notes says so)
        mode = "1d"
    return {"size": cfg.tp, "mode": mode, **({"depth": cfg.tp_depth} if mode == "2.5d" else {})}


def _size(value: Any, field: str, where: str) -> int:
    """A parallel size written as an int or ``dict(size=...)`` (absent: 1)."""
    if value is None:
        return 1
    if isinstance(value, Mapping):
        extra = sorted(set(value) - {"size"})
        if extra:
            raise ConfigError(f"{where}: {field}.{extra[0]} is not a key of {field}; it takes only size")
        if "size" not in value:
            raise ConfigError(f"{where}: {field} is a dict without size; write {field.split('.')[-1]}=dict(size=N)")
        return positive_int(value["size"], f"{field}.size", where)
    return positive_int(value, field, where)


def _tensor(value: Any, where: str) -> tuple[int, str | None]:
    """The tensor size and mode, checked against the seed's rules for each mode."""
    if value is None:
        return 1, None
    if not isinstance(value, Mapping):
        size = positive_int(value, "parallel.tensor", where)
        if size > 1:
            raise ConfigError(f"{where}: parallel.tensor={size} has no mode; Colossal-AI needs one: write "
                              f"tensor=dict(size={size}, mode='1d') (or '2d', '2.5d', '3d')")
        return 1, None
    extra = sorted(set(value) - {"size", "mode", "depth"})
    if extra:
        raise ConfigError(f"{where}: parallel.tensor.{extra[0]} is not a tensor key; valid: size, mode, depth")
    mode = value.get("mode")
    if mode is not None:
        if not isinstance(mode, str) or mode.lower() not in MODES:
            raise ConfigError(f"{where}: parallel.tensor.mode={mode!r} is invalid; valid: "
                              f"{', '.join(map(repr, MODES))} (or None with size 1)")
        mode = mode.lower()
    if "size" not in value:
        if mode is not None:
            raise ConfigError(f"{where}: parallel.tensor has mode={mode!r} but no size; write "
                              f"tensor=dict(size=N, mode={mode!r})")
        return 1, None
    size = positive_int(value["size"], "parallel.tensor.size", where)
    if mode is None:
        if size > 1:
            raise ConfigError(f"{where}: parallel.tensor.size={size} has no mode; Colossal-AI needs one: "
                              f"add mode='1d' (or '2d', '2.5d', '3d')")
        return 1, None
    if "depth" in value and mode != "2.5d":
        raise ConfigError(f"{where}: parallel.tensor.depth is for mode='2.5d' only, got mode={mode!r}")
    _check_mode(size, mode, value.get("depth"), where)
    return size, mode


def _check_mode(size: int, mode: str, depth: Any, where: str) -> None:
    """The seed's shape rules: 2D on q^2 devices, 2.5D on depth x q^2, 3D on q^3."""
    def root(n: int, k: int) -> int | None:
        q = round(n ** (1 / k))
        return next((r for r in (q - 1, q, q + 1) if r > 0 and r ** k == n), None)

    if mode == "2d" and root(size, 2) is None:
        squares = [q * q for q in range(1, math.isqrt(size) + 2)][-2:]
        raise ConfigError(f"{where}: parallel.tensor.size={size} with mode='2d' must be a square (a q x q grid); "
                          f"nearest: {', '.join(map(str, squares))}")
    if mode == "2.5d":
        if depth is None:
            raise ConfigError(f"{where}: parallel.tensor mode='2.5d' needs depth (size = depth x q^2), e.g. "
                              f"tensor=dict(size=8, mode='2.5d', depth=2)")
        d = positive_int(depth, "parallel.tensor.depth", where)
        if size % d or root(size // d, 2) is None:
            raise ConfigError(f"{where}: parallel.tensor.size={size} with mode='2.5d', depth={d} must be depth x q^2 "
                              f"(q x q grids, depth of them), e.g. {d * 1}, {d * 4}, {d * 9}")
    if mode == "3d" and root(size, 3) is None:
        q = max(1, round(size ** (1 / 3)))
        raise ConfigError(f"{where}: parallel.tensor.size={size} with mode='3d' must be a cube (a q x q x q "
                          f"grid); nearest: {', '.join(str(r ** 3) for r in (q, q + 1) if r ** 3 != size)}")


def _extras(cfg: Mapping[str, Any], pp: int, where: str) -> tuple[dict[str, Any], list[str]]:
    """The strategy keys outside ``parallel``: microbatches, chunks, fp16; and notes on what is not read."""
    keys: dict[str, Any] = {}
    notes: list[str] = []
    schedule = mapping(cfg.get("schedule"), "schedule", where)
    micro = {f: positive_int(v, f, where) for f, v in (("NUM_MICRO_BATCHES", cfg.get("NUM_MICRO_BATCHES")),
                                                        ("schedule.num_microbatches", schedule.get("num_microbatches")))
             if v is not None}
    if len(set(micro.values())) > 1:
        raise ConfigError(f"{where}: NUM_MICRO_BATCHES={micro['NUM_MICRO_BATCHES']} and schedule.num_microbatches="
                          f"{micro['schedule.num_microbatches']} disagree; keep one")
    accumulate = positive_int(cfg.get("gradient_accumulation", 1), "gradient_accumulation", where)
    chunks = positive_int(cfg.get("NUM_CHUNKS", 1), "NUM_CHUNKS", where)
    if pp > 1:
        m = next(iter(micro.values()), None)
        if m is None:
            notes.append(f"NUM_MICRO_BATCHES not given: microbatches={pp * accumulate} (autopar's default, pp)")
            m = pp
        if accumulate > 1:
            notes.append(f"gradient_accumulation={accumulate} over a pipeline of {m} microbatches: read as "
                         f"microbatches={m * accumulate} (the same samples per optimizer step)")
        keys["microbatches"] = m * accumulate
        if chunks > 1:
            keys["schedule"], keys["chunks"] = "interleaved", chunks
    else:
        if micro:
            notes.append(f"{', '.join(micro)} is for a pipeline; with pipeline=1 it is not read")
        if chunks > 1:
            raise ConfigError(f"{where}: NUM_CHUNKS={chunks} interleaves model chunks of a pipeline; it needs "
                              "parallel.pipeline > 1")
        keys["microbatches"] = accumulate
    if cfg.get("fp16") is not None:
        keys["precision"] = "fp16"
        notes.append("fp16 read as precision=fp16 (fp32 master weights, dynamic loss scaling)")
    if cfg.get("zero") is not None:
        notes.append("zero=dict(...) is not read: give the ZeRO stage as zero=N in the strategy")
    return keys, notes


# ------------------------------------------------------------------ strategy -> config
def to_colossal(what: Source) -> Exported:
    """A plan or strategy as a Colossal-AI config: ``data`` holds ``parallel``
    (and ``NUM_MICRO_BATCHES``, ``NUM_CHUNKS``, ``gradient_accumulation``,
    ``fp16`` where they apply), ``text`` the Python file; ``notes`` list what
    Colossal-AI's config cannot say (and where Colossal-AI keeps it)."""
    cfg, plan = source(what)
    par: dict[str, Any] = {}
    if cfg.pp > 1:
        par["pipeline"] = {"size": cfg.pp}
    if cfg.tp > 1 and cp_of(cfg) > 1:
        raise UnsupportedError(f"{cfg.to_string()}: Colossal-AI's parallel dict has one tensor mode, so tp={cfg.tp} "
                               f"(mode='1d') and cp={cp_of(cfg)} (mode='sequence') cannot both be written")
    if cfg.tp > 1 or cp_of(cfg) > 1:
        par["tensor"] = _tensor_out(cfg) if cfg.tp > 1 else {"size": cp_of(cfg), "mode": "sequence"}
    data: dict[str, Any] = {"parallel": par}
    if cfg.pp > 1:
        data["NUM_MICRO_BATCHES"] = cfg.microbatches
        if cfg.chunks > 1:
            data["NUM_CHUNKS"] = cfg.chunks
    elif cfg.microbatches > 1:
        data["gradient_accumulation"] = cfg.microbatches
    if cfg.precision == "fp16":
        data["fp16"] = {"mode": "AMP_TYPE.TORCH"}
    notes = _losses(cfg, plan)
    lines = [f"# Colossal-AI config written by autopar for {cfg.to_string()}",
             f"# data parallel size {cfg.dp} is inferred by Colossal-AI from the world size ({cfg.devices})"]
    if "fp16" in data:
        lines.append("from colossalai.amp import AMP_TYPE")
    lines += [f"{k} = {_python(v)}" for k, v in data.items()]
    return Exported(data, "\n".join(lines) + "\n", tuple(notes))


def _python(value: Any) -> str:
    """``value`` as Python source in Colossal-AI's style (``dict(k=v)``; ``AMP_TYPE.X`` unquoted)."""
    if isinstance(value, Mapping):
        return "dict(" + ", ".join(f"{k}={_python(v)}" for k, v in value.items()) + ")"
    if isinstance(value, str) and value.startswith("AMP_TYPE."):
        return value
    return repr(value)


def _losses(cfg: ParallelConfig, plan: Plan | None) -> list[str]:
    """What Colossal-AI's config does not carry, and where Colossal-AI puts it."""
    notes = common_losses(cfg, plan, "Colossal-AI config")
    if cp_of(cfg) > 1:
        notes.append(f"cp={cp_of(cfg)} written as tensor mode 'sequence': Colossal-AI runs ring self-attention "
                     "there, autopar all-gathers keys and values (the same split of the sequence)")
    if cfg.zero:
        notes.append(f"zero={cfg.zero}: not in `parallel`; Colossal-AI sets ZeRO in its legacy zero=dict(...) "
                     f"config or with the booster's plugins (LowLevelZeroPlugin(stage=1|2), GeminiPlugin, "
                     f"HybridParallelPlugin(zero_stage=...))")
    if cfg.recompute != "none":
        notes.append(f"recompute={cfg.recompute}: activation checkpointing is model code in Colossal-AI "
                     "(torch.utils.checkpoint around the blocks), not config")
    if cfg.sequence_parallel:
        notes.append("sequence_parallel=true (Megatron's, inside the tp group): Colossal-AI's tensor mode "
                     "'sequence' is another method (ring self-attention); HybridParallelPlugin("
                     "enable_sequence_parallelism=True) is the closest")
    if cfg.pp > 1 and cfg.schedule == "gpipe":
        notes.append("schedule=gpipe: Colossal-AI's pipeline schedules are 1F1B (PipelineSchedule) and "
                     "interleaved 1F1B (NUM_CHUNKS); it would run 1F1B")
    if cfg.precision == "bf16":
        notes.append("precision=bf16: the legacy fp16=dict(mode=AMP_TYPE...) is fp16 only; "
                     "HybridParallelPlugin(precision='bf16') is the booster's way")
    if cfg.offload != "none":
        notes.append(f"offload={cfg.offload}: not in `parallel`; Colossal-AI offloads through its booster "
                     "plugins (GeminiPlugin, LowLevelZeroPlugin(cpu_offload=True))")
    if layers := uneven_layers(cfg, plan):
        notes.append(f"layers per stage {layers}: Colossal-AI partitions the layers itself "
                     "(PipelinableContext / build_pipeline_model)")
    return notes
