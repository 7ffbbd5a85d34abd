"""Every GPT shape of Megatron-LM's Table 1 planned on its published GPU count.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473), Table 1: ten GPT
models from 1.7B to 1T parameters (sequence 2048, vocabulary 51,200) on 32 to
3072 A100 GPUs, with the tensor / pipeline sizes, global batch and measured
teraFLOP/s per GPU the paper reports.

For each row, ``autopar.plan`` searches the full space on ``dgx-a100-80g``
(zoo string to plan; planning time, chosen strategy, predicted TFLOP/s per
GPU), and ``autopar.evaluate`` predicts the published configuration (its tp
and pp, dp = GPUs / (tp x pp), microbatch size 1, full recompute as the
paper's runs used, fp16 with the gradients all-reduced in fp16 after the
backward (:data:`PAPER_PRECISION`), and the interleaved schedule of its
Section 5.1 with the fewest chunks, 2, or 3 where the layers per stage are
odd; 1F1B where a stage holds one layer). Two of these requests used to crash the planner
(issue 17): 145B on 1536 GPUs tried sequence parallelism with tp=3, and
310B / 530B tried pipeline stages of 60 and 72 GPUs straddling nodes.

The paper's teraFLOP/s count the FLOPs its runs execute, the recomputed
forward included (its equation 3, :func:`megatron_flops`: 96 B s l h^2 (1 +
s/6h + V/16lh), four passes of the weight matmuls), while autopar's
``tflops_per_device`` counts the model's three (forward and backward). The
comparison is on the paper's count: its FLOPs over autopar's predicted step
time (``published_predicted_tflops``); autopar's own figure is kept beside it.

    python -m benchmarks.megatron_table1 [--quick]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple

from rich.console import Console

import autopar

from .common import timed_run

NAME = "megatron_table1"
CLUSTER = "dgx-a100-80g"
console = Console(stderr=True, highlight=False, soft_wrap=True)


#: the paper's runs as Megatron-LM ran them then: fp16 mixed precision (its example scripts' ``--fp16``;
#: bf16 came to Megatron-LM after the paper), whose local DDP keeps the gradients in the parameters'
#: dtype (``accumulate_allreduce_grads_in_fp32`` off unless bf16 forces it) and all-reduces them
#: after the backward of the last microbatch, not bucket by bucket during it
PAPER_PRECISION = "precision=fp16,reduce_dtype=fp16,overlap=false"
#: Megatron-LM's optimizer: apex's FusedAdam in AdamW mode, one pass over the weights and state
#: (torch's default AdamW makes ten, ``cost_models.memory.OPTIMIZER_ACCESSES``)
PAPER_OPTIMIZER = "adamw_fused"


class Row(NamedTuple):
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float       # achieved teraFLOP/s per GPU, as published

    @property
    def spec(self) -> str:
        return f"gpt:layers={self.layers},hidden={self.hidden},heads={self.heads},seq=2048,vocab=51200"

    @property
    def published(self) -> str:
        dp = self.gpus // (self.tp * self.pp)
        m = self.batch // dp
        pipe = ""
        if self.pp > 1:
            per_stage = self.layers // self.pp
            chunks = 2 if per_stage % 2 == 0 else 3 if per_stage % 3 == 0 else 1
            pipe = f",pp={self.pp}," + (f"schedule=interleaved,chunks={chunks}" if chunks > 1 else "schedule=1f1b")
        return f"dp={dp},tp={self.tp}{pipe},microbatches={m},recompute=full,{PAPER_PRECISION}"

    def flops(self) -> float:
        """FLOPs of one step as the paper counts them (:func:`megatron_flops`)."""
        return megatron_flops(self.batch, self.layers, self.hidden)


def megatron_flops(batch: int, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """FLOPs of one training step of a GPT with full activation recompute, as
    Narayanan et al. 2021 count them (equation 3): 96 B s l h^2 (1 + s/6h +
    V/16lh), i.e. the weight and attention matmuls of four passes (forward,
    the recomputed forward, backward twice) and the logits of three. Their
    teraFLOP/s per GPU are these FLOPs over the measured step time."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def paper_tflops(flops: float, step_time_s: float, gpus: int) -> float:
    """TeraFLOP/s per GPU of ``flops`` done in ``step_time_s`` on ``gpus``."""
    return flops / step_time_s / gpus / 1e12


TABLE1 = [
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def plan_row(row: Row) -> dict[str, Any]:
    """Plan one row from its zoo string; evaluate its published configuration."""
    t0 = time.perf_counter()
    p = autopar.plan(row.spec, cluster=CLUSTER, devices=row.gpus, global_batch=row.batch)
    took = time.perf_counter() - t0
    pub = autopar.evaluate(row.spec, cluster=CLUSTER, devices=row.gpus, global_batch=row.batch,
                           strategy=row.published, optimizer=PAPER_OPTIMIZER)
    predicted = paper_tflops(row.flops(), pub.step_time_s, row.gpus)
    return {"model": row.name, "gpus": row.gpus, "batch": row.batch, "plan_s": took, "strategy": p.strategy,
            "predicted_tflops": p.predicted["tflops_per_device"], "published": row.published,
            "published_predicted_tflops": predicted, "published_model_tflops": pub.tflops_per_device,
            "published_fits": pub.fits, "published_measured_tflops": row.tflops,
            "ratio": predicted / row.tflops}


def run(quick: bool = False) -> dict[str, Any]:
    rows = TABLE1[:4] if quick else TABLE1
    records = []
    for row in rows:
        rec = plan_row(row)
        console.print(f"{row.name:>5} on {row.gpus:>4} GPUs: {rec['plan_s']:5.1f} s  {rec['strategy']}  "
                      f"{rec['predicted_tflops']:.0f} TFLOP/s (published config, the paper's FLOPs: predicted "
                      f"{rec['published_predicted_tflops']:.0f}, measured {row.tflops:.0f})")
        records.append(rec)
    return {
        "title": "Megatron-LM Table 1 shapes planned on their published GPU counts",
        "description": (
            "Each GPT of Narayanan et al. 2021 (arXiv:2104.04473) Table 1, planned by `autopar.plan` over the full "
            "search space on dgx-a100-80g from its zoo string (cold, one process), and the paper's own "
            "configuration (its tp and pp, microbatch size 1, the interleaved schedule with 2 or 3 chunks, full "
            "recompute, fp16 with the gradients all-reduced in fp16 after the backward, as Megatron-LM then "
            "ran) predicted by `autopar.evaluate`, beside the teraFLOP/s per GPU the paper measured. "
            "Predicted and measured teraFLOP/s of the published configuration both count the paper's FLOPs "
            "(its equation 3, the recomputed forward included); autopar's plan is in its own count (forward "
            "and backward only)."),
        "params": {"cluster": CLUSTER, "rows": [r._asdict() for r in rows]},
        "table": {"columns": ["model", "GPUs", "batch", "plan s", "autopar's plan", "predicted TFLOP/s",
                              "published config", "its predicted TFLOP/s (paper's FLOPs)", "fits",
                              "published TFLOP/s", "ratio"],
                  "rows": [[r["model"], r["gpus"], r["batch"], round(r["plan_s"], 1), r["strategy"],
                            round(r["predicted_tflops"]), r["published"], round(r["published_predicted_tflops"]),
                            r["published_fits"], r["published_measured_tflops"], round(r["ratio"], 2)]
                           for r in records]},
        "records": records,
    }


def main(quick: bool = False, save_result: bool = True) -> dict[str, Any]:
    return timed_run(NAME, lambda: run(quick), quick, save_result=save_result, log=console.print)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the four smallest rows only")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    main(quick=args.quick, save_result=not args.no_save)


if __name__ == "__main__":
    cli()
