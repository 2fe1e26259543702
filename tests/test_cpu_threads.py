"""Each trainer rank on a CPU machine computes with its share of the cores (megarl.parallel.cpu_threads)."""

import os

from megarl.parallel.cpu_threads import trainer_cpu_threads
from megarl.parallel.spawn import run_ranks


def test_share_of_the_cores_by_hand() -> None:
    assert trainer_cpu_threads(0, world_size=2, rollout_workers=2, cores=2) == 1  # never 0
    assert trainer_cpu_threads(0, world_size=1, rollout_workers=1, cores=2) == 1
    assert trainer_cpu_threads(0, world_size=2, rollout_workers=2, cores=16) == 4
    assert trainer_cpu_threads(0, world_size=1, rollout_workers=2, cores=16) == 5
    assert trainer_cpu_threads(3, world_size=2, rollout_workers=2, cores=2) == 3  # asked for: taken as is


def _rank_threads(rank: int, requested: int) -> int:
    import torch

    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads

    apply_trainer_cpu_threads(requested, world_size=2, rollout_workers=2)
    return torch.get_num_threads()


def test_spawned_rank_computes_with_its_share() -> None:
    cores = len(os.sched_getaffinity(0))
    assert run_ranks(_rank_threads, 2, 0) == [max(1, cores // 4)] * 2
    assert run_ranks(_rank_threads, 1, 2) == [2]
