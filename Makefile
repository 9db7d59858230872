# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch goes in first: an unpinned torch pulled in by a dependency would be a multi-GB CUDA build.
# Machines without CUDA get the pinned CPU build; machines with nvidia-smi get the default CUDA build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# Ray's token authentication stays on (Ray's default): `make demo` and `make serve` start a loopback
# head with RAY_AUTH_MODE=token themselves (deployments/dev/local_ray.py). Only the tests' own cluster
# turns it off (tests/conftest.py), so nothing here exports RAY_AUTH_MODE.
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo serve test venv clean-zoo

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/offload-serve demo

# configs/local.yaml on a head started as `ray start --head --node-ip-address=127.0.0.1
# --dashboard-host=127.0.0.1` with token auth; Ctrl-C stops the service and that head (only it).
serve: $(STAMP)
	$(VENV)/bin/offload-serve serve configs/local.yaml

# The tiny zoo the tests load (11 models, 12 s and 527 MB on a fresh clone), built before the tests start
# rather than by the first test that asks for each model, so no test on the Ray modules' worker (the suite's
# critical path) waits on the other, niced worker's build of a model (zoo/cache.py's lock).
# The stamp skips the 6 s of imports a warm zoo's check costs; a model missing anyway is built on use.
ZOO_DIR   := $(or $(OFFLOAD_SERVE_ZOO),.cache/zoo)
ZOO_STAMP := $(ZOO_DIR)/.built-by-make

$(ZOO_STAMP): $(STAMP) $(wildcard zoo/*.py)
	$(PY) -m zoo.build > /dev/null
	touch $(ZOO_STAMP)

# One BLAS thread per process: Ray workers and the test process share 2 cores, and oversubscribed
# threads made the engine's tests 4x slower here (12 s vs 48 s).
# The house first (seconds): pyflakes and import order, then the import contracts in pyproject.toml.
test: $(STAMP) $(ZOO_STAMP)
	$(VENV)/bin/ruff check -q compat offload_core cluster deployments zoo testing bench tests docs
	$(VENV)/bin/lint-imports --no-cache
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 tests

clean-zoo:
	rm -rf $(ZOO_DIR)
