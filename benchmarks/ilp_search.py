"""The intra-operator ILP: planning time on the issue's targets, and plan
quality against the exhaustive manual (Megatron-style) grid.

Planning time is measured from the zoo string to the saved plan file, as
``autopar plan <spec> --out plan.json`` does it (model build on the meta
device, trace, search, plan JSON), in this process after the imports:

* GPT-3 175B on 1024 dgx-a100-80g GPUs, global batch 1536 (target <= 30 s),
  and the same model with 24 layers (96 layers must cost <= 1.5x);
* a Llama-3-8B-shaped model on 32 dgx-h100 GPUs, global batch 8 (<= 10 s).

Plan quality: for each case the predicted step time of
``search_mode="dynamic_programming"`` (the ILP picks the placement of every
op on the tensor-parallel axis of every configuration) against
``search_mode="grid"`` (the same mesh x microbatch x recompute x ZeRO grid
with Megatron-style placements), under the same cost model. The ratio must
never exceed 1; rows below 1 are where per-op freedom helps.

    .venv/bin/python -m benchmarks.ilp_search [--quick]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

import autopar

from .common import timed_run

NAME = "ilp_search"
console = Console(stderr=True, highlight=False, soft_wrap=True)

GPT3 = "gpt:layers={layers},hidden=12288,heads=96,seq=2048,vocab=51200"
LLAMA3_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"
TIMED = [
    ("GPT-3 175B", GPT3.format(layers=96), "dgx-a100-80g", 1024, 1536, 30.0),
    ("GPT-3 175B, 24 layers", GPT3.format(layers=24), "dgx-a100-80g", 1024, 1536, None),
    ("Llama-3-8B", LLAMA3_8B, "dgx-h100", 32, 8, 10.0),
]
# (label, spec, cluster, devices, global batch): large models on GPU presets and
# the small zoo models on the calibrated-free cpu preset (4 processes)
QUALITY = [
    ("GPT-3 175B", GPT3.format(layers=96), "dgx-a100-80g", 1024, 1536),
    ("GPT-3 6.7B", "gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200", "dgx-a100-80g", 64, 1024),
    ("GPT-3 1.3B", "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200", "dgx-h100", 8, 512),
    ("Llama-3-8B", LLAMA3_8B, "dgx-h100", 32, 8),
    ("Llama-3-8B, batch 64", LLAMA3_8B, "dgx-h100", 64, 64),
    ("small GPT", "gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024", "cpu", 4, 16),
    ("small Llama", "llama:layers=4,hidden=256,heads=8,kv_heads=4,ffn=512,seq=128,vocab=1024", "cpu", 4, 16),
    ("MLP", "mlp:layers=4,inp=256,hidden=1024,classes=16", "cpu", 4, 64),
    ("CNN", "cnn:layers=3,channels=64,image=32,classes=10", "cpu", 4, 32),
]
QUICK_QUALITY = ["GPT-3 175B", "Llama-3-8B", "small GPT", "small Llama", "MLP"]


def time_plan(spec: str, cluster: str, devices: int, batch: int) -> dict[str, Any]:
    """Zoo string -> saved plan, timed (one cold run in this process)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        graph = autopar.api.as_graph(spec)
        t1 = time.perf_counter()
        p, record = autopar.api.plan_and_record(graph, cluster=cluster, devices=devices, global_batch=batch)
        p.save(Path(tmp) / "plan.json")
        t2 = time.perf_counter()
    res = record.result
    ilp = p.data["search"].get("ilp", {})
    return {"total_s": t2 - t0, "trace_s": t1 - t0, "search_s": t2 - t1, "strategy": p.strategy,
            "step_time_s": p.predicted["step_time_s"], "configs": res.candidates if res else None,
            "ilp_solves": res.ilp_solves if res else 0, "ilp_time_s": res.ilp_time_s if res else 0.0,
            "ilp_decisions": ilp.get("decisions"), "ilp_nodes": ilp.get("nodes"),
            "ilp_variables": ilp.get("variables")}


def quality(spec: str, cluster: str, devices: int, batch: int) -> dict[str, Any]:
    graph = autopar.api.as_graph(spec)
    out: dict[str, Any] = {}
    for mode in ("grid", "dynamic_programming"):
        try:
            p = autopar.plan(graph, cluster=cluster, devices=devices, global_batch=batch, search_mode=mode)
            out[mode] = {"strategy": p.strategy, "step_time_s": p.predicted["step_time_s"],
                         "tp_axis": p.data["search"].get("tp_axis")}
        except autopar.NoFeasibleStrategyError as e:
            out[mode] = {"error": str(e)}
    g, i = out["grid"].get("step_time_s"), out["dynamic_programming"].get("step_time_s")
    out["ratio"] = i / g if g and i else None
    return out


def run(quick: bool) -> dict[str, Any]:
    # one-time costs (lazy imports inside torch.fx / export, the solver library) are
    # paid once here, not by whichever case happens to run first
    autopar.plan("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", cluster="dgx-h100", devices=8, global_batch=8)
    timed = []
    for label, spec, cluster, devices, batch, target in TIMED:
        r = time_plan(spec, cluster, devices, batch)
        r.update(label=label, spec=spec, cluster=cluster, devices=devices, global_batch=batch, target_s=target)
        console.print(f"{label} on {devices} {cluster}: {r['total_s']:.1f} s (trace {r['trace_s']:.1f} s, "
                      f"search {r['search_s']:.1f} s, {r['ilp_solves']} ILP solves in {r['ilp_time_s']:.1f} s) "
                      f"-> {r['strategy']}")
        timed.append(r)
    rows_q = []
    for label, spec, cluster, devices, batch in QUALITY:
        if quick and label not in QUICK_QUALITY:
            continue
        q = quality(spec, cluster, devices, batch)
        q.update(label=label, spec=spec, cluster=cluster, devices=devices, global_batch=batch)
        console.print(f"{label}: ILP/grid {q['ratio']}")
        rows_q.append(q)
    by = {r["label"]: r for r in timed}
    layers_ratio = by["GPT-3 175B"]["total_s"] / by["GPT-3 175B, 24 layers"]["total_s"]
    ratios = [q["ratio"] for q in rows_q if q["ratio"] is not None]
    rows = []
    for r in timed:
        rows.append([r["label"], f"{r['devices']} x {r['cluster']}", r["total_s"], r["trace_s"], r["search_s"],
                     r["ilp_solves"], r["ilp_time_s"], f"{r['ilp_decisions']} / {r['ilp_nodes']}",
                     r["target_s"] or "-", r["strategy"]])
    qrows = [[q["label"], f"{q['devices']} x {q['cluster']}", q["global_batch"],
              q["grid"].get("strategy", "none fits"), q["grid"].get("step_time_s"),
              q["dynamic_programming"].get("strategy", "none fits"), q["dynamic_programming"].get("step_time_s"),
              q["ratio"]] for q in rows_q]
    return {
        "title": "ILP search: planning time and plan quality against the manual grid",
        "description": __doc__.split("\n\n")[0].replace("\n", " "),
        "params": {"timed": [t[:5] for t in TIMED], "quality": [q for q in QUALITY
                                                                 if not quick or q[0] in QUICK_QUALITY]},
        "timed": timed, "quality": rows_q,
        "summary": {
            "175B on 1024 A100, zoo string to saved plan (s, target <= 30)": by["GPT-3 175B"]["total_s"],
            "96 layers / 24 layers, zoo string to saved plan (target <= 1.5)": layers_ratio,
            "96 layers / 24 layers, search only (traced graph to plan)":
                by["GPT-3 175B"]["search_s"] / by["GPT-3 175B, 24 layers"]["search_s"],
            "96 layers / 24 layers, ILP time per solve":
                (by["GPT-3 175B"]["ilp_time_s"] / max(by["GPT-3 175B"]["ilp_solves"], 1)) /
                (by["GPT-3 175B, 24 layers"]["ilp_time_s"] / max(by["GPT-3 175B, 24 layers"]["ilp_solves"], 1)),
            "Llama-3-8B on 32 H100 (s, target <= 10)": by["Llama-3-8B"]["total_s"],
            "ILP / grid predicted step time, worst (must be <= 1)": max(ratios) if ratios else None,
            "ILP / grid, best": min(ratios) if ratios else None,
            "cases where the ILP is strictly better (< 0.999)": sum(1 for x in ratios if x < 0.999),
        },
        "table": {"columns": ["model", "cluster", "total s", "trace s", "search s", "ILP solves", "ILP s",
                              "ILP decisions / nodes", "target s", "plan"], "rows": rows},
        "quality_table": {"columns": ["model", "cluster", "batch", "grid plan", "grid step s", "ILP plan",
                                      "ILP step s", "ILP / grid"], "rows": qrows},
        "notes": [
            "Times are wall-clock on this machine, one cold run each after a warm-up plan of a tiny model (so "
            "one-time imports are excluded); the ILP is solved by HiGHS (highspy), given the whole model at once.",
            "Repeated layers share their ILP variables, so the ILP of 96 blocks has as many decisions as that of "
            "24 and costs the same per solve. End to end, 96 layers cost more than 1.5x 24 layers: tracing, the "
            "Megatron propagation used as the search's reference, the per-configuration sums and the plan record "
            "are still linear in the number of nodes (4x more nodes), and the 96-layer model needs more "
            "microbatches to fit, so the bisection visits more configurations.",
            "Where the ILP wins (ratio < 1), it is by per-op choices the Megatron pattern does not have: "
            "sequence-sharded norms and K/V projections for Llama-3-8B (Megatron-style sequence parallelism "
            "found by the search), the tensor-parallel axis used as extra data parallelism for the attention of "
            "GPT-3 6.7B, which then moves the best mesh from tp=2 to tp=4, and a replicated classifier head with "
            "the tensor-parallel axis splitting the batch for the CNN.",
            "Quality rows compare predictions of the same cost model, not measurements. The search keeps, per "
            "configuration, the better of the ILP plan and the Megatron plan only as a guard for the linearised "
            "memory bound; `best_plan_per_config_from` in `autopar plan --explain` shows how often each won.",
            "Quality table: " + "; ".join(f"{r[0]} ({r[1]}, batch {r[2]}): grid {r[3]} {_s(r[4])}, ILP {r[5]} "
                                          f"{_s(r[6])}, ratio {_r(r[7])}" for r in qrows),
        ],
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g} s"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(quick: bool = False, save_result: bool = True) -> dict[str, Any]:
    return timed_run(NAME, lambda: run(quick), quick, save_result, console.print)


def cli() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ilp_search", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer plan-quality cases")
    main(ap.parse_args().quick)


if __name__ == "__main__":
    cli()
