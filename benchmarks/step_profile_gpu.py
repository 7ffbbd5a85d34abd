"""Where a training step goes on one CUDA GPU: the kernels' time by kind against
the cost model's compute and optimizer time.

``fidelity_gpu.py`` found the cost model 15-50% fast on the small single-GPU
models (124M-1.3B). This benchmark runs the same cases through
``autopar.parallelize`` and profiles three steps with ``torch.profiler``: the
wall time of a step, the GPU's busy time (the kernels' durations summed; the
profiler's own annotations, such as ``Optimizer.step#AdamW.step``, which span
kernels already counted, left out), and the kernels by kind (GEMMs, fused
attention, the optimizer's multi-tensor kernels, elementwise and the rest),
beside ``autopar.evaluate``'s compute and optimizer time for the case. It is
how the optimizer was found to make ten passes over its state where the model
counted one (``cost_models.memory.OPTIMIZER_ACCESSES``).

    python -m benchmarks.step_profile_gpu [--cases gpt-350m,...]

Needs CUDA; results go to ``results/step_profile_gpu-<device>.json``.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import save
from benchmarks.fidelity_gpu import MODELS, _data, _sync

CASES = ("gpt-350m", "gpt-1.3b", "llama-1b", "hf-gpt2-124m")
STRATEGY = "precision=bf16"
KINDS = {
    "gemm": ("gemm", "cutlass", "sm90_", "sm80_", "xmma", "cublas", "matmul", "nvjet"),
    "attention": ("flash", "fmha", "attention", "cudnn", "sdpa"),
    "optimizer": ("adam", "multi_tensor", "foreach"),
    "embedding/index": ("embedding", "index", "scatter", "gather"),
    "loss/softmax": ("softmax", "nll", "cross_entropy"),
    "norm": ("norm",),
    "copy": ("copy", "memcpy", "memset"),
}


def kind(name: str) -> str:
    n = name.lower()
    return next((k for k, keys in KINDS.items() if any(s in n for s in keys)), "elementwise/other")


def _annotation(ev) -> bool:
    """A profiler range drawn on the GPU's timeline (it spans kernels listed on their own)."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(("Optimizer.", "ProfilerStep"))


def profile_case(key: str, steps: int = 3) -> dict:
    import torch

    import autopar
    import autopar.zoo as zoo
    from autopar.runtime.dist import local_device
    spec, gb = MODELS[key]
    z = zoo.build(spec, device="cpu", batch=gb, seed=0)
    x, y = _data(z, gb)
    pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy=STRATEGY,
                             cluster="dgx-h100")
    dev = local_device()
    x, y = x.to(dev), y.to(dev)

    def step():
        pm.train_step((x,), y)

    for _ in range(3):
        step()
    walls = []
    for _ in range(5):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync()
    by_kind: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA") and not _annotation(ev):
            t = ev.time_range.elapsed_us() / 1e6 / steps
            kernels[ev.name] = kernels.get(ev.name, 0.0) + t
            by_kind[kind(ev.name)] = by_kind.get(kind(ev.name), 0.0) + t
    est = autopar.evaluate(spec, cluster="dgx-h100", devices=1, strategy=STRATEGY, global_batch=gb)
    return {"case": key, "strategy": STRATEGY, "batch": gb, "wall_s": statistics.median(walls),
            "gpu_busy_s": sum(kernels.values()), "by_kind_s": by_kind,
            "top_kernels": sorted(kernels.items(), key=lambda kv: -kv[1])[:12],
            "predicted_step_s": est.step_time_s, "predicted_compute_s": est.compute_time_s,
            "predicted_optimizer_s": est.optimizer_time_s}


def row(r: dict) -> list:
    k = r["by_kind_s"]
    ms = lambda s: f"{s * 1e3:.1f}"   # noqa: E731
    return [r["case"], ms(r["wall_s"]), ms(r["gpu_busy_s"]), ms(k.get("gemm", 0)), ms(k.get("attention", 0)),
            ms(r["gpu_busy_s"] - k.get("optimizer", 0)), ms(r["predicted_compute_s"]), ms(k.get("optimizer", 0)),
            ms(r["predicted_optimizer_s"])]


COLUMNS = ["case", "wall ms", "GPU busy ms", "GEMM ms", "attention ms", "kernels besides the optimizer ms",
           "predicted compute ms", "optimizer ms", "predicted optimizer ms"]


def main(cases: list[str]) -> dict:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("step_profile_gpu needs a CUDA GPU")
    raw = []
    for key in cases:
        rec = profile_case(key)
        print({k: v for k, v in rec.items() if k != "top_kernels"}, flush=True)
        raw.append(rec)
        torch.cuda.empty_cache()
    result = {"title": f"Where a training step goes on one GPU ({torch.cuda.get_device_name(0)})",
              "params": {"gpu": torch.cuda.get_device_name(0), "cases": cases, "strategy": STRATEGY},
              "table": {"columns": COLUMNS, "rows": [row(r) for r in raw]}, "raw": raw}
    save("step_profile_gpu", result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated keys of fidelity_gpu.MODELS")
    main(ap.parse_args().cases.split(","))
