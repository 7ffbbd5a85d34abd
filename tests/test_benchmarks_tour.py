"""benchmarks/tour.py (issue 18's tour) and benchmarks/matrix.py's ``--merge``,
without spawning: the tour's planning of the example MLP on both clusters (each
refusal one line, auto's choice a strategy parallelize accepts), its table, and
the merge of a partial matrix run into a saved one."""
from __future__ import annotations

import pytest

from autopar import parse_strategy
from benchmarks import matrix, tour


@pytest.fixture(scope="module")
def mlp_plans():
    return tour.plan_cells(["mlp"])


def test_the_tour_plans_every_cell_or_says_why_in_one_line(mlp_plans):
    assert set(mlp_plans) == {("mlp", cl, col) for cl in tour.CLUSTERS for col in tour.STRATEGIES}
    for (_, cl, col), cell in mlp_plans.items():
        assert "error" not in cell, cell
        cfg = parse_strategy(cell["config"])
        assert cfg.devices == tour.DEVICES and cell["step_s"] > 0 and cell["fits"]
        # the GPU preset's default precision is bf16: what its rows run
        assert cfg.precision == ("bf16" if cl == "dgx-h100" else "fp32")
        if col != "auto":
            assert parse_strategy(tour.STRATEGIES[col], tour.DEVICES).dp == cfg.dp


def test_tour_table_and_marks(mlp_plans):
    details = []
    for (m, cl, col), p in mlp_plans.items():
        ok = "error" not in p
        st = "ok" if ok else p["error"]
        run0 = {"local_numel": 10, "full_numel": 10}     # every weight whole: auto's tp says so
        details.append({"model": m, "cluster": cl, "column": col, "strategy": tour.STRATEGIES[col], "status": st,
                        "mark": tour._mark(col, p, st, run0), "predicted_step_s": p.get("step_s")})
    r = tour.result(["mlp"], details)
    assert r["table"]["columns"][:2] == ["model", "cluster"] and len(r["table"]["rows"]) == len(tour.CLUSTERS)
    row = dict(zip(r["table"]["columns"], r["table"]["rows"][0]))
    # the example MLP's 2 blocks on 4 pipeline stages: the input layer alone first, the head alone last
    assert row["pp"] == "yes" and row["dp"] == "yes" and row["auto"].startswith("yes: ")
    assert r["summary"] == {"cells": 10, "pass": 10, "not applicable": 0, "fail": 0}
    assert tour.short("dp=4,tp=1,pp=1,microbatches=1,recompute=none,zero=1,precision=fp32") == \
        "dp=4,zero=1,precision=fp32"


def _cell(model, family, status):
    return {"model": model, "family": family, "strategy": matrix.FAMILIES[family][0], "status": status}


def test_matrix_merge_keeps_the_saved_cells_and_marks_the_unrun():
    old = matrix.result(["nanogpt", "hf-gpt2"], ["dp", "tp"],
                        [_cell(m, f, "ok") for m in ("nanogpt", "hf-gpt2") for f in ("dp", "tp")])
    old["versions"] = {"commit": "aaa"}
    new = matrix.result(["tv-resnet18"], ["tp", "dp", "2d"],
                        [_cell("tv-resnet18", "dp", "ok"), _cell("tv-resnet18", "tp", "ok"),
                         _cell("tv-resnet18", "2d", "StrategyError: no")])
    new["versions"] = {"commit": "bbb"}
    redo = matrix.result(["nanogpt"], ["tp"], [_cell("nanogpt", "tp", "RuntimeError: boom")])
    redo["versions"] = {"commit": "ccc"}
    out = matrix.merge(matrix.merge(old, new), redo)
    # MODELS / FAMILIES order, whatever order the runs came in
    assert out["params"]["models"] == ["nanogpt", "hf-gpt2", "tv-resnet18"]
    assert list(out["params"]["families"]) == ["dp", "tp", "2d"]
    rows = {r[0]: r[1:] for r in out["table"]["rows"]}
    assert rows == {"nanogpt": ["yes", "FAIL", "-"], "hf-gpt2": ["yes", "yes", "-"],
                    "tv-resnet18": ["yes", "yes", "n/a"]}
    assert out["summary"] == {"cells": 7, "pass": 5, "not applicable": 1, "fail": 1, "not run": 2}
    assert out["notes"][:2] == ["nanogpt / tp: RuntimeError: boom", "tv-resnet18 / 2d: StrategyError: no"]
    assert out["notes"][2].endswith("aaa 3, ccc 1, bbb 3")    # old cells keep their run's commit
