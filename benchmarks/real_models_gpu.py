"""Real models, as their authors write them, compiled by autopar and trained on one CUDA GPU.

The breadth runs (:mod:`benchmarks.hf_architectures`, ``--breadth``) check
twenty-nine ``transformers`` decoders, five timm / torchvision vision models, three models
on PyTorch's own layers (``nn.TransformerEncoder``, ``nn.LSTM``, ``nn.Transformer``, ``[seq, batch]``)
and research code on ``torch.einsum``
against one process on gloo CPU processes. This runs the same cases through
``autopar.parallelize`` on one CUDA GPU (world size 1, NCCL), where what
differs from the CPU is the device: factory ops written with the trace's
device, kernels that exist only on CUDA (``torch._grouped_mm`` for mixtures of
experts in bf16), cuDNN convolutions, and the CUDA caching allocator.

Per case and strategy, a cell passes when every step's loss is within 1e-4
(relative) of the same model trained eagerly on the same GPU, and the final
weights equal (``rtol 1e-4``, ``atol 1e-5``), all in fp32 with TF32 off; a
bf16 cell passes when it runs and its losses are finite and within 2e-2 of
the fp32 eager ones (relative, or absolute below a loss of 1).

    python -m benchmarks.real_models_gpu [--cases hf-mixtral,timm-swin] [--budget-s 300]

Results go to ``results/real_models_gpu-<device>.json``; without CUDA it
refuses (the CPU runs are ``hf_architectures --breadth``).
"""
from __future__ import annotations

import argparse
import functools
import math
import time
import traceback
import warnings

import torch

import autopar  # noqa: F401 - first: its torchvision shim, before any model is built

from .common import save
from .matrix import LR, STEPS, _optimizer
from .real_models import BREADTH_HF, BREADTH_VISION, CASES, RESEARCH, TORCH_NN

#: strategies run on one GPU: the plain program, microbatches with full recompute, selective
#: recompute, and bf16 mixed precision (looser tolerance)
#: (precision named: a CUDA machine's default is bf16)
STRATEGIES = ("precision=fp32", "microbatches=2,recompute=full,precision=fp32",
              "recompute=selective,precision=fp32", "precision=bf16")
BF16_TOLERANCE = 2e-2


def _to(x, dev):
    return x.to(dev) if isinstance(x, torch.Tensor) else x


def eager(key: str, dev: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final state of ``STEPS`` eager fp32 steps of ``key`` on ``dev``."""
    c = CASES[key]()
    c.model.to(dev)
    inputs, target = tuple(_to(x, dev) for x in c.inputs), c.target.to(dev)
    opt = _optimizer(list(c.model.parameters()), lr=c.lr or LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = c.loss_fn(c.model(*inputs), target) if c.loss_fn != "labels" else c.loss(inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().float().cpu() for k, v in c.model.state_dict().items()}


def compiled(key: str, strategy: str, dev: torch.device) -> tuple[list[float], dict[str, torch.Tensor], str]:
    """Losses, gathered final state and the strategy run of ``key`` through ``autopar.parallelize``."""
    c = CASES[key]()
    pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target,
                             optimizer=functools.partial(_optimizer, lr=c.lr or LR), strategy=strategy,
                             batch_dim=c.batch_dim)
    off = off_device(pm, dev)
    if off:
        print(f"{key} {strategy}: tensors not on {dev}: {off[:8]}", flush=True)
    inputs, target = tuple(_to(x, dev) for x in c.inputs), c.target.to(dev)
    losses = [pm.train_step(inputs, target) for _ in range(STEPS)]
    return losses, {k: v.detach().float().cpu() for k, v in pm.full_state_dict().items()}, pm.config.to_string()


def off_device(pm: torch.nn.Module, dev: torch.device) -> list[str]:
    """Names of the tensors of ``pm``'s modules (parameters, buffers, plain tensor attributes) not on ``dev``."""
    return [f"{m_name}.{name}:{t.device}" for m_name, m in pm.named_modules()
            for name, t in [*vars(m).items(), *m._buffers.items(), *m._parameters.items()]
            if isinstance(t, torch.Tensor) and t.device != dev]


def verdict(strategy: str, got: tuple[list[float], dict], ref: tuple[list[float], dict]) -> str:
    """``"ok"`` or why the cell fails."""
    (losses, state), (ref_losses, ref_state) = got, ref
    rel = BF16_TOLERANCE if "bf16" in strategy else 1e-4
    if not all(math.isfinite(v) for v in losses):
        return f"non-finite losses {losses}"
    # bf16: relative to the loss or 1, whichever is larger (a loss trained near 0 in three steps
    # differs from fp32 by bf16's absolute rounding, not a relative one)
    floor = 1.0 if "bf16" in strategy else 0.0
    bad = [(a, b) for a, b in zip(losses, ref_losses) if abs(a - b) > rel * max(abs(b), floor)]
    if bad:
        return f"losses {losses} vs {ref_losses}"
    if "bf16" in strategy:
        return "ok"
    for k, v in ref_state.items():
        if not v.is_floating_point():
            continue
        if k not in state:
            return f"final state lacks {k}"
        if not torch.allclose(state[k], v, rtol=1e-4, atol=1e-5):
            return f"final weight {k} differs by {(state[k] - v).abs().max().item():.2e}"
    return "ok"


def main(cases: list[str], budget_s: float) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("real_models_gpu needs a CUDA GPU (on the CPU: python -m benchmarks.hf_architectures)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    warnings.simplefilter("ignore")
    dev = torch.device("cuda", 0)
    t_start, details, rows = time.perf_counter(), [], []
    for key in cases:
        if time.perf_counter() - t_start > budget_s:
            print(f"budget of {budget_s:.0f} s spent: {key} and after not run", flush=True)
            break
        row = [key]
        try:
            ref = eager(key, dev)
        except Exception as e:  # noqa: BLE001 - a case whose eager run fails is a row
            traceback.print_exc()
            details.append({"case": key, "strategy": "eager", "status": f"eager: {type(e).__name__}: {e}"})
            rows.append(row + ["-"] * len(STRATEGIES))
            continue
        for strategy in STRATEGIES:
            t0 = time.perf_counter()
            try:
                losses, state, run = compiled(key, strategy, dev)
                status = verdict(strategy, (losses, state), ref)
            except Exception as e:  # noqa: BLE001 - a failing cell is a row
                traceback.print_exc()
                status, losses, run = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None, None
            details.append({"case": key, "strategy": strategy, "run": run, "status": status, "losses": losses,
                            "reference": ref[0], "s": round(time.perf_counter() - t0, 2)})
            print(details[-1], flush=True)
            row.append("ok" if status == "ok" else "FAIL")
            torch.cuda.empty_cache()
        rows.append(row)
    ok = sum(d["status"] == "ok" for d in details)
    result = {"params": {"gpu": torch.cuda.get_device_name(0), "strategies": list(STRATEGIES), "steps": STEPS,
                         "cases": cases},
              "table": {"columns": ["case", *STRATEGIES], "rows": rows},
              "summary": {"cells": len(details), "ok": ok, "failures": [f"{d['case']} {d['strategy']}: {d['status']}"
                                                                       for d in details if d["status"] != "ok"]},
              "details": details}
    save("real_models_gpu", result)
    print(f"{ok} of {len(details)} cells equal eager", flush=True)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join([*BREADTH_HF, *BREADTH_VISION, *TORCH_NN, *RESEARCH]),
                    help="comma-separated keys")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no case after this many seconds")
    a = ap.parse_args()
    main(a.cases.split(","), a.budget_s)
