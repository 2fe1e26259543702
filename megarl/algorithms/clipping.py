"""Clip masks of the REC family (REC paper eq. 8, 18-21). All masks are 0/1 tensors in the ratio's
dtype, computed without gradient; `ratio` and `adv` broadcast (`[B, S]` ratio with `[B, 1]`
advantages for token masks, `[B]` with `[B]` for GSPO-style sequence masks). Boundaries are inclusive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClipParams:
    eps_low: float  # inner band: ratio >= 1 - eps_low
    eps_high: float  # inner band: ratio <= 1 + eps_high
    eps_low_outer: float = 1.0  # REC-Ring outer margin eps'_low: A>0 regains gradient when ratio <= 1 - eps'_low
    eps_high_outer: float = float("inf")  # REC-Ring outer margin eps'_high: A<0 regains it when ratio >= 1+eps'_high


def one_side_mask(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipParams) -> torch.Tensor:
    """REC eq. 8: `M = 1(A>0, ratio <= 1+eps_high) + 1(A<0, ratio >= 1-eps_low)` (A = 0 gives 0)."""
    ratio, adv = ratio.detach(), adv.detach()
    keep_pos = (adv > 0) & (ratio <= 1 + clip.eps_high)
    keep_neg = (adv < 0) & (ratio >= 1 - clip.eps_low)
    return (keep_pos | keep_neg).to(ratio.dtype)


def two_side_mask(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipParams) -> torch.Tensor:
    """REC eq. 18: `M = 1(1-eps_low <= ratio <= 1+eps_high)`, whatever the sign of A."""
    ratio = ratio.detach()
    inside = (ratio >= 1 - clip.eps_low) & (ratio <= 1 + clip.eps_high)
    return (inside & torch.ones_like(adv, dtype=torch.bool)).to(ratio.dtype)


def ring_mask(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipParams) -> torch.Tensor:
    """REC eq. 19-21: two-side band `+ 1(A>0, ratio <= 1-eps'_low) + 1(A<0, ratio >= 1+eps'_high)`
    (outer margins `eps'_low >= eps_low`, `eps'_high >= eps_high`, so the three sets are disjoint)."""
    ratio, adv = ratio.detach(), adv.detach()
    inside = (ratio >= 1 - clip.eps_low) & (ratio <= 1 + clip.eps_high)
    low_pos = (adv > 0) & (ratio <= 1 - clip.eps_low_outer)
    high_neg = (adv < 0) & (ratio >= 1 + clip.eps_high_outer)
    return (inside | low_pos | high_neg).to(ratio.dtype)


CLIP_MASKS = {"onesided": one_side_mask, "twosided": two_side_mask, "ring": ring_mask}
