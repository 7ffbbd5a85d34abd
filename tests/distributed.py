"""The tests' launcher is the product's own: :mod:`autopar.runtime.launch`."""
from autopar.runtime.launch import run_distributed  # noqa: F401
