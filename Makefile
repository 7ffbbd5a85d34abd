# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing. On a machine without an NVIDIA GPU the
# CPU wheel torch==2.13.0 is installed first (never a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autopar-installed
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.5,<3' || echo 'torch==2.13.0')

.PHONY: all demo test bench matrix venv clean

all: test

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m benchmarks.run_quick

# real models (nanoGPT-style, Hugging Face) x every strategy family, against one process
matrix: $(STAMP)
	$(PY) -m benchmarks.matrix

clean:
	rm -rf $(VENV) build *.egg-info
