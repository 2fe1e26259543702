"""Per-token log-probs of target tokens and the exact entropy, from tensor-parallel vocabulary shards.

Each TP rank holds `logits[..., rank*V/tp : (rank+1)*V/tp]`. Nothing the size of the full vocabulary
is ever built on any rank: the softmax statistics are reduced across the group (one max, then one
sum of three per-token numbers), and tokens are processed in chunks so the fp32 temporaries are
`chunk_size x V/tp`. In the style of megatron-core's `tensor_parallel/cross_entropy.py`: tiny math
steps, an explicit process group.

With `z` the logits of one token, `Z = sum_v exp(z_v)`, `p = softmax(z)`:
    logp(y) = z_y - log Z                 d logp / dz_k = 1[k=y] - p_k
    H       = log Z - sum_v p_v z_v       d H / dz_k    = p_k (E_p[z] - z_k)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _vocab_range(local_vocab: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    return rank * local_vocab, (rank + 1) * local_vocab


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, chunk_size: int):
        start, stop = _vocab_range(logits.shape[-1], group)
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp)
        shift = torch.empty_like(logp)  # global max logit per token
        log_z = torch.empty_like(logp)  # log sum exp(z - shift)
        mean_z = torch.empty_like(logp)  # E_p[z - shift]
        for lo in range(0, n, chunk_size):
            z = logits[lo:lo + chunk_size].float()
            t = targets[lo:lo + chunk_size]
            # m = max_v z_v over all shards (subtracted for stability)
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            z = z - m[:, None]
            e = z.exp()
            # this shard's share of: Z, sum_v exp(z_v) z_v, and the target logit (0 if the target lives elsewhere)
            in_shard = (t >= start) & (t < stop)
            local_t = torch.where(in_shard, t - start, torch.zeros_like(t))
            target_z = z.gather(-1, local_t[:, None]).squeeze(-1) * in_shard
            stats = torch.stack([e.sum(-1), (e * z).sum(-1), target_z])
            sum_e, sum_ez, z_y = _all_reduce(stats, dist.ReduceOp.SUM, group)
            # log p(y) = z_y - log Z ;  H = log Z - E_p[z]
            lz = sum_e.log()
            logp[lo:lo + chunk_size] = z_y - lz
            entropy[lo:lo + chunk_size] = lz - sum_ez / sum_e
            shift[lo:lo + chunk_size], log_z[lo:lo + chunk_size] = m, lz
            mean_z[lo:lo + chunk_size] = sum_ez / sum_e
        ctx.save_for_backward(logits, targets, shift, log_z, mean_z)
        ctx.chunk_size, ctx.start, ctx.stop = chunk_size, start, stop
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        logits, targets, shift, log_z, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(lo, lo + ctx.chunk_size)
            # p_k = exp(z_k - m - log Z), recomputed instead of stored
            z = logits[sl].float() - shift[sl, None]
            p = (z - log_z[sl, None]).exp()
            # d logp / dz = onehot(y) - p ;  d H / dz = p * (E_p[z] - z)
            g = -grad_logp[sl, None] * p + grad_entropy[sl, None] * p * (mean_z[sl, None] - z)
            t = targets[sl]
            in_shard = (t >= ctx.start) & (t < ctx.stop)
            rows = in_shard.nonzero().squeeze(-1)
            g[rows, t[rows] - ctx.start] += grad_logp[sl][rows]
            grad[sl] = g.to(grad.dtype)
        return grad, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None, chunk_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits_shard [..., V/tp]` (this rank's vocabulary slice), `targets [...]` (global token ids)
    -> `(logprobs [...], entropy [...])` in fp32, differentiable w.r.t. the logits. `group` is the
    tensor-parallel group the vocabulary is split over (None: the shard is the whole vocabulary)."""
    lead = targets.shape
    flat = logits_shard.reshape(-1, logits_shard.shape[-1])
    logp, ent = _VocabParallelLogprobEntropy.apply(flat, targets.reshape(-1), group, chunk_size)
    return logp.reshape(lead), ent.reshape(lead)
