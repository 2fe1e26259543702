"""Train-inference corrections (megarl/algorithms/corrections.py) and their composition with the registered losses.

Weights and masked/truncated fractions are checked against hand counts on ratios that are exact powers of two (on
and off the band edges); gradients of REINFORCE, GRPO and REC-GSPO-IS/NOIS with each correction against their
closed forms written out here (float64, the weights re-derived from their definitions in plain Python); for every
other reweightable loss, the defining rule `d loss / d logp_i^t` = `w_i^t` x the unweighted gradient. Then: no
correction leaves the computation untouched, splits into microbatches still agree, OAPL refuses a weight, and the
config validators name the fields.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from megarl.algorithms import corrections, losses
from megarl.algorithms.aggregation import LOSS_AGGS, Aggregation
from megarl.algorithms.clipping import ClipParams
from megarl.algorithms.registry import ALGORITHMS, get_algorithm
from megarl.config.schema import AlgorithmConfig, CorrectionConfig

KINDS = ("tis_token", "tis_seq", "mis_token", "mis_seq", "icepop")
LN2 = math.log(2.0)
CFG = CorrectionConfig(cap=2.0, lower=0.5, upper=2.0)

# ---------------------------------------------------------------- weights and fractions by hand

# per sequence, its token log-ratios as multiples of ln 2: rho = 0.25, 1, 4 | 2, 2 | 0.25 (padded to 3 positions)
LOG2_RHO = [[-2, 0, 2], [1, 1], [-2]]
OTHER_TOKENS = 4  # the global batch has 4 more response tokens in other microbatches: T = 6 + 4


def _rho_case():
    log_rho = torch.zeros(3, 3, dtype=torch.float64)
    mask = torch.zeros(3, 3, dtype=torch.float64)
    for i, row in enumerate(LOG2_RHO):
        for t, k in enumerate(row):
            log_rho[i, t], mask[i, t] = k * LN2, 1.0
    assert math.exp(LN2) == 2.0 and math.exp(-2 * LN2) == 0.25  # the band edges are hit exactly
    return log_rho, mask, 6 + OTHER_TOKENS


# expected weights (rows padded with 0) and counts of truncated / masked tokens, worked out by hand:
# tis_token: min(rho, 2): 4 -> 2 (truncated; rho = 2 exactly is not);  tis_seq: products 1, 4 -> 2, 0.25;
# mis_*: band [0.5, 2] inclusive (rho = 2 kept; 0.25 and 4 dropped; sequence products 1 kept, 4 and 0.25 dropped);
# icepop: rho inside [0.5, 2], 0 outside.
EXPECTED = {
    "tis_token": ([[0.25, 1, 2], [2, 2, 0], [0.25, 0, 0]], 1, 0),
    "tis_seq": ([[1, 1, 1], [2, 2, 0], [0.25, 0, 0]], 2, 0),
    "mis_token": ([[0, 1, 0], [1, 1, 0], [0, 0, 0]], 0, 3),
    "mis_seq": ([[1, 1, 1], [0, 0, 0], [0, 0, 0]], 0, 3),
    "icepop": ([[0, 1, 0], [2, 2, 0], [0, 0, 0]], 0, 3),
}


@pytest.mark.parametrize("kind", KINDS)
def test_weights_and_fractions_by_hand(kind):
    log_rho, mask, num_tokens = _rho_case()
    weight, metrics = corrections.CORRECTIONS[kind](log_rho, mask, CFG, num_tokens)
    want, truncated, masked = EXPECTED[kind]
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(weight, want, rtol=1e-15, atol=0)
    assert not weight.requires_grad
    assert metrics["correction/truncated_frac"].item() == truncated / num_tokens
    assert metrics["correction/masked_frac"].item() == masked / num_tokens
    assert metrics["correction/weight_mean"].item() == pytest.approx(float(want.sum()) / num_tokens, rel=1e-15)


@pytest.mark.parametrize("kind", ["mis_token", "mis_seq", "icepop"])
def test_band_lower_edge_is_inside(kind):
    """A ratio exactly on the band's lower edge (rho = 0.5 = lower, exact in binary) is kept, like one exactly on the
    upper edge; a ratio just below it is not. One-token sequences, so the sequence product is the token's rho."""
    rho = [0.5, 0.5 * (1 - 2**-20), 2.0]  # on the lower edge, just below it, on the upper edge
    log_rho = torch.tensor([[math.log(r)] for r in rho], dtype=torch.float64)
    assert [math.exp(x) for x in log_rho.flatten().tolist()] == rho  # the edges are hit exactly
    weight, metrics = corrections.CORRECTIONS[kind](log_rho, torch.ones(3, 1, dtype=torch.float64), CFG, 3)
    kept = [0.5, 0.0, 2.0] if kind == "icepop" else [1.0, 0.0, 1.0]  # IcePop keeps rho, MIS keeps 1
    assert weight.flatten().tolist() == kept
    assert metrics["correction/masked_frac"].item() == 1 / 3


def test_correction_weights_reads_trainer_minus_engine():
    """rho = exp(logp_trainer - logp_engine) on response tokens; `none` gives no weight and no metrics."""
    log_rho, mask, num_tokens = _rho_case()
    engine = -1.5 * mask
    trainer = (engine + log_rho).requires_grad_(True)
    weight, metrics = corrections.correction_weights(CorrectionConfig(kind="tis_token"), trainer, engine, mask,
                                                     num_tokens)
    torch.testing.assert_close(weight, torch.tensor(EXPECTED["tis_token"][0], dtype=torch.float64))
    assert not weight.requires_grad and set(metrics) == set(corrections.KEYS)
    assert corrections.correction_weights(CorrectionConfig(), trainer, engine, mask, num_tokens) == (None, {})


def test_sequence_ratio_overflow_is_capped_not_nan():
    log_rho = torch.full((1, 4), 400.0)  # prod rho = exp(1600): inf in float32
    mask = torch.ones(1, 4)
    weight, metrics = corrections.tis_seq(log_rho, mask, CFG, 4)
    assert torch.equal(weight, torch.full((1, 4), 2.0)) and metrics["correction/truncated_frac"].item() == 1.0
    weight, metrics = corrections.mis_seq(-log_rho, mask, CFG, 4)  # prod rho underflows to 0: outside the band
    assert torch.equal(weight, torch.zeros(1, 4)) and metrics["correction/masked_frac"].item() == 1.0


# ---------------------------------------------------------------- gradients against closed forms

CLIP = ClipParams(eps_low=0.2, eps_high=0.2)
N_GLOBAL = 7  # sequences in the global batch (this microbatch holds 4)
# per sequence: (trainer/engine log-ratio, current/old ratio) per token; none of them on a band or clip edge
TOKENS = [
    [(0.1, 1.1), (1.2, 1.5), (-0.9, 0.9)],
    [(-1.1, 0.7), (0.3, 1.05)],
    [(0.6, 1.3), (0.2, 0.95), (0.15, 1.02), (-0.05, 1.4)],
    [(-0.3, 0.6)],
]
ADV = [0.8, -0.6, 0.4, -1.2]
CORR = CorrectionConfig(cap=1.5, lower=0.5, upper=1.6)


def _grad_case():
    b, s = len(TOKENS), max(len(r) for r in TOKENS)
    logp, old, engine, mask = (torch.zeros(b, s, dtype=torch.float64) for _ in range(4))
    for i, row in enumerate(TOKENS):
        for t, (log_rho, ratio) in enumerate(row):
            lp = -0.5 - 0.3 * t - 0.1 * i
            logp[i, t], engine[i, t], old[i, t], mask[i, t] = lp, lp - log_rho, lp - math.log(ratio), 1.0
    return logp, old, engine, mask, torch.tensor(ADV, dtype=torch.float64), int(mask.sum()) + 5


def _hand_weights(kind, logp, engine, mask):
    """w_i^t from the definitions, token by token in Python floats."""
    w = [[0.0] * logp.shape[1] for _ in range(logp.shape[0])]
    for i in range(logp.shape[0]):
        rhos = [math.exp(float(logp[i, t] - engine[i, t])) for t in range(logp.shape[1]) if mask[i, t]]
        prod = math.prod(rhos)
        for t, rho in enumerate(rhos):
            w[i][t] = {
                "tis_token": min(rho, CORR.cap),
                "tis_seq": min(prod, CORR.cap),
                "mis_token": float(CORR.lower <= rho <= CORR.upper),
                "mis_seq": float(CORR.lower <= prod <= CORR.upper),
                "icepop": rho if CORR.lower <= rho <= CORR.upper else 0.0,
            }[kind]
    return w


def _autograd(loss_fn, kind, *args):
    logp, old, engine, mask, adv, num_tokens = _grad_case()
    weight, _ = corrections.correction_weights(CORR.model_copy(update={"kind": kind}), logp, engine, mask, num_tokens)
    x = logp.clone().requires_grad_(True)
    inp = losses.PolicyLossInput(x, old, mask, adv, N_GLOBAL, num_tokens=num_tokens, engine_logprobs=engine,
                                 token_weight=weight)
    loss, _ = loss_fn(inp, *args)
    loss.backward()
    return loss.item(), x.grad, _hand_weights(kind, logp, engine, mask), (logp, old, mask, num_tokens)


def _one_side(a, r):  # REC eq. 8 with eps 0.2
    return float((a > 0 and r <= 1 + CLIP.eps_high) or (a < 0 and r >= 1 - CLIP.eps_low))


def _assert_grad(grad, expected):
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", KINDS)
def test_reinforce_gradient_and_value(kind):
    """token-mean: L = sum_{i,t} -A_i w_i^t logp_i^t / T, dL/dlogp_i^t = -A_i w_i^t / T."""
    loss, grad, w, (logp, _, mask, num_tokens) = _autograd(losses.reinforce_loss, kind, Aggregation("token-mean"))
    expected = [[-ADV[i] * w[i][t] / num_tokens * float(mask[i, t]) for t in range(mask.shape[1])]
                for i in range(mask.shape[0])]
    _assert_grad(grad, expected)
    value = sum(-ADV[i] * w[i][t] * float(logp[i, t]) for i in range(4) for t in range(len(TOKENS[i]))) / num_tokens
    assert loss == pytest.approx(value, rel=1e-12)
    assert any(g != 0 for row in expected for g in row)


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_gradient_and_value(kind):
    """seq-mean-token-mean: dL/dlogp_i^t = -A_i ratio_i^t M_i^t w_i^t / (N |y_i|); value -w min(rA, clip(r)A)."""
    agg = Aggregation("seq-mean-token-mean")
    loss, grad, w, (_, _, mask, _) = _autograd(losses.grpo_loss, kind, CLIP, agg)
    expected = [[0.0] * mask.shape[1] for _ in range(4)]
    value = 0.0
    for i, row in enumerate(TOKENS):
        for t, (_, r) in enumerate(row):
            expected[i][t] = -ADV[i] * r * _one_side(ADV[i], r) * w[i][t] / (N_GLOBAL * len(row))
            clipped = min(max(r, 1 - CLIP.eps_low), 1 + CLIP.eps_high)
            value += -w[i][t] * min(r * ADV[i], clipped * ADV[i]) / (N_GLOBAL * len(row))
    _assert_grad(grad, expected)
    assert loss == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_rec_gspo_is_gradient(kind):
    """dL/dlogp_i^t = -(1/N) A_i s_i M_i w_i^t / |y_i|, s_i = exp(mean_t log ratio); the value stays unweighted:
    GSPO's objective -(1/N) min(s_i A_i, clip(s_i) A_i)."""
    loss, grad, w, (_, _, mask, _) = _autograd(losses.rec_gspo_is_loss, kind, CLIP)
    expected = [[0.0] * mask.shape[1] for _ in range(4)]
    value = 0.0
    for i, row in enumerate(TOKENS):
        s = math.exp(sum(math.log(r) for _, r in row) / len(row))
        m = _one_side(ADV[i], s)
        value += -min(s * ADV[i], min(max(s, 1 - CLIP.eps_low), 1 + CLIP.eps_high) * ADV[i]) / N_GLOBAL
        for t in range(len(row)):
            expected[i][t] = -ADV[i] * s * m * w[i][t] / (N_GLOBAL * len(row))
    _assert_grad(grad, expected)
    assert loss == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_rec_gspo_nois_gradient(kind):
    """dL/dlogp_i^t = -(1/N) A_i M_i w_i^t / |y_i|."""
    _, grad, w, (_, _, mask, _) = _autograd(losses.rec_gspo_nois_loss, kind, CLIP)
    expected = [[0.0] * mask.shape[1] for _ in range(4)]
    for i, row in enumerate(TOKENS):
        m = _one_side(ADV[i], math.exp(sum(math.log(r) for _, r in row) / len(row)))
        for t in range(len(row)):
            expected[i][t] = -ADV[i] * m * w[i][t] / (N_GLOBAL * len(row))
    _assert_grad(grad, expected)


REWEIGHTABLE = sorted(name for name, a in ALGORITHMS.items() if a.reweightable)


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("name", REWEIGHTABLE)
def test_every_loss_scales_each_token_gradient_by_its_weight(name, agg):
    """The composition rule for every reweightable registered loss: the gradient reaching logp_i^t is w_i^t times
    the uncorrected one (arbitrary weights, zeros included), whatever the aggregation."""
    algo = get_algorithm(name)
    cfg = AlgorithmConfig(name=name, loss_agg=agg, loss_agg_constant=3.0)
    logp, old, engine, mask, adv, num_tokens = _grad_case()
    weight = torch.tensor([[0.0, 1.7, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0], [2.0, 0.5, 0.0, 1.2], [0.9, 0.0, 0.0, 0.0]],
                          dtype=torch.float64) * mask

    def grad(token_weight):
        x = logp.clone().requires_grad_(True)
        inp = losses.PolicyLossInput(x, old, mask, adv, N_GLOBAL, num_tokens=num_tokens, engine_logprobs=engine,
                                     ref_logprobs=old + 0.1 * mask, token_weight=token_weight)
        algo.loss(inp, cfg)[0].backward()
        return x.grad

    plain = grad(None)
    assert plain.abs().sum() > 0
    torch.testing.assert_close(grad(weight), weight * plain, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- no correction, splits, OAPL, config


def test_no_correction_is_the_unweighted_computation():
    """kind=none yields no weight, and a loss input without one returns its own tensors (no arithmetic added)."""
    logp, old, engine, mask, adv, num_tokens = _grad_case()
    assert corrections.correction_weights(CorrectionConfig(), logp, engine, mask, num_tokens) == (None, {})
    inp = losses.PolicyLossInput(logp, old, mask, adv, N_GLOBAL, num_tokens=num_tokens)
    assert inp.weigh(logp) is logp and inp.weighted_logprobs() is logp


def _split_case():
    g = torch.Generator().manual_seed(3)
    n, s = 8, 5
    mask = (torch.rand(n, s, generator=g) > 0.3).double()
    mask[:, 0] = 1
    engine = -torch.rand(n, s, generator=g, dtype=torch.float64) * mask
    logp = (engine + 0.5 * torch.randn(n, s, generator=g, dtype=torch.float64)) * mask  # rho spread around 1
    old = (logp + 0.2 * torch.randn(n, s, generator=g, dtype=torch.float64)) * mask
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 1.0]], dtype=torch.float64)
    return logp, old, engine, mask, rewards


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "name", ["reinforce", "grpo", "rec_onesided_is", "rec_gspo_is", "opmd_sequence", "opmd_token", "off_policy_grpo"]
)
def test_microbatch_split_invariance_with_a_correction(name, kind):
    """1 x 8, 2 x 4 and 4 x 2 microbatches give the same loss, gradient and metrics (correction/* included)."""
    algo = get_algorithm(name)
    cfg = AlgorithmConfig(name=name, correction=CORR.model_copy(update={"kind": kind}))
    logp, old, engine, mask, rewards = _split_case()
    n, num_tokens = logp.shape[0], int(mask.sum())
    adv, seq_mask = algo.advantages(rewards, cfg).reshape(-1), algo.sequence_mask(rewards, cfg).reshape(-1)

    def run(splits):
        x = logp.clone().requires_grad_(True)
        total, metrics = 0.0, {}
        for rows in torch.tensor_split(torch.arange(n), splits):
            weight, m = corrections.correction_weights(cfg.correction, x[rows], engine[rows], mask[rows], num_tokens)
            inp = losses.PolicyLossInput(x[rows], old[rows], mask[rows], adv[rows], n, num_tokens=num_tokens,
                                         engine_logprobs=engine[rows], seq_mask=seq_mask[rows], token_weight=weight)
            loss, lm = algo.loss(inp, cfg)
            loss.backward()
            total += loss.item()
            for k, v in {**lm, **m}.items():
                metrics[k] = metrics.get(k, 0.0) + v.item()
        return total, x.grad, metrics

    l1, g1, m1 = run(1)
    assert g1.abs().sum() > 0 and set(corrections.KEYS) <= set(m1)
    assert m1["correction/truncated_frac"] + m1["correction/masked_frac"] > 0  # the correction does something
    for splits in (2, 4):
        ls, gs, ms = run(splits)
        assert ls == pytest.approx(l1, rel=1e-12, abs=1e-14)
        torch.testing.assert_close(gs, g1, rtol=1e-12, atol=1e-14)
        assert ms == pytest.approx(m1, rel=1e-12, abs=1e-14)


def test_oapl_refuses_a_correction():
    with pytest.raises(ValidationError, match=r"algorithm\.correction\.kind='tis_token'.*algorithm\.name='oapl'"):
        AlgorithmConfig(name="oapl", correction={"kind": "tis_token"})
    AlgorithmConfig(name="oapl")  # no correction: fine
    logp, old, engine, mask, adv, num_tokens = _grad_case()
    inp = losses.PolicyLossInput(logp, old, mask, adv, N_GLOBAL, num_tokens=num_tokens, engine_logprobs=engine,
                                 token_weight=torch.ones_like(mask))
    with pytest.raises(ValueError, match="OAPL must not be reweighted"):
        losses.oapl_loss(inp, 0.5)
    assert not get_algorithm("oapl").reweightable


@pytest.mark.parametrize("fields, message", [
    ({"lower": 2.0, "upper": 2.0}, r"algorithm\.correction\.lower=2\.0 must be < algorithm\.correction\.upper=2\.0"),
    ({"lower": 3.0, "upper": 1.5}, r"correction\.lower=3\.0 must be <"),
    ({"cap": 0.0}, "cap"),
    ({"lower": -0.1}, "lower"),
    ({"upper": 0.0}, "upper"),
    ({"kind": "tis"}, "kind"),
    ({"caps": 2.0}, "caps"),
])
def test_config_validation(fields, message):
    with pytest.raises(ValidationError, match=message):
        AlgorithmConfig(name="grpo", correction=fields)


def test_config_defaults_and_yaml_keys():
    cfg = AlgorithmConfig()
    assert cfg.correction.kind == "none"
    cfg = AlgorithmConfig(name="rec_gspo_is", correction={"kind": "icepop", "lower": 0.5, "upper": 5.0})
    assert (cfg.correction.kind, cfg.correction.lower, cfg.correction.upper) == ("icepop", 0.5, 5.0)
