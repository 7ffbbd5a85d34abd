"""What the planner knows about hardware: a device, a link, a cluster of nodes.

Units are SI throughout: bytes, seconds, FLOP/s, bytes/s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ClusterError
from .schema import validate_cluster_dict


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process).

    ``peak_flops`` maps the dtypes the device has ("float32", "tf32",
    "bfloat16", "float16") to dense peak FLOP/s. ``matmul_efficiency`` and
    ``memory_efficiency`` are the achievable fractions of peak compute and
    bandwidth; ``kernel_overhead_s`` is the fixed cost of launching one op.
    ``unaligned_matmul_efficiency`` is the fraction of peak a matrix product
    reaches when one of its dimensions is not a multiple of 16 bytes (GPT-2's
    vocabulary of 50257: cuBLAS then runs kernels without vectorised loads);
    0 where the device does not slow down (the aligned rate applies).

    Host-bound devices (a CPU process: every op runs synchronously in Python)
    also pay ``dispatch_overhead_s`` per op and pass, views included: the
    framework's own time (fx, autograd, Python) in a training step; and
    ``optimizer_overhead_s[optimizer]`` per parameter tensor per optimizer
    step (a loop over the tensors). On a GPU that host time overlaps the
    kernels, so GPU presets leave both at 0.

    ``checkpoint_dispatch_s`` is the host time per traced op that runs under
    selective recompute: torch's selective activation checkpointing routes
    every op of a checkpointed layer through a Python dispatch mode, in the
    forward and again in the recompute. It adds to the layer's time, on a
    GPU too (measured: it is not hidden behind the kernels); it matters for
    small layers, where a layer's kernels last about as long as its ops'
    dispatch.

    ``comm_overlap`` is the fraction of compute time that communication
    launched alongside it (gradient buckets during backward, prefetched
    ZeRO-3 gathers) can hide behind: 1 where collectives run on their own
    engines (GPUs with NCCL), less where they compete with compute for the
    same cores.

    ``comm_compute_share`` is the fraction of the device's compute a running
    collective takes from the kernels beside it: NCCL moves data with thread
    blocks that occupy streaming multiprocessors (one per channel), so a GEMM
    overlapped with a collective runs on the SMs left. Hiding communication
    is therefore not free: every second a collective runs beside compute
    stretches that compute by this fraction of a second (0 where
    communication has engines of its own, or does not overlap at all).
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    matmul_efficiency: float
    memory_efficiency: float
    kernel_overhead_s: float = 0.0
    dispatch_overhead_s: float = 0.0
    optimizer_overhead_s: dict[str, float] = field(default_factory=dict)
    comm_overlap: float = 1.0
    comm_compute_share: float = 0.0
    checkpoint_dispatch_s: float = 0.0
    unaligned_matmul_efficiency: float = 0.0

    def __hash__(self) -> int:
        # The generated hash would fail on the dict field; specs key caches.
        return hash((self.name, self.memory_bytes, tuple(sorted(self.peak_flops.items())),
                     self.memory_bandwidth, self.matmul_efficiency, self.memory_efficiency,
                     self.kernel_overhead_s, self.dispatch_overhead_s,
                     tuple(sorted(self.optimizer_overhead_s.items())), self.comm_overlap,
                     self.comm_compute_share, self.checkpoint_dispatch_s, self.unaligned_matmul_efficiency))

    def flops(self, dtype: str) -> float:
        """Return the peak FLOP/s for ``dtype``.

        "float32" is the true fp32 rate even on devices with TF32: PyTorch does
        not use TF32 for matmuls unless the user opts in, so asking for "tf32"
        is explicit. Raises ClusterError for a dtype the device does not list.
        """
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ClusterError(
                f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"valid: {sorted(self.peak_flops)}") from None


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth in bytes/s per device per direction, latency in s."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class HostSpec:
    """The host side of one device, for offloading: ``link`` is the
    device-host link (PCIe) per device per direction, ``memory_bandwidth`` the
    host DRAM bandwidth one device's share of the host can stream (the CPU
    optimizer step is bound by it), ``memory_bytes`` the host DRAM of a node."""

    link: LinkSpec
    memory_bandwidth: float
    memory_bytes: int


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of ``devices_per_node`` devices each.

    ``intra_node`` links devices of one node, ``inter_node`` devices of
    different nodes. ``default_precision`` is "mixed" or "fp32".
    ``collectives`` holds calibrated overrides (format in :mod:`cost_models.comm`),
    ``sources`` where each number comes from, ``max_nodes`` the largest number of
    nodes (None: unbounded), ``host`` the device-host link and host memory
    (None: offloading is not modelled for this cluster).
    """

    name: str
    description: str
    device: DeviceSpec
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    default_precision: str
    collectives: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    max_nodes: int | None = None
    host: HostSpec | None = None

    def __hash__(self) -> int:
        # The generated hash would fail on the dict fields; specs key caches.
        return hash(json.dumps(self.to_dict()))

    @property
    def compute_dtype(self) -> str:
        """Return the matmul dtype of ``default_precision``: "float32" for fp32,
        "bfloat16" (else "float16" if the device lacks it) for mixed."""
        if self.default_precision == "fp32":
            return "float32"
        return "bfloat16" if "bfloat16" in self.device.peak_flops else "float16"

    def check_devices(self, n: int) -> int:
        """Return the number of nodes ``n`` devices occupy.

        Raises ClusterError when ``n`` is not positive, when ``n`` exceeds one
        node without being a multiple of ``devices_per_node`` (partial nodes are
        not modelled), or when it needs more than ``max_nodes`` nodes.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ClusterError(f"cluster {self.name!r}: device count must be a "
                               f"positive integer, got {n!r}")
        if n <= self.devices_per_node:
            return 1
        if n % self.devices_per_node:
            raise ClusterError(
                f"cluster {self.name!r}: {n} devices span several nodes but are not "
                f"a multiple of devices_per_node={self.devices_per_node}")
        nodes = n // self.devices_per_node
        if self.max_nodes is not None and nodes > self.max_nodes:
            raise ClusterError(
                f"cluster {self.name!r}: {n} devices need {nodes} nodes, at most "
                f"{self.max_nodes} available ({self.max_nodes * self.devices_per_node} devices)")
        return nodes

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form, keys sorted at every level;
        ``from_dict(to_dict())`` equals ``self``."""
        d = {
            "name": self.name,
            "description": self.description,
            "device": {
                "name": self.device.name,
                "memory_bytes": self.device.memory_bytes,
                "peak_flops": dict(self.device.peak_flops),
                "memory_bandwidth": self.device.memory_bandwidth,
                "matmul_efficiency": self.device.matmul_efficiency,
                "memory_efficiency": self.device.memory_efficiency,
                "kernel_overhead_s": self.device.kernel_overhead_s,
                "dispatch_overhead_s": self.device.dispatch_overhead_s,
                "optimizer_overhead_s": dict(self.device.optimizer_overhead_s),
                "comm_overlap": self.device.comm_overlap,
                "comm_compute_share": self.device.comm_compute_share,
                "checkpoint_dispatch_s": self.device.checkpoint_dispatch_s,
                "unaligned_matmul_efficiency": self.device.unaligned_matmul_efficiency,
            },
            "devices_per_node": self.devices_per_node,
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
            "default_precision": self.default_precision,
            "collectives": self.collectives,
            "sources": self.sources,
            "max_nodes": self.max_nodes,
        }
        if self.host is not None:
            d["host"] = {"link": _link_dict(self.host.link), "memory_bandwidth": self.host.memory_bandwidth,
                         "memory_bytes": self.host.memory_bytes}
        return _sorted(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "cluster dict") -> ClusterSpec:
        """Return the ClusterSpec of a dict in the cluster file format.

        Raises ClusterError (naming ``where`` and the key) when ``d`` is malformed.
        """
        validate_cluster_dict(d, where)
        dev = d["device"]
        device = DeviceSpec(
            name=dev["name"],
            memory_bytes=int(dev["memory_bytes"]),
            # float(): JSON may spell 19.5e12 as an integer; keep types stable.
            peak_flops={k: float(v) for k, v in sorted(dev["peak_flops"].items())},
            memory_bandwidth=float(dev["memory_bandwidth"]),
            matmul_efficiency=float(dev["matmul_efficiency"]),
            memory_efficiency=float(dev["memory_efficiency"]),
            kernel_overhead_s=float(dev.get("kernel_overhead_s", 0.0)),
            dispatch_overhead_s=float(dev.get("dispatch_overhead_s", 0.0)),
            optimizer_overhead_s={k: float(v) for k, v in sorted(dev.get("optimizer_overhead_s", {}).items())},
            comm_overlap=float(dev.get("comm_overlap", 1.0)),
            comm_compute_share=float(dev.get("comm_compute_share", 0.0)),
            checkpoint_dispatch_s=float(dev.get("checkpoint_dispatch_s", 0.0)),
            unaligned_matmul_efficiency=float(dev.get("unaligned_matmul_efficiency", 0.0)),
        )
        return cls(
            name=d["name"],
            description=d.get("description", ""),
            device=device,
            devices_per_node=int(d["devices_per_node"]),
            intra_node=_link(d["intra_node"]),
            inter_node=_link(d["inter_node"]),
            default_precision=d["default_precision"],
            collectives=_sorted(d.get("collectives", {})),
            sources=dict(sorted(d.get("sources", {}).items())),
            max_nodes=d.get("max_nodes"),
            host=HostSpec(link=_link(d["host"]["link"]), memory_bandwidth=float(d["host"]["memory_bandwidth"]),
                          memory_bytes=int(d["host"]["memory_bytes"])) if d.get("host") else None,
        )


def _link(d: dict[str, Any]) -> LinkSpec:
    return LinkSpec(bandwidth=float(d["bandwidth"]), latency=float(d["latency"]))


def _link_dict(link: LinkSpec) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def _sorted(x: Any) -> Any:
    """Return a deep copy of nested dicts with keys sorted (deterministic JSON)."""
    if isinstance(x, dict):
        return {k: _sorted(x[k]) for k in sorted(x)}
    return x
