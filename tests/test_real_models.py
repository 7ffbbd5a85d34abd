"""Models written the way their authors write them run every strategy family
with the numerics of one process (issue 15).

None of these models traces with symbolic ``torch.fx`` (nanoGPT's ``B, T, C =
x.size()`` and its mask buffer sliced by ``T``; every Hugging Face model), so
all go through ``torch.export``. One spawn of 4 gloo processes runs a covering
subset of the matrix: six of its eight export models (the other two are
variants run elsewhere: ``ELSEWHERE``), and tp, dp x tp, 1F1B and
interleaved pipelines, sequence parallel, full recompute, ZeRO-2/3 on at
least one model (selective recompute, ZeRO-1 and
bf16 run on the zoo's graphs in tests/test_memory_options.py, for the suite's
time budget). The full models x families matrix (and pp x dp x tp on 8 processes) is
``make matrix`` (:mod:`benchmarks.matrix`), with its table in
``benchmarks/README.md``.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from benchmarks import matrix  # noqa: E402
from benchmarks.real_models import VISION  # noqa: E402
from distributed import eager_steps, run_distributed  # noqa: E402

# the vision models (torchvision, timm) trace with torch.fx: tests/test_vision.py runs them
EXPORT_MODELS = sorted(set(matrix.MODELS) - set(VISION))

RUNS = [
    ("nanogpt-vocab", "dp x tp", "dp=2,tp=2"),    # both vocabulary-parallel kernels
    ("nanogpt-tied", "pp interleaved", "pp=2,dp=2,schedule=interleaved,chunks=2,microbatches=4"),
    ("hf-llama", "sequence parallel", "tp=4,sequence_parallel=true"),
    ("hf-gpt2", "zero-2", "dp=2,tp=2,zero=2"),
    ("hf-bert", "recompute full", "pp=2,tp=2,recompute=full,microbatches=2"),   # also tp and a 1F1B pipeline
    ("hf-vit", "zero-3", "dp=4,zero=3"),
    # a mixture of experts, its experts split Megatron-style, in an interleaved pipeline (its
    # layers were found as 2, not 4: below)
    ("hf-mixtral", "pp interleaved", "pp=2,tp=2,schedule=interleaved,chunks=2,microbatches=2"),
    # latent attention whose queries are filled in parts (scatters under tp), and a dense layer before the
    # experts, a pipeline unit of its own: 4 stages of one layer each
    ("hf-deepseekv3", "pp interleaved", "pp=2,tp=2,schedule=interleaved,chunks=2,microbatches=2"),
    # an encoder-decoder: the pipeline cuts between the encoder's layers and inside the decoder's
    ("hf-t5", "pp x tp", "pp=2,tp=2,microbatches=2"),
]
#: models of `make matrix` left out of the suite's spawn (its time budget), with where they run here
ELSEWHERE = {"nanogpt": "nanogpt-vocab without its vocabulary-parallel annotations",
             "hf-gpt2-labels": "Hugging Face's own loss: tests/test_runtime_scenarios.py (loss_fn='labels')"}


@pytest.fixture(scope="module")
def results():
    return run_distributed(matrix.worker, 4, [(m, s) for m, _, s in RUNS], timeout=600)


@pytest.mark.parametrize("model,family,strategy", RUNS)
def test_real_model_matches_single_process(results, model, family, strategy):
    ref = matrix.reference(model, "bf16" if family in matrix.TOLERANCE else "fp32")
    per_rank = [r[(model, strategy)] for r in results]
    assert matrix.check(family, strategy, ref, per_rank) == "ok", per_rank[0].get("traceback")
    if "tp=" in strategy:
        assert per_rank[0]["comms"] > 0


def test_matrix_families_are_all_covered():
    # selective recompute, ZeRO-1 and bf16 run on export graphs in `make matrix`; in `make test` on the
    # zoo's fx graphs (tests/test_memory_options.py), for the suite's time budget; so does the 2d grid
    # (tests/test_tensor2d.py, with sequence parallelism on its columns too, Hugging Face's GPT-2
    # among its models); dp x 2d, 2.5d and 3d take 8 processes, as pp x dp x tp
    # tp and pp 1F1B run inside the recompute-full strategy (pp=2,tp=2, 1F1B by default)
    assert {f for _, f, _ in RUNS} >= set(matrix.FAMILIES) - {"dp", "pp x dp x tp", "zero-1",
                                                               "recompute selective", "bf16", "2d", "2d sp",
                                                               "dp x 2d", "2.5d", "3d", "pp x 2d", "2d zero-3",
                                                               "tp", "pp 1F1B"}
    assert matrix.FAMILIES["recompute full"][0].startswith("pp=2,tp=2,")
    assert {m for m, _, _ in RUNS if m in matrix.MODELS} | set(ELSEWHERE) == set(EXPORT_MODELS)


@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_real_models_need_torch_export(model):
    """The premise: symbolic fx cannot trace these, so every run above compiled an export graph,
    whose repeated layers come from export's module stacks."""
    import autopar
    from benchmarks.real_models import MODELS
    c = MODELS[model]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    assert g.frontend == "export"
    assert g.fallback_reason and g.summary()["fallback_reason"] == g.fallback_reason   # why fx failed
    assert g.traced_batch_dims is not None          # the batch size was a symbol
    assert [len(gr.instances) for gr in g.groups] == [c.layers]


def test_vocab_parallel_kernels_on_an_export_graph():
    """The nanogpt-vocab run above (dp=2,tp=2) uses both vocabulary-parallel kernels:
    the embedding pinned to vocabulary rows and the cross-entropy the search splits."""
    import autopar
    from autopar.search.pins import annotations
    from benchmarks.real_models import MODELS
    c = MODELS["nanogpt-vocab"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    assert g.frontend == "export"
    p = autopar.plan(g, cluster="cpu", devices=4, global_batch=8, strategy="dp=2,tp=2",
                     shardings=annotations(c.model))
    ops = p.to_dict()["ops"]
    chosen = {}
    for name, key in g.op_keys().items():
        st, nd = ops.get(key), g[name]
        if st is None:
            continue
        if nd.kind == "cross_entropy" or nd.kind == "embedding" and g[nd.inputs[0]].param == "model.transformer.wte.weight":
            chosen[nd.kind] = st["strategy"][1]        # the tensor-parallel axis
    assert chosen == {"embedding": "vocab", "cross_entropy": "vocab"}


def test_export_factory_ops_follow_the_rank_device():
    """torch.export writes the trace's device into factory ops (a Hugging Face
    model's ``arange`` of positions): the compiled program must make them on
    the rank's device, or a model traced on the CPU fails on a GPU (seen on an
    H200: "index is on cpu, different from other tensors on cuda:0")."""
    import torch

    from autopar.compile.fx_utils import retarget_devices

    class Pos(torch.nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[1], dtype=x.dtype)

    gm = torch.export.export(Pos(), (torch.zeros(2, 3),)).module()
    named = [n for n in gm.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    assert named and all(n.kwargs["device"].type == "cpu" for n in named)
    assert retarget_devices(gm, torch.device("meta")) == len(named)
    out = gm(torch.zeros(2, 3, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3)
    assert retarget_devices(gm, torch.device("meta")) == 0     # already there: the graph is left alone


def test_devices_in_no_grad_and_autocast_regions_follow_the_rank_device():
    """A Hugging Face rotary embedding runs under ``@torch.no_grad()`` and
    ``torch.autocast(enabled=False)``: torch.export makes each region a graph
    of its own behind a higher-order op, with the trace's device inside
    (seen on an H200 with Mixtral: "Tensor device mismatch! Expected: cpu,
    Got: cuda:0" from an ``_assert_tensor_metadata`` in the no-grad region)."""
    import torch

    from autopar.compile.fx_utils import retarget_devices

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)

        @torch.no_grad()
        def forward(self, x):
            with torch.autocast(device_type="cpu", enabled=False):
                pos = torch.arange(x.shape[1], dtype=torch.float32)
                freq = self.inv_freq[None, :, None].float().to(x.device)    # aten.to.device(.., cpu, ..)
                return (freq * pos[None, None, :]).float()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary, self.proj = Rotary(), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.proj(x) * self.rotary(x).sum()

    gm = torch.export.export(Model(), (torch.zeros(2, 3),)).module()

    def named(device_type):
        return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
                if n.op == "call_function" and (n.kwargs.get("device") == torch.device(device_type)
                                                or n.args[:1] == (device_type,)
                                                or torch.device(device_type) in n.args)]
    before = named("cpu")
    assert len(before) >= 4        # arange, a metadata assert, to(device) and the autocast region's device type
    assert retarget_devices(gm, torch.device("meta")) == len(before)
    assert named("cpu") == [] and len(named("meta")) == len(before)
    assert retarget_devices(gm, torch.device("meta")) == 0


def test_layers_that_differ_by_a_reused_size_expression_are_one_group():
    """torch.export computes a size expression once and reuses it: Mixtral's
    experts view by ``16 * batch`` in every layer, computed in the first. The
    first layer then held two more (size) nodes than the others, the layers
    were no group, and a 4-layer Mixtral had 2 "repeated layers" (its first
    layer's two norms): an interleaved pipeline was refused."""
    import autopar
    from autopar.cost import units
    from benchmarks.real_models import BREADTH_HF
    c = BREADTH_HF["hf-mixtral"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    assert [len(gr.instances) for gr in g.groups] == [4]
    assert units(g).layers == 4
    sizes = [nd for nd in g.nodes if nd.kind == "shape" and nd.module.startswith("model.model.layers.0.")]
    assert sizes and all(nd.group is None for nd in sizes)      # outside the instances, read by all four



@pytest.mark.parametrize("model,grouped,unlike", [
    ("hf-smollm3", ["model.model.layers.0", "model.model.layers.1", "model.model.layers.2"],
     "model.model.layers.3"),       # no rotary positions in every fourth layer
    ("hf-deepseekv3", ["model.model.layers.1", "model.model.layers.2", "model.model.layers.3"],
     "model.model.layers.0"),       # a dense layer before the mixture-of-experts ones
])
def test_a_stack_with_an_unlike_layer_keeps_its_alike_layers_and_every_unit(model, grouped, unlike):
    """A layer stack with one layer unlike the rest: SmolLM3's layer without
    rotary positions made its four layers no group at all (their op sequences
    differ), so a layer's two norms were taken for the model's "repeated
    layers"; DeepSeek-V3's dense first layer was no pipeline unit (it rode
    with the embedding), and neither ran an interleaved pipeline. The alike
    layers are one group, the unlike one a layer instance of its own, and the
    pipeline has four units, one per layer."""
    import autopar
    from autopar.cost import units
    from benchmarks.real_models import BREADTH_HF
    c = BREADTH_HF[model]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    assert [gr.instances for gr in g.groups] == [grouped]
    assert units(g).labels[1:-1] == tuple(sorted([*grouped, unlike]))
    mine = [nd for nd in g.nodes if nd.module.startswith(unlike + ".") and not nd.is_state]
    assert mine and all(nd.group == unlike for nd in mine)
    est = autopar.evaluate(g, strategy="pp=2,microbatches=4,schedule=interleaved,chunks=2", cluster="cpu",
                           devices=2, global_batch=8)
    assert est.pipeline["layers"] == [1, 1, 1, 1]



@pytest.mark.parametrize("model,first_decoder", [("hf-t5", "model.model.decoder.block.0"),
                                                 ("hf-bart", "model.model.model.decoder.layers.0")])
def test_an_encoder_decoder_pipelines_its_encoder_and_its_decoder(model, first_decoder):
    """An encoder-decoder's layers are two stacks, one after the other: the
    pipeline units are the encoder's layers then the decoder's (they were the
    decoder's alone, the whole encoder riding with the embedding), and T5's
    first block of each stack (the only one with a relative position bias, so
    in no group) is a unit like the others."""
    import autopar
    from autopar.cost import units
    from benchmarks.real_models import ENCODER_DECODER
    c = ENCODER_DECODER[model]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    labels = units(g).labels[1:-1]
    assert len(labels) == 8 and labels[4] == first_decoder and all("encoder" in x for x in labels[:4])
    est = autopar.evaluate(g, strategy="pp=2,microbatches=4,schedule=interleaved,chunks=2", cluster="cpu",
                           devices=2, global_batch=8)
    assert est.pipeline["layers"] == [2, 2, 2, 2]



def test_layers_whose_first_op_reads_a_weight_alone_are_in_sequence():
    """Nemotron's layers start with their norm's ``weight + 1``, an op that
    reads a weight alone: the test whether layers run one after another
    looked at each layer's first op only, found them not in sequence, and
    the model had no pipeline units. It now looks at what each layer reads."""
    import autopar
    from autopar.cost import units
    from benchmarks.real_models import BREADTH_HF
    c = BREADTH_HF["hf-nemotron"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    first = next(nd for nd in g.nodes if nd.group == "model.model.layers.1" and not nd.is_state)
    assert all(g[i].is_state for i in first.inputs)
    assert units(g).layers == 4


@pytest.mark.parametrize("kinds", ["AAAA", "BAAA", "AABA", "ABAB", "AAB", "ABBA", "ABCA"])
def test_every_layer_of_a_mixed_stack_is_a_pipeline_unit(kinds):
    """Stacks of layers of two or three kinds in any order (``A``: a residual
    MLP, ``B``: the same with a norm first, ``C``: another width inside): the
    kinds that occur twice or more are groups, every layer is a pipeline unit
    in stack order, and a pipeline of one layer per stage evaluates."""
    import torch
    import torch.nn as nn

    import autopar
    from autopar.cost import units

    class Layer(nn.Module):
        def __init__(self, kind):
            super().__init__()
            inner = 24 if kind == "C" else 16
            self.norm = nn.LayerNorm(8) if kind == "B" else None
            self.up, self.down = nn.Linear(8, inner), nn.Linear(inner, 8)

        def forward(self, x):
            h = self.norm(x) if self.norm is not None else x
            return x + self.down(torch.relu(self.up(h)))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 4)
            self.layers = nn.ModuleList(Layer(k) for k in kinds)

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    def loss(out, target):
        return ((out - target) ** 2).mean()

    g = autopar.trace(Stack(), (torch.randn(8, 4),), loss_fn=loss, target=torch.randn(8, 4))
    twice = {k for k in kinds if kinds.count(k) > 1}
    assert g.frontend == "fx"       # the stacks of fx graphs too, not only export's
    assert sorted(sorted(gr.instances) for gr in g.groups) == sorted(
        [f"model.layers.{i}" for i, x in enumerate(kinds) if x == k] for k in twice)
    assert units(g).labels[1:-1] == tuple(f"model.layers.{i}" for i in range(len(kinds)))
    n = len(kinds)
    est = autopar.evaluate(g, strategy=f"pp={n},microbatches={n}", cluster="cpu", devices=n, global_batch=2 * n)
    assert est.pipeline["layers"] == [1] * len(kinds)


class _TwoTower:
    """A two-tower contrastive model (CLIP's shape: token ids and pixels,
    logits image x text over the batch), as fx traces it (``control=False``)
    or only torch.export does (a branch on a size)."""

    @staticmethod
    def build(control: bool):
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        class TwoTower(nn.Module):
            def __init__(self):
                super().__init__()
                self.text, self.image = nn.Embedding(16, 8), nn.Linear(12, 8)
                self.scale = nn.Parameter(torch.tensor([2.0]))
                self.cls = nn.Parameter(torch.randn(8))

            def forward(self, ids, pixels):
                if control and ids.shape[0] > 1:   # control flow on a size: torch.fx cannot trace it
                    pixels = pixels * 1.0
                t = F.normalize(self.text(ids).mean(1), dim=-1)
                # a weight made the batch's size (timm's and CLIP's class token): a value of the weight alone
                i = F.normalize(self.image(pixels) + self.cls.expand(pixels.shape[0], -1), dim=-1)
                return self.scale * i @ t.t()

        torch.manual_seed(0)
        return TwoTower()

    @staticmethod
    def batch():
        import torch
        g = torch.Generator().manual_seed(1)
        return (torch.randint(0, 16, (8, 5), generator=g), torch.randn(8, 12, generator=g)), torch.arange(8)

    @staticmethod
    def loss(logits, target):
        """CLIP's symmetric loss, the labels made in the loss from the logits' size."""
        import torch
        import torch.nn.functional as F
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2 + 0 * target.sum()


def _hf_clip():
    import torch
    import transformers as T
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.CLIPConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=16),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=16, patch_size=8), projection_dim=16)

    class Clip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = T.CLIPModel(cfg)

        def forward(self, ids, px):
            return self.m(input_ids=ids, pixel_values=px).logits_per_image

    g = torch.Generator().manual_seed(1)
    return Clip(), (torch.randint(0, 64, (8, 16), generator=g), torch.randn(8, 3, 16, 16, generator=g)), \
        torch.arange(8)


def _contrastive(name: str):
    """(model, inputs, target, loss) of a model whose samples meet."""
    import torch.nn.functional as F
    if name == "hf-clip":
        import autopar  # noqa: F401 - its torchvision shim before transformers
        model, inputs, target = _hf_clip()
        return model, inputs, target, F.cross_entropy
    inputs, target = _TwoTower.batch()
    return _TwoTower.build(control=name == "two-tower-export"), inputs, target, _TwoTower.loss


CONTRASTIVE = [("two-tower-fx", "dp=2"), ("two-tower-export", "dp=2,zero=1"), ("hf-clip", "dp=2"),
               ("hf-clip", "dp=2,zero=3")]    # FSDP2 leaves CLIP's 0-d logit_scale whole


def _contrastive_steps(name: str, strategy: str | None):
    """Three SGD steps of ``name``: (losses, final weights, the kinds of the
    program's collectives), in one process when ``strategy`` is None."""
    import torch
    import autopar
    model, inputs, target, loss = _contrastive(name)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5)   # noqa: E731
    if strategy is None:
        losses = eager_steps(model, inputs, target, loss, opt)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, []
    pm = autopar.parallelize(model, inputs, loss_fn=loss, example_target=target, optimizer=opt, strategy=strategy)
    losses = [pm.train_step(inputs, target) for _ in range(3)]
    kinds = sorted(m.kind for m in pm.program.modules() if type(m).__name__ == "Comm")
    return losses, {k.removeprefix("model."): v.clone() for k, v in pm.full_state_dict().items()}, kinds


def _contrastive_worker(rank: int, world: int) -> list:
    return [_contrastive_steps(name, strategy) for name, strategy in CONTRASTIVE]


def test_a_model_whose_samples_meet_trains_under_data_parallelism():
    """A contrastive model (an image x text similarity over the batch) under
    dp trains what one process does. Before, a torch.fx-traced one ran on
    silently with each rank's own samples only (first loss 1.42 against
    2.07), and torch.export ones were refused. Now the data-parallel axis is
    compiled in like a tensor axis where samples meet: each rank gathers the
    other ranks' text features, the loss is the whole batch's, and each
    weight's gradient is reduced once, by the runtime (no all-reduce of
    weights in the program: only the gathers and the loss's all-reduce)."""
    import torch
    got = run_distributed(_contrastive_worker, 2, timeout=300)[0]
    for (name, strategy), (losses, weights, kinds) in zip(CONTRASTIVE, got):
        ref_losses, ref_weights, _ = _contrastive_steps(name, None)
        assert losses == pytest.approx(ref_losses, abs=1e-5), (name, strategy)
        for k, w in ref_weights.items():
            assert torch.allclose(weights[k], w, atol=1e-5), (name, strategy, k)
        assert "all_gather" in kinds or "all_gather_reduce_grad" in kinds, (name, kinds)
        assert "reduce_grad" not in kinds, (name, kinds)     # no weight gradient reduced in the program


def test_where_samples_meet_is_found_by_either_front_end():
    """The value where samples meet: torch.export's batch symbols, an fx
    graph's shapes at twice the batch (:func:`autopar.trace.batch_meets`), and
    a batch mean reduced before a product on either (:func:`samples_meet`); a
    model whose samples never meet has none, and its plain data parallelism
    is kept (no gathers)."""
    import torch
    import torch.nn as nn

    import autopar
    from autopar import zoo
    from autopar.sharding import samples_meet
    from autopar.trace import batch_meets

    inputs, target = _TwoTower.batch()
    fx = autopar.trace(_TwoTower.build(control=False), inputs, loss_fn=_TwoTower.loss, target=target)
    ex = autopar.trace(_TwoTower.build(control=True), inputs, loss_fn=_TwoTower.loss, target=target)
    assert fx.frontend == "fx" and ex.frontend == "export"
    assert batch_meets(fx) is not None and fx[batch_meets(fx)].out.shape == (8, 8)
    # the batch walk sees it too: the logits' product reads one tower's batch-split features whole
    single = autopar.trace(_TwoTower.build(control=False), inputs, loss_fn=nn.functional.cross_entropy,
                           target=target)
    assert single[samples_meet(single)].kind == "matmul"
    assert ex.cross_sample is not None and batch_meets(ex) == ex.cross_sample

    class Centered(nn.Module):       # a loss of batch statistics: samples meet without a [B, B] value
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            z = self.lin(x)
            return ((z.mean(0) - 1.0) ** 2).sum() + (z ** 2).mean()

    g = autopar.trace(Centered(), (torch.randn(8, 4),))
    assert samples_meet(g) is not None and batch_meets(g) is None
    for spec in ("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64", "cnn", "hf-gpt2"):
        g = autopar.api.as_graph(spec)
        assert samples_meet(g) is None and batch_meets(g) is None, spec
    z = zoo.build("mlp", batch=4)
    g = autopar.trace(z.model, z.example_inputs, loss_fn=z.loss_fn, target=z.example_target)
    assert samples_meet(g) is None and batch_meets(g) is None


def test_where_samples_meet_a_split_batch_is_data_parallelism_or_refused():
    """Microbatches and copies would train another loss (a loss over part of
    the batch), so they are refused in words, as are the combinations not run
    yet (a tp_mode grid's rows, cp); dp, ZeRO and tp run."""
    from autopar.errors import UnsupportedError
    from autopar.parallelize import check_runnable
    from autopar.sharding import meeting_limits
    from autopar.spec import parse_strategy
    from autopar.errors import NoFeasibleStrategyError
    from cost_models.presets import load_cluster

    import autopar
    cpu = load_cluster("cpu")
    small = dataclasses.replace(cpu, name="cpu-small", device=dataclasses.replace(cpu.device, memory_bytes=2**18))
    inputs, target = _TwoTower.batch()
    for control in (False, True):
        g = autopar.trace(_TwoTower.build(control), inputs, loss_fn=_TwoTower.loss, target=target)
        for strategy in ("microbatches=2", "dp=2,microbatches=2", "pp=2"):
            with pytest.raises(UnsupportedError, match="mixes samples"):
                check_runnable(g, parse_strategy(strategy))
        with pytest.raises(UnsupportedError, match="not with a tp_mode grid"):
            check_runnable(g, parse_strategy("tp=4,tp_mode=2d"))
        for strategy in ("dp=2", "dp=2,zero=1", "tp=2", "dp=2,tp=2"):
            check_runnable(g, parse_strategy(strategy))
        plan = autopar.plan(g, cluster="cpu", devices=4, global_batch=8)
        assert not meeting_limits(plan.config), plan.strategy
        check_runnable(g, plan.config)
        # the automatic search leaves out what would be refused: on devices of 256 KiB, 2 microbatches
        # fit (which it picked before), 1 does not
        with pytest.raises(NoFeasibleStrategyError, match="microbatches=1.* samples meet"):
            autopar.plan(g, cluster=small, devices=2, global_batch=1024)


def test_parallel_branches_are_no_layer_stack():
    """Siblings that do not run one after another (branches reading the same
    input) are never made layer instances: only alike siblings group."""
    import torch
    import torch.nn as nn

    import autopar

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.branches = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8))])

        def forward(self, x):
            return sum(b(x) for b in self.branches)

    g = autopar.trace(Branches(), (torch.randn(2, 8),))
    assert [gr.instances for gr in g.groups] == [["branches.0", "branches.1"]]
    assert all(nd.group is None for nd in g.nodes if nd.module.startswith("branches.2"))


def test_tensor_constants_of_an_export_graph_follow_the_rank_device():
    """``nn.Module.to`` moves parameters and buffers, not the plain tensor
    attributes torch.export keeps a model's constants in: they stayed on the
    CPU beside weights on the GPU (seen on an H200: "mat2 is on cuda:0,
    different from other tensors on cpu" in a Hugging Face rotary embedding)."""
    import torch

    from autopar.compile.fx_utils import to_device

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.ones(3), persistent=False)
            self.scale = torch.full((3,), 2.0)          # a plain tensor attribute: a constant to export

        def forward(self, x):
            return x * self.scale + self.freq

    gm = torch.export.export(Scaled(), (torch.zeros(2, 3),)).module()

    def devices():
        return {t.device.type for m in gm.modules() for t in [*vars(m).values(), *m._buffers.values()]
                if isinstance(t, torch.Tensor)}
    assert devices() == {"cpu"}
    assert to_device(gm, torch.device("meta")) >= 1
    assert devices() == {"meta"}
    assert gm(torch.zeros(2, 3, device="meta")).device.type == "meta"


def test_a_step_that_raises_in_a_no_grad_region_leaves_autograd_on():
    """torch's ``wrap_with_set_grad_enabled`` (an export graph's ``torch.no_grad()``
    region) does not restore the grad mode when its region raises: a failed
    ``train_step`` left the process without autograd, and the next eager
    ``backward`` failed with "element 0 of tensors does not require grad"
    (seen on an H200 after a Mixtral step failed)."""
    import torch

    import autopar

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(5, 3))

        @torch.no_grad()
        def forward(self, i):
            return torch.index_select(self.table, 0, i)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lookup, self.proj = Lookup(), torch.nn.Linear(3, 3)

        def forward(self, x, i):
            if x.shape[0] > 1:         # control flow on a size: torch.fx cannot trace it, export can
                x = x * 2
            return self.proj(x) * self.lookup(i)

    def loss(out, target):
        return ((out - target) ** 2).mean()

    x, i, y = torch.randn(2, 3), torch.tensor([0, 4]), torch.randn(2, 3)
    pm = autopar.parallelize(Model(), (x, i), loss_fn=loss, example_target=y, strategy="dp=1")
    with pytest.raises(IndexError):
        pm.train_step((x, torch.tensor([0, 9])), y)       # out of the table, inside the no-grad region
    assert torch.is_grad_enabled()
    assert pm.train_step((x, i), y) > 0


def test_the_cost_model_charges_the_gathers_where_samples_meet(monkeypatch):
    """Under dp a model whose samples meet moves the text features (and
    the loss's partial sums) over the dp link each step: the estimate's dp
    communication holds that time (priced by the redistribution table on the
    batch walk's transitions), more with more ranks, none without dp."""
    import autopar
    import autopar.cost as cost

    inputs, target = _TwoTower.batch()
    g = autopar.trace(_TwoTower.build(control=False), inputs, loss_fn=_TwoTower.loss, target=target)

    def dp_comm(strategy: str, devices: int) -> float:
        autopar.api.WARM.clear(g)
        return autopar.evaluate(g, strategy=strategy, cluster="dgx-a100-80g", devices=devices,
                                global_batch=1024).dp_comm_time_s

    with_meet = {s: dp_comm(s, d) for s, d in (("dp=2", 2), ("dp=4", 4), ("tp=2", 2))}
    monkeypatch.setattr(cost, "samples_meet", lambda graph: None)
    without = {s: dp_comm(s, d) for s, d in (("dp=2", 2), ("dp=4", 4), ("tp=2", 2))}
    assert with_meet["tp=2"] == without["tp=2"] == 0.0
    extra = {s: with_meet[s] - without[s] for s in ("dp=2", "dp=4")}
    assert 0 < extra["dp=2"] < extra["dp=4"]


def _albert_pp(rank: int, world: int) -> list[float]:
    import torch
    import autopar
    from benchmarks.real_models import CASES
    c = CASES["hf-albert"]()
    pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="pp=2,microbatches=2")
    return [pm.train_step(c.inputs, c.target) for _ in range(3)]


def test_a_layer_module_called_for_every_layer_pipelines():
    """ALBERT shares one layer module among its layers: torch.export keys its
    second and later calls ``path@1``, ``path@2``, ...; each call is a layer
    instance (a pipeline unit, a recompute region), the calls one group, and
    a pipeline holds the shared weights on both stages and sums their
    gradients there, as for a tied embedding. pp was refused before (no
    repeated layers); now it trains as one process."""
    import torch
    import autopar
    from autopar.pipeline.partition import units
    from benchmarks.real_models import CASES
    c = CASES["hf-albert"]()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    layer = "model.albert.encoder.albert_layer_groups.0"
    assert [gr.instances for gr in g.groups] == [[layer] + [f"{layer}@{k}" for k in range(1, 4)]]
    assert units(g).labels[1:-1] == (layer, f"{layer}@1", f"{layer}@2", f"{layer}@3")
    opt = torch.optim.SGD(c.model.parameters(), lr=0.1)
    ref = []
    for _ in range(3):
        opt.zero_grad()
        loss = c.loss()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert run_distributed(_albert_pp, 2, timeout=300)[0] == pytest.approx(ref, abs=1e-5)


def _padded_vocab_case():
    """nanoGPT with a vocabulary 128x its width, its embedding pinned to
    vocabulary rows (the search runs the vocabulary-parallel kernel), given a
    padding row (``nn.Embedding(padding_idx=0)``, as BERT's pad token) that
    its batch reads."""
    from benchmarks.real_models import MODELS
    c = MODELS["nanogpt-vocab"]()
    c.model.transformer.wte.padding_idx = 0
    c.inputs[0][:, :3] = 0
    return c


def _vocab_rows_worker(rank: int, world: int) -> tuple[list[float], list[float], str]:
    import torch

    import autopar
    from autopar.search.pins import annotations
    c = _padded_vocab_case()
    g = autopar.trace(c.model, c.inputs, loss_fn=c.loss_fn, target=c.target)
    plan = autopar.plan(g, cluster="cpu", devices=2, global_batch=c.inputs[0].shape[0], strategy="tp=2",
                        shardings=annotations(c.model))
    pm = autopar.parallelize(c.model, c.inputs, loss_fn=c.loss_fn, example_target=c.target, strategy=plan,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    losses = [pm.train_step(c.inputs, c.target) for _ in range(3)]
    kernel = next(e["strategy"][1] for k, e in plan.to_dict()["ops"].items() if "embedding" in k and
                  e["strategy"][1] == "vocab")
    return losses, pm.full_state_dict()["transformer.wte.weight"][0].tolist(), kernel


def test_the_vocabulary_parallel_embedding_keeps_the_padding_row_out_of_training():
    """The vocabulary-parallel embedding kernel gave the padding row a
    gradient (``F.embedding`` without its ``padding_idx``): a model whose
    batches hold its pad token trained the row one process keeps fixed.
    Found by tp_mode=mesh on Hugging Face BERT (pad token 0), where the joint
    program picked the kernel: a 2e-3 weight error after one step."""
    import torch
    c = _padded_vocab_case()
    pad_before = c.model.transformer.wte.weight[0].detach().clone()
    ref = eager_steps(c.model, c.inputs, c.target, c.loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.5))
    losses, pad_row, kernel = run_distributed(_vocab_rows_worker, 2, timeout=300)[0]
    assert kernel == "vocab"
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-5)
    assert torch.equal(torch.tensor(pad_row), pad_before)
