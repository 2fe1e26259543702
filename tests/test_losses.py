"""REC-GSPO / GSPO: the gradient w.r.t. the per-token log-probs equals the paper's `g`, written out here
independently (REC appendix B.7 / GSPO), on hand-built groups with masks at the clip boundaries,
zero advantages and uneven lengths; and EVERY registered algorithm is split-invariant over microbatches
for every loss_agg (the token-level losses' gradients are checked in test_algorithms_gradients.py)."""

import math

import pytest
import torch

from megarl.algorithms.advantages import group_mean_advantages, group_normalized_advantages
from megarl.algorithms.losses import ClipParams, PolicyLossInput, rec_gspo_is_loss, rec_gspo_nois_loss
from megarl.algorithms.registry import ALGORITHMS, get_algorithm
from megarl.config.schema import AlgorithmConfig

CLIP = ClipParams(eps_low=0.2, eps_high=0.3)


def _case():
    """Four sequences of lengths 3, 1, 2, 3 (S = 3) whose sequence ratios sit on both sides of the band."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1.0]])
    lengths = mask.sum(-1)
    # mean log-ratio per sequence: log(1.1) inside, log(1.5) above 1+eps_high, log(0.7) below 1-eps_low, 0
    targets = [math.log(1.1), math.log(1.5), math.log(0.7), 0.0]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0, 0], [-0.3, -2.5, 0], [-1.2, -0.1, -3.0]])
    noise = torch.tensor([[0.05, -0.02, -0.03], [0, 0, 0], [0.1, -0.1, 0], [0.2, -0.1, -0.1]])
    shift = torch.tensor(targets)[:, None]
    logp = ((old + shift + noise) * mask).requires_grad_(True)
    adv = torch.tensor([1.0, 0.5, -0.7, 0.0])
    return logp, old * mask, mask, lengths, adv


def _reference_grad(logp, old, mask, lengths, adv, with_is):
    """g_i^t = -(1/N) A_i M_i [s_i] / |y_i| for each response token (the loss gradient, sign of minimisation)."""
    n = logp.shape[0]
    grad = torch.zeros_like(logp)
    for i in range(n):
        s = math.exp(float(((logp[i] - old[i]) * mask[i]).sum() / lengths[i]))
        a = float(adv[i])
        m = 1.0 if (a > 0 and s <= 1 + CLIP.eps_high) or (a < 0 and s >= 1 - CLIP.eps_low) else 0.0
        w = s if with_is else 1.0
        for t in range(logp.shape[1]):
            if mask[i, t]:
                grad[i, t] = -a * m * w / float(lengths[i]) / n
    return grad


@pytest.mark.parametrize(("fn", "with_is"), [(rec_gspo_is_loss, True), (rec_gspo_nois_loss, False)])
def test_gradient_matches_paper_formula(fn, with_is):
    logp, old, mask, lengths, adv = _case()
    loss, metrics = fn(PolicyLossInput(logp, old, mask, adv, num_seqs=4, num_tokens=9), CLIP)
    loss.backward()
    expected = _reference_grad(logp.detach(), old, mask, lengths, adv, with_is)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-7)
    # sequence 1 (A>0, s=1.5 > 1.3) and 2 (A<0, s=0.7 < 0.8) are clipped; 3 has A=0 and does not count
    assert metrics["clip_frac"].item() == pytest.approx(2 / 4)


def test_ratio_exactly_on_the_boundary_keeps_the_gradient():
    mask = torch.ones(2, 1)
    old = torch.zeros(2, 1)
    logp = torch.tensor([[math.log(1 + CLIP.eps_high)], [math.log(1 - CLIP.eps_low)]], dtype=torch.float64)
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = rec_gspo_nois_loss(PolicyLossInput(logp, old.double(), mask.double(), adv, 2), CLIP)
    loss.backward()
    assert torch.all(logp.grad != 0)


def _split_case():
    """A global batch of 8 sequences (2 groups of 4) with uneven lengths, rewards with excess negatives,
    engine and reference log-probs that differ from the behaviour ones; group 2 has zero variance."""
    g = torch.Generator().manual_seed(0)
    n, s = 8, 5
    mask = (torch.rand(n, s, generator=g) > 0.3).double()
    mask[:, 0] = 1
    old = -torch.rand(n, s, generator=g, dtype=torch.float64) * mask
    logp = (old + 0.3 * torch.randn(n, s, generator=g, dtype=torch.float64)) * mask
    engine = (old + 0.05 * torch.randn(n, s, generator=g, dtype=torch.float64)) * mask
    ref = (old + 0.1 * torch.randn(n, s, generator=g, dtype=torch.float64)) * mask
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)  # 2nd: sigma = 0
    return logp, old, mask, engine, ref, rewards


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_microbatch_split_invariance(name, agg):
    """1 x 8, 2 x 4 and 4 x 2 microbatches (or data-parallel ranks) give the same loss, gradient and
    metrics for every registered algorithm and every loss_agg."""
    from megarl.config.schema import AlgorithmConfig

    algo = get_algorithm(name)
    cfg = AlgorithmConfig(name=name, loss_agg=agg, loss_agg_constant=4.0, oapl_beta2=0.5)
    logp, old, mask, engine, ref, rewards = _split_case()
    n = logp.shape[0]
    adv = algo.advantages(rewards, cfg).reshape(-1)
    seq_mask = algo.sequence_mask(rewards, cfg).reshape(-1)
    num_tokens = int(mask.sum())

    def run(splits):
        x = logp.clone().requires_grad_(True)
        total, metrics = 0.0, {}
        for rows in torch.tensor_split(torch.arange(n), splits):
            inp = PolicyLossInput(x[rows], old[rows], mask[rows], adv[rows], num_seqs=n, num_tokens=num_tokens,
                                  engine_logprobs=engine[rows], ref_logprobs=ref[rows], seq_mask=seq_mask[rows])
            loss, m = algo.loss(inp, cfg)
            loss.backward()
            total += loss.item()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v.item()
        return total, x.grad, metrics

    l1, g1, m1 = run(1)
    assert g1.abs().sum() > 0  # the case exercises a non-trivial gradient
    for splits in (2, 4):
        ls, gs, ms = run(splits)
        assert ls == pytest.approx(l1, rel=1e-12, abs=1e-14)
        torch.testing.assert_close(gs, g1, rtol=1e-12, atol=1e-14)
        assert ms == pytest.approx(m1, rel=1e-12, abs=1e-14)


def test_advantages_by_hand():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(group_mean_advantages(r), torch.tensor([[-0.5, 0.5, 0.5, -0.5], [0.0] * 4]))
    norm = group_normalized_advantages(r, eps=0.0)
    torch.testing.assert_close(norm[0], torch.tensor([-1.0, 1.0, 1.0, -1.0]))  # population std = 0.5
    assert torch.all(group_normalized_advantages(r)[1] == 0)  # zero-variance group gives zero advantage


@pytest.mark.parametrize("name", ["rec_gspo_is", "gspo"])
def test_gspo_loss_value_is_the_clipped_objective(name):
    """The logged loss is GSPO's objective `-(1/N) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)`,
    written out here per sequence: the clipped sequences 1 (A>0, s=1.5) and 2 (A<0, s=0.7) add `-clip(s) A`, not 0."""
    logp, old, mask, lengths, adv = _case()
    loss, _ = rec_gspo_is_loss(PolicyLossInput(logp, old, mask, adv, num_seqs=4, num_tokens=9), CLIP)
    expected = 0.0
    for i in range(4):
        s = math.exp(float(((logp[i] - old[i]) * mask[i]).sum() / lengths[i]))
        a = float(adv[i])
        expected -= min(s * a, min(max(s, 1 - CLIP.eps_low), 1 + CLIP.eps_high) * a) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    cfg = AlgorithmConfig(name=name, eps_low=CLIP.eps_low, eps_high=CLIP.eps_high)
    registered, _ = get_algorithm(name).loss(PolicyLossInput(logp, old, mask, adv, num_seqs=4, num_tokens=9), cfg)
    assert registered.item() == pytest.approx(expected, rel=1e-6)
