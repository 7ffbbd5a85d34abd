"""Train a small GPT with an automatic plan. Every rank runs this script:

    torchrun --nproc-per-node 4 examples/train_gpt.py [--strategy auto|dp=2,tp=2] [--steps 5]

autopar traces the model, picks the strategy (or takes yours), rewrites the
model into this rank's shards and trains. Rank 0 prints the plan, the losses
and the predicted against the measured step time.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import autopar
from autopar import zoo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt:layers=4,hidden=128,heads=4,seq=64,vocab=512")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()

    torch.manual_seed(0)
    z = zoo.build(args.model, device="cpu", batch=args.batch)   # an ordinary single-device model
    vocab = z.config["vocab"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, z.config["seq"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                             strategy=args.strategy)
    rank = dist.get_rank()
    if rank == 0:
        print(pm.plan.summary())
    for step in range(args.steps):
        loss = pm.train_step((x,), y)
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}  ({pm.step_times[-1] * 1e3:.1f} ms)")
    if rank == 0:
        measured = statistics.median(pm.step_times[1:]) if len(pm.step_times) > 1 else pm.step_times[0]
        predicted = pm.plan.predicted["step_time_s"]
        print(f"strategy {pm.plan.strategy}: predicted step {predicted * 1e3:.1f} ms, "
              f"measured median {measured * 1e3:.1f} ms (ratio {measured / predicted:.2f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
