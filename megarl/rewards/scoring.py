"""Scoring, the step between generation and training: a generated batch's responses -> rewards -> `RolloutBatch`.

`BatchScorer` decodes every response, computes its reward against the problem's gold answer in the reward
pool (other processes, a hard per-response timeout: `megarl.rewards.pool`) and builds the scored batch. The
task decides the problems and the gold answers (`data.task`), the reward function is chosen by `reward.name`;
the rollout worker only calls `scorer(index, problems, samples)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from megarl.batch import RolloutBatch
from megarl.data.problem import Problem
from megarl.rewards.pool import RewardPool
from megarl.rollout.client import Sample


def scored_batch(index: int, samples: list[list[Sample]], rewards: list[list[float]],
                 reward_timeouts: int = 0, reward_flags: dict[str, int] | None = None) -> RolloutBatch:
    """A batch from its samples (per problem, its K samples) and their rewards; checks one policy version."""
    versions = {s.policy_version for group in samples for s in group}
    if len(versions) != 1:
        raise RuntimeError(f"batch {index} mixes samples from policy versions {sorted(versions)}")
    flat = [s for group in samples for s in group]
    with_routes = sum(s.routed_experts is not None for s in flat)
    if with_routes not in (0, len(flat)):
        raise RuntimeError(f"batch {index}: {with_routes} of {len(flat)} samples carry routed experts (a replica "
                           "started without rollout.return_routed_experts?)")
    return RolloutBatch(
        index=index,
        prompt_ids=[list(s.prompt_ids) for s in flat],
        response_ids=[list(s.response_ids) for s in flat],
        engine_logprobs=[list(s.response_logprobs) for s in flat],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        advantages=None,
        policy_version=versions.pop(),
        reward_timeouts=reward_timeouts,
        reward_flags=dict(reward_flags or {}),
        routed_experts=[torch.from_numpy(s.routed_experts) for s in flat] if with_routes else None,
    )


class Scores(NamedTuple):
    rewards: list[list[float]]  # [G][K]
    timeouts: int  # responses whose reward passed reward.timeout_s (scored 0)
    flags: dict[str, int]  # flag -> responses the reward function flagged


class BatchScorer:
    """Scores batches with the reward pool `rewards` (owned: `close()` closes it); `decode` maps response ids
    to the text the reward function reads."""

    def __init__(self, rewards: RewardPool, decode: Callable[[list[int]], str]) -> None:
        self.rewards, self.decode = rewards, decode

    def rewards_of(self, problems: Sequence[Problem], samples: list[list[Sample]]) -> Scores:
        """Each response's reward (`samples[g]` are the K responses to `problems[g]`), how many timed out, and
        how many the reward function flagged, per flag (e.g. `unparsable`: megarl/rewards/registry.py)."""
        groups = self.group_scores(problems, samples)
        flags: dict[str, int] = {}
        for scores in groups:
            for flag, n in scores.flags.items():
                flags[flag] = flags.get(flag, 0) + n
        return Scores([s.rewards[0] for s in groups], sum(s.timeouts for s in groups), flags)

    def group_scores(self, problems: Sequence[Problem], samples: list[list[Sample]]) -> list[Scores]:
        """`rewards_of` group by group (each `Scores` holds one group's rewards, timeouts and flags): partial
        rollouts (`megarl.rollout.partial`) train groups in other batches than the ones they were scored with."""
        items = [(self.decode(s.response_ids), p.answer) for p, group in zip(problems, samples, strict=True)
                 for s in group]
        scored = self.rewards.score(items)
        k = len(samples[0])

        def within(g: int, indices: list[int]) -> int:
            return sum(g * k <= i < (g + 1) * k for i in indices)

        return [Scores([scored.rewards[g * k:(g + 1) * k]], within(g, scored.timed_out),
                       {flag: n for flag, items in scored.flags.items() if (n := within(g, items))})
                for g in range(len(samples))]

    def __call__(self, index: int, problems: Sequence[Problem], samples: list[list[Sample]]) -> RolloutBatch:
        """Batch `index`: `samples[g]` are the K responses to `problems[g]`."""
        scores = self.rewards_of(problems, samples)
        return scored_batch(index, samples, scores.rewards, reward_timeouts=scores.timeouts,
                            reward_flags=scores.flags)

    def close(self) -> None:
        self.rewards.close()
