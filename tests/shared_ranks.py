"""Several `megarl train` jobs trained by ONE set of trainer ranks (one forkserver start, one rank start per
module instead of one per job): each job keeps its own process groups, policy, weight sync and rollout worker,
through launch's rank entry point, on ports of its own. Used by the end-to-end modules whose jobs share a trainer
layout and a session fleet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megarl.config.schema import Config
from megarl.launch import TrainerError
from megarl.parallel.spawn import RankError, free_ports, run_ranks


def _every_job(rank: int, jobs: list[tuple[dict[str, Any], dict[str, int]]], fleet_urls: list[str]) -> None:
    """One trainer rank: each job in turn (a config and its ports), as `megarl.launch.run_trainers` runs it."""
    from megarl.launch import _trainer_rank

    for cfg_data, ports in jobs:
        try:
            _trainer_rank(rank, cfg_data, fleet_urls, ports)
        except Exception as err:
            err.add_note(f"while training run.dir={cfg_data['run']['dir']} "
                         f"(algorithm.name={cfg_data['algorithm']['name']})")
            raise


def train_jobs_in_one_set_of_ranks(cfgs: list[Config], ranks: int, fleet_urls: list[str], log_dir: Path) -> None:
    """Train every config in turn on the same `ranks` trainer processes against the fleet at `fleet_urls`; a rank's
    failure raises `TrainerError` naming the job. The caller finishes each run (`megarl.launch.finish_run`) if it
    needs the summary and plots."""
    ports = iter(free_ports(2 * len(cfgs)))  # each job its own trainer store and weight-sync store
    jobs = [(cfg.model_dump(mode="json"), {"master": next(ports), "sync": next(ports)}) for cfg in cfgs]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        run_ranks(_every_job, ranks, jobs, fleet_urls, role="trainer", log_dir=log_dir)
    except RankError as err:
        raise TrainerError.from_rank_error(err) from None
