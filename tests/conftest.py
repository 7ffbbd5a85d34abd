"""Shared pytest set-up: make the helper modules in tests/ (e.g. ``distributed``) importable."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

#: the modules that spawn gloo process groups (4-8 processes each), longest first. `make test` runs 2
#: pytest-xdist workers with --dist loadgroup: these all go to one worker, one spawn after another (two
#: spawns at once put 8+ busy processes on the 2 cores and each ran slower than both in turn), while the
#: other worker runs the single-process modules, each module whole
DISTRIBUTED = ["test_real_models", "test_pipeline_runtime", "test_memory_options", "test_runtime_scenarios",
               "test_checkpoint", "test_benchmarks_runtime", "test_context_parallel", "test_parallel",
               "test_parallel_auto", "test_optim", "test_regions", "test_faults", "test_collectives",
               "test_calibrate", "test_redistribute"]


def pytest_collection_modifyitems(session, config, items):
    import pytest
    rank = {name: i for i, name in enumerate(DISTRIBUTED)}

    def module(item) -> str:
        return item.module.__name__.rsplit(".", 1)[-1]

    items.sort(key=lambda item: rank.get(module(item), len(rank)))
    for item in items:
        m = module(item)
        item.add_marker(pytest.mark.xdist_group("distributed" if m in rank else m))
