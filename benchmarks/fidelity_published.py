"""The cost model against published measurements (issue 17, "honest costs").

Every row is a number a paper measured or derived, the source (paper, table
or figure), autopar's prediction of the same quantity, and their ratio
(predicted / published). The target is a ratio within 10%.

* **Megatron-LM PTD-P**, Narayanan et al. 2021 ("Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473)
  Table 1: the ten GPT shapes of :data:`benchmarks.megatron_table1.TABLE1` in
  their published configuration (see :class:`~benchmarks.megatron_table1.Row`).
* **PTD-P against ZeRO-3**, the same paper, Section 5.2: Figure 10 plots and
  Table 2 lists the teraFLOP/s per GPU of GPT-3 175B and the 530B model, ZeRO-3
  without model parallelism (microbatch 4, 2, 1 as the GPUs double, one
  microbatch per step) against PTD-P (tensor 8 x pipeline 12 and 8 x 35,
  microbatch 1). Both count FLOPs with the paper's equation 3 (recompute
  included), as the Table 1 rows do; all run full recompute on
  ``dgx-a100-80g``. The PTD-P rows run as Megatron-LM ran them then
  (:data:`~benchmarks.megatron_table1.PAPER_PRECISION`: fp16, the gradients
  all-reduced in fp16 after the backward). The ZeRO-3 rows are priced in
  bf16 (two gathers of 2 bytes per element and a reduce-scatter of 4), which
  moves what DeepSpeed's fp16 ZeRO-3 moves under activation checkpointing
  (its units are gathered again for the recompute and once more for the
  backward: three gathers of 2 bytes and a reduce-scatter of 2); autopar's
  FSDP2 gathers twice, so in fp16 these rows would be 7-43% fast.
* **Activation memory**, Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", arXiv:2205.05198) Table 2: bytes
  per transformer layer for GPT 22B, 175B and 530B at tensor parallel 8,
  sequence 2048, microbatch 1, measured as the difference of autopar's
  ``activations`` between models of 3 and 2 layers. The paper's formulas
  assume dropout and an attention that stores its score matrices; the zoo's
  GPT has neither (``scaled_dot_product_attention``, no dropout), so the
  comparison uses the paper's own per-tensor accounting (its Section 4.1)
  for that model: without the two dropout masks (-2 sbh) and the attention
  core (-5as^2b); the attention output ``O`` that fused attention keeps
  for its backward is the projection's input (fused attention writes its
  output in its query's layout, sequence-major here, so the GPT's
  ``.transpose(1, 2).contiguous()`` copies nothing; measured on an H200 and
  checked against autograd's saved storages on the CPU). Its 34 sbh become
  32 sbh, ``10 + 24/t``
  becomes ``8 + 24/t``, ``34/t`` becomes ``32/t``; selective
  recompute (the paper's: the attention core only) then saves nothing more
  than sequence parallel; full recompute keeps the layer input, 2 sbh, or
  2 sbh/t when sequence parallel splits it. (Fused attention's float32 row
  statistics, 4as b bytes, are 1/32 sbh at h/a = 128 and left out of both.)
* **Llama 3 405B**, Llama Team 2024 ("The Llama 3 Herd of Models",
  arXiv:2407.21783) Table 4: TP 8, PP 16, DP 64 on 8192 H100 (sequence 8192,
  32 sequences per dp rank, 2048 per batch), 430 teraFLOP/s per GPU (43% BF16
  MFU, model FLOPs, as autopar counts them), and DP 128 on 16,384 H100 (16
  sequences per dp rank), 400 teraFLOP/s (41%); Section 3.3.2 says it trained
  without activation checkpointing, on an interleaved schedule whose first
  model chunk on the first stage holds only the embedding and whose last
  model chunk on the last stage holds only the output projection and the
  loss, one layer taken from each: 126 layers + 2 = 128 model chunks = 16
  ranks x 8 chunks of one layer (``chunks=8``; the stage balance puts the
  embedding and the head alone, as ``even_layers`` does with more stages
  than layers). On ``dgx-h100`` with sequence parallel and
  the optimizer state sharded over dp (as its FSDP does). What the model keeps
  per layer and microbatch at t = 8 with sequence parallel is 42.5 sbh/t
  bytes (bf16), tensor by tensor what autograd saves for the zoo Llama as
  written, in the Hugging Face manner: the two norms' inputs and those of the
  qkv and first MLP linears, q, the attention output (the output linear's
  input: the same storage), and k and v
  *expanded to every query head* before attention (``repeat_kv``), 2 sbh/t
  each (unexpanded grouped-query k and v would be 2/16); RoPE's constant
  tables (1/2); the unfused SwiGLU's gate, SiLU, up projection and product
  (6.5 sbh/t each at ffn = 3.25 h). A Megatron-style layer (k and v at 1/16,
  the SwiGLU fused so that its SiLU is recomputed) keeps 34.25 sbh/t. Even
  that, on the first rank holding 142 one-layer chunks of a microbatch in
  flight (Megatron's interleaved warm-up with 16 ranks and 8 chunks), is
  about 76 GiB of activations beside about 20 GiB of model states: the
  paper's claim needs fewer microbatches in flight than that warm-up keeps
  (its schedule's tunable ``N``) or a layer that keeps less, and it does not
  say which.

    python -m benchmarks.fidelity_published [--quick]
"""
from __future__ import annotations

import argparse
from functools import lru_cache
from typing import Any, NamedTuple

from rich.console import Console

import autopar
from autopar.api import as_graph, planner_for
from autopar.search.planner import Sharder
from autopar.spec import parse_strategy

from .common import timed_run
from .megatron_table1 import CLUSTER, PAPER_OPTIMIZER, TABLE1, Row, paper_tflops

NAME = "fidelity_published"
TARGET = 0.10
NARAYANAN = "Narayanan et al. 2021"
console = Console(stderr=True, highlight=False, soft_wrap=True)


class Record(NamedTuple):
    group: str
    what: str
    source: str
    config: str
    published: float
    predicted: float
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TARGET


GPT175 = dict(heads=96, hidden=12288, layers=96)
GPT530 = dict(heads=128, hidden=20480, layers=105)

# Narayanan et al. 2021 Table 2 (Figure 10): (model, GPUs, batch, microbatch size, TFLOP/s per GPU)
ZERO3 = [(GPT175, "175B", 384, 1536, 4, 144), (GPT175, "175B", 768, 1536, 2, 88),
         (GPT175, "175B", 1536, 1536, 1, 44), (GPT530, "530B", 640, 2560, 4, 138),
         (GPT530, "530B", 1120, 2240, 2, 98), (GPT530, "530B", 2240, 2240, 1, 48)]
PTDP = [Row("175B", tp=8, pp=12, gpus=g, batch=1536, tflops=t, **GPT175) for g, t in ((384, 153), (768, 149),
                                                                                      (1536, 141))] + \
       [Row("530B", tp=8, pp=35, gpus=g, batch=2240, tflops=t, **GPT530) for g, t in ((560, 171), (1120, 167),
                                                                                      (2240, 159))]

LLAMA405 = "llama:layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,seq=8192"
LLAMA_CLUSTER = "dgx-h100"
# Llama Team 2024, Table 4: (GPUs, configuration, TFLOP/s per GPU)
LLAMA_PLAN = "tp=8,pp=16,sp=true,zero=1,schedule=interleaved,chunks=8,precision=bf16"
LLAMA_RUNS = [
    (8192, f"dp=64,{LLAMA_PLAN},microbatches=32", 430.0),
    (16384, f"dp=128,{LLAMA_PLAN},microbatches=16", 400.0),
    # what fits 80 GB under this model: the same plan with selective recompute
    (8192, f"dp=64,{LLAMA_PLAN},microbatches=32,recompute=selective", 430.0),
    (16384, f"dp=128,{LLAMA_PLAN},microbatches=16,recompute=selective", 400.0)]

# Korthikanti et al. 2022 Table 2 at t = 8: (setting, strategy, their formula, sbh coefficient for the zoo GPT, note)
T = 8
ACTIVATION = [
    ("tensor parallel", "", "sbh(10 + 24/t + 5as/(ht))", 8 + 24 / T, ""),
    ("tensor + sequence parallel", ",sp=true", "sbh(34/t + 5as/(ht))", 32 / T, ""),
    ("selective recompute + sequence parallel", ",sp=true,recompute=selective", "sbh 34/t", 32 / T,
     "autopar's selective keeps the outputs of the weight matmuls and attention that a backward of the layer "
     "needs (q, k, v, attention, the first MLP linear: 18/t sbh with the layer input) and runs the rest again, "
     "the row-parallel GEMMs included; Megatron's recomputes only the attention core, which fused attention "
     "never stores, so it keeps what no recompute keeps (before issue 17 autopar kept every weight matmul's "
     "output, the row-parallel ones whole: 1.47x)"),
    ("full recompute", ",recompute=full", "2 sbh", 2.0,
     "autopar's tp=8 placements keep the residual stream split over the hidden dimension between layers "
     "(the compiled program reduce-scatters each row-parallel output and gathers before each norm), so the "
     "checkpoint keeps 2 sbh/t; Megatron without sequence parallel keeps it whole. The propagation picks it "
     "for time: the bias and residual adds run on 1/t for half a gather more per layer in backward"),
    ("full recompute + sequence parallel", ",sp=true,recompute=full", "2 sbh/t", 2.0 / T, ""),
    ("full recompute, Megatron's placements", ",recompute=full", "2 sbh", 2.0,
     "the row above with the residual stream pinned replicated (every norm's input R), as Megatron without "
     "sequence parallel places it: the model's memory for the paper's plan"),
]
#: settings priced with the residual stream pinned replicated (Megatron without sequence parallel)
MEGATRON_RESIDUAL = {"full recompute, Megatron's placements"}
KORTHIKANTI = "Korthikanti et al. 2022, Table 2"
SIZES = [("22B", 64, 6144), ("175B", 96, 12288), ("530B", 128, 20480)]


NOTES = [
    "Megatron-LM's teraFLOP/s count the recomputed forward (four passes); compared on autopar's own count "
    "(three) the PTD-P rows looked 25% slow (90-107 against 135-163 in `megatron_table1` before).",
    "PTD-P runs as the paper ran it: fp16, whose gradients Megatron-LM's DDP of the time kept and all-reduced "
    "in fp16 (fp32 only where bf16 forces it, which came after the paper), after the backward of the last "
    "microbatch. Priced as bf16 with fp32 gradients reduced during the backward (before), Table 1's rows "
    "without a pipeline were 0.86 (7.5B) and 0.90 (18B); now every PTD-P row is within 10%.",
    "ZeRO-3 is 3-14% fast. The comm-bound rows (768 and more GPUs) fix the product of volume and bandwidth: "
    "they are priced in bf16, two gathers and one fp32 reduce-scatter per unit at the 25 GB/s NIC of each GPU, "
    "which is the volume of DeepSpeed's fp16 ZeRO-3 under activation checkpointing (three gathers, the "
    "recompute's included, and an fp16 reduce-scatter); a ring using all 8 NICs of a node would make them "
    "several times faster than measured. In fp16 with FSDP2's two gathers, as autopar would run them, they "
    "are 7-43% fast: autopar's runtime gathers less than the measured system. The compute-bound rows (microbatch 4) "
    "pay FSDP2's copies around each unit's collectives (the gathered buffer split into the parameters twice, "
    "the gradients packed for the reduce-scatter once: 2.7% of the step at 175B; 6% and 11% fast before).",
    "At 175B on 384 GPUs the paper measured ZeRO-3 6% behind PTD-P; the model now ranks it behind too, by "
    "0.2% (2% ahead before FSDP2's copies were charged): the ranking is right, the gap inside the error of "
    "the two rows.",
    "Activation memory matches Korthikanti's accounting where the runtime keeps what Megatron keeps (tensor "
    "parallel; sequence parallel, since the runtime keeps the column-parallel linears' input as its sequence "
    "shard and gathers it again in backward, as Megatron does: 1.82x before; full recompute with sequence "
    "parallel; full recompute with Megatron's placements, the residual stream pinned replicated). Selective "
    "recompute and full recompute under autopar's own tp=8 placements differ by what autopar's policy and "
    "placements keep (notes column), which the model counts: selective keeps less than Megatron's (it also "
    "runs norms, activations and the attention projection's GEMM again), never more than no recompute; "
    "the hidden-split residual stream keeps 1/t of Megatron's checkpoint.",
    "Llama 3 405B on its published schedule (Section 3.3.2: interleaved, the first model chunk holding only the "
    "embedding and the last only the head, so 8 one-layer chunks per rank: `chunks=8`) is within 10% at both "
    "scales without recompute: 446 TFLOP/s per GPU against 430 on 8192 H100 (1.04, bubble 8%) and 379 against "
    "400 on 16,384 (0.95, 16 microbatches: bubble 13%). Until the model allowed stages holding only the "
    "embedding or the head (more stages than layers), the rows guessed the schedule: 1F1B at 0.77 (bubble 32%) "
    "and 2 chunks at 0.92 (18%) on 8192, 0.77 on 16,384; the dgx-h100 preset's matmul efficiency is measured "
    "(0.66: `benchmarks/layer_gpu.py` timed one tp=8 rank's 405B layer on an H100 at 601 TFLOP/s, predicted "
    "3.4% slow). The memory still contradicts the paper: without recompute the first rank holds 142 one-layer "
    "chunks of a microbatch in flight (Megatron's interleaved warm-up), 94 GiB of activations at 42.5 sbh/t "
    "bytes per layer (the zoo Llama as Hugging Face writes it: k and v expanded to every head by repeat_kv, "
    "4 sbh/t, and the unfused SwiGLU's four 3.25h-wide tensors, 26 sbh/t; a Megatron-style layer keeps 34.25) "
    "beside 20 GiB of model states; the paper's claim needs fewer microbatches in flight than Megatron's "
    "interleaved warm-up (its schedule's tunable N) or a layer that keeps less, and it does not say which. "
    "With selective recompute the plan fits (62 and 58 GiB) at 0.91 and 0.84: a layer's cheap ops and the "
    "attention projection's GEMM (its output feeds the second norm) run again, 15% of a layer's forward, and "
    "torch's selective-checkpoint dispatch mode adds 43 us of host time per op in the forward and again in the "
    "recompute (measured on an H200); Megatron's selective recompute runs only the attention core again.",
]


@lru_cache(maxsize=None)
def graph(spec: str):
    """The traced graph of a zoo string, once per run (evaluating on it takes milliseconds)."""
    return as_graph(spec)


def ptdp_records(rows: list[Row], source: str) -> list[Record]:
    """PTD-P rows in their published configuration, on the paper's FLOP count."""
    out = []
    for row in rows:
        est = autopar.evaluate(graph(row.spec), cluster=CLUSTER, devices=row.gpus, global_batch=row.batch,
                               strategy=row.published, optimizer=PAPER_OPTIMIZER)
        out.append(Record("PTD-P", f"GPT {row.name} on {row.gpus} A100", source, row.published, row.tflops,
                          paper_tflops(row.flops(), est.step_time_s, row.gpus), "TFLOP/s per GPU"))
    return out


def zero3_records(rows: list = ZERO3) -> list[Record]:
    """ZeRO-3 without model parallelism, one microbatch per step, full recompute."""
    out = []
    for shape, name, gpus, batch, mbs, tflops in rows:
        row = Row(name, tp=1, pp=1, gpus=gpus, batch=batch, tflops=tflops, **shape)
        cfg = f"dp={gpus},microbatches={batch // (gpus * mbs)},zero=3,recompute=full,precision=bf16"
        # DeepSpeed's ZeRO-3 steps with its own fused Adam, as Megatron-LM with apex's
        est = autopar.evaluate(graph(row.spec), cluster=CLUSTER, devices=gpus, global_batch=batch, strategy=cfg,
                               optimizer=PAPER_OPTIMIZER)
        out.append(Record("ZeRO-3", f"GPT {name} on {gpus} A100, microbatch {mbs}",
                          f"{NARAYANAN}, Table 2 / Figure 10", cfg, tflops,
                          paper_tflops(row.flops(), est.step_time_s, gpus), "TFLOP/s per GPU"))
    return out


def layer_activations(heads: int, hidden: int, strategy: str, seq: int = 2048,
                      replicated_residual: bool = False) -> float:
    """Bytes of activations one more layer adds on a device (3 layers minus
    2); ``replicated_residual``: with every norm's input pinned replicated."""
    acts = []
    for layers in (2, 3):
        g = graph(f"gpt:layers={layers},hidden={hidden},heads={heads},seq={seq},vocab=51200")
        if replicated_residual:
            pins = tuple(sorted({(nd.inputs[0], "R") for nd in g.nodes if nd.kind == "layernorm"}))
            planner = planner_for(g, CLUSTER, "adamw", None, devices=T, global_batch=1)
            est = planner.evaluate(parse_strategy(strategy, devices=T), Sharder(pins=pins), layers="even")
        else:
            est = autopar.evaluate(g, cluster=CLUSTER, devices=T, global_batch=1, strategy=strategy)
        acts.append(est.memory["activations"])
    return acts[1] - acts[0]


def activation_records(sizes: list = SIZES) -> list[Record]:
    """Per-layer activation memory against Korthikanti's accounting for the zoo GPT (module docstring)."""
    out = []
    for name, heads, hidden in sizes:
        sbh = 2048 * hidden
        for setting, extra, formula, coeff, note in ACTIVATION:
            cfg = f"dp=1,tp={T},microbatches=1,precision=bf16{extra}"
            out.append(Record("activation memory", f"GPT {name}, {setting}", f"{KORTHIKANTI} ({formula})", cfg,
                              coeff * sbh / 2**20,
                              layer_activations(heads, hidden, cfg, replicated_residual=setting in MEGATRON_RESIDUAL)
                              / 2**20,
                              "MiB per layer", note))
    return out


def llama_records() -> list[Record]:
    """Llama 3 405B's published plan: throughput, and whether it fits."""
    out = []
    for gpus, cfg, tflops in LLAMA_RUNS:
        est = autopar.evaluate(graph(LLAMA405), cluster=LLAMA_CLUSTER, devices=gpus, global_batch=2048,
                               strategy=cfg)
        note = (f"peak {est.peak_memory_bytes / 2**30:.0f} GiB per GPU (activations "
                f"{est.memory['activations'] / 2**30:.0f} GiB), {'fits' if est.fits else 'does not fit'} 80 GB; "
                f"bubble {est.pipeline['bubble_fraction']:.0%}")
        # the published plan, and the same with selective recompute: what fits 80 GB under this model
        group = "Llama 3" if "recompute" not in cfg else "Llama 3, selective recompute to fit"
        out.append(Record(group, f"Llama 3 405B on {gpus} H100", "Llama Team 2024, Table 4", cfg, tflops,
                          est.tflops_per_device, "TFLOP/s per GPU (model FLOPs)", note))
    return out


def ranking(records: list[Record]) -> dict[str, Any]:
    """ZeRO-3 against PTD-P at 175B on 384 GPUs, published and predicted."""
    z = next(r for r in records if r.group == "ZeRO-3" and r.what.startswith("GPT 175B on 384 "))
    p = next(r for r in records if r.group == "PTD-P" and r.what == "GPT 175B on 384 A100")
    return {"published": "PTD-P" if p.published > z.published else "ZeRO-3",
            "predicted": "PTD-P" if p.predicted > z.predicted else "ZeRO-3",
            "ZeRO-3 / PTD-P published": z.published / p.published,
            "ZeRO-3 / PTD-P predicted": z.predicted / p.predicted}


def run(quick: bool = False) -> dict[str, Any]:
    records = activation_records(SIZES[:1] if quick else SIZES)
    records += ptdp_records(PTDP[:1] if quick else PTDP, f"{NARAYANAN}, Table 2 / Figure 10")
    records += zero3_records(ZERO3[:1] if quick else ZERO3)
    if not quick:
        records += ptdp_records(TABLE1, f"{NARAYANAN}, Table 1")
        records += llama_records()
    for r in records:
        console.print(f"{r.group:>17}  {r.what:<58} published {r.published:8.1f}  predicted {r.predicted:8.1f}  "
                      f"{r.ratio:5.2f}{'' if r.within else '  *'}")
    rank = ranking(records)
    by_group: dict[str, list[Record]] = {}
    for r in records:
        by_group.setdefault(r.group, []).append(r)
    summary = {f"{g}: rows within {TARGET:.0%}": f"{sum(r.within for r in rs)} of {len(rs)}"
               for g, rs in by_group.items()}
    summary["175B on 384 GPUs, faster (published / predicted)"] = f"{rank['published']} / {rank['predicted']}"
    return {
        "title": "The cost model against published measurements",
        "description": (
            "Published numbers with their source beside autopar's prediction of the same quantity, and the ratio "
            "predicted / published (target: within 10%). Megatron-LM rows count the paper's FLOPs (equation 3, "
            "recompute included) over the predicted step time; activation memory compares with Korthikanti et "
            "al.'s per-tensor accounting for the zoo GPT (fused attention, no dropout: see the module docstring "
            "of `benchmarks/fidelity_published.py`); Llama 3 counts model FLOPs, as its MFU does."),
        "params": {"cluster": CLUSTER, "llama_cluster": LLAMA_CLUSTER, "target": TARGET},
        "summary": summary,
        "ranking": rank,
        "notes": NOTES,
        "table": {"columns": ["group", "what", "source", "configuration", "unit", "published", "predicted",
                              "ratio", "note"],
                  "rows": [[r.group, r.what, r.source, r.config, r.unit, round(r.published, 1),
                            round(r.predicted, 1), round(r.ratio, 2), r.note] for r in records]},
        "records": [dict(r._asdict(), ratio=r.ratio, within=r.within) for r in records],
    }


def main(quick: bool = False, save_result: bool = True) -> dict[str, Any]:
    return timed_run(NAME, lambda: run(quick), quick, save_result=save_result, log=console.print)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one row of each group but Table 1 and Llama 3")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    main(quick=args.quick, save_result=not args.no_save)


if __name__ == "__main__":
    cli()
