"""A diffusion U-Net as PyTorch diffusion tutorials write it (``ddpm-unet`` in
``benchmarks/real_models.py``): group norm, ``F.interpolate``, skip connections
concatenated on the channels, ``F.mse_loss`` on the predicted noise, and an
attention block that reads its heads' width off its input (``b, c, h, w =
x.shape; ... / math.sqrt(c // heads)``).

Before: group norm, interpolate and mse_loss had no kind: data parallelism
crashed on a reshape of its local batch (the batch lost at the first group
norm), tp was refused (the output conv's 3 channels counted as a layer width),
and once allowed, tp computed another function: the channel count read off a
value tp splits was this rank's half, so attention was scaled by sqrt(8) instead
of sqrt(16). A size read off a dim the tp axis splits is the whole one now.
Under bf16 its fp32 timestep embedding met bf16 weights in a matmul and failed.
"""
from __future__ import annotations

import pytest

from benchmarks import matrix
from distributed import run_distributed

STRATEGIES = ("tp=2", "dp=2", "pp=2,microbatches=2", "dp=2,zero=3")


@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = run_distributed(matrix.worker, 2, [("ddpm-unet", st) for st in STRATEGIES], timeout=600)
    return {st: [r[("ddpm-unet", st)] for r in per_rank] for st in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_unet_trains_as_in_one_process(runs, strategy):
    ref = matrix.reference("ddpm-unet")
    assert matrix.check(strategy, strategy, ref, runs[strategy]) == "ok"


def test_bf16_reads_an_fp32_embedding_made_in_the_model():
    """The U-Net makes its sinusoidal timestep embedding in fp32 (``torch.arange``) and feeds it to
    the time MLP, whose weights bf16 makes bf16: the matmul of two dtypes failed (found on an H200).
    Matmul-family ops now read their operands in the compute dtype, as torch.autocast makes them."""
    import torch

    from benchmarks import real_models_gpu as gpu
    cpu = torch.device("cpu")
    ref = gpu.eager("ddpm-unet", cpu)
    assert gpu.verdict("precision=bf16", gpu.compiled("ddpm-unet", "precision=bf16", cpu)[:2], ref) == "ok"
