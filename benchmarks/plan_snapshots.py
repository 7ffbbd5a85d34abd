"""Plans and estimates of the benchmark cases, written as files to compare
across a refactoring: the same inputs must give byte-identical plans.

    python -m benchmarks.plan_snapshots OUT_DIR [--quick]
    diff -r BEFORE_DIR AFTER_DIR

Each case writes ``<name>.json``: the plan's ``to_json()`` (automatic cases)
or the estimate's ``to_dict()`` (manual strategies). Planning time is printed,
never written, so the files depend only on the planner's decisions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import autopar

GPT_1_3B = "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200"
GPT_6_7B = "gpt:layers=32,hidden=4096,heads=32,seq=2048,vocab=51200"
GPT_175B = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
LLAMA_8B = "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"
SMALL_GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"
SMALL_LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=176,seq=16,vocab=128"

# (name, model, cluster, devices, global batch, strategy or "auto", extra plan kwargs)
QUICK = [
    ("small-gpt-auto", SMALL_GPT, "cpu", 4, 8, "auto", {}),
    ("small-llama-auto", SMALL_LLAMA, "cpu", 4, 8, "auto", {}),
    ("small-gpt-greedy", SMALL_GPT, "cpu", 4, 8, "auto", {"search_mode": "greedy"}),
    ("small-gpt-dp2tp2", SMALL_GPT, "cpu", 4, 8, "dp=2,tp=2", {}),
    ("small-gpt-pp2", SMALL_GPT, "cpu", 4, 8, "dp=1,tp=2,pp=2,microbatches=4", {}),
    ("small-gpt-sp", SMALL_GPT, "cpu", 4, 8, "dp=2,tp=2,sequence_parallel=true", {}),
    ("1.3B-a100x8", GPT_1_3B, "dgx-a100-80g", 8, 512, "auto", {}),
    ("6.7B-a100x64", GPT_6_7B, "dgx-a100-80g", 64, 1024, "auto", {}),
    ("6.7B-a100x64-tp8-sp", GPT_6_7B, "dgx-a100-80g", 64, 1024,
     "dp=8,tp=8,microbatches=4,sequence_parallel=true,recompute=selective", {}),
    ("llama8b-h100x32", LLAMA_8B, "dgx-h100", 32, 256, "auto", {}),
]
FULL = QUICK + [
    ("175B-a100x1024", GPT_175B, "dgx-a100-80g", 1024, 1536, "auto", {}),
    ("175B-h100x1024", GPT_175B, "dgx-h100", 1024, 1536, "auto", {}),
    ("175B-a100x1024-3d", GPT_175B, "dgx-a100-80g", 1024, 1536,
     "dp=32,tp=4,pp=8,microbatches=48,schedule=interleaved,chunks=2,zero=1", {}),
]


def run_case(model: str, cluster: str, devices: int, batch: int, strategy: str, kwargs: dict) -> str:
    if strategy == "auto":
        p = autopar.plan(model, cluster=cluster, devices=devices, global_batch=batch, **kwargs)
        return p.to_json()
    est = autopar.evaluate(model, cluster=cluster, devices=devices, strategy=strategy, global_batch=batch)
    return json.dumps(est.to_dict(), indent=1, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true", help="skip the 175B cases")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    for name, model, cluster, devices, batch, strategy, kwargs in (QUICK if args.quick else FULL):
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        text = run_case(model, cluster, devices, batch, strategy, kwargs)
        (args.out / f"{name}.json").write_text(text)
        print(f"{name}: {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
