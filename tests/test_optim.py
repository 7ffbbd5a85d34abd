"""DistributedOptimizer (autopar/runtime/optim.py): ZeRO 0/1/2, bf16/fp16, overlap, offload, tied weights.

The distributed checks run in ONE spawn of 4 gloo ranks (start-up dominates
the run time); each check returns failure messages, grouped by topic, and the
tests below assert on their topic. Every rank trains on its quarter of a
global batch and is compared with a single-process reference on the whole
batch.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import DistributedError
from autopar.runtime.optim import DistributedOptimizer
from distributed import run_distributed

DP = 4
GLOBAL_BATCH = 16
STEPS = 3
# 400 bytes: with the model below the fp32 buckets are (reverse order)
# [ln.b, ln.w, fc2.b, fc2.w] = 96, [fc1.b] = 13 and [fc1.w] = 91 elements;
# each parameter starts at a multiple of 4 elements (16 bytes of fp32): 8 + 8 + 8 + 80 = 104,
# 16 and 92, padded to multiples of dp=4 x 4: 112 + 16 + 96 = 224, shards 28 + 4 + 24 = 56.
# bf16 / fp16 parameters start at multiples of 8 elements: 8 + 8 + 8 + 80 = 104, 16 and 96; the
# master is all of them (216) at zero=0, a shard of multiples of 4 x 8 (128 + 32 + 96) / 4 = 64.
BUCKET_MB = 400 / 2 ** 20
N_PARAMS = 200
PADDED, SHARD = 224, 56
LOW_MASTER = {0: 216, 1: 64, 2: 64}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 6), nn.LayerNorm(6))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 6, generator=g))
            for _ in range(STEPS)]


def _sgdm(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def _sgd1(ps):
    return torch.optim.SGD(ps, lr=1.0)


OPTIMIZERS = {"sgdm": _sgdm, "adamw": _adamw}


def _reference(factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch training on the global batch."""
    model = _model()
    opt = factory(list(model.parameters()))
    losses = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, dp: int, group, microbatches: int, *, scale: float | None = None,
           **kw) -> tuple[list[float], list[bool], dict, Any]:
    """Train _model() with a DistributedOptimizer on this rank's 1/dp of each batch."""
    model = _model()
    opt = DistributedOptimizer(model.parameters(), kw.pop("factory"), group, bucket_mb=kw.pop("bucket_mb", BUCKET_MB),
                               **kw)
    if scale is not None:
        opt.loss_scale = scale
    losses, applied = [], []
    for x, y in _batches():
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        opt.zero_grad()
        total = torch.zeros(())
        for j, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            opt.start_microbatch(last=j == microbatches - 1)
            loss = F.mse_loss(model(xm.to(opt.param_dtype)).float(), ym) / microbatches
            (loss * opt.loss_scale).backward()
            total += loss.detach().float()
        applied.append(opt.step())
        if dp > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / dp)
    return losses, applied, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


class _Checks:
    def __init__(self):
        self.failures: list[str] = []

    def close(self, name, actual, expected, **tol):
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as e:
            self.failures.append(f"{name}: {e}")

    def true(self, name, cond, detail=""):
        if not cond:
            self.failures.append(f"{name}: {detail}")


# ------------------------------------------------------------------ distributed checks (run on every rank)

def _check_fp32(rank: int, ck: _Checks) -> None:
    """fp32, every zero x overlap x microbatches x optimizer == plain torch on the global batch."""
    group = dist.group.WORLD
    for oname, factory in OPTIMIZERS.items():
        ref_losses, ref_w = _reference(factory)
        for zero in (0, 1, 2):
            for overlap in (True, False):
                for m in (1, 2):
                    tag = f"fp32 {oname} zero={zero} overlap={overlap} microbatches={m}"
                    losses, applied, w, opt = _train(rank, DP, group, m, factory=factory, zero=zero,
                                                     overlap=overlap)
                    ck.true(tag + " mode", opt.mode == ("plain" if zero == 0 else "flat"), opt.mode)
                    ck.true(tag + " applied", all(applied), str(applied))
                    ck.close(tag + " losses", torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
                    for k in ref_w:
                        ck.close(f"{tag} {k}", w[k], ref_w[k], rtol=1e-5, atol=1e-6)


def _check_low_precision(rank: int, ck: _Checks) -> None:
    """bf16/fp16 over dp=4 == the same policy in one process (dp_group=None) on the global batch.

    Tolerance: the params are bf16 (8 significant bits, unit roundoff 2^-8 ~
    3.9e-3) or fp16 (11 bits, 2^-11 ~ 4.9e-4). The two runs do their matmuls in
    the low precision on different batch slices and sum the rank/microbatch
    grads (in fp32) in a different order, so their grads differ by a few
    roundoffs of the low precision; three small steps move the fp32 masters by
    lr * O(that), and the params, rounded from the masters, may land on a
    neighbouring representable value: we allow 2 ulps relative (rtol 2^-7 for
    bf16, 2^-10 for fp16; we observe <= 1.6 ulps), plus atol 2e-3 = 0.2 * lr
    for weights near zero, where AdamW's normalised first steps (~lr * sign of
    a tiny grad) amplify the grad differences (observed up to ~8 fp16 ulps of
    such small weights). The losses agree to ~2.4e-5 relative.
    """
    group = dist.group.WORLD
    for precision, rtol in (("bf16", 2 ** -7), ("fp16", 2 ** -10)):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        # fp16: a rank's grads are of the mean over ITS samples (the dp mean comes after), 4x the
        # reference's, so the default 2**16 overflows on some steps here but not in the reference
        scale = 2.0 ** 10 if precision == "fp16" else None
        ref_losses, ref_applied, ref_w, ref_opt = _train(0, 1, None, 1, factory=_adamw, precision=precision,
                                                         scale=scale)
        ck.true(f"{precision} ref applied", all(ref_applied), str(ref_applied))
        ck.true(f"{precision} ref master fp32", ref_opt.master.dtype == torch.float32, str(ref_opt.master.dtype))
        for zero in (0, 1, 2):
            for m in (1, 2):
                tag = f"{precision} zero={zero} microbatches={m}"
                losses, applied, w, opt = _train(rank, DP, group, m, factory=_adamw, zero=zero, precision=precision,
                                                 scale=scale)
                ck.true(tag + " applied", all(applied), str(applied))
                ck.true(tag + " master fp32", opt.master.dtype == torch.float32, str(opt.master.dtype))
                ck.true(tag + " master shard", opt.master.numel() == LOW_MASTER[zero], str(opt.master.numel()))
                ck.true(tag + " 16-byte aligned", all(t.data_ptr() % 16 == 0 for t in (*opt.params, opt.master)),
                        str([p.data_ptr() % 16 for p in opt.params]))
                ck.true(tag + " params dtype", all(p.dtype == dtype for p in opt.params),
                        str({p.dtype for p in opt.params}))
                ck.true(tag + " grad buffer fp32", opt.reduce_dtype == torch.float32, str(opt.reduce_dtype))
                ck.close(tag + " losses", torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=1e-3)
                for k in ref_w:
                    ck.true(f"{tag} {k} dtype", w[k].dtype == dtype, str(w[k].dtype))
                    ck.close(f"{tag} {k}", w[k].float(), ref_w[k].float(), rtol=rtol, atol=2e-3)
                if precision == "fp16":
                    ck.true(tag + " scale", opt.loss_scale == 2.0 ** 10, str(opt.loss_scale))


def _check_loss_scaling(rank: int, ck: _Checks) -> None:
    """fp16: an inf in ONE element of ONE rank's grads skips the step everywhere and halves the scale."""
    group = dist.group.WORLD
    x, y = _batches()[0]
    x, y = x.chunk(DP)[rank], y.chunk(DP)[rank]
    for zero in (0, 1, 2):
        tag = f"fp16 overflow zero={zero}"
        model = _model()
        opt = DistributedOptimizer(model.parameters(), _adamw, group, zero=zero, precision="fp16",
                                   bucket_mb=BUCKET_MB)
        ck.true(tag + " initial scale", opt.loss_scale == 2.0 ** 16, str(opt.loss_scale))
        opt.loss_scale = 2.0 ** 10   # low enough that the clean grads never overflow
        before = {k: v.clone() for k, v in model.state_dict().items()}
        master_before = opt.master.clone()

        def poison(g):
            g = g.clone()
            g[0, 0] = float("inf")
            return g

        handle = model[0].weight.register_hook(poison) if rank == 1 else None
        opt.zero_grad()
        (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
        ok = opt.step()
        if handle is not None:
            handle.remove()
        ck.true(tag + " skipped", ok is False, str(ok))
        ck.true(tag + " scale halved", opt.loss_scale == 2.0 ** 9, str(opt.loss_scale))
        for k, v in model.state_dict().items():
            ck.true(f"{tag} {k} unchanged", torch.equal(v, before[k]))
        ck.true(tag + " master unchanged", torch.equal(opt.master, master_before))
        # the grads were zeroed: a clean step now applies (and keeps the halved scale)
        opt.zero_grad()
        (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
        ok = opt.step()
        ck.true(tag + " next step applied", ok is True, str(ok))
        ck.true(tag + " scale kept", opt.loss_scale == 2.0 ** 9, str(opt.loss_scale))
        ck.true(tag + " weights moved", not torch.equal(model[0].weight, before["0.weight"]))


def _check_memory(rank: int, ck: _Checks) -> None:
    """memory_bytes(): the state is 1/dp (of the padded buckets) for zero 1/2, offload is on the host."""
    group = dist.group.WORLD
    n_tensors = 6
    mem = {}
    for zero, offload in ((0, False), (1, False), (2, False), (1, True)):
        _, _, _, opt = _train(rank, DP, group, 2, factory=_adamw, zero=zero, offload=offload)
        mem[zero, offload] = m = opt.memory_bytes()
        tag = f"memory zero={zero} offload={offload}"
        ck.true(tag + " keys", set(m) == {"master", "optimizer_state", "grad_buffer", "bucket_staging",
                                          "offloaded"}, str(m))
        if zero:
            ck.true(tag + " layout", (opt.padded_numel, opt.shard_numel) == (PADDED, SHARD),
                    str((opt.padded_numel, opt.shard_numel, opt.bucket_numels)))
    f = 4  # fp32
    # AdamW: exp_avg + exp_avg_sq per element, plus a 0-dim fp32 "step" per tensor
    ck.true("memory zero=0 state", mem[0, False]["optimizer_state"] == 2 * f * N_PARAMS + 4 * n_tensors,
            str(mem[0, False]))
    for zero in (1, 2):
        m = mem[zero, False]
        ck.true(f"memory zero={zero} state", m["optimizer_state"] == 2 * f * SHARD + 4, str(m))
        ck.true(f"memory zero={zero} ~1/dp", abs(m["optimizer_state"] / mem[0, False]["optimizer_state"] - 1 / DP)
                < 0.05, str(m))
        ck.true(f"memory zero={zero} master", m["master"] == f * SHARD, str(m))
        ck.true(f"memory zero={zero} not offloaded", m["offloaded"] == 0, str(m))
    ck.true("memory zero=0 plain", mem[0, False]["master"] == 0 and mem[0, False]["grad_buffer"] == 0, str(mem))
    # plain: every bucket (grads + one flag per param) may be in flight at once
    ck.true("memory zero=0 staging", mem[0, False]["bucket_staging"] == f * (N_PARAMS + n_tensors), str(mem))
    # zero 1: the full fp32 grad buffer + this rank's reduced shard (also the master's grad); no staging
    ck.true("memory zero=1 grads", mem[1, False]["grad_buffer"] == f * (PADDED + SHARD), str(mem[1, False]))
    ck.true("memory zero=1 staging", mem[1, False]["bucket_staging"] == 0, str(mem[1, False]))
    # zero 2: only the shard; staging at most two buckets (one in flight, one filling) + one output chunk
    ck.true("memory zero=2 grads", mem[2, False]["grad_buffer"] == f * SHARD, str(mem[2, False]))
    st = mem[2, False]["bucket_staging"]
    ck.true("memory zero=2 staging", f * 96 <= st <= f * (96 + 92 + 24), str(st))
    # offload: master, state and the host copy of the grad shard live on the host
    m = mem[1, True]
    ck.true("memory offload state", m["optimizer_state"] == 2 * f * SHARD + 4, str(m))
    ck.true("memory offload offloaded", m["offloaded"] == m["master"] + m["optimizer_state"] + f * SHARD,
            str(m))
    _, _, _, opt = _train(rank, DP, group, 1, factory=_adamw, zero=1, offload=True)
    ck.true("offload master on cpu", opt.master.device.type == "cpu" and opt.master.data_ptr() != 0)
    states = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    ck.true("offload state on cpu", states and all(v.device.type == "cpu" for v in states))
    ck.true("offload master separate from params", opt.master.data_ptr() != opt.params[0].data_ptr())


def _check_overlap(rank: int, ck: _Checks) -> None:
    """overlap=True launches the bucket reductions from the backward hooks, before step()."""
    group = dist.group.WORLD
    x, y = _batches()[0]
    x, y = x.chunk(DP)[rank], y.chunk(DP)[rank]
    for zero in (0, 1, 2):
        for overlap in (True, False):
            tag = f"overlap={overlap} zero={zero}"
            model = _model()
            opt = DistributedOptimizer(model.parameters(), _sgdm, group, zero=zero, overlap=overlap,
                                       bucket_mb=BUCKET_MB)
            nb = len(opt.overlapped)
            ck.true(tag + " buckets", nb == 3, str(opt.bucket_numels))
            opt.zero_grad()
            seen = []
            for j, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                opt.start_microbatch(last=j == 1)
                (F.mse_loss(model(xm), ym) / 2).backward()
                seen.append(opt.launched_buckets)
            if not overlap:
                want = [0, 0]
            elif zero == 2:
                want = [nb, 2 * nb]     # every microbatch
            else:
                want = [0, nb]          # once, during the last microbatch
            ck.true(tag + " launched before step", seen == want, f"{seen} != {want}")
            ck.true(tag + " step", opt.step() is True)
            if zero:
                ck.true(tag + " grads freed by the hooks", all(p.grad is None for p in opt.params))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.ones(2))   # first: its bucket is the last non-tied one
        self.w = nn.Parameter(torch.linspace(-1, 1, 5))
        self.t = nn.Parameter(torch.linspace(0, 1, 3))

    def forward(self, a, b):
        return (self.w * a).sum() + (self.t * b).sum()


def _check_tied(rank: int, ck: _Checks) -> None:
    """pp=2 x dp=2 (rank = pp * 2 + dp): ``t`` is tied across pp ranks {d, 2+d}: its grad is summed over
    the tie group, then averaged over dp; ``w`` is only averaged; ``unused`` never gets a grad."""
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tie_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, d = divmod(rank, 2)
    a = [torch.arange(5.0) * (r + 1) for r in range(4)]
    b = [torch.tensor([1.0, -2.0, 3.0]) * (r + 1) ** 2 for r in range(4)]
    dp_members = [pp * 2, pp * 2 + 1]
    want_w = torch.linspace(-1, 1, 5) - sum(a[r] for r in dp_members) / 2
    want_t = torch.linspace(0, 1, 3) - sum(b) / 2      # sum over ties, mean over dp: (b0+b2 + b1+b3) / 2
    for zero, precision, overlap in ((0, "fp32", True), (0, "fp32", False), (1, "fp32", True),
                                     (2, "fp32", True), (2, "fp32", False), (1, "bf16", True)):
        tag = f"tied zero={zero} {precision} overlap={overlap}"
        m = _Tied()
        opt = DistributedOptimizer(m.parameters(), _sgd1, dp_groups[pp], zero=zero, precision=precision,
                                   overlap=overlap, tied=[(m.t, tie_groups[d])], bucket_mb=0)
        ck.true(tag + " buckets", [(bk.params, bk.tied) for bk in opt.buckets] == [([1], False), ([0], False),
                                                                                   ([2], True)],
                str([(bk.params, bk.tied) for bk in opt.buckets]))
        opt.zero_grad()
        m(a[rank].to(m.w.dtype), b[rank].to(m.w.dtype)).backward()
        if overlap:   # w's bucket went from the hook; the tied one and the unused one wait for step()
            ck.true(tag + " launched", opt.launched_buckets == 1, str(opt.launched_buckets))
        ck.true(tag + " applied", opt.step() is True)
        tol = dict(rtol=2 ** -7, atol=1e-2) if precision == "bf16" else dict(rtol=1e-6, atol=1e-6)
        ck.close(tag + " w", m.w.detach().float(), want_w, **tol)
        ck.close(tag + " t", m.t.detach().float(), want_t, **tol)
        ck.true(tag + " unused unchanged", torch.equal(m.unused.detach().float(), torch.ones(2)))
        if opt.mode == "plain":
            ck.true(tag + " unused grad None", m.unused.grad is None)


_CHECKS = {"fp32": _check_fp32, "low_precision": _check_low_precision, "loss_scaling": _check_loss_scaling,
           "memory": _check_memory, "overlap": _check_overlap, "tied": _check_tied}


def _run_all(rank: int, world: int) -> dict[str, list[str]]:
    torch.manual_seed(0)
    out = {}
    for name, fn in _CHECKS.items():
        ck = _Checks()
        fn(rank, ck)
        out[name] = [f"rank {rank}: {f}" for f in ck.failures]
    return out


@pytest.fixture(scope="module")
def dist_results() -> dict[str, list[str]]:
    per_rank = run_distributed(_run_all, DP, timeout=240)
    return {name: [f for r in per_rank for f in r[name]] for name in _CHECKS}


@pytest.mark.parametrize("topic", list(_CHECKS))
def test_distributed(dist_results, topic):
    failures = dist_results[topic]
    assert not failures, f"{len(failures)} failure(s):\n" + "\n".join(failures[:20])


# ------------------------------------------------------------------ single process

def test_single_process_matches_torch():
    """dp_group=None: plain mode and flat mode (zero=1 over one rank, offload) equal plain torch."""
    ref_losses, ref_w = _reference(_adamw)
    for kw in (dict(zero=0), dict(zero=1), dict(zero=2), dict(zero=0, offload=True), dict(zero=2, overlap=False)):
        losses, applied, w, opt = _train(0, 1, None, 2, factory=_adamw, **kw)
        assert all(applied)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-5, atol=1e-6, msg=lambda s: f"{kw} {k}: {s}")


def test_reduce_dtype_makes_fp32_flat():
    """fp32 params with a bf16 reduction: flat mode, the master IS the param buffer (no copy)."""
    ref_losses, ref_w = _reference(_sgdm)
    losses, applied, w, opt = _train(0, 1, None, 1, factory=_sgdm, reduce_dtype="bf16")
    assert opt.mode == "flat" and opt.reduce_dtype == torch.bfloat16 and all(applied)
    mem = opt.memory_bytes()
    # bf16 buffer + fp32 master grad, each parameter at a multiple of 8 elements (16 bytes of bf16)
    assert mem["master"] == 0 and mem["grad_buffer"] == LOW_MASTER[0] * (2 + 4)
    # grads rounded to bf16 before the update: agreement to bf16 roundoff (2^-8) of the update sizes
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=1e-3)
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=1e-2, atol=2e-3)


def test_default_factory_is_sgd():
    model = _model()
    opt = DistributedOptimizer(model.parameters(), None, None)
    assert isinstance(opt.optimizer, torch.optim.SGD) and opt.optimizer.defaults["lr"] == 0.01
    assert opt.loss_scale == 1.0 and opt.mode == "plain"


def test_fp16_scale_growth_and_floor():
    x, y = _batches()[0]
    model = _model()
    opt = DistributedOptimizer(model.parameters(), _sgd1, None, zero=1, precision="fp16")
    assert opt.loss_scale == 2.0 ** 16
    opt.growth_interval = 2
    for _ in range(2):
        opt.zero_grad()
        (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
        assert opt.step() is True
    assert opt.loss_scale == 2.0 ** 17
    opt._scale = 1.0
    h = model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
    opt.zero_grad()
    (F.mse_loss(model(x.half()).float(), y) * opt.loss_scale).backward()
    h.remove()
    assert opt.step() is False and opt.loss_scale == 1.0   # the floor


def test_flat_mode_params_are_views_of_one_buffer():
    model = _model()
    opt = DistributedOptimizer(model.parameters(), _adamw, None, zero=1, precision="bf16")
    base = opt.params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in opt.params)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.master.dtype == torch.float32 and len(opt.optimizer.param_groups[0]["params"]) == 1


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="zero=3"):
        DistributedOptimizer(model.parameters(), None, None, zero=3)
    with pytest.raises(ValueError, match="precision='fp8'"):
        DistributedOptimizer(model.parameters(), None, None, precision="fp8")
    with pytest.raises(ValueError, match="reduce_dtype"):
        DistributedOptimizer(model.parameters(), None, None, reduce_dtype=torch.int32)
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedOptimizer(model.parameters(), None, None, bucket_mb=-1)
    with pytest.raises(ValueError, match="one device"):
        DistributedOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))], None, None)
    with pytest.raises(ValueError, match="no parameters"):
        DistributedOptimizer([nn.Parameter(torch.ones(2), requires_grad=False)], None, None)
    with pytest.raises(ValueError, match="tied"):
        DistributedOptimizer(model.parameters(), None, None, tied=[(nn.Parameter(torch.ones(2)), None)])
    with pytest.raises(ValueError, match="one dtype"):
        DistributedOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],
                             None, None, zero=1)
    with pytest.raises(ValueError, match="not a torch.optim.Optimizer"):
        DistributedOptimizer(model.parameters(), lambda ps: object(), None)
    with pytest.raises(ValueError, match="param group"):
        DistributedOptimizer(model.parameters(), lambda ps: torch.optim.SGD(
            [{"params": ps}, {"params": [torch.zeros(1)]}], lr=0.1), None, zero=1)


def test_gradient_after_reduction_is_an_error():
    """zero=1 with overlap: a second backward without start_microbatch(last=False) hits reduced buckets."""
    x, y = _batches()[0]
    model = _model()
    opt = DistributedOptimizer(model.parameters(), _sgd1, None, zero=1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with pytest.raises(DistributedError, match="start_microbatch"):
        F.mse_loss(model(x), y).backward()


def test_a_dropped_parallel_module_frees_its_training_state():
    """The gradient hooks must not keep the optimizer alive: on an H200 every
    dropped ParallelModule left its whole training state allocated (7 GiB for
    a 350M GPT), so a second ``parallelize`` in the same process ran out."""
    import gc
    import weakref

    import autopar
    import autopar.zoo as zoo

    z = zoo.build("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64", device="cpu", batch=4, seed=0)
    x = torch.randint(0, 64, (4, 8))
    for strategy in ("precision=fp32", "precision=bf16"):
        pm = autopar.parallelize(z.model, (x,), loss_fn=z.loss_fn, example_target=x,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy=strategy,
                                 cluster="cpu")
        pm.train_step((x,), x)
        held = [weakref.ref(p) for p in pm.program.parameters()] + [weakref.ref(pm.optimizer)]
        del pm
        gc.collect()
        assert not [r for r in held if r() is not None], strategy
