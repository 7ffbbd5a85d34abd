"""What the per-layer choice on the data-parallel axis buys, against its bound, under the cost model.

Issue 16 asks for the dp axis in the joint program: per weight, ``S(0)`` on
dp (FSDP-like, ZeRO-3) or kept whole there (ZeRO-1/2: its gradient reduced
once per step, its optimizer state sharded), decided with the tensor axes
under the memory limit. autopar makes it per layer (``fsdp_layers=k``: the
first k repeated layers FSDP2 units, the rest under the distributed
optimizer's ZeRO-1/2; the search's ``_try_fsdp_layers``). This benchmark
plans each request with and without that choice (``search.grid.FSDP_TRIES``
set to 0), in the default search mode and in ``grid`` mode, and sets the
gain beside a bound of what any per-weight mix could buy; predictions only.

Per preset request, the search in ``grid`` mode (Megatron placements on the
tp axis, so that every configuration is priced alike) gives the best plan
``t_best``. Then for every configuration without a pipeline (ZeRO-2 and -3
refuse pipelines) whose ZeRO-1 or ZeRO-2 form does not fit while its ZeRO-3
form does, a per-weight mix of the two lies between them:

* **bound**: no mix is faster than the ZeRO-1/2 form itself (it moves a
  subset of the mix's bytes: the mix adds FSDP's gathers for its sharded
  weights), so ``(t_best - t_low) / t_best`` over those configurations
  bounds the gain of any mix;
* **estimate**: the memory of a mix is linear in the share of weight bytes
  kept whole, so at most ``f = (cap - peak_3) / (peak_low - peak_3)`` of them
  can be; taking the time linear in that share too, a mix takes ``t_3 -
  f (t_3 - t_low)``.

Run: ``python -m benchmarks.dp_axis_bound [--quick]``; results in
``benchmarks/results/dp_axis_bound-<device>.json`` and its README section.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import autopar
from autopar.api import as_graph, planner_for
from autopar.cost import MEMORY_HEADROOM
from autopar.errors import StrategyError
from autopar.search import grid as search_grid
from autopar.search.grid import grid_configs
from autopar.search.planner import MANUAL
from benchmarks.common import each_case, quick_cli, timed_run
from benchmarks.mesh_search import LLAMA_70B
from benchmarks.tensor2d import GPT_1_3B, GPT_6_7B, LLAMA_8B
from benchmarks.tensor2d import NAMES as _NAMES

NAMES = {**_NAMES, LLAMA_70B: "Llama-3 70B"}

#: (model, cluster, devices, global batch): memory-tight requests (few GPUs for the model)
#: and roomy ones, on both presets
CASES = {
    "gpt1.3b-a100x16": (GPT_1_3B, "dgx-a100-80g", 16, 64),
    "gpt6.7b-a100x8": (GPT_6_7B, "dgx-a100-80g", 8, 64),
    "gpt6.7b-a100x64": (GPT_6_7B, "dgx-a100-80g", 64, 512),
    "llama8b-h100x8": (LLAMA_8B, "dgx-h100", 8, 64),
    "llama8b-h100x32": (LLAMA_8B, "dgx-h100", 32, 256),
    "llama70b-h100x64": (LLAMA_70B, "dgx-h100", 64, 128),
}
QUICK = ["gpt1.3b-a100x16"]


def _flat(graph: Any, devices: int, batch: int) -> list:
    """Every configuration without a pipeline the search's grid has, ZeRO-3 ones alone (their
    ZeRO-1/2 forms are made from them)."""
    return [c for line in grid_configs(graph, devices, batch) for c in line if c.zero == 3]


@contextlib.contextmanager
def without_layer_choice() -> Iterator[None]:
    """The search without ``fsdp_layers`` (no ZeRO-3 configuration refined)."""
    tries, search_grid.FSDP_TRIES = search_grid.FSDP_TRIES, 0
    try:
        yield
    finally:
        search_grid.FSDP_TRIES = tries


def searched(graph: Any, cluster: str, devices: int, batch: int, mode: str) -> dict[str, Any]:
    """The plan of ``mode`` with and without the per-layer dp choice: (strategy, step time) each, and the gain."""
    out = {}
    for label, ctx in (("without", without_layer_choice), ("with", contextlib.nullcontext)):
        with ctx():
            p = autopar.plan(graph, cluster=cluster, devices=devices, global_batch=batch, search_mode=mode)
            out[label] = (p.strategy, p.predicted["step_time_s"])
    out["gain"] = (out["without"][1] - out["with"][1]) / out["without"][1]
    return out


def row(key: str) -> dict[str, Any]:
    spec, cluster, devices, batch = CASES[key]
    graph = as_graph(spec)
    auto = searched(graph, cluster, devices, batch, "ilp")
    grid = searched(graph, cluster, devices, batch, "grid")
    best = grid["without"]
    t_best = best[1]
    planner = planner_for(graph, cluster, "adamw", None, devices=devices, global_batch=batch)
    bound = estimate = None
    pairs = 0
    for three in _flat(graph, devices, batch):
        try:
            e3 = planner.evaluate(three, MANUAL)
        except StrategyError:
            continue
        if not e3.fits:
            continue
        cap = e3.device_memory_bytes * MEMORY_HEADROOM
        for z in (1, 2):
            low = dataclasses.replace(three, zero=z)
            try:
                el = planner.evaluate(low, MANUAL)
            except StrategyError:
                continue
            if el.fits or el.peak_memory_bytes <= e3.peak_memory_bytes:
                continue    # it fits whole (the search has it) or keeps no more than ZeRO-3
            pairs += 1
            f = max(0.0, min(1.0, (cap - e3.peak_memory_bytes) / (el.peak_memory_bytes - e3.peak_memory_bytes)))
            mix = e3.step_time_s - f * max(0.0, e3.step_time_s - el.step_time_s)
            if bound is None or el.step_time_s < bound[0]:
                bound = (el.step_time_s, low.to_string())
            if estimate is None or mix < estimate[0]:
                estimate = (mix, three.to_string(), z, f)
    gain = (lambda t: max(0.0, (t_best - t) / t_best) if t is not None else 0.0)
    return {"case": key, "model": NAMES[spec], "cluster": cluster, "devices": devices, "batch": batch,
            "best": best[0], "best_s": t_best, "pairs": pairs,
            "auto_without": auto["without"][0], "auto_without_s": auto["without"][1],
            "auto_with": auto["with"][0], "auto_with_s": auto["with"][1], "auto_gain": auto["gain"],
            "grid_with": grid["with"][0], "grid_with_s": grid["with"][1], "grid_gain": grid["gain"],
            "bound_s": bound[0] if bound else None, "bound_config": bound[1] if bound else None,
            "bound_gain": gain(bound[0] if bound else None),
            "estimate_s": estimate[0] if estimate else None,
            "estimate_config": estimate[1] if estimate else None,
            "estimate_low_zero": estimate[2] if estimate else None,
            "estimate_whole_share": estimate[3] if estimate else None,
            "estimate_gain": gain(estimate[0] if estimate else None)}


def run(keys: list[str]) -> dict[str, Any]:
    rows = each_case(keys, row)
    ok = [r for r in rows if "error" not in r]
    worst = max(ok, key=lambda r: r["estimate_gain"], default=None)
    return {
        "title": "The dp axis per layer (ZeRO-3 for some layers, ZeRO-1/2 for the rest): what it buys, and its bound",
        "description": " ".join(__doc__.split("\n\n")[i].replace("\n", " ") for i in (1, 2, 3)),
        "params": {"cases": {k: CASES[k] for k in keys}, "memory_headroom": MEMORY_HEADROOM},
        "table": {
            "columns": ["model", "cluster", "devices", "batch", "plan without", "s", "plan with the layer choice",
                        "s", "gain", "grid mode: gain", "bound gain", "estimate gain", "share kept whole"],
            "rows": [[r["model"], r["cluster"], r["devices"], r["batch"], r["auto_without"], r["auto_without_s"],
                      r["auto_with"], r["auto_with_s"], r["auto_gain"], r["grid_gain"], r["bound_gain"],
                      r["estimate_gain"], r["estimate_whole_share"]] for r in ok],
        },
        "summary": {
            "cases": len(ok),
            "largest gain of the layer choice (default search)": max((r["auto_gain"] for r in ok), default=0.0),
            "largest gain of the layer choice (grid mode)": max((r["grid_gain"] for r in ok), default=0.0),
            "largest bound on the gain": max((r["bound_gain"] for r in ok), default=0.0),
            "largest estimated gain": worst["estimate_gain"] if worst else 0.0,
            "case of the largest estimated gain": worst["case"] if worst else None,
        },
        "records": rows,
    }


def main(quick: bool = False, save_result: bool = True) -> dict[str, Any]:
    keys = QUICK if quick else list(CASES)
    return timed_run("dp_axis_bound", lambda: run(keys), quick, save_result)


def cli() -> None:
    quick_cli("benchmarks.dp_axis_bound", __doc__, QUICK, main)


if __name__ == "__main__":
    cli()
