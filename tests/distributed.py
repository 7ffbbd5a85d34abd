"""The tests' launcher is the product's own: :mod:`autopar.runtime.launch`."""
import os

import pytest

from autopar.runtime.launch import run_distributed  # noqa: F401

#: the 8-process spawns (38 s together on the 2-core machine) do not fit the suite's 10 minutes, so
#: they run when asked (`make test-spawn8`, AUTOPAR_SPAWN8=1); `make matrix` runs the real models'
#: 8-process families
spawn8 = pytest.mark.skipif(not os.environ.get("AUTOPAR_SPAWN8"),
                            reason="8-process spawn, beyond the suite's time budget: make test-spawn8")


def eager_steps(model, inputs, target, loss_fn, optimizer, steps: int = 3) -> list[float]:
    """``steps`` training steps of ``model`` in this process, as a user writes
    them (the reference a parallel run is compared with): the losses."""
    opt = optimizer(model.parameters())
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out
