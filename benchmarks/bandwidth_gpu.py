"""Memory bandwidth of elementwise kernels and of the AdamW step, by tensor size,
on one CUDA GPU.

The cost model prices a memory-bound op at ``memory_bandwidth *
memory_efficiency`` plus ``kernel_overhead_s``, and an optimizer step by the
passes torch's implementation makes over its state
(``cost_models.memory.OPTIMIZER_ACCESSES``: 20 fp32 reads and writes an element
for AdamW's foreach step, 7 for the fused kernel). This measures both: ``x + y``,
``x * 2``, GELU and a copy in bf16 from 64K to 256M elements, and an AdamW step
over one flat fp32 tensor of 1M to 256M elements with ``foreach=True`` and with
``fused=True``; the bandwidth is the bytes the model counts over the time taken.
If the access table is right, both AdamW variants reach the same bandwidth.

    python -m benchmarks.bandwidth_gpu

Needs CUDA; results go to ``results/bandwidth_gpu-<device>.json``.
"""
from __future__ import annotations

import time

from benchmarks.common import save
from cost_models.memory import OPTIMIZER_ACCESSES

SIZES = [1 << k for k in range(16, 29, 2)]


def _timeit(fn, sync, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def measure(device: str = "cuda", sizes: list[int] = SIZES) -> list[dict]:
    import torch
    import torch.nn.functional as F
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for n in sizes:
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        y = torch.randn_like(x)
        for name, fn, nbytes in [("add", lambda: x + y, 3 * 2 * n), ("mul_scalar", lambda: x * 2.0, 2 * 2 * n),
                                 ("gelu", lambda: F.gelu(x), 2 * 2 * n), ("copy", lambda: x.clone(), 2 * 2 * n)]:
            s = _timeit(fn, sync)
            rows.append({"op": name, "elems": n, "bytes": nbytes, "s": s, "GBps": nbytes / s / 1e9})
        del x, y
    for n in sizes[2:]:
        p = torch.nn.Parameter(torch.randn(n, device=device))
        p.grad = torch.randn(n, device=device)
        for name, opt, key in [("adamw_foreach", torch.optim.AdamW([p], lr=1e-4, foreach=True), "adamw"),
                               ("adamw_fused", torch.optim.AdamW([p], lr=1e-4, fused=True), "adamw_fused")]:
            s = _timeit(opt.step, sync, 5)
            nbytes = n * 4 * OPTIMIZER_ACCESSES[key]
            rows.append({"op": name, "elems": n, "bytes": nbytes, "s": s, "GBps": nbytes / s / 1e9})
        del p
    return rows


def result(rows: list[dict], gpu: str) -> dict:
    ops_ = sorted({r["op"] for r in rows}, key=[r["op"] for r in rows].index)
    sizes = sorted({r["elems"] for r in rows})
    cell = {(r["op"], r["elems"]): r for r in rows}
    table = [[f"{n:,}"] + [f"{cell[o, n]['GBps']:.0f}" if (o, n) in cell else "" for o in ops_] for n in sizes]
    return {"title": f"Memory bandwidth by tensor size ({gpu})", "params": {"gpu": gpu, "sizes": sizes},
            "table": {"columns": ["elements"] + [f"{o} GB/s" for o in ops_], "rows": table}, "raw": rows}


def main() -> dict:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bandwidth_gpu needs a CUDA GPU")
    rows = measure()
    for r in rows:
        print(f"{r['op']:14s} {r['elems']:>10d} {r['s'] * 1e6:10.1f} us {r['GBps']:8.1f} GB/s", flush=True)
    res = result(rows, torch.cuda.get_device_name(0))
    save("bandwidth_gpu", res)
    return res


if __name__ == "__main__":
    main()
