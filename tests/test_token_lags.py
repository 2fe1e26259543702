"""Per-token lag metrics (megarl/metrics/token_lags.py) against hand counts, and the per-token versions carried into
the trainer's padded batch and microbatches (megarl/trainer/batching.py `pack_batch`)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.metrics import token_lags
from megarl.token_versions import TokenVersions
from megarl.trainer.batching import pack_batch, pack_microbatch, select_microbatch

TRAINER = 5
BOUND = 2
# lags per token: [1, 1, 1, 0, 0], [0, 0, 0, 0], [2, 2], [2, 1, 0]
TV = [TokenVersions(((4, 3), (5, 2))), TokenVersions.single(5, 4), TokenVersions.single(3, 2),
      TokenVersions(((3, 1), (4, 1), (5, 1)))]


def test_histogram_mean_max_and_spanning_share_by_hand():
    got = token_lags.token_lag_metrics(TV, TRAINER, BOUND)
    # lag 0: 2 + 4 + 1 tokens, lag 1: 3 + 1, lag 2: 2 + 1; 14 tokens; 2 of 4 responses span versions
    assert got == {"token_lag/tokens_lag0": 7, "token_lag/tokens_lag1": 4, "token_lag/tokens_lag2": 3,
                   "token_lag/mean": (4 * 1 + 3 * 2) / 14, "token_lag/max": 2, "token_lag/spanning_share": 0.5}
    assert token_lags.token_lag_metrics(TV[1:2], TRAINER, 3) == {
        "token_lag/tokens_lag0": 4, "token_lag/tokens_lag1": 0, "token_lag/tokens_lag2": 0, "token_lag/tokens_lag3": 0,
        "token_lag/mean": 0.0, "token_lag/max": 0, "token_lag/spanning_share": 0.0}
    with pytest.raises(ValueError, match="outside 0..1"):
        token_lags.token_lag_metrics(TV, TRAINER, 1)


LN2 = math.log(2.0)
# per response, per token: (lag, delta = logp_trainer - logp_engine)
TOKENS = [
    [(1, 0.3), (1, -0.2), (1, LN2 + 0.1), (0, 1e-6), (0, -2e-6)],
    [(0, 0.0), (0, 3e-6), (0, -1e-6), (0, 0.0)],
    [(2, -0.8), (2, 0.5)],
    [(2, 1.1), (1, -LN2 + 0.05), (0, 1e-6)],
]


def _tensors():
    b, s = len(TOKENS), 6
    trainer, engine, mask = (torch.zeros(b, s, dtype=torch.float64) for _ in range(3))
    lags = torch.full((b, s), 99, dtype=torch.long)  # padding holds a lag outside the bound: it must be ignored
    for i, row in enumerate(TOKENS):
        for t, (lag, delta) in enumerate(row):
            trainer[i, t + 1] = -1.0 - 0.1 * t
            engine[i, t + 1] = trainer[i, t + 1] - delta
            mask[i, t + 1], lags[i, t + 1] = 1.0, lag
    return trainer, engine, mask, lags


def _hand(lag: int) -> dict[str, float | None]:
    deltas = [d for row in TOKENS for k, d in row if k == lag]
    if not deltas:
        return {f"mismatch/lag{lag}/{key}": None for key in ("abs_diff_mean", "k3_kl", "ratio_outside_0.5_2")}
    n = len(deltas)
    return {f"mismatch/lag{lag}/abs_diff_mean": sum(abs(d) for d in deltas) / n,
            f"mismatch/lag{lag}/k3_kl": sum(math.exp(d) - 1 - d for d in deltas) / n,
            f"mismatch/lag{lag}/ratio_outside_0.5_2": sum(math.exp(d) < 0.5 or math.exp(d) > 2 for d in deltas) / n}


def test_mismatch_per_segment_by_hand_and_summed_over_microbatches():
    trainer, engine, mask, lags = _tensors()
    halves = [token_lags.segment_contributions(trainer[rows], engine[rows], mask[rows], lags[rows], 3)
              for rows in (slice(0, 1), slice(1, 4))]  # 2 microbatches, a bound of 3 (no token at lag 3)
    summed = {k: halves[0][k] + halves[1][k] for k in token_lags.SEGMENT_KEYS}
    got = token_lags.finish_segments({"loss": 1.0, **summed}, 3)
    want = {"loss": 1.0}
    for lag in range(4):
        want.update(_hand(lag))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == (None if value is None else pytest.approx(value, rel=1e-9, abs=1e-15)), key
    assert got["mismatch/lag1/ratio_outside_0.5_2"] == 0.25  # exp(ln2 + 0.1) > 2 only
    assert got["mismatch/lag2/ratio_outside_0.5_2"] == 2 / 3  # exp(-0.8) < 0.5, exp(1.1) > 2


def test_a_bound_of_zero_sums_to_a_float():
    """With bound 0 each vector has one element, which the trainer's metric sum returns as a float."""
    trainer, engine, mask, lags = _tensors()
    keep = (lags == 0) & mask.bool()
    c = token_lags.segment_contributions(trainer, engine, keep.double(), torch.where(keep, lags, 0), 0)
    got = token_lags.finish_segments({k: float(v) for k, v in c.items()}, 0)
    assert got == {k: pytest.approx(v, rel=1e-9, abs=1e-15) for k, v in _hand(0).items()}
    with pytest.raises(ValueError, match="outside 0..0"):
        token_lags.segment_contributions(trainer, engine, mask, lags, 0)


def test_pack_batch_aligns_versions_with_the_response_tokens():
    prompts = [[5, 6], [7], [8, 9, 10], [11, 12]]
    responses = [[20, 21, 22, 23, 24], [25, 26, 27, 28], [29, 30], [31, 32, 33]]
    batch = RolloutBatch(index=0, prompt_ids=prompts, response_ids=responses,
                         engine_logprobs=[[-0.5] * len(r) for r in responses],
                         rewards=torch.zeros(2, 2), advantages=torch.zeros(2, 2), policy_version=3, token_versions=TV)
    packed = pack_batch(batch, pad_id=0)
    versions, mask = packed["token_versions"], packed["mask"]
    assert versions.shape == mask.shape and versions.dtype == torch.long
    for i, tv in enumerate(TV):
        assert versions[i][mask[i].bool()].tolist() == tv.per_token()  # response token j at prompt_len - 1 + j
        assert (versions[i][~mask[i].bool()] == -1).all()
    assert versions[0].tolist()[:7] == [-1, 4, 4, 4, 5, 5, -1]
    mb = pack_microbatch(select_microbatch(packed, [1, 3], width=5), length=10, pad_id=0)
    assert torch.equal(mb["token_versions"], versions[[1, 3], :5])
    assert "token_versions" not in pack_batch(
        RolloutBatch(**{**batch.__dict__, "token_versions": None}), pad_id=0)
    short = [*TV[:3], TokenVersions(((3, 1), (4, 1)))]  # 2 versions recorded for a 3-token response
    with pytest.raises(ValueError, match="sample 3: 2 token_versions for a response of 3 tokens"):
        pack_batch(RolloutBatch(**{**batch.__dict__, "token_versions": short}), pad_id=0)
