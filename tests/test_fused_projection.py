"""A fused q, k, v projection split after its GEMM, as nanoGPT (``c_attn(x).split(n_embd,
dim=2)``) and Hugging Face's GPT-2 (``Conv1D`` c_attn, then ``.split(split_size, dim=2)``)
write it, is split over the heads under tensor parallelism: the weight and bias take the
blocked placement ``S(d,3)`` (each rank its chunk of q, of k and of v), the split hands
each rank its heads of each, and attention runs head-parallel. Before, a column-parallel
c_attn gave each rank a contiguous chunk of ``[q | k | v]``, no rule could split the heads,
and attention ran replicated or split over the batch with collectives around it.

Numerics under tp (one process's, fp32) run in tests/test_real_models.py (nanoGPT and
GPT-2 under dp=2,tp=2), tests/test_copies.py, tests/test_tensor2d.py and
tests/test_context_parallel.py; a checkpoint of the blocked shards resumes without tp in
tests/test_checkpoint.py. Here: the placements, the plan record, the helpers, the cost."""
from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.api import as_graph, planner_for
from autopar.errors import CompileError, PlanError
from autopar.spec import S, local_chunk, parse_strategy, shard_blocks, shard_dim, unblock
from autopar.spec.placement import valid
from autopar.strategies.redistribute import feasible, transition_steps

pytest.importorskip("transformers")

HF_GPT2 = "hf-gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=64,seq=16"
#: GPT-2 at width 2048 (16 heads, 2 layers) on 4 H100: wide enough that the per-op search splits
#: attention over the heads at one sample per GPU (with more samples, or at GPT-2 124M's width 768, it
#: keeps q, k and v whole and splits the batch over the tensor axis, storing the weights sharded)
WIDE = "hf-gpt2:n_layer=2,n_embd=2048,n_head=16,vocab_size=50257,seq=1024"
ON_4 = dict(cluster="dgx-h100", devices=4, global_batch=4, strategy="tp=4")
_graphs: dict = {}


def _nanogpt_graph():
    if "nanogpt" not in _graphs:
        from benchmarks.real_models import NanoGPT, _tokens, lm_loss
        x, y = _tokens()
        _graphs["nanogpt"] = autopar.trace(NanoGPT(n_layer=2), (x[:4],), loss_fn=lm_loss, target=y[:4])
    return _graphs["nanogpt"]


def _graph(name: str):
    if name == "nanogpt":
        return _nanogpt_graph()
    if name not in _graphs:
        _graphs[name] = as_graph(name)
    return _graphs[name]


def test_blocked_placement_strings_and_chunks():
    assert S(0, 3) == "S(0,3)" and S(2) == "S(2)"
    assert (shard_dim("S(2,3)"), shard_blocks("S(2,3)"), shard_blocks("S(2)"), shard_blocks("R")) == (2, 3, 1, 1)
    assert valid("S(0,3)") and not valid("S(0,1)") and not valid("S(0,x)") and not valid("S(0,3,1)")
    t = torch.arange(24.0).view(12, 2)            # three blocks of 4 rows, 2 ranks
    parts = [local_chunk(t, 0, 2, r, 3) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]     # rows 0-1 of each block
    assert torch.equal(unblock(torch.cat(parts), 0, 2, 3), t)
    assert torch.equal(local_chunk(t, 1, 2, 1), t.chunk(2, dim=1)[1])     # one block: the plain chunk


def test_a_blocked_shard_is_only_read_as_it_is():
    assert feasible("S(0,3)", "S(0,3)") and transition_steps("S(0,3)", "S(0,3)") == ()
    for have, want in (("S(0,3)", "R"), ("R", "S(0,3)"), ("S(0)", "S(0,3)"), ("S(0,3)", "S(1)")):
        assert not feasible(have, want)
        with pytest.raises(CompileError, match="blocked shard"):
            transition_steps(have, want)


@pytest.mark.parametrize("name", ["nanogpt", HF_GPT2], ids=["nanogpt", "hf-gpt2"])
def test_fused_qkv_is_split_over_the_heads(name):
    g = _graph(name)
    chain = [nd for nd in g.nodes if "blocks" in nd.attrs]
    assert {nd.kind for nd in chain} >= {"split", "elementwise"} and len({nd.attrs["blocks"][0] for nd in chain}) == 1
    planner = planner_for(g, "dgx-h100", "adamw", None, devices=2, global_batch=4)
    sh, _ = planner.sharding(parse_strategy("tp=2", 2))
    weights = {sh.out[nd.name] for nd in g.nodes if nd.kind == "param" and "c_attn" in nd.name}
    assert weights == ({"S(0,3)"} if name == "nanogpt" else {"S(1,3)", "S(0,3)"})   # Conv1D's weight: [in, out]
    attention = [nd for nd in g.nodes if nd.kind in ("sdpa", "softmax")]
    assert attention and all(sh.out[nd.name] == "S(1)" for nd in attention)      # [B, heads, T, ...]: heads


def test_the_per_op_search_takes_the_blocks_where_they_are_faster():
    """Planned with the ILP, then again on the same graph with the fused chain unmarked (the
    rules as they were before): the blocked plan is faster."""
    g = _graph(WIDE)
    plan = autopar.plan(g, search_mode="ilp", **ON_4)
    placed = {tuple(p) for k, p in plan.data["params"].items() if "c_attn" in k}
    assert placed == {("R", "S(1,3)"), ("R", "S(0,3)")}, placed       # [dp, tp] per parameter
    import autopar.zoo as zoo
    z = zoo.build(WIDE, batch=2)
    before = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    for nd in before.nodes:       # the chain unmarked: the rules as they were
        nd.attrs.pop("blocks", None)
    whole = autopar.plan(before, search_mode="ilp", **ON_4)
    assert not any(shard_blocks(p[1]) > 1 for p in whole.data["params"].values())
    assert plan.predicted["step_time_s"] < whole.predicted["step_time_s"]


def test_a_plan_with_blocked_placements_round_trips_and_is_checked(tmp_path):
    g = _graph(WIDE)
    plan = autopar.plan(g, **ON_4)
    path = plan.save(tmp_path / "plan.json")
    again = autopar.Plan.load(path)
    assert again == plan
    again.check_graph(g)
    d = json.loads(path.read_text())
    layer = d["templates"][0]["params"]      # the repeated layers' placements, once for all
    assert layer["attn.c_attn.weight"] == ["R", "S(1,3)"] and layer["attn.c_attn.bias"] == ["R", "S(0,3)"]
    layer["attn.c_attn.weight"] = ["R", "S(1,7)"]       # 7 blocks x tp=4 do not divide 6144
    (tmp_path / "edited.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="7 blocks x tp=4"):
        autopar.Plan.load(tmp_path / "edited.json").check_graph(g)


def test_experts_are_split_megatron_style_under_tp():
    """A mixture of experts (transformers' Mixtral: experts stored [E, N, K], transposed for
    the grouped matmul, gate and up fused then ``chunk(2, -1)``) under ``tp=2``: every
    expert's gate / up columns by blocks (each rank its columns of gate and of up), its down
    projection's rows, one partial sum out, as Megatron splits a dense MLP. Before, the
    grouped matmul had no rule (replicated, its FLOPs uncounted), and the greedy placed the
    down weight over the experts' dim, which the grouped matmul only reads gathered."""
    from autopar.search.planner import Sharder
    from benchmarks.real_models import BREADTH_HF
    c = BREADTH_HF["hf-mixtral"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    mms = [nd for nd in g.nodes if nd.kind == "grouped_mm"]
    assert len(mms) == 8 and all(nd.flops > 0 for nd in mms)
    sh, _ = planner_for(g, "dgx-h100", "adamw", None, devices=2, global_batch=8).sharding(
        parse_strategy("tp=2", devices=2), Sharder())
    pre = "model_model_layers_0_mlp_experts_"
    assert sh.out[pre + "gate_up_proj"] == S(1, 2) and sh.out[pre + "down_proj"] == S(2)
    gate_up, down = mms[0].name, mms[1].name
    assert sh.out[gate_up] == S(1, 2) and sh.out[down] == "P"
    split = next(nd for nd in g.nodes if nd.kind == "split" and gate_up in nd.inputs)
    assert sh.strategy[split.name].name == "blocks"
