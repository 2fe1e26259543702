"""Sequence-level policy losses (pure functions) over per-token log-probs.

Shapes: `B` sequences of one microbatch, `S` token positions. All masks are computed without
gradient. Each loss returns `(loss, metrics)` where `loss` is this microbatch's *contribution to
the global-batch loss*: it is divided by the global number of sequences `num_seqs` (the
sequence-mean aggregation GSPO uses), so summing contributions over microbatches and data-parallel
ranks gives the same loss and gradients however the global batch is split. Metric values are
contributions too (summed by the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossInput:
    logprobs: torch.Tensor  # [B, S] trainer log-probs of the target tokens (differentiable)
    old_logprobs: torch.Tensor  # [B, S] behaviour log-probs of the same tokens
    mask: torch.Tensor  # [B, S] 1.0 on response tokens, 0.0 elsewhere
    advantages: torch.Tensor  # [B] one advantage per sequence
    num_seqs: int  # sequences in the GLOBAL batch (the sequence-mean normaliser)
    num_tokens: int = 0  # response tokens in the GLOBAL batch (the token-mean normaliser)


@dataclass(frozen=True)
class ClipParams:
    eps_low: float
    eps_high: float


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, S] -> [B]`: mean over each sequence's response tokens (`mean_t`)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def one_side_mask(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipParams) -> torch.Tensor:
    """REC eq. 8: `1(A>0, ratio <= 1+eps_high) + 1(A<0, ratio >= 1-eps_low)` (no gradient)."""
    ratio, adv = ratio.detach(), adv.detach()
    keep_pos = (adv > 0) & (ratio <= 1 + clip.eps_high)
    keep_neg = (adv < 0) & (ratio >= 1 - clip.eps_low)
    return (keep_pos | keep_neg).to(ratio.dtype)


def _sequence_ratio(inp: PolicyLossInput) -> torch.Tensor:
    """GSPO's sequence importance ratio `s_i = exp(mean_t (logp_i^t - oldlogp_i^t))`, shape [B]."""
    return torch.exp(sequence_mean(inp.logprobs - inp.old_logprobs, inp.mask))


def _clip_metrics(seq_mask: torch.Tensor, ratio: torch.Tensor, inp: PolicyLossInput) -> dict[str, torch.Tensor]:
    n = float(inp.num_seqs)
    return {
        "clip_frac": ((inp.advantages != 0).to(ratio.dtype) * (1 - seq_mask)).sum().detach() / n,
        "seq_ratio_mean": ratio.detach().sum() / n,
    }


def rec_gspo_is_loss(inp: PolicyLossInput, clip: ClipParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-GSPO-IS: `L = -(1/N) sum_i A_i * s_i * M_i`, `s_i = exp(mean_t(logp - oldlogp))`, `M_i` the
    one-side mask on `s_i` (REC appendix B.7; GSPO without std-normalised advantages).
    Gradient: `-(1/N) sum_i A_i s_i M_i mean_t grad logp_i^t`."""
    ratio = _sequence_ratio(inp)
    seq_mask = one_side_mask(ratio, inp.advantages, clip)
    loss = -(inp.advantages * ratio * seq_mask).sum() / inp.num_seqs
    return loss, _clip_metrics(seq_mask, ratio, inp)


def rec_gspo_nois_loss(inp: PolicyLossInput, clip: ClipParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-GSPO-NOIS: `L = -(1/N) sum_i A_i * M_i * mean_t logp_i^t`, `M_i` one-side on `s_i` as in
    REC-GSPO-IS but without the importance weight (REC appendix B.7).
    Gradient: `-(1/N) sum_i A_i M_i mean_t grad logp_i^t`."""
    ratio = _sequence_ratio(inp)
    seq_mask = one_side_mask(ratio, inp.advantages, clip)
    loss = -(inp.advantages * seq_mask * sequence_mean(inp.logprobs, inp.mask)).sum() / inp.num_seqs
    return loss, _clip_metrics(seq_mask, ratio, inp)


gspo_loss = rec_gspo_is_loss
"""GSPO (Zheng et al. 2025) is REC-GSPO-IS fed with std-normalised advantages; the registry pairs it so."""
