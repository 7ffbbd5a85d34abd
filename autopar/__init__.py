"""autopar: automatic parallelization planner and compiler for PyTorch.

    graph = autopar.trace(model, example_inputs)
    est   = autopar.evaluate(graph, cluster="dgx-a100-80g", devices=64, strategy="dp=8,tp=8", global_batch=512)
    plan  = autopar.plan(model, example_inputs, cluster="dgx-a100-80g", devices=64, global_batch=512)
    pm    = autopar.parallelize(model, example_inputs, loss_fn=..., optimizer=..., strategy="auto")
    autopar.shard(model.blocks[0].mlp.fc, weight="S(0)")   # pin a sharding; the search does the rest
"""
__version__ = "0.1.0"

# first: torchvision beside a torch its C extension was not built for (the CPU wheel) imports
# through this hook, and so does transformers, which imports torchvision (see zoo/vision.py)
from .zoo.vision import install_shim as _install_torchvision_shim  # noqa: E402

_install_torchvision_shim()

from .api import evaluate, load_cluster, plan, plan_and_record  # noqa: E402
from .cost import Estimate  # noqa: E402
from .errors import (AutoparError, CheckpointError, ClusterError, CompileError, DistributedError,  # noqa: E402
                     NoFeasibleStrategyError, NonFiniteLossError, PlanError, StrategyError, TraceError,
                     UnsupportedError, ZooError)
from .graph import Graph  # noqa: E402
from .parallelize import parallelize  # noqa: E402  (the function: it shadows its module's name)
from .plan import Plan  # noqa: E402
from .runtime.checkpoint import load_full_state_dict  # noqa: E402
from .search.pins import shard  # noqa: E402
from .spec import ParallelConfig, parse_strategy  # noqa: E402
from .trace import trace  # noqa: E402

__all__ = [
    "trace", "evaluate", "plan", "plan_and_record", "parallelize", "shard", "load_cluster", "Plan", "Graph", "Estimate",
    "ParallelConfig", "parse_strategy", "AutoparError", "TraceError", "ZooError", "StrategyError", "PlanError",
    "ClusterError", "NoFeasibleStrategyError", "NonFiniteLossError", "CompileError", "UnsupportedError",
    "DistributedError", "CheckpointError", "load_full_state_dict",
]
