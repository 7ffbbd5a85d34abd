"""The optimizer step's memory traffic: the cost model counts the passes torch's
own optimizers make over their tensors (an H100 measured AdamW at 3.3x the one
read and one write of the state the model counted before). The table is checked
here against the installed torch: every aten op of a step is intercepted and
the bytes of the full-size tensors it reads and writes are summed."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from cost_models import load_cluster, optimizer_step_bytes
from cost_models.memory import OPTIMIZER_ACCESSES

N = 4096


class _Traffic(TorchDispatchMode):
    """Bytes read and written by ops on tensors of ``N`` elements (0-d step
    counters and scalars left out): every tensor argument is read, once however
    many arguments name it (``addcmul_(v, g, g)`` loads each element of g once),
    except the destination of ``copy_``; every argument the op's schema writes,
    and every new output, is written."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written, read = set(), set()
        for i, a in enumerate(schema.arguments):
            val = args[i] if i < len(args) else kwargs.get(a.name)
            tensors = val if isinstance(val, (list, tuple)) else [val]
            for t in tensors:
                if not (isinstance(t, torch.Tensor) and t.numel() == N):
                    continue
                is_write = a.alias_info is not None and a.alias_info.is_write
                # the fused kernels' schema lets them unscale the grads in place: without a scale, only read
                if a.name == "grads" and kwargs.get("grad_scale") is None:
                    is_write = False
                if not (is_write and func.__name__.startswith("copy_")) and id(t) not in read:
                    self.bytes += t.numel() * t.element_size()      # read
                    read.add(id(t))
                if is_write:
                    self.bytes += t.numel() * t.element_size()      # written
                    written.add(id(t))
        outs = out if isinstance(out, (list, tuple)) else [out]
        for t in outs:
            if isinstance(t, torch.Tensor) and t.numel() == N and id(t) not in written:
                self.bytes += t.numel() * t.element_size()
        return out


def _step_bytes(make, foreach: bool) -> int:
    p = torch.nn.Parameter(torch.randn(N))
    p.grad = torch.randn(N)
    opt = make([p], foreach)
    opt.step()                       # the first step creates the state (SGD's momentum buffer by a clone)
    mode = _Traffic()
    with mode:
        opt.step()
    return mode.bytes


OPTIMIZERS = {
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-3, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=1e-3, foreach=fe),
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=1e-3, foreach=fe),
    "sgd_momentum": lambda ps, fe: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=fe),
    # fused: one kernel whatever foreach says
    "adam_fused": lambda ps, fe: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adamw_fused": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per-tensor"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_table_counts_what_torch_moves(name, foreach):
    assert _step_bytes(OPTIMIZERS[name], foreach) == 4 * N * OPTIMIZER_ACCESSES[name]
    assert optimizer_step_bytes(N, name) == 4 * N * OPTIMIZER_ACCESSES[name]


def test_mixed_precision_adds_the_casts():
    # the updated fp32 master cast into the bf16 weights (read 4, write 2); a bf16 gradient
    # also copied into the fp32 master gradient (read 2, write 4)
    assert optimizer_step_bytes(1, "adamw", "bf16", grad_bytes=4) == 80 + 6
    assert optimizer_step_bytes(1, "adamw", "bf16", grad_bytes=2) == 80 + 6 + 6
    assert optimizer_step_bytes(1, "adamw", "fp32") == 80
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_step_bytes(1, "lion")


def test_the_estimate_charges_the_step_at_the_devices_bandwidth():
    est = autopar.evaluate("gpt:layers=2,hidden=256,heads=4,seq=64,vocab=512", cluster="dgx-h100", devices=1,
                           strategy="precision=bf16", global_batch=8)
    n = autopar.trace("gpt:layers=2,hidden=256,heads=4,seq=64,vocab=512").num_params
    dev = load_cluster("dgx-h100").device
    want = n * (80 + 6) / (dev.memory_bandwidth * dev.memory_efficiency)
    assert est.optimizer_time_s == pytest.approx(want, rel=1e-6)
