"""The bad-input table (issue 17): every case below is run, and each must end
in one clear :class:`autopar.AutoparError` (or, for the command line, exit 2
with a one-paragraph message and no traceback) whose message contains the
expected words, or in a correct result. None may be silent or a raw error
from deep inside.

``docs/bad-inputs.md`` is generated from these cases and their actual
messages; the test fails when it is out of date. Regenerate it with::

    .venv/bin/python tests/test_bad_input_table.py

One process, tiny models: a few seconds in all.
"""
from __future__ import annotations

import json
import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402

DOC = ROOT / "docs" / "bad-inputs.md"
GPT = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"
WHERE = dict(cluster="cpu", devices=4, global_batch=8)
CLI_WHERE = ["--cluster", "cpu", "--devices", "4", "--global-batch", "8"]


@dataclass
class Case:
    area: str
    what: str                         # the input, as the table shows it
    call: Callable[[Any], Any]        # fx -> result; fx is the module fixture (files, models)
    words: str | None                 # regex the message must contain; None: a correct result is expected
    error: type = AutoparError        # the error class (a subclass of AutoparError)
    check: Callable[[Any], bool] | None = None   # for results: is it right?


class CliExit(Exception):
    """A command that exited non-zero: its code and its message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- helpers
def _strategy(text: str, devices: int = 8):
    return autopar.parse_strategy(text, devices=devices)


def _eval(strategy: str, model: str = GPT, **kw):
    args = {**WHERE, **kw}
    return autopar.evaluate(model, strategy=strategy, **args)


def _plan(model: Any = GPT, **kw):
    args = {**WHERE, **kw}
    return autopar.plan(model, **args)


def _cli(*args: Any):
    from typer.testing import CliRunner

    from autopar.cli import app
    res = CliRunner().invoke(app, [str(a) for a in args])
    if res.exit_code != 0:
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception
        raise CliExit(res.exit_code, " ".join(res.output.split()))
    return res.output


def _mse(out, target):
    return ((out - target) ** 2).mean()


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


class Branchy(nn.Module):
    """Python control flow on a tensor's value: neither fx nor export can trace it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            return h.relu()
        return h


def _cluster_file(fx, name: str, edit: Callable[[dict], None]) -> str:
    data = json.loads(json.dumps(autopar.load_cluster("cpu").to_dict()))
    edit(data)
    path = fx["dir"] / f"{name}.json"
    path.write_text(json.dumps(data).replace("NaN", "NaN"))
    return str(path)


def _plan_file(fx, name: str, edit: Callable[[dict], None]) -> str:
    data = json.loads(fx["plan_path"].read_text())
    edit(data)
    path = fx["dir"] / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _set_placement(d: dict, value: str) -> None:
    """The first weight's tp placement (plans record [dp, tp] per weight)."""
    name = next(iter(d["params"]))
    d["params"][name] = [d["params"][name][0], value]


def _drop_param(d: dict) -> None:
    d["params"].pop(next(iter(d["params"])))


def _pm(fx):
    return fx["pm"]


def _gpt_batch(fx, inputs, target=None):
    pm, ids = fx["pm"], fx["ids"]
    return pm.train_step(inputs(ids), ids if target is None else target(ids))


def _seq_first_step() -> float:
    """One step of a ``[seq, batch, features]`` encoder (PyTorch's default layout) under ``batch_dim=1``."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1, enable_nested_tensor=False)
    x, t = torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    pm = _parallelize(model, (x,), loss_fn=_mse, example_target=t, batch_dim=1)
    return pm.train_step((x,), t)


def _parallelize(model=None, inputs=None, **kw):
    model = model if model is not None else nn.Linear(8, 8)
    inputs = inputs if inputs is not None else (torch.randn(4, 8),)
    kw.setdefault("loss_fn", _mse)
    kw.setdefault("example_target", torch.randn(4, 8))
    kw.setdefault("strategy", "dp=1")
    return autopar.parallelize(model, inputs, **kw)


# ----------------------------------------------------------------------------- the cases
S, PL, CL, PF, TR, PZ, TS, CLI = ("strategy", "plan / evaluate", "cluster", "plan file", "trace",
                                  "parallelize", "train_step", "command line")
CASES: list[Case] = [
    # -- strategies: the grammar and its rules
    Case(S, '"" (empty)', lambda fx: _strategy(""), r"empty"),
    Case(S, '"dp"', lambda fx: _strategy("dp"), r"key=value"),
    Case(S, '"dp=2;tp=4"', lambda fx: _strategy("dp=2;tp=4"), r"integer"),
    Case(S, '"dp=2,tp=4," (a trailing comma: a correct result)', lambda fx: _strategy("dp=2,tp=4,").to_string(),
         None, check=lambda s: "dp=2" in s and "tp=4" in s),
    Case(S, '"=2"', lambda fx: _strategy("=2"), r"key"),
    Case(S, '"dp="', lambda fx: _strategy("dp="), r"dp"),
    Case(S, '"foo=2"', lambda fx: _strategy("foo=2"), r"unknown strategy key 'foo'"),
    Case(S, '"tp=2,tp=4"', lambda fx: _strategy("tp=2,tp=4"), r"more than once|twice|once"),
    Case(S, '"tp=2,model_parallel=2" (one key, two spellings)', lambda fx: _strategy("tp=2,model_parallel=2"),
         r"more than once|twice|same key|once"),
    Case(S, '"tp=two"', lambda fx: _strategy("tp=two"), r"integer"),
    Case(S, '"tp=2.5"', lambda fx: _strategy("tp=2.5"), r"integer"),
    Case(S, '"tp=0"', lambda fx: _strategy("tp=0"), r">= 1"),
    Case(S, '"tp=-2"', lambda fx: _strategy("tp=-2"), r">= 1"),
    Case(S, '"dp=3,tp=2" on 8 devices', lambda fx: _strategy("dp=3,tp=2"), r"8"),
    Case(S, '"tp=16" on 8 devices', lambda fx: _strategy("tp=16"), r"8"),
    Case(S, '"tp=3" on 8 devices', lambda fx: _strategy("tp=3"), r"divid|8"),
    Case(S, '"pp=2,microbatches=1"', lambda fx: _strategy("pp=2,microbatches=1"), r"microbatches"),
    Case(S, '"schedule=1f1b" without pp', lambda fx: _strategy("schedule=1f1b"), r"pp"),
    Case(S, '"pp=2,schedule=zigzag"', lambda fx: _strategy("pp=2,schedule=zigzag"), r"schedule"),
    Case(S, '"pp=2,chunks=2" (not interleaved)', lambda fx: _strategy("pp=2,chunks=2"), r"interleaved"),
    Case(S, '"pp=2,microbatches=3,schedule=interleaved"',
         lambda fx: _strategy("pp=2,microbatches=3,schedule=interleaved"), r"multiple"),
    Case(S, '"copies=2" without tp', lambda fx: _strategy("copies=2"), r"needs tp > 1"),
    Case(S, '"tp=2,pp=2,copies=2"', lambda fx: _strategy("tp=2,pp=2,copies=2"), r"pipeline"),
    Case(S, '"zero=3,fsdp_layers=2"', lambda fx: _strategy("zero=3,fsdp_layers=2"), r"already shards every layer"),
    Case(S, '"fsdp_layers=-1"', lambda fx: _strategy("fsdp_layers=-1"), r">= 0"),
    Case(S, '"zero=1,fsdp_layers=1" with pp=2', lambda fx: _strategy("pp=2,zero=1,fsdp_layers=1"), r"pipeline"),
    Case(S, '"dp=4,zero=1,fsdp_layers=9" on a 2-layer model', lambda fx: _eval("dp=4,zero=1,fsdp_layers=9"),
         r"has \d+ with weights of their own"),
    Case(S, '"recompute=some"', lambda fx: _strategy("recompute=some"), r"recompute"),
    Case(S, '"zero=4"', lambda fx: _strategy("zero=4"), r"zero"),
    Case(S, '"precision=fp8"', lambda fx: _strategy("precision=fp8"), r"precision"),
    Case(S, '"offload=params"', lambda fx: _strategy("offload=params"), r"offload"),
    Case(S, '"sequence_parallel=true" with tp=1', lambda fx: _strategy("sequence_parallel=true,dp=8"),
         r"sequence_parallel"),
    Case(S, '"sequence_parallel=maybe"', lambda fx: _strategy("sequence_parallel=maybe"), r"true or false"),
    Case(S, '"overlap=perhaps"', lambda fx: _strategy("overlap=perhaps"), r"true or false"),
    Case(S, '"bucket_mb=-1"', lambda fx: _strategy("bucket_mb=-1"), r"bucket_mb"),
    Case(S, '"bucket_mb=nan"', lambda fx: _strategy("bucket_mb=nan"), r"bucket_mb"),
    Case(S, '"reduce_dtype=int8"', lambda fx: _strategy("reduce_dtype=int8"), r"reduce_dtype"),
    Case(S, '"accumulate=4,microbatches=2"', lambda fx: _strategy("accumulate=4,microbatches=2"),
         r"accumulate|microbatches"),
    Case(S, "a number instead of a string", lambda fx: _strategy(8), r"strateg"),
    Case(S, '"tp=2" on 0 devices', lambda fx: _strategy("tp=2", devices=0), r"devices"),
    Case(S, '"DP=2,TP=4" (upper case)', lambda fx: _strategy("DP=2,TP=4").to_string(), None,
         check=lambda s: "dp=2" in s and "tp=4" in s),
    Case(S, '" dp = 2 , tp = 4 " (spaces)', lambda fx: _strategy(" dp = 2 , tp = 4 ").to_string(), None,
         check=lambda s: "dp=2" in s and "tp=4" in s),
    Case(S, '"tp=4" (dp inferred)', lambda fx: _strategy("tp=4").dp, None, check=lambda dp: dp == 2),
    Case(S, '"tp=7,tp_mode=mesh" on 7 devices (a prime tp)', lambda fx: _strategy("tp=7,tp_mode=mesh", devices=7),
         r"prime"),
    Case(S, '"tp=4,tp_mode=mesh" (a 2 x 2 mesh: a correct result)',
         lambda fx: _strategy("tp=4,tp_mode=mesh").tp_grid, None, check=lambda g: g == (2, 2)),
    Case(S, '"tp=4,tp_mode=mesh3" (three axes need three factors)', lambda fx: _strategy("tp=4,tp_mode=mesh3"),
         r"three factors"),
    Case(S, '"tp=4,tp_mode=2d,sequence_parallel=true" (on the grid\'s columns: a correct result)',
         lambda fx: _strategy("tp=4,tp_mode=2d,sequence_parallel=true").sequence_parallel, None,
         check=lambda sp: sp is True),
    Case(S, '"tp=4,tp_mode=mesh,sequence_parallel=true" (on the inner axis: a correct result)',
         lambda fx: _strategy("tp=4,tp_mode=mesh,sequence_parallel=true").sequence_parallel, None,
         check=lambda sp: sp is True),
    # -- plan / evaluate requests
    Case(PL, 'evaluate "tp=4,tp_mode=mesh,recompute=selective,offload=optimizer" (a correct result)',
         lambda fx: _eval("tp=4,tp_mode=mesh,recompute=selective,offload=optimizer").step_time_s, None,
         check=lambda t: 0 < t < math.inf),
    Case(PL, 'evaluate "tp=4,tp_mode=mesh" (a correct result)',
         lambda fx: _eval("tp=4,tp_mode=mesh").step_time_s, None, check=lambda t: 0 < t < math.inf),
    Case(PL, "global_batch=-8", lambda fx: _plan(global_batch=-8), r"global_batch"),
    Case(PL, "global_batch=0", lambda fx: _eval("dp=4", global_batch=0), r"global_batch"),
    Case(PL, "global_batch=8.5", lambda fx: _eval("dp=4", global_batch=8.5), r"global_batch"),
    Case(PL, 'global_batch="8"', lambda fx: _eval("dp=4", global_batch="8"), r"global_batch"),
    Case(PL, "global_batch=6 with dp=4", lambda fx: _eval("dp=4", global_batch=6), r"divisible|dp"),
    Case(PL, "devices=0", lambda fx: _plan(devices=0), r"devices"),
    Case(PL, "devices=-4", lambda fx: _eval("dp=4", devices=-4), r"devices"),
    Case(PL, "devices=True", lambda fx: _eval("dp=4", devices=True), r"devices"),
    Case(PL, 'unknown zoo family "bert:layers=2"', lambda fx: _plan("bert:layers=2"), r"bert"),
    Case(PL, 'unknown zoo key "gpt:layer=2"', lambda fx: _plan("gpt:layer=2"), r"layer"),
    Case(PL, 'bad zoo value "gpt:layers=two"', lambda fx: _plan("gpt:layers=two"), r"layers"),
    Case(PL, 'zoo value 0 "gpt:layers=0"', lambda fx: _plan("gpt:layers=0"), r"layers"),
    Case(PL, 'hidden not divisible by heads "gpt:hidden=30,heads=4"', lambda fx: _plan("gpt:hidden=30,heads=4,layers=2"),
         r"heads|hidden"),
    Case(PL, "tp=3 on a model with 4 heads", lambda fx: _eval("tp=3", devices=3, global_batch=3), r"tp|valid"),
    Case(PL, "tp=8 on a model with 4 heads", lambda fx: _eval("tp=8", devices=8), r"valid sizes"),
    Case(PL, "6 virtual stages on a 2-layer model",
         lambda fx: _eval("pp=2,schedule=interleaved,chunks=3,microbatches=4", devices=4), r"layer|stage"),
    Case(PL, 'strategy "dp=2,tp=2" on devices=8', lambda fx: _eval("dp=2,tp=2", devices=8), r"8"),
    Case(PL, 'cluster="tpu-v5"', lambda fx: _eval("dp=4", cluster="tpu-v5"), r"tpu-v5"),
    Case(PL, 'search_mode="genetic"', lambda fx: _plan(search_mode="genetic"), r"search_mode"),
    Case(PL, "sharding_propagation without any pin", lambda fx: _plan(search_mode="sharding_propagation"),
         r"pin"),
    Case(PL, 'pin on an unknown weight "blocks.9.w"', lambda fx: _plan(shardings={"blocks.9.w": "S(0)"}),
         r"blocks\.9\.w"),
    Case(PL, "pin with a dim out of range S(5)", lambda fx: _plan(shardings={fx["gpt_weight"]: "S(5)"}),
         r"S\(5\)|dim"),
    Case(PL, 'pin "Q(0)" (no such placement)', lambda fx: _plan(shardings={fx["gpt_weight"]: "Q(0)"}),
         r"Q\(0\)"),
    Case(PL, 'pin a partial sum "P"', lambda fx: _plan(shardings={fx["gpt_weight"]: "P"}), r"partial|P"),
    Case(PL, 'pin "S(0)|S(1)" (two axes) with tp_mode=1d',
         lambda fx: _plan(strategy="tp=4", shardings={fx["gpt_weight"]: "S(0)|S(1)"}), r"several axes"),
    Case(PL, 'pin "S(0)|S(1)|R" (three axes) on a 2 x 2 mesh',
         lambda fx: _plan(strategy="tp=4,tp_mode=mesh", shardings={fx["gpt_weight"]: "S(0)|S(1)|R"}), r"names 3 axes"),
    Case(PL, "optimizer='adagrad'", lambda fx: _plan(optimizer="adagrad"), r"adagrad"),
    Case(PL, "precision='fp8'", lambda fx: _plan(precision="fp8"), r"fp8"),
    Case(PL, "a model with no parameters", lambda fx: autopar.plan(NoParams(), (torch.randn(4, 8),), **WHERE),
         r"param"),
    Case(PL, "an nn.Module without example inputs", lambda fx: autopar.plan(nn.Linear(4, 4), **WHERE),
         r"example"),
    Case(PL, "a Graph traced at batch 1 scaled to global_batch=8",
         lambda fx: autopar.evaluate(fx["graph1"], strategy="dp=4", **WHERE), r"batch"),
    Case(PL, 'strategy "dp=4" evaluated on the GPT (a correct result)',
         lambda fx: _eval("dp=4").step_time_s, None, check=lambda t: t > 0 and math.isfinite(t)),
    Case(PL, "a strategy that does not fit in memory (a correct answer: fits=False)",
         lambda fx: _eval("dp=4", model="gpt:layers=48,hidden=4096,heads=32,seq=2048,vocab=50257").fits, None,
         check=lambda fits: fits is False),
    # -- cluster files
    Case(CL, "a file that does not exist", lambda fx: autopar.load_cluster(str(fx["dir"] / "none.json")),
         r"none\.json"),
    Case(CL, "a directory", lambda fx: autopar.load_cluster(str(fx["dir"])), r"director|cluster"),
    Case(CL, "not JSON", lambda fx: autopar.load_cluster(fx["text_file"]), r"JSON|json"),
    Case(CL, "an empty JSON object", lambda fx: autopar.load_cluster(fx["empty_json"]), r"required property"),
    Case(CL, "a NaN bandwidth",
         lambda fx: autopar.load_cluster(_cluster_file(fx, "nan", lambda d: _set_first_number(d, "bandwidth",
                                                                                              float("nan")))),
         r"bandwidth|finite|NaN|nan"),
    Case(CL, "an infinite bandwidth",
         lambda fx: autopar.load_cluster(_cluster_file(fx, "inf", lambda d: _set_first_number(d, "bandwidth",
                                                                                              float("inf")))),
         r"bandwidth|finite|inf"),
    Case(CL, "a negative device memory",
         lambda fx: autopar.load_cluster(_cluster_file(fx, "neg", lambda d: _set_first_number(d, "memory", -1))),
         r"memory"),
    Case(CL, "a string where a number belongs",
         lambda fx: autopar.load_cluster(_cluster_file(fx, "str", lambda d: _set_first_number(d, "memory", "big"))),
         r"memory|number"),
    Case(CL, "an unknown preset name", lambda fx: autopar.load_cluster("dgx-z900"), r"dgx-z900"),
    Case(CL, "a preset name (a correct result)", lambda fx: autopar.load_cluster("dgx-h100").name, None,
         check=lambda n: n == "dgx-h100"),
    # -- plan files
    Case(PF, "a file that does not exist", lambda fx: autopar.Plan.load(fx["dir"] / "missing.json"), r"missing"),
    Case(PF, "a directory", lambda fx: autopar.Plan.load(fx["dir"]), r"director"),
    Case(PF, "a binary file", lambda fx: autopar.Plan.load(fx["binary_file"]), r"plan|JSON|read"),
    Case(PF, "truncated JSON", lambda fx: autopar.Plan.load(fx["truncated"]), r"JSON|json"),
    Case(PF, "a JSON list", lambda fx: autopar.Plan.load(fx["list_json"]), r"object|plan"),
    Case(PF, "a newer plan version",
         lambda fx: autopar.Plan.load(_plan_file(fx, "v99", lambda d: d.update(plan_version=99))), r"version"),
    Case(PF, "no version", lambda fx: autopar.Plan.load(_plan_file(fx, "nov", lambda d: d.pop("plan_version"))),
         r"version"),
    Case(PF, "parallel edited to tp=4 (mesh still dp=2,tp=2)",
         lambda fx: autopar.Plan.load(_plan_file(fx, "tp4", lambda d: d["parallel"].update(tp=4, dp=1))),
         r"mesh|parallel"),
    Case(PF, "a weight placed S(7)", lambda fx: _load_check(fx, _plan_file(fx, "s7", lambda d: _set_placement(
        d, "S(7)"))), r"S\(7\)"),
    Case(PF, "a weight placement that is garbage", lambda fx: _load_check(fx, _plan_file(
        fx, "garbage", lambda d: _set_placement(d, "sideways"))), r"sideways|placement"),
    Case(PF, "a parameter deleted", lambda fx: _load_check(fx, _plan_file(fx, "drop", _drop_param)),
         r"param|missing"),
    Case(PF, "a plan of another model", lambda fx: fx["plan"].check_graph(autopar.trace(
        "gpt:layers=3,hidden=32,heads=4,seq=8,vocab=64")), r"fingerprint|model|graph"),
    Case(PF, "a strategy string that names a missing file", lambda fx: _parallelize(strategy="plan_v2.json"),
         r"plan_v2\.json"),
    Case(PF, "saved and loaded back (a correct result)",
         lambda fx: autopar.Plan.load(fx["plan_path"]).to_dict() == fx["plan"].to_dict(), None,
         check=lambda same: same is True),
    # -- trace
    Case(TR, "a model neither fx nor torch.export can trace (branch on a value)",
         lambda fx: autopar.trace(Branchy(), (torch.randn(2, 4),)), r"Branchy|trace"),
    Case(TR, "an input that is not a tensor", lambda fx: autopar.trace(nn.Linear(4, 4), ("x",)), r"input|tensor"),
    Case(TR, "no inputs", lambda fx: autopar.trace(nn.Linear(4, 4), ()), r"input"),
    Case(TR, "inputs of the wrong width", lambda fx: autopar.trace(nn.Linear(4, 4), (torch.randn(2, 5),)),
         r"Linear|shape|trace|size"),
    Case(TR, "not an nn.Module", lambda fx: autopar.trace(lambda x: x, (torch.randn(2, 4),)), r"Module|model"),
    Case(TR, "a loss that returns a vector", lambda fx: autopar.plan(
        nn.Linear(4, 4), (torch.randn(4, 4),), loss_fn=lambda o, t: (o - t) ** 2, target=torch.randn(4, 4), **WHERE),
         r"loss|scalar|single"),
    Case(TR, "a model string with a typo in the family", lambda fx: autopar.trace("gtp:layers=2"), r"gtp"),
    Case(TR, "a factory file that does not exist", lambda fx: autopar.trace("nofile.py:make"), r"nofile"),
    Case(TR, "batch_dim=-1", lambda fx: autopar.trace(nn.Linear(4, 4), (torch.randn(2, 4),), batch_dim=-1),
         r"batch_dim"),
    Case(TR, 'batch_dim="1"', lambda fx: autopar.trace(nn.Linear(4, 4), (torch.randn(2, 4),), batch_dim="1"),
         r"batch_dim"),
    # -- parallelize
    Case(PZ, "a model with no trainable parameters", lambda fx: _parallelize(
        NoParams(), loss_fn=lambda o, t: o.mean()), r"no trainable parameters", autopar.StrategyError),
    Case(PZ, "a loss with reduction='none'", lambda fx: _parallelize(loss_fn=lambda o, t: (o - t) ** 2),
         r"not a single number"),
    Case(PZ, "loss_fn=None", lambda fx: _parallelize(loss_fn=None), r"loss_fn"),
    Case(PZ, "optimizer='adam'", lambda fx: _parallelize(optimizer="adam"), r"optimizer must be a factory"),
    Case(PZ, "lr_scheduler=0.1", lambda fx: _parallelize(lr_scheduler=0.1), r"lr_scheduler"),
    Case(PZ, "on_nonfinite='ignore'", lambda fx: _parallelize(on_nonfinite="ignore"), r"on_nonfinite"),
    Case(PZ, "max_grad_norm=-1", lambda fx: _parallelize(max_grad_norm=-1), r"max_grad_norm"),
    Case(PZ, "max_grad_norm=nan", lambda fx: _parallelize(max_grad_norm=float("nan")), r"max_grad_norm"),
    Case(PZ, 'strategy "dp=2" in a world of 1 process', lambda fx: _parallelize(strategy="dp=2"),
         r"devices|world|1"),
    Case(PZ, 'strategy "zero=3,precision=fp16"', lambda fx: _parallelize(strategy="zero=3,precision=fp16"),
         r"fp16"),
    Case(PZ, 'strategy "tp=two"', lambda fx: _parallelize(strategy="tp=two"), r"integer"),
    Case(PZ, 'strategy "recompute=full" on a model without layers',
         lambda fx: _parallelize(strategy="recompute=full"), r"no layers", autopar.StrategyError),
    Case(PZ, 'search_mode="genetic"', lambda fx: _parallelize(search_mode="genetic"), r"search_mode"),
    Case(PZ, "a keyword batch with labels and loss_fn=_mse",
         lambda fx: _parallelize(inputs={"x": torch.randn(4, 8), "labels": torch.randn(4, 8)}), r"labels"),
    Case(PZ, "[seq, batch] inputs (nn.TransformerEncoder, batch_first=False) with batch_dim=1 (a correct result)",
         lambda fx: _seq_first_step(), None, check=lambda loss: math.isfinite(loss)),
    Case(PZ, "a plain model trained (a correct result)", lambda fx: _parallelize().train_step(
        (torch.randn(4, 8),), torch.randn(4, 8)), None, check=lambda loss: math.isfinite(loss)),
    # -- train_step on a parallelized nanoGPT
    Case(TS, "token ids above the vocabulary", lambda fx: _gpt_batch(fx, lambda ids: (ids + 64,)),
         r"outside the embedding's rows"),
    Case(TS, "negative token ids", lambda fx: _gpt_batch(fx, lambda ids: (ids - 64,)),
         r"outside the embedding's rows"),
    Case(TS, "target ids above the classes", lambda fx: _gpt_batch(fx, lambda ids: (ids,), lambda ids: ids + 64),
         r"outside the loss's classes"),
    Case(TS, "float tokens", lambda fx: _gpt_batch(fx, lambda ids: (ids.float(),)), r"torch.float32"),
    Case(TS, "a shorter sequence", lambda fx: _gpt_batch(fx, lambda ids: (ids[:, :8],), lambda ids: ids[:, :8]),
         r"shape"),
    Case(TS, "a target of the wrong shape", lambda fx: _gpt_batch(fx, lambda ids: (ids,), lambda ids: ids[:, :8]),
         r"target has shape"),
    Case(TS, "two inputs for a one-input model", lambda fx: _gpt_batch(fx, lambda ids: (ids, ids)),
         r"2 input\(s\)"),
    Case(TS, "a string input", lambda fx: _gpt_batch(fx, lambda ids: ("tokens",)), r"must be a tensor"),
    Case(TS, "a list of ints as input", lambda fx: _gpt_batch(fx, lambda ids: (ids.tolist(),)),
         r"must be a tensor"),
    Case(TS, "a batch of 3 for a plan of 4",
         lambda fx: _gpt_batch(fx, lambda ids: (ids[:3],), lambda ids: ids[:3]), r"global batch of 4"),
    Case(TS, "a NaN loss", lambda fx: fx["mlp_pm"].train_step((torch.full((4, 8), float("nan")),),
                                                             torch.randn(4, 8)), r"nan", autopar.NonFiniteLossError),
    Case(TS, "the same batch again (a correct result)", lambda fx: _gpt_batch(fx, lambda ids: (ids,)), None,
         check=lambda loss: math.isfinite(loss)),
    # -- the command line
    Case(CLI, "plan --devices 0", lambda fx: _cli("plan", GPT, "--cluster", "cpu", "--devices", "0",
                                                  "--global-batch", "8"), r"devices"),
    Case(CLI, "plan --global-batch -1", lambda fx: _cli("plan", GPT, "--cluster", "cpu", "--devices", "4",
                                                        "--global-batch", "-1"), r"global-batch"),
    Case(CLI, "plan without --cluster", lambda fx: _cli("plan", GPT, "--devices", "4", "--global-batch", "8"),
         r"cluster"),
    Case(CLI, "plan --cluster tpu", lambda fx: _cli("plan", GPT, *CLI_WHERE[2:], "--cluster", "tpu"), r"tpu"),
    Case(CLI, "plan --strategy tp=two", lambda fx: _cli("plan", GPT, *CLI_WHERE, "--strategy", "tp=two"),
         r"integer"),
    Case(CLI, "plan --strategy dp=3", lambda fx: _cli("plan", GPT, *CLI_WHERE, "--strategy", "dp=3"), r"4"),
    Case(CLI, "plan --pin without =", lambda fx: _cli("plan", GPT, *CLI_WHERE, "--pin", "lm_head.weight"),
         r"pin"),
    Case(CLI, "plan --pin X=S(0) --pin X=S(1)", lambda fx: _cli(
        "plan", GPT, *CLI_WHERE, "--pin", f"{fx['gpt_weight']}=S(0)", "--pin", f"{fx['gpt_weight']}=S(1)"),
         r"contradict|twice|both"),
    Case(CLI, "plan --precision fp8", lambda fx: _cli("plan", GPT, *CLI_WHERE, "--precision", "fp8"), r"fp8"),
    Case(CLI, "plan --optimizer adagrad", lambda fx: _cli("plan", GPT, *CLI_WHERE, "--optimizer", "adagrad"),
         r"adagrad"),
    Case(CLI, "plan of an unknown model family", lambda fx: _cli("plan", "bert:layers=2", *CLI_WHERE), r"bert"),
    Case(CLI, "plan --out into a missing directory", lambda fx: _cli(
        "plan", GPT, *CLI_WHERE, "--strategy", "dp=4", "--out", fx["dir"] / "no" / "such" / "p.json"),
         r"no/such|director|write"),
    Case(CLI, "evaluate without --strategy", lambda fx: _cli("evaluate", GPT, *CLI_WHERE), r"strategy"),
    Case(CLI, "evaluate --strategy auto", lambda fx: _cli("evaluate", GPT, *CLI_WHERE, "--strategy", "auto"),
         r"auto|manual"),
    Case(CLI, "show of a missing file", lambda fx: _cli("show", fx["dir"] / "missing.json"), r"missing"),
    Case(CLI, "show of a directory", lambda fx: _cli("show", fx["dir"]), r"director"),
    Case(CLI, "show of a binary file", lambda fx: _cli("show", fx["binary_file"]), r"plan|JSON|read"),
    Case(CLI, "show of a cluster file", lambda fx: _cli("show", fx["cluster_file"]), r"plan|version"),
    Case(CLI, "diff of a plan and a missing file", lambda fx: _cli("diff", fx["plan_path"], fx["dir"] / "x.json"),
         r"x\.json"),
    Case(CLI, "trace of a factory file that does not exist", lambda fx: _cli("trace", "nofile.py:make"),
         r"nofile"),
    Case(CLI, "trace of a model string with a bad value", lambda fx: _cli("trace", "gpt:layers=x"), r"layers"),
    Case(CLI, "calibrate --out into a missing directory",
         lambda fx: _cli("calibrate", "--out", fx["dir"] / "no" / "c.json", "--quick"), r"no|director|write"),
    Case(CLI, "an unknown command", lambda fx: _cli("optimise"), r"optimise|command"),
    Case(CLI, "show of a saved plan (a correct result)", lambda fx: _cli("show", fx["plan_path"]), None,
         check=lambda out: "dp=2" in out),
]


def _set_first_number(d: dict, word: str, value: Any) -> None:
    """Set the first field (depth first) whose name contains ``word`` to ``value``."""
    def walk(x: Any) -> bool:
        if isinstance(x, dict):
            for k in list(x):
                if word in k and isinstance(x[k], (int, float)) and not isinstance(x[k], bool):
                    x[k] = value
                    return True
                if walk(x[k]):
                    return True
        elif isinstance(x, list):
            return any(walk(v) for v in x)
        return False
    assert walk(d), f"no numeric field with {word!r} in the cluster file"


def _load_check(fx, path: str) -> None:
    plan = autopar.Plan.load(path)
    plan.check_graph(fx["graph"])


# ----------------------------------------------------------------------------- running them
@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("bad"))


def make_fixture(d: Path) -> dict:
    from benchmarks.real_models import NanoGPT, lm_loss
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"dir": d}
    out["graph"] = autopar.trace(GPT)
    out["graph1"] = autopar.trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), (torch.randn(1, 8),))
    out["gpt_weight"] = next(n for n, p in out["graph"].params.items() if len(p.shape) == 2 and "weight" in n)
    plan = autopar.plan(GPT, strategy="dp=2,tp=2", **WHERE)
    out["plan"], out["plan_path"] = plan, d / "plan.json"
    plan.save(out["plan_path"])
    (d / "text.json").write_text("this is not json")
    out["text_file"] = str(d / "text.json")
    (d / "empty.json").write_text("{}")
    out["empty_json"] = str(d / "empty.json")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    out["binary_file"] = d / "binary.bin"
    (d / "truncated.json").write_text(out["plan_path"].read_text()[:100])
    out["truncated"] = d / "truncated.json"
    (d / "list.json").write_text("[1, 2]")
    out["list_json"] = d / "list.json"
    out["cluster_file"] = d / "cluster.json"
    out["cluster_file"].write_text(json.dumps(autopar.load_cluster("cpu").to_dict()))
    torch.manual_seed(0)
    model = NanoGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ids = torch.randint(0, 64, (4, 16))
    ids[0, 0], ids[0, 1] = 0, 63
    out["pm"] = autopar.parallelize(model, (ids,), loss_fn=lm_loss, example_target=ids, strategy="dp=1",
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    out["ids"] = ids
    out["mlp_pm"] = _parallelize()
    return out


def run_case(case: Case, fx: dict) -> tuple[str, str]:
    """(outcome, message) of one case; raises AssertionError when it is not as expected."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = case.call(fx)
    except CliExit as e:
        msg = str(e)
        assert case.words is not None, f"{case.what}: expected a result, got exit {e.code}: {msg}"
        assert e.code == 2, f"{case.what}: exit {e.code}, expected 2: {msg}"
        assert "Traceback" not in msg, f"{case.what}: a traceback: {msg}"
        assert re.search(case.words, msg), f"{case.what}: {msg!r} lacks {case.words!r}"
        return "exit 2", msg
    except AutoparError as e:
        msg = str(e)
        assert case.words is not None, f"{case.what}: expected a result, got {type(e).__name__}: {msg}"
        assert isinstance(e, case.error), f"{case.what}: {type(e).__name__}, expected {case.error.__name__}: {msg}"
        assert re.search(case.words, msg), f"{case.what}: {msg!r} lacks {case.words!r}"
        return type(e).__name__, msg
    except Exception as e:     # noqa: BLE001 - anything else is the bug this table exists to find
        raise AssertionError(f"{case.what}: raw {type(e).__name__}: {e}") from e
    assert case.words is None, f"{case.what}: no error (result {result!r}); expected one matching {case.words!r}"
    assert case.check is not None and case.check(result), f"{case.what}: wrong result {result!r}"
    return "correct result", repr(result) if not isinstance(result, str) else result.splitlines()[0]


def _short(msg: str, n: int = 160) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= n else msg[:n - 1] + "…"


def render(rows: list[tuple[Case, str, str]]) -> str:
    lines = [
        "# Bad inputs and what autopar says",
        "",
        "Generated by `tests/test_bad_input_table.py` from the cases it runs (regenerate with",
        "`.venv/bin/python tests/test_bad_input_table.py`; the test fails when this page is out of date).",
        "Every bad input ends in one clear error, a subclass of `autopar.AutoparError` (the command line",
        "exits 2 with the message and no traceback), or in a correct result. Messages are cut at 160",
        "characters here.",
        "",
        f"{len(rows)} cases; {sum(o != 'correct result' for _, o, _ in rows)} errors, "
        f"{sum(o == 'correct result' for _, o, _ in rows)} correct results.",
        "",
        "| # | where | input | outcome | message |",
        "|---|---|---|---|---|",
    ]
    for i, (case, outcome, msg) in enumerate(rows, 1):
        cell = msg.replace("|", "\\|").replace("\n", " ")
        what = case.what.replace("|", "\\|")
        lines.append(f"| {i} | {case.area} | {what} | {outcome} | {cell} |")
    return "\n".join(lines) + "\n"


def _scrub(msg: str, fx: dict) -> str:
    """Messages without this run's temporary and working directories (rich may have wrapped a path)."""
    return " ".join(msg.split()).replace(str(fx["dir"]), "<tmp>").replace(str(Path.cwd()), "<cwd>")


def run_all(fx: dict) -> tuple[list[tuple[Case, str, str]], list[str]]:
    rows, failures = [], []
    for case in CASES:
        try:
            outcome, msg = run_case(case, fx)
            rows.append((case, outcome, _short(_scrub(msg, fx))))
        except AssertionError as e:
            failures.append(str(e))
    return rows, failures


def test_every_bad_input_gets_a_clear_answer_and_the_table_is_current(fx):
    rows, failures = run_all(fx)
    assert not failures, "\n".join(failures)
    assert len(CASES) >= 120
    assert DOC.read_text() == render(rows), f"{DOC} is out of date: run .venv/bin/python {Path(__file__).name}"


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        rows, failures = run_all(make_fixture(Path(tmp)))
    for f in failures:
        print("FAIL:", f)
    DOC.write_text(render(rows))
    print(f"wrote {DOC}: {len(rows)} rows, {len(failures)} failures, {len(CASES)} cases")
