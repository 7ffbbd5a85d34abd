"""The cost model against published numbers (``benchmarks/fidelity_published.py``,
issue 17), on the rows that are cheap to price: activation memory of GPT 22B at
tensor parallel 8 against Korthikanti et al. 2022, and GPT-3 175B on 384 A100
under PTD-P and ZeRO-3 against Narayanan et al. 2021 (Table 2 / Figure 10)."""
import warnings

import pytest

import autopar

from benchmarks.fidelity_published import PTDP, SIZES, T, ZERO3, activation_records, ptdp_records, ranking, \
    zero3_records


@pytest.fixture(scope="module")
def activations():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {r.what.split(", ", 1)[1]: r for r in activation_records(SIZES[:1])}


@pytest.fixture(scope="module")
def gpt175():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ptdp_records(PTDP[:1], "Table 2") + zero3_records(ZERO3[:1])


@pytest.mark.parametrize("setting", ["tensor parallel", "tensor + sequence parallel",
                                     "full recompute + sequence parallel", "full recompute, Megatron's placements"])
def test_activation_memory_within_ten_percent_of_korthikanti(activations, setting):
    assert activations[setting].within, activations[setting]


def test_activation_memory_where_the_runtime_keeps_more_than_megatron(activations):
    """The rows off the formula are off by what autopar's runtime keeps and
    Megatron does not (the notes of the benchmark): pinned, so that a change of
    the model or a fix of the runtime shows here."""
    # the checkpoint keeps the residual stream as placed between layers: split over the hidden dim by
    # autopar's tp=8 placements, whole (2 sbh) with Megatron's (the residual stream pinned replicated)
    assert activations["full recompute"].ratio == pytest.approx(1 / T, rel=0.02)
    assert activations["full recompute, Megatron's placements"].ratio == pytest.approx(1.0, rel=0.02)
    # selective keeps the layer input, q, k, v, attention and the first MLP linear, all split
    # (18 sbh / t), and runs the row-parallel matmuls again (it kept their partial outputs whole, 2 x 2 sbh
    # more, before issue 17): less than Megatron's, which keeps all that no recompute keeps (32 sbh / t
    # without the dropout masks, the attention output being the projection's input on a GPU)
    sel = activations["selective recompute + sequence parallel"]
    assert sel.ratio == pytest.approx((18 / T) / (32 / T), rel=0.02)
    assert sel.predicted < activations["tensor + sequence parallel"].predicted


@pytest.mark.parametrize("group", ["PTD-P", "ZeRO-3"])
def test_gpt175_on_384_gpus_within_ten_percent(gpt175, group):
    row = next(r for r in gpt175 if r.group == group)
    assert row.within, row


def test_ptdp_beats_zero3_at_175b_on_384_gpus_as_published(gpt175):
    """The paper measured ZeRO-3 6% behind PTD-P here. The model put it 2%
    ahead until it charged FSDP2's copies around each unit's collectives (the
    gathered buffer split into the parameters, the gradients packed for the
    reduce-scatter: memory-bound kernels beside the compute); now it is
    behind, by less than measured."""
    rank = ranking(gpt175)
    assert rank["published"] == "PTD-P"
    assert rank["predicted"] == rank["published"]


def test_zero3_pays_fsdp2s_copies_where_the_compute_is_the_longer(monkeypatch):
    """GPT-3 175B on 384 A100 under ZeRO-3 is compute-bound per unit (a
    layer's forward and backward outlast its gathers): each unit's copies
    (two copy-outs of its gathered weights, a copy-in of its gradients, all
    read and written at the device's streaming bandwidth) add to the step
    about their time, units times microbatches."""
    from autopar.cost import CostModel
    from benchmarks.fidelity_published import GPT175, Row, graph

    row = Row("175B", tp=1, pp=1, gpus=384, batch=1536, tflops=144, **GPT175)
    cfg = "dp=384,microbatches=1,zero=3,recompute=full,precision=bf16"

    def step():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.evaluate(graph(row.spec), cluster="dgx-a100-80g", devices=384, global_batch=1536,
                                    strategy=cfg).step_time_s

    with_copies = step()
    monkeypatch.setattr(CostModel, "_fsdp_copies", lambda self, elems, pb, gb: (0.0, 0.0))
    without = step()
    # a layer of 12 h^2 weights, bf16 gathers (2 bytes), fp32 gradients (4): 2 x 2 x 2 + 2 x 4 bytes an element
    layer = 12 * 12288 ** 2
    copies = 96 * layer * (8 + 8) / (2039e9 * 0.8)
    assert with_copies - without == pytest.approx(copies, rel=0.1)


def test_table1_rows_without_a_pipeline_within_ten_percent_as_the_paper_ran_them():
    """Megatron-LM Table 1's four smallest GPTs (dp x tp, no pipeline) in the
    paper's configuration: fp16, the gradients all-reduced in fp16 after the
    backward, as Megatron-LM's DDP then did. Priced as bf16 with fp32
    gradients reduced during the backward, the 7.5B and 18B rows were 14%
    and 10% slow (the all-reduce of fp32 gradients over the 25 GB/s NIC is
    15% of their step)."""
    from benchmarks.megatron_table1 import PAPER_PRECISION, TABLE1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = ptdp_records(TABLE1[:4], "Table 1")
    assert all(PAPER_PRECISION in r.config for r in rows)
    assert all(r.within for r in rows), [(r.what, round(r.ratio, 3)) for r in rows]


def test_llama3_405b_on_its_published_schedule_within_ten_percent():
    """Llama 3's interleaved schedule: 8 one-layer model chunks per rank, the
    embedding alone in the first and the head alone in the last (126 layers
    + 2 = 16 x 8): within 10% of the 430 TFLOP/s per GPU measured on 8192 H100."""
    from benchmarks.fidelity_published import LLAMA405, LLAMA_CLUSTER, LLAMA_RUNS, graph
    gpus, cfg, published = LLAMA_RUNS[0]
    assert "chunks=8" in cfg and "recompute" not in cfg
    est = autopar.evaluate(graph(LLAMA405), cluster=LLAMA_CLUSTER, devices=gpus, global_batch=2048, strategy=cfg)
    layers = est.pipeline["layers"]
    assert len(layers) == 128 and layers[0] == layers[-1] == 0 and set(layers[1:-1]) == {1}
    assert est.tflops_per_device == pytest.approx(published, rel=0.1)
