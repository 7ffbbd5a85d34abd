"""Bad inputs end in one clear AutoparError, never a raw torch error deep
inside or a silently wrong run (issue 17). One process (dp=1): fast."""
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import PlanError, StrategyError
from benchmarks.real_models import NanoGPT, lm_loss


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mse(out, target):
    return ((out - target) ** 2).mean()


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("call,words", [
    (lambda: autopar.parallelize(NoParams(), (torch.randn(4, 8),), loss_fn=lambda o, t: o.mean(), strategy="dp=1"),
     "no trainable parameters"),
    (lambda: autopar.parallelize(nn.Linear(8, 8), (torch.randn(4, 8),), loss_fn=lambda o, t: (o - t) ** 2,
                                 example_target=torch.randn(4, 8), strategy="dp=1"), "not a single number"),
    (lambda: autopar.parallelize(nn.Linear(8, 8), (torch.randn(4, 8),), loss_fn=None, strategy="dp=1"),
     "without loss_fn the model's output is taken as the loss"),
    (lambda: autopar.parallelize(nn.Linear(8, 8), (torch.randn(4, 8),), loss_fn=_mse, optimizer="adam",
                                 strategy="dp=1"), "optimizer must be a factory"),
])
def test_parallelize_refuses_clearly(call, words):
    with pytest.raises(StrategyError, match=words):
        call()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = NanoGPT(vocab=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ids = torch.randint(0, 64, (4, 16))
    # the example target IS the input tensor: export merged the two and the model embedded the target
    pm = autopar.parallelize(model, (ids,), loss_fn=lm_loss, example_target=ids, strategy="dp=1",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    return model, pm, ids


def test_an_example_target_that_is_the_input_is_not_merged_with_it(gpt):
    model, pm, ids = gpt
    target = torch.randint(0, 64, (4, 16))
    assert pm.train_step((ids,), target) == pytest.approx(lm_loss(model(ids), target).item(), rel=1e-5)


@pytest.mark.parametrize("batch,words", [
    (lambda ids: ((ids + 64,), ids), "input 0 holds ids in \\[64, 127\\], outside the embedding's rows"),
    (lambda ids: ((ids,), ids + 64), "the target holds ids in \\[64, 127\\], outside the loss's classes"),
    (lambda ids: ((ids.float(),), ids), "input 0 is torch.float32, but the model was traced with torch.int64"),
    (lambda ids: ((ids[:, :8],), ids[:, :8]), "input 0 has shape \\(4, 8\\), but the model was traced with "
                                              "\\(batch, 16\\)"),
    (lambda ids: ((ids,), ids[:, :8]), "the target has shape"),
    (lambda ids: ((ids, ids), ids), "2 input\\(s\\), but the model was traced with 1"),
    (lambda ids: (("tokens",), ids), "input 0 must be a tensor"),
])
def test_train_step_refuses_a_batch_unlike_the_example(gpt, batch, words):
    _, pm, ids = gpt
    full = ids.clone()
    full[0, 0], full[0, 1] = 0, 63       # ids span 0..63
    inputs, target = batch(full)
    with pytest.raises(StrategyError, match=words):
        pm.train_step(inputs, target)


def test_a_list_of_inputs_is_fine(gpt):
    _, pm, ids = gpt
    assert pm.train_step([ids], ids) == pm.train_step((ids,), ids)


def test_plan_files_that_are_not_plans(tmp_path):
    (tmp_path / "bin.json").write_bytes(bytes(range(256)))
    for path in (tmp_path, tmp_path / "bin.json"):
        with pytest.raises(PlanError, match="cannot be read|not valid JSON"):
            autopar.Plan.load(path)
