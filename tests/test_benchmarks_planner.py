"""Smoke tests of benchmarks/planner_scaling.py and benchmarks/plan_quality.py on
a tiny GPT and the ``cpu`` preset: structure only, no timings, nothing saved."""
from __future__ import annotations

import pytest

from benchmarks import plan_quality, planner_scaling
from benchmarks.planner_scaling import ModelSpec

TINY = {"tiny": ModelSpec("tiny", layers=2, hidden=64, heads=4, batch=8)}
CASES = [("tiny", "cpu", 4)]


@pytest.fixture(autouse=True)
def _small_seq(monkeypatch):
    # the benchmark's models use seq=2048 and vocab=51200; shrink them for a test
    monkeypatch.setattr(ModelSpec, "spec", property(
        lambda m: f"gpt:layers={m.layers},hidden={m.hidden},heads={m.heads},seq=16,vocab=128"))


def test_planner_scaling_structure(tmp_path):
    png = tmp_path / "scaling.png"
    r = planner_scaling.run(CASES, models=TINY, plot_path=png, log=lambda s: None)
    assert png.exists() and png.stat().st_size > 0 and r["plot"]
    rows = r["table"]["rows"]
    assert len(rows) == 1 and len(rows[0]) == len(r["table"]["columns"])
    rec = r["records"][0]
    assert rec["layers"] == 2 and rec["nodes"] > 0 and rec["devices"] == 4 and rec["global_batch"] == 8
    assert rec["strategy"] and rec["evaluated"] >= 1 and rec["grid_size"] >= rec["evaluated"]
    assert rec["plan_s"] >= rec["search_s"] > 0 and rec["grid_lines"] >= 1
    assert r["summary"]["cases"] == 1 and r["notes"]


def test_planner_targets_structure():
    from benchmarks.planner_scaling import Goal, Target
    spec = "gpt:layers={},hidden=64,heads=4,seq=16,vocab=128"
    targets = {"deep": Target("deep", spec.format(4), "cpu", 4, 8),
               "shallow": Target("shallow", spec.format(1), "cpu", 4, 8),
               "meshes": Target("meshes", spec.format(2), "cpu", 4, 8, tp_modes=("1d", "mesh"))}
    goals = [Goal("deep time", ("deep",), 1e3), Goal("depth ratio", ("deep", "shallow"), 1e3),
             Goal("impossible", ("shallow",), 0.0)]
    r = planner_scaling.run_targets(targets=targets, goals=goals, log=lambda s: None,
                                    depth_pair=("deep", "shallow"), also=[Goal("with meshes", ("meshes",), 1e3)])
    deep, shallow, meshes = r["records"]
    assert meshes["strategy"] and r["params"]["targets"]["meshes"]["tp_modes"] == ("1d", "mesh")
    # depth alone: the shallow search's evaluations made again on both graphs, timed
    same = r["same_configurations"]
    assert same["evaluations"] > 0 and same["shallow_s"] > 0 and same["deep_s"] > 0
    assert same["ratio"] == pytest.approx(same["deep_s"] / same["shallow_s"]) and "Depth alone" in r["notes"][0]
    assert deep["nodes"] > shallow["nodes"] and deep["strategy"] and deep["error"] is None
    assert deep["total_s"] == pytest.approx(deep["trace_s"] + deep["plan_s"] + deep["save_s"])
    met = {g["goal"]: g["met"] for g in r["goals"]}
    assert met == {"deep time": True, "depth ratio": True, "impossible": False, "with meshes": True}
    assert [g["counted"] for g in r["goals"]] == [True, True, True, False]     # "with meshes" measured beside
    ratio = next(g["value"] for g in r["goals"] if g["goal"] == "depth ratio")
    assert ratio == pytest.approx(deep["total_s"] / shallow["total_s"])
    assert r["summary"]["targets met"] == "2 of 3" and r["summary"]["depth ratio (x)"] == ratio
    assert deep["candidates"] > 0 and deep["ilp_solves"] is not None
    assert len(r["table"]["rows"]) == 3 and all(len(row) == len(r["table"]["columns"]) for row in r["table"]["rows"])
    # the four goals, each over targets that exist
    assert len(planner_scaling.GOALS) == 4 and all(k in planner_scaling.TARGETS
                                                   for g in planner_scaling.GOALS for k in g.keys)


def test_plan_quality_structure():
    r = plan_quality.run(CASES, models=TINY, log=lambda s: None)
    rec = r["records"][0]
    assert rec["auto"] is not None and rec["grid_best"] is not None
    # the auto planner is a grid over the same space: it can never lose to the exhaustive grid
    assert not rec["auto_below_grid"] and rec["auto_over_grid"] == pytest.approx(1.0)
    assert rec["grid_evaluated"] >= rec["auto_search"]["candidates"]
    assert rec["auto_over_dp"] is None or rec["auto_over_dp"] >= 1 - 1e-9
    assert rec["auto_over_zero3"] is None or rec["auto_over_zero3"] >= 1 - 1e-9
    assert len(r["table"]["rows"][0]) == len(r["table"]["columns"])
    assert r["summary"]["cases where auto < grid best (search bugs)"] == 0


def test_manual_strategies_cover_the_grammar():
    from autopar.api import as_graph
    from autopar.cost import fsdp_layer_params
    g = as_graph("gpt:layers=1,hidden=32,heads=4,seq=8,vocab=64")
    strategies, rejected = plan_quality.manual_strategies(g, devices=8, batch=8)
    assert rejected == 1                                  # tp=8 does not divide 4 heads
    # tp in {1, 2, 4} (dp 8, 4, 2); microbatches divide 8/dp; 3 recompute modes x 4 ZeRO stages;
    # with and without sequence parallelism where tp > 1; and copies 2 / 4 dividing the per-rank
    # microbatch with tp > 1 and ZeRO < 3 (tp=2: mb 1; tp=4: mb 1 x copies 2, 4 and mb 2 x copies 2)
    # and fsdp_layers 1, 2, 4 and 6 with ZeRO 1 and 2 (every dp > 1 here; the one block's repeated
    # parts are six layer instances with weights of their own)
    assert len(fsdp_layer_params(g)) == 6
    assert len([s for s in strategies if ",pp=1," in s]) == (1 + 2 * (2 + 3)) * 3 * 4 + (1 + 3) * 3 * 3 * 2 + \
        (1 + 2 * (2 + 3)) * 3 * 2 * 4
    assert "dp=2,tp=4,pp=1,microbatches=4,recompute=full,zero=2,fsdp_layers=1,sequence_parallel=true" in strategies
    assert "dp=2,tp=4,pp=1,microbatches=1,copies=4,recompute=none,zero=2" in strategies
    assert "dp=2,tp=4,pp=1,microbatches=4,recompute=full,zero=3,sequence_parallel=true" in strategies
    assert "dp=2,tp=4,pp=1,microbatches=4,recompute=full,zero=3" in strategies
    g2 = as_graph("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64")
    piped = [s for s in plan_quality.manual_strategies(g2, devices=8, batch=8)[0] if ",pp=2," in s]
    assert "dp=1,tp=4,pp=2,microbatches=8,schedule=interleaved,chunks=2,recompute=none,zero=0" not in piped
    assert "dp=2,tp=2,pp=2,microbatches=2,schedule=gpipe,chunks=1,recompute=selective,zero=1" in piped


def test_mesh_ilp_row_structure():
    """benchmarks/mesh_ilp.py on a tiny GPT inside one dgx node: the joint
    program is never worse than the single-axis ILP on the same group."""
    from benchmarks import mesh_ilp
    r = mesh_ilp.row("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", "dgx-a100-80g", (2, 2), 2)
    assert r["spans_nodes"] == [False, False] and r["variables"] > 0
    assert r["joint_s"] <= r["one_d_s"] * (1 + 1e-9)
    assert r["batch_1d_s"] is not None and r["joint_s"] <= r["batch_1d_s"] * (1 + 1e-9)


def test_mesh3_bian_row_structure():
    """benchmarks/mesh3_bian.py on a tiny GPT: the pins do force Bian's triple
    on every linear, and the free three-axis program is never worse than
    that pinned layout (it is one of its choices)."""
    from benchmarks import mesh3_bian
    r = mesh3_bian.row("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", "dgx-a100-80g", (2, 2, 2), 4)
    assert r["linears"] > 0 and r["pinned_bian_linears"] == r["linears"]
    assert r["joint_s"] <= r["bian_s"] * (1 + 1e-9)


def test_mesh_search_row_structure():
    """benchmarks/mesh_search.py on a tiny GPT: the search with meshes tries
    some and its plan is no slower than the 1d search's."""
    from benchmarks import mesh_search
    mesh_search.NAMES["gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"] = "tiny"
    r = mesh_search.row("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128", "dgx-a100-80g", 8, 8)
    assert r["meshes_tried"] >= 0 and r["searched_step_s"] <= r["flat_step_s"] * (1 + 1e-9)


def test_dp_axis_bound_structure():
    """The per-weight dp bound on its quick case: a row per case, the bound
    never below the estimate's gain (no mix beats its ZeRO-1/2 form)."""
    from benchmarks import dp_axis_bound
    r = dp_axis_bound.run(dp_axis_bound.QUICK + ["llama8b-h100x8"])
    assert len(r["table"]["rows"]) == 2 and r["summary"]["cases"] == 2
    for rec in r["records"]:
        assert rec["best_s"] > 0 and 0.0 <= rec["estimate_gain"] <= rec["bound_gain"] + 1e-12
    tight = r["records"][1]     # Llama-3 8B on 8 H100: ZeRO-3 is picked, ZeRO-1/2 do not fit
    assert "zero=3" in tight["best"] and tight["pairs"] > 0 and tight["bound_gain"] > 0
    assert 0 < tight["estimate_whole_share"] < 1


def test_manual_placements_structure():
    """Manual tp on a published checkpoint's config: Gemma 2 9B (eager attention only: its sdpa
    row is refused by transformers and recorded so), the greedy within 1.2x of the ILP on the
    same mesh (1.67x before its look-ahead knew eager attention's scores)."""
    pytest.importorskip("transformers")
    from benchmarks import manual_placements
    r = manual_placements.run(manual_placements.QUICK)
    rec = r["records"][0]
    assert r["summary"]["cases"] == 1 and len(r["table"]["rows"]) == 1
    assert "does not support" in rec["sdpa"]["error"]
    assert 1.0 - 1e-9 <= rec["eager"]["ratio"] < 1.2
