"""Configs in and out: Colossal-AI, MindFormers and torchtitan.

Users arrive with a config of the framework they know; these read it into a
:class:`~autopar.spec.ParallelConfig` (and notes on what was read only
approximately), and write a plan or strategy back in that framework's form
(and notes on what it cannot express, and where that framework keeps it)::

    from autopar import compat
    got = compat.from_colossal("config.py", devices=16)      # Imported: .config, .strategy, .notes
    out = compat.to_mindformers(plan)                         # Exported: .data, .text (YAML), .notes

* :mod:`~autopar.compat.colossal`: ``parallel = dict(...)`` Python configs (read with ast, never run);
* :mod:`~autopar.compat.mindformers`: the YAML ``parallel`` context and ``parallel_config``;
* :mod:`~autopar.compat.torchtitan`: the job TOML's ``[parallelism]`` (written; read back as a bonus).

A layer above :mod:`autopar.plan`: it imports only the plan, the strategy
vocabulary (:mod:`autopar.spec`) and the errors; ``cli.py`` imports it.
"""
from .colossal import from_colossal, read_python_config, to_colossal
from .common import Exported, Imported
from .mindformers import from_mindformers, read_yaml, to_mindformers
from .torchtitan import from_torchtitan, to_torchtitan

FORMATS = ("colossal", "mindformers", "torchtitan")
READERS = {"colossal": from_colossal, "mindformers": from_mindformers, "torchtitan": from_torchtitan}
WRITERS = {"colossal": to_colossal, "mindformers": to_mindformers, "torchtitan": to_torchtitan}

__all__ = ["Exported", "Imported", "FORMATS", "READERS", "WRITERS", "from_colossal", "to_colossal",
           "from_mindformers", "to_mindformers", "from_torchtitan", "to_torchtitan", "read_python_config",
           "read_yaml"]
