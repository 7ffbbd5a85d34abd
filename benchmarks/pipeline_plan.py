"""Pipeline planning: the automatic plan against the exhaustive manual grid
with pipelines, and the simulated bubble against the closed form.

* GPT-3 175B on 1024 dgx-a100-80g GPUs, global batch 1536 (the issue's
  target: the plan uses pp and is at least as good as the best manual
  (dp, tp, pp, microbatch size, recompute, schedule) configuration, planning
  within 30 s), and a 24-layer 2.7B-sized GPT on 64 GPUs.
* The manual grid evaluates every strategy string as written
  (``autopar.evaluate``: Megatron placements, equal layers per stage), over
  tp dividing the heads, every pp up to the layer count, every microbatch
  size dividing the per-replica batch (``--quick``: powers of two), recompute
  none/selective/full, ZeRO 0/1, and the GPipe, 1F1B and interleaved (2
  chunks) schedules.
* The bubble the simulator predicts for GPipe and 1F1B on uniform stages
  against ``(p - 1) / (m + p - 1)``.

    .venv/bin/python -m benchmarks.pipeline_plan [--quick]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console

import autopar
from autopar.cost import tp_valid_sizes
from autopar.errors import StrategyError
from autopar.pipeline.partition import units
from autopar.pipeline.schedule import build_schedule, simulate
from autopar.spec import RECOMPUTE, divisors

from .common import timed_run
from .ilp_search import GPT3

NAME = "pipeline_plan"
console = Console(stderr=True, highlight=False, soft_wrap=True)
CASES = [
    ("GPT-3 175B", GPT3.format(layers=96), "dgx-a100-80g", 1024, 1536),
    ("GPT 2.7B (24 layers)", "gpt:layers=24,hidden=2560,heads=32,seq=2048,vocab=51200", "dgx-a100-80g", 64, 512),
]
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def manual_grid(graph, devices: int, batch: int, quick: bool) -> list[str]:
    """Every manual pipelined or flat strategy of the grid (module docstring)."""
    try:
        n_layers = units(graph).layers
    except StrategyError:   # nothing to pipeline
        n_layers = 1
    out = []
    for tp in [t for t in tp_valid_sizes(graph) if devices % t == 0]:
        for pp in divisors(devices // tp):
            if pp > n_layers:
                continue
            dp = devices // (tp * pp)
            if batch % dp:
                continue
            per_replica = batch // dp
            sizes = [b for b in divisors(per_replica) if not quick or b & (b - 1) == 0]
            for b in sizes:
                m = per_replica // b
                scheds = SCHEDULES if pp > 1 else (("none", 1),)
                for sched, chunks in scheds:
                    if pp > 1 and (m < pp or (sched == "interleaved" and (m % pp or pp * chunks > n_layers))):
                        continue
                    for rc in RECOMPUTE:
                        for z in (0, 1):
                            if z and dp == 1:
                                continue
                            pipe = f",schedule={sched},chunks={chunks}" if pp > 1 else ""
                            out.append(f"dp={dp},tp={tp},pp={pp},microbatches={m}{pipe},recompute={rc},zero={z}")
    return out


def best_manual(graph, cluster: str, devices: int, batch: int, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    best, fitting, strategies = None, 0, manual_grid(graph, devices, batch, quick)
    for s in strategies:
        try:
            e = autopar.evaluate(graph, cluster=cluster, devices=devices, strategy=s, global_batch=batch)
        except StrategyError:
            continue
        if e.fits:
            fitting += 1
            if best is None or e.step_time_s < best.step_time_s:
                best = e
    return {"best": best, "evaluated": len(strategies), "fitting": fitting, "grid_s": time.perf_counter() - t0}


def bubble_rows() -> list[list[Any]]:
    rows = []
    for sched in ("gpipe", "1f1b"):
        for p, m in ((4, 4), (4, 16), (8, 8), (8, 64), (16, 128)):
            tl = simulate(build_schedule(sched, p, m), [1.0] * p, [2.0] * p)
            rows.append([sched, p, m, tl.bubble_fraction, (p - 1) / (m + p - 1)])
    return rows


def run(quick: bool) -> dict[str, Any]:
    autopar.plan("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", cluster="dgx-h100", devices=8, global_batch=8)
    records = []
    for label, spec, cluster, devices, batch in CASES:
        t0 = time.perf_counter()
        graph = autopar.api.as_graph(spec)
        p, record = autopar.api.plan_and_record(graph, cluster=cluster, devices=devices, global_batch=batch)
        plan_s = time.perf_counter() - t0
        grid = best_manual(graph, cluster, devices, batch, quick)
        g = grid["best"]
        auto = record.result.best
        rec = {"label": label, "spec": spec, "cluster": cluster, "devices": devices, "global_batch": batch,
               "plan_s": plan_s, "auto_strategy": p.strategy, "auto_step_s": auto.step_time_s,
               "auto_layers": (p.data.get("pipeline") or {}).get("layers"),
               "auto_bubble": (p.data.get("pipeline") or {}).get("bubble_fraction"),
               "grid_strategy": g.strategy if g else None, "grid_step_s": g.step_time_s if g else None,
               "grid_evaluated": grid["evaluated"], "grid_fitting": grid["fitting"], "grid_s": grid["grid_s"],
               "grid_over_auto": (g.step_time_s / auto.step_time_s) if g else None}
        console.print(f"{label}: auto {p.strategy} {auto.step_time_s:.3f} s in {plan_s:.1f} s; best manual "
                      f"{rec['grid_strategy']} {rec['grid_step_s']} ({grid['evaluated']} strategies, "
                      f"{grid['grid_s']:.0f} s)")
        records.append(rec)
    bubbles = bubble_rows()
    by = {r["label"]: r for r in records}
    big = by["GPT-3 175B"]
    return {
        "title": "Pipeline planning: automatic plan vs the manual grid with pipelines; simulated bubble",
        "description": __doc__.split("\n\n")[0].replace("\n", " "),
        "params": {"cases": [list(c) for c in CASES], "quick": quick},
        "records": records,
        "bubbles": bubbles,
        "table": {
            "columns": ["model", "devices", "batch", "plan s", "auto strategy", "auto step s", "best manual",
                        "manual step s", "manual/auto", "manual evaluated"],
            "rows": [[r["label"], f"{r['devices']} x {r['cluster']}", r["global_batch"], r["plan_s"],
                      r["auto_strategy"], r["auto_step_s"], r["grid_strategy"], r["grid_step_s"],
                      r["grid_over_auto"], r["grid_evaluated"]] for r in records],
        },
        "summary": {
            "175B on 1024 A100: plan uses pp": bool(big["auto_strategy"] and "pp=1," not in big["auto_strategy"]),
            "175B: best manual step / auto step (target >= 1)": big["grid_over_auto"],
            "175B: zoo string to plan (s, target <= 30)": big["plan_s"],
            "max |simulated bubble - (p-1)/(m+p-1)|": max(abs(r[3] - r[4]) for r in bubbles),
        },
    }


def main(quick: bool = True) -> dict[str, Any]:
    return timed_run(NAME, lambda: run(quick), quick, log=console.print)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="power-of-two microbatch sizes only in the grid")
    main(quick=ap.parse_args().quick)
