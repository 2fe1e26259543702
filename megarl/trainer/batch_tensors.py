"""A rollout batch as a small fixed set of flat tensors, and its broadcast from trainer rank 0 to every rank.

Rank 0 holds the `RolloutBatch` (lists of token ids and log-probs per sample); the step needs it on every trainer
rank. `batch_to_tensors` flattens it once into `BatchTensors`: the samples' tokens concatenated (prompt then
response, sample after sample), their prompt and response lengths, the engine log-probs of the response tokens
concatenated, the advantages, the engine's routed experts concatenated with their per-sample lengths (when the
batch has them), and every per-response-token field of `RESPONSE_TOKEN_FIELDS` (e.g. each token's policy version,
`megarl.token_versions`) concatenated like the log-probs. The scalar metadata the loop and the step read (index,
policy version, rewards, reward timeouts and flags) rides in a small header with the tensors' names, shapes and
dtypes.

`broadcast_batch` sends the header (one small pickled object) and then each tensor with `dist.broadcast`, on the
device the collectives run on (NCCL takes CUDA tensors only; the host copies are pinned and non-blocking there);
the other ranks allocate the tensors from the header and receive them directly, with no pickled batch and no
Python loop over samples. `megarl.trainer.batching.pack_tensors` turns them into the padded `[N, S]` trainer
tensors with indexed writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from megarl.batch import RolloutBatch
from megarl.token_versions import TokenVersions
from megarl.trainer.placement import to_device

# Per-response-token fields beyond the engine log-probs: name -> (the values of each response, one per token, or
# None when the batch has none; their dtype; the value off the response). Each is flattened as `response/<name>`
# and packed by `megarl.trainer.batching.pack_tensors` as `<name> [N, S]`, aligned with `old_logprobs`.
RESPONSE_TOKEN_FIELDS: dict[str, tuple[Callable[[RolloutBatch], list[list[int]] | list[list[float]] | None],
                                       torch.dtype, float]] = {
    # each response token's policy version (megarl.token_versions), -1 where there is no response token
    "token_versions": (lambda b: None if b.token_versions is None else [v.per_token() for v in b.token_versions],
                       torch.long, -1),
}
RESPONSE_PREFIX = "response/"


@dataclass
class BatchTensors:
    """A batch's flat tensors (module docstring) and its header's metadata."""

    meta: dict[str, Any]  # index, policy_version, rewards (nested list) and rewards_dtype, reward_timeouts, flags
    tensors: dict[str, torch.Tensor]

    @property
    def num_seqs(self) -> int:
        return self.tensors["prompt_lengths"].shape[0]

    @property
    def policy_version(self) -> int:
        return self.meta["policy_version"]

    @property
    def rewards(self) -> torch.Tensor:
        """`[G, K]` in the batch's dtype."""
        return torch.tensor(self.meta["rewards"], dtype=getattr(torch, self.meta["rewards_dtype"]))

    @property
    def token_versions(self) -> list[TokenVersions] | None:
        """Each response's `TokenVersions`, rebuilt from the flat per-token versions (None: the batch has none)."""
        flat = self.tensors.get(RESPONSE_PREFIX + "token_versions")
        if flat is None:
            return None
        out = []
        for versions in flat.cpu().split(self.tensors["response_lengths"].cpu().tolist()):
            runs, counts = torch.unique_consecutive(versions, return_counts=True)
            out.append(TokenVersions(tuple(zip(runs.tolist(), counts.tolist(), strict=True))))
        return out

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """The engine's routes of every sample, concatenated `[sum T_i, layers, k]` (None: the batch has none)."""
        return self.tensors.get("routed_experts")


def _flat(values: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(list(chain.from_iterable(values)), dtype=dtype)


def _check_per_response(name: str, values: list, batch: RolloutBatch) -> None:
    for i, (v, r) in enumerate(zip(values, batch.response_ids, strict=True)):
        if len(v) != len(r):
            raise ValueError(f"sample {i}: {len(v)} {name} for a response of {len(r)} tokens; the rollout side must "
                             "give one per response token")


def _check_routes(routed: list[torch.Tensor], lengths: list[int]) -> None:
    for i, (r, n) in enumerate(zip(routed, lengths, strict=True)):
        if not n - 1 <= r.shape[0] <= n:
            raise ValueError(f"sample {i}: routed experts for {r.shape[0]} tokens, expected {n - 1} or {n} (prompt "
                             "+ response); the engine must return routes for every prompt token "
                             "(routed_experts_prompt_start=0)")


def batch_to_tensors(batch: RolloutBatch) -> BatchTensors:
    """The batch's flat tensors (on the CPU) and header metadata; the advantages must be set."""
    if batch.advantages is None:
        raise ValueError("the batch has no advantages yet: add them (megarl.batch.with_advantages) before the step")
    _check_per_response("engine log-probs", batch.engine_logprobs, batch)
    prompt_lengths = [len(p) for p in batch.prompt_ids]
    if 0 in prompt_lengths:
        raise ValueError(f"sample {prompt_lengths.index(0)} has an empty prompt: the first response token needs a "
                         "position that predicts it")
    tensors = {
        "tokens": _flat([chain(p, r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)],
                        torch.long),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long),
        "response_lengths": torch.tensor([len(r) for r in batch.response_ids], dtype=torch.long),
        "engine_logprobs": _flat(batch.engine_logprobs, torch.float32),
        "advantages": batch.advantages.float().reshape(-1),
    }
    if batch.routed_experts is not None:
        _check_routes(batch.routed_experts, [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids,
                                                                              strict=True)])
        tensors["routed_experts"] = torch.cat(batch.routed_experts)
        tensors["route_lengths"] = torch.tensor([r.shape[0] for r in batch.routed_experts], dtype=torch.long)
    for name, (read, dtype, _) in RESPONSE_TOKEN_FIELDS.items():
        values = read(batch)
        if values is not None:
            _check_per_response(name, values, batch)
            tensors[RESPONSE_PREFIX + name] = _flat(values, dtype)
    meta = {"index": batch.index, "policy_version": batch.policy_version, "rewards": batch.rewards.tolist(),
            "rewards_dtype": str(batch.rewards.dtype).removeprefix("torch."),
            "reward_timeouts": batch.reward_timeouts, "reward_flags": dict(batch.reward_flags)}
    return BatchTensors(meta, tensors)


def as_batch_tensors(batch: RolloutBatch | BatchTensors) -> BatchTensors:
    return batch if isinstance(batch, BatchTensors) else batch_to_tensors(batch)


def broadcast_batch(batch: RolloutBatch | None, device: torch.device, src: int = 0,
                    group: dist.ProcessGroup | None = None) -> BatchTensors:
    """Rank `src`'s batch on every rank of `group` (default: the world) as `BatchTensors` on `device`: a header
    (metadata, tensor names, shapes and dtypes) with one `broadcast_object_list`, then each tensor with
    `dist.broadcast` into tensors the receivers allocate from the header. `batch` is read on `src` only."""
    sender = dist.get_rank() == src
    if sender:
        assert batch is not None, "the broadcasting rank must hold the batch"
        flat = batch_to_tensors(batch)
        tensors = {k: to_device(v.contiguous(), device) for k, v in flat.tensors.items()}
        header = [{"meta": flat.meta, "specs": [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]}]
    else:
        header = [None]
    dist.broadcast_object_list(header, src=src, group=group)
    if not sender:
        tensors = {k: torch.empty(shape, dtype=dtype, device=device) for k, shape, dtype in header[0]["specs"]}
    for t in tensors.values():
        if t.numel():  # as bytes: every dtype goes (gloo has no int16, the routes' wider dtype)
            dist.broadcast(t.view(-1).view(torch.uint8), src=src, group=group)
    return BatchTensors(header[0]["meta"], tensors)
