"""The GPU benchmarks' code paths on the CPU. benchmarks/layer_gpu.py times one
tensor-parallel rank's layer on a GPU; here,
on the CPU, that rank's layer is checked to be a real 1/tp of the zoo layer: with
the full layer's weights sliced as Megatron does, the ranks' attention and MLP
outputs sum to the full layer's (the all-reduce the benchmark leaves out)."""
from __future__ import annotations

import torch

from benchmarks import layer_gpu

SPEC = "llama:layers={L},hidden=64,heads=8,kv_heads=4,ffn=96,seq=16,vocab=64"


def _full_block():
    import autopar.zoo as zoo
    z = zoo.build(SPEC.format(L=1), device="cpu", seed=0)
    return z.model.layers[0].float(), z.model.cos.float(), z.model.sin.float()


def _rank(full, tp: int, r: int):
    blk, _ = layer_gpu.rank_block(SPEC, tp, "cpu")
    blk = blk.float()
    with torch.no_grad():
        for name, mod in blk.named_modules():
            if name in layer_gpu.COLUMN or name in layer_gpu.ROW:
                w = full.get_submodule(name).weight
                dim = 1 if name in layer_gpu.ROW else 0
                mod.weight.copy_(w.chunk(tp, dim=dim)[r])
    return blk


def test_rank_layers_sum_to_the_full_layer():
    full, cos, sin = _full_block()
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    for tp in (2, 4):
        ranks = [_rank(full, tp, r) for r in range(tp)]
        attn = sum(b.attn(x, cos, sin) for b in ranks)
        mlp = sum(b.mlp(x) for b in ranks)
        torch.testing.assert_close(attn, full.attn(x, cos, sin), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mlp, full.mlp(x), rtol=1e-4, atol=1e-5)
        assert ranks[0].attn.heads == 8 // tp and ranks[0].attn.kv_heads == 4 // tp


def test_cpu_run_of_the_script_gives_a_row():
    res = layer_gpu.main(["tiny"], "cpu", 1)
    (rec,) = res["raw"]
    assert "failed" not in rec, rec
    assert rec["measured_layer_s"] > 0 and rec["predicted_layer_s"] > 0
    assert [g["linear"] for g in rec["gemms"]] == list(layer_gpu.COLUMN + layer_gpu.ROW)


def test_bandwidth_script_runs_on_the_cpu():
    from benchmarks import bandwidth_gpu
    rows = bandwidth_gpu.measure("cpu", sizes=[1 << 10, 1 << 11, 1 << 12])
    assert {r["op"] for r in rows} == {"add", "mul_scalar", "gelu", "copy", "adamw_foreach", "adamw_fused"}
    res = bandwidth_gpu.result(rows, "cpu")
    assert len(res["table"]["rows"]) == 3 and all(r["GBps"] > 0 for r in rows)
