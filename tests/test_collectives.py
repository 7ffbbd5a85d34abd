"""Distributed runtime primitives: one 4-rank gloo run checks everything against single-process math.

Every rank builds the same full tensors from fixed seeds, feeds its shard /
partial to the op under test, and compares forward outputs and gradients with
plain torch on the full tensors. Failures are collected per rank and reported
together, so one run shows every broken check.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _full(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """Deterministic tensor, identical on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class _Checks:
    """Collects failed comparisons instead of stopping at the first (a stop could desync the ranks)."""

    def __init__(self):
        self.failures: list[str] = []

    def close(self, name, actual, expected, **tol):
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except (AssertionError, TypeError) as e:
            self.failures.append(f"{name}: {e}")

    def equal(self, name, actual, expected):
        if actual != expected:
            self.failures.append(f"{name}: got {actual!r}, expected {expected!r}")

    def raises(self, name, exc, fn, *needles):
        try:
            fn()
        except exc as e:
            missing = [n for n in needles if n not in str(e)]
            if missing:
                self.failures.append(f"{name}: message {str(e)!r} lacks {missing}")
            return
        self.failures.append(f"{name}: did not raise {exc.__name__}")


def _check_mesh(ck: _Checks, rank: int, world: int):
    import torch.distributed as dist

    from autopar.errors import DistributedError
    from autopar.runtime.dist import Mesh, local_device

    ck.equal("local_device", local_device(), torch.device("cpu"))
    m22 = Mesh.build((2, 2), ("dp", "tp"))
    m22_ng = Mesh.build((2, 2), ("dp", "tp"), use_device_mesh=False)
    m4 = Mesh.build((4,), ("x",))
    m14 = Mesh.build((1, 4), ("pp", "tp"))
    ck.equal("(2,2) uses DeviceMesh", m22.device_mesh is not None, True)
    ck.equal("new_group fallback has no DeviceMesh", m22_ng.device_mesh is None, True)
    for tag, m in (("device_mesh", m22), ("new_group", m22_ng)):
        ck.equal(f"{tag} coords", (m.coord("dp"), m.coord("tp"), m.coords), (rank // 2, rank % 2, (rank // 2, rank % 2)))
        expect = {"dp": [rank % 2, rank % 2 + 2], "tp": [rank - rank % 2, rank - rank % 2 + 1]}
        for ax, ranks in expect.items():
            g = m.group(ax)
            ck.equal(f"{tag} {ax} group ranks", dist.get_process_group_ranks(g), ranks)
            ck.equal(f"{tag} {ax} group_ranks()", m.group_ranks(ax), ranks)
            ck.equal(f"{tag} {ax} rank in group == coord", dist.get_rank(g), m.coord(ax))
            ck.equal(f"{tag} {ax} size", (m.size(ax), g.size()), (2, 2))
    ck.equal("(4,) coord/size", (m4.coord("x"), m4.size(0), m4.group(0).size()), (rank, 4, 4))
    ck.equal("(4,) group ranks", dist.get_process_group_ranks(m4.group("x")), [0, 1, 2, 3])
    ck.equal("(1,4) size-1 axis", (m14.group("pp"), m14.size("pp"), m14.coord("pp")), (None, 1, 0))
    ck.equal("(1,4) tp axis", (m14.coord(-1), m14.group("tp").size(), m14.axis_index(-1)), (rank, 4, 1))
    ck.raises("shape vs world", DistributedError, lambda: Mesh.build((3,), ("x",)), "(3,)", "4")
    ck.raises("unknown axis", DistributedError, lambda: m22.size("pp"), "pp", "dp")
    return m22, m4


def _check_collectives(ck: _Checks, rank: int, gname: str, group, members: list[int]):
    from autopar.errors import DistributedError
    from autopar.runtime import collectives as C

    w, r = len(members), members.index(rank)
    full, W = _full((4, 8, 12), 1), _full((4, 8, 12), 2)
    scale = sum(m + 1 for m in members)  # rank m holds partial (m + 1) * full

    def chunk(t, d):
        return t.chunk(w, d)[r]

    def run(x, op, weight):
        x = x.clone().requires_grad_()
        out = op(x)
        (out * weight).sum().backward()
        return out.detach(), x.grad

    out, g = run(full * (rank + 1), lambda x: C.all_reduce(x, group), W)
    ck.close(f"{gname} all_reduce fwd", out, full * scale)
    ck.close(f"{gname} all_reduce bwd", g, W)
    out, g = run(full, lambda x: C.reduce_grad(x, group), W * (rank + 1))
    ck.close(f"{gname} reduce_grad fwd", out, full)
    ck.close(f"{gname} reduce_grad bwd", g, W * scale)
    for d in (0, 1, -1):
        out, g = run(chunk(full, d), lambda x: C.all_gather(x, d, group), W)
        ck.close(f"{gname} all_gather({d}) fwd", out, full)
        ck.close(f"{gname} all_gather({d}) bwd", g, chunk(W, d))
        out, g = run(chunk(full, d), lambda x: C.all_gather_reduce_grad(x, d, group), W * (rank + 1))
        ck.close(f"{gname} all_gather_reduce_grad({d}) fwd", out, full)
        ck.close(f"{gname} all_gather_reduce_grad({d}) bwd", g, chunk(W * scale, d))
        out, g = run(full, lambda x: C.split(x, d, group), chunk(W, d))
        ck.close(f"{gname} split({d}) fwd", out, chunk(full, d))
        ck.close(f"{gname} split({d}) bwd", g, W)
        out, g = run(full * (rank + 1), lambda x: C.reduce_scatter(x, d, group), chunk(W, d))
        ck.close(f"{gname} reduce_scatter({d}) fwd", out, chunk(full * scale, d))
        ck.close(f"{gname} reduce_scatter({d}) bwd", g, W)
    for i, o in ((0, 1), (1, 0), (2, 0), (-1, 1), (1, 1)):
        out, g = run(chunk(full, i), lambda x: C.all_to_all(x, i, o, group), chunk(W, o))
        ck.close(f"{gname} all_to_all({i}->{o}) fwd", out, chunk(full, o))
        ck.close(f"{gname} all_to_all({i}->{o}) bwd", g, chunk(W, i))
    # a channels-last activation (torchvision's ConvNeXt) into an all-to-all: was "Tensors must be contiguous"
    cl, wcl = _full((4, 8, 4, 4), 3), _full((4, 8, 4, 4), 4)
    for i, o in ((1, 0), (0, 1)):
        out, g = run(chunk(cl, i).contiguous(memory_format=torch.channels_last),
                     lambda x: C.all_to_all(x, i, o, group), chunk(wcl, o))
        ck.close(f"{gname} channels-last all_to_all({i}->{o}) fwd", out, chunk(cl, o))
        ck.close(f"{gname} channels-last all_to_all({i}->{o}) bwd", g, chunk(wcl, i))
    x = torch.ones(3)
    ck.equal(f"{gname} identity for group None", all(
        f(x) is x for f in (lambda t: C.all_reduce(t, None), lambda t: C.split(t, 0, None),
                            lambda t: C.all_to_all(t, 0, 0, group))), True)
    ck.raises(f"{gname} indivisible split", DistributedError, lambda: C.split(torch.ones(w + 1), 0, group),
              "not divisible", str(w))

    # Megatron tensor-parallel MLP (reduce_grad / all_reduce) and its sequence-parallel variant
    # (all_gather_reduce_grad / reduce_scatter) against the unsharded MLP.
    X, W1, W2, G = _full((8, 6), 3), _full((6, 8), 4), _full((8, 6), 5), _full((8, 6), 6)
    ref = [t.clone().requires_grad_() for t in (X, W1, W2)]
    y_ref = F.gelu(ref[0] @ ref[1]) @ ref[2]
    (y_ref * G).sum().backward()
    for sp in (False, True):
        x = (chunk(X, 0) if sp else X).clone().requires_grad_()
        w1, w2 = chunk(W1, 1).clone().requires_grad_(), chunk(W2, 0).clone().requires_grad_()
        h = C.all_gather_reduce_grad(x, 0, group) if sp else C.reduce_grad(x, group)
        p = F.gelu(h @ w1) @ w2
        y = C.reduce_scatter(p, 0, group) if sp else C.all_reduce(p, group)
        (y * (chunk(G, 0) if sp else G)).sum().backward()
        tag = f"{gname} {'sequence' if sp else 'tensor'}-parallel MLP"
        ck.close(f"{tag} fwd", y.detach(), chunk(y_ref.detach(), 0) if sp else y_ref.detach())
        ck.close(f"{tag} x grad", x.grad, chunk(ref[0].grad, 0) if sp else ref[0].grad)
        ck.close(f"{tag} w1 grad", w1.grad, chunk(ref[1].grad, 1))
        ck.close(f"{tag} w2 grad", w2.grad, chunk(ref[2].grad, 0))


def _check_data_parallel(ck: _Checks, rank: int, gname: str, group, members: list[int]):
    from autopar.runtime.collectives import GradSync, _buckets, all_reduce_mean_, broadcast_params_

    w = len(members)
    mean = sum(m + 1 for m in members) / w
    shapes = {"a": ((3, 4), torch.float64), "b": ((5,), torch.float64), "c": ((7,), torch.float32),
              "d": ((2, 2), torch.float64), "e": ((3,), torch.float64), "f": ((2,), torch.float64)}
    ps = {k: torch.zeros(s, dtype=dt, requires_grad=k != "f") for k, (s, dt) in shapes.items()}
    base = {k: _full(s, 10 + i, dt) for i, (k, (s, dt)) in enumerate(shapes.items())}
    for k in "abc":
        ps[k].grad = base[k] * (rank + 1)
    if rank == members[0]:
        ps["d"].grad = base["d"].clone()  # grad on one rank only: the others count as zeros
    ps["f"].grad = base["f"].clone()  # requires_grad=False: not synced
    sync = GradSync([ps["a"], ps["b"], ps["a"], ps["c"], ps["d"], ps["e"], ps["f"]], group, bucket_mb=100 / 2**20)
    ck.equal(f"{gname} GradSync params / buckets", (len(sync.params), sync.buckets), (5, [[0], [1, 3, 4], [2]]))
    sync.sync()
    for k in "abc":
        ck.close(f"{gname} GradSync {k}", ps[k].grad, base[k] * mean)
    ck.close(f"{gname} GradSync grad on one rank", ps["d"].grad, base["d"] / w)
    ck.equal(f"{gname} GradSync no grad anywhere stays None", ps["e"].grad, None)
    ck.close(f"{gname} GradSync skips requires_grad=False", ps["f"].grad, base["f"])
    ck.equal("_buckets big tensor alone", _buckets([torch.ones(100), torch.ones(1), torch.ones(1)], 8 / 2**20),
             [[0], [1, 2]])

    ts = [base[k] * (rank + 1) for k in "abc"]
    all_reduce_mean_(ts, group, bucket_mb=1e-5)
    ck.close(f"{gname} all_reduce_mean_", ts, [base[k] * mean for k in "abc"])
    ts = [torch.nn.Parameter(base[k] * (rank + 1)) for k in "abc"]
    broadcast_params_(ts, group, src_rank_in_group=1)
    ck.close(f"{gname} broadcast_params_", [t.detach() for t in ts], [base[k] * (members[1] + 1) for k in "abc"])


def _check_vocab_parallel(ck: _Checks, rank: int, gname: str, group, members: list[int]):
    from autopar.runtime.collectives import all_reduce
    from autopar.runtime.kernels import vocab_parallel_cross_entropy, vocab_parallel_embedding

    w, r = len(members), members.index(rank)
    V, D = 16, 6
    s, e = r * V // w, (r + 1) * V // w
    ids = torch.tensor([[0, 15, 3, 8, 8], [4, 12, 7, 11, 1], [2, 5, 9, 13, 14]])
    Wfull, G = _full((V, D), 20), _full((3, 5, D), 21)
    shard = Wfull[s:e].clone().requires_grad_()
    out = all_reduce(vocab_parallel_embedding(ids, shard, s, e), group)
    (out * G).sum().backward()
    Wref = Wfull.clone().requires_grad_()
    ref = F.embedding(ids, Wref)
    (ref * G).sum().backward()
    ck.close(f"{gname} vocab_parallel_embedding fwd", out.detach(), ref.detach())
    ck.close(f"{gname} vocab_parallel_embedding bwd", shard.grad, Wref.grad[s:e])
    # a padding row (BERT's pad token, nn.Embedding(padding_idx=...)) takes no gradient, on whichever rank holds it
    for pad in (0, 11, -1):
        shard = Wfull[s:e].clone().requires_grad_()
        out = all_reduce(vocab_parallel_embedding(ids, shard, s, e, padding_idx=pad, vocab_size=V), group)
        (out * G).sum().backward()
        Wref = Wfull.clone().requires_grad_()
        (F.embedding(ids, Wref, padding_idx=pad) * G).sum().backward()
        ck.close(f"{gname} vocab_parallel_embedding(padding_idx={pad}) fwd", out.detach(),
                 F.embedding(ids, Wfull, padding_idx=pad))
        ck.close(f"{gname} vocab_parallel_embedding(padding_idx={pad}) bwd", shard.grad, Wref.grad[s:e])

    target = torch.tensor([3, 15, 0, 8, -100, 7, 3, 12, 4])
    L, wts = _full((9, V), 22) * 3, _full((9,), 23)
    for red, ign, dtype in (("mean", -100, torch.float64), ("sum", -100, torch.float64),
                            ("mean", 3, torch.float64), ("none", 3, torch.float64), ("mean", -100, torch.float32)):
        tag = f"{gname} vocab_parallel_cross_entropy({red}, ignore_index={ign}, {dtype})"
        logits, tgt = L.to(dtype), target.where(target != -100, ign)  # -100 is only valid when ignored
        x = logits[:, s:e].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, tgt, s, e, group, ignore_index=ign, reduction=red)
        xr = logits.clone().requires_grad_()
        lref = F.cross_entropy(xr, tgt, ignore_index=ign, reduction=red)
        (loss * wts.to(dtype) if red == "none" else loss * 1.7).sum().backward()
        (lref * wts.to(dtype) if red == "none" else lref * 1.7).sum().backward()
        ck.close(f"{tag} fwd", loss.detach(), lref.detach())
        ck.close(f"{tag} bwd", x.grad, xr.grad[:, s:e])
    # [B, T, V] logits with [B, T] targets
    x = L[:8].reshape(2, 4, V)[..., s:e].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target[:8].reshape(2, 4), s, e, group)
    ck.close(f"{gname} vocab_parallel_cross_entropy 3-d", loss, F.cross_entropy(L[:8], target[:8]))


def _check_all(rank: int, world: int) -> list[str]:
    """Runs on every rank; returns this rank's failed checks."""
    ck = _Checks()
    m22, m4 = _check_mesh(ck, rank, world)
    for gname, group, members in (("tp2", m22.group("tp"), m22.group_ranks("tp")),
                                  ("world4", m4.group("x"), m4.group_ranks("x"))):
        _check_collectives(ck, rank, gname, group, members)
        _check_vocab_parallel(ck, rank, gname, group, members)
    _check_data_parallel(ck, rank, "dp2", m22.group("dp"), m22.group_ranks("dp"))
    _check_data_parallel(ck, rank, "world4", m4.group("x"), m4.group_ranks("x"))
    return [f"rank {rank}: {f}" for f in ck.failures]


def test_collectives_on_4_ranks():
    failures = [f for per_rank in run_distributed(_check_all, 4) for f in per_rank]
    assert not failures, f"{len(failures)} failed checks:\n" + "\n".join(failures)


def _fail_or_hang(rank: int, world: int):
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("boom on purpose")
    dist.barrier()  # never completes: rank 0 is gone


def _sleep(rank: int, world: int):
    time.sleep(600)


def test_run_distributed_reports_child_errors_and_hangs():
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 of 2 failed.*Traceback.*boom on purpose"):
        run_distributed(_fail_or_hang, 2, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not finish within 2"):
        run_distributed(_sleep, 1, timeout=2)
    assert time.monotonic() - t0 < 20


_SINGLE_PROCESS = textwrap.dedent("""
    import os
    import torch, torch.distributed as dist, torch.nn.functional as F
    from autopar.errors import DistributedError
    from autopar.runtime import collectives as C
    from autopar.runtime.dist import Mesh, init_process_group, local_device
    from autopar.runtime.kernels import vocab_parallel_cross_entropy

    os.environ["RANK"] = "0"
    try:
        init_process_group()
        raise SystemExit("partial torchrun env accepted")
    except DistributedError as e:
        assert "MASTER_ADDR" in str(e) and not dist.is_initialized(), e
    del os.environ["RANK"]
    try:
        Mesh.build((1,), ("dp",))
        raise SystemExit("Mesh.build before init accepted")
    except DistributedError as e:
        assert "init_process_group" in str(e), e

    assert init_process_group() == (0, 1)
    assert init_process_group() == (0, 1)  # idempotent
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        assert local_device() == torch.device("cpu")
    m = Mesh.build((1, 1), ("dp", "tp"))
    assert (m.group("dp"), m.group(1), m.size("tp"), m.coord("dp"), m.coords) == (None, None, 1, 0, (0, 0))
    for shape, names, needles in (((2, 2), ("dp", "tp"), ("(2, 2)", "4", "world size is 1")),
                                  ((1,), ("dp", "tp"), ("names",)), ((1, 1), ("dp", "dp"), ("distinct",))):
        try:
            Mesh.build(shape, names)
            raise SystemExit(f"Mesh.build({shape}, {names}) accepted")
        except DistributedError as e:
            assert all(n in str(e) for n in needles), e
    x = torch.randn(4, 6, requires_grad=True)
    assert C.all_reduce(x, m.group("dp")) is x and C.all_gather(x, 0, None) is x
    t = torch.tensor([1, 5, -100, 2])
    assert torch.allclose(vocab_parallel_cross_entropy(x, t, 0, 6, None), F.cross_entropy(x, t))
    x.grad = torch.ones_like(x)
    C.GradSync([x], m.group("dp")).sync()
    assert torch.equal(x.grad, torch.ones_like(x))
    dist.destroy_process_group()
    print("SINGLE-PROCESS-OK")
""")


def test_single_process_world_and_mesh_errors():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SINGLE_PROCESS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SINGLE-PROCESS-OK" in proc.stdout, proc.stdout + proc.stderr
