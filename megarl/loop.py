"""The RL controller loop, run by every trainer rank (rank 0 also drives the rollout fleet).

    for each step l:
        the fleet generates batches until it is sync_offset batches ahead; before generating batch j
        it takes the trainer's weights when the schedule says so (a partitioned broadcast);
        batch l is scored, advantaged and broadcast to all trainer ranks;
        one optimizer step on it (policy version += 1); rank 0 records the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from megarl.algorithms.registry import get_algorithm
from megarl.config.schema import Config
from megarl.metrics.writer import MetricsWriter
from megarl.sync.schedule import SyncSchedule
from megarl.sync.weight_sync import SyncStats
from megarl.trainer.step import train_on_batch


def _broadcast(obj: Any, rank: int) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync_metrics(stats: list[SyncStats]) -> dict[str, float]:
    return {
        "sync/count": len(stats),
        "sync/bytes_sent": sum(sum(s.bytes_sent.values()) for s in stats),
        "sync/bytes_received": sum(sum(s.bytes_received.values()) for s in stats),
        "sync/seconds": sum(s.seconds for s in stats),
    }


def run_loop(cfg: Config, rank: int, policy, weight_sync, producer, dp: tuple[int, int], pad_id: int) -> list[dict]:
    """Train for cfg.run.steps steps; returns the metric records (rank 0; other ranks return [])."""
    algorithm = get_algorithm(cfg.algorithm.name)
    schedule = SyncSchedule(cfg.sync.interval, cfg.sync.offset)
    writer = MetricsWriter(cfg.run.dir) if rank == 0 else None
    pending: dict[int, Any] = {}
    generated = 0
    bar = tqdm(range(cfg.run.steps), desc="megarl train", disable=rank != 0, dynamic_ncols=True)
    syncs: list[SyncStats] = []
    if cfg.sync.push_initial:
        syncs.append(weight_sync.push(policy.iter_local_hf_slices(), version=policy.version))
    try:
        for step in bar:
            t0 = time.perf_counter()
            while generated < schedule.batches_ready_before_step(step):
                version = schedule.sync_before_batch(generated)
                if version is not None:
                    if version != policy.version:
                        raise RuntimeError(f"schedule pushes version {version} but the trainer is at {policy.version}")
                    syncs.append(weight_sync.push(policy.iter_local_hf_slices(), version=policy.version))
                if rank == 0:
                    pending[generated] = producer.produce(generated)
                generated += 1
            batch = _broadcast(pending.pop(step, None), rank)
            t1 = time.perf_counter()
            lag = policy.version - batch.policy_version
            record = {"step": step, "policy_version": policy.version, "batch_lag": lag,
                      "reward/mean": float(batch.rewards.mean())}
            record.update(train_on_batch(policy, batch, algorithm, cfg, pad_id, *dp, lag=lag))
            record.update(_sync_metrics(syncs))
            syncs = []
            record.update({"time/rollout_and_sync_s": t1 - t0, "time/train_s": time.perf_counter() - t1})
            if writer is not None:
                writer.write(record)
                bar.set_postfix(reward=f"{record['reward/mean']:.2f}", lag=lag)
    finally:
        if writer is not None:
            writer.close()
    return writer.records if writer is not None else []
