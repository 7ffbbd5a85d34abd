"""A first search: the best strategy of the dp x tp (x microbatches x
recompute x ZeRO) grid under the cost model.

For every tensor-parallel size the model allows, microbatch counts are tried
from the fewest up and the first that fits is kept for each (recompute, zero)
choice (more microbatches only lower activation memory and add per-microbatch
overheads in this cost model). The intra-operator ILP of a later release
replaces the per-op part of this search.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..cost import Estimate, Evaluator, tp_valid_sizes
from ..errors import NoFeasibleStrategyError, StrategyError
from .space import ParallelConfig, divisors


@dataclass
class SearchResult:
    best: Estimate
    best_config: ParallelConfig
    candidates: int
    feasible: int
    time_s: float
    top: list[Estimate] = field(default_factory=list)


def grid_configs(ev: Evaluator, devices: int, global_batch: int, *, executable_only: bool = False
                 ) -> list[list[ParallelConfig]]:
    """The grid, as lists of configs ordered by increasing microbatches (one
    list per tp x recompute x zero choice)."""
    tps = [t for t in tp_valid_sizes(ev.graph) if devices % t == 0]
    recomputes = ("none",) if executable_only else ("none", "selective", "full")
    zeros = (0,) if executable_only else (0, 1, 2, 3)
    out = []
    for tp in tps:
        dp = devices // tp
        if global_batch % dp:
            continue
        mbs = divisors(global_batch // dp)
        for rc in recomputes:
            for z in zeros:
                if z and dp == 1:
                    continue
                out.append([ParallelConfig(dp=dp, tp=tp, microbatches=m, recompute=rc, zero=z) for m in mbs])
    return out


def search_grid(ev: Evaluator, devices: int, global_batch: int, *, executable_only: bool = False,
                progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Best fitting strategy of the grid (lowest predicted step time; ties go
    to the smaller tp, then fewer microbatches). Raises
    :class:`NoFeasibleStrategyError` when nothing fits, naming the closest."""
    t0 = time.perf_counter()
    lines = grid_configs(ev, devices, global_batch, executable_only=executable_only)
    if not lines:
        raise StrategyError(f"no dp x tp split of {devices} devices divides global batch {global_batch}; "
                            f"valid tp sizes for this model: {tp_valid_sizes(ev.graph)}")
    evaluated, feasible = 0, []
    closest: Estimate | None = None
    for k, line in enumerate(lines):
        for cfg in line:
            est = ev.evaluate(cfg, global_batch, devices)
            evaluated += 1
            if est.fits:
                feasible.append((est, cfg))
                break
            if closest is None or est.peak_memory_bytes < closest.peak_memory_bytes:
                closest = est
        if progress:
            progress(k + 1, len(lines))
    if not feasible:
        assert closest is not None
        raise NoFeasibleStrategyError(
            f"no strategy fits in device memory ({closest.device_memory_bytes / 2**30:.3g} GiB); the closest, "
            f"{closest.strategy}, needs {closest.peak_memory_bytes / 2**30:.3g} GiB per device"
            + ("" if not executable_only else
               " (only strategies this release can execute were searched: recompute and ZeRO excluded)"))
    feasible.sort(key=lambda ec: (ec[0].step_time_s, ec[1].tp, ec[1].microbatches, ec[1].zero, ec[1].recompute))
    best, cfg = feasible[0]
    return SearchResult(best=best, best_config=cfg, candidates=evaluated, feasible=len(feasible),
                        time_s=time.perf_counter() - t0, top=[e for e, _ in feasible[:5]])
