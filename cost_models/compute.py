"""Roofline model of one op's run time on one device."""
from __future__ import annotations

from .hardware import DeviceSpec

#: families that run on matmul units (tensor cores) and reach matmul_efficiency.
MATMUL_FAMILIES = ("matmul", "conv", "attention")
#: everything else: elementwise, reductions, norms, softmax, copies.
OTHER_FAMILIES = ("other",)


def op_time(device: DeviceSpec, flops: float, nbytes: float, dtype: str = "float32",
            family: str = "matmul", aligned: bool = True) -> float:
    """Return the predicted seconds of one op (one kernel launch).

    time = kernel_overhead_s + max(flops / compute_rate, nbytes / (bandwidth *
    memory_efficiency)), where ``nbytes`` counts every byte read and written.
    For matmul families compute_rate = flops(dtype) * matmul_efficiency, or
    * unaligned_matmul_efficiency for a product with a dimension that is not a
    multiple of 16 bytes (``aligned=False``) on a device that sets it. Other
    ops do not run on tensor cores, so their compute rate is the plain
    "float32" (CUDA core / vector unit) peak at memory_efficiency: such kernels
    are streaming kernels, in practice always bandwidth bound. A device without
    "float32" uses its smallest listed peak.

    Raises ValueError for negative sizes or an unknown family, ClusterError for
    a dtype the device lacks.
    """
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and nbytes must be >= 0, got {flops}, {nbytes}")
    if family in MATMUL_FAMILIES:
        eff = device.matmul_efficiency if aligned else (device.unaligned_matmul_efficiency or device.matmul_efficiency)
        rate = device.flops(dtype) * eff
    elif family in OTHER_FAMILIES:
        device.flops(dtype)  # still reject a dtype the device cannot run
        vector_peak = device.peak_flops.get("float32", min(device.peak_flops.values()))
        rate = vector_peak * device.memory_efficiency
    else:
        raise ValueError(f"unknown op family {family!r}; valid: "
                         f"{', '.join(MATMUL_FAMILIES + OTHER_FAMILIES)}")
    compute = flops / rate
    memory = nbytes / (device.memory_bandwidth * device.memory_efficiency)
    return device.kernel_overhead_s + max(compute, memory)
