"""Cost-model fidelity: predicted against measured step time and peak memory.

On 4 local gloo processes, every strategy of a small GPT and a small Llama-like
model that autopar can execute today (data / tensor splits x microbatches) is
planned with a cluster file (by default the one ``autopar calibrate`` wrote to
``benchmarks/results/cluster-<device>.json``, else the ``cpu`` preset), run
for a few steps, and measured:

* step time: median over timed steps of ``train_step`` (barrier before each),
  max over ranks (the step ends when the slowest rank does);
* peak memory per rank: ``torch.distributed._tools.mem_tracker.MemTracker``
  (PyTorch's own accounting of parameters, gradients, optimizer state,
  activations and temporaries by tensor storage) over one steady-state step,
  max over ranks.

It reports the Spearman rank correlation of predicted and measured step times
and the median absolute percentage error (MAPE) of time and memory, against
the targets 0.85, 25 % and 15 %.

    python -m benchmarks.fidelity [--quick] [--cluster FILE]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, device_tag, save

WORLD = 4
MODELS = {
    "gpt": "gpt:layers=2,hidden=128,heads=4,seq=64,vocab=1024",
    "llama": "llama:layers=2,hidden=128,heads=4,kv_heads=2,ffn=352,seq=64,vocab=1024",
}
SPLITS = ["dp=4", "tp=4", "dp=2,tp=2"]
TARGETS = {"spearman": 0.85, "time_mape": 0.25, "memory_mape": 0.15}


def cases(quick: bool) -> list[tuple[str, str, int]]:
    """(model key, strategy, global batch) for every run."""
    out = []
    batches = [8, 16] if quick else [8, 16, 32]
    for key in MODELS:
        for gb in batches:
            for split in SPLITS:
                for mb in (1, 2):
                    out.append((key, f"{split},microbatches={mb}", gb))
    return out


def _peak_tracker():
    """MemTracker without its per-module bookkeeping: that refuses a root module
    called once per microbatch, and only the total over the step is wanted here.
    Storages are still counted by PyTorch's own accounting (a dispatch mode that
    sees every allocation, plus the parameters and the optimizer state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, *a, **k):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

    return PeakTracker()


def _worker(rank: int, world: int, runs: list[tuple[str, str, int]], cluster: str, steps: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import autopar
    import autopar.zoo as zoo

    out = []
    for key, strategy, gb in runs:
        z = zoo.build(MODELS[key], device="cpu", batch=gb, seed=0)
        g = torch.Generator().manual_seed(1)
        vocab = z.config["vocab"]
        x = torch.randint(0, vocab, z.example_inputs[0].shape, generator=g)
        y = torch.randint(0, vocab, x.shape, generator=g)
        pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 strategy=strategy, cluster=cluster)
        del z
        for _ in range(2):                       # warm-up: allocator, optimizer state
            pm.train_step((x,), y)
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            pm.train_step((x,), y)
            times.append(time.perf_counter() - t0)
        mt = _peak_tracker()
        mt.track_external(pm, pm.optimizer)
        with mt:
            pm.train_step((x,), y)
        snap = mt.get_tracker_snapshot("peak")
        dev = next(iter(snap))
        parts = {k.value if hasattr(k, "value") else str(k): int(v) for k, v in snap[dev].items()}
        pred = pm.plan.predicted
        out.append({
            "model": key, "strategy": pm.config.to_string(), "global_batch": gb,
            "measured_step_s": statistics.median(times), "predicted_step_s": pred["step_time_s"],
            "measured_peak_bytes": parts.get("Total", 0), "predicted_peak_bytes": pred["peak_memory_bytes"],
            "measured_parts": parts, "predicted_memory": pm.plan.data.get("predicted", {}).get("memory"),
            "predicted_compute_s": pred.get("compute_time_s"), "predicted_comm_s": pred.get("comm_time_s"),
        })
        del pm
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def mape(pred: list[float], meas: list[float]) -> float:
    return float(np.median([abs(p - m) / m for p, m in zip(pred, meas)]))


def default_cluster() -> str:
    path = RESULTS / f"cluster-{device_tag()}.json"
    return str(path) if path.exists() else "cpu"


def main(quick: bool = False, cluster: str | None = None) -> dict:
    from rich.console import Console

    from autopar.runtime.launch import run_distributed
    con = Console(stderr=True)
    cluster = cluster or default_cluster()
    runs = cases(quick)
    steps = 4 if quick else 8
    con.print(f"[bold]fidelity[/]: {len(runs)} runs on {WORLD} gloo processes, cluster {cluster}")
    t0 = time.perf_counter()
    rows: list[dict] = []
    chunk = 6        # a few runs per spawn: start-up is paid once, a failure loses little
    for i in range(0, len(runs), chunk):
        part = runs[i:i + chunk]
        per_rank = run_distributed(_worker, WORLD, part, cluster, steps, timeout=900)
        for j in range(len(part)):
            r = dict(per_rank[0][j])
            r["measured_step_s"] = max(pr[j]["measured_step_s"] for pr in per_rank)
            r["measured_peak_bytes"] = max(pr[j]["measured_peak_bytes"] for pr in per_rank)
            rows.append(r)
            con.print(f"  {r['model']:6s} gb={r['global_batch']:<3d} {r['strategy']:38s} "
                      f"time {r['predicted_step_s'] * 1e3:7.1f} / {r['measured_step_s'] * 1e3:7.1f} ms  "
                      f"memory {r['predicted_peak_bytes'] / 2**20:7.1f} / {r['measured_peak_bytes'] / 2**20:7.1f} MiB")
    pt = [r["predicted_step_s"] for r in rows]
    mt = [r["measured_step_s"] for r in rows]
    pm = [r["predicted_peak_bytes"] for r in rows]
    mm = [r["measured_peak_bytes"] for r in rows]
    summary = {"runs": len(rows), "spearman (time)": spearman(pt, mt), "median time error": mape(pt, mt),
               "median memory error": mape(pm, mm), "spearman (memory)": spearman(pm, mm)}
    met = {"spearman": summary["spearman (time)"] >= TARGETS["spearman"],
           "time": summary["median time error"] <= TARGETS["time_mape"],
           "memory": summary["median memory error"] <= TARGETS["memory_mape"]}
    summary["targets met"] = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in met.items())
    table = {"columns": ["model", "global batch", "strategy", "predicted ms", "measured ms", "time err",
                         "predicted MiB", "measured MiB", "memory err"],
             "rows": [[r["model"], r["global_batch"], r["strategy"].replace(",schedule=1f1b", ""),
                       r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3,
                       f"{(r['predicted_step_s'] / r['measured_step_s'] - 1) * 100:+.0f}%",
                       r["predicted_peak_bytes"] / 2**20, r["measured_peak_bytes"] / 2**20,
                       f"{(r['predicted_peak_bytes'] / r['measured_peak_bytes'] - 1) * 100:+.0f}%"]
                      for r in rows]}
    worst_t = max(rows, key=lambda r: abs(r["predicted_step_s"] / r["measured_step_s"] - 1))
    worst_m = max(rows, key=lambda r: abs(r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1))
    notes = [
        f"largest time error: {worst_t['model']} gb={worst_t['global_batch']} {worst_t['strategy']} "
        f"({(worst_t['predicted_step_s'] / worst_t['measured_step_s'] - 1) * 100:+.0f}%)",
        f"largest memory error: {worst_m['model']} gb={worst_m['global_batch']} {worst_m['strategy']} "
        f"({(worst_m['predicted_peak_bytes'] / worst_m['measured_peak_bytes'] - 1) * 100:+.0f}%)",
        "what drives the remaining time error: at these sizes a step is mostly framework time (fx, autograd, "
        "Python: `dispatch_overhead_s` per op, measured once by calibrate on a width-8 model) and gloo latency "
        "(ms per collective with 4 processes on 2 cores, where a rank waits for the OS to schedule its peers); "
        "both vary with load, and collectives are not overlapped with compute in the model or the runtime",
        "what drives the remaining memory error: temporaries of the tensor-parallel kernels (vocabulary-parallel "
        "cross-entropy, all-gathered copies) are modelled as 2 x the largest activation, and gradients are "
        "counted as fully live at the peak while MemTracker sees them being created during backward",
    ]
    result = {
        "notes": notes,
        "title": "Cost-model fidelity (4 gloo processes)",
        "description": (f"Predicted (cluster `{Path(cluster).name}`) against measured step time (median of "
                        f"{steps} steps, slowest rank) and peak memory per rank (MemTracker, largest rank), "
                        f"AdamW, fp32. Models: " + "; ".join(f"{k} `{v}`" for k, v in MODELS.items()) + "."),
        "params": {"world": WORLD, "models": MODELS, "cluster": cluster, "steps": steps, "quick": quick},
        "summary": summary, "targets": TARGETS, "table": table, "runs": rows,
        "wall_s": time.perf_counter() - t0,
    }
    save("fidelity", result)
    con.print(summary)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and steps")
    ap.add_argument("--cluster", default=None, help="cluster preset or file (default: the calibrated one)")
    a = ap.parse_args()
    main(a.quick, a.cluster)
