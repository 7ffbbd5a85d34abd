"""The Plan record: JSON round trip, determinism, schema validation, model checks, summary."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

import autopar
from autopar import ParallelConfig, Plan, PlanError
from autopar.api import as_graph, sharding_from_plan
from autopar.plan import PLAN_SCHEMA, PLAN_VERSION
from autopar.spec import FIELDS

GPT = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"
LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,seq=16,vocab=128"


@pytest.fixture(scope="module")
def gpt_graph():
    return as_graph(GPT)


@pytest.fixture(scope="module")
def gpt_plan(gpt_graph):
    return autopar.plan(gpt_graph, cluster="cpu", devices=4, global_batch=8, strategy="dp=2,tp=2")


# ------------------------------------------------------------------ serialisation
def test_round_trip(gpt_plan, tmp_path):
    path = gpt_plan.save(tmp_path / "plan.json")
    assert path.read_text() == gpt_plan.to_json()
    loaded = Plan.load(path)
    assert loaded.to_json() == gpt_plan.to_json()
    assert loaded == gpt_plan                       # data equal (the graph is not compared)
    assert loaded.strategy == gpt_plan.strategy
    assert loaded.mesh_shape == (2, 2)
    assert loaded.fingerprint == gpt_plan.fingerprint
    assert Plan.from_dict(json.loads(gpt_plan.to_json())).to_json() == gpt_plan.to_json()


def test_json_is_sorted_and_has_no_timing(gpt_plan):
    d = json.loads(gpt_plan.to_json())
    assert list(d) == sorted(d)
    assert d["plan_version"] == PLAN_VERSION
    assert "planning_time_s" not in gpt_plan.to_json()
    assert gpt_plan.planning_time_s is not None and gpt_plan.planning_time_s >= 0


@pytest.mark.parametrize("strategy", ["dp=2,tp=2", "auto"])
def test_byte_identical_for_same_inputs(strategy):
    a = autopar.plan(GPT, cluster="cpu", devices=4, global_batch=8, strategy=strategy)
    b = autopar.plan(GPT, cluster="cpu", devices=4, global_batch=8, strategy=strategy)   # traced again
    assert a.to_json() == b.to_json()


def test_plan_of_module_equals_plan_of_zoo_string(gpt_plan):
    from autopar import zoo
    z = zoo.build(GPT, device="cpu", batch=2)
    p = autopar.plan(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target,
                     cluster="cpu", devices=4, global_batch=8, strategy="dp=2,tp=2")
    assert p.fingerprint == gpt_plan.fingerprint
    assert p.data["params"] == gpt_plan.data["params"]


# ------------------------------------------------------------------ schema errors
def _bad(plan: Plan, edit) -> PlanError:
    d = copy.deepcopy(plan.to_dict())
    edit(d)
    with pytest.raises(PlanError) as ei:
        Plan.from_dict(d)
    return ei.value


def test_missing_top_level_key(gpt_plan):
    e = _bad(gpt_plan, lambda d: d.pop("ops"))
    assert "'ops' is a required property" in str(e)


def test_missing_nested_key(gpt_plan):
    e = _bad(gpt_plan, lambda d: d["parallel"].pop("tp"))
    assert "at 'parallel'" in str(e) and "'tp'" in str(e)


def test_bad_placement_string(gpt_plan):
    name = "model.blocks.0.attn.q.weight"
    e = _bad(gpt_plan, lambda d: d["params"][name].__setitem__(1, "S(x)"))
    msg = str(e)
    assert f"params/{name}/1" in msg and "S(x)" in msg


def test_bad_op_placement(gpt_plan):
    op = next(iter(gpt_plan.data["ops"]))
    e = _bad(gpt_plan, lambda d: d["ops"][op]["out"].__setitem__(0, "Shard(0)"))
    assert f"ops/{op}/out/0" in str(e)


@pytest.mark.parametrize("version", [PLAN_VERSION + 1, 0, "1", None])
def test_wrong_plan_version(gpt_plan, version):
    e = _bad(gpt_plan, lambda d: d.__setitem__("plan_version", version))
    assert f"plan_version {version!r} is not supported" in str(e)


def test_unknown_key_and_bad_values(gpt_plan):
    assert "'extra'" in str(_bad(gpt_plan, lambda d: d.__setitem__("extra", 1)))
    assert "at 'parallel/zero'" in str(_bad(gpt_plan, lambda d: d["parallel"].__setitem__("zero", 5)))
    assert "at 'devices'" in str(_bad(gpt_plan, lambda d: d.__setitem__("devices", 0)))


def test_parallel_schema_is_generated_from_the_strategy_keys(gpt_plan):
    schema = PLAN_SCHEMA["properties"]["parallel"]
    assert list(schema["properties"]) == [k.name for k in FIELDS]
    # keys recorded only when changed (cp) are left out of plans at their default
    assert list(ParallelConfig().as_dict()) == [k.name for k in FIELDS if k.recorded == "always"]
    assert list(ParallelConfig(cp=2, copies=2, tp=8, tp_mode="2.5d", tp_depth=2, fsdp_layers=1).as_dict()) == \
        [k.name for k in FIELDS]
    assert schema["properties"] == {k.name: k.schema() for k in FIELDS}
    # the keys of the first plans stay required; the later ones are optional for the plans written before them
    assert schema["required"] == ["dp", "tp", "pp", "microbatches", "schedule", "recompute", "zero"]
    assert "'bogus'" in str(_bad(gpt_plan, lambda d: d["parallel"].__setitem__("bogus", 1)))
    for k in FIELDS:
        if k.choices:
            good, bad = k.choices[-1], "bogus" if k.type is str else max(k.choices) + 1
        elif k.type is bool:
            good, bad = not k.default, "true"
        else:
            good, bad = k.minimum + 1, k.minimum - (1 if k.type is int else 0)
        d = copy.deepcopy(gpt_plan.to_dict())
        d["parallel"][k.name] = good
        if k.name in ("dp", "tp", "pp", "cp"):     # the mesh restates these: a plan that contradicts it is refused
            d["parallel"][k.name] = 2 * gpt_plan.parallel.get(k.name, 1)
            with pytest.raises(PlanError, match=f"the mesh gives {k.name}="):
                Plan.from_dict(d)
        else:
            assert Plan.from_dict(d).parallel[k.name] == good
        e = _bad(gpt_plan, lambda d: d["parallel"].__setitem__(k.name, bad))
        assert f"at 'parallel/{k.name}'" in str(e), (k.name, bad)


def test_config_of_a_plan(gpt_plan, tmp_path):
    cfg = gpt_plan.config
    assert cfg == dataclasses.replace(autopar.parse_strategy("dp=2,tp=2", 4), precision=gpt_plan.data["precision"])
    assert cfg.to_string() == gpt_plan.strategy
    assert Plan.load(gpt_plan.save(tmp_path / "p.json")).config == cfg
    # a plan written before the memory options: their defaults, the precision the plan's
    d = copy.deepcopy(gpt_plan.to_dict())
    d["parallel"] = {k: d["parallel"][k] for k in ("dp", "tp", "pp", "microbatches", "schedule", "recompute", "zero")}
    d["precision"] = "mixed"
    old = Plan.from_dict(d)
    assert old.config == ParallelConfig(dp=2, tp=2, precision="bf16")
    assert old.strategy == "dp=2,tp=2,pp=1,microbatches=1,recompute=none,zero=0"


def test_not_an_object():
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_dict([1, 2])


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"plan_version": PLAN_VERSION}))
    with pytest.raises(PlanError, match=r"wrong\.json.*is a required property"):
        Plan.load(wrong)


# ------------------------------------------------------------------ model checks and summary
def test_check_model(gpt_plan, gpt_graph):
    gpt_plan.check_model(gpt_graph.fingerprint)        # same model: fine
    other = as_graph("gpt:layers=2,hidden=128,heads=4,seq=16,vocab=128")
    with pytest.raises(PlanError) as ei:
        gpt_plan.check_model(other.fingerprint, "BiggerGPT")
    msg = str(ei.value)
    assert gpt_plan.fingerprint in msg and other.fingerprint in msg
    assert "BiggerGPT" in msg


def test_summary(gpt_plan):
    s = gpt_plan.summary()
    assert gpt_plan.strategy in s
    assert "fits" in s and "DOES NOT FIT" not in s
    assert "dp=2 x tp=2" in s
    assert gpt_plan.fingerprint in s
    assert "cpu" in s
    assert repr(gpt_plan).startswith("Plan(")


def test_summary_auto_search():
    p = autopar.plan(GPT, cluster="cpu", devices=2, global_batch=4)
    s = p.summary()
    assert "dynamic_programming" in s and "candidates evaluated" in s and "tp placements" in s
    assert p.strategy in s


# ------------------------------------------------------------------ sharding_from_plan
@pytest.mark.parametrize("spec,strategy,devices", [(GPT, "dp=2,tp=2", 4), (GPT, "tp=4", 4),
                                                   (LLAMA, "tp=2", 2)])
def test_sharding_from_plan(spec, strategy, devices):
    g = as_graph(spec)
    p = autopar.plan(g, cluster="cpu", devices=devices, global_batch=8, strategy=strategy)
    from autopar.api import planner_for
    ev = planner_for(g, "cpu", "adamw", None, devices=devices, global_batch=8)
    cfg = autopar.parse_strategy(strategy, devices)
    want, _ = ev.sharding(cfg)
    got = sharding_from_plan(g, p)
    assert got is not None
    assert got.n == cfg.tp
    for nd in g.nodes:
        if nd.kind in ("param", "buffer"):
            assert got.out[nd.name] == want.out.get(nd.name, "R"), nd.name
    for name, st in want.strategy.items():
        mine = got.strategy[name]
        assert (mine.name, mine.ins, mine.out, mine.split, mine.kernel) == \
            (st.name, st.ins, st.out, st.split, st.kernel), name
        assert got.out[name] == want.out[name]
    # and through a JSON round trip
    again = sharding_from_plan(g, Plan.from_dict(json.loads(p.to_json())))
    assert again.out == got.out


def test_sharding_from_plan_other_graph(gpt_plan):
    g = as_graph("mlp:layers=2,inp=8,hidden=16,classes=4")
    assert sharding_from_plan(g, gpt_plan) is None


# ------------------------------------------------------------------ edited plans (issue 17)
def _first_weight(plan: Plan, placement: str) -> str:
    return next(k for k, v in sorted(plan.data["params"].items()) if k.endswith("weight") and v[1] == placement)


def test_edited_plan_contradicting_its_mesh_is_refused(gpt_plan):
    assert "the mesh gives tp=2 but 'parallel' says tp=4" in str(
        _bad(gpt_plan, lambda d: d["parallel"].update(tp=4)))
    assert "'devices' is 8" in str(_bad(gpt_plan, lambda d: d.update(devices=8)))
    assert "malformed" in str(_bad(gpt_plan, lambda d: d["mesh"].update(axes=["dp", "dp"])))


@pytest.mark.parametrize("edit,words", [
    (lambda p, d: d["params"].__setitem__(_first_weight(p, "S(0)"), ["R", "S(7)"]), ["S(7)", "splits dim 7"]),
    (lambda p, d: d["params"].__setitem__(_first_weight(p, "S(0)"), ["R", "S(1)"]),
     ["in 'params' but op", "reads it as S(0)"]),
    (lambda p, d: d["params"].pop(_first_weight(p, "S(0)")), ["do not match the model", "missing"]),
    (lambda p, d: d["params"].__setitem__("model.nope.weight", ["R", "R"]), ["unknown model.nope.weight"]),
])
def test_edited_plan_contradicting_the_model_is_refused(gpt_plan, gpt_graph, edit, words):
    d = copy.deepcopy(gpt_plan.to_dict())
    edit(gpt_plan, d)
    edited = Plan.from_dict(d)        # each part is well formed on its own
    with pytest.raises(PlanError) as e:
        edited.check_graph(gpt_graph)
    for w in words:
        assert w in str(e.value)
    gpt_plan.check_graph(gpt_graph)   # the plan as made passes


def test_save_is_atomic(gpt_plan, tmp_path, monkeypatch):
    """A write that fails midway leaves the previous plan whole (issue 17)."""
    path = gpt_plan.save(tmp_path / "plan.json")
    before = path.read_text()

    def broken(self):
        raise OSError("disk full")
    monkeypatch.setattr(Plan, "to_json", broken)
    with pytest.raises(OSError, match="disk full"):
        gpt_plan.save(path)
    assert path.read_text() == before and Plan.load(path) == gpt_plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]      # no temporary left behind


# ------------------------------------------------------------------ the compact format (issue 18, item 7)
GPT3 = "gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200"
GPT3_STRATEGY = "dp=32,tp=4,pp=8,microbatches=48,schedule=interleaved,chunks=2,zero=1"
#: the same plan's to_json() in plan version 1 (ops under fx node names, every layer written out): 692,297 bytes
#: (the automatic 175B plan on 1024 A100s: 693,284); version 2 writes it in 21,096
GPT3_V1_BYTES = 692_297
V1_PLAN = Path(__file__).parent / "data" / "gpt-plan-v1.json"     # written by autopar 0.1.0 at plan version 1


@pytest.fixture(scope="module")
def gpt3_plan():
    return autopar.plan(GPT3, cluster="dgx-a100-80g", devices=1024, global_batch=1536, strategy=GPT3_STRATEGY)


def test_175b_plan_is_compact(gpt3_plan, tmp_path):
    text = gpt3_plan.to_json()
    assert len(text) * 10 <= GPT3_V1_BYTES, len(text)         # 1/33 measured; at least 1/10
    d = json.loads(text)
    assert d["plan_version"] == PLAN_VERSION == 2
    # one template stands for the 96 equal blocks: their 1,536 parameters and ~2,600 ops are not listed one by one
    (t,) = d["templates"]
    assert t["instances"] == [f"model.blocks.{i}" for i in range(96)] == d["layers"][0]["instances"]
    assert len(d["params"]) + 96 * len(t["params"]) == len(gpt3_plan.data["params"]) == 1541
    assert "attn.q.weight" in t["params"] and "attn.q:linear" in t["ops"] and ":add" in t["ops"]
    # keys are module paths and positions, not fx's counters; no default fields
    assert not re.search(r'"(add|linear|view)_\d+"', text)
    assert '"reduce_dtype"' not in text and '"split": [\n    false,\n    false' not in text
    assert '"overlap"' not in text and '"offload"' not in text
    # and it reads back to the same plan, which writes the same bytes
    loaded = Plan.load(gpt3_plan.save(tmp_path / "175b.json"))
    assert loaded == gpt3_plan and loaded.to_json() == text
    assert loaded.data["ops"].keys() == gpt3_plan.data["ops"].keys() and len(loaded.data["ops"]) > 2500


def test_stable_op_keys(gpt_graph):
    """A layer's op keys do not depend on how many layers come before or after it."""
    keys2 = gpt_graph.op_keys()
    keys4 = as_graph(GPT.replace("layers=2", "layers=4")).op_keys()
    first = {k for k in keys2.values() if k.startswith("model.blocks.0")}
    assert first and first == {k for k in keys4.values() if k.startswith("model.blocks.0")}
    assert {k for k in keys2.values() if not k.startswith("model.blocks.")} == \
        {k for k in keys4.values() if not k.startswith("model.blocks.")}
    assert keys2["add_8"] == "model.blocks.0.attn.o:add" and keys2["cross_entropy"] == ":cross_entropy"
    assert len(set(keys2.values())) == len(keys2)


def test_byte_deterministic_whatever_the_order(gpt_plan):
    """Same plan, same bytes: the order entries were recorded in does not show."""
    shuffled = copy.deepcopy(gpt_plan.data)
    for section in ("params", "ops"):
        shuffled[section] = dict(reversed(list(shuffled[section].items())))
    again = Plan(shuffled)
    assert again == gpt_plan and again.to_json() == gpt_plan.to_json()


def test_an_edited_layer_leaves_the_template(gpt_plan, gpt_graph):
    """One layer placed otherwise is written out on its own; a flat entry wins over a template."""
    data = copy.deepcopy(gpt_plan.data)
    data["ops"]["model.blocks.1.mlp.gelu:gelu"]["strategy"][1] = "edited"
    d = json.loads(Plan(data).to_json())
    assert "templates" not in d and "model.blocks.1.mlp.gelu:gelu" in d["ops"]      # two layers, now unequal
    d = json.loads(gpt_plan.to_json())
    d["params"]["model.blocks.1.mlp.fc.weight"] = ["R", "R"]                       # a hand edit of one layer
    edited = Plan.from_dict(d)
    assert edited.data["params"]["model.blocks.1.mlp.fc.weight"] == ["R", "R"]
    assert edited.data["params"]["model.blocks.0.mlp.fc.weight"] == gpt_plan.data["params"]["model.blocks.0.mlp.fc.weight"]
    with pytest.raises(PlanError, match="in 'params' but op"):
        edited.check_graph(gpt_graph)


def test_bad_template_placement(gpt_plan):
    d = json.loads(gpt_plan.to_json())
    d["templates"][0]["params"]["attn.q.weight"][1] = "S(x)"
    with pytest.raises(PlanError, match="templates/0/params/attn.q.weight/1"):
        Plan.from_dict(d)


def test_version_1_plans_still_load(gpt_plan, gpt_graph, tmp_path):
    """A plan file written at plan version 1 (tests/data, by the code before this format) reads, checks against
    its model, gives the same decisions, is written back as it was, and upgrades to this plan."""
    old = Plan.load(V1_PLAN)
    # its predictions are the model's of its day: the step time since counts every pass torch's
    # optimizer makes over its state (it was one read and one write), the activations the attention
    # output once (the output projection's input, in the same storage)
    assert old.version == 1 and old.strategy == gpt_plan.strategy
    assert old.predicted["step_time_s"] < gpt_plan.predicted["step_time_s"]
    assert old.predicted["optimizer_time_s"] < gpt_plan.predicted["optimizer_time_s"]
    assert old.predicted["memory"]["activations"] > gpt_plan.predicted["memory"]["activations"]
    # its decisions are its own: the manual placements since keep the row-parallel biases, and the
    # residual adds after them, whole (Megatron's layout: all-reduced, then added), where it split
    # them over the hidden dim; nothing else moved
    biases = {f"model.blocks.{i}.{m}.bias" for i in (0, 1) for m in ("attn.o", "mlp.proj")}
    assert {k for k, v in old.data["params"].items() if v != gpt_plan.data["params"][k]} == biases
    assert old.data["params"].keys() == gpt_plan.data["params"].keys() and "add_8" in old.data["ops"]
    old.check_graph(gpt_graph)
    a, b = sharding_from_plan(gpt_graph, old), sharding_from_plan(gpt_graph, gpt_plan)
    moved = {n for n in a.out if a.out[n] != b.out.get(n)} | {n for n in a.strategy if a.strategy[n] != b.strategy[n]}
    assert moved and all(gpt_graph[n].target == "add" or gpt_graph[n].is_state for n in moved)
    assert old.to_json() == V1_PLAN.read_text()
    assert Plan.load(old.save(tmp_path / "v1.json")) == old
    new = old.upgraded(gpt_graph)
    # the cluster is the one the old plan was made for: the cpu preset since gained checkpoint_dispatch_s
    # and a source for unaligned_matmul_efficiency (0 there: both spell "not modelled")
    cur = copy.deepcopy(gpt_plan.data)
    assert cur["cluster"]["spec"]["device"].pop("checkpoint_dispatch_s") > 0
    assert cur["cluster"]["spec"]["sources"].pop("device.checkpoint_dispatch_s")
    assert cur["cluster"]["spec"]["device"].pop("unaligned_matmul_efficiency") == 0
    assert cur["cluster"]["spec"]["sources"].pop("device.unaligned_matmul_efficiency")
    cur["predicted"] = old.data["predicted"]          # an upgrade keeps the predictions as they were made
    cur["params"] = old.data["params"]                # and the decisions (above: the biases' adds)
    adds = {k for k, v in cur["ops"].items() if v != new.data["ops"].get(k)}
    assert adds and all(k.endswith((":add", ":add#1")) for k in adds)
    cur["ops"] = {k: new.data["ops"][k] if k in adds else v for k, v in cur["ops"].items()}
    assert new.version == 2 and {**new.data, "autopar_version": ""} == {**cur, "autopar_version": ""}
    assert new.to_json().replace(new.data["autopar_version"], "") == \
        Plan(cur).to_json().replace(gpt_plan.data["autopar_version"], "")
    with pytest.raises(PlanError, match="fingerprint"):
        old.upgraded(as_graph("mlp:layers=2,inp=8,hidden=16,classes=4"))
    # a diff across plan versions names the parameters that moved (ops are keyed apart: not compared)
    assert old.diff(gpt_plan)["ops"]["changed"] is None and old.diff(gpt_plan)["params"]["changed"] == len(biases)


def test_diff_by_template():
    a = autopar.plan(GPT, cluster="cpu", devices=4, global_batch=8, strategy="dp=2,tp=2")
    b = autopar.plan(GPT, cluster="cpu", devices=4, global_batch=8, strategy="dp=4")
    d = a.diff(b)
    assert not d["identical"] and d["parallel"] == {"dp": [2, 4], "tp": [2, 1]}
    q = next(t for t in d["params"]["templates"] if t["pattern"] == "model.blocks.*.attn.q.weight")
    assert q == {"pattern": "model.blocks.*.attn.q.weight", "from": ["R", "S(0)"], "to": ["R", "R"], "count": 2}
    assert sum(t["count"] for t in d["params"]["templates"]) == d["params"]["changed"]
    st = d["predicted"]["step_time_s"]
    assert st["delta"] == pytest.approx(st["to"] - st["from"], rel=1e-5)
    assert "memory.weights" in d["predicted"] and "peak_memory_bytes" in d["predicted"]
    assert a.diff(a) == {"identical": True, "same_model": True, "request": {}, "parallel": {}, "pipeline": {},
                         "params": {"changed": 0, "of": 37, "templates": []}, "predicted": {}, "other": [],
                         "ops": {"changed": 0, "of": len(a.data["ops"]), "templates": []}}
