"""``tp_mode=mesh`` on real models: each case of :mod:`benchmarks.real_models`
named below trained three SGD steps under ``tp=4,tp_mode=mesh`` (a 2 x 2 mesh,
fp32) on 4 gloo processes, against the same steps in one process; with
``--pipeline``, under ``tp=4,tp_mode=mesh,pp=2`` on 8 processes (a 2 x 2 mesh
in each of two pipeline stages), saved as ``mesh_real_models_pp``.

The cluster is the ``cpu`` preset with links so fast that splitting the tiny
models' work pays (on its own links the joint program keeps them whole,
which would test nothing): the joint program then splits weights on both
axes, and the count of weights split on both is recorded per case.

Run: ``python -m benchmarks.mesh_real_models [--models a,b] [--pipeline]``; results in
``benchmarks/results/mesh_real_models-<device>.json`` and its README
section.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import torch

import autopar
from benchmarks.common import save
from benchmarks.real_models import CASES
from autopar.runtime.launch import run_distributed

STRATEGY = "tp=4,tp_mode=mesh,precision=fp32"
PIPELINED = "tp=4,tp_mode=mesh,pp=2,precision=fp32"
MODELS = ["nanogpt", "nanogpt-tied", "hf-gpt2", "hf-gpt2-labels", "hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3",
          "hf-phi3", "hf-neox", "hf-gemma", "hf-gemma2", "hf-opt", "hf-falcon", "hf-mixtral", "hf-gptj", "hf-bloom",
          "hf-bigcode", "hf-bert", "hf-roberta", "hf-distilbert", "hf-vit", "hf-t5"]
TOLERANCE = 1e-4     # the matrix's criterion (fp32)
LR = 0.05


def fast_links():
    """The cpu preset with near-free links (see the module docstring)."""
    import cost_models
    from cost_models.hardware import LinkSpec
    link = LinkSpec(1e13, 1e-9)
    return dataclasses.replace(cost_models.load_cluster("cpu"), name="fast-links", intra_node=link,
                               inter_node=link, collectives={})


def _eager(name: str) -> list[float]:
    c = CASES[name]()
    opt = torch.optim.SGD(c.model.parameters(), lr=LR)
    out = []
    for _ in range(3):
        opt.zero_grad()
        loss = c.loss()
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def _parallel(name: str, strategy: str = STRATEGY) -> dict:
    c = CASES[name]()
    pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target, strategy=strategy,
                             cluster=fast_links(), optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
    both = sum(1 for n, p in pm.param_placement.items() if p != "R" and pm.row_placement.get(n, "R") != "R")
    return {"losses": [pm.train_step(c.inputs, c.target) for _ in range(3)], "split_both": both,
            "params": len(pm.param_placement)}


def worker(rank: int, world: int, names: list[str], strategy: str = STRATEGY) -> list:
    warnings.filterwarnings("ignore")
    out = []
    for name in names:
        try:
            out.append(_parallel(name, strategy))
        except Exception as e:      # noqa: BLE001 - a case's failure is its row
            out.append({"error": f"{type(e).__name__}: {str(e)[:300]}"})
    return out


def main(models: list[str], pipeline: bool = False) -> dict:
    t0 = time.perf_counter()
    strategy, world = (PIPELINED, 8) if pipeline else (STRATEGY, 4)
    got = run_distributed(worker, world, models, strategy, timeout=3600)[0]
    rows = []
    for name, g in zip(models, got):
        ref = _eager(name)
        if "error" in g:
            rows.append({"model": name, "ok": False, "error": g["error"]})
        else:
            err = max(abs(a - b) for a, b in zip(g["losses"], ref))
            rows.append({"model": name, "ok": err <= TOLERANCE, "max_loss_error": err, "split_both": g["split_both"],
                         "params": g["params"], "losses": g["losses"], "reference": ref})
        r = rows[-1]
        print(f"{name:16s} {'ok' if r['ok'] else 'FAIL'} " +
              (f"max error {r['max_loss_error']:.1e}, {r['split_both']} of {r['params']} weights split on both axes"
               if "error" not in r else r["error"]), flush=True)
    passed = sum(r["ok"] for r in rows)
    worst = max((r["max_loss_error"] for r in rows if "max_loss_error" in r), default=0.0)
    res = {
        "title": "tp_mode=mesh on real models (" + ("8 processes, a 2 x 2 mesh in each of 2 pipeline stages"
                                                   if pipeline else "4 processes, a 2 x 2 mesh") + ", fp32)",
        "description": f"Three SGD steps of each case under `{strategy}` against one process; the joint "
                       "program decides both axes (links made near-free so that it splits the tiny models: see "
                       "the module docstring). Criterion: every loss within 1e-4.",
        "summary": {"cases within 1e-4": f"{passed} of {len(rows)}", "largest loss error": worst},
        "table": {"columns": ["model", "ok", "max loss error", "weights split on both axes", "weights"],
                  "rows": [[r["model"], r["ok"], r.get("max_loss_error"), r.get("split_both"), r.get("params")]
                           for r in rows]},
        "rows": rows, "params": {"strategy": strategy, "models": models}, "wall_s": time.perf_counter() - t0,
    }
    path = save("mesh_real_models_pp" if pipeline else "mesh_real_models", res)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated case names")
    ap.add_argument("--pipeline", action="store_true", help=f"{PIPELINED} on 8 processes")
    args = ap.parse_args()
    main([m for m in args.models.split(",") if m], args.pipeline)
