"""Plans and estimates of the benchmark cases, written as files to compare
across a refactoring: the same inputs must give the same plans.

    python -m benchmarks.plan_snapshots OUT_DIR [--quick]
    diff -r BEFORE_DIR AFTER_DIR                                   # same plan format: bytes
    python -m benchmarks.plan_snapshots --compare BEFORE_DIR AFTER_DIR   # across plan formats: content

Each case writes ``<name>.json``: the plan's ``to_json()`` (automatic cases)
or the estimate's ``to_dict()`` (manual strategies). Planning time is printed,
never written, so the files depend only on the planner's decisions.
``--compare`` reads both directories' plans, brings an older plan version to
the current one for its case's model (:meth:`autopar.Plan.upgraded`: ops
re-keyed, nothing else changed) and compares their content (everything but
the autopar version; estimates as JSON), naming what differs; exit code 1
when anything does.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import autopar
from autopar.api import as_graph
from autopar.plan import PLAN_VERSION, Plan

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


def _content(path: Path, model: str) -> dict:
    """What a snapshot file says, independent of the plan format: an
    estimate's JSON, or a plan's data in the current version (the autopar
    version left out)."""
    d = json.loads(path.read_text())
    if "plan_version" not in d:
        return d
    p = Plan.from_dict(d, where=str(path))
    if p.version < PLAN_VERSION:
        p = p.upgraded(as_graph(model))
    return {k: v for k, v in p.data.items() if k != "autopar_version"}


def compare(before: Path, after: Path) -> int:
    """Compare the snapshots of two directories by content; print each case
    that differs (and what differs in it). Returns 0 when all are equal, 1 otherwise."""
    models = {name: model for name, model, *_ in FULL}
    bad = 0
    for path in sorted(before.glob("*.json")):
        other = after / path.name
        if not other.exists():
            print(f"{path.stem}: missing in {after}")
            bad += 1
            continue
        x, y = _content(path, models[path.stem]), _content(other, models[path.stem])
        if x != y:
            print(f"{path.stem}: differs in {', '.join(sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k)))}")
            bad += 1
        else:
            print(f"{path.stem}: same content")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("after", type=Path, nargs="?", help="with --compare: the directory to compare OUT with")
    ap.add_argument("--quick", action="store_true", help="skip the 175B cases")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--compare", action="store_true", help="compare the snapshots in OUT and AFTER by content")
    args = ap.parse_args(argv)
    if args.compare:
        if args.after is None:
            ap.error("--compare needs two directories: BEFORE AFTER")
        return compare(args.out, args.after)
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
