"""Vision models as model strings: ``tv-resnet18``, ``tv-resnet50`` (torchvision) and ``timm-vit`` (timm).

``tv-resnet18:num_classes=10,image=32`` builds ``torchvision.models.resnet18``
and ``timm-vit:arch=vit_tiny_patch16_224,img_size=32,patch_size=8`` builds
``timm.create_model(arch, pretrained=False, ...)``: no download, random
weights, on the meta device by default (plannable at full size). Keys:
``batch`` (the example batch) for all; ``num_classes`` and ``image`` (the
square input size) for the ResNets; for ViT ``arch`` (any timm ViT name),
``img_size``, ``patch_size``, ``num_classes``, and ``depth``, ``embed_dim``,
``num_heads``, ``mlp_ratio`` (``None``: the arch's own). Both trace with
``torch.fx``. The loss is the mean cross-entropy of the logits ``[B, C]``.

``torchvision`` and ``timm`` are optional (the ``vision`` extra): without
them these families raise :class:`~autopar.errors.ZooError` saying what to
install; nothing here imports them before a model is built.

**The torchvision shim.** PyPI's torchvision wheels carry a C extension
(``torchvision::nms``, ``roi_align``, ...) built against the CUDA build of
the torch they pair with. Beside the CPU wheel ``torch==2.13.0+cpu`` that
extension cannot load (it links ``libtorch_cuda.so``), and ``import
torchvision`` then fails in ``torchvision/_meta_registrations.py`` with
``RuntimeError: operator torchvision::nms does not exist`` while registering
meta kernels for those ops. Everything that imports torchvision fails with it,
``transformers`` included: it imports torchvision whenever it is installed, so
with such a torchvision no ``transformers`` model can be built. The
classification models never call the C ops, so :func:`install_shim` (run when
``autopar`` is imported, so before anything of autopar builds a model)
puts an import hook on that one module: the real module runs first, and only
when it fails with that error is it left empty (the ops then raise when
called, as torchvision does without its extension). A torchvision whose
extension loads (a GPU machine's matching wheel) is not touched.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ZooError
from .hf import key_values

_SHIMMED = "torchvision._meta_registrations"
#: why the real ``torchvision._meta_registrations`` was replaced, once it was (else None)
SHIM_REASON: str | None = None


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec) if hasattr(self.real, "create_module") else None

    def exec_module(self, module) -> None:
        global SHIM_REASON
        try:
            self.real.exec_module(module)
        except RuntimeError as e:
            if "torchvision::" not in str(e) or "does not exist" not in str(e):
                raise
            # torchvision's C extension did not load (built for another torch): the meta
            # kernels of its detection ops cannot be registered; the models need none
            SHIM_REASON = str(e).splitlines()[0]


class _ShimFinder(importlib.abc.MetaPathFinder):
    """Finds ``torchvision._meta_registrations`` through the other finders and
    wraps its loader in :class:`_ShimLoader`; every other name is left alone."""

    def find_spec(self, name, path, target=None):
        if name != _SHIMMED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ShimLoader(spec.loader)
                return spec
        return None


def install_shim() -> None:
    """Put the torchvision import hook first on ``sys.meta_path`` (once; see the module doc)."""
    if not any(isinstance(f, _ShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ShimFinder())


def torchvision():
    """``import torchvision`` (through the shim), or a ZooError saying why it fails."""
    install_shim()
    try:
        import torchvision as tv
        import torchvision.models  # noqa: F401
    except ImportError:
        raise ZooError("the tv-* model families need torchvision: pip install torchvision "
                       "(beside the CPU wheel torch==2.13.0: pip install --no-deps torchvision==0.28.0)") from None
    except Exception as e:  # noqa: BLE001 - a broken install: say what broke
        raise ZooError(f"torchvision is installed but fails to import: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return tv


def timm():
    """``import timm`` (through the shim: timm imports torchvision), or a ZooError saying why it fails."""
    torchvision()
    try:
        import timm as tm
    except ImportError:
        raise ZooError("the timm-* model families need timm: pip install timm "
                       "(beside the CPU wheel torch==2.13.0: pip install --no-deps timm)") from None
    except Exception as e:  # noqa: BLE001
        raise ZooError(f"timm is installed but fails to import: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return tm


@dataclass(frozen=True)
class VisionFamily:
    """One vision family: its builder and the string's keys."""

    library: str               # "torchvision" or "timm"
    arch: str                  # torchvision's builder name, or timm's default arch
    keys: dict[str, Any]       # key -> default; the default's type is the key's type (None: int or None)
    doc: str


FAMILIES: dict[str, VisionFamily] = {
    "tv-resnet18": VisionFamily("torchvision", "resnet18", {"num_classes": 1000, "image": 224, "batch": 1},
                                "torchvision ResNet-18 (11.7M) at 224x224"),
    "tv-resnet50": VisionFamily("torchvision", "resnet50", {"num_classes": 1000, "image": 224, "batch": 1},
                                "torchvision ResNet-50 (25.6M) at 224x224"),
    "timm-vit": VisionFamily("timm", "vit_base_patch16_224", {
        "arch": "vit_base_patch16_224", "img_size": 224, "patch_size": 16, "num_classes": 1000,
        "depth": None, "embed_dim": None, "num_heads": None, "mlp_ratio": None, "batch": 1,
    }, "timm ViT (default ViT-B/16 at 224x224, 86M); arch is any timm ViT name"),
}
_FLOAT_KEYS = {"mlp_ratio"}


def families() -> dict[str, dict[str, Any]]:
    """``{family: {key: default}}`` (no import of torchvision or timm)."""
    return {name: dict(fam.keys) for name, fam in FAMILIES.items()}


def _value(family: str, key: str, default: Any, raw: str) -> Any:
    """One raw value: a string where the default is one, ``none`` where it is None, else a positive number."""
    if isinstance(default, str):
        return raw
    if default is None and raw.lower() == "none":
        return None
    try:
        v = float(raw) if key in _FLOAT_KEYS else int(raw)
    except ValueError:
        kind = "a number" if key in _FLOAT_KEYS else "an integer"
        raise ZooError(f"{family}: {key}={raw!r} is invalid: expected {kind}") from None
    if v <= 0:
        raise ZooError(f"{family}: {key}={raw} is invalid: expected a positive value")
    return v


def parse(family: str, text: str, batch: int | None) -> dict[str, Any]:
    """The complete key -> value dict of ``family`` from the ``key=value,...`` text."""
    fam = FAMILIES[family]
    values = key_values(family, text, fam.keys, _value)
    if batch is not None:
        values["batch"] = batch
    cfg = {**fam.keys, **values}
    if family == "timm-vit" and cfg["img_size"] % cfg["patch_size"]:
        raise ZooError(f"timm-vit: patch_size={cfg['patch_size']} does not divide img_size={cfg['img_size']}")
    if family == "timm-vit" and cfg["embed_dim"] and cfg["num_heads"] and cfg["embed_dim"] % cfg["num_heads"]:
        raise ZooError(f"timm-vit: num_heads={cfg['num_heads']} does not divide embed_dim={cfg['embed_dim']}")
    if family.startswith("tv-resnet") and cfg["image"] < 32:
        raise ZooError(f"{family}: image={cfg['image']} is too small: ResNets downsample 32x (image >= 32)")
    return cfg


def construct(family: str, cfg: dict[str, Any]) -> torch.nn.Module:
    """The model on the current default device (torchvision / timm imported here)."""
    fam = FAMILIES[family]
    if fam.library == "torchvision":
        tv = torchvision()
        return getattr(tv.models, fam.arch)(num_classes=cfg["num_classes"])
    tm = timm()
    kwargs = {k: cfg[k] for k in ("img_size", "patch_size", "num_classes", "depth", "embed_dim", "num_heads",
                                  "mlp_ratio") if cfg[k] is not None}
    try:
        return tm.create_model(cfg["arch"], pretrained=False, **kwargs)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ZooError(f"timm-vit: timm.create_model({cfg['arch']!r}) rejects the config: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def input_shapes(family: str, cfg: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(input shape, target shape, classes)``: images ``[B, 3, S, S]``, one class per image."""
    s = cfg["image"] if "image" in cfg else cfg["img_size"]
    return (cfg["batch"], 3, s, s), (cfg["batch"],), cfg["num_classes"]


def classification_loss(logits, target):
    """Mean cross-entropy of ``logits[B, C]`` vs class indices ``target[B]``."""
    return F.cross_entropy(logits, target)


__all__ = ["FAMILIES", "VisionFamily", "families", "install_shim", "torchvision", "timm", "SHIM_REASON"]
