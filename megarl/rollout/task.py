"""The task side of rollouts: which problems batch `l` holds, how prompts are tokenized, the sampling
arguments and seeds, and the reward function. `start_rollout_worker` wires them into a `RolloutWorker`.

Problems and seeds of batch `l` are a deterministic function of `l` and `run.seed`, so which version
generates which batch is decided by the schedule alone, and a resumed run regenerates nothing it saved.
"""

from __future__ import annotations

from functools import partial

from transformers import AutoTokenizer

from megarl.config.schema import Config
from megarl.data.arithmetic import problem_batch
from megarl.metrics.timeline import Timeline
from megarl.rewards.pool import RewardPool
from megarl.rewards.registry import REWARD_FUNCTIONS  # reward.name -> module:callable
from megarl.rollout.batch import RolloutBatch
from megarl.rollout.client import RolloutClient
from megarl.rollout.worker import RolloutWorker
from megarl.sync.schedule import SyncSchedule


def start_rollout_worker(cfg: Config, clients: list[RolloutClient], timeline: Timeline, start: int = 0,
                         ready: dict[int, RolloutBatch] | None = None) -> RolloutWorker:
    """The run's rollout worker, generating from batch `start` on (`ready`: batches a checkpoint saved)."""
    d, r = cfg.data, cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.hf_dir))
    prompts_per_batch = d.prompts_per_step
    rewards = RewardPool(REWARD_FUNCTIONS[cfg.reward.name], workers=cfg.reward.workers,
                         timeout_s=cfg.reward.timeout_s)
    try:
        return RolloutWorker(
            clients, SyncSchedule(cfg.sync.interval, cfg.sync.offset),
            problems=partial(problem_batch, size=d.prompts_per_step, max_operand=d.max_operand, seed=cfg.run.seed),
            encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            sampling={"n": r.samples_per_prompt, "max_tokens": r.max_new_tokens, "temperature": r.temperature,
                      "top_p": r.top_p},
            seed=lambda index: cfg.run.seed * 100_003 + index * prompts_per_batch,
            rewards=rewards, timeline=timeline, end=cfg.run.steps, overlap=r.overlap, start=start, ready=ready,
        )
    except BaseException:
        rewards.close()
        raise
