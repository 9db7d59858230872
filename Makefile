# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch goes in first: an unpinned torch pulled in by a dependency would be a multi-GB CUDA build.
# Machines without CUDA get the pinned CPU build; machines with nvidia-smi get the default CUDA build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test venv clean-zoo

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m deployments.demo

# One BLAS thread per process: Ray workers and the test process share 2 cores, and oversubscribed
# threads made the engine's tests 4x slower here (12 s vs 48 s).
# The house first (seconds): pyflakes and import order, then the import contracts in pyproject.toml.
test: $(STAMP)
	$(VENV)/bin/ruff check -q offload_core cluster deployments zoo bench tests
	$(VENV)/bin/lint-imports --no-cache
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider tests

clean-zoo:
	rm -rf .cache/zoo
