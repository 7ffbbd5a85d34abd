"""The `autopar` command: every subcommand on a tiny zoo model, errors exit 2."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autopar
from autopar.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"
WHERE = ["--cluster", "cpu", "--devices", "4", "--global-batch", "8"]

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def ok(*args):
    res = run(*args)
    assert res.exit_code == 0, f"exit {res.exit_code}\nstdout: {res.stdout}\nstderr: {res.stderr}\n{res.exception!r}"
    return res


def fails(*args):
    res = run(*args)
    assert res.exit_code == 2, f"exit {res.exit_code}\nstdout: {res.stdout}\nstderr: {res.stderr}"
    assert "Traceback" not in res.output
    return " ".join(res.stderr.split())   # rich wraps long lines


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    res = ok("plan", TINY, *WHERE, "--strategy", "dp=2,tp=2", "--out", path)
    assert "dp=2,tp=2" in res.stdout and "plan written" in res.stdout
    return path


def test_plan_json_is_only_json_and_uses_all_devices():
    res = ok("plan", TINY, *WHERE, "--json")
    d = json.loads(res.stdout)       # nothing but the plan on stdout
    p = d["parallel"]
    assert p["dp"] * p["tp"] * p["pp"] == 4
    assert d["devices"] == 4 and d["search"]["mode"] == "dynamic_programming"


def test_plan_plain_excludes_the_memory_options():
    d = json.loads(ok("plan", TINY, *WHERE, "--plain", "--json").stdout)
    assert d["parallel"]["zero"] == 0 and d["parallel"]["recompute"] == "none"
    # keys at their defaults are left out of the plan (issue 18): read them through the config
    cfg = autopar.Plan.from_dict(d).config
    assert not cfg.sequence_parallel and cfg.offload == "none" and "offload" not in d["parallel"]


def test_plan_out_is_a_loadable_plan_that_show_reads(saved_plan):
    plan = autopar.Plan.load(saved_plan)
    assert plan.parallel["dp"] == 2 and plan.parallel["tp"] == 2
    res = ok("show", saved_plan)
    assert "dp=2,tp=2" in res.stdout
    assert "parameter placements" in res.stdout and "S(" in res.stdout   # tp shards some weights
    assert "op strategies" in res.stdout
    shown = ok("show", saved_plan, "--json").stdout      # the plan file as saved (compact)
    assert shown == plan.to_json() == saved_plan.read_text()
    assert autopar.Plan.from_dict(json.loads(shown)).to_dict() == plan.to_dict()


def test_show_missing_file_exits_2(tmp_path):
    assert "does not exist" in fails("show", tmp_path / "nope.json")


def test_evaluate_json_and_table():
    d = json.loads(ok("evaluate", TINY, *WHERE, "--strategy", "dp=2,tp=2", "--json").stdout)
    assert d["step_time_s"] > 0 and d["fits"] and d["parallel"]["tp"] == 2
    res = ok("evaluate", TINY, *WHERE, "--strategy", "dp=4")
    assert "step time" in res.stdout and "peak memory" in res.stdout


@pytest.mark.parametrize("devices", ["4", "6"])
def test_bad_tp_size_names_valid_sizes(devices):
    args = ["--cluster", "cpu", "--devices", devices, "--global-batch", "12"]
    msg = fails("evaluate", TINY, *args, "--strategy", "tp=3")
    assert "error" in msg and "valid sizes" in msg and "1, 2" in msg
    assert "valid sizes" in fails("plan", TINY, *args, "--strategy", "tp=3")


def test_unknown_zoo_key_lists_valid_keys():
    msg = fails("trace", "gpt:layerz=2")
    assert "layerz" in msg and "hidden" in msg and "layers" in msg
    assert "layers" in fails("plan", "gpt:layerz=2", *WHERE)


def test_other_bad_inputs_exit_2():
    assert "valid presets" in fails("evaluate", TINY, "--cluster", "nope", "--devices", "4",
                                    "--global-batch", "8", "--strategy", "dp=4")
    assert "adamw" in fails("evaluate", TINY, *WHERE, "--strategy", "dp=4", "--optimizer", "lion")
    assert "plan" in fails("evaluate", TINY, *WHERE, "--strategy", "auto")
    assert run("plan", TINY).exit_code == 2          # missing required options: click's usage error


def test_trace_json_and_table():
    d = json.loads(ok("trace", TINY, "--json").stdout)
    assert d["params"] > 0 and d["nodes"] > 0 and d["forward_flops"] > 0
    assert d["groups"][0]["instances"] == 2 and d["kinds"]["linear"] > 0 and d["frontend"] == "fx"
    res = ok("trace", TINY)
    assert "repeated layers" in res.stdout and "linear" in res.stdout


def test_trace_user_factory():
    d = json.loads(ok("trace", ROOT / "examples" / "custom_model.py:make", "--json").stdout)
    assert d["groups"] and d["params"] > 0


SEQ_FIRST = """
import torch, torch.nn as nn, torch.nn.functional as F

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0), 1,
                                         enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))

def make():
    x = torch.randint(0, 64, (16, 4))     # [seq, batch]: PyTorch's default layout
    return M(), (x,), lambda o, t: F.cross_entropy(o.reshape(-1, 64), t.reshape(-1)), x
"""


def test_a_seq_first_factory_with_batch_dim(tmp_path):
    path = tmp_path / "seq_first.py"
    path.write_text(SEQ_FIRST)
    assert json.loads(ok("trace", f"{path}:make", "--json").stdout)["batch_size"] == 16    # the sequence
    assert json.loads(ok("trace", f"{path}:make", "--batch-dim", "1", "--json").stdout)["batch_size"] == 4
    d = json.loads(ok("evaluate", f"{path}:make", "--batch-dim", "1", "--cluster", "cpu", "--devices", "2",
                      "--strategy", "dp=2", "--global-batch", "8", "--json").stdout)
    assert d["fits"]
    assert "batch-dim" in fails("trace", f"{path}:make", "--batch-dim", "-1")


def test_zoo_and_presets():
    fams = json.loads(ok("zoo", "--json").stdout)
    assert {"gpt", "llama", "mlp", "cnn"} <= set(fams) and "hidden" in fams["gpt"]
    assert "gpt" in ok("zoo").stdout
    presets = json.loads(ok("presets", "--json").stdout)
    assert {"cpu", "dgx-a100-80g"} <= {p["name"] for p in presets}
    assert all(p["memory_bytes"] > 0 and p["devices_per_node"] > 0 for p in presets)
    assert "dgx-a100-80g" in ok("presets").stdout


def test_version():
    assert autopar.__version__ in ok("--version").stdout


def test_python_dash_m_autopar():
    res = subprocess.run([sys.executable, "-m", "autopar", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"autopar {autopar.__version__}"


def test_plan_explain_pins_and_search_mode():
    res = ok("plan", TINY, *WHERE, "--strategy", "dp=2,tp=2", "--search-mode", "dynamic_programming",
             "--pin", "blocks.0.mlp.fc.weight=S(1)", "--explain")
    text = " ".join(res.stdout.split())
    assert "ILP of the chosen configuration" in text and "runners-up" in text
    assert "model.blocks.*" in text and "pinned" in text and "blocks.0.mlp.fc.weight=S(1)" in text
    d = json.loads(ok("plan", TINY, *WHERE, "--explain", "--json").stdout)
    assert d["plan"]["search"]["mode"] == "dynamic_programming" and d["explain"]["configs"]
    assert "ilp_solves" in d["explain"]["search"]
    g = json.loads(ok("plan", TINY, *WHERE, "--search-mode", "grid", "--json").stdout)
    assert g["search"]["tp_axis"] == "manual"


def test_plan_output_piped_shows_progress_and_cuts_nothing():
    """issue 18: nothing on a piped stderr during a search; strategies cut with '...' in the summary and
    --explain (the best configurations looked identical); raw dicts and '0.0018 GiB' numbers."""
    res = ok("plan", "gpt:layers=4,hidden=64,heads=4,seq=16,vocab=128", "--cluster", "cpu", "--devices", "8",
             "--global-batch", "16", "--explain")
    assert "searching: " in res.stderr and "configurations" in res.stderr
    assert "…" not in res.stdout and "{'" not in res.stdout
    assert not re.search(r"\b0\.0\d* GiB", res.stdout)


def test_plan_bad_pins_and_modes_exit_2():
    assert "expected NAME=PLACEMENT" in fails("plan", TINY, *WHERE, "--pin", "blocks.0.mlp.fc.weight")
    assert "no parameter or module" in fails("plan", TINY, *WHERE, "--pin", "nope.weight=S(0)")
    assert "search_mode 'fast' is invalid" in fails("plan", TINY, *WHERE, "--search-mode", "fast")
    w = "blocks.0.mlp.fc.weight"      # issue 17: the last of two contradicting pins used to win silently
    assert "pinned twice" in fails("plan", TINY, *WHERE, "--pin", f"{w}=S(0)", "--pin", f"{w}=S(1)")


@pytest.mark.parametrize("devices,batch,bad", [("4", "-8", "global_batch"), ("4", "0", "global_batch"),
                                               ("0", "8", "devices")])
def test_sizes_must_be_positive(devices, batch, bad):
    """issue 17: plan(global_batch=-8) was a bare AssertionError, evaluate(global_batch=0) 'not divisible'."""
    from autopar.errors import StrategyError
    for call in (lambda: autopar.plan(TINY, cluster="cpu", devices=int(devices), global_batch=int(batch)),
                 lambda: autopar.evaluate(TINY, cluster="cpu", devices=int(devices), global_batch=int(batch),
                                          strategy="dp=1")):
        with pytest.raises(StrategyError, match=f"{bad} must be a positive integer"):
            call()


def test_pipeline_plan_and_timeline(tmp_path, saved_plan):
    path = tmp_path / "pp.json"
    ok("plan", TINY, *WHERE, "--strategy", "pp=2,tp=2,microbatches=4,schedule=1f1b", "--out", path)
    data = json.loads(path.read_text())
    assert data["pipeline"]["layers"] == [1, 1] and data["mesh"]["axes"] == ["pp", "dp", "tp"]
    png = tmp_path / "timeline.png"
    res = ok("show", path, "--timeline", png)
    assert png.stat().st_size > 0 and "pipeline" in res.stdout and "bubble" in res.stdout
    assert "no pipeline" in fails("show", saved_plan, "--timeline", tmp_path / "none.png")
    assert "micro_batch_num" in fails("plan", TINY, *WHERE, "--strategy", "pp=4,microbatches=2")


def test_diff_two_plans(tmp_path, monkeypatch):
    """issue 18: `autopar diff a.json b.json`: what changed (per template of the repeated layers) and what it does
    to the predictions, in human units with signed deltas; exit 0 when identical, 1 when not; --json only JSON."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ok("plan", TINY, *WHERE, "--strategy", "dp=2,tp=2", "--out", a)
    ok("plan", TINY, *WHERE, "--strategy", "dp=4", "--out", b)
    res = run("diff", a, b, "--json")
    assert res.exit_code == 1
    d = json.loads(res.stdout)          # nothing but JSON
    assert not d["identical"] and d["same_model"] and d["parallel"] == {"dp": [2, 4], "tp": [2, 1]}
    assert 0 < d["params"]["changed"] <= d["params"]["of"] and "step_time_s" in d["predicted"]
    q = next(t for t in d["params"]["templates"] if t["pattern"] == "model.blocks.*.attn.q.weight")
    assert (q["from"], q["to"], q["count"]) == (["R", "S(0)"], ["R", "R"], 2)
    from rich.console import Console
    monkeypatch.setattr("autopar.cli.out", Console(highlight=False, width=200))    # a wide terminal: no wrapping
    res = run("diff", a, b, "--limit", "0")
    assert res.exit_code == 1
    text = " ".join(res.stdout.split())
    assert "dp │ 2 -> 4" in text and "placed otherwise" in text
    assert "model.blocks.*.attn.q.weight │ R,S(0) -> R,R (x2)" in text
    assert "model.blocks.*.attn.q:linear │ batch0,colwise (S(0),S(2)) -> batch0,replicate (S(0),R) (x2)" in text
    st = re.search(r"step time │ ([\d.]+) ms -> ([\d.]+) ms \(([+-][\d.]+ µs), ([+-][\d.]+)%\)", text)
    assert st, text
    pm = re.search(r"peak memory per device │ ([\d.]+) MiB -> ([\d.]+) MiB \((\+[\d.]+ KiB), (\+[\d.]+)%\)", text)
    assert pm, text
    res = run("diff", a, a)
    assert res.exit_code == 0 and "are the same plan" in res.stdout
    same = run("diff", a, a, "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["identical"]
    assert "does not exist" in fails("diff", a, tmp_path / "none.json")

@pytest.mark.parametrize("strategy,devices,header", [("dp=2,cp=2,tp=2", 8, ["dp", "tp"]),
                                                     ("dp=2,tp=4,tp_mode=mesh", 8, ["dp", "tp_row|tp"])])
def test_show_heads_the_placement_columns_by_the_axes_they_hold(tmp_path, strategy, devices, header):
    """The placements are per (dp, tp): with cp there is no cp column (a cp
    rank holds the weights whole; the tp placements were shown under cp
    before), and a mesh's tp column holds each of its axes."""
    g = autopar.api.as_graph("llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,seq=16,vocab=64")
    p = autopar.plan(g, cluster="cpu", devices=devices, global_batch=8, strategy=strategy)
    assert p.placement_axes() == header
    path = p.save(tmp_path / "p.json")
    out = ok("show", path, "--limit", "0").stdout
    table = out.split("parameter placements")[1].split("\n")
    heads = next(line for line in table if "tensors" in line)
    assert [c.strip() for c in re.split(r"[┃│]", heads) if c.strip()][:len(header) + 1] == [*header, "tensors"]
