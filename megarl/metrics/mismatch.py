"""The train-inference mismatch monitor: how far the trainer's log-probs of the sampled response tokens are from
the rollout engine's, over one consumed batch.

Per response token (the mask's ones) of the batch, with `logp_trainer` the trainer's log-prob of the sampled token
at its current weights and `logp_engine` the log-prob the engine reported when it sampled the token:

    delta = logp_trainer - logp_engine          (= log r)
    r     = exp(delta) = pi_trainer / pi_engine  (the token ratio; the tokens were sampled from pi_engine)

Statistics over the batch's `T` response tokens (each a key of the step's record):

| key | formula |
|---|---|
| `mismatch/abs_diff_mean` | `sum |delta| / T` |
| `mismatch/k3_kl` | `sum (r - 1 - log r) / T`: Schulman's k3 estimator of `KL(pi_engine || pi_trainer)` |
| `mismatch/ratio_outside_0.5_2` | share of tokens with `r < 0.5` or `r > 2` |
| `mismatch/ratio_p01` ... `ratio_p99` | quantiles 0.01, 0.1, 0.5, 0.9, 0.99 of `r` (from a histogram, below) |

The direction of the KL: the samples come from `pi_engine` and `E_{y ~ pi_engine}[r - 1] = sum_y pi_trainer(y) - 1
= 0`, so `E[r - 1 - log r] = E_{pi_engine}[log(pi_engine / pi_trainer)] = KL(pi_engine || pi_trainer)` of the
next-token distributions at each sampled prefix, averaged over the engine's tokens; each term is >= 0 (`x - 1 >=
log x`), so the estimate is unbiased and never negative.

Quantiles without gathering tokens: every token's `log r` goes into a fixed histogram, `NUM_BINS = 2003` bins: an
underflow bin (`log r < -10.005`), 2001 bins of width `BIN_WIDTH = 0.01` centred on `-10, -9.99, ..., 0, ..., 10`
(bin `i`, 1-based, holds `[c - 0.005, c + 0.005)` with centre `c = -10 + (i - 1) * 0.01`), and an overflow bin
(`log r >= 10.005`, and NaN). The counts are summed over microbatches and data-parallel ranks like every other
metric, then read as quantiles: the `q`-quantile is the centre of the bin holding the sorted token of 0-based rank
`floor(q * (T - 1))` (numpy's `method="lower"`), so inside `[-10.005, 10.005)` its `log r` is within
`BIN_WIDTH / 2 = 0.005` of the exact one: `r` to within a factor `exp(0.005)`, about 0.5 % relative. A bin is
centred on `log r = 0`, so ratios within `exp(+-0.005)` of 1 (pure numerics at lag 0) read exactly 1. A quantile in
the underflow (overflow) bin reads `exp(-10)` (`exp(10)`): "at most" ("at least") that.

`token_contributions` gives one microbatch's contributions (sums divided by the GLOBAL token count `T`, and raw
histogram counts), `finish` turns their sums into the scalar statistics; `mismatch_stats` does both for a whole
batch at once.
"""

from __future__ import annotations

import math

import torch

PREFIX = "mismatch/"
LOG_RATIO_LIMIT = 10.0
BIN_WIDTH = 0.01
NUM_INNER_BINS = round(2 * LOG_RATIO_LIMIT / BIN_WIDTH) + 1  # 2001, centred on -10, -9.99, ..., 10
NUM_BINS = NUM_INNER_BINS + 2  # + underflow + overflow
QUANTILES = {"p01": 0.01, "p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99}
HIST_KEY = PREFIX + "log_ratio_hist"  # summed over ranks, then replaced by the quantiles (never recorded)
KEYS = (PREFIX + "abs_diff_mean", PREFIX + "k3_kl", PREFIX + "ratio_outside_0.5_2",
        *(f"{PREFIX}ratio_{name}" for name in QUANTILES))


def log_ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """Bin index of each `log r` (long, 0 = underflow, NUM_BINS - 1 = overflow or non-finite)."""
    x = log_ratio.double()
    inner = torch.floor((x + LOG_RATIO_LIMIT + BIN_WIDTH / 2) * (1 / BIN_WIDTH)).clamp(-1, NUM_INNER_BINS) + 1
    inner = torch.where(torch.isnan(x), torch.full_like(x, NUM_BINS - 1), inner)
    return inner.long()


def token_contributions(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                        num_tokens: float) -> dict[str, torch.Tensor]:
    """One microbatch's share of the batch statistics: `[B, S]` log-probs and 0/1 `mask` (response tokens),
    `num_tokens` = response tokens of the whole (global) batch. Means come back as sums over this microbatch's
    tokens divided by `num_tokens`, the histogram as raw counts (float64 `[NUM_BINS]`); summing the dicts of every
    microbatch and rank gives the batch's, for `finish`. Computed where the log-probs are (the model's device), with
    shapes that do not depend on the mask, so nothing waits on the device."""
    keep = mask.detach().bool()
    delta = logp_trainer.detach().double() - logp_engine.detach().double()
    delta = torch.where(keep, delta, torch.zeros_like(delta))  # 0 off the response: adds 0 to every sum below
    ratio = torch.exp(delta)
    outside = ((ratio < 0.5) | (ratio > 2)) & keep
    # fixed shapes only (no boolean-mask indexing, no bincount): nothing here waits for the device to finish
    hist = torch.zeros(NUM_BINS, dtype=torch.float64, device=delta.device)
    hist.scatter_add_(0, log_ratio_bins(delta).reshape(-1), keep.to(torch.float64).reshape(-1))
    return {
        PREFIX + "abs_diff_mean": delta.abs().sum() / num_tokens,
        PREFIX + "k3_kl": (ratio - 1 - delta).sum() / num_tokens,
        PREFIX + "ratio_outside_0.5_2": outside.sum().double() / num_tokens,
        HIST_KEY: hist,
    }


def histogram_quantile(counts: torch.Tensor, q: float) -> float | None:
    """The `q`-quantile of `r` from the summed `log r` histogram (module docstring); None without tokens."""
    counts = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
    total = int(round(float(counts.sum())))
    if total == 0:
        return None
    rank = math.floor(q * (total - 1))  # 0-based rank of the order statistic
    cumulative = torch.cumsum(counts, 0)
    b = int(torch.searchsorted(cumulative, torch.tensor([rank + 0.5], dtype=torch.float64)))
    if b == 0:
        return math.exp(-LOG_RATIO_LIMIT)
    if b >= NUM_BINS - 1:
        return math.exp(LOG_RATIO_LIMIT)
    return math.exp(-LOG_RATIO_LIMIT + (b - 1) * BIN_WIDTH)  # the bin's centre


def finish(metrics: dict) -> dict:
    """Summed contributions -> the scalar statistics: pops the histogram, adds `mismatch/ratio_pXX`."""
    counts = metrics.pop(HIST_KEY)
    out = dict(metrics)
    for name, q in QUANTILES.items():
        out[f"{PREFIX}ratio_{name}"] = histogram_quantile(counts, q)
    return out


def mismatch_stats(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Every statistic of one whole batch (a single microbatch on a single rank)."""
    num_tokens = float(mask.sum())
    c = token_contributions(logp_trainer, logp_engine, mask, num_tokens)
    return finish({k: (v if k == HIST_KEY else float(v)) for k, v in c.items()})
