"""The cluster file format: its vocabulary and a JSON schema that checks it.

A cluster file is the JSON form of :class:`cost_models.hardware.ClusterSpec`
(see ``presets/*.json``). ``sources`` maps the dotted path of each number
(``"device.peak_flops.bfloat16"``) to where it comes from.
"""
from __future__ import annotations

import math
from typing import Any

from .errors import ClusterError

#: dtypes a device may list in ``peak_flops`` (torch names without ``torch.``).
DTYPES = ("float32", "tf32", "bfloat16", "float16")
#: values of ``default_precision``.
PRECISIONS = ("fp32", "mixed")
#: collectives the communication model knows.
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                    "send_recv", "broadcast")
#: scopes of calibrated collective overrides, see :mod:`cost_models.comm`.
COLLECTIVE_SCOPES = ("intra_node", "inter_node")

_POSITIVE = {"type": "number", "exclusiveMinimum": 0}
_NON_NEGATIVE = {"type": "number", "minimum": 0}
_FRACTION = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}

_LINK = {
    "type": "object",
    "required": ["bandwidth", "latency"],
    "properties": {"bandwidth": _POSITIVE, "latency": _NON_NEGATIVE},
    "additionalProperties": False,
}

_ALPHA_BETA = {
    "type": "object",
    "required": ["alpha", "beta"],
    "properties": {"alpha": _NON_NEGATIVE, "beta": _NON_NEGATIVE},
    "additionalProperties": False,
}

# One kind's override: either a single fit, or one fit per group size.
# if/then/else rather than oneOf so that errors point at the branch meant.
_OVERRIDE = {
    "type": "object",
    "if": {"anyOf": [{"required": ["alpha"]}, {"required": ["beta"]}]},
    "then": _ALPHA_BETA,
    "else": {"minProperties": 1,
             "propertyNames": {"pattern": "^[1-9][0-9]*$"},
             "additionalProperties": _ALPHA_BETA},
}

_SCOPE = {"type": "object", "propertyNames": {"enum": list(COLLECTIVE_KINDS)},
          "additionalProperties": _OVERRIDE}

CLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "device", "devices_per_node", "intra_node", "inter_node",
                 "default_precision"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "device": {
            "type": "object",
            "required": ["name", "memory_bytes", "peak_flops", "memory_bandwidth",
                         "matmul_efficiency", "memory_efficiency"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "memory_bytes": {"type": "integer", "minimum": 1},
                "peak_flops": {"type": "object", "minProperties": 1,
                               "propertyNames": {"enum": list(DTYPES)},
                               "additionalProperties": _POSITIVE},
                "memory_bandwidth": _POSITIVE,
                "matmul_efficiency": _FRACTION,
                "memory_efficiency": _FRACTION,
                "kernel_overhead_s": _NON_NEGATIVE,
                "dispatch_overhead_s": _NON_NEGATIVE,
                "checkpoint_dispatch_s": _NON_NEGATIVE,
                "unaligned_matmul_efficiency": {"type": "number", "minimum": 0, "maximum": 1},
                "optimizer_overhead_s": {"type": "object", "additionalProperties": _NON_NEGATIVE},
                "comm_overlap": {"type": "number", "minimum": 0, "maximum": 1},
                "comm_compute_share": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            },
            "additionalProperties": False,
        },
        "devices_per_node": {"type": "integer", "minimum": 1},
        "intra_node": _LINK,
        "inter_node": _LINK,
        "default_precision": {"enum": list(PRECISIONS)},
        "collectives": {"type": "object",
                        "propertyNames": {"enum": list(COLLECTIVE_SCOPES)},
                        "additionalProperties": _SCOPE},
        "sources": {"type": "object", "additionalProperties": {"type": "string"}},
        "max_nodes": {"type": ["integer", "null"], "minimum": 1},
        "host": {"type": "object", "required": ["link", "memory_bandwidth", "memory_bytes"],
                 "properties": {"link": _LINK, "memory_bandwidth": _POSITIVE,
                                "memory_bytes": {"type": "integer", "minimum": 1}},
                 "additionalProperties": False},
    },
    # A typo in an optional key would otherwise be silently ignored.
    "additionalProperties": False,
}


def validate_cluster_dict(d: Any, where: str = "cluster dict") -> None:
    """Check ``d`` against :data:`CLUSTER_SCHEMA`; return None.

    Raises ClusterError naming ``where`` (a file name) and the bad or missing key.
    """
    # Imported here: jsonschema is only needed when a cluster is loaded.
    import jsonschema

    bad = _non_finite(d)
    if bad is not None:
        raise ClusterError(f"{where}: invalid cluster at '{bad[0]}': {bad[1]} is not a finite number")
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(CLUSTER_SCHEMA).iter_errors(d))
    if error is not None:
        at = ".".join(str(p) for p in error.absolute_path) or "<top level>"
        raise ClusterError(f"{where}: invalid cluster at '{at}': {error.message}")


def _non_finite(d: Any, at: str = "") -> tuple[str, float] | None:
    """The dotted path and value of the first NaN or infinite number in ``d``
    (JSON Schema's bounds let both through: NaN compares false), or None."""
    if isinstance(d, float) and not math.isfinite(d):
        return at or "<top level>", d
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        found = _non_finite(v, f"{at}.{k}" if at else str(k))
        if found is not None:
            return found
    return None
