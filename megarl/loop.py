"""The RL controller loop, run by every trainer rank (rank 0 also drives the rollout fleet).

    for each step l:
        the fleet generates batches until it is sync_offset batches ahead; before generating batch j
        it takes the trainer's weights when the schedule says so (a partitioned broadcast);
        batch l is scored, advantaged and broadcast to all trainer ranks;
        one optimizer step on it (policy version += 1); rank 0 records the step;
        every checkpoint.interval steps (where the fleet holds no state) all ranks save a checkpoint.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from megarl.algorithms.registry import Algorithm, get_algorithm
from megarl.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_due,
    latest_checkpoint,
    open_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
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


def checkpoint_identity(cfg: Config) -> dict[str, Any]:
    """What a checkpoint must share with the config that resumes it (recorded in its meta.json)."""
    t = cfg.trainer
    model = hashlib.sha256((Path(cfg.model.hf_dir) / "config.json").read_bytes()).hexdigest()
    return {"world_size": t.world_size, "tp": t.tp, "pp": t.pp, "ep": t.ep,
            "distributed_optimizer": t.distributed_optimizer,  # each rank's optimizer file holds its own shard
            "sync_interval": cfg.sync.interval, "sync_offset": cfg.sync.offset, "algorithm": cfg.algorithm.name,
            "model_config_sha256": model,
            # prompts, sampling seeds and the algorithm's hyper-parameters decide what each later step computes
            "seed": cfg.run.seed, "data": cfg.data.model_dump(mode="json"),
            "sampling": cfg.rollout.model_dump(mode="json", include={"samples_per_prompt", "max_new_tokens",
                                                                      "temperature", "top_p"}),
            "algorithm_config": cfg.algorithm.model_dump(mode="json")}


def resume_point(cfg: Config) -> Checkpoint | None:
    """The verified checkpoint `checkpoint.resume` names (None: a fresh start)."""
    if cfg.checkpoint.resume is None:
        return None
    root = Path(cfg.run.dir) / "checkpoints"
    path = latest_checkpoint(root) if cfg.checkpoint.resume == "latest" else Path(cfg.checkpoint.resume)
    if path is None:
        raise CheckpointError(
            f"checkpoint.resume=latest but {root} holds no complete checkpoint: start without checkpoint.resume, "
            "or point it at a checkpoint directory"
        )
    return open_checkpoint(path, checkpoint_identity(cfg))


def _algorithm_state(algorithm: Algorithm) -> dict[str, Any] | None:
    """State carried by stateful estimators (RED-Drop's generator), None for pure ones."""
    state_dict = getattr(algorithm.advantages, "state_dict", None)
    return state_dict() if state_dict is not None else None


def run_loop(cfg: Config, rank: int, policy, weight_sync, producer, dp: tuple[int, int], pad_id: int) -> list[dict]:
    """Train until cfg.run.steps steps are done; returns the metric records (rank 0; other ranks return [])."""
    algorithm = get_algorithm(cfg.algorithm.name)
    schedule = SyncSchedule(cfg.sync.interval, cfg.sync.offset)
    world = dist.get_world_size()
    pending: dict[int, Any] = {}
    generated, start = 0, 0
    resumed = resume_point(cfg)
    if resumed is not None:  # trainer state, then (rank 0) the batches generated ahead and the estimator state
        state = resumed.rank_state(rank)
        policy.load_state_dict(state["policy"])
        set_rng_state(state["rng"])
        start, generated = resumed.step + 1, schedule.batches_ready_before_step(resumed.step)
        if rank == 0:
            loop_state = resumed.loop_state()
            pending = loop_state["pending"]
            if loop_state["algorithm"] is not None:
                algorithm.advantages.load_state_dict(loop_state["algorithm"])
    last_saved = resumed.step if resumed is not None else -1
    writer = MetricsWriter(cfg.run.dir, resume_at=start if resumed is not None else None) if rank == 0 else None
    bar = tqdm(range(start, cfg.run.steps), desc="megarl train", disable=rank != 0, dynamic_ncols=True,
               initial=start, total=cfg.run.steps)
    syncs: list[SyncStats] = []
    if cfg.sync.push_initial and resumed is None:  # a resumed run's next batch starts with a push anyway
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
            if checkpoint_due(schedule, step, cfg.checkpoint.interval, last_saved):
                loop_state = {"pending": pending, "algorithm": _algorithm_state(algorithm)} if rank == 0 else None
                save_checkpoint(Path(cfg.run.dir) / "checkpoints", step, rank, world,
                                {"policy": policy.state_dict(), "rng": rng_state()}, loop_state,
                                checkpoint_identity(cfg), cfg.checkpoint.keep_last)
                last_saved = step
    finally:
        if writer is not None:
            writer.close()
    return writer.records if writer is not None else []
