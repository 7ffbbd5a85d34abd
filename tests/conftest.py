"""Shared pytest set-up: make the helper modules in tests/ (e.g. ``distributed``) importable."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

#: test modules by running time, longest first (one spawn of 4-8 processes each). `make test` runs the
#: suite on 2 pytest-xdist workers that take whole files in collection order: the long files start
#: first so that no long file runs alone at the end while the other worker idles
LONGEST_FIRST = ["test_real_models", "test_pipeline_runtime", "test_memory_options", "test_runtime_scenarios",
                 "test_checkpoint", "test_benchmarks_runtime", "test_context_parallel", "test_parallel",
                 "test_parallel_auto", "test_optim", "test_regions", "test_faults", "test_collectives", "test_ilp",
                 "test_calibrate"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))
