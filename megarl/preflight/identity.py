"""Who a check step is, from what its launcher put in its environment: node, SLURM job and step, and the GPUs it
holds. GPUs are named by the node's own indices (SLURM's ids, `SLURM_STEP_GPUS`), so two steps on one node can be
compared; `CUDA_VISIBLE_DEVICES` may be renumbered from 0 in each step (cgroup-constrained devices), and its i-th
entry is SLURM's i-th id."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any


def id_list(text: str | None) -> list[int]:
    """`0,1,3` or SLURM's `0-3,6` as a list of integers; empty or unset: []. Names that are not numbers (GPU
    UUIDs in CUDA_VISIBLE_DEVICES) are skipped: they cannot be compared with SLURM's ids."""
    ids: list[int] = []
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


def visible_devices(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (indices or UUIDs); None when it is unset (every device is visible)."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]


def node_name(env: Mapping[str, str]) -> str:
    """SLURM's name of this node, else the host name (as `megarl.roles.node_name`)."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def step_gpus(env: Mapping[str, str]) -> list[int]:
    """The GPUs this step holds on its node, by SLURM's ids: `SLURM_STEP_GPUS`, else `SLURM_JOB_GPUS`, else the
    visible list itself (outside SLURM)."""
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if env.get(name):
            return id_list(env[name])
    return []


def who(role: str, index: int, local_rank: int, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The identity part of a step's hello. `gpu` is the GPU a trainer rank would use: its step's
    `local_rank % count`-th GPU, as `megarl.parallel.groups` picks it (None for replicas, which use all theirs)."""
    env = os.environ if env is None else env
    gpus = step_gpus(env)
    default_name = "megarl-rank" if role == "rank" else f"megarl-serve-{index}"
    return {
        "role": role, "index": index, "node": node_name(env), "pid": os.getpid(),
        "job_id": env.get("SLURM_JOB_ID"), "step_id": env.get("SLURM_STEP_ID"),
        "step": (env.get("SLURM_JOB_NAME") if env.get("SLURM_STEP_ID") else None) or default_name,
        "local_rank": local_rank, "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "slurm_gpus": env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"), "gpus": gpus,
        "gpu": rank_gpu(gpus, env.get("CUDA_VISIBLE_DEVICES"), local_rank) if role == "rank" else None,
    }


def rank_gpu(held: list[int], visible: str | None, local_rank: int) -> int | None:
    """The GPU (SLURM's id) a trainer rank computes on: the `local_rank % count`-th visible device, as
    `megarl.parallel.groups` picks it. The i-th visible device is SLURM's i-th id when the step sees all it holds;
    with a device per task (`--gpu-bind`), the visible list names SLURM's ids itself."""
    shown = id_list(visible)
    if shown and len(shown) != len(held) and set(shown) <= set(held):
        return shown[local_rank % len(shown)]
    return held[local_rank % len(held)] if held else None
