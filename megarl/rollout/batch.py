"""One rollout batch: problems -> K samples each from the fleet -> rewards; advantages at consumption.

The rollout side (`megarl.rollout.worker`) builds scored `RolloutBatch`es ahead of the trainer; the
controller adds advantages when the trainer consumes a batch (`with_advantages`), so a stateful estimator
(RED-Drop's generator) draws in consumption order whatever the fleet's lead. The result is a plain,
picklable `RolloutBatch` that the other trainer ranks receive by broadcast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.algorithms.registry import Algorithm
from megarl.config.schema import AlgorithmConfig
from megarl.rollout.client import Sample


@dataclass
class RolloutBatch:
    index: int  # batch id l (zero-based)
    prompt_ids: list[list[int]]  # [G*K] flattened groups, K consecutive samples per prompt
    response_ids: list[list[int]]  # [G*K]
    engine_logprobs: list[list[float]]  # [G*K] engine log-prob of each sampled token
    rewards: torch.Tensor  # [G, K]
    advantages: torch.Tensor | None  # [G, K]; None until the controller consumes the batch
    policy_version: int  # version of the weights that generated every sample of the batch (engine-reported)
    reward_timeouts: int = 0  # samples whose reward function passed reward.timeout_s (scored 0)

    @property
    def num_seqs(self) -> int:
        return len(self.response_ids)


def scored_batch(index: int, samples: list[list[Sample]], rewards: list[list[float]],
                 reward_timeouts: int = 0) -> RolloutBatch:
    """A batch from its samples (per problem, its K samples) and their rewards; checks one policy version."""
    versions = {s.policy_version for group in samples for s in group}
    if len(versions) != 1:
        raise RuntimeError(f"batch {index} mixes samples from policy versions {sorted(versions)}")
    flat = [s for group in samples for s in group]
    return RolloutBatch(
        index=index,
        prompt_ids=[list(s.prompt_ids) for s in flat],
        response_ids=[list(s.response_ids) for s in flat],
        engine_logprobs=[list(s.response_logprobs) for s in flat],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        advantages=None,
        policy_version=versions.pop(),
        reward_timeouts=reward_timeouts,
    )


def with_advantages(batch: RolloutBatch, algorithm: Algorithm, algo_cfg: AlgorithmConfig) -> RolloutBatch:
    """The batch with the algorithm's advantages of its rewards (call once per batch, in consumption order)."""
    return dataclasses.replace(batch, advantages=algorithm.advantages(batch.rewards, algo_cfg))
