"""The decoupled objective (AReaL's decoupled PPO, Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement
learning system for language reasoning", section 5.2) over the registered losses: `algorithm.decoupled`.

With in-flight weight updates one response holds tokens sampled by several policy versions. Three policies per
response token `t` of response `i`:

- behaviour `mu`: the version that sampled the token; `log mu_i^t` is the engine's log-prob of it
  (`PolicyLossInput.engine_logprobs`, recorded per token, whatever version);
- proximal `pi_prox`: the trainer at its current weights before the update (`PolicyLossInput.prox_logprobs`; None:
  `logprobs.detach()`, the training forward's own values: megarl takes one optimizer step per batch, so that forward
  runs at the pre-update weights, the `pi_trainer` of `corrections.py`);
- `pi_theta`: the trainer being optimised (`logprobs`, differentiable).

Token-level (AReaL's eq.; the PPO/GRPO/REC losses):

    J = E_mu[ w_i^t * min(r_i^t A_i, clip(r_i^t, 1-eps_low, 1+eps_high) A_i) ],   r_i^t = pi_theta / pi_prox,
    w_i^t = min(pi_prox / mu, C)            (cap_mode truncate, default)
    w_i^t = pi_prox / mu if <= C, else 0    (cap_mode mask: AReaL's `behav_imp_weight_cap` filters such tokens)

The trust region (clip) is around ONE policy, the proximal one, whatever versions sampled the tokens; the behaviour
weight, without gradient, moves each token's sample from its own version `mu` to `pi_prox`. `decoupled_input`
builds it from any registered loss's input: `old_logprobs := pi_prox` (every ratio and clip mask is then against
the proximal policy) and `token_weight := w` (the loss's existing rule: token-level losses multiply `l_i^t` by `w`,
sequence-level ones scale token t's gradient by `w_i^t` through `weighted_logprobs`). The KL reference
(`ref_logprobs`, off-policy GRPO) and OAPL's `engine_logprobs` keep what they were without the switch.

Sequence-level (REC-GSPO-IS/NOIS, GSPO): `s_i = exp(mean_t(logp_i^t - logp_prox_i^t))`, the geometric-mean ratio
against the proximal policy, clipped (one-side `M_i`) as GSPO does; the behaviour correction is PER TOKEN: the
gradient reaching `logp_i^t` is `-(1/N) A_i s_i M_i w_i^t / |y_i|` (IS; NOIS without `s_i`). Why per token:
(1) at the proximal point (`s_i = 1`, megarl's one step per batch) GSPO's gradient is the sequence-mean of token
gradients, and the per-token weight makes it exactly the decoupled token-level gradient aggregated
`seq-mean-token-mean`: the sequence and token forms agree where they coincide without the switch; (2) the weight
sits where the shift is: a token sampled at lag 0 has `pi_prox = mu` (w = 1 up to numerics), a stale token its own
ratio; a per-sequence weight would smear one segment's shift over the whole response; (3) the exact sequence weight
`prod_t pi_prox / mu` is the product of up to thousands of ratios (GSPO's own argument for length-normalising `s_i`);
(4) AReaL's code (`importance_sampling_level=sequence` with `use_decoupled_loss`) multiplies the broadcast sequence
term by per-token weights before its token mean, i.e. a per-sequence weight `sum_t w_i^t` spread evenly over the
response's tokens: the same total weight per response as here, distributed by token instead of evenly.

In megarl the proximal policy is the trainer at the very weights the loss is evaluated at, so `r_i^t = 1` and
`s_i = 1` in value: the clip never binds on the one update per batch, and the objective is the capped-IS policy
gradient `-A_i w_i^t grad logp_i^t` (times the loss's own factors). The loss functions take any `prox_logprobs`
(tested with a proximal policy that differs from `pi_theta`, so the clip binds) and would need no change with several
updates per batch.

Metrics (contributions to global-batch means over the `T` response tokens): `decoupled/behav_weight_mean`
(`sum w / T`), `decoupled/capped_frac` (share of tokens whose `pi_prox / mu` exceeded `C`: truncated or masked).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from megarl.algorithms.losses import PolicyLossInput

PREFIX = "decoupled/"
KEYS = (PREFIX + "behav_weight_mean", PREFIX + "capped_frac")


@dataclass(frozen=True)
class DecoupledParams:
    cap: float  # C > 1
    cap_mode: Literal["truncate", "mask"] = "truncate"


def behaviour_weight(log_w: torch.Tensor, mask: torch.Tensor, params: DecoupledParams,
                     num_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`log_w = log pi_prox - log mu` `[B, S]` -> the behaviour weight `[B, S]` (0 on padding, no gradient) and its
    metric contributions (module docstring)."""
    if num_tokens <= 0:
        raise ValueError("decoupled metrics need the global response-token count num_tokens > 0")
    log_w, mask = log_w.detach(), mask.detach()
    raw = torch.exp(log_w)
    capped = raw > params.cap
    if params.cap_mode == "truncate":
        weight = raw.clamp(max=params.cap)
    elif params.cap_mode == "mask":
        weight = torch.where(capped, torch.zeros_like(raw), raw)
    else:
        raise ValueError(f"decoupled cap_mode={params.cap_mode!r}: use 'truncate' or 'mask'")
    weight = weight * mask
    keep = mask.to(weight.dtype)
    return weight, {PREFIX + "behav_weight_mean": weight.sum() / num_tokens,
                    PREFIX + "capped_frac": (capped.to(weight.dtype) * keep).sum() / num_tokens}


def decoupled_input(inp: PolicyLossInput, params: DecoupledParams) -> tuple[PolicyLossInput, dict[str, torch.Tensor]]:
    """The registered loss's input for the decoupled objective: ratios and clip masks against the proximal policy
    (`old_logprobs := pi_prox`), each token weighted by the behaviour weight (`token_weight := w`, times any weight
    already there), the KL reference and the engine's log-probs as they were. Returns it and the weight's metrics."""
    prox = inp.logprobs if inp.prox_logprobs is None else inp.prox_logprobs
    prox = prox.detach() * inp.mask
    behaviour = inp.engine()
    weight, metrics = behaviour_weight((prox - behaviour) * inp.mask, inp.mask, params, inp.num_tokens)
    if inp.token_weight is not None:
        weight = weight * inp.token_weight.detach()
    return dataclasses.replace(inp, old_logprobs=prox, engine_logprobs=behaviour, ref_logprobs=inp.reference(),
                               token_weight=weight, prox_logprobs=prox), metrics
