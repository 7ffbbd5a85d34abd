"""Does the automatic search pick a mesh of tensor axes on the presets?

Per request (a preset model on a preset cluster, the full search space),
the plan with the single-axis tensor group only (``tp_modes=("1d",)``, the
default) against the plan with ``tp_mode=mesh`` in the search
(``tp_modes=("1d", "mesh")``): the search refines its two fastest
configurations, flat or pipelined, with the tp group as a mesh the joint
program decides (:func:`autopar.search.grid._try_mesh`). Per row: both
plans' strategy and predicted step time, the best mesh the search tried,
and the planning time of each. The times are the cost model's (bf16,
AdamW), not measured: no GPU cluster is reachable here.

Run: ``python -m benchmarks.mesh_search [--quick]``; results in
``benchmarks/results/mesh_search-<device>.json`` and its README section.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import autopar
from autopar.search import grid
from benchmarks.common import save

GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
LLAMA_70B = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=8192,vocab=128256"
LLAMA_70B_8L = "llama:layers=8,hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=8192,vocab=128256"
LLAMA_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"
NAMES = {GPT3: "GPT-3 175B", LLAMA_70B: "Llama-3 70B", LLAMA_70B_8L: "Llama-3 70B shape, 8 layers",
         LLAMA_8B: "Llama-3 8B"}

#: (model, cluster, devices, global batch)
CASES = [
    (GPT3, "dgx-h100", 1024, 1536),
    (GPT3, "dgx-a100-80g", 1024, 1536),
    (LLAMA_70B, "dgx-h100", 512, 512),
    (LLAMA_70B_8L, "dgx-h100", 64, 64),
    (LLAMA_8B, "dgx-h100", 32, 256),
]
QUICK = [(GPT3, "dgx-h100", 1024, 1536)]


def _tried_meshes() -> tuple[list, Callable]:
    """Record every mesh the search evaluates (the best one is reported)."""
    seen: list = []
    inner = grid._mesh_estimate

    def recording(planner, mesh):
        found, n = inner(planner, mesh)
        seen.append((mesh.to_string(), None if found is None else found[0].step_time_s))
        return found, n

    return seen, recording


def row(spec: str, cluster: str, devices: int, batch: int) -> dict:
    graph = autopar.api.as_graph(spec)
    t0 = time.perf_counter()
    flat = autopar.plan(graph, cluster=cluster, devices=devices, global_batch=batch)
    t1 = time.perf_counter()
    seen, recording = _tried_meshes()
    grid._mesh_estimate, kept = recording, grid._mesh_estimate
    try:
        t2 = time.perf_counter()
        mesh = autopar.plan(graph, cluster=cluster, devices=devices, global_batch=batch, tp_modes=("1d", "mesh"))
        t3 = time.perf_counter()
    finally:
        grid._mesh_estimate = kept
    fitting = [(t, s) for s, t in seen if t is not None]
    best_mesh = min(fitting) if fitting else (None, None)
    return {"model": NAMES[spec], "spec": spec, "cluster": cluster, "devices": devices, "global_batch": batch,
            "flat_strategy": flat.strategy, "flat_step_s": flat.predicted["step_time_s"],
            "searched_strategy": mesh.strategy, "searched_step_s": mesh.predicted["step_time_s"],
            "picks_mesh": mesh.config.tp_mode == "mesh", "best_mesh": best_mesh[1], "best_mesh_step_s": best_mesh[0],
            "meshes_tried": len(seen), "meshes_fitting": len(fitting),
            "plan_s_1d": t1 - t0, "plan_s_with_mesh": t3 - t2}


def main(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    rows = []
    for case in QUICK if quick else CASES:
        r = row(*case)
        rows.append(r)
        print(f"{r['model']:28s} {r['cluster']:13s} {r['devices']:5d}: 1d {r['flat_step_s']:.4g} s, with mesh "
              f"{r['searched_step_s']:.4g} s ({'mesh' if r['picks_mesh'] else '1d'}; best mesh "
              f"{r['best_mesh_step_s']}), plan {r['plan_s_1d']:.2f} s / {r['plan_s_with_mesh']:.2f} s", flush=True)
    picked = [r for r in rows if r["picks_mesh"]]
    summary = {"requests where the search picks a mesh": f"{len(picked)} of {len(rows)}",
               "best gain of a picked mesh (1 - mesh / 1d)":
                   round(max((1 - r["searched_step_s"] / r["flat_step_s"] for r in picked), default=0.0), 4),
               "slowest planning with mesh in the search (s)": round(max(r["plan_s_with_mesh"] for r in rows), 2)}
    res = {
        "title": "The search with tensor meshes on the presets",
        "description": "Per request, the plan of the default search (1d tensor groups) against the search with "
                       "`tp_modes=(\"1d\", \"mesh\")`, which refines its two fastest configurations (flat or "
                       "pipelined) with the tp group as a mesh the joint program decides. Predicted step times "
                       "(cost model, bf16, AdamW), planning wall time on this machine.",
        "notes": ["Times are the cost model's predictions; no GPU cluster is reachable here.",
                  "A pipelined mesh is decided by the joint program without a memory row where that fits with "
                  "even stages, else with one row per pipeline rank at even stages (kept where it fits and is "
                  "faster)."],
        "summary": summary,
        "table": {"columns": ["model", "cluster", "devices", "batch", "1d plan", "1d s", "with mesh", "s",
                              "best mesh tried", "mesh s", "plan s (1d)", "plan s (with mesh)"],
                  "rows": [[r["model"], r["cluster"], r["devices"], r["global_batch"], r["flat_strategy"],
                            r["flat_step_s"], r["searched_strategy"], r["searched_step_s"], r["best_mesh"],
                            r["best_mesh_step_s"], r["plan_s_1d"], r["plan_s_with_mesh"]] for r in rows]},
        "rows": rows, "params": {"quick": quick}, "wall_s": time.perf_counter() - t0,
    }
    path = save("mesh_search", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one request")
    main(ap.parse_args().quick)
