"""One trainer rank, whoever started it: join the trainer world, build the policy and the weight sync, run the loop.

The local launcher (`megarl train`, `megarl.launch`) spawns the ranks on this machine and passes the fleet's
URLs; under `srun` or `torchrun` each rank is `megarl rank --config <run.dir>/config.yaml`, finds its place in
the environment (`megarl.parallel.launcher_env`) and rank 0 finds the fleet in the run directory
(`megarl.rollout.rendezvous`).

Ports: rank 0 serves the trainer's rendezvous store on `master_addr:master_port` and the weight-sync group's
store on `master_addr:master_port + 1` (each bound to that address only; `megarl.parallel.stores`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from megarl.config.schema import Config
from megarl.parallel.launcher_env import ProcessPlace
from megarl.parallel.quiet_warnings import quiet_cpu_warnings
from megarl.parallel.spawn import error_log as rank_error_log


def run_rank(cfg: Config, place: ProcessPlace, sync_port: int, fleet_urls: Callable[[], list[str]]) -> None:
    """Train as rank `place.rank`. Rank 0 calls `fleet_urls()` once its model is built (it may wait for the
    fleet there) and drives the rollout side; the other ranks never call it."""
    import torch

    if not torch.cuda.is_available():
        quiet_cpu_warnings()

    from megarl.checks import receive_mode
    from megarl.loop import run_loop
    from megarl.models.hf_config import read_hf_config
    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.membership import Roster
    from megarl.rollout.task import start_rollout_worker
    from megarl.schedule import VersionClock
    from megarl.sync.weight_sync import PartitionedWeightSync
    from megarl.trainer.policy import MegatronPolicy

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t, rank = cfg.trainer, place.rank
    apply_trainer_cpu_threads(t.cpu_threads, t.world_size, cfg.rollout.tp * cfg.rollout.replicas)
    init_trainer_groups(TrainerLayout(t.tp, t.pp, t.ep, t.expert_tp), rank, t.world_size, place.master_addr,
                        place.master_port, timeout_s=t.collective_timeout_s, local_rank=place.local_rank,
                        launcher_store=place.launcher_store)
    try:
        hf = read_hf_config(cfg.model.hf_dir)
        policy = MegatronPolicy(cfg.model.hf_dir, hf, cfg.optimizer, logprob_chunk=t.logprob_chunk_tokens,
                                distributed_optimizer=t.distributed_optimizer, recompute=t.recompute,
                                routing_replay=t.routing_replay, logprob_vocab_block=t.logprob_vocab_block,
                                logprob_kernel=t.logprob_kernel, moe_aux_loss_coeff=t.moe_aux_loss_coeff,
                                precision=t.precision, overlap_grad_reduce=t.overlap_grad_reduce,
                                grad_bucket_size=t.grad_bucket_size, layer_spec=t.layer_spec,
                                grad_reduce_in_bf16=t.grad_reduce_in_bf16,
                                overlap_param_gather=t.overlap_param_gather, recompute_layers=t.recompute_layers)
        clock = VersionClock.from_config(cfg)  # this process's record of the run's versions (`megarl.schedule`)
        urls = fleet_urls() if rank == 0 else []
        clients = [RolloutClient(url, health_timeout_s=cfg.rollout.health_timeout_s) for url in urls]
        roster = Roster(cfg.run.dir, job_secret(), urls, cfg.rollout.health_timeout_s) if rank == 0 else None
        weight_sync = PartitionedWeightSync(
            rank=rank, world_size=t.world_size, hf_config=hf, clients=clients, rollout_tp=cfg.rollout.tp,
            rollout_replicas=cfg.rollout.replicas, store_host=place.master_addr, store_port=sync_port,
            bucket_bytes=int(cfg.sync.bucket_mb * 2**20), timeout_s=t.collective_timeout_s, needs=cfg.sync.needs,
            receive=receive_mode(cfg, hf, torch.cuda.is_available())[0],  # sync.receive=auto resolved
            delta=cfg.sync.delta, wire_dtype=getattr(torch, cfg.rollout.dtype),
            min_replicas=cfg.rollout.min_replicas, rejoin_timeout_s=cfg.sync.rejoin_timeout_s,
            group_timeout=(cfg.sync.timeout_min_gbps, cfg.sync.timeout_fixed_s),
            condemn=roster.condemn if roster is not None else None, silent_s=cfg.rollout.health_timeout_s,
            inflight=cfg.sync.inflight, inflight_kv=cfg.sync.inflight_kv, clock=clock,
        )
        start_rollout = None
        if rank == 0:
            def start_rollout(timeline, start, saved, data_position):
                return start_rollout_worker(cfg, clients, timeline, clock, start, saved, data_position)
        run_loop(cfg, rank, policy, weight_sync, start_rollout, dp_rank_and_size(), pad_id=hf.get("pad_token_id") or 0,
                 roster=roster, clock=clock)
        weight_sync.close()
    finally:
        destroy_trainer_groups()


def job_secret() -> str | None:
    """The fleet secret this process sends (`MEGARL_FLEET_SECRET_FILE`), which also tells this job's replica
    registrations from another's; None if there is none."""
    from megarl.rollout.fleet_auth import SECRET_ENV, read_secret

    path = os.environ.get(SECRET_ENV)
    return read_secret(path) if path else None


def error_log(run_dir: Path | str, rank: int) -> Path:
    """Where a failed trainer rank's whole traceback goes, `<run_dir>/trainer_rank<k>_error.log`, however the
    rank was started (the local launcher's `run_ranks(role="trainer")` writes the same file)."""
    return rank_error_log(run_dir, rank, role="trainer")
