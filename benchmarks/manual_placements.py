"""Manual tensor parallelism on published checkpoints: the greedy's placements against the ILP's.

A manual strategy (``dp=16,tp=4``, as Megatron-LM users write it) is priced
and run with the placements of the greedy propagation
(:mod:`autopar.search.propagate`); given ``search_mode="dynamic_programming"``
the per-op ILP decides the placements on the same mesh. This benchmark builds
published Hugging Face checkpoints from their own ``config.json`` (the
``hf:PATH`` model string, every field as published, no weights) at full
depth, and prices one manual strategy both ways, with each model's default
attention kernel (``sdpa``) and with the scores written out (``eager``,
as Gemma 2 runs for its soft-capping, and has no other kernel); predictions
only.

The ratio greedy / ILP is what a manual strategy gives up against the
searched placements on the same mesh (1.0: the same time). This benchmark
run at commit b12ad06, before two changes of the greedy (e59232d: the
look-ahead of an op that slices its inputs; 5a2c3bb: vectors weigh as
tie-breaks), gave with eager attention Llama 3.1 8B 1.78x, Gemma 2 9B 1.67x
(7.71 s), Mistral 7B 1.80x, Qwen3 8B 1.83x, Phi-3 mini 1.88x (every tp rank
computed the whole attention; Gemma 2's norms also split their gains), and
Qwen2.5 7B 1.03x; with sdpa 1.15x, 1.15x, 1.23x, 1.13x and 1.04x (Qwen2.5:
its k and v biases, split for memory before, are now added after an
all-reduce, 3.7% slower).

Run: ``python -m benchmarks.manual_placements [--quick]``; results in
``benchmarks/results/manual_placements-<device>.json`` and its README section.
"""
from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import autopar
from autopar.errors import ZooError
from benchmarks.common import each_case, quick_cli, timed_run

CLUSTER, DEVICES, BATCH, SEQ = "dgx-h100", 64, 512, 2048
STRATEGY = "dp=16,tp=4,microbatches=32,zero=1,precision=bf16"

# config.json fields of the published checkpoints (the fields that shape the model; the rest default)
CONFIGS: dict[str, dict[str, Any]] = {
    "Llama 3.1 8B": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "vocab_size": 128256,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False},
    "Gemma 2 9B": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
        "intermediate_size": 14336, "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "head_dim": 256, "max_position_embeddings": 8192, "vocab_size": 256000, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "Mistral 7B v0.3": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "Qwen2.5 7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "vocab_size": 152064, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False},
    "Qwen3 8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "Phi-3 mini": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "vocab_size": 32064,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
QUICK = ["Gemma 2 9B"]
KERNELS = ("sdpa", "eager")


def row(name: str, root: Path) -> dict[str, Any]:
    """One checkpoint, both attention kernels: the greedy's and the ILP's placements on one mesh."""
    where = root / name.replace(" ", "_")
    where.mkdir(exist_ok=True)
    (where / "config.json").write_text(json.dumps(CONFIGS[name]))
    out: dict[str, Any] = {"case": name, "layers": CONFIGS[name]["num_hidden_layers"]}
    for kernel in KERNELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                graph = autopar.trace(f"hf:{where},seq={SEQ},attn_implementation={kernel}")
            except ZooError as e:       # a kernel the model has not (Gemma 2: no sdpa)
                out[kernel] = {"error": str(e)}
                continue
            kw = dict(cluster=CLUSTER, devices=DEVICES, global_batch=BATCH, strategy=STRATEGY)
            greedy = autopar.plan(graph, **kw).predicted
            ilp = autopar.plan(graph, search_mode="dynamic_programming", **kw).predicted
        out[kernel] = {
            "greedy_s": greedy["step_time_s"], "ilp_s": ilp["step_time_s"],
            "ratio": greedy["step_time_s"] / ilp["step_time_s"],
            "greedy_gib": greedy["peak_memory_bytes"] / 2**30, "ilp_gib": ilp["peak_memory_bytes"] / 2**30}
    return out


def run(keys: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = each_case(keys, lambda k: row(k, Path(tmp)))
    ok = [r for r in rows if "error" not in r]
    ratios = {k: [r[k]["ratio"] for r in ok if "ratio" in r[k]] for k in KERNELS}
    return {
        "title": "Manual tensor parallelism on published checkpoints: the greedy's placements against the ILP's",
        "description": " ".join(__doc__.split("\n\n")[i].replace("\n", " ") for i in (1, 2)),
        "params": {"cluster": CLUSTER, "devices": DEVICES, "global_batch": BATCH, "seq": SEQ,
                   "strategy": STRATEGY, "models": keys},
        "table": {
            "columns": ["model", "layers", "kernel", "greedy s", "ILP s", "greedy / ILP", "greedy GiB", "ILP GiB"],
            "rows": [[r["case"], r["layers"], k, r[k]["greedy_s"], r[k]["ilp_s"], r[k]["ratio"],
                      r[k]["greedy_gib"], r[k]["ilp_gib"]] for r in ok for k in KERNELS if "ratio" in r[k]],
        },
        "summary": {f"{k}: worst greedy / ILP": max(v, default=None) for k, v in ratios.items()} |
                   {f"{k}: mean greedy / ILP": sum(v) / len(v) if v else None for k, v in ratios.items()} |
                   {"cases": len(ok), "errors": len(rows) - len(ok)},
        "records": rows,
    }


def main(quick: bool = False, save_result: bool = True) -> dict[str, Any]:
    keys = QUICK if quick else list(CONFIGS)
    return timed_run("manual_placements", lambda: run(keys), quick, save_result)


def cli() -> None:
    quick_cli("benchmarks.manual_placements", __doc__, QUICK, main)


if __name__ == "__main__":
    cli()
