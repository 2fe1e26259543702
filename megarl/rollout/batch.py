"""One rollout batch: problems -> K samples each from the fleet -> rewards and advantages.

Everything here runs on the controller (trainer rank 0); the result is a plain, picklable
`RolloutBatch` that the other trainer ranks receive by broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algorithms.registry import Algorithm
from megarl.config.schema import AlgorithmConfig
from megarl.data.arithmetic import Problem
from megarl.rewards.exact_match import exact_match
from megarl.rollout.client import Sample


@dataclass
class RolloutBatch:
    index: int  # batch id l (zero-based)
    prompt_ids: list[list[int]]  # [G*K] flattened groups, K consecutive samples per prompt
    response_ids: list[list[int]]  # [G*K]
    engine_logprobs: list[list[float]]  # [G*K] engine log-prob of each sampled token
    rewards: torch.Tensor  # [G, K]
    advantages: torch.Tensor  # [G, K]
    policy_version: int  # version of the weights that generated every sample of the batch

    @property
    def num_seqs(self) -> int:
        return len(self.response_ids)


def score_and_advantage(
    index: int,
    problems: list[Problem],
    samples: list[list[Sample]],  # per problem, its K samples
    decode: Callable[[list[int]], str],  # token ids -> text, special tokens skipped
    algorithm: Algorithm,
    algo_cfg: AlgorithmConfig,
) -> RolloutBatch:
    """Rewards by exact match, advantages by the algorithm's estimator; checks one policy version."""
    versions = {s.policy_version for group in samples for s in group}
    if len(versions) != 1:
        raise RuntimeError(f"batch {index} mixes samples from policy versions {sorted(versions)}")
    groups = zip(problems, samples, strict=True)
    rewards = torch.tensor([[exact_match(decode(s.response_ids), p.answer) for s in group] for p, group in groups])
    flat = [s for group in samples for s in group]
    return RolloutBatch(
        index=index,
        prompt_ids=[list(s.prompt_ids) for s in flat],
        response_ids=[list(s.response_ids) for s in flat],
        engine_logprobs=[list(s.response_logprobs) for s in flat],
        rewards=rewards,
        advantages=algorithm.advantages(rewards, algo_cfg),
        policy_version=versions.pop(),
    )
