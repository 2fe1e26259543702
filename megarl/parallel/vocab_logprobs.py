"""Per-token log-probs of target tokens and the exact entropy, from tensor-parallel vocabulary shards.

Each TP rank holds `logits[..., rank*V/tp : (rank+1)*V/tp]`. Nothing the size of the full vocabulary
is ever built on any rank: the softmax statistics are reduced across the group (one max, then one
sum of three per-token numbers), and tokens are processed in chunks so the fp32 temporaries are
`chunk_size x V/tp`. In the style of megatron-core's `tensor_parallel/cross_entropy.py`: the math is
split into tiny static steps (`VocabParallelLogprobMath`), the autograd function only loops over chunks,
and the process group is passed explicitly.

With `z` the logits of one token, `m = max_v z_v`, `Z = sum_v exp(z_v - m)`, `p = softmax(z)`:
    logp(y) = (z_y - m) - log Z            d logp / dz_k = 1[k=y] - p_k
    H       = log Z - E_p[z - m]           d H / dz_k    = p_k (E_p[z] - z_k)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _vocab_range(local_vocab: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """`[start, stop)`: the global token ids of this rank's vocabulary shard."""
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    return rank * local_vocab, (rank + 1) * local_vocab


class VocabParallelLogprobMath:
    """The math steps, each on one chunk: `z [n, V/tp]` fp32, per-token vectors `[n]`."""

    @staticmethod
    def shift_by_global_max(z: torch.Tensor, group: dist.ProcessGroup | None,
                            inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """m = max_v z_v over all shards; returns (z - m, m), the shift that keeps exp() finite (`inplace`: written
        over `z`, for a caller whose `z` is its own temporary)."""
        m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        return (z.sub_(m[:, None]) if inplace else z - m[:, None]), m

    @staticmethod
    def target_in_shard(targets: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of tokens whose target lives in this shard, target index local to the shard or 0)."""
        in_shard = (targets >= start) & (targets < stop)
        return in_shard, torch.where(in_shard, targets - start, torch.zeros_like(targets))

    @staticmethod
    def global_sums(z: torch.Tensor, in_shard: torch.Tensor, local_target: torch.Tensor,
                    group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed over shards: Z = sum_v e^z, S = sum_v e^z z, and z_y (0 on shards without the target)."""
        e = z.exp()
        z_y = z.gather(-1, local_target[:, None]).squeeze(-1) * in_shard
        sum_e = e.sum(-1)
        sum_ez = e.mul_(z).sum(-1)  # e * z written over e: one [n, V/tp] temporary, not two
        stats = _all_reduce(torch.stack([sum_e, sum_ez, z_y]), dist.ReduceOp.SUM, group)
        return stats[0], stats[1], stats[2]

    @staticmethod
    def logprob_entropy(sum_e: torch.Tensor, sum_ez: torch.Tensor,
                        z_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """log p(y) = z_y - log Z ; H = log Z - E_p[z] with E_p[z] = S / Z. Returns (logp, H, log Z, E_p[z])."""
        log_z, mean_z = sum_e.log(), sum_ez / sum_e
        return z_y - log_z, log_z - mean_z, log_z, mean_z

    @staticmethod
    def grad_logits(z: torch.Tensor, log_z: torch.Tensor, mean_z: torch.Tensor, grad_logp: torch.Tensor,
                    grad_entropy: torch.Tensor | None, in_shard: torch.Tensor,
                    local_target: torch.Tensor) -> torch.Tensor:
        """dL/dz_k = g_logp (1[k=y] - p_k) + g_H p_k (E_p[z] - z_k), with p_k = exp(z_k - log Z) recomputed.
        The gradient is written over `z` (the caller's temporary): one more `[n, V/tp]` buffer, `p`, not four.
        `grad_entropy` None: the entropy carries no gradient (`entropy_grad=False`), and its term is not computed:
        the result equals the one for a zero `grad_entropy` exactly (`0 - g` is `-g`)."""
        p = (z - log_z[:, None]).exp_()
        if grad_entropy is None:
            grad = p.mul_(-grad_logp[:, None])
        else:
            grad = z.sub_(mean_z[:, None]).mul_(-grad_entropy[:, None]).sub_(grad_logp[:, None]).mul_(p)
        # + g_logp at the target column, for the tokens whose target is in this shard (+0 elsewhere: exact);
        # no data-dependent shapes, so torch.compile takes it whole (`fused_output_logprobs`' compiled tiles)
        return grad.scatter_add_(-1, local_target[:, None], (grad_logp * in_shard)[:, None])


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """`logits [N, V/tp]`, `targets [N]` -> `(logp [N], entropy [N])`, chunk by chunk over the N tokens."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                chunk_size: int, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        math = VocabParallelLogprobMath
        start, stop = _vocab_range(logits.shape[-1], group)
        # per token: the outputs, and the softmax statistics kept for backward (m, log Z, E_p[z - m])
        logp, entropy, shift, log_z, mean_z = (torch.empty(logits.shape[0], dtype=torch.float32,
                                                           device=logits.device) for _ in range(5))
        for lo in range(0, logits.shape[0], chunk_size):
            rows = slice(lo, lo + chunk_size)
            z, shift[rows] = math.shift_by_global_max(logits[rows].float(), group)
            in_shard, local_target = math.target_in_shard(targets[rows], start, stop)
            sums = math.global_sums(z, in_shard, local_target, group)
            logp[rows], entropy[rows], log_z[rows], mean_z[rows] = math.logprob_entropy(*sums)
        ctx.save_for_backward(logits, targets, shift, log_z, mean_z)
        ctx.chunk_size, ctx.start, ctx.stop, ctx.entropy_grad = chunk_size, start, stop, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        math = VocabParallelLogprobMath
        logits, targets, shift, log_z, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(lo, lo + ctx.chunk_size)
            z = logits[rows].float() - shift[rows, None]
            in_shard, local_target = math.target_in_shard(targets[rows], ctx.start, ctx.stop)
            grad[rows] = math.grad_logits(z, log_z[rows], mean_z[rows], grad_logp[rows],
                                          grad_entropy[rows] if ctx.entropy_grad else None, in_shard, local_target)
        return grad, None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None, chunk_size: int = 4096,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits_shard [..., V/tp]` (this rank's vocabulary slice, any float dtype), `targets [...]` (global
    token ids, long) -> `(logprobs [...], entropy [...])` in fp32, differentiable w.r.t. the logits (the
    gradient comes back in the logits' dtype). `group` is the tensor-parallel group the vocabulary is split
    over (None: the shard is the whole vocabulary). Peak extra memory: a few `chunk_size x V/tp` fp32 buffers.
    `entropy_grad` False: the entropy comes back without gradient (no `grad_fn`; for a loss that has no entropy
    term) and the backward skips its term; the values are the same."""
    lead = targets.shape
    flat = logits_shard.reshape(-1, logits_shard.shape[-1])
    logp, ent = _VocabParallelLogprobEntropy.apply(flat, targets.reshape(-1), group, chunk_size, entropy_grad)
    return logp.reshape(lead), ent.reshape(lead)
