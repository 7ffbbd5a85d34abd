"""The tests' launcher is the product's own: :mod:`autopar.runtime.launch`."""
import os

import pytest

from autopar.runtime.launch import run_distributed  # noqa: F401

#: 8-process spawns take minutes on the shared 2-core machine (the suite allows ~40 s per spawn), so
#: they run when asked (AUTOPAR_SPAWN8=1); `make matrix` runs the real models' 8-process families
spawn8 = pytest.mark.skipif(not os.environ.get("AUTOPAR_SPAWN8"),
                            reason="8-process spawn, minutes on 2 cores: set AUTOPAR_SPAWN8=1")
