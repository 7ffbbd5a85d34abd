"""Where the seeds' extra axes win under the cost model, and what searching them costs.

Predictions only (no training), two tables:

1. **Context parallelism (``cp``) at long sequences.** Per case, the
   automatic search as it is (cp offered for attention over 16k positions or
   more, :func:`autopar.strategies.context.cp_choices`) against the same
   search with cp left out (``cp_choices`` returning ``[1]``: what it picked
   before cp existed). The ratio is with / without.
2. **Planning time with the tensor grids in the search.** GPT-3 175B on 1024
   dgx-a100-80g (global batch 1536), from the traced graph to the plan: the
   default search (1d layouts), and with ``tp_modes=("1d", "2d", "2.5d",
   "3d")`` (every q x q grid, 2 and 4 deep 2.5d grid and q x q x q cube the
   heads and batch allow, on top of the 1d search); which strategy each picks.

Where 2D / 2.5D / 3D win case by case is ``benchmarks/tensor2d.py``'s table.

Run: ``python -m benchmarks.nd_search [--quick]``; results in
``benchmarks/results/nd_search-<device>.json`` and its README section. Times
are one run each on a shared CPU; they vary with load.
"""
from __future__ import annotations

import argparse
import time
from unittest import mock

import autopar
from benchmarks.common import save

LLAMA_8B_128K = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=131072,vocab=128256"
LLAMA_70B_128K = "llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=131072,vocab=128256"
LLAMA_8B_32K = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=32768,vocab=128256"
NAMES = {LLAMA_8B_128K: "Llama-3 8B, 128k", LLAMA_70B_128K: "Llama-3 70B, 128k", LLAMA_8B_32K: "Llama-3 8B, 32k"}
GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"

#: (model, cluster, devices, global batch, search mode)
CP_CASES = [
    (LLAMA_8B_128K, "dgx-h100", 64, 8, "grid"),
    (LLAMA_8B_32K, "dgx-h100", 64, 32, "grid"),
    (LLAMA_70B_128K, "dgx-h100", 512, 16, "grid"),
]
QUICK = CP_CASES[:1]
GRID_MODES = ("1d", "2d", "2.5d", "3d")


def _plan(model: str, cluster: str, devices: int, batch: int, **kw) -> tuple[autopar.Plan, float]:
    """The plan and its planning time from a fresh trace (a graph keeps its
    evaluators' caches: a second plan on the same graph would be timed warm)."""
    graph = autopar.trace(model)
    t0 = time.perf_counter()
    plan = autopar.plan(graph, cluster=cluster, devices=devices, global_batch=batch, **kw)
    return plan, time.perf_counter() - t0


def cp_row(model: str, cluster: str, devices: int, batch: int, mode: str) -> dict:
    """One case of table 1: the search with and without cp."""
    with_cp, t_with = _plan(model, cluster, devices, batch, search_mode=mode)
    with mock.patch("autopar.search.grid.cp_choices", lambda *a, **k: [1]):
        without, t_without = _plan(model, cluster, devices, batch, search_mode=mode)
    a, b = with_cp.predicted["step_time_s"], without.predicted["step_time_s"]
    return {"model": NAMES[model], "cluster": cluster, "devices": devices, "global_batch": batch, "mode": mode,
            "with_cp": with_cp.strategy, "with_cp_s": a, "with_cp_plan_s": t_with,
            "without_cp": without.strategy, "without_cp_s": b, "without_cp_plan_s": t_without,
            "ratio": a / b}


def grid_time_row() -> dict:
    """Table 2: GPT-3 175B planned with the default search and with every tensor grid."""
    default, t_default = _plan(GPT3, "dgx-a100-80g", 1024, 1536)
    grids, t_grids = _plan(GPT3, "dgx-a100-80g", 1024, 1536, tp_modes=GRID_MODES)
    return {"model": "GPT-3 175B", "cluster": "dgx-a100-80g", "devices": 1024, "global_batch": 1536,
            "default": default.strategy, "default_s": default.predicted["step_time_s"], "default_plan_s": t_default,
            "grids": grids.strategy, "grids_s": grids.predicted["step_time_s"], "grids_plan_s": t_grids}


def main(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    rows = []
    for case in QUICK if quick else CP_CASES:
        r = cp_row(*case)
        rows.append(r)
        print(f"{r['model']:18s} {r['devices']:4d} x {r['global_batch']:3d}: with cp {r['with_cp']} "
              f"{r['with_cp_s']:.3f} s, without {r['without_cp']} {r['without_cp_s']:.3f} s "
              f"({r['ratio']:.3f})", flush=True)
    g = None if quick else grid_time_row()
    if g:
        print(f"GPT-3 175B / 1024: default {g['default_plan_s']:.1f} s -> {g['default']}; with grids "
              f"{g['grids_plan_s']:.1f} s -> {g['grids']}", flush=True)
    wins = [r for r in rows if r["ratio"] < 1]
    summary = {"long-sequence cases where cp wins": f"{len(wins)} of {len(rows)}",
               "best cp gain": f"{(1 - min(r['ratio'] for r in wins)) * 100:.1f}%" if wins else "none"}
    if g:
        summary.update({"GPT-3 175B / 1024: plan time, default search (s)": round(g["default_plan_s"], 1),
                        "GPT-3 175B / 1024: plan time, with 2d, 2.5d, 3d (s)": round(g["grids_plan_s"], 1),
                        "GPT-3 175B / 1024: the grids' pick": g["grids"]})
    res = {
        "title": "Context parallelism at long sequences, and planning time with the tensor grids",
        "description": "Predicted step times (bf16, AdamW). Table: the search as it is against the same search "
                       "without context parallelism (cp choices limited to 1), per long-sequence case (search "
                       "mode in the row). Summary: GPT-3 175B on 1024 dgx-a100-80g, global batch 1536, planned "
                       "from a fresh trace each with the default search and with `tp_modes=('1d', '2d', '2.5d', "
                       "'3d')`; one run each on a shared 2-core CPU.",
        "summary": summary,
        "table": {"columns": ["model", "cluster", "devices", "batch", "mode", "with cp", "s", "without cp", "s",
                              "with / without", "plan s (with, without)"],
                  "rows": [[r["model"], r["cluster"], r["devices"], r["global_batch"], r["mode"], r["with_cp"],
                            r["with_cp_s"], r["without_cp"], r["without_cp_s"], r["ratio"],
                            f"{r['with_cp_plan_s']:.1f}, {r['without_cp_plan_s']:.1f}"] for r in rows]},
        "rows": rows, "grid_time": g, "params": {"quick": quick}, "wall_s": time.perf_counter() - t0,
    }
    path = save("nd_search", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first case only, no planning-time row")
    main(ap.parse_args().quick)
