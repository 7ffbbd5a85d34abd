"""Model strings: turn ``"gpt:layers=96,hidden=12288"`` or ``"my_model.py:make"`` into a model.

Two forms are accepted:

``FAMILY[:key=value,...]``
    A model of the zoo (:mod:`autopar.zoo.models`): ``gpt``, ``llama``, ``mlp``
    or ``cnn``. Keys are the fields of the family's config; missing keys take
    their defaults (see :func:`families`).
    Or a Hugging Face ``transformers`` model built from its config class
    (:mod:`autopar.zoo.hf`, needs ``transformers``): ``hf-gpt2``, ``hf-llama``,
    ``hf-bert`` or ``hf-vit``, keyed by the config's own field names
    (``hf-llama:hidden_size=4096,num_key_value_heads=8``) plus ``batch`` and
    ``seq``.
    Or a vision model (:mod:`autopar.zoo.vision`, needs ``torchvision`` /
    ``timm``): ``tv-resnet18``, ``tv-resnet50`` (``num_classes``, ``image``,
    ``batch``) or ``timm-vit`` (``arch``, ``img_size``, ``patch_size``,
    ``num_classes``, ``depth``, ``embed_dim``, ``num_heads``, ``batch``).

``path/to/file.py:factory`` or ``package.module:factory``
    ``factory()`` returns ``(model, example_inputs)``, optionally followed by a
    ``loss_fn(output, target)`` and an ``example_target``. ``example_inputs`` is
    a tuple, or a single tensor.

Known family names win; any other ``X:name`` is taken as a factory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ZooError
from . import hf as _hf
from . import hf_pretrained as _hf_pretrained
from . import vision as _vision
_vision.install_shim()   # before anything imports torchvision (transformers does): see zoo/vision.py
from .models import (CNN, GPT, MLP, CNNConfig, GPTConfig, Llama, LlamaConfig, MLPConfig,
                     n_params)

# family -> (config class, model class, task); the task picks inputs and loss
_FAMILIES = {
    "gpt": (GPTConfig, GPT, "lm"),
    "llama": (LlamaConfig, Llama, "lm"),
    "mlp": (MLPConfig, MLP, "classify"),
    "cnn": (CNNConfig, CNN, "classify"),
}


@dataclass
class ZooModel:
    """A model ready for tracing, with example inputs and (optionally) a loss."""

    name: str                    # canonical: "gpt:batch=1,bias=1,...", or the factory spec
    model: nn.Module
    example_inputs: tuple        # on the model's device
    loss_fn: Callable | None     # loss_fn(output, target) -> scalar mean loss
    example_target: torch.Tensor | None
    config: dict                 # the family config's fields; {} for factories


def lm_loss(logits, target):
    """Return the mean next-token cross-entropy of ``logits[B, T, V]`` vs ``target[B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def classification_loss(logits, target):
    """Return the mean cross-entropy of ``logits[B, C]`` vs class indices ``target[B]``."""
    return F.cross_entropy(logits, target)


def families() -> dict[str, dict]:
    """Return ``{family: {key: default}}`` for every zoo family.

    GPT's ``ffn`` default is ``None``, meaning ``4 * hidden``; the ``hf-*``
    families' ``None`` defaults are derived (see :mod:`autopar.zoo.hf`).
    """
    out = {name: {f.name: f.default for f in dataclasses.fields(cfg)}
           for name, (cfg, _, _) in _FAMILIES.items()}
    out.update(_hf.families())
    out.update(_vision.families())
    return out


#: the example batch a zoo family is traced at for planning: 2, so that the
#: batch dimension can be told apart from the others (at batch 1 it cannot)
PLAN_BATCH = 2


def build_for_planning(spec: str, *, batch: int | None = None) -> ZooModel:
    """Build a model string on the meta device for tracing and planning, as
    :func:`autopar.trace`, :func:`autopar.evaluate` and :func:`autopar.plan`
    do: a zoo family at ``batch`` (default :data:`PLAN_BATCH`), a factory at
    the batch its example inputs have."""
    family = spec.split(":", 1)[0].strip().lower() if isinstance(spec, str) else ""
    if family in _FAMILIES or family in _hf.FAMILIES or family in _vision.FAMILIES or family == _hf_pretrained.FAMILY:
        return build(spec, batch=batch or PLAN_BATCH)
    return build(spec)


def build(spec: str, *, device="meta", batch: int | None = None, seed: int | None = 0) -> ZooModel:
    """Build the model a string describes.

    ``device``: where a zoo model's parameters and example inputs live; on
    ``"meta"`` nothing is allocated, so any size builds instantly. Factories
    decide their own device and ``device`` is ignored for them.
    ``batch``: overrides the example batch size of a zoo model (ignored, with a
    warning, for factories).
    ``seed``: zoo models are initialised with ``torch.manual_seed(seed)`` inside
    a forked RNG, so every process builds the same weights and the global RNG
    is left alone; ``None`` draws from the global RNG instead.

    Returns a :class:`ZooModel`. Raises :class:`ZooError` for an unknown
    family or key, an invalid value, or a factory that is missing or returns
    the wrong thing.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ZooError(f"model string {spec!r} is empty: expected FAMILY[:key=value,...] "
                       f"(families: {', '.join(_names())}) or file.py:factory")
    spec = spec.strip()
    head, sep, rest = spec.partition(":")
    if head.lower() in _FAMILIES:
        return _build_family(head.lower(), rest, device, batch, seed)
    if head.lower() in _hf.FAMILIES:
        return _build_hf(head.lower(), rest, device, batch, seed)
    if head.lower() in _vision.FAMILIES:
        return _build_vision(head.lower(), rest, device, batch, seed)
    if head.lower() == _hf_pretrained.FAMILY:
        return _build_hf_pretrained(rest, device, batch, seed)
    if sep and "=" not in spec and spec.rpartition(":")[2].isidentifier():
        if batch is not None:
            warnings.warn(f"batch={batch} is ignored for factory {spec!r}: its example inputs "
                          "fix the batch size", stacklevel=2)
        return _build_factory(spec)
    raise ZooError(f"unknown model family {head!r}: choose one of {', '.join(_names())}, "
                   "or give a factory as path/to/file.py:factory or package.module:factory")


def _names() -> list[str]:
    return [*_FAMILIES, *_hf.FAMILIES, *_vision.FAMILIES, f"{_hf_pretrained.FAMILY}:PATH"]


def load(spec: str, *, device="meta") -> tuple[nn.Module, tuple]:
    """Return ``(model, example_inputs)`` for a model string (see :func:`build`)."""
    z = build(spec, device=device)
    return z.model, z.example_inputs


# ------------------------------------------------------------------------ families

def _parse_kwargs(family: str, text: str) -> dict:
    cfg_cls = _FAMILIES[family][0]
    fields = {f.name: f for f in dataclasses.fields(cfg_cls)}
    kwargs = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if key not in fields:
            raise ZooError(f"unknown key {key!r} for {family}: valid keys are "
                           f"{', '.join(sorted(fields))}")
        if not eq or not raw:
            raise ZooError(f"{family}: key {key!r} has no value: write {key}=VALUE")
        if key in kwargs:
            raise ZooError(f"{family}: key {key!r} is given twice")
        is_float = isinstance(fields[key].default, float)
        try:
            kwargs[key] = float(raw) if is_float else int(raw)
        except ValueError:
            kind = "a number" if is_float else "an integer"
            raise ZooError(f"{family}: {key}={raw!r} is invalid: expected {kind}") from None
    return kwargs


def _build_family(family: str, text: str, device, batch, seed) -> ZooModel:
    cfg_cls, model_cls, task = _FAMILIES[family]
    kwargs = _parse_kwargs(family, text)
    if batch is not None:
        kwargs["batch"] = batch
    cfg = cfg_cls(**kwargs)  # validates; raises ZooError
    dev = torch.device(device)

    model = _seeded(lambda: _construct(model_cls, cfg, dev), dev, seed)

    # Inputs come from a local CPU generator: same values on every device.
    g = torch.Generator().manual_seed(0)
    if task == "lm":
        shape = (cfg.batch, cfg.seq)
        inputs = (_randint(cfg.vocab, shape, g, dev),)
        target, loss_fn = _randint(cfg.vocab, shape, g, dev), lm_loss
    else:
        shape = (cfg.batch, cfg.inp) if family == "mlp" else \
            (cfg.batch, cfg.in_channels, cfg.image, cfg.image)
        inputs = (_randn(shape, g, dev),)
        target, loss_fn = _randint(cfg.classes, (cfg.batch,), g, dev), classification_loss

    config = dataclasses.asdict(cfg)
    name = family + ":" + ",".join(f"{k}={config[k]!r}" for k in sorted(config))
    return ZooModel(name, model, inputs, loss_fn, target, config)


def _build_hf(family: str, text: str, device, batch, seed) -> ZooModel:
    cfg = _hf.parse(family, text, batch)       # ZooError for a bad key or value
    config = _hf.make_config(family, cfg)      # ZooError without transformers
    dev = torch.device(device)
    model = _seeded_on(dev, seed, lambda: _hf.construct(family, config))

    g = torch.Generator().manual_seed(0)
    in_shape, target_shape, classes = _hf.input_shapes(family, cfg)
    if _hf.FAMILIES[family].task == "image":
        inputs = (_randn(in_shape, g, dev),)
    else:
        inputs = (_randint(cfg["vocab_size"], in_shape, g, dev),)
    target = _randint(classes, target_shape, g, dev)
    name = family + ":" + ",".join(f"{k}={_hf_repr(cfg[k])}" for k in sorted(cfg))
    return ZooModel(name, model, inputs, _hf.loss_fn(family), target, dict(cfg))


def _build_hf_pretrained(text: str, device, batch, seed) -> ZooModel:
    """``hf:PATH[,key=value,...]``: the language model of a checkpoint's
    ``config.json`` (:mod:`autopar.zoo.hf_pretrained`), without its weights."""
    path, raw = _hf_pretrained.split(text)
    config, settings = _hf_pretrained.configure(path, raw, batch)
    dev = torch.device(device)
    model = _seeded_on(dev, seed, lambda: _hf_pretrained.construct(path, config))
    g = torch.Generator().manual_seed(0)
    shape = (settings["batch"], settings["seq"])
    inputs = (_randint(config.vocab_size, shape, g, dev),)
    target = _randint(config.vocab_size, shape, g, dev)
    return ZooModel(_hf_pretrained.name(path, settings), model, inputs, _hf.hf_lm_loss, target,
                    {"path": path, **settings})


def _seeded_on(dev: torch.device, seed: int | None, construct):
    """``construct()`` with ``dev`` the default device, seeded as :func:`_seeded`."""
    def on_device():
        with dev:
            return construct()
    return _seeded(on_device, dev, seed)


def _seeded(construct, dev: torch.device, seed: int | None):
    """``construct()``, under ``torch.manual_seed(seed)`` in a forked RNG when a seed is given."""
    if seed is None:
        return construct()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        return construct()


def _build_vision(family: str, text: str, device, batch, seed) -> ZooModel:
    cfg = _vision.parse(family, text, batch)   # ZooError for a bad key or value
    dev = torch.device(device)

    def construct():
        with dev, (_meta_init() if dev.type == "meta" else contextlib.nullcontext()):
            return _vision.construct(family, cfg)   # ZooError without torchvision / timm

    model = _seeded(construct, dev, seed)

    g = torch.Generator().manual_seed(0)
    in_shape, target_shape, classes = _vision.input_shapes(family, cfg)
    inputs = (_randn(in_shape, g, dev),)
    target = _randint(classes, target_shape, g, dev)
    name = family + ":" + ",".join(f"{k}={_hf_repr(cfg[k])}" for k in sorted(cfg))
    return ZooModel(name, model, inputs, _vision.classification_loss, target, dict(cfg))


def _hf_repr(v) -> str:
    """A value as the model string writes it (flags as 0/1, so the name parses back)."""
    return str(int(v)) if isinstance(v, bool) else repr(v) if not isinstance(v, str) else v


def _construct(model_cls, cfg, dev):
    with dev, (_meta_init() if dev.type == "meta" else contextlib.nullcontext()):
        return model_cls(cfg)   # allocated directly on the device; on meta no memory is touched


#: the in-place initialisers of torch.nn.init the zoo's modules run when built
_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
          "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def _meta_init():
    """torch.nn.init's initialisers skip meta tensors while a model is built:
    a meta tensor has no values to set, but each call is a dispatch (a
    96-layer GPT-3 makes a thousand of them, two thirds of its build time).
    The module's functions are wrapped for the time of the build (as
    transformers' ``no_init_weights`` does); a tensor with storage, from
    another thread meanwhile, is initialised as always."""
    init = nn.init
    saved = {name: getattr(init, name) for name in _INITS if hasattr(init, name)}

    def skip_meta(fn):
        def wrapped(tensor, *args, **kwargs):
            return tensor if isinstance(tensor, torch.Tensor) and tensor.is_meta else fn(tensor, *args, **kwargs)
        return wrapped

    for name, fn in saved.items():
        setattr(init, name, skip_meta(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _randint(high, shape, g, dev):
    if dev.type == "meta":
        return torch.empty(shape, dtype=torch.long, device=dev)
    return torch.randint(high, shape, generator=g).to(dev)


def _randn(shape, g, dev):
    if dev.type == "meta":
        return torch.empty(shape, device=dev)
    return torch.randn(shape, generator=g).to(dev)


# ----------------------------------------------------------------------- factories

def _build_factory(spec: str) -> ZooModel:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target)
    else:
        module = _import_module(target)
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ZooError(f"{target} has no attribute {attr!r}; callables it defines: "
                       f"{', '.join(public) or '(none)'}")
    if not callable(fn):
        raise ZooError(f"{target}:{attr} is a {type(fn).__name__}, not a callable factory")

    out = fn()
    if not isinstance(out, (tuple, list)) or not 2 <= len(out) <= 4:
        raise ZooError(f"factory {spec} must return (model, example_inputs[, loss_fn"
                       f"[, example_target]]), got {type(out).__name__}"
                       + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    model, inputs, loss_fn, example_target = (*out, None, None)[:4]
    if not isinstance(model, nn.Module):
        raise ZooError(f"factory {spec} returned a {type(model).__name__} as model, "
                       "expected an nn.Module")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if loss_fn is not None and not callable(loss_fn):
        raise ZooError(f"factory {spec} returned a {type(loss_fn).__name__} as loss_fn, "
                       "expected a callable or None")
    return ZooModel(spec, model, inputs, loss_fn, example_target, {})


def _import_file(path: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ZooError(f"model file {path!r} does not exist (looked at {full})")
    # A unique, stable module name per file, registered in sys.modules so that
    # dataclasses and pickling inside the user's file work.
    stem = os.path.splitext(os.path.basename(full))[0]
    name = f"_autopar_user_{stem}_{zlib.crc32(full.encode()):08x}"
    mod_spec = importlib.util.spec_from_file_location(name, full)
    if mod_spec is None or mod_spec.loader is None:
        raise ZooError(f"cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only our target (or a parent package) missing is the user's typo;
        # a missing dependency inside their module is their error to see.
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ZooError(f"no zoo family or module named {name!r} (missing: {e.name!r}); "
                           f"families: {', '.join(_names())}") from None
        raise


__all__ = ["ZooModel", "build", "build_for_planning", "PLAN_BATCH", "load", "families", "lm_loss",
           "classification_loss",
           "n_params", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig",
           "CNN", "CNNConfig"]
