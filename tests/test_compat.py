"""Configs in and out (autopar.compat): round trips, the seeds' rules as clear errors, the CLI."""
import json
import tomllib

import pytest
import yaml
from typer.testing import CliRunner

from autopar import Plan, compat
from autopar.cli import app
from autopar.errors import ConfigError, StrategyError, UnsupportedError
from autopar.compat.common import CP
from autopar.spec import parse_strategy

runner = CliRunner()
TINY = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"


def _plan(strategy: str, devices: int, batch: int = 32, layers=None, search: str = "manual") -> Plan:
    """A schema-valid plan without tracing a model (only what the exports read is meaningful)."""
    cfg = parse_strategy(strategy, devices)
    data = {"plan_version": 1, "autopar_version": "0", "devices": devices, "global_batch": batch,
            "model": {"name": "m", "fingerprint": "0", "num_params": 1, "num_nodes": 1}, "cluster": {"name": "cpu"},
            "mesh": {"axes": ["pp", "dp", "tp"], "shape": [cfg.pp, cfg.dp, cfg.tp]},
            "parallel": {**cfg.as_dict(), "precision": cfg.precision or "fp32"}, "params": {}, "ops": {},
            "predicted": {"step_time_s": 1.0, "peak_memory_bytes": 1, "tflops_per_device": 1.0, "fits": True},
            "search": {"mode": search}, "precision": cfg.precision or "fp32", "optimizer": "adamw"}
    if cfg.pp > 1:
        data["pipeline"] = {"schedule": cfg.schedule, "chunks": cfg.chunks,
                            "layers": layers or [2] * (cfg.pp * cfg.chunks)}
    return Plan.from_dict(data)


# ------------------------------------------------------------------ round trips
COLOSSAL = [("dp=8", 8), ("dp=2,tp=4", 8), ("dp=2,tp=2,pp=2,microbatches=4", 8),
            ("dp=1,tp=2,pp=2,microbatches=4,schedule=interleaved", 4),
            ("dp=1,pp=4,microbatches=8,schedule=interleaved,chunks=3", 4), ("dp=4,microbatches=4", 4),
            ("dp=4,tp=2,precision=fp16", 8), ("dp=2,tp=4,tp_mode=2d,pp=2,microbatches=4", 16)]
MINDFORMERS = [("dp=8", 8), ("dp=2,tp=4", 8), ("dp=2,tp=2,pp=2,microbatches=4", 8), ("dp=4,zero=1,recompute=full", 4),
               ("dp=2,tp=2,sequence_parallel=true,recompute=selective", 4), ("dp=4,microbatches=4", 4),
               ("dp=1,tp=2,pp=4,microbatches=8,zero=1", 8), ("dp=2,tp=2,copies=2", 4)]
TORCHTITAN = [("dp=8,precision=bf16", 8), ("dp=2,tp=4,sequence_parallel=true,precision=bf16", 8),
              ("dp=2,tp=2,pp=2,microbatches=4,sequence_parallel=true,precision=fp32", 8),
              ("dp=4,zero=3,recompute=full,precision=bf16", 4), ("dp=4,zero=2,recompute=selective,precision=bf16", 4),
              ("dp=1,pp=4,microbatches=8,schedule=interleaved,precision=bf16", 4),
              ("dp=2,pp=2,microbatches=2,schedule=gpipe,zero=1,precision=bf16", 4),
              ("dp=4,microbatches=2,precision=bf16", 4)]


@pytest.mark.parametrize("strategy,devices", COLOSSAL)
def test_colossal_round_trip(strategy, devices, tmp_path):
    cfg = parse_strategy(strategy, devices)
    out = compat.to_colossal(cfg)
    assert compat.from_colossal(out.data, devices).config == cfg
    path = tmp_path / "config.py"
    path.write_text(out.text)
    assert compat.from_colossal(path, devices).config == cfg     # the Python text, read with ast
    assert not out.notes


@pytest.mark.parametrize("strategy,devices", MINDFORMERS)
def test_mindformers_round_trip(strategy, devices, tmp_path):
    cfg = parse_strategy(strategy, devices)
    out = compat.to_mindformers(cfg)
    assert compat.from_mindformers(out.data, devices).config == cfg
    path = tmp_path / "run.yaml"
    path.write_text(out.text)
    assert yaml.safe_load(out.text) == out.data
    assert compat.from_mindformers(path, devices).config == cfg
    assert compat.from_mindformers(out.data).config == cfg           # devices from the degrees


@pytest.mark.parametrize("strategy,devices", TORCHTITAN)
def test_torchtitan_round_trip(strategy, devices, tmp_path):
    cfg = parse_strategy(strategy, devices)
    out = compat.to_torchtitan(cfg, global_batch=64)
    assert tomllib.loads(out.text) == out.data
    path = tmp_path / "job.toml"
    path.write_text(out.text)
    assert compat.from_torchtitan(path, devices).config == cfg
    assert out.data["parallelism"]["enable_async_tensor_parallel"] is False


def test_plans_export_with_their_batch_layers_and_search():
    p = _plan("dp=2,tp=2,pp=2,microbatches=4", 8, batch=32, layers=[3, 1])
    titan = compat.to_torchtitan(p)
    assert titan.data["training"] == {"global_batch_size": 32, "local_batch_size": 16,
                                      "mixed_precision_param": "float32"}
    assert titan.data["parallelism"]["pipeline_parallel_microbatch_size"] == 4
    assert any("uneven" in n for n in titan.notes)
    assert compat.to_torchtitan(_plan("dp=1,pp=2,microbatches=2", 2, layers=[2, 2])).data["parallelism"][
        "pipeline_parallel_layers_per_stage"] == 2
    searched = _plan("dp=2,tp=2", 4, search="sharding_propagation")
    mf = compat.to_mindformers(searched)
    assert mf.data["parallel"]["search_mode"] == "sharding_propagation"
    back = compat.from_mindformers(mf.data, 4)
    assert back.search_mode == "sharding_propagation" and back.config == parse_strategy("dp=2,tp=2", 4)
    for out in (compat.to_colossal(searched), compat.to_torchtitan(searched)):
        assert any("per-op placements" in n for n in out.notes)


def test_exports_name_what_is_lost():
    cfg = parse_strategy("dp=2,tp=2,zero=1,recompute=selective,sequence_parallel=true,offload=optimizer,"
                         "precision=bf16,overlap=false,bucket_mb=50", 4)
    notes = " ".join(compat.to_colossal(cfg).notes)
    for word in ("zero=1", "LowLevelZeroPlugin", "recompute=selective", "sequence_parallel", "bf16", "offload",
                 "overlap", "bucket_mb"):
        assert word in notes
    notes = " ".join(compat.to_mindformers(parse_strategy("dp=1,pp=2,microbatches=2,schedule=gpipe,zero=1,"
                                                          "precision=fp16", 2)).notes)
    assert "schedule=gpipe" in notes and "precision=fp16" in notes
    notes = " ".join(compat.to_torchtitan(parse_strategy("dp=4,zero=1", 4)).notes)
    assert "no ZeRO-1" in notes
    assert compat.to_colossal("dp=2,tp=2").data == {"parallel": {"tensor": {"size": 2, "mode": "1d"}}}
    with pytest.raises(StrategyError, match="cannot export"):
        compat.to_colossal(42)


# ------------------------------------------------------------------ Colossal-AI: the seed's rules
def col(parallel, devices=16, **extra):
    return compat.from_colossal({"parallel": parallel, **extra}, devices)


@pytest.mark.parametrize("parallel,extra,match", [
    (dict(pipeline=2, tensor=4), {}, r"parallel.tensor=4 has no mode"),
    (dict(tensor=dict(size=4)), {}, r"parallel.tensor.size=4 has no mode"),
    (dict(tensor=dict(mode="1d")), {}, r"mode='1d' but no size"),
    (dict(tensor=dict(size=8, mode="2d")), {}, r"size=8 with mode='2d' must be a square"),
    (dict(tensor=dict(size=8, mode="2.5d")), {}, r"mode='2.5d' needs depth"),
    (dict(tensor=dict(size=8, mode="2.5d", depth=3)), {}, r"depth=3 must be depth x q\^2"),
    (dict(tensor=dict(size=4, mode="3d")), {}, r"size=4 with mode='3d' must be a cube"),
    (dict(tensor=dict(size=4, mode="1d", depth=2)), {}, r"depth is for mode='2.5d' only"),
    (dict(tensor=dict(size=4, mode="4d")), {}, r"mode='4d' is invalid"),
    (dict(pipeline=3, tensor=dict(size=2, mode="1d")), {}, r"pipeline=3 x parallel.tensor.size=2 = 6 does not divide"),
    (dict(data=4, tensor=dict(size=2, mode="1d")), {}, r"parallel.data=4, but 16 devices .* leave 8"),
    (dict(pipeline=dict(stages=2)), {}, r"parallel.pipeline.stages is not a key"),
    (dict(pipeline=0), {}, r"parallel.pipeline must be an integer >= 1"),
    (dict(sequence=2), {}, r"parallel.sequence is not a Colossal-AI parallel key"),
    (dict(pipeline=2), {"NUM_MICRO_BATCHES": 4, "schedule": {"num_microbatches": 8}}, r"disagree"),
    (dict(), {"NUM_CHUNKS": 2}, r"NUM_CHUNKS=2 .* needs parallel.pipeline > 1"),
    (dict(pipeline=4), {"NUM_MICRO_BATCHES": 6, "NUM_CHUNKS": 2}, r"multiple of pp .*NUM_MICRO_BATCHES"),
])
def test_colossal_rules(parallel, extra, match):
    with pytest.raises(ConfigError, match=match):
        col(parallel, **extra)


@pytest.mark.parametrize("tensor,strategy", [
    (dict(size=4, mode="2d"), "tp=4,tp_mode=2d"),
    (dict(size=8, mode="2.5d", depth=2), "tp=8,tp_mode=2.5d,tp_depth=2"),
    (dict(size=8, mode="3d"), "tp=8,tp_mode=3d")])
def test_colossal_2d_25d_3d_map_to_tp_mode(tensor, strategy):
    got = col(dict(pipeline=2, tensor=tensor))
    assert got.config == parse_strategy(f"{strategy},pp=2", 16)
    back = compat.to_colossal(got.config)
    assert back.data["parallel"]["tensor"] == tensor and not any("tp_mode" in n for n in back.notes)
    assert any("tp_mode" in n for n in compat.to_torchtitan(got.config, global_batch=32).notes)


def test_colossal_3d_config_is_evaluated_and_planned():
    """A Colossal-AI 3D config (tensor=dict(size=8, mode='3d')) now runs: it is priced and becomes a plan."""
    import autopar
    got = col(dict(tensor=dict(size=8, mode="3d")), devices=16)
    assert got.config == parse_strategy("dp=2,tp=8,tp_mode=3d", 16)
    assert any("not Bian et al.'s matmul schedule" in n for n in got.notes)     # said, not hidden
    model = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
    est = autopar.evaluate(model, cluster="dgx-a100-80g", devices=16, global_batch=16, strategy=got.config)
    assert est.parallel["tp_mode"] == "3d" and est.step_time_s > 0 and est.memory["grid_weights_gathered"] > 0
    plan = autopar.plan(model, cluster="dgx-a100-80g", devices=16, global_batch=16, strategy=got.config)
    assert compat.to_colossal(plan).data["parallel"]["tensor"] == {"size": 8, "mode": "3d"}


def test_colossal_accepted_forms():
    assert col(dict(pipeline=dict(size=2))).strategy.startswith("dp=8,tp=1,pp=2,microbatches=2")
    assert col(dict(tensor=dict(size=1, mode=None))).config == parse_strategy("dp=16", 16)
    assert col(dict(data=8, tensor=dict(size=2, mode="1D"))).config == parse_strategy("dp=8,tp=2", 16)
    assert compat.from_colossal({"pipeline": 2, "data": 2}).config.devices == 4    # the parallel dict alone
    got = col(dict(pipeline=2), schedule=dict(num_microbatches=4), gradient_accumulation=2, fp16=dict(mode="x"))
    assert (got.config.microbatches, got.config.precision) == (8, "fp16")
    assert any("gradient_accumulation=2" in n for n in got.notes)
    with pytest.raises(ConfigError, match="give the device count"):
        compat.from_colossal({"parallel": {"pipeline": 2}})


def test_colossal_file_is_read_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "config.py"
    path.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\nTP = 2\nPP = 2\n"
                    "parallel = dict(pipeline=PP, tensor=dict(size=TP * 1, mode='1d'))\nNUM_MICRO_BATCHES = PP * 2\n"
                    "BATCH_SIZE = len([1])\n")
    got = compat.from_colossal(path, 8)
    assert got.config == parse_strategy("dp=2,tp=2,pp=2,microbatches=4", 8)
    assert not marker.exists()
    path.write_text("import os\nparallel = dict(tensor=dict(size=int(os.environ['TP']), mode='1d'))\n")
    with pytest.raises(ConfigError, match=r"line 2: parallel is not a literal .*int\(os.environ"):
        compat.from_colossal(path, 8)
    with pytest.raises(ConfigError, match="does not exist"):
        compat.from_colossal(tmp_path / "missing.py", 8)


# ------------------------------------------------------------------ MindFormers: the seed's rules
def mf(parallel=None, devices=8, **pc):
    return compat.from_mindformers({"parallel": parallel or {"parallel_mode": 1}, "parallel_config": pc}, devices)


@pytest.mark.parametrize("parallel,pc,devices,match", [
    ({"parallel_mode": 4}, {}, 8, r"parallel_mode=4 is invalid; valid: 0 \(data_parallel\)"),
    ({"parallel_mode": True}, {}, 8, r"parallel_mode=True is invalid"),
    ({"parallel_mode": 2, "search_mode": "greedy"}, {}, 8, r"search_mode='greedy' is invalid"),
    ({"parallel_mode": 0, "full_batch": True}, {}, 8, r"full_batch=true with parallel_mode 0"),
    ({"parallel_mode": 0}, {"model_parallel": 2}, 8, r"parallel_mode 0 \(data parallel\) splits only the batch"),
    (None, {"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 1}, 8,
     r"micro_batch_num=1 < pipeline_stage=2"),
    (None, {"data_parallel": 4, "model_parallel": 4}, 8, r"= 16 devices, more than the 8 given"),
    (None, {"data_parallel": 2, "model_parallel": 2}, 8, r"= 4 devices, but 8 are given .*use "
                                                         r"parallel_config.data_parallel=4"),
    (None, {"model_parallel": 0}, 8, r"parallel_config.model_parallel must be an integer >= 1"),
    (None, {"data_parallel": 8, "use_seq_parallel": True}, 8, r"sequence_parallel=true .* needs tp > 1 .*"
                                                               r"parallel_config.use_seq_parallel"),
    (None, {"data_parallel": 8, "use_seq_parallel": "yes"}, 8, r"use_seq_parallel must be true or false"),
])
def test_mindformers_rules(parallel, pc, devices, match):
    with pytest.raises(ConfigError, match=match):
        mf(parallel, devices, **pc)


def test_mindformers_modes_and_options():
    auto = mf({"parallel_mode": 2, "search_mode": "recursive_programming"}, data_parallel=2)
    assert auto.config is None and auto.strategy == "auto" and auto.search_mode == "recursive_programming"
    assert mf({"parallel_mode": "AUTO_PARALLEL"}).search_mode == "dynamic_programming"
    semi = mf({"parallel_mode": "semi_auto_parallel", "search_mode": "sharding_propagation"}, model_parallel=2)
    assert semi.config == parse_strategy("dp=4,tp=2", 8) and semi.search_mode == "sharding_propagation"
    assert any("automatic mode only" in n for n in semi.notes)
    dp = mf({"parallel_mode": 0, "enable_parallel_optimizer": True, "gradients_mean": False})
    assert dp.config == parse_strategy("dp=8,zero=1", 8) and any("gradients_mean" in n for n in dp.notes)
    hybrid = mf({"parallel_mode": 3, "search_mode": "dynamic_programming"}, data_parallel=4, model_parallel=2,
                vocab_emb_dp=True, gradient_aggregation_group=4)
    assert hybrid.search_mode is None and len(hybrid.notes) == 4
    cfg = {"parallel": {"parallel_mode": 1}, "parallel_config": {"data_parallel": 2, "pipeline_stage": 2,
                                                                  "micro_batch_num": 2, "recompute": True},
           "runner_config": {"gradient_accumulation_steps": 2}}
    assert compat.from_mindformers(cfg, 4).config == parse_strategy("dp=2,pp=2,microbatches=4,recompute=full", 4)
    cfg = {"parallel_config": {"data_parallel": 4}, "recompute_config": {"select_recompute": ["mlp"]}}
    assert compat.from_mindformers(cfg).config.recompute == "selective"
    # multi-copy parallel: micro_batch_interleave_num is copies (top level or in parallel_config)
    cfg = {"parallel_config": {"data_parallel": 2, "model_parallel": 2}, "micro_batch_interleave_num": 2}
    assert compat.from_mindformers(cfg).config == parse_strategy("dp=2,tp=2,copies=2", 4)
    cfg = {"parallel_config": {"model_parallel": 4, "micro_batch_interleave_num": 2}}
    assert compat.from_mindformers(cfg, 4).config.copies == 2
    with pytest.raises(ConfigError, match=r"copies=2 .* needs tp > 1.*micro_batch_interleave_num"):
        compat.from_mindformers({"parallel_config": {"data_parallel": 4}, "micro_batch_interleave_num": 2})
    with pytest.raises(UnsupportedError, match="expert parallel"):
        mf(data_parallel=8, expert_parallel=2)
    with pytest.raises(ConfigError, match="without parallel_config.data_parallel, give the device count"):
        compat.from_mindformers({"parallel_config": {"model_parallel": 2}})


def test_mindformers_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        compat.from_mindformers(bad, 8)
    bad.write_text("parallel: 3\n")
    with pytest.raises(ConfigError, match="parallel must be a mapping"):
        compat.from_mindformers(bad, 8)


# ------------------------------------------------------------------ torchtitan read-back
def test_torchtitan_reading():
    def titan(**par):
        return {"parallelism": par, "activation_checkpoint": {"mode": "none"},
                "training": {"mixed_precision_param": "bfloat16"}}

    assert compat.from_torchtitan(titan(tensor_parallel_degree=2), 8).config == \
        parse_strategy("dp=4,tp=2,zero=3,sequence_parallel=true,precision=bf16", 8)     # shard=-1: the rest
    with pytest.raises(UnsupportedError, match="HSDP"):
        compat.from_torchtitan(titan(data_parallel_replicate_degree=2, data_parallel_shard_degree=2), 4)
    with pytest.raises(UnsupportedError, match="ZBVZeroBubble"):
        compat.from_torchtitan(titan(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble"), 4)
    with pytest.raises(ConfigError, match="give the device count"):
        compat.from_torchtitan(titan())
    with pytest.raises(ConfigError, match="activation_checkpoint.mode='some' is invalid"):
        compat.from_torchtitan({"parallelism": {}, "activation_checkpoint": {"mode": "some"}}, 2)
    with pytest.raises(ConfigError, match="global batch 6 is not a multiple of dp=4"):
        compat.to_torchtitan(parse_strategy("dp=4", 4), global_batch=6)
    got = compat.from_torchtitan({"parallelism": {"data_parallel_shard_degree": 4}})   # torchtitan's defaults
    assert got.config.recompute == "full" and len(got.notes) == 2


# ------------------------------------------------------------------ context parallel (a strategy key in newer trees)
@pytest.mark.skipif(not CP, reason="this tree's strategies have no cp key")
def test_context_parallel_in_and_out():
    got = col(dict(tensor=dict(size=4, mode="sequence")), devices=8)
    assert got.config == parse_strategy("dp=2,cp=4", 8) and "ring" in got.notes[0]
    for strategy, devices, formats in [("dp=2,cp=4", 8, ("colossal", "mindformers")),
                                       ("dp=2,tp=2,cp=2,sequence_parallel=true", 8, ("mindformers",)),
                                       ("dp=2,tp=2,cp=2,sequence_parallel=true,precision=bf16", 8, ("torchtitan",))]:
        cfg = parse_strategy(strategy, devices)
        for fmt in formats:
            assert compat.READERS[fmt](compat.WRITERS[fmt](cfg).data, devices).config == cfg, fmt
    with pytest.raises(UnsupportedError, match="one tensor mode"):
        compat.to_colossal(parse_strategy("dp=1,tp=2,cp=2", 4))


@pytest.mark.skipif(CP, reason="this tree's strategies have a cp key")
def test_context_parallel_refused_without_cp():
    with pytest.raises(UnsupportedError, match="ring self-attention.*Megatron's"):
        col(dict(tensor=dict(size=4, mode="sequence")))
    with pytest.raises(UnsupportedError, match="context_parallel_degree=2 is context parallelism"):
        compat.from_torchtitan({"parallelism": {"context_parallel_degree": 2}}, 4)
    with pytest.raises(UnsupportedError, match="parallel_config.context_parallel=2"):
        mf(data_parallel=4, context_parallel=2)


# ------------------------------------------------------------------ CLI
def test_cli_import_prints_the_strategy(tmp_path):
    path = tmp_path / "config.py"
    path.write_text("parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))\nNUM_MICRO_BATCHES = 4\n")
    res = runner.invoke(app, ["import", "colossal", str(path), "--devices", "8"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "dp=2,tp=2,pp=2,microbatches=4,schedule=1f1b,recompute=none,zero=0"
    res = runner.invoke(app, ["import", "colossal", str(path), "--devices", "6"])
    assert res.exit_code == 2 and "does not divide the 6 devices" in " ".join(res.stderr.split())
    yml = tmp_path / "run.yaml"
    yml.write_text(compat.to_mindformers(parse_strategy("dp=2,tp=2", 4)).text)
    res = runner.invoke(app, ["import", "mindformers", str(yml), "-n", "4", "--evaluate", TINY, "--cluster", "cpu",
                              "--global-batch", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["strategy"].startswith("dp=2,tp=2")
    res = runner.invoke(app, ["import", "megatron", str(yml), "-n", "4"])
    assert res.exit_code == 2 and "unknown config format" in res.stderr


def test_cli_export(tmp_path):
    plan_path = tmp_path / "plan.json"
    _plan("dp=2,tp=2,pp=2,microbatches=4", 8).save(plan_path)
    res = runner.invoke(app, ["export", str(plan_path), "--format", "colossal"])
    assert res.exit_code == 0, res.output
    assert "parallel = dict(pipeline=dict(size=2), tensor=dict(size=2, mode='1d'))" in res.stdout
    assert "lost:" not in res.stdout
    res = runner.invoke(app, ["export", str(plan_path), "-f", "torchtitan", "-o", str(tmp_path / "job.toml")])
    assert res.exit_code == 0 and "lost: sequence_parallel=false" in " ".join(res.stderr.split())
    assert tomllib.loads((tmp_path / "job.toml").read_text())["parallelism"]["tensor_parallel_degree"] == 2
    res = runner.invoke(app, ["export", str(plan_path)])
    assert json.loads(res.stdout)["parallel"]["pp"] == 2
    res = runner.invoke(app, ["export", "dp=2,zero=1", "-n", "2", "-f", "mindformers"])
    assert yaml.safe_load(res.stdout)["parallel"]["enable_parallel_optimizer"] is True
    res = runner.invoke(app, ["export", "dp=2", "-n", "2", "-f", "xml"])
    assert res.exit_code == 2 and "unknown format" in res.stderr


# ------------------------------------------------------------------ MindSpore's dataset slicing
def test_mindformers_dataset_strategy_slices_the_sequence():
    sliced = mf({"parallel_mode": 1, "dataset_strategy": [[2, 2], [2, 2]]}, 8, model_parallel=2)
    assert sliced.config == parse_strategy("dp=2,cp=2,tp=2", 8)
    assert any("context parallel cp=2" in n for n in sliced.notes)
    assert mf({"parallel_mode": 1, "dataset_strategy": "data_parallel"}, 8).config == parse_strategy("dp=8", 8)
    assert mf({"parallel_mode": 1, "dataset_strategy": [[8]]}, 8).config == parse_strategy("dp=8", 8)


@pytest.mark.parametrize("ds,pc,error,match", [
    ([[2, 2, 2, 1]], {}, UnsupportedError, r"dataset_strategy\[0\]=\[2, 2, 2, 1\] slices dim 2 .*halo exchange"),
    ([[2, 2], [2, 4]], {}, ConfigError, r"every input must be sliced alike"),
    ([[2, 2]], {"context_parallel": 4}, ConfigError, r"gives context_parallel=2, but parallel_config"),
    ([[4, 2]], {"data_parallel": 2}, ConfigError, r"gives data_parallel=4, but parallel_config"),
    ([[2, 0]], {}, ConfigError, r"dataset_strategy\[0\] must be an integer >= 1"),
    ("model_parallel", {}, ConfigError, r"dataset_strategy='model_parallel' is invalid"),
    ([], {}, ConfigError, r"dataset_strategy=\[\] is invalid"),
])
def test_mindformers_dataset_strategy_rules(ds, pc, error, match):
    with pytest.raises(error, match=match):
        mf({"parallel_mode": 1, "dataset_strategy": ds}, 8, **pc)
    with pytest.raises((ConfigError, UnsupportedError)):
        mf({"parallel_mode": 0, "dataset_strategy": "full_batch"}, 8)
