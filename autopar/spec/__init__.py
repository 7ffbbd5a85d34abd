"""The strategy vocabulary: what a parallel strategy is, how it is spelled, and
what a placement on one mesh axis is. A leaf: it imports nothing of autopar
but :mod:`autopar.errors`, so every layer (cost, search, plan, compile,
runtime) may speak it.

* :mod:`autopar.spec.config`: :class:`ParallelConfig`, the per-key
  descriptions (:data:`FIELDS`) from which its string, dict and JSON-schema
  forms are generated, :func:`parse_strategy` with the seeds' aliases, and the
  pipeline-schedule rules (:func:`check_schedule`).
* :mod:`autopar.spec.placement`: the placement strings ``"R"``, ``"P"``, ``"S(d)"``.
"""
from .config import (ACCUMULATE, ALIASES, BUCKET_MB, FIELDS, KEYS, MESH_MODES, OFFLOAD, PIPELINE_SCHEDULES,
                     PRECISIONS, RECOMPUTE, TP_MODES, ZERO_STAGES, Key, ParallelConfig, check_fsdp_layers, check_grid,
                     check_schedule, describe, divisors, int_root, json_schema, key, parse_strategy, tp_grid,
                     zero_words)
from .placement import P, R, S, is_shard, local_chunk, shard_blocks, shard_dim, unblock

__all__ = ["ACCUMULATE", "ALIASES", "BUCKET_MB", "FIELDS", "KEYS", "OFFLOAD", "PIPELINE_SCHEDULES", "PRECISIONS",
           "RECOMPUTE", "TP_MODES", "MESH_MODES", "ZERO_STAGES", "int_root", "tp_grid", "Key", "ParallelConfig",
           "check_grid", "check_fsdp_layers", "check_schedule", "describe", "divisors", "json_schema", "key",
           "parse_strategy", "zero_words", "P", "R", "S", "is_shard", "shard_dim"]
