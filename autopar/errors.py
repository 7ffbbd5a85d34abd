"""Every bad input ends in one of these exceptions.

Each message names the offending value and what would be valid, so a user can
fix the call without reading autopar's source.
"""
from __future__ import annotations


class AutoparError(Exception):
    """Base class of all errors autopar raises on purpose."""


class TraceError(AutoparError):
    """The model could not be traced (names the module and the reason)."""


class ZooError(AutoparError, ValueError):
    """A model string (``family:key=value,...`` or ``file.py:factory``) is invalid."""


class StrategyError(AutoparError, ValueError):
    """A manual strategy is malformed or does not fit the model / world size."""


class ConfigError(StrategyError):
    """A Colossal-AI, MindFormers or torchtitan config is malformed or breaks
    one of that framework's rules (names the file, the field and what would be valid)."""


class PlanError(AutoparError, ValueError):
    """A plan file is invalid, of an unknown version, or for another model."""


class ClusterError(AutoparError, ValueError):
    """A cluster preset or cluster file is unknown or malformed."""


class NoFeasibleStrategyError(AutoparError):
    """No strategy in the search space fits in device memory."""


class CompileError(AutoparError):
    """The plan cannot be turned into a per-rank program."""


class UnsupportedError(AutoparError, NotImplementedError):
    """The request is valid but this version of autopar cannot execute it yet."""


class DistributedError(AutoparError, RuntimeError):
    """Process-group set-up or a collective failed (wrong world size, timeout...)."""


class NonFiniteLossError(AutoparError, FloatingPointError):
    """A training step's loss was NaN or infinite (names the step); the update was not applied."""


class CheckpointError(AutoparError):
    """A checkpoint could not be written or read: a missing or incomplete
    checkpoint, one of another model, or a failed write (names the path)."""
