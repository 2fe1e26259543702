"""Advantages, filters, aggregation, KL estimators, registry and config: each checked against a reference
written out here with loops and `math` (not the library's helpers)."""

import math

import pytest
import torch
from pydantic import ValidationError

from megarl.algorithms import advantages as adv
from megarl.algorithms.aggregation import Aggregation, aggregate_tokens
from megarl.algorithms.filters import nonzero_variance_groups, red_drop_keep_mask
from megarl.algorithms.kl import kl_estimate
from megarl.algorithms.registry import ALGORITHMS, get_algorithm
from megarl.config.schema import AlgorithmConfig

REWARDS = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.4, 0.0, 1.0]],
                       dtype=torch.float64)


def _stats(row):
    mean = sum(row) / len(row)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in row) / len(row))


def _per_group(fn):
    return torch.tensor([fn(list(map(float, row))) for row in REWARDS], dtype=torch.float64)


def test_group_mean_normalised_and_off_policy():
    torch.testing.assert_close(adv.group_mean_advantages(REWARDS), _per_group(lambda r: [x - _stats(r)[0] for x in r]))
    expected = _per_group(lambda r: [(x - _stats(r)[0]) / (_stats(r)[1] + 1e-6) for x in r])
    torch.testing.assert_close(adv.group_normalized_advantages(REWARDS, 1e-6), expected)
    eps = 0.01
    expected = _per_group(lambda r: [(x - _stats(r)[0]) / math.sqrt(_stats(r)[1] ** 2 + eps) * (_stats(r)[1] > 0)
                                     for x in r])
    torch.testing.assert_close(adv.off_policy_grpo_advantages(REWARDS, eps), expected)
    assert torch.all(adv.off_policy_grpo_advantages(REWARDS, eps)[1] == 0)  # zero-variance group masked


def test_asymre_and_red_weight():
    beta, temp = 0.1, 0.5
    torch.testing.assert_close(adv.asymre_advantages(REWARDS, beta),
                               _per_group(lambda r: [x - (_stats(r)[0] - beta) for x in r]))
    expected = _per_group(lambda r: [math.exp((x - _stats(r)[0]) / temp) * (x - _stats(r)[0]) for x in r])
    torch.testing.assert_close(adv.red_weight_advantages(REWARDS, temp), expected)


def test_pairwise_weighted_general_formula_and_eq9():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(3, 6, 6, generator=g, dtype=torch.float64)
    w = w + w.transpose(-1, -2)  # symmetric, non-negative
    out = adv.pairwise_weighted_advantages(REWARDS, w)
    for gi in range(3):
        for i in range(6):
            row = sum(float(w[gi, i, j]) for j in range(6))
            wmean = sum(float(w[gi, i, j] * REWARDS[gi, j]) for j in range(6)) / row
            assert float(out[gi, i]) == pytest.approx(row * (float(REWARDS[gi, i]) - wmean), rel=1e-12)
    # eq. 9: product weights give (sum_j w_j) w_i (r_i - rbar_w); T -> inf recovers r_i - rbar
    temp = 0.7
    pw = adv.pairwise_weighted_advantages(REWARDS, adv.exp_pairwise_weights(REWARDS, temp))
    for gi, row in enumerate(REWARDS.tolist()):
        mean = sum(row) / 6
        wi = [math.exp((r - mean) / temp) / math.sqrt(6) for r in row]
        rbar_w = sum(a * b for a, b in zip(wi, row, strict=True)) / sum(wi)
        for i in range(6):
            assert float(pw[gi, i]) == pytest.approx(sum(wi) * wi[i] * (row[i] - rbar_w), rel=1e-12, abs=1e-15)
    flat = adv.pairwise_weighted_advantages(REWARDS, adv.exp_pairwise_weights(REWARDS, 1e9))
    torch.testing.assert_close(flat, adv.group_mean_advantages(REWARDS), rtol=1e-6, atol=1e-8)


def test_red_drop_filter_balances_and_is_seeded():
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0],
                            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    keep = red_drop_keep_mask(rewards, torch.Generator().manual_seed(3))
    assert keep.sum(-1).tolist() == [2, 8, 4, 8]  # 1 pos + 1 neg; no excess; 2 + 2; zero-variance kept
    positive = rewards > rewards.mean(-1, keepdim=True)
    assert keep[positive].all()  # positives are never dropped
    again = red_drop_keep_mask(rewards, torch.Generator().manual_seed(3))
    assert torch.equal(keep, again)  # reproducible from the seed
    others = [red_drop_keep_mask(rewards, torch.Generator().manual_seed(s)) for s in range(10)]
    assert any(not torch.equal(keep, o) for o in others)  # and actually random


def test_red_drop_counts_a_reward_at_the_mean_as_positive():
    """The REC authors' code (Trinity-RFT, drop="balance") splits at `r >= mean`: in [0.75, 0.25, 0, 0] (mean 0.25,
    exact in binary) the tie is a positive, so 2 positives balance 2 negatives and nothing is dropped (a strict
    `r > mean` would see 1 positive and drop a negative). Group 2, [1, 0.25, 0, 0, 0, 0.25] (mean 0.25): 3 positives
    against 3 negatives, nothing dropped; group 3, [1, 0, 0, 0] (no tie): 1 positive, 2 of 3 negatives dropped."""
    for row in ([0.75, 0.25, 0.0, 0.0], [1.0, 0.25, 0.0, 0.0, 0.0, 0.25], [1.0, 0.0, 0.0, 0.0]):
        mean = sum(row) / len(row)
        positives = sum(r >= mean for r in row)
        keep = red_drop_keep_mask(torch.tensor([row]), torch.Generator().manual_seed(0))[0]
        assert int(keep.sum()) == min(len(row), 2 * positives)
        assert all(keep[i] for i, r in enumerate(row) if r >= mean)


def test_red_drop_advantages_are_eq10_and_eq9_with_sqrtK_over_S():
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0], [1, 1, 0, 0.5, 0, 0]], dtype=torch.float64)
    keep = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    a = adv.red_drop_advantages(rewards, keep)
    k = 6
    for g in range(2):
        kept = [i for i in range(k) if keep[g, i]]
        rbar_s = sum(float(rewards[g, i]) for i in kept) / len(kept)
        for i in range(k):
            # the loss's (1/K) sum_i A_i must equal eq. 10's (1/|S|) sum_{i in S} (r_i - rbar_S)
            want = (float(rewards[g, i]) - rbar_s) * k / len(kept) if i in kept else 0.0
            assert float(a[g, i]) == pytest.approx(want, abs=1e-12)
    w = keep.double() * math.sqrt(k) / keep.sum(-1, keepdim=True)
    torch.testing.assert_close(adv.pairwise_weighted_advantages(rewards, w[..., :, None] * w[..., None, :]), a)


def test_red_drop_registered_generator_is_seeded_by_config():
    rewards = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]] * 4)
    algo = get_algorithm("red_drop")
    a1 = algo.advantages(rewards, AlgorithmConfig(name="red_drop", filter_seed=5))
    a2 = algo.advantages(rewards, AlgorithmConfig(name="red_drop", filter_seed=6))
    a3 = algo.advantages(rewards, AlgorithmConfig(name="red_drop", filter_seed=5))
    assert torch.equal(a1, a3)  # a seed change re-seeds the generator
    assert (a1 != 0).sum(-1).tolist() == [2] * 4 and (a2 != 0).sum(-1).tolist() == [2] * 4


def test_oapl_value_is_stable_and_has_the_right_limits():
    r = REWARDS[2]
    for beta1 in (0.3, 1.0, 5.0):
        naive = beta1 * math.log(sum(math.exp(float(x) / beta1) for x in r) / len(r))
        assert float(adv.oapl_value(REWARDS, beta1)[2, 0]) == pytest.approx(naive, rel=1e-12)
    big = torch.tensor([[1000.0, 999.0, 0.0]], dtype=torch.float64)
    v = adv.oapl_value(big, 1e-3)  # naive exp(1e6) overflows
    assert torch.isfinite(v).all() and float(v) == pytest.approx(1000.0 - 1e-3 * math.log(3), rel=1e-12)
    assert float(adv.oapl_value(REWARDS, 1e-4)[2, 0]) == pytest.approx(1.0, abs=2e-4)  # -> max
    assert float(adv.oapl_value(REWARDS, 1e4)[2, 0]) == pytest.approx(_stats(r.tolist())[0], abs=1e-4)  # -> mean
    torch.testing.assert_close(adv.oapl_advantages(REWARDS, 1.0), REWARDS - adv.oapl_value(REWARDS, 1.0))


def test_nonzero_variance_groups():
    assert nonzero_variance_groups(REWARDS).tolist() == [True, False, True]


def test_aggregation_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    n, t = 5, 11
    want = {
        "token-mean": (1 + 2 + 4 + 5 + 6) / t,
        "seq-mean-token-mean": ((1 + 2) / 2 + (4 + 5 + 6) / 3) / n,
        "seq-mean-token-sum": (1 + 2 + 4 + 5 + 6) / n,
        "constant": (1 + 2 + 4 + 5 + 6) / (n * 8.0),
    }
    for kind, value in want.items():
        assert aggregate_tokens(per_token, mask, Aggregation(kind, 8.0), n, t).item() == pytest.approx(value)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_tokens(per_token, mask, Aggregation("token-mean"), n, 0)


def test_kl_estimators():
    logp = torch.tensor([-0.1, -1.0, -2.5], dtype=torch.float64)
    ref = torch.tensor([-0.3, -1.0, -0.5], dtype=torch.float64)
    for i in range(3):
        d = float(logp[i] - ref[i])  # log(p/q)
        want = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}
        for kind, value in want.items():
            assert float(kl_estimate(logp, ref, kind)[i]) == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert torch.all(kl_estimate(logp, ref, "k3") >= 0)
    # k3 is unbiased for KL(p || q): average over samples from p of a 3-symbol distribution
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        expect = float((p * kl_estimate(p.log(), q.log(), kind)).sum())
        assert expect == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(logp, ref, "k4")


def test_registry_names_and_config_keys():
    required = {
        "reinforce", "grpo", "gspo", "rec_gspo_is", "rec_gspo_nois", "opmd_sequence", "opmd_token", "asymre",
        "pairwise_reinforce", "red_drop", "red_weight", "oapl", "off_policy_grpo",
        *(f"rec_{m}_{w}" for m in ("onesided", "twosided", "ring") for w in ("is", "nois")),
    }
    assert required <= set(ALGORITHMS)
    fields = set(AlgorithmConfig.model_fields)
    for algo in ALGORITHMS.values():
        assert set(algo.config_keys) <= fields, algo.name
        assert algo.reference and algo.description
    mask = get_algorithm("off_policy_grpo").sequence_mask(REWARDS, AlgorithmConfig(name="off_policy_grpo"))
    assert mask.tolist() == [[1.0] * 6, [0.0] * 6, [1.0] * 6]
    assert get_algorithm("grpo").sequence_mask(REWARDS, AlgorithmConfig()).eq(1).all()
    with pytest.raises(KeyError, match="choose one of"):
        get_algorithm("ppo")


def test_config_fields_and_checks():
    cfg = AlgorithmConfig()
    assert (cfg.loss_agg, cfg.kl_estimator, cfg.beta, cfg.temperature) == ("token-mean", "k3", 0.1, 1.0)
    assert (cfg.eps_low_outer, cfg.eps_high_outer, cfg.oapl_beta1, cfg.oapl_beta2) == (0.6, 2.0, 1.0, 1e-3)
    with pytest.raises(ValidationError, match="eps_low_outer"):
        AlgorithmConfig(name="rec_ring_nois", eps_low=0.7, eps_low_outer=0.6)
    AlgorithmConfig(name="rec_onesided_nois", eps_low=0.7)  # outer margins only matter for the ring
    with pytest.raises(ValidationError, match="kl_estimator"):
        AlgorithmConfig(kl_estimator="k4")
    with pytest.raises(ValidationError, match="loss_agg"):
        AlgorithmConfig(loss_agg="sum")
