"""Group-relative advantages. Rewards come as `[G, K]` (G groups of K responses to one prompt);
advantages are returned in the same shape, without gradient.
"""

from __future__ import annotations

import torch


def group_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REC / REINFORCE: `A_i = r_i - mean_j r_j` within each group."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def group_normalized_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO / GSPO: `A_i = (r_i - mean_j r_j) / (std_j r_j + eps)` (population std, as the papers)."""
    centred = group_mean_advantages(rewards)
    return centred / (rewards.std(dim=-1, unbiased=False, keepdim=True) + eps)
