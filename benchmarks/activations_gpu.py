"""Activation memory per layer on one CUDA GPU: what the kernels really keep,
against what the cost model counts, at published model widths.

The cost model prices the tensors each op saves for backward from autograd's
rules (issue 17: activation memory within 10% of Korthikanti et al.'s
formulas, and the Llama 3 405B rows). On the CPU some of those rules are not
CUDA's: ``F.rms_norm`` runs as a composite that also keeps the normalized
tensor, and ``scaled_dot_product_attention`` runs the math kernel, which keeps
the ``(B, H, T, T)`` scores. This benchmark measures the GPU's own numbers.

For each case the model is built at two depths (``L1`` and ``L2`` repeated
layers) in bf16 on the GPU, one forward with gradients runs (loss included),
and the bytes allocated after it, less those before it, are the activations
of that depth; their difference over ``L2 - L1`` is what one layer keeps (both
depths at least 2: with one layer nothing repeats, and the cost model counts
that layer with the rest of the program). The prediction is the same difference of ``autopar.evaluate(...).memory
["activations"]`` (one device, ``precision=bf16``). Both are also given in
Korthikanti's unit, bytes per ``s * b * h`` (34 for a GPT layer with flash
attention, no dropout: their formula's ``34 sbh`` without the ``5as/h`` term).

A second table times the bf16 GEMMs of a transformer layer (``[s*b, h] x
[h, n]``) over widths and tensor-parallel splits, for the matmul efficiency
the cost model takes as flat (Megatron's 7.5B row, issue 17).

    python -m benchmarks.activations_gpu [--cases llama3-8b,gpt3-175b,hf-llama3-8b]

Needs CUDA; results go to ``results/activations_gpu-<device>.json``.
"""
from __future__ import annotations

import argparse
import gc
import time

from benchmarks.common import each_case, save

# key -> (zoo string with {L} for the depth, batch, seq, hidden, layers compared)
CASES = {
    "llama3-8b": ("llama:layers={L},hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256",
                  1, 8192, 4096, (2, 4)),
    "gpt3-175b": ("gpt:layers={L},hidden=12288,heads=96,seq=2048,vocab=51200", 1, 2048, 12288, (2, 4)),
    "hf-llama3-8b": ("hf-llama:num_hidden_layers={L},hidden_size=4096,num_attention_heads=32,"
                     "num_key_value_heads=8,intermediate_size=14336,vocab_size=128256,seq=8192",
                     1, 8192, 4096, (2, 4)),
    "hf-gpt2-xl": ("hf-gpt2:n_layer={L},n_embd=1600,n_head=25,vocab_size=50257,seq=1024,n_positions=1024",
                   4, 1024, 1600, (2, 4)),
}
# (hidden, tp): the layer's GEMMs at microbatch 1, seq 2048 (Megatron Table 1 widths)
GEMMS = [(h, t) for h in (2048, 4096, 6144, 8192, 12288, 16384) for t in (1, 2, 4, 8)]


def _measure(spec: str, batch: int) -> int:
    """Bytes a forward with gradients (and its loss) leaves allocated on the GPU."""
    import torch

    import autopar.zoo as zoo
    z = zoo.build(spec, device="cuda", batch=batch, seed=0)
    model = z.model.to(torch.bfloat16)
    x = z.example_inputs[0].to("cuda")
    vocab = z.config["vocab"] if "vocab" in z.config else z.config["vocab_size"]
    y = torch.randint(0, vocab, x.shape, device="cuda")
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    loss = z.loss_fn(model(x), y)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del loss, model, z, x, y
    gc.collect()
    torch.cuda.empty_cache()
    return int(kept)


def _predict(spec: str, batch: int) -> float:
    import autopar
    est = autopar.evaluate(spec, cluster="dgx-h100", devices=1, strategy="precision=bf16", global_batch=batch)
    return float(est.memory["activations"])


def run_case(key: str) -> dict:
    spec, batch, seq, hidden, (l1, l2) = CASES[key]
    meas = {L: _measure(spec.format(L=L), batch) for L in (l1, l2)}
    pred = {L: _predict(spec.format(L=L), batch) for L in (l1, l2)}
    sbh = seq * batch * hidden
    m_layer, p_layer = (meas[l2] - meas[l1]) / (l2 - l1), (pred[l2] - pred[l1]) / (l2 - l1)
    return {"case": key, "spec": spec, "batch": batch, "layers": [l1, l2],
            "measured_bytes": meas, "predicted_bytes": pred,
            "measured_layer_bytes": m_layer, "predicted_layer_bytes": p_layer,
            "measured_layer_sbh": m_layer / sbh, "predicted_layer_sbh": p_layer / sbh,
            "measured_outside_bytes": meas[l1] - l1 * m_layer, "predicted_outside_bytes": pred[l1] - l1 * p_layer,
            "layer_error": p_layer / m_layer - 1}


def gemm_rates(seq: int = 2048, reps: int = 20) -> list[dict]:
    """bf16 TFLOP/s of a layer's four GEMM shapes (qkv, proj, fc1, fc2) per (hidden, tp)."""
    import torch
    rows = []
    for h, t in GEMMS:
        shapes = {"qkv": (h, 3 * h // t), "proj": (h // t, h), "fc1": (h, 4 * h // t), "fc2": (4 * h // t, h)}
        for name, (k, n) in shapes.items():
            a = torch.randn(seq, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            rows.append({"hidden": h, "tp": t, "gemm": name, "m": seq, "k": k, "n": n,
                         "tflops": 2 * seq * k * n / dt / 1e12, "s": dt})
            del a, b
    return rows


def main(cases: list[str]) -> dict:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("activations_gpu needs a CUDA GPU")
    raw, rows = each_case(cases, run_case), []
    for rec in raw:
        key = rec["case"]
        if "error" in rec:
            rows.append([key, "-", "-", "-", "-", rec["error"][:60]])
        else:
            rows.append([key, f"{rec['measured_layer_bytes'] / 2**20:.0f}",
                         f"{rec['predicted_layer_bytes'] / 2**20:.0f}", f"{rec['measured_layer_sbh']:.2f}", f"{rec['predicted_layer_sbh']:.2f}",
                         f"{rec['layer_error']:+.1%}"])
    gemms = gemm_rates()
    for g in gemms:
        print(g, flush=True)
    result = {"params": {"gpu": torch.cuda.get_device_name(0), "cases": cases},
              "table": {"columns": ["case", "measured MiB/layer", "predicted MiB/layer", "measured sbh",
                                    "predicted sbh", "error"], "rows": rows},
              "summary": {"cases": len(raw), "ran": sum("error" not in r for r in raw),
                          "max_abs_layer_error": max((abs(r["layer_error"]) for r in raw if "layer_error" in r),
                                                     default=None)},
              "raw": raw, "gemms": gemms}
    save("activations_gpu", result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated keys of CASES")
    main(ap.parse_args().cases.split(","))
