"""Manual strategies: the grammar of parse_strategy and the checks of check_config / evaluate."""
from __future__ import annotations

import dataclasses
import json

import pytest

import autopar
from autopar import ParallelConfig, StrategyError, parse_strategy
from autopar.spec import ALIASES, FIELDS, KEYS, Key, describe, key
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


# ------------------------------------------------------------------ the per-key descriptions
PIPE = ParallelConfig(dp=1, tp=2, pp=2, microbatches=4, schedule="1f1b", precision="bf16")
FLAT = ParallelConfig(dp=2, tp=2, precision="bf16")


def _values(k: Key) -> list:
    """Every allowed value of key ``k`` (a few for numbers)."""
    if k.type is bool:
        return [True, False]
    if k.choices:
        return [k.default, *k.choices] if k.default not in k.choices else list(k.choices)
    if k.type is int:
        return [k.minimum, k.minimum + 1, k.minimum + 3]
    return [k.minimum + 0.5, 10.0, k.default, 100.25]


def _grid_extra(name: str, value) -> dict:
    """The tp (and depth) a tp_mode / tp_depth value needs: a square, depth x q^2, a cube."""
    if name == "tp_mode":
        return {"1d": {}, "2d": {"tp": 4}, "2.5d": {"tp": 8, "tp_depth": 2}, "3d": {"tp": 8}, "mesh": {"tp": 4},
                "mesh3": {"tp": 8}}[value]
    if name == "tp_depth" and value > 1:
        return {"tp_mode": "2.5d", "tp": 4 * value}
    return {}


def _configs(k: Key):
    """Configs with key ``k`` at each of its values and valid for the grammar (on a pipeline or not)."""
    for value in _values(k):
        ok = []
        for base in (PIPE, FLAT):
            if k.pipeline and base.pp == 1 and value != k.default:
                continue            # pipeline keys are meaningless (and not written) without one
            extra = {"chunks": 2} if (k.name, value) == ("schedule", "interleaved") else \
                {"schedule": "interleaved"} if k.name == "chunks" and value > 1 else \
                {"schedule": "1f1b" if value > 1 else "none"} if k.name == "pp" else \
                _grid_extra(k.name, value)
            cfg = dataclasses.replace(base, **extra, **{k.name: value})
            try:
                parse_strategy(cfg.to_string())
            except StrategyError:
                continue
            ok.append(cfg)
        assert ok, f"{k.name}={value!r} fits no strategy"
        yield from ok


@pytest.mark.parametrize("k", FIELDS, ids=lambda k: k.name)
def test_every_key_round_trips(k):
    seen = set()
    for cfg in _configs(k):
        assert parse_strategy(cfg.to_string()) == cfg, cfg.to_string()
        assert ParallelConfig.from_dict(cfg.as_dict()) == cfg
        assert ParallelConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg
        seen.add(getattr(cfg, k.name))
        if getattr(cfg, k.name) != k.default and (cfg.pp > 1 or not k.pipeline):
            assert f"{k.name}={k.format(getattr(cfg, k.name))}" in cfg.to_string().split(",")
    assert seen == set(_values(k))


def test_to_string_of_the_defaults():
    assert ParallelConfig().to_string() == "dp=1,tp=1,pp=1,microbatches=1,recompute=none,zero=0"
    assert PIPE.to_string() == "dp=1,tp=2,pp=2,microbatches=4,schedule=1f1b,recompute=none,zero=0,precision=bf16"
    full = ParallelConfig(dp=1, tp=2, pp=2, microbatches=4, schedule="interleaved", chunks=2, recompute="full",
                          zero=1, sequence_parallel=True, offload="optimizer", precision="fp16",
                          reduce_dtype="fp32", overlap=False, bucket_mb=12.5)
    assert full.to_string() == ("dp=1,tp=2,pp=2,microbatches=4,schedule=interleaved,chunks=2,recompute=full,zero=1,"
                                "sequence_parallel=true,offload=optimizer,precision=fp16,reduce_dtype=fp32,"
                                "overlap=false,bucket_mb=12.5")


def test_keys_and_aliases_come_from_the_fields():
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    assert [k.name for k in FIELDS] == names
    i = names.index("microbatches") + 1       # accumulate is spelled right after microbatches
    assert KEYS == tuple(names[:i]) + ("accumulate",) + tuple(names[i:])
    assert set(ALIASES.values()) <= set(KEYS) and not set(ALIASES) & set(KEYS)
    for k in FIELDS:
        assert k.doc and k.type is type(k.default)
        for alias in k.aliases:
            assert parse_strategy(f"{alias}={k.format(getattr(FLAT, k.name))}") is not None
    assert "bucket_mb" in describe() and "gradient_accumulation_steps" in describe()


def test_from_dict_defaults_and_aliases():
    assert ParallelConfig.from_dict({}) == ParallelConfig()
    assert ParallelConfig.from_dict({"dp": 4, "precision": "mixed"}) == ParallelConfig(dp=4, precision="bf16")
    assert ParallelConfig.from_dict({"dp": 2.0, "bucket_mb": 10}) == ParallelConfig(dp=2, bucket_mb=10.0)


@pytest.mark.parametrize("d,words", [
    ({"dq": 2}, "unknown strategy key 'dq'; valid keys: dp, tp"),
    ({"dp": 0}, "'dp' must be >= 1, got 0"),
    ({"dp": "2"}, "'dp' needs an integer, got '2'"),
    ({"tp": True}, "'tp' needs an integer, got True"),
    ({"zero": 4}, "zero=4 is invalid; valid stages: 0, 1, 2, 3"),
    ({"recompute": "partial"}, "recompute='partial' is invalid; valid: none, selective, full"),
    ({"schedule": "zb"}, "schedule='zb' is invalid; valid: gpipe, 1f1b, interleaved"),
    ({"precision": "fp8"}, r"precision='fp8' is invalid; valid: fp32, bf16, fp16 \(mixed = bf16\)"),
    ({"sequence_parallel": "yes"}, "'sequence_parallel' needs true or false, got 'yes'"),
    ({"bucket_mb": 0}, "bucket_mb must be > 0, got 0"),
    ({"bucket_mb": "big"}, "bucket_mb needs a number of MiB, got 'big'"),
])
def test_from_dict_errors(d, words):
    with pytest.raises(StrategyError, match=words):
        ParallelConfig.from_dict(d)


def test_key_lookup():
    assert key("zero").choices == (0, 1, 2, 3) and key("bucket_mb").default == 25.0
    with pytest.raises(StrategyError, match="unknown strategy key 'tensor'"):
        key("tensor")


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


def test_copies_rules():
    cfg = parse_strategy("dp=2,tp=2,micro_batch_interleave_num=2", 4)
    assert cfg.copies == 2 and cfg.to_string() == "dp=2,tp=2,pp=1,microbatches=1,copies=2,recompute=none,zero=0"
    assert "copies" not in ParallelConfig(tp=2).as_dict()       # plans without it stay byte-identical
    for text, words in (("tp=1,copies=2", "needs tp > 1"), ("tp=2,pp=2,copies=2", "with pp=2: .* pipeline"),
                        ("tp=2,zero=3,copies=2", "zero=3"), ("tp=2,copies=0", "'copies' must be >= 1")):
        with pytest.raises(StrategyError, match=words):
            parse_strategy(text, 8)


def test_copies_must_divide_the_microbatch(gpt_graph):
    from autopar.cost import check_config
    check_config(gpt_graph, parse_strategy("dp=2,tp=2,copies=2", 4), 4, 8)
    with pytest.raises(StrategyError, match=r"per-rank microbatch of 2 samples .* valid copies: 1, 2"):
        check_config(gpt_graph, parse_strategy("dp=2,tp=2,microbatches=2,copies=4", 4), 4, 8)
