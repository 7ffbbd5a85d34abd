"""Hardware cost models: device and cluster specs, compute, memory, communication.

Standalone: imports only the standard library, numpy and (to check cluster
files) jsonschema, never torch or autopar.
"""
from .comm import MeshTopology, collective_time, fit_alpha_beta
from .compute import op_time
from .errors import ClusterError
from .hardware import ClusterSpec, DeviceSpec, HostSpec, LinkSpec
from .memory import dtype_bytes, model_state_bytes, optimizer_step_bytes, zero_sharded_state_bytes
from .presets import list_presets, load_cluster

__all__ = [
    "ClusterError", "ClusterSpec", "DeviceSpec", "HostSpec", "LinkSpec", "MeshTopology",
    "collective_time", "dtype_bytes", "fit_alpha_beta", "list_presets", "load_cluster",
    "model_state_bytes", "op_time", "optimizer_step_bytes", "zero_sharded_state_bytes",
]
