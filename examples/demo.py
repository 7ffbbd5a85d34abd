"""`make demo`: plan GPT-3 175B on 1024 simulated A100s, then train a small GPT
on 4 local gloo processes with an automatic plan."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import autopar

HERE = Path(__file__).resolve().parent


def main() -> None:
    print("== 1. Planning GPT-3 175B on 1024 A100-80GB (dgx-a100-80g preset), global batch 1536")
    t = time.perf_counter()
    plan = autopar.plan("gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200",
                        cluster="dgx-a100-80g", devices=1024, global_batch=1536)
    print(plan.summary())
    out = Path("plan-gpt3-175b.json")
    plan.save(out)
    print(f"planned in {time.perf_counter() - t:.1f} s (trace + search); plan written to {out}\n")

    print("== 2. Training a small GPT on 4 local gloo processes (torchrun), strategy chosen by autopar")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "4", "--master-port", "29517", str(HERE / "train_gpt.py")]
    print("$", " ".join(cmd))
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
