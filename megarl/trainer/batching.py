"""From a `RolloutBatch` to padded trainer tensors, this data-parallel rank's share, and microbatches.

Token layout per sequence: `tokens = prompt + response` (right-padded); position `t` predicts
`targets[t] = tokens[t+1]`; `mask[t] = 1` exactly where `targets[t]` is a response token, and
`old_logprobs[t]` is the engine's log-prob of that token.
"""

from __future__ import annotations

import torch

from megarl.rollout.batch import RolloutBatch


def pack_batch(batch: RolloutBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """Tensors of the whole global batch: tokens/targets/mask/old_logprobs `[N, S]`, advantages `[N]`."""
    seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
    n, s = len(seqs), max(len(q) for q in seqs)
    tokens = torch.full((n, s), pad_id, dtype=torch.long)
    targets = torch.full((n, s), pad_id, dtype=torch.long)
    mask = torch.zeros(n, s)
    old = torch.zeros(n, s)
    for i, (prompt, response, lps) in enumerate(
        zip(batch.prompt_ids, batch.response_ids, batch.engine_logprobs, strict=True)
    ):
        seq = prompt + response
        tokens[i, : len(seq)] = torch.tensor(seq)
        targets[i, : len(seq) - 1] = torch.tensor(seq[1:])
        first, last = len(prompt) - 1, len(seq) - 1  # positions predicting the response tokens
        mask[i, first:last] = 1.0
        old[i, first:last] = torch.tensor(lps, dtype=torch.float32)
    return {"tokens": tokens, "targets": targets, "mask": mask, "old_logprobs": old,
            "advantages": batch.advantages.reshape(-1).float()}


def data_parallel_share(tensors: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """Contiguous rows `[dp_rank*N/dp, (dp_rank+1)*N/dp)` of every tensor (N must divide evenly)."""
    n = next(iter(tensors.values())).shape[0]
    if n % dp_size:
        raise ValueError(f"global batch of {n} sequences does not split over {dp_size} data-parallel ranks; "
                         "make data.prompts_per_step * rollout.samples_per_prompt a multiple of it")
    per = n // dp_size
    return {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in tensors.items()}


def microbatches(tensors: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[i:i + size] for k, v in tensors.items()} for i in range(0, n, size)]
