"""Smoke test of the pipeline cases of benchmarks/overhead.py and benchmarks/fidelity.py
on a tiny 4-layer GPT, in one spawn of 4 gloo processes: the native
``torch.distributed.pipelining`` baseline runs and its step-1 loss equals
autopar's, and the fidelity worker returns a measured schedule and per-rank
memory a summary can be built from. Structure only, no timings, nothing saved."""
from __future__ import annotations

import math

import pytest

from benchmarks import fidelity, overhead
from distributed import run_distributed

TINY = "gpt:layers=4,hidden=32,heads=4,seq=8,vocab=64"
OVERHEAD_RUNS = [("gpt", "pp=2,dp=2,microbatches=4,schedule=1f1b")]    # one pipeline: the suite's time budget
FIDELITY_RUNS = [("tiny", "pp=2,dp=2,schedule=1f1b,microbatches=4", 8)]


def _both(rank: int, world: int) -> tuple[dict, list[dict]]:
    ov = overhead._worker(rank, world, OVERHEAD_RUNS, {"warmup": 1, "rounds": 1, "block": 1}, {"gpt": TINY})
    fi = fidelity._worker(rank, world, FIDELITY_RUNS, "cpu", 1, {"tiny": TINY})
    return ov, fi


@pytest.fixture(scope="module")
def spawned():
    """One spawn for both tests: the overhead and fidelity pipeline cases, and the hf suite's."""
    return run_distributed(_all, 4, timeout=400)


def _all(rank: int, world: int) -> tuple[dict, list[dict], list[dict] | None]:
    ov, fi = _both(rank, world)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ov, fi, None
    return ov, fi, _hf(rank, world)


def test_pipeline_cases_run(spawned):
    res = [(ov, fi) for ov, fi, _ in spawned]
    for key in OVERHEAD_RUNS:
        r = res[0][0][key]
        # the benchmark fails beyond 1e-4; the same arithmetic on both sides lands far closer
        assert r["loss_native"] == pytest.approx(r["loss_autopar"], rel=1e-5)
        assert all(len(pr[0][key]["times"][side]) == 2 for pr in res for side in ("autopar", "native"))
        prof = r["profile"]
        assert prof["autopar"]["ops"]["send"]["count"] > 0 and prof["native"]["ops"]["send"]["count"] > 0
    per_rank = [pr[1][0] for pr in res]
    assert sorted(r["pipeline"]["pp_rank"] for r in per_rank) == [0, 0, 1, 1]
    s = fidelity._pipeline_summary(FIDELITY_RUNS[0], per_rank)
    assert "plot" not in s and s["layers"] == [2, 2]
    assert len(s["measured_rank_peak_bytes"]) == 2 and min(s["measured_rank_peak_bytes"]) > 0
    assert s["measured_makespan_s"] > 0 and 0 <= s["measured_bubble"] < 1 and s["predicted_makespan_s"] > 0
    assert len(s["measured_timeline"]["events"]) == 2 * 2 * 4      # pp ranks x (F, B) x microbatches
    assert all(math.isfinite(x) for x in s["measured_forward_s"] + s["measured_backward_s"])


TINY_HF = {
    "hf-gpt2": "hf-gpt2:n_layer=2,n_embd=32,n_head=4,vocab_size=64,seq=8",
    "hf-llama": ("hf-llama:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,"
                 "intermediate_size=64,vocab_size=64,seq=8"),
}
# one run (the suite's time budget): ZeRO-3 on an export graph, the family whose memory is measured
# differently (FSDP2's DTensors); sequence parallel on an export graph runs in tests/test_real_models.py
HF_RUNS = [("hf-llama", "dp=4,zero=3,microbatches=1", 8)]


def _hf(rank: int, world: int) -> list[dict]:
    return fidelity._worker(rank, world, HF_RUNS, "cpu", 1, TINY_HF)


def test_hf_suite_runs(spawned):
    """``--suite hf``: its cases cover every strategy family, and the worker runs tiny
    hf-gpt2 / hf-llama (torch.export graphs, the zoo's loss on the ModelOutput)."""
    pytest.importorskip("transformers")
    runs = fidelity.cases(True, "hf")
    strategies = {s for _, s, _ in runs}
    for family in ("dp=4,", "tp=4,", "dp=2,tp=2,microbatches=2", "sequence_parallel=true", "recompute=selective",
                   "recompute=full", "zero=1", "zero=2", "zero=3", "schedule=1f1b", "schedule=interleaved"):
        assert any(family in s for s in strategies), family
    assert {k for k, _, _ in runs} == set(fidelity.SUITES["hf"].specs)
    assert {k for k, s, _ in runs if "pp=" in s} == {"hf-gpt2-4l", "hf-llama-4l"}
    assert fidelity.cases(True) == fidelity.cases(True, "default")
    res = [hf for _, _, hf in spawned]
    for j, (key, strategy, gb) in enumerate(HF_RUNS):
        rows = [pr[j] for pr in res]
        assert all(r["model"] == key and r["global_batch"] == gb and r["pipeline"] is None for r in rows)
        assert all(r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 for r in rows)
        assert all(r["measured_peak_bytes"] > 0 and r["predicted_peak_bytes"] > 0 for r in rows)
    assert "zero=3" in res[0][0]["strategy"]
