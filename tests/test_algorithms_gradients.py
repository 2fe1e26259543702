"""Gradient fidelity: for every loss, autograd's gradient w.r.t. the per-token log-probs equals the paper's
gradient formula `g` (sign of minimisation), written out here with plain Python loops over sequences and
tokens and the masks re-derived from their definitions (REC eq. 8, 18-21; Table 3; OAPL; off-policy GRPO).

The hand-built microbatch has ratios exactly on every clip boundary (powers of two, so `exp(logp - old)`
is exact), inside and outside the bands, positive/negative/zero advantages (a zero-variance group), and
uneven response lengths with padding.
"""

import math

import pytest
import torch

from megarl.algorithms import losses
from megarl.algorithms.aggregation import LOSS_AGGS, Aggregation
from megarl.algorithms.clipping import CLIP_MASKS, ClipParams

CLIP = ClipParams(eps_low=0.5, eps_high=1.0, eps_low_outer=0.75, eps_high_outer=3.0)  # bounds 0.5, 2, 0.25, 4
LN2 = math.log(2.0)
# (old, logp) pairs whose ratio is exactly the boundary value
EXACT = {0.25: (0.0, -2 * LN2), 0.5: (0.0, -LN2), 2.0: (-LN2, 0.0), 4.0: (-2 * LN2, 0.0)}
RATIOS = [  # per sequence: its token ratios (length = response length)
    [0.25, 0.5, 2.0, 4.0],
    [0.25, 0.5, 2.0, 4.0],
    [0.1, 3.0, 1.0],
    [0.1, 5.0],
    [1.5],
    [0.3, 1.5, 5.0],
]
ADV = [1.0, -1.0, 0.5, -0.7, 0.0, 0.3]  # sequence 4: a zero-variance group (A = 0)
N_GLOBAL = 10  # pretend the global batch is larger than this microbatch
C = 3.0


def _case():
    b, s = len(RATIOS), max(len(r) for r in RATIOS)
    old = torch.zeros(b, s, dtype=torch.float64)
    logp = torch.zeros(b, s, dtype=torch.float64)
    mask = torch.zeros(b, s, dtype=torch.float64)
    for i, ratios in enumerate(RATIOS):
        for t, r in enumerate(ratios):
            o, lp = EXACT.get(r, (-1.0 - 0.1 * t, -1.0 - 0.1 * t + math.log(r)))
            old[i, t], logp[i, t], mask[i, t] = o, lp, 1.0
    for (i, t), r in zip([(0, 0), (0, 1), (0, 2), (0, 3)], RATIOS[0], strict=True):
        assert math.exp(logp[i, t] - old[i, t]) == r  # really on the boundary
    engine = (old - 0.05 * torch.arange(s, dtype=torch.float64)) * mask  # differs from old: OAPL must use it
    ref = (old + 0.2 - 0.1 * torch.arange(s, dtype=torch.float64)) * mask
    return logp, old, mask, torch.tensor(ADV, dtype=torch.float64), engine, ref


def _num_tokens(mask):
    return int(mask.sum()) + 7  # global token count (microbatch's plus other microbatches')


def _agg_weight(kind, i, mask):
    """d(aggregated loss) / d(per-token loss) for a response token of sequence i."""
    length = float(mask[i].sum())
    return {
        "token-mean": 1.0 / _num_tokens(mask),
        "seq-mean-token-mean": 1.0 / (N_GLOBAL * length),
        "seq-mean-token-sum": 1.0 / N_GLOBAL,
        "constant": 1.0 / (N_GLOBAL * C),
    }[kind]


def _ref_mask(kind, a, r):
    inside = 1 - CLIP.eps_low <= r <= 1 + CLIP.eps_high
    if kind == "onesided":
        return float((a > 0 and r <= 1 + CLIP.eps_high) or (a < 0 and r >= 1 - CLIP.eps_low))
    if kind == "twosided":
        return float(inside)
    return float(inside or (a > 0 and r <= 1 - CLIP.eps_low_outer) or (a < 0 and r >= 1 + CLIP.eps_high_outer))


def _reference(per_token_g, agg_kind, logp, old, mask):
    """Fill g_i^t = per_token_g(i, t, ratio) * aggregation weight on response tokens, 0 on padding."""
    grad = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = math.exp(float(logp[i, t] - old[i, t]))
                grad[i, t] = per_token_g(i, t, r) * _agg_weight(agg_kind, i, mask)
    return grad


def _inp(logp, old, mask, adv, **kw):
    return losses.PolicyLossInput(logp, old, mask, adv, num_seqs=N_GLOBAL, num_tokens=_num_tokens(mask), **kw)


def _grad(fn, *args, **kw):
    logp, old, mask, adv, engine, ref = _case()
    x = logp.clone().requires_grad_(True)
    loss, metrics = fn(_inp(x, old, mask, adv, **kw), *args)
    loss.backward()
    return x.grad, metrics, (logp, old, mask, adv, engine, ref)


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_reinforce(agg):
    grad, _, (logp, old, mask, adv, *_) = _grad(losses.reinforce_loss, Aggregation(agg, C))
    expected = _reference(lambda i, t, r: -ADV[i], agg, logp, old, mask)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("kind", ["onesided", "twosided", "ring"])
@pytest.mark.parametrize("with_is", [True, False])
def test_rec(kind, with_is, agg):
    grad, metrics, (logp, old, mask, *_) = _grad(losses.rec_loss, CLIP, CLIP_MASKS[kind], with_is, Aggregation(agg, C))

    def g(i, t, r):
        return -ADV[i] * _ref_mask(kind, ADV[i], r) * (r if with_is else 1.0)

    torch.testing.assert_close(grad, _reference(g, agg, logp, old, mask), rtol=1e-12, atol=1e-14)
    clipped = sum(1 - _ref_mask(kind, ADV[i], r) for i, rs in enumerate(RATIOS) for r in rs if ADV[i] != 0)
    assert metrics["clip_frac"].item() == pytest.approx(clipped / _num_tokens(mask))


def test_boundary_tokens_keep_their_gradient():
    """The inclusive boundaries: ratio exactly 1+eps_high with A>0, 1-eps_low with A<0 (one-side), and
    the ring's outer margins, all keep the gradient."""
    grad, *_ = _grad(losses.rec_loss, CLIP, CLIP_MASKS["onesided"], False, Aggregation("token-mean"))
    assert grad[0, 2] != 0 and grad[1, 1] != 0  # A>0 at ratio 2.0; A<0 at ratio 0.5
    assert grad[0, 3] == 0 and grad[1, 0] == 0  # beyond: A>0 at 4.0; A<0 at 0.25
    grad, *_ = _grad(losses.rec_loss, CLIP, CLIP_MASKS["ring"], False, Aggregation("token-mean"))
    assert grad[0, 0] != 0 and grad[1, 3] != 0  # ring: A>0 at 0.25 = 1-eps'_low; A<0 at 4.0 = 1+eps'_high


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_grpo_gradient_and_value(agg):
    grad, _, (logp, old, mask, *_) = _grad(losses.grpo_loss, CLIP, Aggregation(agg, C))
    expected = _reference(lambda i, t, r: -ADV[i] * r * _ref_mask("onesided", ADV[i], r), agg, logp, old, mask)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    # the value is PPO's min(ratio A, clip(ratio) A), written out
    loss, _ = losses.grpo_loss(_inp(logp, old, mask, torch.tensor(ADV, dtype=torch.float64)), CLIP,
                               Aggregation(agg, C))
    value = 0.0
    for i, rs in enumerate(RATIOS):
        for r in rs:
            clipped = min(max(r, 1 - CLIP.eps_low), 1 + CLIP.eps_high)
            value += -min(r * ADV[i], clipped * ADV[i]) * _agg_weight(agg, i, mask)
    assert loss.item() == pytest.approx(value, rel=1e-12)


def _dual_clip_objective(a, r, c):
    """Dual-clip PPO per token, as verl and Trinity-RFT write it: `min(r A, clip(r) A)`, and for `A < 0` its max with
    `c A`; its derivative in logp (dr/dlogp = r): `r A` where the `r A` branch is the one taken, else 0."""
    clipped = min(max(r, 1 - CLIP.eps_low), 1 + CLIP.eps_high)
    value = min(r * a, clipped * a)
    takes_ratio = r * a <= clipped * a  # the min picks r A (r = clip(r) included, where both pieces agree)
    if a < 0:
        takes_ratio = takes_ratio and value >= c * a  # the max keeps the min (r = c included)
        value = max(value, c * a)
    return value, (r * a if takes_ratio else 0.0)


@pytest.mark.parametrize("agg", LOSS_AGGS)
@pytest.mark.parametrize("c", [3.0, 4.0])  # 4.0: sequence 1's ratio-4 token sits exactly on the dual bound
def test_grpo_dual_clip_against_the_formula(agg, c):
    """l = -max(min(rA, clip(r)A), cA) for A<0 (sequences 1 and 3 have ratios 4 and 5 above c = 3), -min(rA, clip(r)A)
    for A>=0 (sequence 5's ratio 5 with A>0 is untouched): value and gradient against the formula written out."""
    grad, metrics, (logp, old, mask, adv, *_) = _grad(losses.grpo_loss, CLIP, Aggregation(agg, C), c)
    expected = _reference(lambda i, t, r: -_dual_clip_objective(ADV[i], r, c)[1], agg, logp, old, mask)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    loss, _ = losses.grpo_loss(_inp(logp, old, mask, adv), CLIP, Aggregation(agg, C), c)
    value = sum(-_dual_clip_objective(ADV[i], r, c)[0] * _agg_weight(agg, i, mask)
                for i, rs in enumerate(RATIOS) for r in rs)
    assert loss.item() == pytest.approx(value, rel=1e-12)
    capped = sum(ADV[i] < 0 and r > c for i, rs in enumerate(RATIOS) for r in rs)
    assert capped == (2 if c == 3.0 else 1)  # the test reaches the bound: ratios 4 and 5 above 3; 5 only above 4
    assert metrics["dual_clip_frac"].item() == pytest.approx(capped / _num_tokens(mask))
    if c == 4.0:
        assert grad[1, 3] != 0  # ratio exactly c with A<0 keeps its gradient
    plain, plain_metrics, _ = _grad(losses.grpo_loss, CLIP, Aggregation(agg, C))
    assert not torch.equal(plain, grad) and "dual_clip_frac" not in plain_metrics  # off by default


def test_off_policy_grpo_dual_clip():
    """The same bound in off-policy GRPO's surrogate, its KL term untouched (k1: gradient beta per token)."""
    beta, c = 0.3, 3.0
    grad, _, (logp, old, mask, *_) = _grad(losses.off_policy_grpo_loss, CLIP, beta, "k1", Aggregation("token-mean"),
                                           c)
    expected = _reference(lambda i, t, r: -_dual_clip_objective(ADV[i], r, c)[1] + beta, "token-mean", logp, old,
                          mask)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_dual_clip_is_configured_off_and_above_one():
    from megarl.algorithms.registry import get_algorithm
    from megarl.config.schema import AlgorithmConfig

    assert AlgorithmConfig(name="grpo").dual_clip is None
    with pytest.raises(ValueError, match="dual_clip"):
        AlgorithmConfig(name="grpo", dual_clip=1.0)
    logp, old, mask, adv, *_ = _case()
    cfg = AlgorithmConfig(name="grpo", eps_low=CLIP.eps_low, eps_high=CLIP.eps_high, dual_clip=3.0)
    registered, _ = get_algorithm("grpo").loss(_inp(logp, old, mask, adv), cfg)
    direct, _ = losses.grpo_loss(_inp(logp, old, mask, adv), CLIP, Aggregation("token-mean"), 3.0)
    assert registered.item() == direct.item()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_off_policy_grpo(estimator, agg):
    beta = 0.3
    logp, old, mask, adv, engine, ref = _case()
    z = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # sequence 4's group has sigma = 0
    grad, metrics, _ = _grad(losses.off_policy_grpo_loss, CLIP, beta, estimator, Aggregation(agg, C),
                             ref_logprobs=ref, seq_mask=z)

    def dkl(i, t):
        d = float(logp[i, t] - ref[i, t])
        return {"k1": 1.0, "k2": d, "k3": 1.0 - math.exp(-d)}[estimator]

    def g(i, t, r):
        return float(z[i]) * (-ADV[i] * r * _ref_mask("onesided", ADV[i], r) + beta * dkl(i, t))

    torch.testing.assert_close(grad, _reference(g, agg, logp, old, mask), rtol=1e-12, atol=1e-14)
    assert torch.all(grad[4] == 0)  # the zero-variance group contributes nothing, KL included
    kl = 0.0
    for i, rs in enumerate(RATIOS):
        for t in range(len(rs)):
            d = float(logp[i, t] - ref[i, t])
            kl += {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[estimator]
    assert metrics["kl"].item() == pytest.approx(kl / _num_tokens(mask), rel=1e-12)


def test_off_policy_grpo_reference_defaults_to_behaviour():
    """Without ref_logprobs the KL is to the behaviour (server) policy: k1 gradient is then beta * weight."""
    logp, old, mask, adv, *_ = _case()
    zero_adv = torch.zeros_like(adv)
    x = logp.clone().requires_grad_(True)
    loss, metrics = losses.off_policy_grpo_loss(_inp(x, old, mask, zero_adv), CLIP, 0.5, "k2",
                                                Aggregation("seq-mean-token-sum"))
    loss.backward()
    torch.testing.assert_close(x.grad, 0.5 * (logp - old) * mask / N_GLOBAL)


def _seq(values, mask, i):
    return sum(float(values[i, t]) for t in range(values.shape[1]) if mask[i, t])


def test_opmd_sequence():
    beta = 0.4
    grad, metrics, (logp, old, mask, *_) = _grad(losses.opmd_sequence_loss, beta)
    expected = torch.zeros_like(logp)
    sq = 0.0
    for i in range(logp.shape[0]):
        delta = _seq(logp, mask, i) - _seq(old, mask, i)
        sq += delta * delta
        for t in range(logp.shape[1]):
            if mask[i, t]:
                expected[i, t] = (-ADV[i] + beta * delta) / N_GLOBAL
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert metrics["opmd/sq_logratio"].item() == pytest.approx(sq / N_GLOBAL)


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_opmd_token(agg):
    """l_i^t = -A_i logp_i^t + beta (logp_i^t - oldlogp_i^t)^2 (the REC authors' code): gradient
    -A_i + 2 beta (logp - old) per token, value and metric written out."""
    beta = 0.4
    grad, metrics, (logp, old, mask, adv, *_) = _grad(losses.opmd_token_loss, beta, Aggregation(agg, C))

    def g(i, t, r):
        return -ADV[i] + 2 * beta * float(logp[i, t] - old[i, t])

    torch.testing.assert_close(grad, _reference(g, agg, logp, old, mask), rtol=1e-12, atol=1e-14)
    loss, _ = losses.opmd_token_loss(_inp(logp, old, mask, adv), beta, Aggregation(agg, C))
    value, sq = 0.0, 0.0
    for i, rs in enumerate(RATIOS):
        for t in range(len(rs)):
            d = float(logp[i, t] - old[i, t])
            value += (-ADV[i] * float(logp[i, t]) + beta * d * d) * _agg_weight(agg, i, mask)
            sq += d * d
    assert loss.item() == pytest.approx(value, rel=1e-12)
    assert metrics["opmd/sq_token_logratio"].item() == pytest.approx(sq / _num_tokens(mask), rel=1e-12)


def test_opmd_recipe_defaults_are_the_rec_authors_runs():
    """REC Fig. 10's OPMD ran the authors' Trinity-RFT REC loss with `regularizer: k2, regularizer_coef: 0.1`: the
    mean over the batch's response tokens of `-A logp + 0.1 (logp - old)^2`. `opmd_token` with the config defaults
    (beta 0.1, token-mean) is that loss; `opmd_sequence` (the paper's formula over summed log-probs) is not."""
    from megarl.algorithms.registry import get_algorithm
    from megarl.config.schema import AlgorithmConfig

    logp, old, mask, adv, *_ = _case()
    tokens = int(mask.sum())
    per_token = [(-ADV[i] * float(logp[i, t]) + 0.1 * float(logp[i, t] - old[i, t]) ** 2)
                 for i, rs in enumerate(RATIOS) for t in range(len(rs))]
    theirs = sum(per_token) / tokens
    inp = losses.PolicyLossInput(logp, old, mask, adv, num_seqs=len(RATIOS), num_tokens=tokens)
    ours, _ = get_algorithm("opmd_token").loss(inp, AlgorithmConfig(name="opmd_token"))
    assert ours.item() == pytest.approx(theirs, rel=1e-12)
    seq, _ = get_algorithm("opmd_sequence").loss(inp, AlgorithmConfig(name="opmd_sequence"))
    assert seq.item() != pytest.approx(theirs, rel=1e-3)


def test_oapl_uses_engine_logprobs():
    beta2 = 0.7
    logp, old, mask, adv, engine, _ = _case()
    grad, metrics, _ = _grad(losses.oapl_loss, beta2, engine_logprobs=engine)
    expected = torch.zeros_like(logp)
    value = 0.0
    for i in range(logp.shape[0]):
        residual = beta2 * (_seq(logp, mask, i) - _seq(engine, mask, i)) - ADV[i]
        value += residual**2 / N_GLOBAL
        for t in range(logp.shape[1]):
            if mask[i, t]:
                expected[i, t] = 2 * beta2 * residual / N_GLOBAL
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    x = logp.clone()
    loss, _ = losses.oapl_loss(_inp(x, old, mask, adv, engine_logprobs=engine), beta2)
    assert loss.item() == pytest.approx(value, rel=1e-12)
    # engine != old here, so using old would give a different gradient
    grad_old, *_ = _grad(losses.oapl_loss, beta2)
    assert not torch.allclose(grad_old, expected)


@pytest.mark.parametrize("with_is", [True, False])
def test_gspo_family_with_sequence_mask(with_is):
    """REC-GSPO gradient (REC B.7) on the boundary case, with one sequence masked out by seq_mask."""
    clip = ClipParams(eps_low=0.5, eps_high=1.0)
    logp, old, mask, adv, *_ = _case()
    z = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    fn = losses.rec_gspo_is_loss if with_is else losses.rec_gspo_nois_loss
    grad, *_ = _grad(fn, clip, seq_mask=z)
    expected = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        length = float(mask[i].sum())
        s = math.exp((_seq(logp, mask, i) - _seq(old, mask, i)) / length)
        m = float((ADV[i] > 0 and s <= 2.0) or (ADV[i] < 0 and s >= 0.5))
        for t in range(logp.shape[1]):
            if mask[i, t]:
                expected[i, t] = -float(z[i]) * ADV[i] * m * (s if with_is else 1.0) / length / N_GLOBAL
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["reinforce", "asymre", "red_weight", "pairwise_reinforce", "red_drop"])
def test_reweighted_reinforce_family_through_the_registry(name):
    """rewards -> registered advantages -> registered loss -> autograd, against REC Table 3's response-wise g
    for one group (loss_agg = seq-mean-token-sum and N = K, so the loss's 1/N is the papers' 1/K)."""
    from megarl.algorithms.registry import get_algorithm
    from megarl.config.schema import AlgorithmConfig

    beta, temp = 0.1, 0.5
    rewards = [1.0, 0.0, 0.0, 0.0] if name == "red_drop" else [1.0, 0.5, 0.0, 0.0]
    k = len(rewards)
    lengths = [3, 1, 2, 3]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(3)] for n in lengths], dtype=torch.float64)
    logp = (-0.5 * torch.rand(k, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)) * mask
    cfg = AlgorithmConfig(name=name, beta=beta, temperature=temp, loss_agg="seq-mean-token-sum")
    algo = get_algorithm(name)
    adv = algo.advantages(torch.tensor([rewards], dtype=torch.float64), cfg).reshape(-1)
    x = logp.clone().requires_grad_(True)
    loss, _ = algo.loss(losses.PolicyLossInput(x, logp.clone(), mask, adv, num_seqs=k, num_tokens=sum(lengths)), cfg)
    loss.backward()

    rbar = sum(rewards) / k
    if name == "reinforce":
        coef = [(r - rbar) / k for r in rewards]
    elif name == "asymre":
        coef = [(r - (rbar - beta)) / k for r in rewards]
    elif name == "red_weight":  # Table 3: sum_i w_i (r_i - rbar), with the loss's 1/K
        coef = [math.exp((r - rbar) / temp) * (r - rbar) / k for r in rewards]
    elif name == "pairwise_reinforce":
        w = [[math.exp((ri - rbar) / temp + (rj - rbar) / temp) / k for rj in rewards] for ri in rewards]
        coef = []
        for i in range(k):
            row = sum(w[i])
            coef.append(row * (rewards[i] - sum(w[i][j] * rewards[j] for j in range(k)) / row) / k)
    else:  # RED-Drop eq. 10: 1 positive, so one of the three negatives is kept; which one is random
        kept_neg = [i for i in range(1, k) if x.grad[i, 0] != 0]
        assert len(kept_neg) == 1
        s = [0, *kept_neg]
        rbar_s = sum(rewards[i] for i in s) / len(s)
        coef = [(rewards[i] - rbar_s) / len(s) if i in s else 0.0 for i in range(k)]
    expected = torch.tensor([[-coef[i] if t < lengths[i] else 0.0 for t in range(3)] for i in range(k)],
                            dtype=torch.float64)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-14)
