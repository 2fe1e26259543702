"""Per-token lag metrics of a batch whose responses carry per-token policy versions (in-flight weight updates,
`megarl.token_versions`): pure functions, recorded by the trainer where `RolloutBatch.token_versions` is set.

A token's lag is `trainer version - the version that sampled it` (the trainer's version when it consumes the batch,
before its update), an integer in `0..bound` (`algorithm.max_token_lag`, `megarl.algorithms.versions`; the trainer
has already refused anything outside). Over the batch's `T` response tokens and `R` responses:

| key | value |
|---|---|
| `token_lag/tokens_lag{k}`, `k = 0..bound` | response tokens at lag `k` (the histogram; every `k`, 0 when none) |
| `token_lag/mean` | `sum lag / T` |
| `token_lag/max` | the largest lag of any token |
| `token_lag/spanning_share` | share of the `R` responses whose tokens come from two or more versions |
| `mismatch/lag{k}/abs_diff_mean` | `sum |delta| / T_k` over the `T_k` tokens at lag `k` (None when `T_k = 0`) |
| `mismatch/lag{k}/k3_kl` | `sum (r - 1 - log r) / T_k`: k3 estimate of `KL(pi_engine || pi_trainer)` on the segment |
| `mismatch/lag{k}/ratio_outside_0.5_2` | share of the `T_k` tokens with `r < 0.5` or `r > 2` |

`delta = logp_trainer - logp_engine`, `r = exp(delta)` as in `megarl/metrics/mismatch.py` (whose batch-wide
statistics stay as they are); here the tokens are grouped by their lag, i.e. by the segment of each response that one
version sampled: lag 0 measures the numerics alone (the engine's version is the trainer's), lag `k > 0` numerics plus
`k` updates of staleness. The segment sums come from each microbatch as vectors over `k = 0..bound`
(`segment_contributions`), summed over microbatches and data-parallel ranks like the mismatch histogram, and turned
into the keys above by `finish_segments` (no ratio quantiles per segment).
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.token_versions import TokenVersions

PREFIX = "token_lag/"
SEGMENT_KEYS = ("token_lag/segment_tokens", "token_lag/segment_abs_diff", "token_lag/segment_k3",
                "token_lag/segment_outside")  # vectors over lags 0..bound, replaced by finish_segments


def token_lag_metrics(token_versions: list[TokenVersions], trainer_version: int, bound: int) -> dict[str, float]:
    """The histogram, mean, max and spanning share (module table) of a batch's per-token versions."""
    counts = [0] * (bound + 1)
    for i, tv in enumerate(token_versions):
        for (version, _), (lag, tokens) in zip(tv.runs, tv.lags(trainer_version), strict=True):
            if not 0 <= lag <= bound:
                raise ValueError(f"sample {i}: tokens of version {version} lag the trainer (version {trainer_version}) "
                                 f"by {lag}, outside 0..{bound} (megarl.algorithms.versions.check_token_versions "
                                 "refuses such a batch first)")
            counts[lag] += tokens
    total = sum(counts)
    out: dict[str, float] = {f"{PREFIX}tokens_lag{k}": c for k, c in enumerate(counts)}
    out[PREFIX + "mean"] = sum(k * c for k, c in enumerate(counts)) / total if total else 0.0
    out[PREFIX + "max"] = max((k for k, c in enumerate(counts) if c), default=0)
    out[PREFIX + "spanning_share"] = sum(tv.spans_versions for tv in token_versions) / len(token_versions)
    return out


def segment_contributions(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                          lags: torch.Tensor, bound: int) -> dict[str, torch.Tensor]:
    """One microbatch's per-lag sums (float64 vectors of `bound + 1`): tokens, `|delta|`, `r - 1 - log r`, tokens
    with `r` outside `[0.5, 2]`; `[B, S]` log-probs, 0/1 `mask`, integer `lags` (read on response tokens only)."""
    keep = mask.detach().bool()
    lag = lags[keep].long()
    if lag.numel() and (int(lag.min()) < 0 or int(lag.max()) > bound):
        raise ValueError(f"token lags {int(lag.min())}..{int(lag.max())} outside 0..{bound}")
    delta = (logp_trainer.detach().double() - logp_engine.detach().double())[keep]
    ratio = torch.exp(delta)
    n = bound + 1

    def per_lag(weights: torch.Tensor) -> torch.Tensor:
        return torch.bincount(lag, weights=weights.double(), minlength=n)

    return dict(zip(SEGMENT_KEYS, (per_lag(torch.ones_like(delta)), per_lag(delta.abs()), per_lag(ratio - 1 - delta),
                                   per_lag(((ratio < 0.5) | (ratio > 2)).double())), strict=True))


def finish_segments(metrics: dict[str, Any], bound: int) -> dict[str, Any]:
    """Summed `segment_contributions` -> `mismatch/lag{k}/*` per lag (None where no token has lag k); pops the
    vectors (a vector of one element, bound 0, comes back from the sum as a float)."""
    out = dict(metrics)
    tokens, abs_diff, k3, outside = (torch.as_tensor(out.pop(k), dtype=torch.float64).reshape(-1)
                                     for k in SEGMENT_KEYS)
    for k in range(bound + 1):
        t = float(tokens[k])
        out[f"mismatch/lag{k}/abs_diff_mean"] = float(abs_diff[k]) / t if t else None
        out[f"mismatch/lag{k}/k3_kl"] = float(k3[k]) / t if t else None
        out[f"mismatch/lag{k}/ratio_outside_0.5_2"] = float(outside[k]) / t if t else None
    return out
