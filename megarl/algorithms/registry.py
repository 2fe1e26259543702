"""Algorithms by name: each pairs an advantage estimator with a policy loss.

The trainer never dispatches on names: `get_algorithm(cfg.name)` returns an `Algorithm` whose two
functions it calls. Add an algorithm by registering it here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algorithms import advantages as adv
from megarl.algorithms import losses
from megarl.config.schema import AlgorithmConfig

AdvantageFn = Callable[[torch.Tensor, AlgorithmConfig], torch.Tensor]
LossFn = Callable[[losses.PolicyLossInput, AlgorithmConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    advantages: AdvantageFn  # rewards [G, K] -> advantages [G, K]
    loss: LossFn


def _clip(cfg: AlgorithmConfig) -> losses.ClipParams:
    return losses.ClipParams(eps_low=cfg.eps_low, eps_high=cfg.eps_high)


def _mean_adv(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    return adv.group_mean_advantages(rewards)


def _norm_adv(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    return adv.group_normalized_advantages(rewards, eps=cfg.adv_eps)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "rec_gspo_nois",
            "REC-GSPO-NOIS: group-mean advantages, one-side sequence clip mask, no importance weight",
            _mean_adv,
            lambda inp, cfg: losses.rec_gspo_nois_loss(inp, _clip(cfg)),
        ),
        Algorithm(
            "rec_gspo_is",
            "REC-GSPO-IS: group-mean advantages, sequence importance weight with one-side clip mask",
            _mean_adv,
            lambda inp, cfg: losses.rec_gspo_is_loss(inp, _clip(cfg)),
        ),
        Algorithm(
            "gspo",
            "GSPO: std-normalised group advantages, sequence importance weight with one-side clip mask",
            _norm_adv,
            lambda inp, cfg: losses.gspo_loss(inp, _clip(cfg)),
        ),
    )
}


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        known = ", ".join(sorted(ALGORITHMS))
        raise KeyError(f"algorithm.name={name!r} is not registered; choose one of: {known}") from None
