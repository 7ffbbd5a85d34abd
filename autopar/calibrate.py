"""Measure the machine it runs on and turn the timings into a cluster file.

``calibrate()`` (the ``autopar calibrate`` command) runs microbenchmarks in
``procs`` processes at the same time and fits the numbers the cost model uses:

- **matmul** (``F.linear`` of square and skinny tokens x hidden x hidden shapes)
  -> ``device.peak_flops[dtype]`` (the best throughput measured for that dtype)
  and ``device.matmul_efficiency`` (the median over the shapes of throughput /
  peak, in the cluster's compute dtype: the fraction of peak a typical GEMM
  reaches). The throughput of a shape is FLOPs / (time - kernel overhead), the
  way :func:`cost_models.op_time` adds the overhead back.
- **kernel overhead**: the time of a tiny op (``torch.add`` of 16 elements).
- **memory**: the best large tensor copy gives ``device.memory_bandwidth``
  (bytes read + written / time); the median of typical elementwise kernels
  (add, mul, gelu, softmax, outputs allocated as in eager training) over it
  gives ``device.memory_efficiency``.
- **collectives** (all_reduce, all_gather, reduce_scatter, all_to_all,
  send_recv, broadcast) over message sizes and group sizes 2, 4, ... up to
  ``procs``, on the local backend (gloo on CPU, NCCL between GPUs). Each
  (kind, group size) is fitted with :func:`cost_models.comm.fit_alpha_beta`
  into the cluster's ``collectives["intra_node"]`` overrides, with ``nbytes``
  as :mod:`cost_models.comm` defines it; ``intra_node`` latency and bandwidth
  are the medians of what the fits imply through the ring formulas.

Why concurrently: training on a CPU machine runs one single-threaded gloo
process per "device", e.g. 4 processes on 2 cores. What one process gets under
that contention, not what it gets alone, is what the cost model must predict
with. So every compute benchmark runs in all ``procs`` processes at once (each
with ``torch.set_num_threads(1)``, via
:func:`autopar.runtime.launch.run_distributed`), with a barrier before each
item, and the result is the median over processes. Collectives of a group size
run in all groups of that size at once (ranks 0-1 and 2-3 for size 2), as the
groups of one mesh axis do in training; their time is the max over the ranks
of each rank's median, each timed sample starting after a barrier.

The fitting functions (``fit_*``, :func:`build_cluster`) are pure: they take
measurements, not timings, so they are tested on synthetic numbers.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

import cost_models
from cost_models.comm import fit_alpha_beta

from .errors import ClusterError, DistributedError

__all__ = ["calibrate", "measure", "build_cluster", "fit_matmul", "fit_memory", "fit_overhead", "fit_framework",
           "fit_checkpoint", "fit_collectives", "link_from_fits", "sizes_for", "MODES"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: the collectives measured, in the order they run.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
#: elementwise kernels whose bandwidth over the best copy is ``memory_efficiency``.
ELEMENTWISE = ("add", "mul", "gelu", "softmax")
#: size sets: "full", "quick" (--quick) and "tiny" (tests only; AUTOPAR_CALIBRATE_SIZES=tiny).
MODES = ("full", "quick", "tiny")
#: hidden override of the size set, for the CLI smoke test.
SIZES_ENV = "AUTOPAR_CALIBRATE_SIZES"

# ring-formula coefficients (latency, bandwidth) of each kind, see cost_models.comm:
# time = a(p) * latency + b(p) * nbytes / bandwidth
_RING = {
    "all_reduce": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p),
    "all_gather": (lambda p: p - 1, lambda p: (p - 1) / p),
    "reduce_scatter": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_to_all": (lambda p: p - 1, lambda p: (p - 1) / p),
    "send_recv": (lambda p: 1, lambda p: 1),
    "broadcast": (lambda p: p - 1, lambda p: 1),
}


# ---------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """What one calibration run measures.

    ``matmul`` shapes are ``(m, k, n)``: ``F.linear(x[m, k], w[n, k])``, i.e.
    tokens x in-features x out-features. ``matmul_dtypes`` run on every shape,
    ``extra_dtypes`` (slow on CPU) only on ``extra_shapes``.
    """

    mode: str
    matmul: tuple[tuple[int, int, int], ...]
    matmul_dtypes: tuple[str, ...]
    extra_shapes: tuple[tuple[int, int, int], ...]
    extra_dtypes: tuple[str, ...]
    reps: int                      # timed samples per item and process, after warm-up
    min_sample_s: float            # a sample repeats an op until it lasts about this long
    copy_bytes: tuple[int, ...]    # buffer sizes of the copy benchmark
    elementwise_bytes: int         # tensor size of the elementwise kernels
    coll_bytes: tuple[int, ...]    # message sizes (the kind's nbytes)
    coll_reps: int
    coll_sample_bytes: int         # small messages repeat until a sample moves this much (<= 16 ops)


def sizes_for(mode: str, cuda: bool) -> Sizes:
    """Return the size set of ``mode`` ("full", "quick" or "tiny") on CPU or CUDA."""
    if mode not in MODES:
        raise ValueError(f"unknown calibration mode {mode!r}; valid: {', '.join(MODES)}")
    if cuda:
        dts = ("float32", "tf32", "bfloat16", "float16")
        if mode == "full":
            shapes = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
                      (8192, 4096, 4096), (4096, 4096, 16384), (4096, 16384, 4096), (2048, 8192, 8192))
            return Sizes(mode, shapes, dts, (), (), 10, 0.02, (64 * MiB, 256 * MiB, 1 * GiB), 256 * MiB,
                         tuple(4 * KiB * 4 ** i for i in range(9)), 10, 64 * MiB)
        if mode == "quick":
            shapes = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096),
                      (4096, 4096, 16384))
            return Sizes(mode, shapes, dts, (), (), 5, 0.01, (256 * MiB,), 256 * MiB,
                         (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB), 5, 64 * MiB)
        return Sizes(mode, ((256, 256, 256), (512, 512, 512)), ("float32", "bfloat16"), (), (), 2, 0.002,
                     (4 * MiB,), 4 * MiB, (4 * KiB, 1 * MiB), 2, 1 * MiB)
    # CPU: bfloat16 GEMMs run ~20x slower than float32 without AVX512-BF16, so only small shapes.
    # Elementwise tensors stay at 16 MiB: glibc serves every allocation of 32 MiB and more with a
    # fresh mmap (page faults on each op), which real activations of this size rarely hit.
    if mode == "full":
        shapes = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
                  (2048, 512, 512), (2048, 1024, 1024), (256, 2048, 2048), (1024, 1024, 4096),
                  (1024, 4096, 1024))
        return Sizes(mode, shapes, ("float32",), ((256, 256, 256), (512, 512, 512)), ("bfloat16",), 5, 0.02,
                     (16 * MiB, 64 * MiB, 128 * MiB), 16 * MiB, tuple(4 * KiB * 4 ** i for i in range(7)), 7,
                     1 * MiB)
    if mode == "quick":
        shapes = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 512, 512), (256, 2048, 2048))
        return Sizes(mode, shapes, ("float32",), ((256, 256, 256),), ("bfloat16",), 3, 0.01,
                     (32 * MiB,), 16 * MiB, (4 * KiB, 32 * KiB, 256 * KiB, 2 * MiB, 16 * MiB), 3, 1 * MiB)
    return Sizes(mode, ((64, 64, 64), (128, 128, 128), (256, 64, 64)), ("float32",), ((32, 32, 32),),
                 ("bfloat16",), 2, 0.002, (1 * MiB,), 1 * MiB, (4 * KiB, 64 * KiB), 2, 64 * KiB)


def group_sizes(procs: int) -> list[int]:
    """The group sizes measured on ``procs`` processes: 2, 4, 8, ... up to ``procs``."""
    out, g = [], 2
    while g <= procs:
        out.append(g)
        g *= 2
    return out


def _steps(sizes: Sizes, procs: int) -> int:
    """How many progress steps one run has (one per measured item)."""
    return (len(sizes.matmul) * len(sizes.matmul_dtypes) + len(sizes.extra_shapes) * len(sizes.extra_dtypes)
            + 2 + len(sizes.copy_bytes) + len(ELEMENTWISE)
            + len(group_sizes(procs)) * len(KINDS) * len(sizes.coll_bytes))


def _human_bytes(n: float) -> str:
    for unit, k in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


# ---------------------------------------------------------------------------------- fitting (pure)
def fit_overhead(seconds: Iterable[float]) -> float:
    """Return ``kernel_overhead_s``: the median time of a tiny op."""
    s = list(seconds)
    if not s or any(x < 0 for x in s):
        raise ValueError("fit_overhead needs at least one non-negative time")
    return float(statistics.median(s))


def fit_matmul(points: Iterable[tuple[str, float, float]], compute_dtype: str,
               overhead_s: float = 0.0) -> tuple[dict[str, float], float]:
    """Return ``(peak_flops, matmul_efficiency)`` from ``(dtype, flops, seconds)`` points.

    A point's throughput is ``flops / (seconds - overhead_s)`` (the overhead is
    what :func:`cost_models.op_time` adds back; the time left is kept at least
    half of ``seconds``, so noise cannot blow it up). ``peak_flops[dtype]`` is
    the best throughput of that dtype; the efficiency is the median over the
    ``compute_dtype`` points of throughput / its peak, so the roofline of a
    typical GEMM matches. Raises ValueError without a ``compute_dtype`` point
    or for non-positive FLOPs or times.
    """
    rates: dict[str, list[float]] = {}
    for dtype, flops, seconds in points:
        if flops <= 0 or seconds <= 0:
            raise ValueError(f"fit_matmul needs positive FLOPs and times, got {flops}, {seconds}")
        busy = max(seconds - overhead_s, seconds / 2)
        rates.setdefault(dtype, []).append(flops / busy)
    if compute_dtype not in rates:
        raise ValueError(f"fit_matmul: no {compute_dtype} measurement (have {sorted(rates)})")
    peak = {dt: max(r) for dt, r in rates.items()}
    eff = statistics.median(r / peak[compute_dtype] for r in rates[compute_dtype])
    return peak, float(min(max(eff, 1e-3), 1.0))


def fit_memory(copies: Iterable[tuple[float, float]], elementwise: Iterable[tuple[float, float]]
               ) -> tuple[float, float]:
    """Return ``(memory_bandwidth, memory_efficiency)`` from ``(bytes moved, seconds)`` points.

    Bandwidth is the best copy (bytes read + written / time); efficiency is the
    median elementwise kernel's bandwidth over it, kept in [0.001, 1]. Raises
    ValueError for no points or non-positive values.
    """
    def bw(points: Iterable[tuple[float, float]], what: str) -> list[float]:
        out = []
        for nbytes, seconds in points:
            if nbytes <= 0 or seconds <= 0:
                raise ValueError(f"fit_memory needs positive bytes and times, got {nbytes}, {seconds}")
            out.append(nbytes / seconds)
        if not out:
            raise ValueError(f"fit_memory needs at least one {what} measurement")
        return out

    best = max(bw(copies, "copy"))
    eff = statistics.median(bw(elementwise, "elementwise")) / best
    return float(best), float(min(max(eff, 1e-3), 1.0))


def fit_collectives(points: Iterable[tuple[str, int, float, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Return ``{kind: {"<group size>": {"alpha", "beta"}}}`` from
    ``(kind, group size, nbytes, seconds)`` points, one
    :func:`cost_models.comm.fit_alpha_beta` per kind and group size (the
    format of a scope of :mod:`cost_models.comm` overrides)."""
    by: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for kind, group, nbytes, seconds in points:
        if kind not in _RING:
            raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(_RING)}")
        sizes, times = by.setdefault((kind, int(group)), ([], []))
        sizes.append(float(nbytes))
        times.append(float(seconds))
    fits: dict[str, dict[str, dict[str, float]]] = {}
    for (kind, group), (sizes, times) in sorted(by.items()):
        alpha, beta = fit_alpha_beta(sizes, times)
        fits.setdefault(kind, {})[str(group)] = {"alpha": alpha, "beta": beta}
    return fits


def link_from_fits(fits: dict[str, dict[str, dict[str, float]]]) -> tuple[float, float] | None:
    """Return the link ``(latency, bandwidth)`` the fits imply, or None.

    Each fit gives latency = alpha / a(p) and bandwidth = b(p) / beta through
    its ring formula (time = a(p) latency + b(p) nbytes / bandwidth); the
    result is the median over fits (fits with beta = 0 give no bandwidth).
    """
    lats, bws = [], []
    for kind, per_group in fits.items():
        a, b = _RING[kind]
        for group, fit in per_group.items():
            p = int(group)
            if p < 2:
                continue
            lats.append(fit["alpha"] / a(p))
            if fit["beta"] > 0:
                bws.append(b(p) / fit["beta"])
    if not lats or not bws:
        return None
    return float(statistics.median(lats)), float(statistics.median(bws))


def _span(values: list[float], scale: float, unit: str) -> str:
    lo, hi = min(values) / scale, max(values) / scale
    return f"{lo:.3g} {unit}" if math.isclose(lo, hi, rel_tol=1e-3) else f"{lo:.3g}-{hi:.3g} {unit}"


def build_cluster(meas: dict[str, Any], base: Any = "cpu", *, host: str | None = None,
                  date: str | None = None) -> dict[str, Any]:
    """Return the cluster dict (cluster file format) fitted from ``meas``.

    ``meas`` is what :func:`measure` returns (synthetic in the tests):
    ``procs``, ``backend``, ``mode``, ``threads``, ``device_name``,
    ``memory_bytes``, ``reps``, ``coll_reps``, and the aggregated lists
    ``matmul`` ({dtype, m, k, n, seconds}), ``overhead`` ({seconds, calls}),
    ``copy`` / ``elementwise`` ({op, bytes, seconds}; bytes moved) and
    ``collectives`` ({kind, group, bytes, seconds}). ``base`` (a preset name,
    cluster file, dict or ClusterSpec) supplies everything not measured:
    devices per node, max nodes, inter-node link and fits, default precision
    (whose compute dtype sets the efficiency). ``peak_flops`` lists exactly
    the measured dtypes (a datasheet peak next to a measured efficiency would
    mix two scales). Without collective measurements (one process) the base's
    intra-node link and fits stay. Every number written gets a ``sources``
    entry. The result is validated by loading it (ClusterError if that fails).
    """
    base_spec = cost_models.load_cluster(base)
    d = base_spec.to_dict()
    host = host or platform.node() or "unknown host"
    date = date or _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z").strip()
    procs, backend = int(meas["procs"]), meas["backend"]
    who = f"measured by autopar calibrate on {host} {date}"
    conc = (f"{procs} concurrent process{'es' if procs > 1 else ''}"
            + (f" x {meas.get('threads', 1)} thread" if not meas.get("cuda") else " (one GPU each)"))
    reps = meas.get("reps", "?")
    sources = dict(d["sources"])
    dev = d["device"]

    ctx = _Said(who, conc, reps)
    _fit_matmul_into(dev, sources, meas, base_spec.compute_dtype, ctx)
    _fit_framework_into(dev, sources, meas, ctx)
    _fit_memory_into(dev, sources, meas, ctx, host, date)
    d, sources = _fit_collectives_into(d, sources, meas, ctx, procs, backend)

    name = base_spec.name if base_spec.name.endswith("-calibrated") else f"{base_spec.name}-calibrated"
    d["name"] = name
    base_desc = base_spec.description.split(" Base: ", 1)[-1]   # recalibrating: no nesting
    d["description"] = (
        f"{base_spec.name} calibrated by `autopar calibrate` on {host} {date}: {conc} over {backend}, "
        f"{meas.get('mode', '?')} sizes. Base: {base_desc}")
    d["sources"] = dict(sorted(sources.items()))
    return cost_models.load_cluster(d).to_dict()   # validates; keys sorted


class _Said(NamedTuple):
    """How every ``sources`` entry of a calibration names its origin: by
    whom and when (``who``), the processes measured at once (``conc``), the
    timed samples per measurement (``reps``)."""

    who: str
    conc: str
    reps: Any


def _fit_matmul_into(dev: dict, sources: dict, meas: dict, compute_dtype: str, ctx: _Said) -> None:
    """The matmul peaks per measured dtype, the efficiency and the kernel
    overhead, written into ``dev`` with their ``sources``."""
    who, conc, reps = ctx
    overhead = fit_overhead([meas["overhead"]["seconds"]])
    mm = meas["matmul"]
    if compute_dtype not in {m["dtype"] for m in mm}:
        compute_dtype = "float32"
    peak, eff = fit_matmul([(m["dtype"], 2.0 * m["m"] * m["k"] * m["n"], m["seconds"]) for m in mm],
                           compute_dtype, overhead)
    for dt in list(dev["peak_flops"]):
        sources.pop(f"device.peak_flops.{dt}", None)
    dev["peak_flops"] = dict(sorted(peak.items()))
    for dt, value in peak.items():
        pts = [m for m in mm if m["dtype"] == dt]
        best = max(pts, key=lambda m: 2.0 * m["m"] * m["k"] * m["n"] / max(m["seconds"] - overhead,
                                                                         m["seconds"] / 2))
        sources[f"device.peak_flops.{dt}"] = (
            f"{who}: best throughput of F.linear {dt} over {len(pts)} shape(s) "
            f"({', '.join('x'.join(map(str, (m['m'], m['k'], m['n']))) for m in pts)}; m x k x n), "
            f"{conc}, median of {reps} timed samples per process after warm-up, median over processes; "
            f"best {value / 1e9:.4g} GFLOP/s at {best['m']}x{best['k']}x{best['n']}")
    dev["matmul_efficiency"] = eff
    rates = [2.0 * m["m"] * m["k"] * m["n"] / max(m["seconds"] - overhead, m["seconds"] / 2)
             for m in mm if m["dtype"] == compute_dtype]
    sources["device.matmul_efficiency"] = (
        f"{who}: median over the {len(rates)} {compute_dtype} shapes of throughput / peak "
        f"(throughputs {_span(rates, 1e9, 'GFLOP/s')}, {conc}); applied to every dtype's peak")
    dev["kernel_overhead_s"] = overhead
    sources["device.kernel_overhead_s"] = (
        f"{who}: torch.add of two 16-element tensors, {meas['overhead'].get('calls', '?')} calls per sample, "
        f"{conc}, median of {reps} samples per process, median over processes")


def _fit_framework_into(dev: dict, sources: dict, meas: dict, ctx: _Said) -> None:
    """Host-bound devices: the per-op dispatch and per-tensor optimizer
    overheads, when measured (after :func:`_fit_matmul_into`, whose kernel
    overhead they exclude)."""
    who, conc, _ = ctx
    fw = meas.get("framework")
    if fw:
        dev["dispatch_overhead_s"] = fit_framework(fw["step_s"], fw["ops"], fw["costed_ops"],
                                                    dev["kernel_overhead_s"])
        sources["device.dispatch_overhead_s"] = (
            f"{who}: forward + backward of an fx-traced 8 x (Linear, GELU, LayerNorm) model of width 8, "
            f"{fw['ops']} ops, {fw['step_s'] * 1e3:.3g} ms per step, / (3 x ops), less the kernel overhead; {conc}")
        dev["optimizer_overhead_s"] = {**dev.get("optimizer_overhead_s", {}), **fw["optimizer_s"]}
        for k in fw["optimizer_s"]:
            sources[f"device.optimizer_overhead_s.{k}"] = (
                f"{who}: torch.optim {k} step over the {fw['tensors']} tensors of that model, per tensor; {conc}")
    ck = meas.get("checkpoint")
    if ck:
        dev["checkpoint_dispatch_s"] = fit_checkpoint(ck["selective_s"], ck["full_s"], ck["ops"])
        sources["device.checkpoint_dispatch_s"] = (
            f"{who}: forward + backward of an fx-traced 8 x (Linear, GELU, LayerNorm) model of width 8 "
            f"({ck['ops']} ops) checkpointed whole, with torch's selective checkpoint dispatch mode "
            f"({ck['selective_s'] * 1e3:.3g} ms) less without it ({ck['full_s'] * 1e3:.3g} ms), / (2 x ops); {conc}")


def _fit_memory_into(dev: dict, sources: dict, meas: dict, ctx: _Said, host: str, date: str) -> None:
    """Memory bandwidth and efficiency (copies, elementwise ops), memory
    size and the device's name."""
    who, conc, reps = ctx
    bw, mem_eff = fit_memory([(c["bytes"], c["seconds"]) for c in meas["copy"]],
                             [(e["bytes"], e["seconds"]) for e in meas["elementwise"]])
    dev["memory_bandwidth"] = bw
    sources["device.memory_bandwidth"] = (
        f"{who}: best tensor copy (bytes read + written / time) over buffers of "
        f"{', '.join(_human_bytes(c['bytes'] / 2) for c in meas['copy'])}, {conc}, "
        f"median of {reps} samples per process, median over processes")
    dev["memory_efficiency"] = mem_eff
    ew = meas["elementwise"]
    sources["device.memory_efficiency"] = (
        f"{who}: median bandwidth of {', '.join(e['op'] for e in ew)} on "
        f"{_human_bytes(ew[0]['bytes'] / (3 if ew[0]['op'] == 'add' else 2))} float32 tensors "
        f"(outputs allocated, as in eager training; "
        f"{_span([e['bytes'] / e['seconds'] for e in ew], 1e9, 'GB/s')}) over the best copy, {conc}")
    if meas.get("memory_bytes"):
        dev["memory_bytes"] = int(meas["memory_bytes"])
        sources["device.memory_bytes"] = (
            f"read by autopar calibrate on {host} {date}: "
            + ("torch.cuda total memory of the GPU" if meas.get("cuda") else
               "total physical memory (sysconf); every process is given all of it, it is shared"))
    if meas.get("device_name"):
        dev["name"] = meas["device_name"]


def _fit_collectives_into(d: dict, sources: dict, meas: dict, ctx: _Said, procs: int,
                          backend: str) -> tuple[dict, dict]:
    """The intra-node collective fits and the link they imply, when
    collectives were measured (several processes); returns ``(d, sources)``,
    ``sources`` rebuilt without the old intra-node entries."""
    who, _, _ = ctx
    coll = meas.get("collectives") or []
    if coll:
        fits = fit_collectives([(c["kind"], c["group"], c["bytes"], c["seconds"]) for c in coll])
        d["collectives"] = {**d.get("collectives", {}), "intra_node": fits}
        sources = {k: v for k, v in sources.items() if not k.startswith("collectives.intra_node")}
        for kind, per_group in fits.items():
            pts = [c for c in coll if c["kind"] == kind]
            nb = sorted({c["bytes"] for c in pts})
            sources[f"collectives.intra_node.{kind}"] = (
                f"{who}: {backend} {kind} of float32 tensors, {len(nb)} sizes "
                f"{_human_bytes(nb[0])}-{_human_bytes(nb[-1])} (nbytes as in cost_models.comm), "
                f"groups of {', '.join(sorted(per_group, key=int))} (all groups of a size at once on "
                f"{procs} processes), {meas.get('coll_reps', '?')} timed samples per size after warm-up, "
                f"each after a barrier; max over ranks of the per-rank medians; fitted with "
                f"cost_models.comm.fit_alpha_beta")
        link = link_from_fits(fits)
        if link is not None:
            d["intra_node"] = {"latency": link[0], "bandwidth": link[1]}
            n = sum(len(v) for v in fits.values())
            sources["intra_node.latency"] = (
                f"{who}: median over the {n} collective fits above of alpha / the ring formula's "
                f"latency coefficient ({backend})")
            sources["intra_node.bandwidth"] = (
                f"{who}: median over the {n} collective fits above of the ring formula's "
                f"bandwidth coefficient / beta ({backend})")
    return d, sources


# ---------------------------------------------------------------------------------- measuring (children)
def _median(x: list[float]) -> float:
    return float(statistics.median(x))


def _narrow_model() -> tuple[Any, Any, Any]:
    """An fx-traced 8 x (Linear, GELU, LayerNorm) model of width 8 (too
    narrow to compute anything: its time is the framework's) with an MSE
    loss, and its input and target."""
    import torch
    import torch.nn as nn

    from .trace import trace

    layers = []
    for _ in range(8):
        layers += [nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)]
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return trace(nn.Sequential(*layers), (x,), loss_fn=nn.functional.mse_loss, target=y), x, y


def _framework_overhead(reps: int) -> dict[str, Any]:
    """Time a training step of a model too narrow to compute anything (width
    8): fx-traced as autopar runs it, forward + backward, and each optimizer's
    step. What is left is the framework's time per op and per tensor."""
    import torch

    from .graph import NO_DISPATCH

    g, x, y = _narrow_model()
    gm = g.gm
    ops = sum(1 for n in g.nodes if n.kind not in NO_DISPATCH)
    costed = sum(1 for n in g.nodes if n.kind not in NO_DISPATCH and (n.flops or n.act_bytes))

    def step():
        gm(x, y).backward()

    samples, _ = _timed(step, reps, 0.02, lambda: None)
    params = [p for p in gm.parameters() if p.requires_grad]
    step()
    opt_s = {}
    for name, opt in (("adamw", torch.optim.AdamW(params, lr=1e-4)), ("sgd", torch.optim.SGD(params, lr=1e-4))):
        t, _ = _timed(opt.step, reps, 0.02, lambda: None)
        opt_s[name] = _median(t) / len(params)
    return {"step_s": _median(samples), "ops": ops, "costed_ops": costed, "tensors": len(params),
            "optimizer_s": opt_s}


def _checkpoint_overhead(reps: int, device: Any, sync: Callable[[], None]) -> dict[str, Any]:
    """Time forward + backward of a width-8 fx-traced model (too narrow to
    compute anything) checkpointed whole, once with torch's selective
    checkpoint dispatch mode (autopar's policy, as ``recompute=selective``
    runs a layer) and once without it (``recompute=full``). The difference
    is the dispatch mode's time over the ops of two passes (forward and
    recompute)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from . import ops as op_registry
    from .graph import checkpoint_dispatches
    from .runtime.regions import recompute_policy

    g, x, y = _narrow_model()
    gm = g.gm.to(device)
    x, y = x.to(device), y.to(device)
    ops = sum(1 for n in g.nodes if checkpoint_dispatches(n.kind, n.target))     # as the cost model counts them
    policy = recompute_policy(op_registry.save_ops())

    def run(selective: bool) -> Callable[[], None]:
        ctx = {"context_fn": lambda: create_selective_checkpoint_contexts(policy)} if selective else {}
        return lambda: checkpoint(gm, x, y, use_reentrant=False, **ctx).backward()

    sel, _ = _timed(run(True), reps, 0.02, sync)
    full, _ = _timed(run(False), reps, 0.02, sync)
    return {"selective_s": _median(sel), "full_s": _median(full), "ops": ops}


def fit_checkpoint(selective_s: float, full_s: float, ops: int) -> float:
    """Return ``checkpoint_dispatch_s``: the selective checkpoint's extra
    time per op and pass (forward and recompute: two passes)."""
    if ops < 1 or selective_s < 0 or full_s < 0:
        raise ValueError("fit_checkpoint needs ops >= 1 and non-negative times")
    return max(0.0, (selective_s - full_s) / (2 * ops))


def fit_framework(step_s: float, ops: int, costed_ops: int, kernel_overhead_s: float) -> float:
    """Return ``dispatch_overhead_s`` from a forward + backward step of a model
    with ``ops`` op nodes (``costed_ops`` of them already pay
    ``kernel_overhead_s`` in the cost model), counted as the cost model counts
    it: three passes per op."""
    if ops < 1 or step_s < 0:
        raise ValueError("fit_framework needs ops >= 1 and a non-negative time")
    return max(0.0, step_s / (3 * ops) - kernel_overhead_s * costed_ops / ops)


def _timed(fn: Callable[[], Any], reps: int, min_sample_s: float, sync: Callable[[], None],
           max_inner: int = 10_000) -> tuple[list[float], int]:
    """Warm up ``fn``, then return ``reps`` samples of its per-call time and the
    calls per sample (enough calls that a sample lasts about ``min_sample_s``)."""
    def once() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    est = once()              # warm-up; it overestimates (lazy set-up), which only lowers the calls per sample
    if est < min_sample_s:    # cheap to re-estimate without the set-up
        est = once()
    inner = max(1, min(max_inner, math.ceil(min_sample_s / max(est, 1e-9))))
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / inner)
    return out, inner


def _worker(rank: int, world: int, sizes: Sizes, cuda: bool, queue: Any) -> dict[str, Any]:
    """One calibration process: compute, memory, then collectives (all ranks in step)."""
    import torch

    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        sync: Callable[[], None] = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    total, done = _steps(sizes, world), [0]

    def tick(what: str) -> None:
        done[0] += 1
        if rank == 0 and queue is not None:
            queue.put((done[0], total, what))

    res: dict[str, Any] = {"matmul": [], "copy": [], "elementwise": [], "collectives": []}
    torch.manual_seed(rank)
    _measure_compute(res, sizes, device, cuda, sync, tick)
    _measure_memory(res, sizes, device, sync, tick)
    _measure_collectives(res, sizes, rank, world, device, cuda, sync, tick)

    if rank == 0:
        if cuda:
            props = torch.cuda.get_device_properties(rank)
            res["device_name"], res["memory_bytes"] = props.name, int(props.total_memory)
        else:
            try:
                res["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                pass
    return res


def _measure_compute(res: dict, sizes: Sizes, device: Any, cuda: bool, sync: Callable[[], None],
                     tick: Callable[[str], None]) -> None:
    """Matmul rates per dtype and shape, the kernel overhead and (host-bound
    devices) the framework's time per op and per tensor, into ``res``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    items = [(s, dt) for dt in sizes.matmul_dtypes for s in sizes.matmul]
    items += [(s, dt) for dt in sizes.extra_dtypes for s in sizes.extra_shapes]
    for (m, k, n), dt in items:
        tdt = getattr(torch, "float32" if dt == "tf32" else dt)
        x = torch.randn(m, k, device=device, dtype=tdt)
        w = torch.randn(n, k, device=device, dtype=tdt)
        if cuda:   # float32 is true fp32 (PyTorch's default), tf32 is opted into
            torch.set_float32_matmul_precision("high" if dt == "tf32" else "highest")
        dist.barrier()
        samples, _ = _timed(lambda: F.linear(x, w), sizes.reps, sizes.min_sample_s, sync)
        res["matmul"].append({"dtype": dt, "m": m, "k": k, "n": n, "seconds": _median(samples)})
        del x, w
        tick(f"matmul {dt} {m}x{k}x{n}")
    if cuda:
        torch.set_float32_matmul_precision("highest")

    # --- kernel overhead
    a = torch.ones(16, device=device)
    dist.barrier()
    samples, calls = _timed(lambda: torch.add(a, a), sizes.reps, sizes.min_sample_s, sync)
    res["overhead"] = {"seconds": _median(samples), "calls": calls}
    tick("kernel overhead")
    if not cuda:      # host-bound: the framework's own time per op, and the optimizers' per-tensor loop
        dist.barrier()
        res["framework"] = _framework_overhead(sizes.reps)
        tick("framework overhead")
    dist.barrier()
    res["checkpoint"] = _checkpoint_overhead(sizes.reps, device, sync)
    tick("selective checkpoint overhead")


def _measure_memory(res: dict, sizes: Sizes, device: Any, sync: Callable[[], None],
                    tick: Callable[[str], None]) -> None:
    """Copy bandwidth per buffer size and the elementwise kernels' rates, into ``res``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    for nbytes in sizes.copy_bytes:
        src = torch.ones(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        dist.barrier()
        samples, _ = _timed(lambda: dst.copy_(src), sizes.reps, sizes.min_sample_s, sync)
        res["copy"].append({"op": "copy", "bytes": 2 * nbytes, "seconds": _median(samples)})
        del src, dst
        tick(f"memory copy {_human_bytes(nbytes)}")
    nb = sizes.elementwise_bytes
    a = torch.rand(nb // 4, device=device)
    b = torch.rand(nb // 4, device=device)
    kernels = {"add": (lambda: a + b, 3 * nb), "mul": (lambda: a * 0.5, 2 * nb),
               "gelu": (lambda: F.gelu(a), 2 * nb), "softmax": (lambda: torch.softmax(a.view(-1, 1024), -1), 2 * nb)}
    for op in ELEMENTWISE:
        fn, moved = kernels[op]
        dist.barrier()
        samples, _ = _timed(fn, sizes.reps, sizes.min_sample_s, sync)
        res["elementwise"].append({"op": op, "bytes": moved, "seconds": _median(samples)})
        tick(f"memory {op} {_human_bytes(nb)}")
    del a, b


def _measure_collectives(res: dict, sizes: Sizes, rank: int, world: int, device: Any, cuda: bool,
                         sync: Callable[[], None], tick: Callable[[str], None]) -> None:
    """Every collective kind and size on every group of one size at once
    (all ranks in step), the max over ranks taken later, into ``res``."""
    import torch.distributed as dist

    from .runtime.collectives import _all_gather_single, _reduce_scatter_single

    for g in group_sizes(world):
        blocks = [list(range(i, i + g)) for i in range(0, world - world % g, g)]
        handles = [dist.new_group(r, backend="nccl" if cuda else "gloo") for r in blocks]
        mine = next(((h, r) for h, r in zip(handles, blocks) if rank in r), None)
        for kind in KINDS:
            for nbytes in sizes.coll_bytes:
                op = _collective(kind, nbytes, g, mine, rank, device, dist, _all_gather_single,
                                 _reduce_scatter_single) if mine else (lambda: None)
                inner = max(1, min(16, sizes.coll_sample_bytes // nbytes))
                dist.barrier()
                op()  # warm-up (NCCL communicators start here)
                sync()
                samples = []
                for _ in range(sizes.coll_reps):
                    sync()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        op()
                    sync()
                    samples.append((time.perf_counter() - t0) / inner)
                if mine:
                    res["collectives"].append({"kind": kind, "group": g, "bytes": nbytes,
                                               "seconds": _median(samples)})
                tick(f"{kind} group {g} {_human_bytes(nbytes)}")
        dist.barrier()


def _collective(kind, nbytes, g, mine, rank, device, dist, all_gather_single, reduce_scatter_single):
    """Return a zero-argument function running one ``kind`` collective whose
    ``nbytes`` is as :mod:`cost_models.comm` defines it."""
    import torch
    group, ranks = mine
    numel = nbytes // 4
    me = ranks.index(rank)
    if kind == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_gather":       # nbytes: the gathered (full) tensor
        inp, out = torch.ones(numel // g, device=device), torch.empty(numel, device=device)
        return lambda: all_gather_single(out, inp, group=group)
    if kind == "reduce_scatter":   # nbytes: the full input tensor
        inp, out = torch.ones(numel, device=device), torch.empty(numel // g, device=device)
        return lambda: reduce_scatter_single(out, inp, group=group)
    if kind == "all_to_all":       # nbytes: each rank's full tensor
        send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    if kind == "send_recv":        # ring shift: every rank sends nbytes to the next, receives from the previous
        send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)
        nxt, prv = ranks[(me + 1) % g], ranks[(me - 1) % g]

        def p2p() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return p2p
    t = torch.ones(numel, device=device)    # broadcast from the group's first rank
    return lambda: dist.broadcast(t, src=ranks[0], group=group)


def _aggregate(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Compute items: median over processes; collectives: max over ranks."""
    out: dict[str, Any] = {}
    for key in ("matmul", "copy", "elementwise"):
        out[key] = []
        for i, item in enumerate(per_rank[0][key]):
            out[key].append({**item, "seconds": _median([r[key][i]["seconds"] for r in per_rank])})
    out["overhead"] = {"seconds": _median([r["overhead"]["seconds"] for r in per_rank]),
                       "calls": per_rank[0]["overhead"]["calls"]}
    if "framework" in per_rank[0]:
        fw = per_rank[0]["framework"]
        out["framework"] = {**fw, "step_s": _median([r["framework"]["step_s"] for r in per_rank]),
                            "optimizer_s": {k: _median([r["framework"]["optimizer_s"][k] for r in per_rank])
                                            for k in fw["optimizer_s"]}}
    if "checkpoint" in per_rank[0]:
        out["checkpoint"] = {**per_rank[0]["checkpoint"],
                             **{k: _median([r["checkpoint"][k] for r in per_rank]) for k in ("selective_s", "full_s")}}
    coll: dict[tuple[str, int, int], float] = {}
    for r in per_rank:
        for c in r["collectives"]:
            key = (c["kind"], c["group"], c["bytes"])
            coll[key] = max(coll.get(key, 0.0), c["seconds"])
    out["collectives"] = [{"kind": k, "group": g, "bytes": n, "seconds": s} for (k, g, n), s in coll.items()]
    for key in ("device_name", "memory_bytes"):
        if key in per_rank[0]:
            out[key] = per_rank[0][key]
    return out


# ---------------------------------------------------------------------------------- driver
def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _default_base() -> str:
    """"cpu" without CUDA; on a GPU the closest preset (dgx-a100-80g for an A100, else dgx-h100)."""
    if not _cuda_available():
        return "cpu"
    import torch
    return "dgx-a100-80g" if "A100" in torch.cuda.get_device_name(0) else "dgx-h100"


def measure(quick: bool = False, procs: int | None = None, progress: Callable[[int, int, str], None] | None = None,
            *, sizes: str | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run the microbenchmarks in ``procs`` concurrent processes and return the
    aggregated measurements (the input of :func:`build_cluster`).

    ``progress(done, total, what)`` is called as items finish. ``sizes`` picks
    the size set ("full", "quick", "tiny"; default from ``quick``, or the
    ``AUTOPAR_CALIBRATE_SIZES`` environment variable). Raises
    DistributedError when a process fails or the run times out.
    """
    from .runtime.launch import run_distributed

    cuda = _cuda_available()
    if procs is None:
        import torch
        procs = torch.cuda.device_count() if cuda else 4
    if procs < 1:
        raise ValueError(f"procs must be >= 1, got {procs}")
    if cuda:
        import torch
        procs = min(procs, torch.cuda.device_count())
    mode = sizes or os.environ.get(SIZES_ENV) or ("quick" if quick else "full")
    plan = sizes_for(mode, cuda)
    if timeout is None:
        timeout = {"full": 1200.0, "quick": 300.0, "tiny": 120.0}[mode]

    queue = drain = None
    if progress is not None:
        import multiprocessing as mp
        queue = mp.get_context("spawn").Queue()

        def pump() -> None:
            while True:
                item = queue.get()
                if item is None:
                    return
                progress(*item)
        drain = threading.Thread(target=pump, daemon=True, name="calibrate-progress")
        drain.start()
    try:
        per_rank = run_distributed(_worker, procs, plan, cuda, queue, timeout=timeout, threads=1)
    except (RuntimeError, TimeoutError) as e:
        raise DistributedError(f"calibration failed: {e}") from e
    finally:
        if queue is not None:
            queue.put(None)
            drain.join(timeout=5)
            queue.close()
    meas = _aggregate(per_rank)
    meas.update(mode=mode, procs=procs, threads=1, cuda=cuda, backend="nccl" if cuda else "gloo",
                reps=plan.reps, coll_reps=plan.coll_reps)
    return meas


def calibrate(quick: bool = False, procs: int | None = None, base: Any = None,
              progress: Callable[[int, int, str], None] | None = None, *,
              sizes: str | None = None) -> dict[str, Any]:
    """Measure this machine and return a cluster dict (cluster file format,
    loadable by :func:`cost_models.load_cluster`).

    ``procs`` processes run at once (default: 4 on CPU, one per GPU on CUDA);
    ``base`` is the preset or cluster file whose unmeasured values are kept
    (default "cpu", or "dgx-h100" on a CUDA machine). ``quick`` measures fewer
    sizes (about a minute on 2 cores). ``progress(done, total, what)`` reports
    each finished item. Raises ClusterError for a bad ``base`` (checked before
    anything runs) and DistributedError when a benchmark process fails.
    """
    if base is None:
        base = _default_base()
    try:
        cost_models.load_cluster(base)   # a bad base fails before minutes of benchmarks
    except cost_models.ClusterError as e:
        raise ClusterError(f"--base: {e}") from None
    meas = measure(quick, procs, progress, sizes=sizes)
    try:
        return build_cluster(meas, base)
    except cost_models.ClusterError as e:   # a fit the schema refuses: a bug, not bad input
        raise ClusterError(f"calibrated cluster is invalid: {e}") from e
