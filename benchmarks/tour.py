"""The user tour (issue 18): what a new user meets who takes the models people
train and asks autopar for each strategy family, on this CPU and for a GPU
cluster.

Models: Hugging Face GPT-2, Llama and BERT (masked LM), torchvision's
ResNet-18, the residual MLP of ``examples/custom_model.py`` and a hand-written
nanoGPT attention (``B, T, C = x.size()``, a causal-mask buffer sliced by
``T``), as :mod:`benchmarks.real_models` builds them. Strategies on 4
processes: ``dp=4``, ``tp=4``, ``dp=2,tp=2``, ``pp=4,microbatches=4`` and
``auto``. Clusters: the ``cpu`` preset (what :func:`autopar.parallelize`
uses on this machine) and the ``dgx-h100`` preset with 4 devices. Each cell
plans with :func:`autopar.plan` (manual strategies are evaluated, ``auto``
searched), then runs :func:`autopar.parallelize` with the same strategy and
cluster on 4 gloo CPU processes for 3 SGD steps and compares with one process
as the matrix does (:func:`benchmarks.matrix.check`: fp32 losses within a
relative 1e-4 and the final weights; the GPU preset's default precision is
bf16, whose runs are compared with one process under the same bf16 policy
within 2e-2). The compiled program does not depend on the preset beyond the
precision it resolves and, for ``auto``, the plan it picks: that is what the
GPU rows show.

A cell reads ``yes`` (plans, runs, equals one process), ``n/a`` (the planner
refuses the strategy for that model with a StrategyError; the note gives
the one-line message the user sees) or ``FAIL`` (the note says why). The
``auto`` cell names the strategy the search picked; it must run (issue 18:
whatever ``strategy="auto"`` returns, ``parallelize`` runs). The last column
is the cost model's step time for auto's plan on that preset, a prediction:
nothing here is timed (the 2 cores were shared with other jobs, so the
wall times the JSON keeps per cell are inflated and say nothing of speed).

    .venv/bin/python -m benchmarks.tour [--models a,b] [--no-save] [--rescore]
"""
from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

from rich.console import Console

from . import matrix
from .real_models import CASES, RESNET_LR

MODELS = ["hf-gpt2", "hf-llama", "hf-bert", "tv-resnet18", "mlp", "nanogpt"]
STRATEGIES: dict[str, str] = {"dp": "dp=4", "tp": "tp=4", "dp x tp": "dp=2,tp=2",
                              "pp": "pp=4,microbatches=4", "auto": "auto"}
CLUSTERS = ["cpu", "dgx-h100"]
DEVICES = 4
# what a strategy string leaves out when it is at its default (the table's short form)
_DEFAULTS = {"dp=1", "tp=1", "pp=1", "microbatches=1", "recompute=none", "zero=0", "schedule=1f1b"}
console = Console(stderr=True, highlight=False, soft_wrap=True)


def short(strategy: str) -> str:
    """``strategy`` (a canonical string) without its keys at their defaults:
    ``dp=4,tp=1,pp=1,microbatches=1,recompute=none,zero=1,precision=fp32`` ->
    ``dp=4,zero=1,precision=fp32``."""
    return ",".join(k for k in strategy.split(",") if k not in _DEFAULTS)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def plan_cells(models: list[str]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (model, cluster, strategy column): the strategy :func:`autopar.plan`
    resolves (``config``) with its predicted step time and peak memory, or
    the error it raises. The model is traced once (:func:`autopar.trace`) and
    planned on each cluster; an error that is no :class:`AutoparError` is a
    bug and keeps its traceback."""
    import traceback

    import autopar
    from autopar.errors import AutoparError
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for m in models:
        c = CASES[m]()
        t0 = time.perf_counter()
        try:
            graph = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
        except AutoparError as e:
            graph, err = None, _one_line(e)
        console.print(f"{m}: traced in {time.perf_counter() - t0:.0f} s")
        for cluster in CLUSTERS:
            for col, strategy in STRATEGIES.items():
                if graph is None:
                    out[(m, cluster, col)] = {"error": err}
                    continue
                t0 = time.perf_counter()
                try:
                    p = autopar.plan(graph, cluster=cluster, devices=DEVICES, global_batch=c.target.shape[0],
                                     strategy=strategy)
                    cell = {"config": p.config.to_string(), "step_s": p.predicted["step_time_s"],
                            "peak_bytes": p.predicted["peak_memory_bytes"], "fits": p.predicted["fits"]}
                except AutoparError as e:
                    cell = {"error": _one_line(e)}
                except Exception as e:  # noqa: BLE001 - a bug, reported in the table with its traceback
                    cell = {"error": "bug: " + _one_line(e), "traceback": traceback.format_exc()[-3000:]}
                cell["plan_s"] = time.perf_counter() - t0
                out[(m, cluster, col)] = cell
                console.print(f"  {cluster:9s} {col:8s} {short(cell.get('config', '')) or cell['error'][:120]}")
    return out


def status(plan: dict[str, Any], run: list[dict] | None, ref: tuple | None, family: str, col: str) -> str:
    """``"ok"`` or why the cell fails: the plan's error, the run's, or
    :func:`benchmarks.matrix.check`'s verdict on the run against one
    process; an auto run that ran another strategy than the plan says too."""
    if "error" in plan:
        return plan["error"]
    r0 = run[0]
    if "error" in r0:
        return r0["error"]
    if r0["config"] != plan["config"]:
        return f"parallelize ran {short(r0['config'])}, autopar.plan chose {short(plan['config'])}"
    return matrix.check(family, plan["config"], ref, run, must_shard=col != "auto")


def _mark(col: str, plan: dict[str, Any], st: str, run0: dict[str, Any]) -> str:
    """The table cell; an auto plan with tensor parallelism whose ILP kept every
    weight whole (every tp rank computing the same) says ``replicated``."""
    if st != "ok":
        return "n/a" if st.startswith("StrategyError") else "FAIL"
    if col != "auto":
        return "yes"
    from autopar import parse_strategy
    whole = parse_strategy(plan["config"]).tp > 1 and run0["local_numel"] >= run0["full_numel"]
    return f"yes: {short(plan['config'])}" + (" (weights replicated)" if whole else "")


def run(models: list[str], timeout: float = 3600) -> dict[str, Any]:
    """Plan every cell here, run every planned one in one spawn of
    :data:`DEVICES` processes, compare each with its one-process reference.
    Returns the result dict (a row per model and cluster)."""
    from autopar import parse_strategy
    from autopar.runtime.launch import run_distributed

    plans = plan_cells(models)
    runs = [(m, STRATEGIES[col], cl) for (m, cl, col), p in plans.items() if "error" not in p]
    t0 = time.perf_counter()
    res = run_distributed(matrix.worker, DEVICES, runs, timeout=timeout) if runs else []
    console.print(f"{len(runs)} runs on {DEVICES} processes in {time.perf_counter() - t0:.0f} s")
    refs: dict[tuple, Any] = {}
    details = []
    for (m, cl, col), p in plans.items():
        key = (m, STRATEGIES[col], cl)
        per_rank = [r[key] for r in res] if "error" not in p else None
        family, ref = col, None
        if per_rank is not None and "error" not in per_rank[0] and "config" in p:
            cfg = parse_strategy(p["config"])
            family = "bf16" if cfg.precision == "bf16" else col
            rk = (m, cfg.precision, matrix.split_of(m, p["config"]))
            if rk not in refs:
                refs[rk] = matrix.reference(*rk)
            ref = refs[rk]
        st = status(p, per_rank, ref, family, col)
        r0 = per_rank[0] if per_rank else {}
        details.append({"model": m, "cluster": cl, "column": col, "strategy": STRATEGIES[col], "status": st,
                        "mark": _mark(col, p, st, r0), "planned": p.get("config"), "ran": r0.get("config"),
                        "predicted_step_s": p.get("step_s"), "predicted_peak_bytes": p.get("peak_bytes"),
                        "fits": p.get("fits"), "plan_s": p.get("plan_s"), "losses": r0.get("losses"),
                        "reference": ref[0] if ref else None, "local_numel": r0.get("local_numel"),
                        "full_numel": r0.get("full_numel"), "seconds": r0.get("s"),
                        "traceback": r0.get("traceback") or p.get("traceback")})
        console.print(f"  {m:12s} {cl:9s} {col:8s} {st[:150]}", markup=False)     # errors hold [brackets]
    return result(models, details)


def result(models: list[str], details: list[dict]) -> dict[str, Any]:
    """The result dict of the cells ``details``."""
    cells = {(d["model"], d["cluster"], d["column"]): d for d in details}
    rows = []
    for m in models:
        for cl in CLUSTERS:
            auto = cells[(m, cl, "auto")]
            step = auto["predicted_step_s"]
            rows.append([m, cl] + [cells[(m, cl, col)]["mark"] for col in STRATEGIES]
                        + [f"{step * 1e3:.3g}" if step is not None else ""])
    marks = [d["mark"] for d in details]
    notes = [f"{d['model']} / {d['cluster']} / {d['column']} ({d['strategy']}): {d['status']}"
             for d in details if d["status"] != "ok"]
    if any(m.endswith("(weights replicated)") for m in marks):
        notes.append("weights replicated: auto's plan has tp > 1 but the ILP split no weight (each rank holds "
                     "the whole model: at these sizes no split saves more than its communication costs)")
    return {
        "title": "User tour: models x strategies, on the CPU and for a GPU preset (issue 18)",
        "description": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
        "params": {"models": models, "strategies": STRATEGIES, "clusters": CLUSTERS, "devices": DEVICES,
                   "steps": matrix.STEPS, "optimizer": f"SGD lr={matrix.LR} (ResNet-18 {RESNET_LR}) momentum=0.9",
                   "tolerance": {"fp32": 1e-4, **matrix.TOLERANCE}},
        "table": {"columns": ["model", "cluster", *STRATEGIES, "auto: predicted step ms"], "rows": rows},
        "summary": {"cells": len(details), "pass": sum(k.startswith("yes") for k in marks),
                    "not applicable": marks.count("n/a"), "fail": marks.count("FAIL")},
        "notes": notes or ["every cell passes"],
        "cells": details,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tour", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--no-save", action="store_true", help="print only: write no result")
    ap.add_argument("--rescore", action="store_true",
                    help="rebuild the table and README section from the saved cells (no run)")
    a = ap.parse_args(argv)
    if a.rescore:
        import json

        from .common import RESULTS, device_tag, save
        old = json.loads((RESULTS / f"tour-{device_tag()}.json").read_text())
        new = {**result(old["params"]["models"], old["cells"]), "wall_s": old.get("wall_s")}
        new["params"]["quick"] = False
        save("tour", new)
        return new
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in CASES:
            ap.error(f"unknown model {m!r}; valid: {', '.join(CASES)}")
    warnings.simplefilter("ignore")
    from .common import timed_run
    return timed_run("tour", lambda: run(models), quick=False, save_result=not a.no_save, log=console.print)


if __name__ == "__main__":
    main()
