"""``make bench``: the quick set of every benchmark, one after the other.

1. ``autopar calibrate --quick`` writes ``results/cluster-<device>.json``;
2. ``fidelity`` plans with that cluster file and measures; ``fidelity_hf`` the same on
   Hugging Face GPT-2 and Llama (``python -m benchmarks.fidelity --suite hf``);
3. ``overhead``, ``planner_scaling``, ``plan_quality``, ``ilp_search`` and ``pipeline_plan``.

They run in sequence on purpose: timings taken while another benchmark uses
the cores would be worthless. ``--only NAME`` runs one of them; ``--full``
runs the full (slower) variants.
"""
from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time

from rich.console import Console

from benchmarks.common import RESULTS, device_tag

STEPS = ["calibrate", "fidelity", "fidelity_hf", "overhead", "planner_scaling", "plan_quality", "ilp_search",
         "pipeline_plan"]


def calibrate(quick: bool) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cluster-{device_tag()}.json"
    cmd = [sys.executable, "-m", "autopar", "calibrate", "--out", str(out)] + (["--quick"] if quick else [])
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=STEPS, action="append", help="run only these (repeatable)")
    ap.add_argument("--full", action="store_true", help="the full variants (much slower)")
    a = ap.parse_args(argv)
    con = Console(stderr=True)
    quick = not a.full
    t_all = time.perf_counter()
    walls = {}
    for name in a.only or STEPS:
        con.rule(f"[bold]{name}")
        t0 = time.perf_counter()
        if name == "calibrate":
            calibrate(quick)
        elif name == "fidelity_hf":
            importlib.import_module("benchmarks.fidelity").main(quick=quick, suite="hf")
        else:
            importlib.import_module(f"benchmarks.{name}").main(quick=quick)
        walls[name] = time.perf_counter() - t0
        con.print(f"{name}: {walls[name]:.0f} s")
    con.rule()
    con.print(", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) +
              f"; total {time.perf_counter() - t_all:.0f} s. Tables: benchmarks/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
