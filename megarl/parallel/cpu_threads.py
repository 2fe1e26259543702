"""How many torch threads a trainer rank computes with on a machine without a GPU.

On a CPU machine the trainer ranks and the vLLM workers share the cores. torch's default (one OpenMP thread
per core in every process) oversubscribes them, and an OpenMP parallel op whose threads are not all running
waits at its barrier for the descheduled one: every one of a step's hundreds of small ops pays a scheduler
time slice. Giving each computing process its share of the cores avoids that.
"""

from __future__ import annotations

import os

import torch


def trainer_cpu_threads(requested: int, world_size: int, rollout_workers: int, cores: int | None = None) -> int:
    """`requested` if set (> 0), else this rank's share of the cores: cores // (trainer ranks + rollout
    workers), at least 1 (everything is assumed on this machine, as it is when there is no GPU)."""
    if requested > 0:
        return requested
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // (world_size + rollout_workers))


def apply_trainer_cpu_threads(requested: int, world_size: int, rollout_workers: int) -> int | None:
    """Set torch's intra-op threads of this trainer rank when there is no GPU; returns the count (None on GPUs,
    where torch's default stays)."""
    if torch.cuda.is_available():
        return None
    threads = trainer_cpu_threads(requested, world_size, rollout_workers)
    torch.set_num_threads(threads)
    return threads
