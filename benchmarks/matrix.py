"""The real-models matrix: models as their authors write them x every strategy
family, each run compared with a single-process run of the same model, data
and optimizer.

Models (:mod:`benchmarks.real_models`): a nanoGPT-style GPT (plain, with a
tied head and SDPA, and with a 4096-token vocabulary split over tp), Hugging
Face GPT-2, Llama (GQA, RoPE, RMSNorm, SwiGLU), BERT (masked LM) and ViT, 4
layers each (GPT-2 also with its own loss, ``loss_fn="labels"``), all traced
through ``torch.export``; torchvision's ResNet-18 (BatchNorm in training mode,
synchronised over dp) and timm's ViT-Tiny (4 blocks), traced with ``torch.fx``.
Strategy families: dp, tp,
dp x tp, pipelines (1F1B, interleaved, pp x dp x tp on 8 processes), Megatron
sequence parallel, selective and full recompute, ZeRO-1/2/3, bf16, and 2D tensor
parallel (a 2 x 2 grid, alone, with Megatron sequence parallelism on its columns,
and with dp=2 and ZeRO-1 on 8 processes), 2.5D
(two 2 x 2 grids, 8 processes), 3D (a 2 x 2 x 2 cube, 8 processes) and a 2 x 2
grid in each stage of a two-stage pipeline (``pp x 2d``, 8 processes) and under
ZeRO-3 over dp=2 (``2d zero-3``, 8 processes).

A cell passes when every step's loss on every rank is within a relative
``1e-4`` of the single process's (fp32; bf16: 2e-2 of one process under
the same precision policy, see :data:`TOLERANCE`), the gathered final weights match (``rtol 1e-4``, ``atol
1e-5``), and, for strategies with tensor parallelism, the local parameters
are really smaller than the model's. ``n/a``: the planner refuses the
strategy for that model with a StrategyError (the note says why); ``-``: not
run yet (a partial run merged with ``--merge``).

    .venv/bin/python -m benchmarks.matrix [--models a,b] [--families x,y] [--merge] [--no-save]

The table lands in ``benchmarks/README.md``; ``make matrix`` runs it all
(its first 91 cells took 8 minutes on 2 cores; the 190 of today's
table more). ``--merge`` runs only the cells asked
for and merges them into the saved result, so a new model or family is added
without running the rest again. ResNet-50 (``tv-resnet50``) is left out of
the default models: its training at this size is chaotic (see
:func:`benchmarks.real_models.tv_resnet50`), so it cannot meet 1e-4 after the
first step whatever the strategy.
"""
from __future__ import annotations

import argparse
import functools
import os
import time
import traceback
from typing import Any

import torch
from rich.console import Console

from .real_models import CASES, MODELS, RESNET_LR

#: the rows ``make matrix`` runs: every model but ResNet-50 (chaotic at this size, see the docstring)
DEFAULT_MODELS = [m for m in MODELS if m != "tv-resnet50"]

STEPS = 3
LR = 0.1
# family -> (strategy, processes)
FAMILIES: dict[str, tuple[str, int]] = {
    "dp": ("dp=4", 4),
    "tp": ("tp=4", 4),
    "dp x tp": ("dp=2,tp=2", 4),
    "pp 1F1B": ("pp=2,dp=2,microbatches=4", 4),
    "pp interleaved": ("pp=2,dp=2,schedule=interleaved,chunks=2,microbatches=4", 4),
    "pp x dp x tp": ("pp=2,dp=2,tp=2,microbatches=2", 8),
    "sequence parallel": ("dp=2,tp=2,sequence_parallel=true", 4),
    "recompute selective": ("dp=2,tp=2,recompute=selective", 4),
    "recompute full": ("pp=2,tp=2,recompute=full,microbatches=2", 4),
    "zero-1": ("dp=4,zero=1", 4),
    "zero-2": ("dp=2,tp=2,zero=2", 4),
    "zero-3": ("dp=4,zero=3", 4),
    "bf16": ("dp=2,tp=2,precision=bf16", 4),
    "2d": ("tp=4,tp_mode=2d", 4),
    "2d sp": ("tp=4,tp_mode=2d,sequence_parallel=true", 4),
    "dp x 2d": ("dp=2,tp=4,tp_mode=2d,zero=1", 8),
    "2.5d": ("tp=8,tp_mode=2.5d,tp_depth=2", 8),
    "3d": ("tp=8,tp_mode=3d", 8),
    "pp x 2d": ("pp=2,tp=4,tp_mode=2d,microbatches=2", 8),
    "2d zero-3": ("dp=2,tp=4,tp_mode=2d,zero=3", 8),
}
# bf16 is compared with one process under the same policy (bf16 weights and compute, fp32
# master weights, gradients reduced in fp32): splitting a matmul or the batch changes where
# products are rounded (unit roundoff 2^-8), so the loss may move by a few 0.1%
TOLERANCE = {"bf16": 2e-2}
console = Console(stderr=True, highlight=False, soft_wrap=True)


def _optimizer(params, lr: float = LR):
    # SGD with momentum: optimizer state for ZeRO to shard, and an update linear in the
    # gradient, so rounding noise stays noise (AdamW turns the noise of a zero true gradient,
    # e.g. of an attention key bias, into full-size steps)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def split_of(model: str, strategy: str) -> tuple[int, int]:
    """``(dp, microbatches)`` a reference of ``model`` must reproduce under
    ``strategy``: BatchNorm's statistics are those of one microbatch (of the
    whole dp group: synchronised batch norm), so a model with batch statistics
    is compared with one process accumulating the same microbatches; other
    models with one process on the whole batch, ``(1, 1)``."""
    from autopar import parse_strategy

    from .real_models import BATCH_STATS
    if model not in BATCH_STATS:
        return 1, 1
    cfg = parse_strategy(strategy)
    return cfg.dp, cfg.microbatches


def microbatches(c, split: tuple[int, int], inputs: tuple | None = None) -> list[tuple[tuple, torch.Tensor]]:
    """The step's microbatches as the runtime makes them: microbatch k is the
    k-th chunk of every dp rank's slice of the batch, together (of
    ``inputs``, the case's own by default)."""
    inputs = c.inputs if inputs is None else inputs
    dp, m = split
    if (dp, m) == (1, 1) or m == 1:
        return [(inputs, c.target)]
    n = c.target.shape[0]
    b = n // (dp * m)
    out = []
    for k in range(m):
        idx = torch.cat([torch.arange(r * (n // dp) + k * b, r * (n // dp) + (k + 1) * b) for r in range(dp)])
        out.append((tuple(x[idx] for x in inputs), c.target[idx]))
    return out


def reference(model: str, precision: str = "fp32",
              split: tuple[int, int] = (1, 1)) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final state of ``STEPS`` steps in this process (bf16: the
    runtime's optimizer on the plain model, the same precision policy).
    ``split``: ``(dp, microbatches)`` of :func:`split_of`; with several
    microbatches the step accumulates their gradients (a model with batch
    statistics)."""
    from autopar.runtime.optim import DistributedOptimizer
    c = CASES[model]()
    params = list(c.model.parameters())
    optimizer = functools.partial(_optimizer, lr=c.lr or LR)
    if precision == "fp32":
        opt, scale = optimizer(params), 1.0
    else:
        opt = DistributedOptimizer(params, optimizer, None, precision=precision)
        scale = opt.loss_scale
        for b in c.model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(torch.bfloat16)
    inputs = tuple(x.to(torch.bfloat16) if precision != "fp32" and x.is_floating_point() else x for x in c.inputs)
    losses = []
    mbs = microbatches(c, split, inputs)     # bf16: the inputs as cast, as the runtime casts them
    for _ in range(STEPS):
        opt.zero_grad()
        if len(mbs) == 1:
            loss = c.loss(inputs)
            (loss * scale).backward()
        else:
            loss = torch.zeros(())
            for k, (x, t) in enumerate(mbs):
                if precision != "fp32":     # the distributed optimizer reduces after the last microbatch
                    opt.start_microbatch(last=k == len(mbs) - 1)
                part = c.loss_fn(c.model(*x), t) / len(mbs)
                (part * scale).backward()
                loss = loss + part.detach()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in c.model.state_dict().items()}


def worker(rank: int, world: int, runs: list[tuple[str, ...]]) -> dict:
    """Parallelize and train each ``(model, strategy)`` or ``(model, strategy,
    cluster)`` of ``runs`` (the cluster a preset or file, for the search;
    default the machine's); per run the losses, the gathered state (rank 0),
    local and full parameter counts, the strategy run, or the error."""
    import warnings

    import autopar
    warnings.simplefilter("ignore")
    out: dict[tuple[str, ...], Any] = {}
    for run in runs:
        model, strategy, *cluster = run
        c = CASES[model]()
        full = sum(p.numel() for p in c.model.parameters())
        t0 = time.perf_counter()
        try:
            pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target,
                                     optimizer=functools.partial(_optimizer, lr=c.lr or LR), strategy=strategy,
                                     cluster=cluster[0] if cluster else None, batch_dim=c.batch_dim)
            losses = [pm.train_step(c.inputs, c.target) for _ in range(STEPS)]
            sd = pm.full_state_dict()
            out[run] = {
                "losses": losses, "state": sd if rank == 0 else None, "full_numel": full,
                "local_numel": sum(p.numel() for p in pm.parameters()), "comms": pm.comms,
                "config": pm.config.to_string(), "s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[run] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        "traceback": traceback.format_exc()[-3000:]}
    return out


def check(family: str, strategy: str, ref: tuple[list[float], dict], per_rank: list[dict], *,
          must_shard: bool = True) -> str:
    """``"ok"`` or why the cell fails. ``must_shard=False``: a strategy with
    tensor parallelism may keep every weight whole (a searched plan whose ILP
    replicates them)."""
    r0 = per_rank[0]
    if "error" in r0:
        return r0["error"]
    rel = TOLERANCE.get(family, 1e-4)
    ref_losses, ref_state = ref
    for rank, res in enumerate(per_rank):
        got = res["losses"]
        bad = [(a, b) for a, b in zip(got, ref_losses) if abs(a - b) > rel * abs(b)]
        if bad:
            return f"rank {rank} losses {got} vs {ref_losses}"
    if family not in TOLERANCE:
        state = r0["state"]
        missing = [k for k, v in ref_state.items() if v.is_floating_point() and k not in state]
        if missing:
            return f"final state lacks {missing[:3]}"
        for k, v in ref_state.items():
            if k in state and v.is_floating_point():
                try:
                    torch.testing.assert_close(state[k].float(), v.float(), rtol=1e-4, atol=1e-5)
                except AssertionError:
                    return f"final weight {k} differs"
    from autopar import parse_strategy
    if must_shard and parse_strategy(strategy).tp > 1 and r0["local_numel"] >= r0["full_numel"]:
        return f"not sharded: {r0['local_numel']} local of {r0['full_numel']}"
    return "ok"


def run(models: list[str], families: list[str], timeout: float = 900) -> dict[str, Any]:
    """Every (model, family) cell: one spawn per process count. Returns the
    result dict (table: a row per model, a column per family)."""
    from autopar.runtime.launch import run_distributed

    details: list[dict] = []
    refs = {(m, p, split_of(m, FAMILIES[f][0])): None for m in models for f in families
            for p in ("bf16" if f in TOLERANCE else "fp32",)}
    refs = {k: reference(*k) for k in refs}
    # one spawn per model and world size: all 130 four-process cells in one spawn outran its timeout
    for world in sorted({FAMILIES[f][1] for f in families}):
        fams = [f for f in families if FAMILIES[f][1] == world]
        for m in models:
            runs = [(m, FAMILIES[f][0]) for f in fams]
            t0 = time.perf_counter()
            res = run_distributed(worker, world, runs, timeout=timeout)
            console.print(f"{m}: {len(runs)} runs on {world} processes in {time.perf_counter() - t0:.0f} s")
            for f in fams:
                key = (m, FAMILIES[f][0])
                ref = refs[(m, "bf16" if f in TOLERANCE else "fp32", split_of(m, key[1]))]
                status = check(f, key[1], ref, [r[key] for r in res])
                r0 = res[0][key]
                details.append({"model": m, "family": f, "strategy": key[1], "status": status,
                                "losses": r0.get("losses"), "reference": ref[0],
                                "local_numel": r0.get("local_numel"), "full_numel": r0.get("full_numel"),
                                "comms": r0.get("comms"), "seconds": r0.get("s"),
                                "traceback": r0.get("traceback")})
                console.print(f"  {m:14s} {f:20s} {status[:150]}")
    return result(models, families, details)


def _mark(status: str | None) -> str:
    """A table cell: ``yes``; ``n/a`` where the strategy cannot apply to the model (the
    planner refuses it with a StrategyError, e.g. sequence parallel on ViT's odd token
    count); ``-`` for a cell not run (``None``: a merged partial run); ``FAIL`` otherwise."""
    if status is None:
        return "-"
    return "yes" if status == "ok" else "n/a" if status.startswith("StrategyError") else "FAIL"


def _commits(details: list[dict]) -> list[str]:
    """A note of how many cells ran at which commit, for a merged table (cells
    tagged by :func:`merge`); none for a table of one run."""
    runs: dict[str, int] = {}
    for d in details:
        if "commit" in d:
            runs[str(d["commit"])] = runs.get(str(d["commit"]), 0) + 1
    return ["cells by the commit they ran at (a merged table): " + ", ".join(f"{c} {n}" for c, n in runs.items())] \
        if runs else []


def result(models: list[str], families: list[str], details: list[dict]) -> dict[str, Any]:
    """The result dict of the cells ``details`` (one per model and family)."""
    cells = {(d["model"], d["family"]): d["status"] for d in details}
    marks = {(m, f): _mark(cells.get((m, f))) for m in models for f in families}
    return {
        "title": "Real models x strategy families (numerics against one process)",
        "description": __doc__.split("\n\n")[1] + " " + __doc__.split("\n\n")[2],
        "params": {"models": models, "families": {f: FAMILIES[f] for f in families}, "steps": STEPS,
                   "optimizer": f"SGD lr={LR} (the ResNets {RESNET_LR}) momentum=0.9",
                   "tolerance": {"default": 1e-4, **TOLERANCE}},
        "table": {"columns": ["model"] + families,
                  "rows": [[m] + [marks[(m, f)] for f in families] for m in models]},
        "summary": {"cells": len(cells), "pass": sum(v == "yes" for v in marks.values()),
                    "not applicable": sum(v == "n/a" for v in marks.values()),
                    "fail": sum(v == "FAIL" for v in marks.values()),
                    **({"not run": sum(v == "-" for v in marks.values())} if len(cells) < len(marks) else {})},
        "notes": ([f"{m} / {f}: {s}" for (m, f), s in cells.items() if s != "ok"] or ["every cell run passes"])
        + _commits(details),
        "cells": details,
    }


def _saved() -> dict[str, Any]:
    """The saved result of this machine (``results/matrix-<device>.json``)."""
    import json

    from .common import RESULTS, device_tag
    return json.loads((RESULTS / f"matrix-{device_tag()}.json").read_text())


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The result of ``old``'s cells with ``new``'s in their place (same model
    and family): models and families in :data:`MODELS` / :data:`FAMILIES`
    order (saved ones no longer defined last); cells neither ran are ``-``."""
    def order(names: list[str], known: dict) -> list[str]:
        return sorted(dict.fromkeys(names), key=lambda n: (list(known).index(n) if n in known else len(known)))
    models = order(old["params"]["models"] + new["params"]["models"], MODELS)
    families = order(list(old["params"]["families"]) + list(new["params"]["families"]), FAMILIES)
    commit = {"old": old.get("versions", {}).get("commit"), "new": new.get("versions", {}).get("commit")}
    cells = {(d["model"], d["family"]): {"commit": commit[k], **d}
             for k, part in (("old", old["cells"]), ("new", new["cells"])) for d in part}
    out = result(models, families, list(cells.values()))
    out["params"]["families"] = {**old["params"]["families"], **out["params"]["families"]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # the ranks are kept between the spawns (one per model and world size), as in the test suite
    os.environ.setdefault("AUTOPAR_REUSE_RANKS", "1")
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--no-save", action="store_true", help="print only: write no result")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each spawn may take (default 900)")
    ap.add_argument("--merge", action="store_true",
                    help="run only these cells and merge them into the saved result (its other cells kept)")
    ap.add_argument("--rescore", action="store_true",
                    help="rebuild the table and README section from the saved cells (no run)")
    a = ap.parse_args(argv)
    from .common import save, timed_run, versions
    if a.rescore:
        old = _saved()
        keep = {k: old[k] for k in ("wall_s",) if k in old}
        new = {**result(old["params"]["models"], list(old["params"]["families"]), old["cells"]), **keep}
        new["params"]["quick"] = old["params"].get("quick", False)
        save("matrix", new)
        return new
    models = [m for m in a.models.split(",") if m]
    families = [f for f in a.families.split(",") if f]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; valid: {', '.join(MODELS)}")
    for f in families:
        if f not in FAMILIES:
            ap.error(f"unknown family {f!r}; valid: {', '.join(FAMILIES)}")
    if not a.merge:
        return timed_run("matrix", lambda: run(models, families, a.timeout), quick=False, save_result=not a.no_save,
                         log=console.print)
    new = timed_run("matrix", lambda: run(models, families, a.timeout), quick=False, save_result=False,
                    log=console.print)
    new["versions"] = versions()
    old = _saved()
    out = merge(old, new)
    out["params"]["quick"] = False
    # the wall time of every run that made the table: the saved one's plus this one's
    out["wall_s"] = old.get("wall_s", 0.0) + new["wall_s"]
    if not a.no_save:
        console.print(f"merged into {save('matrix', out)}")
    return out


if __name__ == "__main__":
    main()
