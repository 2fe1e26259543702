"""`RolloutBatch`: the unit the trainer consumes, one scored rollout batch, and its advantages.

The rollout side builds scored batches ahead of the trainer (`megarl.rollout.worker` generates,
`megarl.rewards.scoring` scores); the controller adds advantages when the trainer consumes a batch
(`with_advantages`), so a stateful estimator (RED-Drop's generator) draws in consumption order whatever
the fleet's lead. A `RolloutBatch` is plain and picklable: the other trainer ranks receive it by broadcast.
The trainer imports this module only, never the rollout package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.algorithms.registry import Algorithm
from megarl.config.schema import AlgorithmConfig
from megarl.token_versions import TokenVersions


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
    reward_flags: dict[str, int] = dataclasses.field(default_factory=dict)  # flag -> samples the reward flagged
    # routing replay: per sample [T, layers, top_k] experts the engine routed each input token to (T = prompt +
    # response tokens, or one fewer: the engine never forwards the last sampled token), uint8/int16
    # (`megarl.trainer.routing_replay.compact_indices`); None when the engine returned none
    routed_experts: list[torch.Tensor] | None = None
    # per sample, the policy version of each response token (`megarl.token_versions`): set when a push landed while
    # some responses were generating (in-flight weight updates); None: every token was sampled with `policy_version`
    token_versions: list[TokenVersions] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.response_ids)


def with_advantages(batch: RolloutBatch, algorithm: Algorithm, algo_cfg: AlgorithmConfig) -> RolloutBatch:
    """The batch with the algorithm's advantages of its rewards (call once per batch, in consumption order)."""
    return dataclasses.replace(batch, advantages=algorithm.advantages(batch.rewards, algo_cfg))


def batch_metrics(batch: RolloutBatch, flags: tuple[str, ...] = ()) -> dict[str, float]:
    """The step record's view of a batch: mean reward, reward timeouts, samples the reward function flagged per flag
    (`flags` are recorded as 0 when absent, e.g. `reward/unparsable`), response lengths in tokens, and the samples
    it holds (prompts x K when nothing was lost or generated twice)."""
    lengths = [len(r) for r in batch.response_ids]
    return {"batch/samples": len(batch.response_ids),
            "reward/mean": float(batch.rewards.mean()), "reward/timeouts": batch.reward_timeouts,
            **{f"reward/{flag}": 0 for flag in flags},
            **{f"reward/{flag}": n for flag, n in batch.reward_flags.items()},
            "response/length_mean": sum(lengths) / len(lengths),
            "response/length_min": min(lengths), "response/length_max": max(lengths)}
