"""The decoupled objective (megarl/algorithms/decoupled.py, `algorithm.decoupled`) on hand-built microbatches whose
responses hold tokens of two policy versions, and the refusals of mixed-version data.

Per token the test fixes its version (lag 1: sampled before the push, lag 0: after), the behaviour log-ratio
`log pi_prox - log mu` (0 on lag-0 tokens, where the engine's version is the proximal one) and the ratio
`r = pi_theta / pi_prox` (the proximal policy is given explicitly and differs from `pi_theta`, so the clip against it
binds on some tokens). Gradients are checked against an independent dense formula (autograd of AReaL's objective
written out here) for GRPO, and against the hand-derived per-token gradient for GSPO / REC-GSPO-IS / REC-GSPO-NOIS
(float64); then the reductions to today's losses, the cap modes, and the refusals.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import ValidationError

from megarl.algorithms import corrections, decoupled, losses
from megarl.algorithms.catalog import NOT_DECOUPLABLE
from megarl.algorithms.registry import ALGORITHMS, get_algorithm
from megarl.algorithms.versions import check_token_versions, mixed_version_groups, stale_samples
from megarl.config.schema import AlgorithmConfig, CorrectionConfig, DecoupledConfig
from megarl.schedule import SyncSchedule, VersionClock
from megarl.token_versions import TokenVersions

EPS = 0.2  # clip band [0.8, 1.2]
CAP = 2.0
N_GLOBAL = 6  # sequences in the global batch (this microbatch holds 4)
# per response, per token: (lag, log pi_prox - log mu, r = pi_theta / pi_prox); two responses span both versions,
# one token's behaviour weight e^1 = 2.72 passes the cap; ratios on both sides of the band, none on an edge
TOKENS = [
    [(1, 0.3, 1.1), (1, 1.0, 0.9), (0, 0.0, 1.5), (0, 0.0, 1.05)],
    [(1, -0.4, 0.6), (1, 0.2, 1.3), (0, 0.0, 0.95)],
    [(1, 0.5, 1.15), (1, -0.2, 0.7)],
    [(0, 0.0, 0.7), (0, 0.0, 0.75), (0, 0.0, 0.9)],  # s = 0.78 < 0.8 with A < 0: a clipped sequence
]
ADV = [0.8, -0.6, 0.4, -1.2]
EXTRA_TOKENS = 5  # response tokens of the global batch in other microbatches


def _case():
    b, s = len(TOKENS), max(len(r) for r in TOKENS)
    logp, prox, behav, mask = (torch.zeros(b, s, dtype=torch.float64) for _ in range(4))
    lags = torch.full((b, s), -1, dtype=torch.long)
    for i, row in enumerate(TOKENS):
        for t, (lag, log_w, r) in enumerate(row):
            p = -0.7 - 0.2 * t - 0.1 * i
            prox[i, t], behav[i, t], logp[i, t], mask[i, t], lags[i, t] = p, p - log_w, p + math.log(r), 1.0, lag
    return logp, prox, behav, mask, lags, torch.tensor(ADV, dtype=torch.float64), int(mask.sum()) + EXTRA_TOKENS


def _cfg(name: str, mode: str = "truncate", **kw) -> AlgorithmConfig:
    return AlgorithmConfig(name=name, eps_low=EPS, eps_high=EPS,
                           decoupled=DecoupledConfig(enabled=True, cap=CAP, cap_mode=mode), **kw)


def _hand_weight(log_w: float, mode: str) -> float:
    w = math.exp(log_w)
    return min(w, CAP) if mode == "truncate" else (w if w <= CAP else 0.0)


def _registered(name, cfg, prox_given=True):
    """Autograd through the registered loss: the trainer's input (old = engine = behaviour), proximal given."""
    logp, prox, behav, mask, _, adv, num_tokens = _case()
    x = logp.clone().requires_grad_(True)
    inp = losses.PolicyLossInput(x * mask, behav, mask, adv, N_GLOBAL, num_tokens=num_tokens, engine_logprobs=behav,
                                 prox_logprobs=prox if prox_given else None)
    loss, metrics = get_algorithm(name).loss(inp, cfg)
    loss.backward()
    return loss.item(), x.grad, metrics


def test_the_case_spans_versions_hits_the_cap_and_the_clip():
    assert sum(len({lag for lag, _, _ in row}) > 1 for row in TOKENS) == 2
    assert any(math.exp(w) > CAP for row in TOKENS for _, w, _ in row)
    assert any(r > 1 + EPS or r < 1 - EPS for row in TOKENS for _, _, r in row)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_grpo_gradient_against_the_dense_formula(mode):
    """AReaL's decoupled PPO, token-mean: L = -(1/T) sum w_t min(r_t A, clip(r_t, 0.8, 1.2) A), r_t = pi_theta /
    pi_prox, w_t = the capped pi_prox / mu; autograd of this dense formula vs the registered grpo loss."""
    logp, prox, behav, mask, _, adv, num_tokens = _case()
    w = torch.tensor([[_hand_weight(float(prox[i, t] - behav[i, t]), mode) if mask[i, t] else 0.0
                       for t in range(mask.shape[1])] for i in range(mask.shape[0])], dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    r = torch.exp(x - prox)
    a = adv[:, None]
    dense = -(mask * w * torch.minimum(r * a, torch.clamp(r, 1 - EPS, 1 + EPS) * a)).sum() / num_tokens
    dense.backward()
    value, grad, metrics = _registered("grpo", _cfg("grpo", mode))
    assert value == pytest.approx(dense.item(), rel=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)
    assert float(x.grad.abs().sum()) > 0 and int((x.grad == 0).sum() - (mask == 0).sum()) > 0  # some tokens clipped
    assert metrics["decoupled/capped_frac"].item() == pytest.approx(1 / num_tokens, rel=1e-15)
    assert metrics["decoupled/behav_weight_mean"].item() == pytest.approx(float(w.sum()) / num_tokens, rel=1e-12)


def _one_side(a: float, s: float) -> float:
    return float((a > 0 and s <= 1 + EPS) or (a < 0 and s >= 1 - EPS))


@pytest.mark.parametrize("name", ["gspo", "rec_gspo_is", "rec_gspo_nois"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_forms_gradient_by_hand(name, mode):
    """s_i = exp(mean_t(logp - logp_prox)) against the proximal policy, M_i one-side on s_i, the behaviour weight per
    token: dL/dlogp_i^t = -(1/N) A_i [s_i] M_i w_i^t / |y_i| (s_i for the IS forms). Value: GSPO's objective
    -(1/N) sum_i min(s_i A_i, clip(s_i) A_i) (IS forms), -(1/N) sum_i A_i M_i mean_t logp (NOIS)."""
    logp, prox, _, _, _, adv, _ = _case()
    expected = [[0.0] * logp.shape[1] for _ in TOKENS]
    value = 0.0
    seq_ratios = []
    for i, row in enumerate(TOKENS):
        n = len(row)
        s = math.exp(sum(math.log(r) for _, _, r in row) / n)
        seq_ratios.append(s)
        a, m = ADV[i], _one_side(ADV[i], s)
        for t, (_, log_w, _) in enumerate(row):
            expected[i][t] = -a * (s if name != "rec_gspo_nois" else 1.0) * m * _hand_weight(log_w, mode) / (
                N_GLOBAL * n)
        if name == "rec_gspo_nois":
            value -= a * m * sum(float(logp[i, t]) for t in range(n)) / n / N_GLOBAL
        else:
            value -= min(s * a, min(max(s, 1 - EPS), 1 + EPS) * a) / N_GLOBAL
    assert {_one_side(a, s) for a, s in zip(ADV, seq_ratios, strict=True)} == {0.0, 1.0}  # one sequence clipped
    got_value, grad, _ = _registered(name, _cfg(name, mode))
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert got_value == pytest.approx(value, rel=1e-12)


DECOUPLABLE = [n for n in ALGORITHMS if n not in NOT_DECOUPLABLE]


def _plain(name, inp):
    loss, metrics = get_algorithm(name).loss(inp, AlgorithmConfig(name=name, eps_low=EPS, eps_high=EPS))
    return loss, metrics


@pytest.mark.parametrize("name", DECOUPLABLE)
def test_one_version_at_lag_zero_is_todays_loss(name):
    """Every token of one version, the trainer's own (pi_prox = mu): the decoupled loss equals today's loss (ratio
    against the engine's log-probs, no weight), value and gradient, for every decouplable algorithm."""
    logp, prox, _, mask, _, adv, num_tokens = _case()
    grads, values = [], []
    for on in (False, True):
        x = logp.clone().requires_grad_(True)
        inp = losses.PolicyLossInput(x * mask, prox, mask, adv, N_GLOBAL, num_tokens=num_tokens,
                                     engine_logprobs=prox, prox_logprobs=prox if on else None)
        cfg = _cfg(name) if on else AlgorithmConfig(name=name, eps_low=EPS, eps_high=EPS)
        loss, _ = get_algorithm(name).loss(inp, cfg)
        loss.backward()
        grads.append(x.grad)
        values.append(loss.item())
    assert values[1] == pytest.approx(values[0], rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-15)
    assert float(grads[0].abs().sum()) > 0


@pytest.mark.parametrize("name", DECOUPLABLE)
def test_in_the_trainer_it_is_trainer_old_logprobs_with_token_tis(name):
    """The proximal policy left to the loss (None: the training forward's own log-probs, as the trainer passes it)
    and the cap not hit: the decoupled loss is today's loss with old_logprobs = the trainer's pre-update log-probs and
    the tis_token correction min(pi_trainer / pi_engine, C) (the KL reference kept on the behaviour policy)."""
    logp, _, behav, mask, _, adv, num_tokens = _case()
    behav = torch.where(mask.bool(), logp - 0.3 * torch.sin(5 * logp), behav)  # every pi_prox / mu below the cap
    assert float(torch.exp(logp - behav).max()) < CAP
    out = []
    for on in (False, True):
        x = logp.clone().requires_grad_(True)
        if on:
            inp = losses.PolicyLossInput(x * mask, behav, mask, adv, N_GLOBAL, num_tokens=num_tokens,
                                         engine_logprobs=behav)
            loss, _ = get_algorithm(name).loss(inp, _cfg(name))
        else:
            weight, _ = corrections.correction_weights(CorrectionConfig(kind="tis_token", cap=CAP), x, behav, mask,
                                                       num_tokens)
            inp = losses.PolicyLossInput(x * mask, logp * mask, mask, adv, N_GLOBAL, num_tokens=num_tokens,
                                         engine_logprobs=behav, ref_logprobs=behav, token_weight=weight)
            loss, _ = _plain(name, inp)
        loss.backward()
        out.append((loss.item(), x.grad))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-12, abs=1e-15)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-12, atol=1e-15)


def test_behaviour_weight_cap_modes_by_hand():
    """pi_prox / mu = 4 (above C = 2), 2 (on it: kept), 0.5, and padding: truncate 2, 2, 0.5; mask 0, 2, 0.5."""
    ln2 = math.log(2.0)
    log_w = torch.tensor([[2 * ln2, ln2, -ln2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    for mode, want in (("truncate", [2.0, 2.0, 0.5, 0.0]), ("mask", [0.0, 2.0, 0.5, 0.0])):
        w, metrics = decoupled.behaviour_weight(log_w, mask, decoupled.DecoupledParams(CAP, mode), 6)
        torch.testing.assert_close(w, torch.tensor([want], dtype=torch.float64), rtol=1e-15, atol=0)
        assert metrics["decoupled/capped_frac"].item() == 1 / 6
        assert metrics["decoupled/behav_weight_mean"].item() == pytest.approx(sum(want) / 6, rel=1e-15)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("fields, message", [
    ({"name": "oapl"}, "algorithm.name='oapl'"),
    ({"name": "opmd_token"}, "regulariser"),
    ({"name": "opmd_sequence"}, "regulariser"),
    ({"name": "grpo", "correction": CorrectionConfig(kind="tis_token")}, "algorithm.correction.kind=none"),
    ({"name": "grpo", "old_logprobs": "trainer"}, "algorithm.old_logprobs=engine"),
])
def test_config_refuses(fields, message):
    with pytest.raises(ValidationError, match="algorithm.decoupled.enabled"):
        AlgorithmConfig(decoupled=DecoupledConfig(enabled=True), **fields)
    with pytest.raises(ValidationError, match=re.escape(message)):
        AlgorithmConfig(decoupled=DecoupledConfig(enabled=True), **fields)


def test_config_fields():
    assert AlgorithmConfig().decoupled == DecoupledConfig(enabled=False, cap=5.0, cap_mode="truncate")
    assert AlgorithmConfig().max_token_lag is None
    with pytest.raises(ValidationError):
        DecoupledConfig(cap=1.0)  # a cap must exceed 1
    with pytest.raises(ValidationError):
        AlgorithmConfig(max_token_lag=-1)


def test_a_refused_loss_raises_if_the_config_was_bypassed():
    cfg = AlgorithmConfig.model_construct(**{**AlgorithmConfig(name="oapl").__dict__,
                                             "decoupled": DecoupledConfig(enabled=True)})
    logp, prox, behav, mask, _, adv, num_tokens = _case()
    inp = losses.PolicyLossInput(logp, behav, mask, adv, N_GLOBAL, num_tokens=num_tokens, engine_logprobs=behav)
    with pytest.raises(ValueError, match="does not take the decoupled objective"):
        get_algorithm("oapl").loss(inp, cfg)


def test_staleness_bound_and_mixed_version_groups():
    bound = lambda cap, m, n: VersionClock(SyncSchedule(m, n), cap).bound  # noqa: E731
    assert bound(None, 4, 0) == 3 and bound(None, 1, 2) == 2 and bound(7, 4, 0) == 7
    # trainer at version 5, two groups of 2: group 0 holds versions 4 and 5 (one response spans them), group 1 only 3
    tv = [TokenVersions(((4, 3), (5, 2))), TokenVersions.single(5, 4), TokenVersions.single(3, 2),
          TokenVersions.single(3, 6)]
    assert mixed_version_groups(tv, 2) == [0]
    assert stale_samples(tv, 5, 2) == [] and stale_samples(tv, 5, 1) == [(2, 2, 2), (3, 2, 2)]
    assert stale_samples(tv, 4, 3) == [(0, 0, -1), (1, -1, -1)]  # newer than the trainer: impossible
    check_token_versions(tv, 2, 5, 2, "grpo")  # in bound, mixed groups accepted
    check_token_versions(None, 2, 5, 0, "oapl")  # no per-token record: every token of the batch's version
    with pytest.raises(ValueError, match=r"algorithm.name='oapl' refuses groups .*\[0\].*V_hat"):
        check_token_versions(tv, 2, 5, 2, "oapl")
    check_token_versions(tv[2:], 2, 5, 2, "oapl")  # one version per group: accepted
    with pytest.raises(RuntimeError, match=r"staleness bound.*bound 1 .*algorithm.max_token_lag"):
        check_token_versions(tv, 2, 5, 1, "grpo")


def test_registry_flags():
    assert [n for n, a in ALGORITHMS.items() if not a.decouplable] == ["opmd_sequence", "opmd_token", "oapl"]
    assert [n for n, a in ALGORITHMS.items() if not a.accepts_mixed_version_groups] == ["oapl"]
