"""autopar: automatic parallelization planner and compiler for PyTorch."""
__version__ = "0.1.0"
