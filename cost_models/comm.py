"""Alpha-beta model of collectives, and which link each mesh axis uses.

Formulas (ring algorithms; p = group size, alpha = link latency, B = link
bandwidth per device per direction, n = ``nbytes``):

==============  =====================================  ==========================
kind            time                                   n is
==============  =====================================  ==========================
all_reduce      2(p-1) alpha + 2(p-1)/p n/B            the tensor
all_gather      (p-1) alpha + (p-1)/p n/B              the gathered (full) tensor
reduce_scatter  (p-1) alpha + (p-1)/p n/B              the full (input) tensor
all_to_all      (p-1) alpha + (p-1)/p n/B              each rank's full tensor
send_recv       alpha + n/B                            the tensor
broadcast       (p-1) alpha + n/B                      the tensor
==============  =====================================  ==========================

Broadcast is NCCL's pipelined ring: every link carries the whole tensor once
and the chunks take p-1 hops. A group of one device costs 0.

Calibrated overrides. A cluster's ``collectives`` field holds measured fits
that replace the formulas::

    {"intra_node": {                          # groups inside one node
        "all_reduce": {"alpha": 3e-5, "beta": 6e-10},   # any group size
        "all_gather": {"2": {"alpha": 2e-5, "beta": 3e-10},
                       "4": {"alpha": 4e-5, "beta": 4e-10}}},
     "inter_node": {...}}                     # groups spanning nodes

With a fit, time = alpha + beta * nbytes (same ``nbytes`` as above). A kind is
either one fit for all group sizes or one fit per group size (JSON keys are
strings); for an unlisted size the nearest listed one is used (the larger on a
tie, to stay pessimistic). Kinds without a fit use the formulas.
:func:`fit_alpha_beta` produces the fits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np

from .hardware import ClusterSpec, LinkSpec
from .schema import COLLECTIVE_KINDS


def collective_time(kind: str, nbytes: float, group_size: int, link: LinkSpec,
                    overrides: dict[str, Any] | None = None) -> float:
    """Return the seconds one ``kind`` collective of ``nbytes`` takes over a
    group of ``group_size`` devices on ``link``.

    ``overrides`` is one scope of calibrated fits, ``{kind: fit}`` (module
    docstring). Raises ValueError for an unknown kind, a group size < 1 or
    negative bytes.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVE_KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    p = group_size
    if p == 1:
        return 0.0
    if overrides and kind in overrides:
        fit = _pick_fit(overrides[kind], p)
        return fit["alpha"] + fit["beta"] * nbytes
    a, t = link.latency, nbytes / link.bandwidth
    if kind == "all_reduce":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * t
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) * a + (p - 1) / p * t
    if kind == "send_recv":
        return a + t
    return (p - 1) * a + t  # broadcast


def _pick_fit(entry: dict[str, Any], group_size: int) -> dict[str, float]:
    """Return the {"alpha", "beta"} fit of ``entry`` for ``group_size``."""
    if "alpha" in entry:
        return entry
    nearest = min(entry, key=lambda s: (abs(int(s) - group_size), -int(s)))
    return entry[nearest]


def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float]) -> tuple[float, float]:
    """Return ``(alpha, beta)``, the least-squares fit of t = alpha + beta * n,
    both clamped to >= 0 (a clamped one is fixed at 0 and the other refit).

    Residuals are relative (weighted by 1/t): calibration sweeps sizes over
    decades, and plain residuals would let the largest messages swamp alpha.
    Raises ValueError unless given equally many (>= 2) points with at least two
    distinct sizes and no negative values.
    """
    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.shape != t.shape or n.ndim != 1 or len(np.unique(n)) < 2 or (n < 0).any() \
            or (t < 0).any():
        raise ValueError("fit_alpha_beta needs equally many non-negative sizes and "
                         "times, with at least two distinct sizes")
    w = 1.0 / np.maximum(t, np.finfo(float).tiny)
    a = np.stack([w, w * n], axis=1)
    alpha, beta = np.linalg.lstsq(a, w * t, rcond=None)[0]
    # Noise can push a tiny true alpha or beta below zero; refit without it.
    w2 = w * w
    if alpha < 0:
        alpha, beta = 0.0, max(float((w2 * n) @ t / ((w2 * n) @ n)), 0.0)
    elif beta < 0:
        alpha, beta = float(w2 @ t / w2.sum()), 0.0
    return float(alpha), float(beta)


@lru_cache(maxsize=1024)
def _spans_nodes(mesh_shape: tuple[int, ...], devices_per_node: int, axis: int) -> bool:
    # called for every edge of every candidate by the planner: cached
    node = np.arange(prod(mesh_shape)).reshape(mesh_shape) // devices_per_node
    node = np.moveaxis(node, axis, -1)
    return bool((node.max(axis=-1) != node.min(axis=-1)).any())


@dataclass(frozen=True)
class MeshTopology:
    """A device mesh laid out on a cluster.

    Global rank r sits at the row-major position of r in ``mesh_shape`` (the
    last axis varies fastest) and on node r // devices_per_node, so
    consecutive ranks fill a node first.
    """

    cluster: ClusterSpec
    mesh_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(self.mesh_shape)
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1
                            for s in shape):
            raise ValueError(f"mesh_shape must be a non-empty tuple of positive "
                             f"integers, got {self.mesh_shape!r}")
        object.__setattr__(self, "mesh_shape", shape)
        self.cluster.check_devices(prod(shape))

    @property
    def num_devices(self) -> int:
        """Return the number of devices of the mesh."""
        return prod(self.mesh_shape)

    def spans_nodes(self, axis: int) -> bool:
        """Return whether some group along ``axis`` has devices on two nodes.

        Raises ValueError for an axis out of range.
        """
        return _spans_nodes(self.mesh_shape, self.cluster.devices_per_node, self._axis(axis))

    def axis_link(self, axis: int) -> LinkSpec:
        """Return the link a collective along ``axis`` is limited by.

        A group inside one node uses ``intra_node``; a group spanning nodes is
        charged entirely at ``inter_node`` speed, its bottleneck. A hierarchical
        all-reduce (intra-node reduce, inter-node exchange) is not modelled
        yet, so such groups are slightly pessimistic.
        """
        return self.cluster.inter_node if self.spans_nodes(axis) else self.cluster.intra_node

    def collective_time(self, kind: str, nbytes: float, axis: int) -> float:
        """Return the seconds of a ``kind`` collective of ``nbytes`` along ``axis``,
        using the cluster's calibrated fits for that link scope when present."""
        scope = "inter_node" if self.spans_nodes(axis) else "intra_node"
        return collective_time(kind, nbytes, self.mesh_shape[self._axis(axis)],
                               self.axis_link(axis), self.cluster.collectives.get(scope))

    def _axis(self, axis: int) -> int:
        ndim = len(self.mesh_shape)
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} out of range for mesh_shape {self.mesh_shape}")
        return axis % ndim
