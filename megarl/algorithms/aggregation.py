"""Loss aggregation (`algorithm.loss_agg`): how a per-token loss matrix becomes this microbatch's
contribution to the global-batch loss.

Every normaliser is a property of the GLOBAL batch (all microbatches of all data-parallel ranks),
never of the microbatch, so summing the returned contributions over any split of the global batch
gives the same loss and gradients:

| `loss_agg`            | contribution of a microbatch                            | normaliser            |
|-----------------------|---------------------------------------------------------|-----------------------|
| `token-mean`          | `sum_{i,t} l_i^t / T`                                   | `T` global resp. tokens |
| `seq-mean-token-mean` | `sum_i (sum_t l_i^t / abs(y_i)) / N`                    | `N` global sequences  |
| `seq-mean-token-sum`  | `sum_i sum_t l_i^t / N`                                 | `N`                   |
| `constant`            | `sum_{i,t} l_i^t / (N * C)` (Dr. GRPO, Liu et al. 2025) | `N * C`, `C` a constant |

`token-mean` is the REC paper's implementation choice (its footnote 1); `seq-mean-token-sum` is the
response-wise formula of REC eq. (1a)/Table 3 (`(1/K) sum_i (...) log pi(y_i|x)` per group);
`constant` with `C` = the generation budget is Dr. GRPO's length-unbiased normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAggName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
LOSS_AGGS: tuple[LossAggName, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")


@dataclass(frozen=True)
class Aggregation:
    kind: LossAggName = "token-mean"
    constant: float = 1.0  # `C` of the `constant` normaliser (ignored by the others)


def sequence_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, S] -> [B]`: `sum_t values_i^t` over each row's response tokens (a sequence log-prob for log-probs)."""
    return (values * mask).sum(-1)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, S] -> [B]`: `mean_t values_i^t` over each row's response tokens (`mean_t`; rows without any -> 0)."""
    return sequence_sum(values, mask) / mask.sum(-1).clamp(min=1)


def aggregate_tokens(
    per_token: torch.Tensor, mask: torch.Tensor, agg: Aggregation, num_seqs: int, num_tokens: int
) -> torch.Tensor:
    """Contribution `[]` of a microbatch's per-token loss `[B, S]` (masked by `mask [B, S]`) to the global
    loss, normalised by the GLOBAL `num_seqs` / `num_tokens` as in the module table."""
    if agg.kind == "token-mean":
        if num_tokens <= 0:
            raise ValueError("loss_agg='token-mean' needs PolicyLossInput.num_tokens (global response tokens) > 0")
        return sequence_sum(per_token, mask).sum() / num_tokens
    if agg.kind == "seq-mean-token-mean":
        return sequence_mean(per_token, mask).sum() / num_seqs
    if agg.kind == "seq-mean-token-sum":
        return sequence_sum(per_token, mask).sum() / num_seqs
    if agg.kind == "constant":
        return sequence_sum(per_token, mask).sum() / (num_seqs * agg.constant)
    raise ValueError(f"unknown loss_agg {agg.kind!r}; choose one of {', '.join(LOSS_AGGS)}")
