"""The RL controller loop, run by every trainer rank (rank 0 also drives the rollout side).

    the rollout worker (rank 0's threads) generates and scores batches ahead, as far as the schedule allows
    (and no further than the last batch the run trains on);
    for each step l:
        if the schedule pushes the trainer's weights now: wait until the fleet has finished every batch of
        the older weights (with `sync.inflight`, not at all: the push lands while the fleet generates, and
        batches are formed from finished groups, `megarl.rollout.partial`), let lost replicas out and restarted
        ones in (`megarl.rollout.membership`), then push (a partitioned broadcast from every trainer rank), and
        check that every replica reports the version the schedule pushed (`VersionClock.check_served`);
        take batch l (waiting only if it is not ready), add its advantages, broadcast it to all trainer ranks
        (as tensors: `megarl.trainer.batch_tensors`);
        one optimizer step on it (policy version += 1); rank 0 records the step and the timeline;
        every checkpoint.interval steps (where the fleet holds no state) all ranks save a checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from megarl.algorithms.registry import Algorithm, get_algorithm
from megarl.batch import batch_metrics, with_advantages
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
from megarl.metrics.sinks import open_sinks
from megarl.metrics.timeline import Timeline, step_times
from megarl.metrics.writer import MetricsWriter
from megarl.rewards.registry import GOLD_UNPARSABLE, UNPARSABLE
from megarl.rollout.membership import Roster, after_push, before_push
from megarl.rollout.worker import RolloutWorker
from megarl.schedule import SyncSchedule, VersionClock
from megarl.sync.weight_sync import SyncStats
from megarl.trainer.batch_tensors import broadcast_batch
from megarl.trainer.step import train_on_batch


class NonFiniteStepsError(FloatingPointError):
    """Too many consecutive steps with a non-finite gradient norm (trainer.max_skipped_steps)."""


REWARD_FLAGS = (UNPARSABLE, GOLD_UNPARSABLE)  # recorded every step (0 when the reward flags nothing)
SYNC_PHASES = ("needs_s", "plan_s", "open_s", "send_s", "close_s", "fleet_paused_s", "worker_receive_s",
               "worker_load_s", "delta_count_s", "delta_store_s")


def _sync_metrics(stats: list[SyncStats]) -> dict[str, float]:
    return {
        "sync/count": len(stats),
        "sync/bytes_sent": sum(sum(s.bytes_sent.values()) for s in stats),
        "sync/bytes_received": sum(sum(s.bytes_received.values()) for s in stats),
        "sync/seconds": sum(s.seconds for s in stats),
        # the most send-bucket bytes any trainer rank held at once (bounded by megarl.sync.stream's window)
        "sync/staging_peak_bytes": max((max(s.staging_peak_bytes.values(), default=0) for s in stats), default=0),
        # where the seconds went (SyncStats.phases): the fixed part (open, close, vLLM reload) against the send
        **{f"sync/{k}": sum(s.phases.get(k, 0.0) for s in stats) for k in SYNC_PHASES},
        # sync.delta: what full pushes would have moved (each worker's slices), and the changed elements of the
        # blocks sent as deltas out of all their elements (changed fraction = delta_changed / delta_elements)
        "sync/bytes_full": sum(sum(s.bytes_needed.values()) for s in stats),
        "sync/delta_pushes": sum(bool(s.delta) for s in stats),
        "sync/bytes_sent_delta": sum(sum(s.bytes_sent.values()) for s in stats if s.delta),
        "sync/seconds_delta": sum(s.seconds for s in stats if s.delta),
        "sync/delta_changed": sum(c for s in stats for c, _ in s.delta.values()),
        "sync/delta_elements": sum(n for s in stats for _, n in s.delta.values()),
        "sync/sender_base_bytes": max((max(s.sender_base_bytes.values(), default=0) for s in stats), default=0),
    }


def checkpoint_identity(cfg: Config) -> dict[str, Any]:
    """What a checkpoint records in its meta.json and must share with the config that resumes it, except the
    trainer layout (`megarl.checkpoint.LAYOUT_KEYS`: recorded for the exporter; resume reshards)."""
    t = cfg.trainer
    model = hashlib.sha256((Path(cfg.model.hf_dir) / "config.json").read_bytes()).hexdigest()
    return {"world_size": t.world_size, "tp": t.tp, "pp": t.pp, "ep": t.ep, "expert_tp": t.expert_tp,
            # megatron names the distributed optimizer's fp32 main parameters in its checkpoint, the plain one's not
            "distributed_optimizer": t.distributed_optimizer,
            "precision": t.precision,  # the model's dtype and whether the optimizer holds fp32 main copies
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


def push_point(schedule: SyncSchedule, step: int, steps: int) -> int | None:
    """The batch that the push at the start of step `step` of a `steps`-step run precedes, or None when the step
    pushes nothing: the schedule's push, unless it precedes only batches the run never trains on (`>= steps`).
    With `sync.offset` 0 the push before the last batch is made at the final step itself."""
    before = schedule.push_at_step(step)
    return before if before is not None and before < steps else None


def _span(timeline: Timeline | None, lane: str, kind: str, label: str) -> AbstractContextManager:
    return timeline.span(lane, kind, label) if timeline is not None else nullcontext()


def run_loop(cfg: Config, rank: int, policy, weight_sync,
             start_rollout: Callable[[Timeline, int, dict, dict | None], RolloutWorker] | None,
             dp: tuple[int, int], pad_id: int, roster: Roster | None = None,
             clock: VersionClock | None = None) -> list[dict]:
    """Train until cfg.run.steps steps are done; returns the metric records (rank 0; other ranks return []).
    Rank 0 passes `start_rollout(timeline, first_batch, saved_batches, data_position)`, which starts the rollout
    worker (`data_position`: where a resumed run's data continues, as its checkpoint recorded it; None if fresh),
    and `roster`, where restarted replicas register (None: none come back). `clock`: this process's
    `megarl.schedule.VersionClock`, shared with the weight sync and the rollout worker (None: one from the config)."""
    algorithm = get_algorithm(cfg.algorithm.name)
    clock = clock if clock is not None else VersionClock.from_config(cfg)
    schedule = clock.schedule
    world = dist.get_world_size()
    start, saved, data_position = 0, {}, None
    resumed = resume_point(cfg)
    if resumed is not None:  # trainer state, then (rank 0) the batches generated ahead and the estimator state
        state = resumed.rank_state(rank)
        policy.load_sharded_state_dict(resumed.load_sharded(policy.sharded_state_dict(is_loading=True)),
                                       state["version"])
        set_rng_state(state["rng"])
        start = resumed.step + 1
        if rank == 0:
            loop_state = resumed.loop_state()
            saved = loop_state["pending"]
            data_position = loop_state.get("data")  # checkpoints written before data positions existed: None
            if loop_state["algorithm"] is not None:
                algorithm.advantages.load_state_dict(loop_state["algorithm"])
    clock.resume_at(start)
    last_saved = resumed.step if resumed is not None else -1
    resume_at = start if resumed is not None else None
    writer = MetricsWriter(cfg.run.dir, resume_at, open_sinks(cfg, resume_at)) if rank == 0 else None
    timeline = Timeline() if rank == 0 else None
    bar = tqdm(range(start, cfg.run.steps), desc="megarl train", disable=rank != 0, dynamic_ncols=True,
               initial=start, total=cfg.run.steps)
    syncs: list[SyncStats] = []
    skipped_in_a_row = 0  # checkpoints are saved only after a step that was not skipped
    skipped_total = sum(r.get("train/skipped_step", 0) for r in writer.records) if writer is not None else 0

    rollout: RolloutWorker | None = None  # rank 0's, started below (after the initial push, if any)

    def push(before: int | None) -> None:  # collective over the trainer ranks; `before`: None for the initial push
        version = clock.push_version(before)  # the schedule's (the trainer's own, checked by `begin_step`)
        with _span(timeline, "push", "push", f"v{version}"):
            before_push(weight_sync, rollout, roster, version)
            syncs.append(weight_sync.push(policy.iter_local_hf_slices(), version=policy.version))
            urls = {rep: c.url for rep, c in weight_sync.fleet.clients.items()} if weight_sync.fleet else None
            clock.check_served(version, syncs[-1].served, urls)  # rank 0 (the others hold no labels)
            after_push(weight_sync, rollout)

    if cfg.sync.push_initial and resumed is None:  # a resumed run's next batch starts with a push anyway
        clock.begin_step(start, policy.version)
        push(None)
    window_start = 0.0
    try:
        if rank == 0 and start_rollout is not None:
            with _span(timeline, "trainer", "startup", "rollout worker"):
                rollout = start_rollout(timeline, start, saved, data_position)
            after_push(weight_sync, rollout)  # replicas the initial push found dead take no chunks
        for step in bar:
            clock.begin_step(step, policy.version)  # the trainer's version is the step it trains
            before = push_point(schedule, step, cfg.run.steps)  # the batch a push of the weights precedes now
            if before is not None:
                if rollout is not None:
                    with _span(timeline, "trainer", "wait", f"push point {before}"):
                        rollout.before_push(before)  # no replica generating with older weights, unless in flight
                push(before)
                if rollout is not None:  # (the requests the push held part-way bound their oldest tokens' versions)
                    rollout.pushed(before, syncs[-1].held_requests)
            record: dict[str, Any] = {"step": step, "policy_version": clock.trainer_version}
            if rollout is not None and cfg.eval.interval and step % cfg.eval.interval == 0:
                with _span(timeline, "trainer", "eval", f"step {step}"):  # the fleet's weights of its last push
                    record.update(rollout.evaluate())
            batch = None
            if rollout is not None:
                batch = rollout.take(step)
                record["pipeline/batches_generated"] = rollout.batches_generated()
                record["fleet/replicas"] = rollout.live_replicas()  # replicas still answering
                record["fleet/replicas_in_sync"] = len(weight_sync.live)  # replicas the pushes reach
                record.update(rollout.step_metrics())  # groups requeued; partial rollouts: carried, dropped
                position = rollout.data_position(step) or {}  # where the batch's prompts start in the data
                record.update({f"data/{k}": position[k] for k in ("epoch", "index") if k in position})
            with _span(timeline, "trainer", "train", f"step {step}"):  # advantages, broadcast, optimizer step
                if batch is not None:
                    batch = with_advantages(batch, algorithm, cfg.algorithm)
                    record.update(batch_metrics(batch, REWARD_FLAGS))  # rank 0's record is the one written
                step_batch = broadcast_batch(batch, policy.device)  # rank 0's batch, as tensors on every rank
                lag = clock.batch_lag(step_batch.policy_version)
                record.update({"batch/generation_version": step_batch.policy_version, "batch_lag": lag})
                record.update(train_on_batch(policy, step_batch, algorithm, cfg, pad_id, *dp, lag=lag,
                                             bound=clock.bound))
            record.update(_sync_metrics(syncs))
            record["sync/versions"] = [s.version for s in syncs]
            if cfg.sync.inflight:  # groups with a response part-way at this step's pushes (FleetLifecycle.held_groups)
                record["sync/held_groups"] = sorted({g for s in syncs for g in s.held_groups})
            if syncs:  # what each replica in the sync reports serving after this step's last push
                record["sync/served_versions"] = {str(rep): label for rep, label in syncs[-1].served.items()}
            syncs = []
            if timeline is not None:
                window_end = timeline.now()
                record.update(step_times(timeline.spans(), window_start, window_end))
                window_start = window_end
            skipped_in_a_row = skipped_in_a_row + 1 if record["train/skipped_step"] else 0
            skipped_total += record["train/skipped_step"]
            record["train/skipped_steps"] = skipped_total
            if writer is not None:
                writer.write(record)
                bar.set_postfix(reward=f"{record['reward/mean']:.2f}", lag=lag)
            if skipped_in_a_row >= cfg.trainer.max_skipped_steps:  # every rank sees the same gradient norms
                raise NonFiniteStepsError(
                    f"steps {step - skipped_in_a_row + 1}..{step}: {skipped_in_a_row} consecutive steps had a "
                    f"non-finite gradient norm and were skipped (trainer.max_skipped_steps="
                    f"{cfg.trainer.max_skipped_steps}); the run stops with the weights of step "
                    f"{step - skipped_in_a_row}. Lower optimizer.lr, check the data, or resume from "
                    f"{Path(cfg.run.dir) / 'checkpoints'}")
            if skipped_in_a_row == 0 and checkpoint_due(schedule, step, cfg.checkpoint.interval, last_saved):
                with _span(timeline, "trainer", "checkpoint", f"step {step}"):
                    loop_state = None
                    if rollout is not None:  # the fleet stops before the push that follows; save what it made
                        rollout.quiesce(min(schedule.batches_ready_before_step(step), cfg.run.steps))
                        loop_state = {"pending": rollout.pending(), "algorithm": _algorithm_state(algorithm),
                                      "data": rollout.data_position(step + 1)}  # where the data continues
                    save_checkpoint(Path(cfg.run.dir) / "checkpoints", step, rank, world,
                                    {"version": policy.version, "rng": rng_state()}, loop_state,
                                    checkpoint_identity(cfg), cfg.checkpoint.keep_last, policy.sharded_state_dict())
                last_saved = step
    finally:
        if rollout is not None:
            rollout.close()
        if writer is not None:
            writer.close()
        if timeline is not None:
            timeline.save(Path(cfg.run.dir) / "timeline.json")
    return writer.records if writer is not None else []

