"""Hugging Face batches (issue 18): ``model(**batch)`` with the labels in the
batch and ``loss_fn="labels"`` traces, parallelizes and trains like one
process; train_step takes the same dict."""
import warnings

import pytest
import torch

import autopar
from autopar.errors import StrategyError, TraceError
from autopar.runtime.launch import run_distributed

transformers = pytest.importorskip("transformers")


def _bert():
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _train(rank, world, strategy):
    warnings.simplefilter("ignore")
    model, batch = _bert()
    ref_model, _ = _bert()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = []
    for _ in range(2):
        opt.zero_grad()
        loss = ref_model(**batch).loss
        loss.backward()
        opt.step()
        ref.append(loss.item())
    pm = autopar.parallelize(model, batch, loss_fn="labels", strategy=strategy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return ref, [pm.train_step(batch) for _ in range(2)], pm.input_keys


def test_keyword_batch_trains_like_one_process():
    for ref, got, keys in run_distributed(_train, 2, "dp=2"):
        assert got == pytest.approx(ref, rel=1e-5)
        assert keys == ("input_ids", "attention_mask")      # labels became the target


def test_keyword_batch_traces_with_keys():
    warnings.simplefilter("ignore")
    model, batch = _bert()
    g = autopar.trace(model, batch, loss_fn="labels")
    assert g.input_keys == ("input_ids", "attention_mask") and len(g.inputs) == 3     # + the target
    with pytest.raises(TraceError, match="identifier keys"):
        autopar.trace(model, {"input ids": batch["input_ids"]}, loss_fn="labels")


def test_keyword_batch_errors():
    warnings.simplefilter("ignore")
    model, batch = _bert()
    pm = autopar.parallelize(model, batch, loss_fn="labels", strategy="dp=1")
    with pytest.raises(StrategyError, match="not the traced ones"):
        pm.train_step({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    with pytest.raises(StrategyError, match="needs a target"):
        pm.train_step({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
    positional = autopar.parallelize(_bert()[0], (batch["input_ids"],), loss_fn="labels",
                                     example_target=batch["labels"], strategy="dp=1")
    with pytest.raises(StrategyError, match="traced with positional inputs"):
        positional.train_step(batch)


def _eval(rank, world, strategy):
    warnings.simplefilter("ignore")
    model, batch = _bert()
    ref = model(**batch).loss.item()
    pm = autopar.parallelize(model, batch, loss_fn="labels", strategy=strategy,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    before = pm.full_state_dict()
    got = pm.eval_step(batch)
    after = pm.full_state_dict()
    return ref, got, all(torch.equal(before[k], after[k]) for k in before)


def test_eval_step_is_the_loss_without_an_update():
    for ref, got, unchanged in run_distributed(_eval, 4, "dp=2,tp=2"):
        assert got == pytest.approx(ref, rel=1e-5) and unchanged
