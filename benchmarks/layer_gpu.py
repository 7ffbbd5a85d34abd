"""One tensor-parallel rank's transformer layer timed on one CUDA GPU, against
the cost model's compute time for the same layer.

Issue 17 asks which part of the cost model is wrong for Llama 3 405B (430
TFLOP/s per GPU measured on 8192 H100, 0.72-0.85 of that predicted). The cost
model prices a GEMM at one flat fraction of the datasheet peak
(``device.matmul_efficiency``, 0.6 on the dgx-h100 preset, an assumption from
Megatron-LM's end-to-end utilisation). This benchmark measures what one rank's
share of a layer really takes on the GPU.

Each case builds the zoo model's own layer (``LlamaBlock``, the code autopar
runs) at one rank's shapes under Megatron tensor parallelism of degree ``tp``:
the column-parallel linears (q, k, v, w1, w3) keep ``1/tp`` of their outputs,
the row-parallel ones (o, w2) ``1/tp`` of their inputs, and the attention
``1/tp`` of the query and key/value heads. One forward and backward of that
block on a ``[batch, seq, hidden]`` bf16 input (gradients of the input and of
every weight, as inside a model) is timed between device syncs (the median of
``--reps`` runs; the H100 result of 2026-11-27 used CUDA events); the tensor-parallel
collectives are left out, as they are out of the cost model's compute time.

The prediction is the per-layer difference of ``autopar.evaluate(...)
.compute_time_s`` for the zoo model at two depths (2 and 4 layers) under
``tp=<tp>,precision=bf16`` on the dgx-h100 preset. Both are also given as
TFLOP/s of the layer's model FLOPs (6 x tokens x the rank's weights, plus
causal attention's 6 x batch x seq^2 x the rank's query width).

The bf16 GEMM rates of the rank's forward GEMM shapes are timed too (raw
``gemms``), and the fused attention's forward and backward alone.

    python -m benchmarks.layer_gpu [--cases llama3-405b-tp8,...] [--reps 10]

Needs CUDA (``--device cpu`` with ``--cases tiny`` runs the code path on the
CPU, for tests of the script itself); results go to
``results/layer_gpu-<device>.json``.
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.common import each_case, save
from benchmarks.fidelity_gpu import _timed

# key -> (zoo string with {L} for the depth, tp, batch)
CASES = {
    "llama3-405b-tp8": ("llama:layers={L},hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=8192,vocab=128256", 8, 1),
    "llama3-70b-tp8": ("llama:layers={L},hidden=8192,heads=64,kv_heads=8,ffn=28672,seq=8192,vocab=128256", 8, 1),
    "llama3-8b-tp1": ("llama:layers={L},hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256", 1, 1),
    "llama3-8b-tp4": ("llama:layers={L},hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256", 4, 1),
    "tiny": ("llama:layers={L},hidden=64,heads=8,kv_heads=4,ffn=128,seq=32,vocab=256", 2, 2),
}
COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.w1", "mlp.w3")
ROW = ("attn.o", "mlp.w2")


def rank_block(spec: str, tp: int, device: str):
    """The zoo model's first layer at one tensor-parallel rank's shapes, in bf16 on ``device``."""
    import torch
    from torch import nn

    import autopar.zoo as zoo
    z = zoo.build(spec.format(L=1), device="meta")
    block = z.model.layers[0]
    attn = block.attn
    if attn.heads % tp or attn.kv_heads % tp:
        raise ValueError(f"tp={tp} must divide the heads ({attn.heads}) and kv heads ({attn.kv_heads})")
    attn.heads //= tp
    attn.kv_heads //= tp
    for name, mod in list(block.named_modules()):
        if name in COLUMN or name in ROW:
            i, o = mod.in_features, mod.out_features
            new = nn.Linear(i // tp if name in ROW else i, o if name in ROW else o // tp, bias=False, device="meta")
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent), leaf, new)
    block = block.to_empty(device=device)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return block.to(torch.bfloat16), z.config


def _weights(block) -> int:
    return sum(p.numel() for n, p in block.named_parameters() if p.dim() > 1)


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, each between device syncs, after
    fidelity_gpu's warm-ups."""
    return statistics.median(_timed(fn, reps))


def measure_layer(spec: str, tp: int, batch: int, device: str, reps: int) -> dict:
    """Seconds of one forward and backward of the rank's layer, and its model FLOPs."""
    import torch

    from autopar.zoo.models import rope_cache
    block, cfg = rank_block(spec, tp, device)
    seq, hd = cfg["seq"], cfg["hidden"] // cfg["heads"]
    cos, sin = (t.to(device=device, dtype=torch.bfloat16) for t in rope_cache(seq, hd, cfg.get("rope_theta", 5e5)))
    x = torch.randn(batch, seq, cfg["hidden"], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    params = list(block.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        block(x, cos, sin).backward(grad)

    s = _time(step, reps)
    q_width = cfg["heads"] // tp * hd
    flops = 6 * batch * seq * _weights(block) + 6 * batch * seq * seq * q_width
    attn = _time_attention(batch, seq, cfg["heads"] // tp, hd, device, reps)
    attn_flops = 6 * batch * seq * seq * q_width  # causal: half of 4 s^2 d forward, backward 2x
    gemms = _gemm_rates(block, batch * seq, device, reps)
    del block, x, grad, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"measured_layer_s": s, "layer_flops": flops, "measured_tflops": flops / s / 1e12,
            "attention_s": attn, "attention_tflops": attn_flops / attn / 1e12, "gemms": gemms}


def _time_attention(batch: int, seq: int, heads: int, hd: int, device: str, reps: int) -> float:
    """Seconds of causal scaled_dot_product_attention's forward and backward at the rank's shape."""
    import torch
    import torch.nn.functional as F
    q, k, v = (torch.randn(batch, heads, seq, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(batch, heads, seq, hd, device=device, dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    return _time(step, reps)


def _gemm_rates(block, m: int, device: str, reps: int) -> list[dict]:
    """bf16 TFLOP/s of ``[m, in] x [in, out]`` for each of the block's linears."""
    import torch
    rows = []
    for name in COLUMN + ROW:
        w = block.get_submodule(name).weight
        a = torch.randn(m, w.shape[1], device=device, dtype=torch.bfloat16)
        s = _time(lambda: a @ w.t(), reps)
        rows.append({"linear": name, "m": m, "k": w.shape[1], "n": w.shape[0], "s": s,
                     "tflops": 2 * m * w.shape[1] * w.shape[0] / s / 1e12})
    return rows


def predict_layer(spec: str, tp: int, batch: int, cluster: str = "dgx-h100") -> dict:
    """The cost model's compute seconds (and tensor-parallel communication) per layer and microbatch."""
    import autopar
    est = {L: autopar.evaluate(spec.format(L=L), cluster=cluster, devices=tp, strategy=f"tp={tp},precision=bf16",
                               global_batch=batch) for L in (2, 4)}
    return {"predicted_layer_s": (est[4].compute_time_s - est[2].compute_time_s) / 2,
            "predicted_tp_comm_layer_s": (est[4].tp_comm_time_s - est[2].tp_comm_time_s) / 2}


def run_case(key: str, device: str, reps: int) -> dict:
    spec, tp, batch = CASES[key]
    rec = {"case": key, "spec": spec, "tp": tp, "batch": batch}
    rec.update(measure_layer(spec, tp, batch, device, reps))
    rec.update(predict_layer(spec, tp, batch))
    rec["predicted_tflops"] = rec["layer_flops"] / rec["predicted_layer_s"] / 1e12
    rec["error"] = rec["predicted_layer_s"] / rec["measured_layer_s"] - 1
    return rec


def main(cases: list[str], device: str, reps: int) -> dict:
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("layer_gpu needs a CUDA GPU (or --device cpu --cases tiny to check the script)")
    raw, rows = each_case(cases, lambda key: run_case(key, device, reps), failed="failed"), []
    for rec in raw:
        key = rec["case"]
        if "failed" in rec:
            rows.append([key, "-", "-", "-", "-", "-", "-", rec["failed"][:60]])
        else:
            rows.append([key, f"{rec['measured_layer_s'] * 1e3:.2f}", f"{rec['predicted_layer_s'] * 1e3:.2f}",
                         f"{rec['measured_tflops']:.0f}", f"{rec['predicted_tflops']:.0f}",
                         f"{rec['attention_tflops']:.0f}", f"{rec['predicted_tp_comm_layer_s'] * 1e3:.2f}",
                         f"{rec['error']:+.1%}"])
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    result = {"params": {"gpu": gpu, "cases": cases, "reps": reps, "cluster": "dgx-h100"},
              "table": {"columns": ["case", "measured ms/layer", "predicted ms/layer", "measured TFLOP/s",
                                    "predicted TFLOP/s", "attention alone TFLOP/s", "tp comm ms/layer (predicted)",
                                    "error"], "rows": rows},
              "summary": {"cases": len(raw), "ran": sum("failed" not in r for r in raw)},
              "raw": raw}
    if device == "cuda":  # a CPU run only checks the script
        save("layer_gpu", result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="llama3-405b-tp8,llama3-70b-tp8,llama3-8b-tp1,llama3-8b-tp4",
                    help="comma-separated keys of CASES")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    main(a.cases.split(","), a.device, a.reps)
