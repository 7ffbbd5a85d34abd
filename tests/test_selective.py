"""Selective recompute keeps what a backward needs (issue 17): the runtime's
checkpoint policy and the cost model keep the same values, and selective
never keeps more than no recompute (before, every weight matmul's output was
kept, the row-parallel ones whole before their reduction: 1.47x the
activations of sequence parallelism without recompute)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import ops
from autopar.api import as_graph, planner_for, _config
from autopar.sharding import selective_keeps

GPT = "gpt:layers={layers},hidden=256,heads=8,seq=128,vocab=512"
LLAMA = "llama:layers={layers},hidden=256,heads=8,kv_heads=4,ffn=704,seq=128,vocab=512"


def _layer_activations(spec: str, strategy: str) -> float:
    acts = [autopar.evaluate(as_graph(spec.format(layers=n)), cluster="dgx-a100-80g", devices=8, global_batch=1,
                             strategy=strategy).memory["activations"] for n in (2, 3)]
    return acts[1] - acts[0]


@pytest.mark.parametrize("spec", [GPT, LLAMA])
@pytest.mark.parametrize("extra", ["", ",sp=true"])
def test_selective_keeps_less_than_no_recompute(spec, extra):
    cfg = f"dp=1,tp=8,microbatches=1,precision=bf16{extra}"
    none = _layer_activations(spec, cfg)
    sel = _layer_activations(spec, cfg + ",recompute=selective")
    full = _layer_activations(spec, cfg + ",recompute=full")
    assert full < sel < none, (full, sel, none)


def _kept_kinds(spec: str, strategy: str, devices: int) -> dict[str, list[str]]:
    g = as_graph(spec.format(layers=2))
    cfg = _config(strategy, devices)
    sh, _ = planner_for(g, "dgx-a100-80g", "adamw", None, devices=devices, global_batch=1).sharding(cfg)
    keeps = selective_keeps(g, sh)
    out: dict[str, list[str]] = {}
    for nd in g.nodes:
        if nd.group == "model.blocks.0" and (nd.kind in ("linear", "sdpa")):
            out.setdefault("kept" if nd.name in keeps else "run again", []).append(
                nd.kind if nd.kind == "sdpa" else sh.strategy[nd.name].name)
    return out


def test_row_parallel_outputs_are_run_again():
    # the row-parallel linears' partial outputs are read by a reduction and adds, which keep nothing
    got = _kept_kinds(GPT, "dp=1,tp=8,sp=true", 8)
    assert sorted(got["kept"]) == ["colwise"] * 4 + ["sdpa"], got
    assert got["run again"] == ["rowwise", "rowwise"], got
    # on one device the attention projection's output feeds the second norm (its input is saved):
    # kept; the last projection's only reaches the layer's output
    one = _kept_kinds(GPT, "dp=1", 1)
    assert len(one["kept"]) == 6 and len(one["run again"]) == 1, one


@pytest.mark.parametrize("spec", [GPT, LLAMA])
def test_copied_layers_keep_what_their_source_keeps(spec):
    # selective_keeps decides the instances a search copied from another once (flat in depth):
    # the same set as deciding every instance of the same decisions on its own
    import dataclasses
    from autopar.sharding import _selective_keeps
    g = as_graph(spec.format(layers=6))
    for strategy in ("dp=1,tp=8", "dp=1,tp=8,sp=true", "dp=2,tp=4"):
        sh, _ = planner_for(g, "dgx-a100-80g", "adamw", None, devices=8, global_batch=2).sharding(
            _config(strategy, 8))
        assert sh.copied_from, strategy      # the search copied layers: the shortcut is exercised
        alone = dataclasses.replace(sh, copied_from={})
        assert selective_keeps(g, sh) == _selective_keeps(g, alone), strategy


def test_runtime_policy_saves_the_kept_nodes_only():
    """The compiled regions save, under selective recompute, exactly one
    matmul output per kept node (the markers around it) and nothing else."""
    import sys
    sys.path.insert(0, "tests")
    from test_regions import _program
    from autopar.compile.regions import layer_regions
    from autopar.runtime import regions as R_

    spec = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"
    z, x, y, graph, prog = _program(spec)
    rm = layer_regions(prog.module, graph, prog.keeps)
    R_.apply_recompute(rm, "selective", ops.save_ops())
    saved: list[str] = []
    policy = R_.recompute_policy

    def counting(save_ops):
        inner = policy(save_ops)

        def wrapped(ctx, op, *a, **k):
            out = inner(ctx, op, *a, **k)
            if not ctx.is_recompute and out.name == "MUST_SAVE":
                saved.append(str(op))
            return out
        return wrapped

    R_.recompute_policy = counting
    try:
        rm(x, y).backward()
    finally:
        R_.recompute_policy = policy
    kept = [n for n in prog.keeps if graph[n].group is not None]
    assert len(kept) == 2 * 6
    assert len(saved) == len(kept), saved


def test_full_recompute_charges_no_regather_inside_layers():
    """Under recompute the checkpoint keeps nothing of a sequence-parallel
    entry inside a layer: its forward gather runs again with the layer
    (charged with the replay) and no regather follows; outside the layers
    (the head) the regather stays. Selective recompute replays the forward
    collectives up to the layer's last saving node. The cached sums are kept
    per recompute mode."""
    from autopar.sharding import numel
    g = as_graph(GPT.format(layers=2))
    pl = planner_for(g, "dgx-a100-80g", "adamw", None, devices=8, global_batch=8)
    sums = {}
    for r in ("none", "full", "selective"):
        cfg = _config(f"dp=1,tp=8,sp=true,microbatches=8,recompute={r}", 8)
        sh, shapes = pl.sharding(cfg)
        m = pl.cost(cfg.precision)
        topo = m.topology((1, 8))
        sums[r] = m._node_sums(cfg, sh, shapes, topo, 1.0)
    ln = next(nd.name for nd in g.nodes if nd.kind == "layernorm" and nd.group == "model.blocks.0")
    ag = m._tp_collective(8, topo)("all_gather", numel(shapes[ln]) * 4)
    for inst, s in sums["none"][1].items():
        # two gathered norm outputs per layer: q, k and v share the attention norm's (one transition,
        # as the compiler inserts it), the first MLP linear reads the MLP norm's
        assert sums["full"][1][inst].comm == pytest.approx(s.comm - 2 * ag), inst
        # selective: the same, plus the replayed forward collectives (not the last reduce-scatter's)
        assert s.comm - 2 * ag < sums["selective"][1][inst].comm < 1.5 * (s.comm - 2 * ag), inst
    for unit, s in sums["none"][0].items():
        assert sums["full"][0][unit].comm == pytest.approx(s.comm)
    # the estimate does not reuse another recompute mode's sums
    fresh = autopar.evaluate(as_graph(GPT.format(layers=2) + ",tie=0"), cluster="dgx-a100-80g", devices=8,
                             global_batch=8, strategy="dp=1,tp=8,sp=true,microbatches=8,recompute=full")
    after_none = pl.evaluate(_config("dp=1,tp=8,sp=true,microbatches=8,recompute=full", 8))
    assert after_none.tp_comm_time_s == pytest.approx(fresh.tp_comm_time_s)
