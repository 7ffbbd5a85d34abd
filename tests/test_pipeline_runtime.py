"""Pipeline execution (pp > 1) against a single-process run.

One spawn of 4 gloo processes runs pp=2 x tp=2 (1F1B; GPT and Llama), pp=4
(GPipe), pp=2 x dp=2 (interleaved, 2 chunks per rank), a GPT whose head is tied
to its embedding (on another pipeline rank: the copies' gradients are summed), a
2-layer GPT on 4 virtual stages (the embedding and the head each alone on one),
and the refusal of more stages than layers plus two; one spawn of 8
runs pp=2 x dp=2 x tp=2 (1F1B). Every step's loss must match the
single-process loss to a relative 1e-4 on every rank, and the gathered final
weights the single-process weights. The cut itself (:func:`split_stages`) is
checked in this process.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from distributed import run_distributed, spawn8
from test_parallel import GPT, LLAMA, _data, _single_run, _train

GPT4 = "gpt:layers=4,hidden=32,heads=4,seq=8,vocab=64"
PIPE = "microbatches=4,schedule=1f1b"
RUNS4 = [
    (GPT, f"pp=2,tp=2,{PIPE}", "sgd"),
    (LLAMA, f"pp=2,tp=2,{PIPE}", "adamw"),
    (GPT4, "pp=4,microbatches=4,schedule=gpipe", "sgd"),
    (GPT4, "pp=2,dp=2,microbatches=4,schedule=interleaved,chunks=2", "sgd"),
    (GPT + ",tie=1", f"pp=2,tp=2,{PIPE}", "sgd"),   # head tied to the embedding, on another rank
    # 4 virtual stages of 2 layers: the embedding alone first, the head alone last (Llama 3's chunks)
    (GPT, "pp=2,dp=2,microbatches=4,schedule=interleaved,chunks=2", "sgd"),
]
# 8 processes on 2 cores is the suite's costliest spawn: GPT only (Llama's pp x dp x tp is in `make matrix`'s
# 8-process run and pp x tp above)
RUNS8 = [(GPT, f"pp=2,dp=2,tp=2,{PIPE}", "sgd")]
REFUSED = {   # label -> (model, strategy)
    "too_many_stages": (GPT, "pp=2,microbatches=4,schedule=interleaved,chunks=4"),
}


def _worker(rank: int, world: int, runs: list[tuple[str, str, str]], refused: dict[str, tuple[str, str]]) -> dict:
    import autopar
    results: dict = {}
    for spec, strategy, opt in runs:
        pm, losses = _train(spec, strategy, opt)
        timeline = pm.measured_timeline()
        if rank == 0:   # the predicted schedule above the measured one
            png = pm.plot_timeline(Path(tempfile.mkdtemp()) / "timeline.png", measured=timeline)
            assert png.stat().st_size > 0
        results[spec, strategy] = {
            "losses": losses, "state": pm.full_state_dict(), "describe": pm.describe(),
            "local": sorted(n for n, _ in pm.named_parameters()), "held": pm.stages_held,
            "events": [(e.rank, e.stage, e.kind, e.microbatch) for e in timeline.events],
            "mesh": (pm.mesh.names, pm.mesh.coords),
        }
    for label, (spec, strategy) in refused.items():
        z, x, y = _data(spec)
        try:
            autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=y, strategy=strategy)
            results[label] = "no error"
        except autopar.AutoparError as e:
            results[label] = f"{type(e).__name__}: {e}"
    return results


def _check(runs, results_per_rank) -> None:
    from autopar.pipeline.schedule import build_schedule
    from autopar.spec import parse_strategy

    for spec, strategy, opt in runs:
        ref_losses, ref_state = _single_run(spec, opt)
        cfg = parse_strategy(strategy)
        order = build_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.chunks)
        for rank, res in enumerate(results_per_rank):
            got = res[spec, strategy]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-4), (spec, strategy, rank)
            assert got["state"].keys() == ref_state.keys(), (spec, strategy, rank)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, rtol=1e-4, atol=2e-5, msg=f"{spec} {strategy} {k}")
            # every pipeline rank ran exactly its schedule, in order
            for p in range(cfg.pp):
                ran = [(s, kind, i) for r, s, kind, i in got["events"] if r == p]
                assert ran == [(a.stage(p, cfg.pp), a.kind, a.microbatch) for a in order[p]], (strategy, p)
        # pipeline rank 0 holds the embedding and only the stages it runs
        names, coords = results_per_rank[0][spec, strategy]["mesh"]
        first = results_per_rank[0][spec, strategy]
        assert names == ("pp", "dp", "tp") and coords == (0, 0, 0)
        assert first["held"] == list(range(0, cfg.stages, cfg.pp))
        assert any("embed" in n or "wte" in n for n in first["local"])
        assert not any("lm_head" in n for n in first["local"])
        assert "pp 0/" in first["describe"]


def test_pipelines_on_4_processes_match_single_process():
    res = run_distributed(_worker, 4, RUNS4, REFUSED, timeout=300)
    _check(RUNS4, res)
    for r in res:
        assert r["too_many_stages"].startswith("StrategyError"), r["too_many_stages"]
        assert "layers" in r["too_many_stages"]


@spawn8
def test_pp_dp_tp_on_8_processes_matches_single_process():
    """pp x dp x tp: 20 s of the suite's 10 minutes; `make matrix` runs the family on the real models."""
    res = run_distributed(_worker, 8, RUNS8, {}, timeout=300)
    _check(RUNS8, res)


def _compiled(spec: str, tp: int):
    """A traced model and its rank-0 program for ``tp`` (no process group:
    with ``tp > 1`` the collectives are only placed, not run)."""
    from autopar import api
    from autopar.compile.rewrite import compile_local
    from autopar.sharding import scaled_shapes
    from autopar.trace import trace

    z, x, y = _data(spec)
    graph = trace(z.model, (x,), loss_fn=z.loss_fn, target=y)
    plan = api.plan(graph, cluster="cpu", devices=tp, global_batch=8, strategy=f"tp={tp}")
    params = {**dict(graph.gm.named_parameters()), **dict(graph.gm.named_buffers())}
    prog = compile_local(graph, api.sharding_from_plan(graph, plan), scaled_shapes(graph, 8, 1), tp_rank=0,
                         tp_group=None, params=params)
    return graph, prog.module, x, y


@pytest.mark.parametrize("spec,stages", [(GPT4, 4), (LLAMA, 2)])
def test_split_stages_chained_equal_whole_program(spec, stages):
    from autopar.pipeline.partition import assign, even_layers, units
    from autopar.compile.stages import split_stages

    graph, gm, x, y = _compiled(spec, 1)
    stage_of = assign(graph, even_layers(units(graph).layers, stages))
    parts = split_stages(gm, graph, stage_of, list(range(stages)))
    ref = gm(x, y)
    ref.backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    env = {"input_0": x, "target": y}
    for st in parts:
        assert all(env_name in env for env_name in st.args)
        out = st.module(*[env[n] for n in st.args])
        if st.last:
            loss = out
        else:
            env.update(zip(st.outputs, out))
    assert [st.last for st in parts] == [False] * (stages - 1) + [True]
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    loss.backward()
    for n, p in gm.named_parameters():    # the stages share the program's parameters
        torch.testing.assert_close(p.grad, want[n], msg=n)
    # only the previous stage's hidden state crosses a cut (sizes, positions and rotary tables are recomputed)
    for st in parts[1:]:
        assert list(st.inputs.values()) == [st.stage - 1], st.inputs


def test_split_stages_places_inserted_collectives_with_their_users():
    from autopar.pipeline.partition import assign, even_layers, units
    from autopar.compile.stages import split_stages

    graph, gm, _, _ = _compiled(LLAMA, 2)
    stage_of = assign(graph, even_layers(units(graph).layers, 2))
    parts = split_stages(gm, graph, stage_of, [0, 1])
    placed: dict[str, int] = {}
    for st in parts:
        for n in st.module.graph.nodes:
            if n.op == "call_module" and n.target.startswith("_autopar_"):
                assert n.name not in placed, n.name
                placed[n.name] = st.stage
                assert any(u.op != "output" for u in n.users), (n.name, st.stage)   # not sent on unused
    assert set(placed) == {n.name for n in gm.graph.nodes if n.op == "call_module" and
                           n.target.startswith("_autopar_")}
    assert sum(st.comms for st in parts) == len(placed)


def test_a_weight_moved_for_readers_on_two_stages_is_moved_on_each():
    """A tied embedding and head read through one move the compiler inserted
    (under ``tp_mode=mesh`` a gather on an axis that stores the weight split;
    here a stand-in computed from the weight alone): each stage runs its own
    move of the weight it holds, nothing of the weight crosses the cut, and
    the chained stages give the whole program's loss and gradients."""
    import operator

    from autopar.compile.stages import split_stages
    from autopar.pipeline.partition import assign, even_layers, units

    graph, gm, x, y = _compiled("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64,tie=1", 1)
    weight = next(n for n in gm.graph.nodes if n.op == "get_attr" and "wte" in str(n.target))
    readers = list(weight.users)
    assert len(readers) == 2    # the embedding and the head
    with gm.graph.inserting_after(weight):
        moved = gm.graph.call_function(operator.mul, (weight, 1.0))
    for r in readers:
        r.replace_input_with(weight, moved)
    gm.recompile()
    ref = gm(x, y)
    ref.backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)
    parts = split_stages(gm, graph, assign(graph, even_layers(units(graph).layers, 2)), [0, 1])
    for st in parts:    # each stage moves the weight itself
        assert any(n.name == moved.name for n in st.module.graph.nodes), st.stage
        assert moved.name not in st.inputs and moved.name not in st.outputs
    h = parts[0].module(*[{"input_0": x, "target": y}[n] for n in parts[0].args])
    loss = parts[1].module(*[dict({"input_0": x, "target": y}, **dict(zip(parts[0].outputs, h)))[n]
                             for n in parts[1].args])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    loss.backward()
    for n, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


def _input_alone_worker(rank: int, world: int) -> dict:
    """The example MLP (no embedding: its first unit holds no parameter) on 4
    pipeline ranks: rank 0 runs the input alone, rank 3 the head alone."""
    import autopar
    from benchmarks.real_models import CASES
    c = CASES["mlp"]()
    pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), strategy="pp=4,microbatches=4",
                             max_grad_norm=0.5)
    losses = [pm.train_step(c.inputs, c.target) for _ in range(3)]
    return {"losses": losses, "norm": pm.grad_norm, "layers": pm.plan.data["pipeline"]["layers"],
            "params": sum(p.numel() for p in pm.parameters())}


def test_a_pipeline_rank_without_parameters_takes_part_in_the_step():
    from benchmarks.real_models import CASES
    res = run_distributed(_input_alone_worker, 4, timeout=300)
    c = CASES["mlp"]()
    opt = torch.optim.AdamW(c.model.parameters(), lr=1e-2)
    ref = []
    for _ in range(3):
        opt.zero_grad()
        loss = c.loss_fn(c.model(*c.inputs), c.target)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(c.model.parameters(), 0.5))
        opt.step()
        ref.append(loss.item())
    assert res[0]["layers"] == [0, 1, 1, 0] and res[0]["params"] == 0
    for r in res:
        assert r["losses"] == pytest.approx(ref, rel=1e-4) and r["norm"] == pytest.approx(norm, rel=1e-4)
