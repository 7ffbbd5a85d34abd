"""The one exception of the cost models.

``cost_models`` is importable without autopar, so it owns its error type;
autopar wraps or re-exports it.
"""
from __future__ import annotations


class ClusterError(ValueError):
    """A cluster preset, cluster file or device query is unknown or malformed.

    The message names the offending value (preset, file, key, dtype, device
    count) and what would be valid.
    """
