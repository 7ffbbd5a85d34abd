"""Manual strategies: the grammar of parse_strategy and the checks of check_config / evaluate."""
from __future__ import annotations

import pytest

import autopar
from autopar import ParallelConfig, StrategyError, parse_strategy
from autopar.api import as_graph
from autopar.cost import check_config, tp_valid_sizes

GPT4H = "gpt:layers=1,hidden=64,heads=4,seq=8,vocab=64"


@pytest.fixture(scope="module")
def gpt_graph():
    return as_graph(GPT4H)


# ------------------------------------------------------------------ grammar
def test_defaults():
    cfg = parse_strategy("tp=1")
    assert cfg == ParallelConfig(dp=1, tp=1, pp=1, microbatches=1, schedule="none", recompute="none", zero=0)
    assert parse_strategy("dp=4") == ParallelConfig(dp=4)


def test_inferred_dp():
    assert parse_strategy("tp=2", 8) == ParallelConfig(dp=4, tp=2)
    assert parse_strategy("microbatches=4", 8) == ParallelConfig(dp=8, microbatches=4)
    assert parse_strategy("tp=8", 8).dp == 1


def test_inferred_dp_not_dividing():
    with pytest.raises(StrategyError, match=r"tp=3.*does not divide 8 devices"):
        parse_strategy("tp=3", 8)


def test_whitespace_case_order_and_empty_items():
    assert parse_strategy(" TP = 2 , dp=2,, ", 4) == ParallelConfig(dp=2, tp=2)
    assert parse_strategy("recompute=FULL,zero=1,dp=2", 2) == ParallelConfig(dp=2, recompute="full", zero=1)


@pytest.mark.parametrize("text,expected", [
    ("data_parallel=2,model_parallel=4", ParallelConfig(dp=2, tp=4)),
    ("data=2,tensor=4", ParallelConfig(dp=2, tp=4)),
    ("tensor_parallel=4,micro_batch_num=8", ParallelConfig(dp=2, tp=4, microbatches=8)),
    ("dp=8,micro_batches=2", ParallelConfig(dp=8, microbatches=2)),
    ("dp=8,grad_accum=2", ParallelConfig(dp=8, microbatches=2)),
    ("dp=8,pipeline_stage=1", ParallelConfig(dp=8)),
])
def test_aliases(text, expected):
    assert parse_strategy(text, 8) == expected


def test_to_string_round_trips():
    cfg = ParallelConfig(dp=2, tp=4, microbatches=3, recompute="selective", zero=2)
    assert parse_strategy(cfg.to_string(), 8) == cfg


def test_unknown_key_lists_valid_keys():
    with pytest.raises(StrategyError) as ei:
        parse_strategy("dp=2,sq=2")
    msg = str(ei.value)
    assert "'sq'" in msg
    for key in ("dp", "tp", "pp", "microbatches", "schedule", "chunks", "recompute", "zero"):
        assert key in msg
    assert "micro_batch_num" in msg  # the aliases are listed too


def test_not_key_value():
    with pytest.raises(StrategyError, match=r"'dp2' is not key=value"):
        parse_strategy("dp2")


@pytest.mark.parametrize("text", ["", "   ", None])
def test_empty(text):
    with pytest.raises(StrategyError, match="empty strategy"):
        parse_strategy(text)


@pytest.mark.parametrize("text,key", [("dp=2,dp=2", "dp"), ("tp=2,model_parallel=2", "tp"),
                                      ("micro_batch_num=2,microbatches=2", "microbatches")])
def test_duplicates(text, key):
    with pytest.raises(StrategyError, match=f"'{key}' given twice"):
        parse_strategy(text)


@pytest.mark.parametrize("text,key,value", [("dp=two", "dp", "two"), ("tp=2.0", "tp", "2.0"),
                                            ("microbatches=", "microbatches", ""), ("zero=x", "zero", "x")])
def test_non_int(text, key, value):
    with pytest.raises(StrategyError, match=f"'{key}' needs an integer, got '{value}'"):
        parse_strategy(text)


@pytest.mark.parametrize("text,msg", [("dp=0", "'dp' must be >= 1, got 0"),
                                      ("tp=-1", "'tp' must be >= 1, got -1"),
                                      ("microbatches=0", "'microbatches' must be >= 1"),
                                      ("zero=-1", "'zero' must be >= 0")])
def test_below_minimum(text, msg):
    with pytest.raises(StrategyError, match=msg):
        parse_strategy(text)


def test_product_mismatch_names_both_numbers():
    with pytest.raises(StrategyError) as ei:
        parse_strategy("dp=2,tp=2", 8)
    msg = str(ei.value)
    assert "= 4 devices" in msg and "has 8" in msg


def test_pipeline_keys_and_defaults():
    cfg = parse_strategy("pp=2,tp=2", 8)
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.microbatches, cfg.schedule, cfg.chunks) == (2, 2, 2, 2, "1f1b", 1)
    cfg = parse_strategy("pipeline_stage=4,micro_batch_num=8,schedule=gpipe", 4)
    assert (cfg.pp, cfg.microbatches, cfg.schedule) == (4, 8, "gpipe")
    cfg = parse_strategy("pp=2,microbatches=4,schedule=interleaved", 2)
    assert (cfg.chunks, cfg.stages) == (2, 4)
    assert parse_strategy("pp=2,microbatches=6,schedule=interleaved,num_model_chunks=3", 2).chunks == 3
    for text in ("pp=2,microbatches=4,schedule=interleaved,chunks=2,recompute=none,zero=0",
                 "dp=2,tp=1,pp=2,microbatches=2,schedule=gpipe,recompute=full,zero=1"):
        cfg = parse_strategy(text)
        assert parse_strategy(cfg.to_string()) == cfg


def test_pipeline_rules_of_the_seeds():
    # MindFormers: micro_batch_num >= pipeline_stage
    with pytest.raises(StrategyError, match=r"micro_batch_num"):
        parse_strategy("pp=4,microbatches=2", 4)
    # Colossal-AI / Megatron: interleaving needs microbatches a multiple of the stages
    with pytest.raises(StrategyError, match=r"multiple"):
        parse_strategy("pp=4,microbatches=6,schedule=interleaved", 4)
    with pytest.raises(StrategyError, match=r"chunks"):
        parse_strategy("pp=2,microbatches=4,schedule=1f1b,chunks=2", 2)
    with pytest.raises(StrategyError, match=r"gpipe, 1f1b, interleaved"):
        parse_strategy("pp=2,schedule=zb", 2)


def test_schedule_needs_pp():
    with pytest.raises(StrategyError, match=r"schedule=1f1b needs a pipeline"):
        parse_strategy("dp=2,schedule=1f1b")
    with pytest.raises(StrategyError, match=r"chunks > 1 needs a pipeline"):
        parse_strategy("dp=2,chunks=2")
    assert parse_strategy("dp=2,schedule=none").schedule == "none"


@pytest.mark.parametrize("value", ["none", "selective", "full"])
def test_recompute_valid(value):
    assert parse_strategy(f"dp=1,recompute={value}").recompute == value


def test_recompute_invalid():
    with pytest.raises(StrategyError, match=r"recompute='partial' is invalid; valid: none, selective, full"):
        parse_strategy("recompute=partial")


@pytest.mark.parametrize("z", [0, 1, 2, 3])
def test_zero_valid(z):
    assert parse_strategy(f"dp=2,zero={z}").zero == z


def test_zero_invalid():
    with pytest.raises(StrategyError, match=r"zero=4 is invalid; valid stages: 0, 1, 2, 3"):
        parse_strategy("zero=4")


def test_executable():
    assert parse_strategy("dp=2,tp=2").executable
    assert parse_strategy("pp=2,tp=2", 4).executable
    assert parse_strategy("dp=2,zero=1").executable
    assert parse_strategy("dp=2,tp=2,recompute=full,zero=3,sequence_parallel=true,offload=optimizer").executable


def test_memory_option_keys_and_aliases():
    c = parse_strategy("dp=2,tp=2,accumulate=4,use_seq_parallel=true,precision=mixed,offload=optimizer,"
                       "zero_stage=2,overlap=false,bucket_mb=10", 4)
    assert (c.microbatches, c.sequence_parallel, c.precision, c.offload, c.zero, c.overlap, c.bucket_mb) == \
        (4, True, "bf16", "optimizer", 2, False, 10.0)
    assert parse_strategy(c.to_string(), 4) == c
    assert parse_strategy("dp=4").to_string() == "dp=4,tp=1,pp=1,microbatches=1,recompute=none,zero=0"
    for bad, words in [("tp=1,sequence_parallel=true", "tp > 1"), ("pp=2,accumulate=2", "pipeline"),
                       ("precision=fp32,reduce_dtype=bf16", "lower precision"), ("offload=all", "none, optimizer"),
                       ("bucket_mb=0", "> 0"), ("accumulate=2,microbatches=2", "not both"),
                       ("precision=fp8", "fp32, bf16, fp16"), ("overlap=maybe", "true or false")]:
        with pytest.raises(StrategyError, match=words):
            parse_strategy(bad)


def test_strategy_error_is_value_error():
    with pytest.raises(ValueError):
        parse_strategy("dp=x")


# ------------------------------------------------------------------ checks against a model
def test_tp_valid_sizes_heads(gpt_graph):
    assert tp_valid_sizes(gpt_graph) == [1, 2, 4]
    assert tp_valid_sizes(gpt_graph, limit=2) == [1, 2]


def test_tp_valid_sizes_without_attention():
    g = as_graph("mlp:layers=2,inp=12,hidden=24,classes=10")
    # widths of the hidden layers (24), not of the classifier output (10)
    assert tp_valid_sizes(g) == [1, 2, 3, 4, 6, 8, 12, 24]


def test_tp3_on_four_heads(gpt_graph):
    with pytest.raises(StrategyError) as ei:
        check_config(gpt_graph, ParallelConfig(dp=1, tp=3), 3, 3)
    msg = str(ei.value)
    assert "tensor parallel size 3" in msg and "attention heads" in msg
    assert "valid sizes: 1, 2, 4" in msg
    with pytest.raises(StrategyError, match="valid sizes: 1, 2, 4"):
        autopar.evaluate(gpt_graph, cluster="cpu", devices=3, strategy="tp=3", global_batch=3)


def test_global_batch_not_divisible(gpt_graph):
    with pytest.raises(StrategyError) as ei:
        autopar.evaluate(gpt_graph, cluster="cpu", devices=4, strategy="dp=2,tp=2,microbatches=2",
                         global_batch=6)
    msg = str(ei.value)
    assert "global batch 6" in msg and "dp=2 x microbatches=2 = 4" in msg
    with pytest.raises(StrategyError, match="global batch 3 is not divisible by dp=2"):
        check_config(gpt_graph, ParallelConfig(dp=2), 2, 3)
    with pytest.raises(StrategyError, match="global batch 0"):
        check_config(gpt_graph, ParallelConfig(dp=1), 1, 0)


def test_check_config_device_mismatch(gpt_graph):
    with pytest.raises(StrategyError, match=r"= 4 devices, but 8 were given"):
        check_config(gpt_graph, ParallelConfig(dp=2, tp=2), 8, 8)


def test_evaluate_strategy_device_mismatch(gpt_graph):
    with pytest.raises(StrategyError, match="has 8"):
        autopar.evaluate(gpt_graph, cluster="cpu", devices=8, strategy="dp=2,tp=2", global_batch=8)
    with pytest.raises(StrategyError, match="uses 4 devices, not 8"):
        autopar.evaluate(gpt_graph, cluster="cpu", devices=8, strategy=ParallelConfig(dp=2, tp=2),
                         global_batch=8)


def test_evaluate_valid(gpt_graph):
    est = autopar.evaluate(gpt_graph, cluster="cpu", devices=4, strategy="dp=2,tp=2,microbatches=2",
                           global_batch=8)
    assert est.strategy == "dp=2,tp=2,pp=1,microbatches=2,recompute=none,zero=0"
    assert est.parallel["tp"] == 2
