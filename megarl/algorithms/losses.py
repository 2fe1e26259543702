"""Policy losses (pure functions) over per-token log-probs; each is minimised, so its gradient is the
negative of the paper's update direction `g`.

Shapes: `B` sequences (whole response rows) of one microbatch, `S` token positions. All masks are
computed without gradient. Each loss returns `(loss, metrics)` where `loss` is this microbatch's
*contribution to the global-batch loss*: it is divided by a GLOBAL count (`num_seqs` = N sequences, or
`num_tokens` = T response tokens, or `N * C`), so summing contributions over microbatches and
data-parallel ranks gives the same loss and gradients however the global batch is split. Metric values
are contributions too (the trainer sums them).

Train-inference corrections (`corrections.py`, `PolicyLossInput.token_weight` = `w_i^t`, no gradient) enter every
loss but OAPL's so that the gradient reaching `logp_i^t` is multiplied by `w_i^t`: token-level losses multiply their
per-token term `l_i^t` by `w_i^t` before aggregating (value and gradient weighted); sequence-level losses read the
log-probs through `PolicyLossInput.weighted_logprobs()` (value unchanged, gradient `w_i^t dlogp_i^t`), so their masks
and ratios keep their definitions and their reported loss value is the unweighted one. OAPL refuses a weight.

The decoupled objective for mixed-version responses (`decoupled.py`, `algorithm.decoupled`) reaches every loss but
OAPL's and OPMD's through its input, applied by the registry: `old_logprobs` becomes the proximal policy
(`prox_logprobs`; None: `logprobs.detach()`) and `token_weight` the capped behaviour weight `pi_prox / pi_engine`.

Two kinds of loss:
- token-level losses (REINFORCE and the advantage-reweighted variants, GRPO, REC-*, off-policy GRPO, OPMD-token)
  build a per-token loss `l_i^t` and reduce it with `aggregation.aggregate_tokens` (`algorithm.loss_agg`);
- sequence-level losses (REC-GSPO-*, GSPO, OPMD-sequence, OAPL) are defined per whole response (`s_i`, `M_i`,
  `mean_t`, sequence log-prob `logp_i = sum_t logp_i^t`) and are averaged over sequences: `/ N`.

References: REC = "Group-relative REINFORCE is secretly an off-policy algorithm" (Table 3, appendix
B.3, B.6, B.7); GSPO = Zheng et al. 2025; OAPL = "Optimal-advantage policy optimisation with lagged
inference" (with A*-PO, Brantley et al. 2025); off-policy GRPO = Mroueh et al., "Revisiting GRPO: on-
and off-policy" (eq. 6-8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algorithms.aggregation import Aggregation, aggregate_tokens, sequence_mean, sequence_sum
from megarl.algorithms.clipping import ClipParams, one_side_mask
from megarl.algorithms.kl import KLEstimator, kl_estimate

__all__ = [
    "ClipParams",
    "LossOutput",
    "PolicyLossInput",
    "asymre_loss",
    "grpo_loss",
    "gspo_loss",
    "oapl_loss",
    "off_policy_grpo_loss",
    "one_side_mask",
    "opmd_sequence_loss",
    "opmd_token_loss",
    "rec_gspo_is_loss",
    "rec_gspo_nois_loss",
    "rec_loss",
    "reinforce_loss",
    "sequence_mean",
]

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]
MaskFn = Callable[[torch.Tensor, torch.Tensor, ClipParams], torch.Tensor]


@dataclass
class PolicyLossInput:
    logprobs: torch.Tensor  # [B, S] trainer log-probs of the target tokens (differentiable, already * mask)
    old_logprobs: torch.Tensor  # [B, S] behaviour log-probs of the same tokens (engine's, or the trainer recompute)
    mask: torch.Tensor  # [B, S] 1.0 on response tokens, 0.0 elsewhere
    advantages: torch.Tensor  # [B] one advantage per sequence
    num_seqs: int  # sequences in the GLOBAL batch (the sequence-mean normaliser N)
    num_tokens: int = 0  # response tokens in the GLOBAL batch (the token-mean normaliser T)
    engine_logprobs: torch.Tensor | None = None  # [B, S] rollout engine's log-probs (OAPL's pi_vllm); None: old
    ref_logprobs: torch.Tensor | None = None  # [B, S] KL reference pi_ref (off-policy GRPO); None: old_logprobs
    seq_mask: torch.Tensor | None = None  # [B] per-sequence 0/1 weight from `Algorithm.sequence_mask`; None: 1
    token_weight: torch.Tensor | None = None  # [B, S] train-inference correction (corrections.py, no grad); None: 1
    # [B, S] proximal policy of the decoupled objective (decoupled.py); None: logprobs.detach(), the trainer's
    # log-probs at its current (pre-update) weights
    prox_logprobs: torch.Tensor | None = None

    def engine(self) -> torch.Tensor:
        return self.old_logprobs if self.engine_logprobs is None else self.engine_logprobs

    def reference(self) -> torch.Tensor:
        return self.old_logprobs if self.ref_logprobs is None else self.ref_logprobs

    def weigh(self, per_token: torch.Tensor) -> torch.Tensor:
        """`per_token * token_weight` (the same tensor when there is no correction: bitwise unchanged)."""
        return per_token if self.token_weight is None else per_token * self.token_weight.detach()

    def weighted_logprobs(self) -> torch.Tensor:
        """`[B, S]` log-probs whose value is exactly `logprobs` and whose gradient is `token_weight * dlogp`:
        `sg(logp) + w (logp - sg(logp))`; sequence-level losses built on them scale each token's gradient by `w`."""
        if self.token_weight is None:
            return self.logprobs
        frozen = self.logprobs.detach()
        return frozen + self.token_weight.detach() * (self.logprobs - frozen)  # value: exactly logprobs

    def kept(self) -> torch.Tensor:
        """`[B]` per-sequence weight (1.0 when no sequence mask was given)."""
        if self.seq_mask is None:
            return torch.ones_like(self.advantages)
        return self.seq_mask.to(self.advantages.dtype)


def _token_ratio(inp: PolicyLossInput) -> torch.Tensor:
    """`ratio_i^t = exp(logp_i^t - oldlogp_i^t)`, `[B, S]` (1 on padding, where both are 0)."""
    return torch.exp(inp.logprobs - inp.old_logprobs)


def _token_mean_metric(values: torch.Tensor, inp: PolicyLossInput) -> torch.Tensor:
    """Contribution of `[B, S]` values to their mean over the global batch's response tokens (no gradient)."""
    if inp.num_tokens <= 0:
        raise ValueError("token-level metrics need PolicyLossInput.num_tokens (global response tokens) > 0")
    return (values.detach() * inp.mask).sum() / inp.num_tokens


def _token_clip_metrics(m: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, inp: PolicyLossInput):
    active = (adv != 0).to(ratio.dtype).expand_as(ratio)  # tokens of sequences that carry a gradient at all
    return {"clip_frac": _token_mean_metric(active * (1 - m), inp), "ratio_mean": _token_mean_metric(ratio, inp)}


# ---------------------------------------------------------------- token-level losses


def reinforce_loss(inp: PolicyLossInput, agg: Aggregation) -> LossOutput:
    """Group-relative REINFORCE (REC eq. 1b): `l_i^t = -A_i * logp_i^t`, reduced by `agg`.
    Gradient per token: `-A_i * c_i`, with `c_i` the aggregation weight (`1/T`, `1/(N |y_i|)`, `1/N`, `1/(N C)`).
    With group-mean advantages this is vanilla REINFORCE; with AsymRE, RED-Drop, RED-Weight or pairwise
    advantages it is that algorithm (their difference lives in `advantages.py`)."""
    adv = (inp.advantages * inp.kept())[:, None]
    return aggregate_tokens(inp.weigh(-adv * inp.logprobs), inp.mask, agg, inp.num_seqs, inp.num_tokens), {}


def asymre_loss(inp: PolicyLossInput, agg: Aggregation) -> LossOutput:
    """AsymRE (REC section 4.2, Table 3): `-(r_i - (rbar - beta)) * logp_i` = REINFORCE with the shifted
    baseline of `advantages.asymre_advantages`; the same per-token loss as `reinforce_loss`."""
    return reinforce_loss(inp, agg)


def rec_loss(
    inp: PolicyLossInput, clip: ClipParams, mask_fn: MaskFn, importance_sampling: bool, agg: Aggregation
) -> LossOutput:
    """REC-{OneSide,TwoSide,Ring}-{IS,NOIS} (REC section 4.1, appendix B.3):
    IS: `l_i^t = -A_i * ratio_i^t * M_i^t` (gradient `-A_i ratio_i^t M_i^t` per token, times the aggregation weight);
    NOIS: `l_i^t = -A_i * M_i^t * logp_i^t` (gradient `-A_i M_i^t`). `M` is `mask_fn` (one-side eq. 8, two-side
    eq. 18 or ring eq. 19-21) on the token ratio `exp(logp - oldlogp)`."""
    ratio = _token_ratio(inp)
    adv = inp.advantages[:, None]
    m = mask_fn(ratio, adv, clip)
    weight = (adv * inp.kept()[:, None]) * m
    per_token = inp.weigh(-weight * (ratio if importance_sampling else inp.logprobs))
    return aggregate_tokens(per_token, inp.mask, agg, inp.num_seqs, inp.num_tokens), _token_clip_metrics(
        m, ratio, adv, inp
    )


def _grpo_surrogate(
    inp: PolicyLossInput, clip: ClipParams, dual_clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate `min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A)` `[B, S]`, written as
    `ratio A` where the one-side mask `M` keeps the gradient and the (constant) clipped value elsewhere:
    the same value as the `min`, and exactly the gradient `A ratio M` of REC Table 3 (boundaries inclusive).
    Dual-clip PPO (Ye et al. 2020; verl's and Trinity-RFT's `clip_ratio_c`), when `dual_clip = c` is given: for
    `A < 0` the objective is `max(min(ratio A, clip(ratio) A), c A)`, i.e. the constant `c A` (no gradient) where
    `ratio > c` (boundary inclusive: `ratio = c` keeps its gradient); `A >= 0` is unchanged. Returns the surrogate
    and the metric contributions (`clip_frac`, `ratio_mean`, and `dual_clip_frac` when the dual clip is on)."""
    ratio = _token_ratio(inp)
    adv = inp.advantages[:, None]
    m = one_side_mask(ratio, adv, clip)
    clipped = torch.clamp(ratio.detach(), 1 - clip.eps_low, 1 + clip.eps_high) * adv
    surrogate = torch.where(m.bool(), ratio * adv, clipped)
    metrics = _token_clip_metrics(m, ratio, adv, inp)
    if dual_clip is not None:
        lower = (adv < 0) & (ratio.detach() > dual_clip)  # where max(., c A) = c A
        surrogate = torch.where(lower, dual_clip * adv, surrogate)
        metrics["dual_clip_frac"] = _token_mean_metric(lower.to(ratio.dtype), inp)
    return surrogate, metrics


def grpo_loss(inp: PolicyLossInput, clip: ClipParams, agg: Aggregation, dual_clip: float | None = None) -> LossOutput:
    """GRPO (Shao et al. 2024; REC section 4.1): `l_i^t = -min(ratio A_i, clip(ratio, 1-eps_low, 1+eps_high) A_i)`
    with std-normalised advantages and no KL term (as REC runs it). Gradient per token: `-A_i ratio_i^t M_i^t`.
    `dual_clip = c` (off by default: neither GRPO nor REC uses it): for `A_i < 0`,
    `l_i^t = -max(min(ratio A_i, clip(ratio) A_i), c A_i)`, no gradient where `ratio > c`."""
    surrogate, metrics = _grpo_surrogate(inp, clip, dual_clip)
    per_token = inp.weigh(-surrogate * inp.kept()[:, None])
    return aggregate_tokens(per_token, inp.mask, agg, inp.num_seqs, inp.num_tokens), metrics


def off_policy_grpo_loss(
    inp: PolicyLossInput,
    clip: ClipParams,
    beta: float,
    estimator: KLEstimator,
    agg: Aggregation,
    dual_clip: float | None = None,
) -> LossOutput:
    """Off-policy GRPO (Mroueh et al., eq. 6-8) with `pi_k / alpha ~ 1` (their practical choice):
    `l_i^t = z_i * ( -min(ratio A_i, clip(ratio) A_i) + beta * KL_hat(logp_i^t, ref_i^t) )`, ratio against the
    lagged server policy `alpha` (`old_logprobs`), `A_i` from `advantages.off_policy_grpo_advantages`, `z_i` the
    zero-variance mask (`seq_mask`) and `KL_hat` the k1/k2/k3 estimator against `ref_logprobs` (default: the
    behaviour policy, i.e. a reference swapped at every weight sync). Gradient per token:
    `z_i (-A_i ratio M + beta dKL_hat/dlogp)` (k1: 1, k2: `logp - ref`, k3: `1 - exp(ref - logp)`).
    `dual_clip = c` as in `grpo_loss` (off by default: the paper does not use it)."""
    surrogate, metrics = _grpo_surrogate(inp, clip, dual_clip)
    kl = kl_estimate(inp.logprobs, inp.reference(), estimator)
    per_token = inp.weigh((-surrogate + beta * kl) * inp.kept()[:, None])
    metrics["kl"] = _token_mean_metric(kl, inp)
    return aggregate_tokens(per_token, inp.mask, agg, inp.num_seqs, inp.num_tokens), metrics


# ---------------------------------------------------------------- sequence-level losses (/ N)


def _sequence_ratio(inp: PolicyLossInput) -> torch.Tensor:
    """GSPO's sequence importance ratio `s_i = exp(mean_t (logp_i^t - oldlogp_i^t))`, shape [B] (under a correction
    the gradient reaching token t is scaled by `token_weight_i^t`, the value is unchanged: `weighted_logprobs`)."""
    return torch.exp(sequence_mean(inp.weighted_logprobs() - inp.old_logprobs, inp.mask))


def _seq_clip_metrics(seq_mask: torch.Tensor, ratio: torch.Tensor, inp: PolicyLossInput) -> dict[str, torch.Tensor]:
    n = float(inp.num_seqs)
    return {
        "clip_frac": ((inp.advantages != 0).to(ratio.dtype) * (1 - seq_mask)).sum().detach() / n,
        "seq_ratio_mean": ratio.detach().sum() / n,
    }


def rec_gspo_is_loss(inp: PolicyLossInput, clip: ClipParams) -> LossOutput:
    """REC-GSPO-IS: `L = -(1/N) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)`,
    `s_i = exp(mean_t(logp - oldlogp))` (REC appendix B.7; GSPO without std-normalised advantages). Written as
    `s_i A_i` where the one-side mask `M_i` on `s_i` keeps the gradient and the constant `clip(s_i) A_i` elsewhere:
    the value is GSPO's objective (comparable with GSPO's and verl's logged loss; a clipped sequence adds
    `-clip(s_i) A_i`, not 0), the gradient `-(1/N) A_i s_i M_i / |y_i|` on each response token of sequence i."""
    ratio = _sequence_ratio(inp)
    seq_mask = one_side_mask(ratio, inp.advantages, clip)
    clipped = torch.clamp(ratio.detach(), 1 - clip.eps_low, 1 + clip.eps_high) * inp.advantages
    objective = torch.where(seq_mask.bool(), ratio * inp.advantages, clipped)
    loss = -(objective * inp.kept()).sum() / inp.num_seqs
    return loss, _seq_clip_metrics(seq_mask, ratio, inp)


def rec_gspo_nois_loss(inp: PolicyLossInput, clip: ClipParams) -> LossOutput:
    """REC-GSPO-NOIS: `L = -(1/N) sum_i A_i * M_i * mean_t logp_i^t`, `M_i` one-side on `s_i` as in
    REC-GSPO-IS but without the importance weight (REC appendix B.7).
    Gradient: `-(1/N) A_i M_i / |y_i|` on each response token of sequence i."""
    ratio = _sequence_ratio(inp)
    seq_mask = one_side_mask(ratio, inp.advantages, clip)
    mean_logp = sequence_mean(inp.weighted_logprobs(), inp.mask)
    loss = -(inp.advantages * seq_mask * inp.kept() * mean_logp).sum() / inp.num_seqs
    return loss, _seq_clip_metrics(seq_mask, ratio, inp)


def gspo_loss(inp: PolicyLossInput, clip: ClipParams) -> LossOutput:
    """GSPO (Zheng et al. 2025) is REC-GSPO-IS fed with std-normalised advantages (the registry pairs them):
    `L = -(1/N) sum_i min(s_i A_i, clip(s_i) A_i)`, gradient `-(1/N) A_i s_i M_i / |y_i|` per response token."""
    return rec_gspo_is_loss(inp, clip)


def opmd_sequence_loss(inp: PolicyLossInput, beta: float) -> LossOutput:
    """Kimi's OPMD as the REC paper writes it (section 4.2, Table 3), per sequence with `logp_i = sum_t logp_i^t`:
    `L = (1/N) sum_i [ -A_i logp_i + beta/2 (logp_i - oldlogp_i)^2 ]`, `A_i = r_i - rbar`.
    Gradient on each response token of i: `(1/N) (-A_i + beta (logp_i - oldlogp_i))`. The regulariser grows with
    the square of the response length, so REC's beta (Fig. 10, run with `opmd_token_loss`) does not carry over."""
    logp, old = sequence_sum(inp.weighted_logprobs(), inp.mask), sequence_sum(inp.old_logprobs, inp.mask)
    kept = inp.kept()
    delta = logp - old
    loss = ((-inp.advantages * logp + 0.5 * beta * delta**2) * kept).sum() / inp.num_seqs
    return loss, {"opmd/sq_logratio": (delta.detach() ** 2 * kept).sum() / inp.num_seqs}


def opmd_token_loss(inp: PolicyLossInput, beta: float, agg: Aggregation) -> LossOutput:
    """Kimi's OPMD as the REC authors' code runs it (Trinity-RFT's REC loss with its `k2` regulariser; the runs of
    REC Fig. 10), per token: `l_i^t = -A_i logp_i^t + beta (logp_i^t - oldlogp_i^t)^2` (the 1/2 of the sequence
    form is absorbed into beta), reduced by `agg` (token-mean in their code). Gradient per token:
    `-A_i + 2 beta (logp_i^t - oldlogp_i^t)`, times the aggregation weight."""
    delta = inp.logprobs - inp.old_logprobs
    per_token = inp.weigh((-inp.advantages[:, None] * inp.logprobs + beta * delta**2) * inp.kept()[:, None])
    metrics = {"opmd/sq_token_logratio": _token_mean_metric(delta**2 * inp.kept()[:, None], inp)}
    return aggregate_tokens(per_token, inp.mask, agg, inp.num_seqs, inp.num_tokens), metrics


def oapl_loss(inp: PolicyLossInput, beta2: float) -> LossOutput:
    """OAPL (lagged-inference optimal-advantage regression): per sequence, with `logp_i = sum_t logp_i^t`,
    `vllm_i = sum_t` of the rollout engine's log-probs and `A_i = r_i - V_hat(x)` (`advantages.oapl_advantages`),
    `L = (1/N) sum_i ( beta2 (logp_i - vllm_i) - A_i )^2` (the paper sums over x and i; `1/N` is a constant).
    No importance weight, no clipping. Gradient on each response token of i:
    `(2 beta2 / N) (beta2 (logp_i - vllm_i) - A_i)`."""
    if inp.token_weight is not None:
        raise ValueError("OAPL must not be reweighted: PolicyLossInput.token_weight must be None "
                         "(set algorithm.correction.kind=none)")
    logratio = sequence_sum(inp.logprobs, inp.mask) - sequence_sum(inp.engine(), inp.mask)
    residual = beta2 * logratio - inp.advantages
    kept = inp.kept()
    loss = (residual**2 * kept).sum() / inp.num_seqs
    return loss, {"oapl/logratio_mean": (logratio.detach() * kept).sum() / inp.num_seqs}
