"""Shared pytest set-up: make the helper modules in tests/ (e.g. ``distributed``) importable."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# The distributed tests' gloo ranks are processes kept between tests (autopar/runtime/launch.py):
# each spawn no longer starts Python and imports torch in every rank.
os.environ.setdefault("AUTOPAR_REUSE_RANKS", "1")
