"""In-place ops are rewritten out of place (autopar/inplace.py), on both front
ends, so the sharded program computes what the model computes (issue 17: an
``h.add_(1.0)`` was dropped by dead-code elimination and the loss changed)."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import TraceError


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class InPlace(nn.Module):
    """Mutations whose results nobody names: ``add_``, ``mul_``, ``+=`` after a residual was taken."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        h.add_(1.0)
        r = torch.relu(h)
        r.mul_(2.0)
        s = r
        s += 0.5              # s and r are one tensor: the residual below sees the update
        return self.b(r + s)


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _state():
    torch.manual_seed(0)
    return InPlace(), torch.randn(8, 8), torch.randn(8, 4)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_no_inplace_op_is_left_in_the_graph(frontend):
    m, x, _ = _state()
    g = autopar.trace(m, (x,), frontend=frontend)
    names = [nd.target for nd in g.nodes if nd.op in ("call_function", "call_method")]
    assert not [t for t in names if t.endswith("_") and not t.endswith("__") or t in ("iadd", "imul")], names


class SizeArithmetic(nn.Module):
    """``n += 1`` on a size rebinds ``n``; the old value stays where it was read."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        n = x.size(0)
        m = n
        n += 2
        return self.a(x).sum() * n + m


def test_inplace_operator_on_a_size_rebinds_only():
    m = SizeArithmetic()
    x = torch.randn(4, 8)
    g = autopar.trace(m, (x,), frontend="fx")
    torch.testing.assert_close(g.gm(x), m(x))


def test_the_fx_program_computes_the_model():
    m, x, _ = _state()
    g = autopar.trace(m, (x,), frontend="fx")
    torch.testing.assert_close(g.gm(x), m(x))


class ViewThenRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        v = h.view(2, -1)
        v.mul_(2.0)           # writes h through a view, and h is read below
        return h.sum()


def test_a_mutated_view_read_through_its_base_is_refused():
    with pytest.raises(TraceError, match="view of .* reads afterwards"):
        autopar.trace(ViewThenRead(), (torch.randn(4, 8),), frontend="fx")


def test_batchnorm_state_update_stays():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
    g = autopar.trace(m, (torch.randn(2, 3, 8, 8),), frontend="export")
    kinds = {nd.target: nd.inputs for nd in g.nodes}
    assert "relu_" not in kinds and "relu" in kinds          # the in-place relu is out of place
    assert any(t == "add_" for t in kinds)                   # num_batches_tracked += 1 is the model's state


# the distributed run of InPlace is in test_runtime_scenarios.py (one spawn for several scenarios)


class FillZero(nn.Module):
    """fill_ / zero_ have no Tensor method without the underscore: they become full_like / zeros_like."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        m = torch.zeros_like(x)
        m.fill_(2.0)
        k = torch.ones_like(x)
        k.zero_()
        return (self.a(x) * m).sum() + k.sum()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_fill_and_zero_are_rewritten(frontend):
    m, x = FillZero(), torch.randn(2, 4)
    g = autopar.trace(m, (x,), frontend=frontend)
    assert not [nd.target for nd in g.nodes if nd.target.endswith("_")]
    if frontend == "fx":
        torch.testing.assert_close(g.gm(x), m(x))


class TopkRenormalised(nn.Module):
    """Mixtral's router (``transformers``): the top-k routing weights
    renormalised in place, then read with their indices. The outputs of
    ``topk`` are tensors of their own, not views of one storage: this was
    refused as a mutated view."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)
        w, idx = torch.topk(w, 2, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        return (w * idx.float()).sum()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_an_output_of_topk_written_in_place_is_no_view(frontend):
    m, x = TopkRenormalised(), torch.randn(4, 8)
    g = autopar.trace(m, (x,), frontend=frontend)
    assert not [nd.target for nd in g.nodes if nd.target.endswith("_") or nd.target == "itruediv"]
    if frontend == "fx":
        torch.testing.assert_close(g.gm(x), m(x))


class IndexedThenRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h[:, :4].mul_(2.0)    # indexing a tensor is a view: this writes h, read below
        return h.sum()


def test_an_indexed_tensor_stays_a_view():
    with pytest.raises(TraceError, match="view of .* reads afterwards"):
        autopar.trace(IndexedThenRead(), (torch.randn(4, 8),), frontend="fx")


class FilledInParts(nn.Module):
    """DeepSeek-V3's attention (``transformers``): a fresh tensor filled in parts,
    ``q = x.new_empty(...); q[..., :k] = a; q[..., k:] = b``, then read. Each write
    goes into a slice that a sibling slice or the base is read through afterwards:
    this was refused; it is a scatter of each part into a new tensor now."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        q = x.new_empty(x.shape[0], 8)
        q[:, :4] = self.a(x)
        q[:, 4:] = torch.tanh(self.b(x))
        q[0] = q[0] * 2.0           # a select, written after the slices
        return (q * q).sum()


def test_a_tensor_filled_in_parts_is_scattered():
    m, x = FilledInParts(), torch.randn(4, 8)
    g = autopar.trace(m, (x,), frontend="export")
    names = [nd.target for nd in g.nodes]
    assert "slice_scatter" in names and "select_scatter" in names and "copy_" not in names
    torch.testing.assert_close(torch.fx.Interpreter(g.gm).run(x), m(x))


class _RunningMean(nn.Module):
    """A buffer updated in place in the forward, as a VQ-VAE codebook's EMA or an observation
    normaliser is: ``self.ema.mul_(0.9).add_(m, alpha=0.1)`` (a chain of in-place ops), then read."""

    def __init__(self, export: bool = False, after: bool = False):
        super().__init__()
        self.export, self.after = export, after
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x):
        h = self.a(x)
        out = self.b(h - self.ema)           # with after=True the batch statistics reach the next step only
        if not self.export or x.shape[0] > 0:        # a branch on a size: fx cannot trace it, export can
            self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return out if self.after else self.b(h - self.ema)


def _ema_eager(steps: int, export: bool, after: bool) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    m, (x, y) = _RunningMean(export, after), _ema_batch()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.ema.clone()


def _ema_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _ema_worker(rank: int, world: int, strategy: str, export: bool, after: bool) -> tuple[list[float], torch.Tensor]:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    m, (x, y) = _RunningMean(export, after), _ema_batch()
    pm = autopar.parallelize(m, (x,), loss_fn=_loss, example_target=y, strategy=strategy,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return [pm.train_step((x,), y) for _ in range(3)], pm.full_state_dict()["ema"]


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("after", [False, True], ids=["read", "next-step"])
def test_a_buffer_updated_in_the_forward_is_updated(export, after):
    """fx ran ``self.ema.mul_(0.9)`` on the model's buffer while tracing and did not record it; the
    chain's second op took the first's output for a new tensor and was made out of place, so the
    buffer was never updated; the sharded program's dead-code elimination dropped such updates (fx
    counts a method call as pure); under tp each rank added its slice of the batch mean into its
    slice of the buffer, or updated a gathered copy of it; under dp each replica updated it from its
    own samples. One process, tp and dp now equal eager, whether the forward reads the update or
    only the next step does."""
    from distributed import run_distributed
    want, ema = _ema_eager(3, export, after)
    assert ema.abs().sum() > 0
    got = _ema_worker(0, 1, "precision=fp32", export, after)
    assert got[0] == pytest.approx(want, rel=1e-6) and torch.allclose(got[1], ema, atol=1e-6)
    for strategy in ("tp=2", "dp=2"):
        for losses, state in run_distributed(_ema_worker, 2, strategy, export, after, timeout=300):
            assert losses == pytest.approx(want, rel=1e-5), strategy
            assert torch.allclose(state, ema, atol=1e-5), strategy
