"""Hugging Face ``transformers`` models as model strings: ``hf-gpt2``, ``hf-llama``, ``hf-bert``, ``hf-vit``.

Each family builds the ``transformers`` model from its config class, with no
download: ``GPT2LMHeadModel(GPT2Config)``, ``LlamaForCausalLM(LlamaConfig)``,
``BertForMaskedLM(BertConfig)`` and ``ViTForImageClassification(ViTConfig)``.
The keys of the model string are the config's own field names
(``hf-llama:hidden_size=4096,num_key_value_heads=8``) plus ``batch`` and
``seq`` (the example inputs' batch size and sequence length). ``use_cache`` is
always off, and the dropouts default to 0 (the other zoo families have none)
so that every build computes the same thing.

``transformers`` is optional: without it these families raise
:class:`~autopar.errors.ZooError` saying ``pip install transformers``; nothing
here imports it before a model is built. The models do not trace with
``torch.fx``; :func:`autopar.trace` takes them through ``torch.export``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import ZooError


def _logits(out: Any) -> torch.Tensor:
    """The logits of a ``transformers`` ModelOutput (or a plain tensor)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def hf_lm_loss(out, target):
    """Mean cross-entropy of ``out.logits[B, T, V]`` vs token ids ``target[B, T]``
    (causal LMs: the target is the next token; masked LMs: every position)."""
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def hf_classification_loss(out, target):
    """Mean cross-entropy of ``out.logits[B, C]`` vs class indices ``target[B]``."""
    return F.cross_entropy(_logits(out), target)


@dataclass(frozen=True)
class HFFamily:
    """One ``hf-*`` family: the ``transformers`` classes and the string's keys."""

    config_cls: str
    model_cls: str
    task: str                  # "lm" (token ids in, logits [B, T, V]) or "image" (pixels in, logits [B, C])
    keys: dict[str, Any]       # key -> default; the default's type is the key's type (None: int or None)
    doc: str


_DROP0 = 0.0
FAMILIES: dict[str, HFFamily] = {
    "hf-gpt2": HFFamily("GPT2Config", "GPT2LMHeadModel", "lm", {
        "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "n_positions": 1024,
        "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True, "resid_pdrop": _DROP0, "embd_pdrop": _DROP0, "attn_pdrop": _DROP0,
        "seq": None, "batch": 1,
    }, "GPT-2 small (124M); seq defaults to n_positions"),
    "hf-llama": HFFamily("LlamaConfig", "LlamaForCausalLM", "lm", {
        "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": None,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": _DROP0,
        "seq": 2048, "batch": 1,
    }, "Llama-3.2-1B shape (~1.2B: GQA, RoPE, RMSNorm, SwiGLU); max_position_embeddings defaults to seq"),
    "hf-bert": HFFamily("BertConfig", "BertForMaskedLM", "lm", {
        "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
        "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
        "layer_norm_eps": 1e-12, "tie_word_embeddings": True,
        "hidden_dropout_prob": _DROP0, "attention_probs_dropout_prob": _DROP0,
        "seq": None, "batch": 1,
    }, "BERT-base (110M) masked LM; seq defaults to max_position_embeddings"),
    "hf-vit": HFFamily("ViTConfig", "ViTForImageClassification", "image", {
        "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
        "image_size": 224, "patch_size": 16, "num_channels": 3, "num_labels": 1000, "hidden_act": "gelu",
        "layer_norm_eps": 1e-12, "qkv_bias": True,
        "hidden_dropout_prob": _DROP0, "attention_probs_dropout_prob": _DROP0,
        "batch": 1,
    }, "ViT-B/16 at 224x224, 1000 classes"),
}

# the keys every family's layer count, width and heads go by (for the checks below)
_SHAPE_KEYS = {
    "hf-gpt2": ("n_layer", "n_embd", "n_head", None),
    "hf-llama": ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"),
    "hf-bert": ("num_hidden_layers", "hidden_size", "num_attention_heads", None),
    "hf-vit": ("num_hidden_layers", "hidden_size", "num_attention_heads", None),
}
# positional embeddings with a table: seq may not exceed it
_POSITIONS = {"hf-gpt2": "n_positions", "hf-bert": "max_position_embeddings"}


def families() -> dict[str, dict[str, Any]]:
    """``{family: {key: default}}`` for the ``hf-*`` families (no import of transformers)."""
    return {name: dict(fam.keys) for name, fam in FAMILIES.items()}


def _transformers(what: str = "the hf-* model families"):
    """``transformers``, or :class:`ZooError` saying that ``what`` needs it."""
    try:
        import transformers
    except ImportError:
        raise ZooError(f"{what} need Hugging Face transformers: pip install transformers") from None
    return transformers


def key_values(family: str, text: str, keys: dict[str, Any],
               value: Callable[[str, str, Any, str], Any]) -> dict[str, Any]:
    """The ``key=value,...`` text as a dict, each raw value read by
    ``value(family, key, default, raw)``; :class:`ZooError` for an unknown,
    empty or repeated key (shared by the Hugging Face and vision families)."""
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if key not in keys:
            raise ZooError(f"unknown key {key!r} for {family}: valid keys are {', '.join(sorted(keys))}")
        if not eq or not raw:
            raise ZooError(f"{family}: key {key!r} has no value: write {key}=VALUE")
        if key in values:
            raise ZooError(f"{family}: key {key!r} is given twice")
        values[key] = value(family, key, keys[key], raw)
    return values


def parse(family: str, text: str, batch: int | None) -> dict[str, Any]:
    """The complete key -> value dict of ``family`` from the ``key=value,...`` text."""
    fam = FAMILIES[family]
    values = key_values(family, text, fam.keys, _value)
    if batch is not None:
        values["batch"] = batch
    cfg = {**fam.keys, **values}
    _check(family, cfg)
    return cfg


def _value(family: str, key: str, default: Any, raw: str) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true"):
            return True
        if raw.lower() in ("0", "false"):
            return False
        raise ZooError(f"{family}: {key}={raw!r} is invalid: expected 0 or 1")
    if isinstance(default, str):
        return raw
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ZooError(f"{family}: {key}={raw!r} is invalid: expected a number") from None
    if default is None and raw.lower() == "none":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ZooError(f"{family}: {key}={raw!r} is invalid: expected an integer") from None


def _check(family: str, cfg: dict[str, Any]) -> None:
    fam = FAMILIES[family]
    for key, default in fam.keys.items():
        v = cfg[key]
        if isinstance(default, bool) or isinstance(default, str) or v is None:
            continue
        if isinstance(default, float):
            if v < 0 or ("pdrop" in key or "dropout" in key) and v >= 1:
                raise ZooError(f"{family}: {key}={v!r} is invalid")
        elif v < 1:
            raise ZooError(f"{family}: {key}={v!r} is invalid: expected a positive integer")
    _, width, heads, kv = _SHAPE_KEYS[family]
    if cfg[width] % cfg[heads] and not cfg.get("head_dim"):
        raise ZooError(f"{family}: {heads}={cfg[heads]} does not divide {width}={cfg[width]}")
    if kv and cfg[heads] % cfg[kv]:
        raise ZooError(f"{family}: {kv}={cfg[kv]} does not divide {heads}={cfg[heads]}")
    if family == "hf-vit" and cfg["image_size"] % cfg["patch_size"]:
        raise ZooError(f"hf-vit: patch_size={cfg['patch_size']} does not divide image_size={cfg['image_size']}")
    pos = _POSITIONS.get(family)
    if pos is not None:
        if cfg["seq"] is None:
            cfg["seq"] = cfg[pos]
        elif cfg["seq"] > cfg[pos]:
            raise ZooError(f"{family}: seq={cfg['seq']} exceeds {pos}={cfg[pos]}: "
                           f"give {pos}={cfg['seq']} too")
    if family == "hf-llama" and cfg["max_position_embeddings"] is None:
        cfg["max_position_embeddings"] = cfg["seq"]


def make_config(family: str, cfg: dict[str, Any]) -> Any:
    """The ``transformers`` config object of a parsed family dict."""
    transformers = _transformers()
    fam = FAMILIES[family]
    kwargs = {k: v for k, v in cfg.items() if k not in ("batch", "seq")}
    if family == "hf-gpt2" and cfg["vocab_size"] <= 50256:
        kwargs.update(bos_token_id=None, eos_token_id=None)   # GPT-2's 50256 is outside a small vocabulary
    try:
        config = getattr(transformers, fam.config_cls)(use_cache=False, **kwargs)
    except (TypeError, ValueError) as e:
        raise ZooError(f"{family}: transformers.{fam.config_cls} rejects the config: {e}") from None
    config.use_cache = False
    return config


def construct(family: str, config: Any) -> torch.nn.Module:
    """``transformers.<model class>(config)`` on the current default device."""
    transformers = _transformers()
    fam = FAMILIES[family]
    return getattr(transformers, fam.model_cls)(config)


def loss_fn(family: str) -> Callable:
    """The family's loss: ``loss_fn(model output, target)``."""
    return hf_classification_loss if FAMILIES[family].task == "image" else hf_lm_loss


def input_shapes(family: str, cfg: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(input shape, target shape, the target's number of classes)``; token
    ids for the language models, ``pixel_values[B, C, H, W]`` for ViT."""
    b = cfg["batch"]
    if FAMILIES[family].task == "image":
        s = cfg["image_size"]
        return (b, cfg["num_channels"], s, s), (b,), cfg["num_labels"]
    return (b, cfg["seq"]), (b, cfg["seq"]), cfg["vocab_size"]


__all__ = ["FAMILIES", "HFFamily", "families", "hf_lm_loss", "hf_classification_loss"]
