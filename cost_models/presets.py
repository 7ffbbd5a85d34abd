"""Named cluster presets (``presets/*.json``) and loading of cluster files."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import ClusterError
from .hardware import ClusterSpec

PRESET_DIR = Path(__file__).resolve().parent / "presets"


def list_presets() -> list[str]:
    """Return the sorted names of the shipped presets (file names without .json)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_cluster(name_or_path: str | os.PathLike | dict[str, Any] | ClusterSpec) -> ClusterSpec:
    """Return the ClusterSpec for a preset name, a JSON cluster file, a dict in
    the cluster file format, or a ClusterSpec (returned as is).

    A string is a preset name first, a path otherwise. Raises ClusterError for
    an unknown preset (listing the valid names), a missing or unreadable file,
    or malformed content (naming the file and the key).
    """
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    if isinstance(name_or_path, dict):
        return ClusterSpec.from_dict(name_or_path)
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ClusterError(f"expected a preset name, a path, a dict or a ClusterSpec, "
                           f"got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and text in list_presets():
        return _load_file(PRESET_DIR / f"{text}.json")
    path = Path(text)
    if path.is_file():
        return _load_file(path)
    # Anything that does not look like a path was meant as a preset name.
    if isinstance(name_or_path, str) and os.sep not in text and not text.endswith(".json"):
        raise ClusterError(f"unknown cluster preset {text!r}; valid presets: "
                           f"{', '.join(list_presets())} (or a path to a JSON cluster file)")
    raise ClusterError(f"cluster file {text!r} does not exist")


def _load_file(path: Path) -> ClusterSpec:
    """Return the ClusterSpec in JSON file ``path``; raise ClusterError naming it."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ClusterError(f"cannot read cluster file {str(path)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ClusterError(f"cluster file {str(path)!r} is not valid JSON: {e}") from None
    return ClusterSpec.from_dict(data, where=f"cluster file {str(path)!r}")
