"""Hugging Face batches (issue 18): ``model(**batch)`` with the labels in the
batch and ``loss_fn="labels"`` traces, parallelizes and trains like one
process; train_step takes the same dict."""
import warnings

import pytest
import torch

import autopar
from autopar.errors import StrategyError, TraceError

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

# training and eval_step on 4 processes are in test_runtime_scenarios.py
