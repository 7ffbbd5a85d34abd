"""Losses that sum the batch, and losses with terms of the weights, under a
split batch (dp, microbatches, copies, pipelines): each part's loss is a
part of the sum, not a sample of the mean, so the runtime scales the
backward and the reported loss by the number of parts; a loss plus an L2
term of the weights stays plain data parallelism. Every run equals one
process. Before, a summed loss trained under dp=2 with half the gradient
and reported half the loss (76.6 against 38.3), without a word; a
token-mean cross-entropy whose targets ignore tokens unevenly (padding,
masked prompts) averaged the parts' means, not the tokens (4.357 against
4.306 at the first step; under cp, whose load-balanced chunks put the
padding on one rank, 4.362 against 4.355: each part is now weighted by its
share of the counted tokens; a class-weighted cross-entropy, 1.386 against 1.370 under
dp=2, is weighted by its targets' class weights); and an L2
term of a weight written in the loss was a constant in the program (torch.fx
computed it at trace time; torch.export lifted the weight as a constant), so
it took no gradient, under every strategy, tp=2 included."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.sharding import batch_reduction, samples_meet
from distributed import eager_steps, run_distributed

GPT = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _mlp_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 8, generator=g),), torch.randn(8, 8, generator=g)


def _sq_sum(out, target):
    return ((out - target) ** 2).sum()


def _gpt():
    z = autopar.zoo.build(GPT, device="cpu", seed=0, batch=4)
    return z.model


def _gpt_batch():
    g = torch.Generator().manual_seed(2)
    return (torch.randint(0, 64, (4, 8), generator=g),), torch.randint(0, 64, (4, 8), generator=g)


def _ce_sum(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")


_L2 = {}


def _ce_plus_l2(logits, target):
    """A mean loss plus an L2 term of a weight (no data): stays a mean."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + \
        1e-2 * (_L2["w"] ** 2).sum()


def _gpt_padded_batch():
    """Targets with ignored tokens, unevenly: sample 0 keeps 2 of 8, sample 1 keeps 5 (SFT-style masks)."""
    inputs, target = _gpt_batch()
    target[0, 2:] = -100
    target[1, 5:] = -100
    return inputs, target


def _gpt_empty_part_batch():
    """Samples 0 and 1 ignore every token (a batch of long masked prompts): the
    first data-parallel rank's part, or the first microbatch, counts none."""
    inputs, target = _gpt_batch()
    target[:2] = -100
    target[2, 3:] = -100
    return inputs, target


def _gpt_empty_cp_rank_batch():
    """Positions 0, 1, 6 and 7 ignored in every sample: under cp=2 the
    load-balanced chunks give the first rank exactly those, so it counts none."""
    inputs, target = _gpt_batch()
    target[:, :2] = -100
    target[:, 6:] = -100
    return inputs, target


def _ce_mean(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


def _nll_mean(logits, target):
    """log_softmax then nll_loss, as older code and torchvision's examples write a cross-entropy."""
    return F.nll_loss(F.log_softmax(logits.reshape(-1, logits.shape[-1]), -1), target.reshape(-1))


_CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 5.0, 0.5, 1.0, 3.0, 1.0, 0.25])


def _mlp_class_batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8, 8, generator=g),), torch.randint(0, 8, (8,), generator=g)


def _weighted_ce(out, target):
    """A class-weighted cross-entropy (imbalanced classes): a mean over the targets' weights."""
    return F.cross_entropy(out, target, weight=_CLASS_WEIGHTS)


def _gpt_masked_batch():
    """The token ids and, stacked on the last dim, a mask that keeps 2 of 8 tokens of sample 0 and 5 of sample 1."""
    inputs, target = _gpt_batch()
    mask = torch.ones(4, 8)
    mask[0, 2:] = 0
    mask[1, 5:] = 0
    return inputs, torch.stack([target.float(), mask], -1)


def _gpt_masked_empty_batch():
    """The masked mean's batch with samples 0 and 1 masked out entirely."""
    inputs, target = _gpt_masked_batch()
    target[:2, :, 1] = 0
    return inputs, target


def _masked_mean(logits, target):
    """A masked mean written out, as custom training loops write it: a ratio of two batch sums."""
    ids, mask = target[..., 0].long(), target[..., 1]
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), reduction="none")
    return (tokens.view_as(mask) * mask).sum() / mask.sum()


CASES = {"mlp-sum": (_mlp, _mlp_batch, _sq_sum), "gpt-ce-sum": (_gpt, _gpt_batch, _ce_sum),
         "gpt-ce-l2": (_gpt, _gpt_batch, _ce_plus_l2), "gpt-ce-padded": (_gpt, _gpt_padded_batch, _ce_mean),
         "gpt-masked-mean": (_gpt, _gpt_masked_batch, _masked_mean),
         "gpt-nll-padded": (_gpt, _gpt_padded_batch, _nll_mean),
         "mlp-weighted-ce": (_mlp, _mlp_class_batch, _weighted_ce),
         "gpt-ce-empty-part": (_gpt, _gpt_empty_part_batch, _ce_mean),
         "gpt-ce-empty-cp-rank": (_gpt, _gpt_empty_cp_rank_batch, _ce_mean),
         "gpt-masked-empty-part": (_gpt, _gpt_masked_empty_batch, _masked_mean)}
RUNS = [("mlp-sum", "dp=2"), ("mlp-sum", "dp=2,microbatches=2,zero=1"), ("gpt-ce-sum", "pp=2,microbatches=2"),
        ("gpt-ce-sum", "tp=2,copies=2"), ("gpt-ce-l2", "dp=2,microbatches=2"),
        ("gpt-ce-padded", "dp=2"), ("gpt-ce-padded", "dp=2,microbatches=2,zero=1"),
        ("gpt-ce-padded", "pp=2,microbatches=2"), ("gpt-ce-padded", "cp=2"), ("gpt-masked-mean", "dp=2,microbatches=2"),
        ("gpt-masked-mean", "pp=2,microbatches=2"), ("gpt-nll-padded", "dp=2"),
        ("mlp-weighted-ce", "dp=2,microbatches=2"), ("mlp-weighted-ce", "tp=2"),
        # a part that counts no token: its loss is 0/0, weighted 0 (before: the step raised a non-finite loss)
        ("gpt-ce-empty-part", "dp=2"), ("gpt-ce-empty-part", "dp=2,microbatches=2,zero=1"),
        ("gpt-ce-empty-part", "pp=2,microbatches=2"), ("gpt-ce-empty-part", "tp=2,microbatches=2"),
        ("gpt-ce-empty-cp-rank", "cp=2"), ("gpt-masked-empty-part", "dp=2"),
        ("gpt-masked-empty-part", "pp=2,microbatches=2"),
        # copies weight their losses by their counts inside the program (before: the copies' means averaged)
        ("gpt-ce-padded", "tp=2,copies=2"), ("gpt-masked-mean", "tp=2,copies=2"),
        ("gpt-ce-empty-part", "tp=2,copies=2"), ("gpt-ce-empty-part", "tp=2,copies=2,microbatches=2"),
        ("mlp-weighted-ce", "tp=2,copies=2"),
        # cp: each rank's loss sums its positions (before: averaged, half the gradient)
        ("gpt-ce-sum", "cp=2"), ("gpt-ce-sum", "cp=2,microbatches=2")]


def _make(name: str):
    make, batch, loss = CASES[name]
    model = make()
    if name == "gpt-ce-l2":
        _L2["w"] = next(p for p in model.parameters() if p.dim() == 2)
    return model, batch(), loss


def _steps(name: str, strategy: str | None) -> list[float]:
    model, (inputs, target), loss = _make(name)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.01)   # noqa: E731
    if strategy is None:
        return eager_steps(model, inputs, target, loss, opt)
    pm = autopar.parallelize(model, inputs, loss_fn=loss, example_target=target, optimizer=opt, strategy=strategy)
    return [pm.train_step(inputs, target) for _ in range(3)]


def _all_ignored() -> str:
    """dp=2 on a batch whose every target is ignored: one process's loss is
    0/0, and so is the step's (a non-finite loss, not a silent 0)."""
    model, (inputs, target), loss = _make("gpt-ce-empty-part")
    target[:] = -100
    pm = autopar.parallelize(model, inputs, loss_fn=loss, example_target=target, strategy="dp=2",
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    try:
        pm.train_step(inputs, target)
    except autopar.errors.NonFiniteLossError as e:
        return str(e)
    return "trained"


def _worker(rank: int, world: int) -> list:
    return [_steps(name, strategy) for name, strategy in RUNS] + [_all_ignored()]


def test_the_loss_reduction_is_read_off_the_batch_walk():
    def graph(name):
        model, (inputs, target), loss = _make(name)
        return autopar.trace(model, inputs, loss_fn=loss, target=target)

    assert batch_reduction(graph("mlp-sum")) == batch_reduction(graph("gpt-ce-sum")) == "sum"
    l2 = graph("gpt-ce-l2")
    assert batch_reduction(l2) == "mean" and samples_meet(l2) is None   # the weight's term is no meeting
    # torch.fx would fold the weight's term into a constant: export traces it, reading the parameter
    assert l2.frontend == "export" and "trainable weights at trace time" in l2.fallback_reason
    reads = [n.target for n in l2.gm.graph.nodes if n.op == "get_attr"]
    assert not any(t.startswith(("lifted_tensor", "_tensor_constant")) for t in reads), reads
    assert batch_reduction(autopar.api.as_graph(GPT)) == "mean"


def test_a_token_mean_loss_is_counted():
    """The token counter: a cross-entropy averaged over its target's tokens
    whose target is made of the inputs (found on either front end); it counts
    what the loss counts."""
    from autopar.compile.tokens import token_counter
    model, (inputs, target), loss = _make("gpt-ce-padded")
    g = autopar.trace(model, inputs, loss_fn=loss, target=target)
    counter = token_counter(g)
    assert counter is not None and int(counter(*inputs, target)) == 2 + 5 + 8 + 8
    assert int(counter(inputs[0][2:], target[2:])) == 16
    for other in (_ce_sum, lambda o, t: F.cross_entropy(o.reshape(-1, 64), t.reshape(-1), label_smoothing=0.1)):
        assert token_counter(autopar.trace(_gpt(), inputs, loss_fn=other, target=target)) is None


def test_a_masked_mean_is_divided_by_the_whole_batch_mask():
    """``(loss * mask).sum() / mask.sum()``: what it divides by is found
    (a batch sum of the target alone), so it is no meeting of samples: dp,
    microbatches and pipelines weight each part by its share of the mask
    (before, dp gathered and microbatches were refused), copies by theirs
    inside the program; cp, which averages its ranks' losses inside the
    program, is refused in words."""
    from autopar.compile.tokens import token_counter
    from autopar.errors import UnsupportedError
    from autopar.parallelize import check_runnable
    from autopar.sharding import loss_denominator
    from autopar.spec import parse_strategy
    model, (inputs, target), loss = _make("gpt-masked-mean")
    g = autopar.trace(model, inputs, loss_fn=loss, target=target)
    assert samples_meet(g) is None and loss_denominator(g)[0] == "sum"
    assert float(token_counter(g)(*inputs, target)) == 2 + 5 + 8 + 8
    with pytest.raises(UnsupportedError, match="ratio of batch sums"):
        check_runnable(g, parse_strategy("cp=2"))
    check_runnable(g, parse_strategy("tp=2,copies=2"))


def test_a_loss_that_reduces_positions_apart_from_samples_is_refused_under_cp():
    """A sum over each sample's positions, then a mean over the samples: cp
    splits the positions, and its ranks' losses would be averaged, not
    added, so it is refused in words; a cross-entropy over the flattened
    tokens (positions reduced with the samples) runs."""
    from autopar.errors import UnsupportedError
    from autopar.parallelize import check_runnable
    from autopar.sharding import positions_reduced_with_samples
    from autopar.spec import parse_strategy

    def per_sample_sum(logits, target):
        tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        return tokens.view(target.shape).sum(1).mean()

    inputs, target = _gpt_batch()
    g = autopar.trace(_gpt(), inputs, loss_fn=per_sample_sum, target=target)
    assert not positions_reduced_with_samples(g, 8)
    with pytest.raises(UnsupportedError, match="positions apart from the samples"):
        check_runnable(g, parse_strategy("cp=2"))
    check_runnable(g, parse_strategy("dp=2"))
    flat = autopar.trace(_gpt(), inputs, loss_fn=_ce_sum, target=target)
    assert positions_reduced_with_samples(flat, 8)
    check_runnable(flat, parse_strategy("cp=2"))


def test_a_summed_loss_under_a_split_batch_equals_one_process():
    got = run_distributed(_worker, 2, timeout=300)[0]
    assert "the loss is nan" in got.pop()
    for (name, strategy), losses in zip(RUNS, got):
        assert losses == pytest.approx(_steps(name, None), rel=1e-5, abs=1e-5), (name, strategy)


def _hf_gpt2_padded():
    """Hugging Face GPT-2 with its own loss (``labels`` in the batch; the
    model shifts them and averages the tokens not -100), the labels masked
    unevenly as supervised fine-tuning masks prompts and padding."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    labels = ids.clone()
    labels[0, 3:] = -100
    labels[1, 10:] = -100
    return model, {"input_ids": ids, "labels": labels}


def _hf_worker(rank: int, world: int) -> list:
    out = []
    for strategy in ("dp=2", "pp=2,microbatches=2"):
        model, batch = _hf_gpt2_padded()
        pm = autopar.parallelize(model, batch, loss_fn="labels", strategy=strategy,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
        out.append([pm.train_step(batch) for _ in range(3)])
    return out


def test_a_hugging_face_loss_over_masked_labels_equals_one_process():
    """The model's own loss (a keyword batch with labels, torch.export) is
    found as a token mean, and dp and a pipeline train as one process does."""
    model, batch = _hf_gpt2_padded()
    o = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = []
    for _ in range(3):
        o.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        o.step()
        ref.append(loss.item())
    for losses in run_distributed(_hf_worker, 2, timeout=300)[0]:
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-5)


GRID_RUNS = [("gpt-ce-padded", "tp=4,tp_mode=2d"), ("gpt-ce-empty-part", "tp=4,tp_mode=2d,dp=1")]


def _grid_worker(rank: int, world: int) -> list:
    return [_steps(name, strategy) for name, strategy in GRID_RUNS]


def test_a_token_mean_split_over_a_grid_s_rows_equals_one_process():
    """A 2D grid's rows split each microbatch's samples inside the program:
    the loss's token mean is weighted there by each row's share of the
    counted tokens (before: the rows' means averaged, 4.357 against 4.306,
    and a row of masked prompts gave a non-finite loss)."""
    got = run_distributed(_grid_worker, 4, timeout=300)[0]
    for (name, strategy), losses in zip(GRID_RUNS, got):
        assert losses == pytest.approx(_steps(name, None), rel=1e-5, abs=1e-5), (name, strategy)
