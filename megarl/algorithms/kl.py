"""Per-token estimators of `KL(pi_theta || pi_ref)` from tokens sampled by the rollout policy
(Schulman, "Approximating KL divergence", 2020). With `logp = log pi_theta(y^t)` and
`ref = log pi_ref(y^t)`, all shapes `[B, S]`:

- k1 = `log(p/q)            = logp - ref`                 (unbiased, high variance, can be negative)
- k2 = `0.5 * log(p/q)^2    = 0.5 * (logp - ref)^2`       (biased, low variance, >= 0)
- k3 = `q/p - 1 - log(q/p)  = exp(ref - logp) - 1 - (ref - logp)`  (unbiased, low variance, >= 0)

Gradients flow through `logp` only (`ref` is data).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_k1(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k1 = `logp - ref`; d/dlogp = 1."""
    return logp - ref


def kl_k2(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k2 = `0.5 (logp - ref)^2`; d/dlogp = `logp - ref`."""
    return 0.5 * (logp - ref) ** 2


def kl_k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 = `exp(ref - logp) - 1 - (ref - logp)`; d/dlogp = `1 - exp(ref - logp)`."""
    log_q_over_p = ref - logp
    return torch.exp(log_q_over_p) - 1 - log_q_over_p


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate `[B, S]` with the named estimator."""
    try:
        return _ESTIMATORS[kind](logp, ref)
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose k1, k2 or k3") from None
