# The trainer role's image (docs/gpu.md): megarl's trainer ranks on the NGC PyTorch release megatron-core 0.16.1's
# own CI develops against (Megatron-LM core_v0.16.1, docker/.ngc_version.dev). The image provides torch
# 2.10.0a0 (CUDA 13.0) and Transformer Engine 2.9; everything else comes from locks/gpu-trainer.txt, which leaves
# those two out. Written, never built: the machines this project is developed on have no Docker and no registry.
#
#   docker build -f containers/trainer.Dockerfile -t megarl-trainer .       (from the repository root)
#
# The last step checks the result against the stack (`megarl preflight versions`): a torch or TE build string that
# differs from megarl/stacks.py's CONTAINER_PROVIDES (from public sources, not read from the image) fails the
# build here, naming both versions.
ARG TRAINER_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${TRAINER_IMAGE}

# A venv over the image's packages, as Megatron-LM's CI builds its own: the image's torch and Transformer Engine stay
# visible (--system-site-packages) and untouched; the lock's packages shadow the image's other copies. The image
# constrains pip to its own versions (PIP_CONSTRAINT); the lock decides here.
ENV PIP_CONSTRAINT="" \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv --system-site-packages /opt/venv

WORKDIR /opt/megarl
COPY locks/ locks/
RUN pip install --no-cache-dir --no-deps -r locks/gpu-trainer.txt
# megarl itself, editable, so `megarl preflight` finds locks/ beside the package
COPY pyproject.toml README.md ./
COPY megarl/ megarl/
COPY configs/ configs/
COPY slurm/ slurm/
RUN pip install --no-cache-dir --no-deps -e . \
    && megarl preflight versions --stack gpu-trainer
