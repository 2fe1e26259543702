"""The three ways `megarl bench logprob` compares to get per-token log-probs and the entropy from vocabulary-sharded
logits (`sharded`, `gathered`, `megatron`; see `megarl.bench.logprob`). Both log-prob benches use them: the one from
the logits (`megarl.bench.logprob`) and the one from the hidden states (`megarl.bench.output_logprob`), which import
this module and not each other."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sharded_logprobs_entropy(shard: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                             chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy

    return vocab_parallel_logprobs_entropy(shard, targets, group, chunk_size=chunk_tokens)


def gathered_logprobs_entropy(shard: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                              chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary gathered on every rank, then the dense textbook formulas."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(shard, group=group)  # [tokens, V] on every rank
    logp_all = torch.log_softmax(full.float(), dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _all_gather_stack(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[3, N]` per rank -> `[tp, 3, N]`, the same on every rank."""
    if dist.get_world_size(group) == 1:
        return local[None]
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts)


class _ShardEntropy(torch.autograd.Function):
    """`logits [N, V/tp]` -> entropy `[N]`, next to megatron's `vocab_parallel_cross_entropy`, which returns
    only -log p(y) and keeps its max, sum and softmax to itself (nothing to reuse from outside).

    What it costs on top of megatron's cross entropy (3 all_reduces: max, target logit, sum of exp):
    ONE more collective, an all_gather of each rank's per-token (local max m_r, Z_r = sum e^(z - m_r),
    S_r = sum e^(z - m_r) (z - m_r)), 3 floats per token per rank, from which every rank rescales to the
    global max (a global max first would take two all_reduces instead); a second pass of max/exp over the
    shard; and a second saved `[N, V/tp]` fp32 softmax for backward, next to megatron's own. Backward needs
    no collective: dH/dz_k = -p_k (log p_k + H)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        z = logits.float()
        local_max = z.max(dim=-1).values
        z = z - local_max[:, None]  # a new tensor: megatron's cross entropy reuses the logits' storage
        e = z.exp()
        stats = _all_gather_stack(torch.stack([local_max, e.sum(-1), (e * z).sum(-1)]), group)
        m_r, z_r, s_r = stats[:, 0], stats[:, 1], stats[:, 2]
        m = m_r.max(dim=0).values
        # scale_r = e^(m_r - m): Z = sum_r scale_r Z_r, sum e^(z - m)(z - m) = sum_r scale_r (S_r + (m_r - m) Z_r)
        scale = (m_r - m).exp()
        sum_e = (scale * z_r).sum(0)
        log_z = sum_e.log()
        entropy = log_z - (scale * (s_r + (m_r - m) * z_r)).sum(0) / sum_e
        p = e.mul_((local_max - m - log_z).exp()[:, None])  # p_k = e^(z_k - m_r) e^(m_r - m) / Z, in place
        ctx.save_for_backward(p, entropy)
        ctx.dtype = logits.dtype
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        p, entropy = ctx.saved_tensors
        grad = torch.xlogy(p, p).add_(p * entropy[:, None]).mul_(-grad_entropy[:, None])
        return grad.to(ctx.dtype), None


def megatron_logprobs_entropy(shard: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                              chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's cross entropy for log p(y), `_ShardEntropy` for H. The entropy runs first: on fp32
    logits megatron subtracts the max and exponentiates IN PLACE (its softmax, saved for backward, lives in
    the logits' storage), so the logits are gone once it has run; bf16 logits are copied to fp32 first."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    entropy = _ShardEntropy.apply(shard, group)
    logp = -vocab_parallel_cross_entropy(shard, targets)  # megatron reads the TP group from parallel_state
    return logp, entropy


METHOD_FNS = {"sharded": sharded_logprobs_entropy, "gathered": gathered_logprobs_entropy,
               "megatron": megatron_logprobs_entropy}
