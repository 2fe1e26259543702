"""Group filters: which responses of a group take part in training. Inputs are rewards `[G, K]`;
outputs are boolean keep masks, without gradient. Filters are kept apart from advantages and losses:
an advantage estimator may consume a keep mask (RED-Drop), and `PolicyLossInput.seq_mask` carries a
per-sequence mask into a loss (zero-variance masking of off-policy GRPO's KL term).
"""

from __future__ import annotations

import torch


def nonzero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """`[G, K] -> [G]` bool: True where the group's rewards are not all equal (`sigma != 0`).
    Off-policy GRPO eq. 8 / DAPO mask out the others (`1(sigma_r(x) != 0)`)."""
    return (rewards != rewards[..., :1]).any(dim=-1)


def red_drop_keep_mask(rewards: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """RED-Drop (REC section 4.3 and appendix B.6): in each group with more negatives (`r_i < rbar`)
    than positives (`r_i >= rbar`: a reward exactly at the mean counts as a positive, as in the REC authors' code,
    Trinity-RFT's `drop="balance"`), keep all positives and a uniformly random subset of `#positives` negatives,
    drawn with `generator` (seeded by the caller, so the drop is reproducible). Returns the keep mask `S` as bool
    `[G, K]`; groups with no excess keep everyone."""
    rbar = rewards.mean(dim=-1, keepdim=True)
    negative, positive = rewards < rbar, rewards >= rbar
    keep = torch.ones_like(rewards, dtype=torch.bool)
    for g in range(rewards.shape[0]):
        neg_idx = negative[g].nonzero().flatten()
        excess = len(neg_idx) - int(positive[g].sum())
        if excess > 0:
            drop = neg_idx[torch.randperm(len(neg_idx), generator=generator)[:excess]]
            keep[g, drop] = False
    return keep
