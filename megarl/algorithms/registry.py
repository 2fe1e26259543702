"""Algorithms by name: each pairs an advantage estimator (with any group filter) and a policy loss.

The trainer never dispatches on names: `get_algorithm(cfg.name)` returns an `Algorithm` whose functions
it calls:
- `advantages(rewards [G, K], cfg) -> [G, K]` on the controller, once per rollout batch;
- `sequence_mask(rewards [G, K], cfg) -> [G, K]` 0/1 per-sequence weights for `PolicyLossInput.seq_mask`
  (all ones except where an algorithm masks whole groups, e.g. off-policy GRPO's zero-variance groups);
- `loss(PolicyLossInput, cfg) -> (loss, metrics)` per microbatch (global-batch contributions).
A train-inference correction (`algorithm.correction`, `corrections.py`) reaches every loss the same way, as
`PolicyLossInput.token_weight`; an algorithm that is not `reweightable` (OAPL, `catalog.NOT_REWEIGHTABLE`) is
refused with one at config time. The decoupled objective (`algorithm.decoupled`, `decoupled.py`) wraps every
registered loss at registration (`_with_decoupling`): the loss the trainer calls applies it when the switch is on,
and an algorithm that is not `decouplable` (OAPL, OPMD: `catalog.NOT_DECOUPLABLE`) is refused at config time; one
that refuses mixed-version groups (`catalog.SINGLE_VERSION_GROUPS`) is checked per batch (`versions.py`).
Add an algorithm by registering it here and naming it in `catalog.py` (which the
config validates against without importing torch); `config_keys` lists the `AlgorithmConfig` fields it reads.
Layers: this module imports the config schema, which imports only the torch-free catalogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algorithms import advantages as adv
from megarl.algorithms import decoupled, filters, losses
from megarl.algorithms.aggregation import Aggregation
from megarl.algorithms.catalog import ALGORITHM_NAMES, NOT_DECOUPLABLE, NOT_REWEIGHTABLE, SINGLE_VERSION_GROUPS
from megarl.algorithms.clipping import CLIP_MASKS, ClipParams
from megarl.config.schema import AlgorithmConfig

AdvantageFn = Callable[[torch.Tensor, AlgorithmConfig], torch.Tensor]
LossFn = Callable[[losses.PolicyLossInput, AlgorithmConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]

_AGG_KEYS = ("loss_agg", "loss_agg_constant")
_CLIP_KEYS = ("eps_low", "eps_high")


def _keep_all(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    return torch.ones_like(rewards)


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    advantages: AdvantageFn  # rewards [G, K] -> advantages [G, K]
    loss: LossFn
    sequence_mask: AdvantageFn = _keep_all  # rewards [G, K] -> 0/1 [G, K] for PolicyLossInput.seq_mask
    config_keys: tuple[str, ...] = ()  # AlgorithmConfig fields this algorithm reads (besides `name`)
    reference: str = ""  # paper and section of the formula

    @property
    def reweightable(self) -> bool:
        """The loss takes a train-inference correction (`PolicyLossInput.token_weight`, `algorithm.correction`)."""
        return self.name not in NOT_REWEIGHTABLE

    @property
    def decouplable(self) -> bool:
        """The loss takes the decoupled objective (`algorithm.decoupled`)."""
        return self.name not in NOT_DECOUPLABLE

    @property
    def accepts_mixed_version_groups(self) -> bool:
        """A group may hold tokens of several policy versions (in-flight weight updates)."""
        return self.name not in SINGLE_VERSION_GROUPS


def _with_decoupling(algorithm: Algorithm) -> Algorithm:
    """`algorithm` whose loss applies the decoupled objective when `cfg.decoupled.enabled` (`decoupled.py`): the
    base loss on `decoupled_input(inp)`, with the behaviour weight's metrics added; unchanged when it is off."""
    base = algorithm.loss

    def loss(inp: losses.PolicyLossInput, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not cfg.decoupled.enabled:
            return base(inp, cfg)
        if not algorithm.decouplable:
            raise ValueError(f"algorithm {algorithm.name!r} does not take the decoupled objective: "
                             f"{NOT_DECOUPLABLE[algorithm.name]}; set algorithm.decoupled.enabled=false")
        inp, metrics = decoupled.decoupled_input(inp, decoupled.DecoupledParams(cfg.decoupled.cap,
                                                                                cfg.decoupled.cap_mode))
        value, loss_metrics = base(inp, cfg)
        return value, {**loss_metrics, **metrics}

    return dataclasses.replace(algorithm, loss=loss)


def _clip(cfg: AlgorithmConfig) -> ClipParams:
    return ClipParams(cfg.eps_low, cfg.eps_high, cfg.eps_low_outer, cfg.eps_high_outer)


def _agg(cfg: AlgorithmConfig) -> Aggregation:
    return Aggregation(cfg.loss_agg, cfg.loss_agg_constant)


def _mean_adv(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    return adv.group_mean_advantages(rewards)


def _norm_adv(rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
    return adv.group_normalized_advantages(rewards, eps=cfg.adv_eps)


def _reinforce(inp: losses.PolicyLossInput, cfg: AlgorithmConfig):
    return losses.reinforce_loss(inp, _agg(cfg))


class _RedDropAdvantages:
    """RED-Drop's advantage estimator: the seeded filter, then advantages on the kept set. The generator
    is created from `cfg.filter_seed` on first use and advances with every batch (advantages are computed
    once per batch on the controller), so a run's drops are reproducible from its seed."""

    def __init__(self) -> None:
        self._seed: int | None = None
        self._generator = torch.Generator()

    def __call__(self, rewards: torch.Tensor, cfg: AlgorithmConfig) -> torch.Tensor:
        if self._seed != cfg.filter_seed:
            self._seed = cfg.filter_seed
            self._generator.manual_seed(cfg.filter_seed)
        keep = filters.red_drop_keep_mask(rewards, self._generator)
        return adv.red_drop_advantages(rewards, keep)

    def state_dict(self) -> dict:
        """The generator's position, saved in checkpoints so a resumed run drops the same sequences."""
        return {"seed": self._seed, "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._seed = state["seed"]
        self._generator.set_state(state["generator"])


def _rec(mask: str, importance_sampling: bool) -> Algorithm:
    kind = {"onesided": "OneSide", "twosided": "TwoSide", "ring": "Ring"}[mask]
    weight = "importance weight ratio * M" if importance_sampling else "no importance weight (M * logp)"
    keys = _CLIP_KEYS + (("eps_low_outer", "eps_high_outer") if mask == "ring" else ()) + _AGG_KEYS
    return Algorithm(
        name=f"rec_{mask}_{'is' if importance_sampling else 'nois'}",
        description=f"REC-{kind}-{'IS' if importance_sampling else 'NOIS'}: group-mean advantages, "
        f"{mask.replace('sided', '-sided')} token clip mask, {weight}",
        advantages=_mean_adv,
        loss=lambda inp, cfg: losses.rec_loss(inp, _clip(cfg), CLIP_MASKS[mask], importance_sampling, _agg(cfg)),
        config_keys=keys,
        reference="REC section 4.1 (one-side, eq. 8), appendix B.3 (two-side eq. 18, ring eq. 19-21)",
    )


ALGORITHMS: dict[str, Algorithm] = {
    a.name: _with_decoupling(a)
    for a in (
        Algorithm(
            "reinforce",
            "Group-relative REINFORCE: A = r - mean, -A * logp per token, no clipping",
            _mean_adv,
            _reinforce,
            config_keys=_AGG_KEYS,
            reference="REC eq. 1a/1b, Table 3",
        ),
        Algorithm(
            "grpo",
            "GRPO: std-normalised group advantages, token PPO clipped surrogate, no KL",
            _norm_adv,
            lambda inp, cfg: losses.grpo_loss(inp, _clip(cfg), _agg(cfg), cfg.dual_clip),
            config_keys=_CLIP_KEYS + ("dual_clip", "adv_eps") + _AGG_KEYS,
            reference="Shao et al. 2024; REC section 4.1, Table 3",
        ),
        *(_rec(mask, is_) for mask in ("onesided", "twosided", "ring") for is_ in (True, False)),
        Algorithm(
            "rec_gspo_nois",
            "REC-GSPO-NOIS: group-mean advantages, one-side sequence clip mask, no importance weight",
            _mean_adv,
            lambda inp, cfg: losses.rec_gspo_nois_loss(inp, _clip(cfg)),
            config_keys=_CLIP_KEYS,
            reference="REC appendix B.7",
        ),
        Algorithm(
            "rec_gspo_is",
            "REC-GSPO-IS: group-mean advantages, sequence importance weight with one-side clip mask",
            _mean_adv,
            lambda inp, cfg: losses.rec_gspo_is_loss(inp, _clip(cfg)),
            config_keys=_CLIP_KEYS,
            reference="REC appendix B.7",
        ),
        Algorithm(
            "gspo",
            "GSPO: std-normalised group advantages, sequence importance weight with one-side clip mask",
            _norm_adv,
            lambda inp, cfg: losses.gspo_loss(inp, _clip(cfg)),
            config_keys=_CLIP_KEYS + ("adv_eps",),
            reference="Zheng et al. 2025; REC appendix B.7",
        ),
        Algorithm(
            "opmd_sequence",
            "OPMD as the REC paper writes it: REINFORCE on sequence log-probs + beta/2 (logp - oldlogp)^2 per sequence",
            _mean_adv,
            lambda inp, cfg: losses.opmd_sequence_loss(inp, cfg.beta),
            config_keys=("beta",),
            reference="Kimi k1.5; REC section 4.2, Table 3",
        ),
        Algorithm(
            "opmd_token",
            "OPMD as the REC authors' code runs it: -A logp + beta (logp - oldlogp)^2 per token (REC Fig. 10's runs)",
            _mean_adv,
            lambda inp, cfg: losses.opmd_token_loss(inp, cfg.beta, _agg(cfg)),
            config_keys=("beta",) + _AGG_KEYS,
            reference="Kimi k1.5; REC section 4.2, Fig. 10 (Trinity-RFT's REC loss, regularizer k2)",
        ),
        Algorithm(
            "asymre",
            "AsymRE: REINFORCE with the baseline shifted down by beta (A = r - (mean - beta))",
            lambda rewards, cfg: adv.asymre_advantages(rewards, cfg.beta),
            lambda inp, cfg: losses.asymre_loss(inp, _agg(cfg)),
            config_keys=("beta",) + _AGG_KEYS,
            reference="Arnal et al. 2025; REC section 4.2, Table 3",
        ),
        Algorithm(
            "pairwise_reinforce",
            "Pairwise-weighted REINFORCE: A_i = (sum_j w_ij)(r_i - weighted mean), w_ij = exp((A_i + A_j)/T) / K",
            lambda rewards, cfg: adv.pairwise_weighted_advantages(
                rewards, adv.exp_pairwise_weights(rewards, cfg.temperature)
            ),
            _reinforce,
            config_keys=("temperature",) + _AGG_KEYS,
            reference="REC section 4.3, eq. 9, Table 3",
        ),
        Algorithm(
            "red_drop",
            "RED-Drop: drop excess negatives at random (seeded), A = (K/|S|)(r - mean over kept), REINFORCE loss",
            _RedDropAdvantages(),
            _reinforce,
            config_keys=("filter_seed",) + _AGG_KEYS,
            reference="REC section 4.3, eq. 10, appendix B.6",
        ),
        Algorithm(
            "red_weight",
            "RED-Weight: A = exp((r - mean)/T) * (r - mean), REINFORCE loss",
            lambda rewards, cfg: adv.red_weight_advantages(rewards, cfg.temperature),
            _reinforce,
            config_keys=("temperature",) + _AGG_KEYS,
            reference="REC section 4.3, appendix B.6, Table 3",
        ),
        Algorithm(
            "oapl",
            "OAPL: (beta2 (logp - vllm_logp) - (r - V_hat))^2 per sequence, V_hat = beta1 logmeanexp(r/beta1)",
            lambda rewards, cfg: adv.oapl_advantages(rewards, cfg.oapl_beta1),
            lambda inp, cfg: losses.oapl_loss(inp, cfg.oapl_beta2),
            config_keys=("oapl_beta1", "oapl_beta2"),
            reference="OAPL section 3 (eq. 2-3); A*-PO (Brantley et al. 2025)",
        ),
        Algorithm(
            "off_policy_grpo",
            "Off-policy GRPO: A = (r - mean)/sqrt(var + eps) of the server-policy group, zero-variance groups "
            "masked, token clipped surrogate + beta * KL(pi || pi_ref)",
            lambda rewards, cfg: adv.off_policy_grpo_advantages(rewards, eps=cfg.adv_eps),
            lambda inp, cfg: losses.off_policy_grpo_loss(
                inp, _clip(cfg), cfg.beta, cfg.kl_estimator, _agg(cfg), cfg.dual_clip
            ),
            sequence_mask=lambda rewards, cfg: filters.nonzero_variance_groups(rewards)[:, None]
            .expand_as(rewards)
            .to(rewards.dtype),
            config_keys=_CLIP_KEYS + ("dual_clip", "adv_eps", "beta", "kl_estimator") + _AGG_KEYS,
            reference="Mroueh et al., Revisiting GRPO, eq. 2, 6-8 and Algorithm 1",
        ),
    )
}

if tuple(ALGORITHMS) != ALGORITHM_NAMES:
    raise ImportError(
        f"megarl/algorithms/registry.py registers {sorted(ALGORITHMS)} but megarl/algorithms/catalog.py names "
        f"{sorted(ALGORITHM_NAMES)}: name every registered algorithm in catalog.ALGORITHM_NAMES, in registry order"
    )


def get_algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        known = ", ".join(sorted(ALGORITHMS))
        raise KeyError(f"algorithm.name={name!r} is not registered; choose one of: {known}") from None
