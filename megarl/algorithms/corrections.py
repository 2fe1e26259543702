"""Train-inference mismatch corrections (`algorithm.correction`): a per-token weight `w_i^t` (no gradient) that any
registered loss except OAPL multiplies into the gradient of each response token (`PolicyLossInput.token_weight`).

The quantity they act on is the per-token log-ratio between the trainer and the rollout engine for the sampled
tokens, at the trainer's weights of THIS step, before its update:

    log rho_i^t = logp_trainer_i^t - logp_engine_i^t,   rho_i^t = pi_trainer(y_i^t) / pi_engine(y_i^t)

`logp_trainer` is `logprobs.detach()` of the training forward: megarl takes one optimizer step per consumed batch,
so the training forward runs at the pre-update weights and equals the trainer's "old" recompute (the `pi_old` /
`pi_fsdp(theta_old)` of the sources below) without a second forward. `old_logprobs` is NOT used: with the default
`algorithm.old_logprobs=engine` it IS the engine's log-prob, so `old - engine = 0` and every correction would be a
no-op; with `old_logprobs=trainer` it is the same quantity as `logprobs.detach()` (the same weights). The trainer
never holds the lagged behaviour weights, so at lag > 0 `rho` measures both the numerics (kernels, precision) and
the policy lag between the engine's behaviour weights and the trainer's current ones: exactly the distribution shift
the sampled tokens must be corrected for to estimate the gradient at the current weights (verl's "decoupled" mode:
trainer recompute over rollout log-probs). The mismatch monitor (`megarl/metrics/mismatch.py`) reports the same
`rho` (its `r`).

| kind | weight `w_i^t` | source |
|---|---|---|
| `tis_token` | `min(rho_i^t, C)` | [TIS] |
| `tis_seq` | `min(prod_t rho_i^t, C)` on each token of sequence i | [MIS] sequence IS; verl `rollout_is=sequence` |
| `mis_token` | `1(lower <= rho_i^t <= upper)` | [MIS] masked IS / rejection; verl `rollout_rs=token` |
| `mis_seq` | `1(lower <= prod_t rho_i^t <= upper)` on every token of sequence i | [MIS]; verl `rollout_rs=sequence` |
| `icepop` | `rho_i^t * 1(alpha <= rho_i^t <= beta)`, `alpha, beta = lower, upper` | [IcePop] `M(k)` |

[TIS] Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (blog).
[MIS] Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the training-inference
mismatch" (blog; verl's "rollout correction": IS weights `rollout_is`, rejection `rollout_rs`).
[IcePop] Ling team 2025, Ring-1T technical report "Every step evolves" (IcePop: `M(k) = k` inside `[alpha, beta]`).

The sequence ratio is the plain product `prod_t rho_i^t = exp(sum_t log rho_i^t)` (the geometric-mean variant
`exp(mean_t log rho)` is not offered). Band boundaries are inclusive, like the clip masks. Every function returns the
weight `[B, S]` (0 on padding) and its metrics as contributions to global-batch means over the `T` response tokens
(sums divided by the GLOBAL `num_tokens`), so summing them over microbatches and data-parallel ranks gives the batch's:
`correction/weight_mean` (`sum w / T`), `correction/truncated_frac` (share of tokens whose weight was capped at C: TIS)
and `correction/masked_frac` (share of tokens given weight 0: MIS, IcePop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.algorithms.aggregation import sequence_sum
from megarl.config.schema import CorrectionConfig

PREFIX = "correction/"
KEYS = (PREFIX + "weight_mean", PREFIX + "truncated_frac", PREFIX + "masked_frac")
CorrectionOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _metrics(weight: torch.Tensor, truncated: torch.Tensor, masked: torch.Tensor, mask: torch.Tensor,
             num_tokens: float) -> dict[str, torch.Tensor]:
    """Contributions of this microbatch's response tokens to the global-batch means (module table)."""
    if num_tokens <= 0:
        raise ValueError("correction metrics need the global response-token count num_tokens > 0")
    keep = mask.to(weight.dtype)
    return {
        PREFIX + "weight_mean": (weight * keep).sum() / num_tokens,
        PREFIX + "truncated_frac": (truncated.to(weight.dtype) * keep).sum() / num_tokens,
        PREFIX + "masked_frac": (masked.to(weight.dtype) * keep).sum() / num_tokens,
    }


def _per_token(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B]` -> `[B, S]`: the sequence's value on each of its response tokens, 0 on padding."""
    return seq_values[:, None] * mask


def _inside(rho: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    return (rho >= lower) & (rho <= upper)


def tis_token(log_rho: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, num_tokens: float) -> CorrectionOutput:
    """Token-level truncated IS (Yao et al. 2025, TIS): `w_i^t = min(rho_i^t, C)`, `C = cfg.cap`; a token is
    truncated when `rho_i^t > C`."""
    log_rho, mask = log_rho.detach(), mask.detach()
    rho = torch.exp(log_rho)
    weight = rho.clamp(max=cfg.cap) * mask
    return weight, _metrics(weight, rho > cfg.cap, torch.zeros_like(mask, dtype=torch.bool), mask, num_tokens)


def tis_seq(log_rho: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, num_tokens: float) -> CorrectionOutput:
    """Sequence-level truncated IS (Liu, Li et al. 2025; verl `rollout_is=sequence`): `w_i = min(prod_t rho_i^t, C)`
    on every response token of sequence i; all its tokens count as truncated when `prod_t rho_i^t > C`."""
    log_rho, mask = log_rho.detach(), mask.detach()
    seq_rho = torch.exp(sequence_sum(log_rho, mask))  # inf on overflow: min(inf, C) = C
    weight = _per_token(seq_rho.clamp(max=cfg.cap), mask)
    truncated = _per_token((seq_rho > cfg.cap).to(mask.dtype), mask).bool()
    return weight, _metrics(weight, truncated, torch.zeros_like(truncated), mask, num_tokens)


def mis_token(log_rho: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, num_tokens: float) -> CorrectionOutput:
    """Token-level masked IS / rejection (Liu, Li et al. 2025; verl `rollout_rs=token`):
    `w_i^t = 1(lower <= rho_i^t <= upper)`: tokens outside the band are dropped, the others keep weight 1."""
    log_rho, mask = log_rho.detach(), mask.detach()
    keep = _inside(torch.exp(log_rho), cfg.lower, cfg.upper)
    weight = keep.to(mask.dtype) * mask
    return weight, _metrics(weight, torch.zeros_like(keep), ~keep, mask, num_tokens)


def mis_seq(log_rho: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, num_tokens: float) -> CorrectionOutput:
    """Sequence-level masked IS / rejection (Liu, Li et al. 2025; verl `rollout_rs=sequence`):
    `w_i = 1(lower <= prod_t rho_i^t <= upper)` on every response token of sequence i."""
    log_rho, mask = log_rho.detach(), mask.detach()
    keep = _inside(torch.exp(sequence_sum(log_rho, mask)), cfg.lower, cfg.upper)
    weight = _per_token(keep.to(mask.dtype), mask)
    masked = _per_token((~keep).to(mask.dtype), mask).bool()
    return weight, _metrics(weight, torch.zeros_like(masked), masked, mask, num_tokens)


def icepop(log_rho: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig, num_tokens: float) -> CorrectionOutput:
    """IcePop (Ling team 2025, Ring-1T technical report, "Every step evolves"): the token's calibration
    `M(k) = k if alpha <= k <= beta else 0` with `k = rho_i^t`, `alpha, beta = cfg.lower, cfg.upper`:
    `w_i^t = rho_i^t * 1(alpha <= rho_i^t <= beta)`; tokens outside the band get no gradient at all."""
    log_rho, mask = log_rho.detach(), mask.detach()
    rho = torch.exp(log_rho)
    keep = _inside(rho, cfg.lower, cfg.upper)
    weight = torch.where(keep, rho, torch.zeros_like(rho)) * mask
    return weight, _metrics(weight, torch.zeros_like(keep), ~keep, mask, num_tokens)


CorrectionFn = Callable[[torch.Tensor, torch.Tensor, CorrectionConfig, float], CorrectionOutput]
CORRECTIONS: dict[str, CorrectionFn] = {
    "tis_token": tis_token, "tis_seq": tis_seq, "mis_token": mis_token, "mis_seq": mis_seq, "icepop": icepop,
}


def correction_weights(cfg: CorrectionConfig, logp_trainer: torch.Tensor, logp_engine: torch.Tensor,
                       mask: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The `[B, S]` token weight of `cfg.kind` for one microbatch and its metric contributions, from the trainer's
    (pre-update) and the engine's log-probs of the sampled tokens; `(None, {})` for `kind=none` (no reweighting)."""
    if cfg.kind == "none":
        return None, {}
    log_rho = (logp_trainer.detach() - logp_engine.detach()) * mask
    return CORRECTIONS[cfg.kind](log_rho, mask, cfg, num_tokens)
