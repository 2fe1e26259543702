"""The train-inference mismatch statistics (`megarl/metrics/mismatch.py`) against an independent numpy float64
reference: means and shares exactly (to float64 rounding), quantiles to the histogram's stated precision (half a
bin, 0.005 in log r, of numpy's `method="lower"` order statistic); masked-out tokens are ignored; microbatches and
data-parallel halves summed give the whole batch's numbers; the quantile reader at the histogram's edges. The
statistics in real runs' records are checked in `tests/test_end_to_end.py` (every step, lag 0 against
`logprob/engine_vs_trainer`) and through every trainer layout in `tests/test_trainer_invariance.py`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megarl.metrics import mismatch
from megarl.metrics.plot import plot_mismatch

HALF_BIN = mismatch.BIN_WIDTH / 2


def _random_batch(seed: int, rows: int = 64, cols: int = 50, scale: float = 0.3):
    """Engine log-probs of sampled tokens, trainer log-probs = engine + noise (some tokens far off, so the
    share outside [0.5, 2] is not zero), a ragged 0/1 mask; masked positions hold garbage that must not count."""
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 5
    delta = torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale
    delta[torch.rand(rows, cols, generator=g) < 0.05] *= 8  # a heavy tail: |log r| > log 2 for some tokens
    trainer = engine + delta
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None] < lengths[:, None]).float()
    trainer = torch.where(mask.bool(), trainer, torch.full_like(trainer, 123.0))  # garbage where masked
    engine = torch.where(mask.bool(), engine, torch.full_like(engine, -1e4))
    return trainer.float(), engine.float(), mask


def _reference(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """numpy float64, from the definitions: delta = logp_trainer - logp_engine, r = exp(delta), over masked tokens."""
    keep = mask.numpy().astype(bool)
    d = trainer.double().numpy()[keep] - engine.double().numpy()[keep]
    r = np.exp(d)
    ref = {"mismatch/abs_diff_mean": float(np.mean(np.abs(d))),
           "mismatch/k3_kl": float(np.mean(r - 1 - np.log(r))),
           "mismatch/ratio_outside_0.5_2": float(np.mean((r < 0.5) | (r > 2)))}
    for name, q in mismatch.QUANTILES.items():
        ref[f"mismatch/ratio_{name}"] = float(np.quantile(r, q, method="lower"))
    return ref


def _check(stats: dict, ref: dict) -> None:
    for key in ("mismatch/abs_diff_mean", "mismatch/k3_kl", "mismatch/ratio_outside_0.5_2"):
        assert stats[key] == pytest.approx(ref[key], rel=1e-12, abs=1e-15), key
    for name in mismatch.QUANTILES:
        key = f"mismatch/ratio_{name}"
        assert abs(math.log(stats[key]) - math.log(ref[key])) <= HALF_BIN + 1e-9, (key, stats[key], ref[key])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_match_a_numpy_reference(seed):
    trainer, engine, mask = _random_batch(seed)
    ref = _reference(trainer, engine, mask)
    assert 0 < ref["mismatch/ratio_outside_0.5_2"] < 0.2 and ref["mismatch/k3_kl"] > 0
    stats = mismatch.mismatch_stats(trainer, engine, mask)
    assert set(stats) == set(mismatch.KEYS)
    _check(stats, ref)
    # the default (linear) numpy quantile lies between the lower and higher order statistics: within a bin of those
    keep = mask.bool()
    r = np.exp(trainer.double().numpy()[keep.numpy()] - engine.double().numpy()[keep.numpy()])
    for name, q in mismatch.QUANTILES.items():
        lo, hi = np.quantile(r, q, method="lower"), np.quantile(r, q, method="higher")
        assert math.log(lo) - HALF_BIN - 1e-9 <= math.log(stats[f"mismatch/ratio_{name}"])
        assert math.log(stats[f"mismatch/ratio_{name}"]) <= math.log(hi) + HALF_BIN + 1e-9
        assert lo <= np.quantile(r, q) <= hi


def test_masked_tokens_are_ignored():
    trainer, engine, mask = _random_batch(3)
    stats = mismatch.mismatch_stats(trainer, engine, mask)
    keep = mask.bool()
    other_trainer = torch.where(keep, trainer, torch.full_like(trainer, -50.0))
    other_engine = torch.where(keep, engine, torch.full_like(engine, 7.0))
    assert mismatch.mismatch_stats(other_trainer, other_engine, mask) == stats
    # the same tokens packed into one row, no padding at all
    flat = mismatch.mismatch_stats(trainer[keep][None], engine[keep][None], torch.ones(1, int(mask.sum())))
    for key in mismatch.KEYS:
        assert flat[key] == pytest.approx(stats[key], rel=1e-12), key


def _summed(parts: list[dict[str, torch.Tensor]]) -> dict:
    """What the trainer does with the contributions: sum over microbatches and ranks (`_sum_metrics`)."""
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    return mismatch.finish({k: (v if k == mismatch.HIST_KEY else float(v)) for k, v in total.items()})


def test_data_parallel_halves_and_microbatches_sum_to_the_whole():
    trainer, engine, mask = _random_batch(4)
    whole = mismatch.mismatch_stats(trainer, engine, mask)
    num_tokens = float(mask.sum())
    halves = [mismatch.token_contributions(trainer[s], engine[s], mask[s], num_tokens)
              for s in (slice(0, 32), slice(32, 64))]
    micro = [mismatch.token_contributions(trainer[i:i + 8], engine[i:i + 8], mask[i:i + 8], num_tokens)
             for i in range(0, 64, 8)]
    for parts in (halves, micro):
        assert torch.equal(sum(p[mismatch.HIST_KEY] for p in parts),
                           mismatch.token_contributions(trainer, engine, mask, num_tokens)[mismatch.HIST_KEY])
        summed = _summed(parts)
        for key in mismatch.KEYS:
            assert summed[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-15), key


def test_identical_log_probs_give_zero_mismatch():
    trainer, _, mask = _random_batch(5)
    stats = mismatch.mismatch_stats(trainer, trainer.clone(), mask)
    assert stats["mismatch/abs_diff_mean"] == 0 and stats["mismatch/k3_kl"] == 0
    assert stats["mismatch/ratio_outside_0.5_2"] == 0
    for name in mismatch.QUANTILES:  # log r = 0: the bin [-0.005, 0.005), read at its centre
        assert stats[f"mismatch/ratio_{name}"] == 1.0


def test_histogram_bins_and_quantile_reader_at_the_edges():
    x = torch.tensor([-math.inf, -10.5, -10.004, -9.996, -0.004, 0.0, 0.004, 0.006, 10.0, 10.006, math.inf,
                      math.nan], dtype=torch.float64)
    assert mismatch.NUM_BINS == 2003
    assert mismatch.log_ratio_bins(x).tolist() == [0, 0, 1, 1, 1001, 1001, 1001, 1002, 2001, 2002, 2002, 2002]
    counts = torch.zeros(mismatch.NUM_BINS, dtype=torch.float64)
    counts[0], counts[1001], counts[1002], counts[-1] = 10, 70, 10, 10
    assert mismatch.histogram_quantile(counts, 0.01) == math.exp(-10)  # underflow: "at most e^-10"
    assert mismatch.histogram_quantile(counts, 0.5) == 1.0  # the bin centred on log r = 0
    assert mismatch.histogram_quantile(counts, 0.85) == pytest.approx(math.exp(0.01))
    assert mismatch.histogram_quantile(counts, 0.99) == math.exp(10)  # overflow: "at least e^10"
    assert mismatch.histogram_quantile(torch.zeros(mismatch.NUM_BINS), 0.5) is None  # no tokens


def test_plot_mismatch_draws_a_run(tmp_path):
    records = [{"step": k, "batch_lag": k % 2, "mismatch/abs_diff_mean": 0.01 * k, "mismatch/k3_kl": 1e-4 * k,
                "mismatch/ratio_outside_0.5_2": 0.0, "mismatch/ratio_p01": 0.9, "mismatch/ratio_p10": 0.95,
                "mismatch/ratio_p50": 1.0, "mismatch/ratio_p90": 1.05, "mismatch/ratio_p99": 1.1,
                "mismatch/at_behaviour_weights": int(k % 2 == 0)} for k in range(6)]
    old = [{"step": 6, "batch_lag": 0}]  # a record from before the monitor existed: skipped
    plot_mismatch(records + old, tmp_path / "mismatch.png")
    assert (tmp_path / "mismatch.png").stat().st_size > 0
    plot_mismatch(old, tmp_path / "empty.png")  # nothing to draw: a figure that says so, no error
    assert (tmp_path / "empty.png").stat().st_size > 0
