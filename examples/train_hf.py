"""Train a Hugging Face Llama with an automatic plan. Every rank runs this script:

    torchrun --nproc-per-node 4 examples/train_hf.py [--strategy auto|dp=2,tp=2|pp=2,tp=2] [--steps 5]

The model is ``transformers``' own ``LlamaForCausalLM`` (grouped-query
attention, rotary embeddings, RMSNorm, SwiGLU), built from its config class,
nothing downloaded. ``torch.fx`` cannot trace it symbolically, so autopar
traces it with ``torch.export``; the plan, the tensor-parallel rewrite, the
pipeline stages and the memory options run on that graph as on any other.
Rank 0 prints the plan, the losses, and the predicted against the measured
step time.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar


def next_token_loss(out, target):
    """Mean cross-entropy of the model's logits against the next tokens."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args()

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden) // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)          # an ordinary single-device model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    pm = autopar.parallelize(model, (x,), loss_fn=next_token_loss, example_target=y,
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
    full = pm.full_state_dict()      # collective: every rank gathers; named as model.state_dict()
    if rank == 0:
        missing = set(model.state_dict()) - set(full)
        print(f"gathered state: {len(full)} tensors" + (f", not gathered: {sorted(missing)}" if missing else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
