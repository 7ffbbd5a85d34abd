# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing. On a machine without an NVIDIA GPU the
# CPU wheel torch==2.13.0 is installed first (never a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autopar-installed
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.5,<3' || echo 'torch==2.13.0')
# The vision extras (torchvision, timm: the tv-* / timm-* model strings, tests/test_vision.py).
# Beside the CPU wheel: torchvision 0.28.0 (the release for torch 2.13) without dependencies, as
# its wheel pins torch==2.13.0 and pip would fetch the CUDA build; its C extension (detection ops)
# links the CUDA torch and cannot load, which autopar.zoo.vision works around (see there).
VISION_PIP ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torchvision timm' || echo '--no-deps torchvision==0.28.0 timm==1.0.31')

.PHONY: test-spawn8 all demo test bench matrix venv clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@$(PY) -m pip install -q $(VISION_PIP) || echo "torchvision / timm not installed: tests/test_vision.py will be skipped"
	@touch $(STAMP)

venv: $(STAMP)

# The HTML report's browser test (tests/test_report.py) renders in Debian's chromium:
# installed here where apt-get runs as root; elsewhere that one test is skipped, saying why.
BROWSER_STAMP := $(VENV)/.browser-checked
$(BROWSER_STAMP): $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ echo "installing Debian's chromium for the report's browser test"; \
		  apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
		echo "no chromium: the report's browser test will be skipped"
	@touch $(BROWSER_STAMP)

# one process at a time: the distributed tests keep both cores busy (their gloo ranks poll), and
# running two pytest-xdist workers beside them measured slower (654-658 s against the budget of 600)
test: $(STAMP) $(BROWSER_STAMP)
	$(PY) -m pytest -q tests

# the 8-process spawns (pp x dp x tp, the 2.5d and 3d cubes, a 2d grid in a pipeline and under ZeRO-3,
# tp_mode=mesh3, a mesh in each pipeline stage)
# the suite skips for its time budget
test-spawn8: $(STAMP)
	AUTOPAR_SPAWN8=1 $(PY) -m pytest -q -k "8_processes or cube or pipelined_grid" tests/test_pipeline_runtime.py tests/test_tensor2d.py \
		tests/test_mesh_ilp.py

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m benchmarks.run_quick

# real models (nanoGPT-style, Hugging Face) x every strategy family, against one process
matrix: $(STAMP)
	$(PY) -m benchmarks.matrix

clean:
	rm -rf $(VENV) build *.egg-info
