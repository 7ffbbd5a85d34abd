"""Hugging Face models from their own ``config.json``: the ``hf:PATH`` model string.

``hf:PATH[,key=value,...]`` builds the ``transformers`` model a checkpoint's
configuration describes, without its weights (on the meta device when planning):
``PATH`` is a checkpoint directory holding ``config.json``, a ``config.json``
file, or a Hub id (``meta-llama/Llama-3.1-8B``) that ``transformers`` resolves
(from its local cache when offline). So ``autopar plan hf:./Meta-Llama-3-8B``
plans the architecture exactly as published: every field of the file, the
rotary scaling, tied embeddings, attention variants, without writing them out.

The keys after the path are ``seq`` (the example inputs' sequence length;
default the smaller of 2048 and the configuration's position limit),
``batch``, and any field of the configuration to override, read as the type
the file gives it (``num_hidden_layers=2`` to try a shallow copy first; a
field the file leaves out is read as an integer, a number, ``true``/``false``
or ``none``; ``attn_implementation=eager`` picks the attention kernel as
``from_pretrained``'s keyword does). The model class is the file's ``architectures`` entry when it
is a language-model head (``...ForCausalLM``, ``...LMHeadModel``,
``...ForMaskedLM``), else ``AutoModelForCausalLM``'s choice. Other heads
(classification, encoder-decoder, multimodal) need a factory file
(``path/to/file.py:make``). The example target is random token ids, and the
loss the mean token cross-entropy. Configurations that need remote code
(``auto_map``, ``trust_remote_code``) are refused: autopar runs no code from
a checkpoint.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import ZooError
from .hf import _transformers as hf_transformers

FAMILY = "hf"
#: the heads whose output is logits over the vocabulary at every position
LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")
DEFAULT_SEQ = 2048
#: the fields a configuration names its position limit by
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def split(text: str) -> tuple[str, dict[str, str]]:
    """``PATH[,key=value,...]`` as ``(path, {key: raw value})``: the path is
    everything before the first ``,key=`` item."""
    parts = text.split(",")
    k = next((i for i in range(1, len(parts)) if "=" in parts[i]), len(parts))
    path = ",".join(parts[:k]).strip()
    if not path:
        raise ZooError("hf: no path: write hf:PATH with PATH a checkpoint directory, a config.json "
                       "or a Hub id, e.g. hf:./Meta-Llama-3-8B,seq=8192")
    raw: dict[str, str] = {}
    for item in (p.strip() for p in parts[k:]):
        if not item:
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if not key or not eq or not value:
            raise ZooError(f"hf: item {item!r} is not key=value")
        if key in raw:
            raise ZooError(f"hf: key {key!r} is given twice")
        raw[key] = value
    return path, raw


def _transformers():
    transformers = hf_transformers("hf:PATH model strings")
    transformers.logging.set_verbosity_error()
    return transformers


def load_config(path: str) -> Any:
    """The ``transformers`` configuration at ``path`` (directory, file or Hub id)."""
    transformers = _transformers()
    where = (os.path.dirname(path) or ".") if os.path.basename(path) == "config.json" else path
    if os.path.isfile(path) and os.path.basename(path) != "config.json":
        raise ZooError(f"hf:{path}: a file must be named config.json (or give its directory)")
    try:
        return transformers.AutoConfig.from_pretrained(where, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ZooError(f"hf:{path}: transformers cannot read a configuration there: {first}") from None


def _read(key: str, current: Any, raw: str) -> Any:
    """``raw`` as the type of the configuration's ``current`` value."""
    low = raw.lower()
    if isinstance(current, bool) or current is None and low in ("true", "false"):
        if low in ("1", "true"):
            return True
        if low in ("0", "false"):
            return False
        raise ZooError(f"hf: {key}={raw!r} is invalid: expected true or false")
    if low == "none":
        return None
    if isinstance(current, str):
        return raw
    for cast in ((float,) if isinstance(current, float) else (int,) if isinstance(current, int) else (int, float)):
        try:
            return cast(raw)
        except ValueError:
            pass
    if current is None:
        return raw
    raise ZooError(f"hf: {key}={raw!r} is invalid: expected {type(current).__name__} (the file has {current!r})")


def configure(path: str, raw: dict[str, str], batch: int | None) -> tuple[Any, dict[str, Any]]:
    """The configuration with the overrides applied (``use_cache`` off), and
    the model string's settings: ``seq``, ``batch`` and each override."""
    config = load_config(path)
    if getattr(config, "auto_map", None):
        raise ZooError(f"hf:{path}: the configuration needs remote code (auto_map: "
                       f"{', '.join(sorted(config.auto_map))}); autopar runs no code from a checkpoint: "
                       "build the model in a factory file (path/to/file.py:make)")
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("seq", "batch"):
            settings[key] = _positive(key, value)
        elif key == "attn_implementation":      # from_pretrained's keyword: the config keeps it privately
            config._attn_implementation = settings[key] = value
        else:
            setattr(config, key, _read(key, getattr(config, key, None), value))
            settings[key] = getattr(config, key)
    if batch is not None:
        settings["batch"] = batch
    settings.setdefault("batch", 1)
    limit = next((getattr(config, f) for f in _POSITION_FIELDS if isinstance(getattr(config, f, None), int)), None)
    if "seq" not in settings:
        settings["seq"] = min(DEFAULT_SEQ, limit) if limit else DEFAULT_SEQ
    elif limit and settings["seq"] > limit:
        field = next(f for f in _POSITION_FIELDS if getattr(config, f, None) == limit)
        raise ZooError(f"hf:{path}: seq={settings['seq']} exceeds the configuration's {field}={limit}: "
                       f"give {field}={settings['seq']} too")
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise ZooError(f"hf:{path}: the configuration has no vocab_size: only language models "
                       "(token ids in, logits out) are built from a config; use a factory file")
    config.use_cache = False
    return config, settings


def _positive(key: str, raw: str) -> int:
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 1:
        raise ZooError(f"hf: {key}={raw!r} is invalid: expected a positive integer")
    return v


def construct(path: str, config: Any) -> Any:
    """The language model of ``config`` on the current default device."""
    transformers = _transformers()
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch is not None:
        if not arch.endswith(LM_HEADS):
            raise ZooError(f"hf:{path}: {arch} is not a language-model head ({', '.join(LM_HEADS)}): "
                           "build it in a factory file (path/to/file.py:make) with its inputs and loss")
        cls = getattr(transformers, arch, None)
        if cls is None:
            raise ZooError(f"hf:{path}: transformers {transformers.__version__} has no {arch}")
    try:
        return cls(config) if arch is not None else transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:     # an attention kernel the model has not, a configuration it refuses
        raise ZooError(f"hf:{path}: transformers cannot build this configuration: "
                       f"{str(e).strip().splitlines()[0]}") from None


def name(path: str, settings: dict[str, Any]) -> str:
    """The canonical model string (parses back to the same model)."""
    def shown(v: Any) -> str:
        return "true" if v is True else "false" if v is False else "none" if v is None else str(v)
    return f"{FAMILY}:{path}," + ",".join(f"{k}={shown(settings[k])}" for k in sorted(settings))
