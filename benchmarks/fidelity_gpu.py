"""Cost-model fidelity and runtime overhead on one CUDA GPU.

The CPU fidelity benchmarks (``fidelity.py``) run tiny models on gloo
processes, where a step is bound by framework overhead, not arithmetic. This
one runs real-sized models on one GPU, where it is the arithmetic and the
memory traffic that the cost model must get right:

* **predicted**: the plan ``autopar.parallelize`` makes for the case (its
  ``predicted.step_time_s`` and ``peak_memory_bytes``), with the cluster given
  by ``--cluster`` (default ``dgx-h100``: an H200 has the H100's arithmetic
  rates and faster memory, so the H100 preset is the one a user would pick
  for it), and the same strategy evaluated with the calibrated cluster file
  when ``--calibrated FILE`` names one (``autopar calibrate`` run on this GPU);
* **measured**: ``ParallelModule.train_step`` on the GPU (world size 1, NCCL),
  median of the timed steps with ``torch.cuda.synchronize`` around each, and
  ``torch.cuda.max_memory_allocated`` over one step;
* **hand-written**: the same model in plain eager PyTorch (AdamW, fp32
  weights; bf16 cases under ``torch.autocast``; full recompute with
  ``torch.utils.checkpoint`` around each repeated block), the baseline
  autopar's runtime is held to ("executed as fast as hand-written code").

It reports, per case, predicted / measured / hand-written times and memory,
and over all cases the median absolute time error and the Spearman
correlation. Results go to ``results/fidelity_gpu-<device>.json``.

    python -m benchmarks.fidelity_gpu [--quick] [--cluster dgx-h100] [--calibrated FILE]

Without CUDA it runs ``--tiny`` cases on the CPU (a smoke run of the code
path; the numbers mean nothing there and are not saved).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import traceback

import numpy as np

from benchmarks.common import save
from benchmarks.fidelity import mape, spearman

# (key, zoo string, global batch): sized so that a step is tens to hundreds of ms on an H100/H200
MODELS = {
    "gpt-350m": ("gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=50304", 8),
    "gpt-1.3b": ("gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=50304", 4),
    "llama-1b": ("llama:layers=16,hidden=2048,heads=16,kv_heads=8,ffn=5632,seq=2048,vocab=32000", 4),
    "hf-gpt2-124m": ("hf-gpt2:n_layer=12,n_embd=768,n_head=12,vocab_size=50257,seq=1024", 8),
}
STRATEGIES = {
    "gpt-350m": ["precision=bf16", "precision=bf16,recompute=selective", "precision=bf16,recompute=full",
                 "precision=bf16,microbatches=2", "precision=fp32"],
    "gpt-1.3b": ["precision=bf16", "precision=bf16,recompute=full"],
    "llama-1b": ["precision=bf16", "precision=bf16,recompute=full"],
    "hf-gpt2-124m": ["precision=bf16", "precision=fp32"],
}
QUICK = {"gpt-350m": ["precision=bf16", "precision=bf16,recompute=full", "precision=fp32"],
         "llama-1b": ["precision=bf16"], "hf-gpt2-124m": ["precision=bf16"]}
TINY = {"gpt-tiny": ("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256", 4)}
TINY_STRATEGIES = {"gpt-tiny": ["precision=fp32", "precision=fp32,recompute=full"]}


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step, steps: int) -> list[float]:
    for _ in range(2):                       # warm-up: allocator, optimizer state, cuBLAS heuristics
        step()
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _resident() -> int:
    """Bytes still allocated on the GPU after collecting garbage (what an
    earlier case left behind is not this case's)."""
    import gc

    import torch
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


def _peak(step, base: int) -> int:
    """Peak bytes allocated over one step, less ``base`` (allocated before the case began)."""
    import torch
    if not torch.cuda.is_available():
        return 0
    torch.cuda.reset_peak_memory_stats()
    step()
    _sync()
    return int(torch.cuda.max_memory_allocated()) - base


def _data(z, gb: int):
    import torch
    g = torch.Generator().manual_seed(1)
    vocab = z.config["vocab"] if "vocab" in z.config else z.config["vocab_size"]
    x = torch.randint(0, vocab, z.example_inputs[0].shape, generator=g)
    return x, torch.randint(0, vocab, x.shape, generator=g)


def run_autopar(spec: str, strategy: str, gb: int, cluster: str, steps: int) -> dict:
    """One case through ``autopar.parallelize`` on this process's device."""
    import torch

    import autopar
    import autopar.zoo as zoo
    from autopar.runtime.dist import local_device

    base = _resident()
    z = zoo.build(spec, device="cpu", batch=gb, seed=0)
    x, y = _data(z, gb)
    pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                             strategy=strategy, cluster=cluster)
    del z
    dev = local_device()
    x, y = x.to(dev), y.to(dev)
    times = _timed(lambda: pm.train_step((x,), y), steps)
    peak = _peak(lambda: pm.train_step((x,), y), base)
    pred = pm.plan.predicted
    out = {"measured_step_s": statistics.median(times), "measured_peak_bytes": peak,
           "predicted_step_s": pred["step_time_s"], "predicted_peak_bytes": pred["peak_memory_bytes"],
           "predicted_compute_s": pred.get("compute_time_s"), "strategy_run": pm.config.to_string()}
    pm = None     # noqa: F841 - the last reference: what stays allocated after it is a leak
    out["resident_before_bytes"] = base
    out["left_behind_bytes"] = _resident() - base     # > 0: the ParallelModule outlived its last reference
    return out


def _blocks(model) -> list:
    """The repeated blocks of a zoo or Hugging Face model (the largest ModuleList)."""
    import torch.nn as nn
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def run_eager(spec: str, strategy: str, gb: int, steps: int) -> dict:
    """The same case written by hand in eager PyTorch."""
    import torch
    import torch.utils.checkpoint as ckpt

    import autopar.zoo as zoo

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    base = _resident()
    z = zoo.build(spec, device="cpu", batch=gb, seed=0)
    x, y = _data(z, gb)
    x, y = x.to(dev), y.to(dev)
    model, loss_fn = z.model.to(dev), z.loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bf16 = "precision=bf16" in strategy
    mbs = 2 if "microbatches=2" in strategy else 1
    if "recompute=full" in strategy:
        for blk in _blocks(model):
            fwd = blk.forward
            blk.forward = (lambda f: lambda *a, **k: ckpt.checkpoint(f, *a, use_reentrant=False, **k))(fwd)

    def step():
        for xs, ys in zip(x.chunk(mbs), y.chunk(mbs)):
            with torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = loss_fn(model(xs), ys) / mbs
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _timed(step, steps)
    peak = _peak(step, base)
    model = opt = z = None     # noqa: F841
    return {"eager_step_s": statistics.median(times), "eager_peak_bytes": peak,
            "eager_note": "selective recompute not written by hand: eager runs it without recompute"
            if "selective" in strategy else None}


def _calibrated_prediction(spec: str, strategy: str, gb: int, calibrated: str | None) -> float | None:
    if not calibrated:
        return None
    import autopar
    try:
        return autopar.evaluate(spec, cluster=calibrated, devices=1, strategy=strategy,
                                global_batch=gb).step_time_s
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        print(f"  calibrated evaluate failed: {e}")
        return None


def main(quick: bool, cluster: str, calibrated: str | None, tiny: bool, steps: int) -> dict:
    import torch
    models, strategies = (TINY, TINY_STRATEGIES) if tiny else (MODELS, QUICK if quick else STRATEGIES)
    rows, raw = [], []
    for key, strats in strategies.items():
        spec, gb = models[key]
        for strategy in strats:
            rec = {"model": key, "spec": spec, "strategy": strategy, "global_batch": gb}
            t0 = time.perf_counter()
            try:
                rec.update(run_autopar(spec, strategy, gb, cluster, steps))
            except Exception as e:  # noqa: BLE001 - a failing case is a row, not the end of the run
                rec["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            try:
                rec.update(run_eager(spec, strategy, gb, steps))
            except Exception as e:  # noqa: BLE001
                rec["eager_error"] = f"{type(e).__name__}: {e}"
            rec["predicted_calibrated_s"] = _calibrated_prediction(spec, strategy, gb, calibrated)
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            raw.append(rec)
            print({k: v for k, v in rec.items() if k != "spec"}, flush=True)
            if "measured_step_s" in rec:
                err = rec["predicted_step_s"] / rec["measured_step_s"] - 1
                over = rec["measured_step_s"] / rec["eager_step_s"] - 1 if "eager_step_s" in rec else None
                rows.append([key, strategy, gb, f"{rec['predicted_step_s'] * 1e3:.1f}",
                             f"{rec['measured_step_s'] * 1e3:.1f}", f"{err:+.0%}",
                             f"{rec['eager_step_s'] * 1e3:.1f}" if "eager_step_s" in rec else "-",
                             f"{over:+.0%}" if over is not None else "-",
                             f"{rec['predicted_peak_bytes'] / 2**30:.2f}", f"{rec['measured_peak_bytes'] / 2**30:.2f}"])
            else:
                rows.append([key, strategy, gb, "-", "failed", rec.get("error", "")[:60], "-", "-", "-", "-"])
    ok = [r for r in raw if "measured_step_s" in r]
    pred, meas = [r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok]
    summary = {
        "cases": len(raw), "ran": len(ok),
        "time_mape": mape(pred, meas) if ok else None,
        "spearman": spearman(pred, meas) if len(ok) > 1 else None,
        "memory_mape": float(np.median([abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1)
                                        for r in ok if r["measured_peak_bytes"]])) if ok and ok[0]["measured_peak_bytes"] else None,
        "runtime_overhead_median": float(np.median([r["measured_step_s"] / r["eager_step_s"] - 1
                                                    for r in ok if "eager_step_s" in r])) if ok else None,
    }
    cal = [(r["predicted_calibrated_s"], r["measured_step_s"]) for r in ok if r.get("predicted_calibrated_s")]
    if cal:
        summary["time_mape_calibrated"] = mape(*zip(*cal))
    result = {
        "params": {"cluster": cluster, "calibrated": calibrated, "steps": steps, "quick": quick,
                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "table": {"columns": ["model", "strategy", "batch", "predicted ms", "measured ms", "error",
                              "hand-written ms", "autopar overhead", "predicted GiB", "measured GiB"],
                  "rows": rows},
        "summary": summary,
        "raw": raw,
    }
    print(summary)
    if not tiny and torch.cuda.is_available():
        save("fidelity_gpu", result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU smoke cases (nothing saved)")
    ap.add_argument("--cluster", default="dgx-h100", help="the cluster the plans are made for")
    ap.add_argument("--calibrated", default=None, help="a cluster file from `autopar calibrate` on this GPU")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per case")
    a = ap.parse_args()
    main(a.quick, a.cluster, a.calibrated, a.tiny, a.steps)
