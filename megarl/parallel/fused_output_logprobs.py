"""The output layer fused with the vocab-parallel log-prob and exact entropy: the logits are never whole.

`hidden [N, h]` (the last stage's final hidden states) and this rank's output-weight shard `W [V/tp, h]` (the
output layer's, or the embedding's when they are tied) go in; per-token `log p(target)` and the entropy come
out. Tokens are processed `chunk_size` at a time: forward computes one chunk's logits `z = h W^T`, reduces
them over the TP group with exactly the steps of `vocab_parallel_logprobs_entropy`
(`VocabParallelLogprobMath`: global max, then one sum of three per-token numbers) and drops them, keeping
three per-token vectors; backward recomputes the chunk's logits, turns them into `dL/dz` and contracts it at
once, so no `[N, V/tp]` tensor exists in forward or backward (peak: a few `chunk_size x V/tp` fp32 buffers):

    dL/dh = sum over shards of dL/dz W       (all-reduced over the TP group, as ColumnParallelLinear's input)
    dL/dW = sum over chunks of dL/dz^T h     (this shard's rows, accumulated in fp32)

The input mapping is ColumnParallelLinear's: without sequence parallelism `hidden` is the same on every TP
rank and its gradient is all-reduced; with it, `hidden` is this rank's slice of dim 0 (the sequence), gathered
in forward (again in backward, instead of being kept) and its gradient reduce-scattered. The process group is
passed explicitly; None means the shard is the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.parallel.vocab_logprobs import VocabParallelLogprobMath, _vocab_range


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


class FusedOutputLogprobMath:
    """The steps the fusion adds around `VocabParallelLogprobMath`, each on one chunk of tokens."""

    @staticmethod
    def gather_sequence(hidden: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Sequence parallel: [n/tp, ...] on each rank -> [n, ...], the ranks' slices in rank order along dim 0."""
        world = _tp_size(group)
        if world == 1:
            return hidden
        out = hidden.new_empty((world * hidden.shape[0], *hidden.shape[1:]))
        dist.all_gather_into_tensor(out, hidden.contiguous(), group=group)
        return out

    @staticmethod
    def reduce_input_grad(grad: torch.Tensor, group: dist.ProcessGroup | None,
                          sequence_parallel: bool) -> torch.Tensor:
        """dL/dh = sum over shards of each shard's dL/dz W: all-reduced, or reduce-scattered to this rank's slice
        of dim 0 when the input was gathered (sequence parallel)."""
        world = _tp_size(group)
        if world == 1:
            return grad
        if not sequence_parallel:
            dist.all_reduce(grad, group=group)
            return grad
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
        return out

    @staticmethod
    def chunk_logits(h: torch.Tensor, weight: torch.Tensor, valid: int) -> torch.Tensor:
        """z = h W^T in the weight's dtype (what the output layer computes), columns >= `valid` (vocabulary padded
        to a multiple of TP: no token) set to the dtype's lowest value as the unfused path does; returned in fp32."""
        z = h @ weight.t()
        if valid < z.shape[-1]:
            z[:, valid:] = torch.finfo(z.dtype).min
        return z.float()

    @staticmethod
    def grad_logits_unpadded(grad: torch.Tensor, valid: int, dtype: torch.dtype) -> torch.Tensor:
        """dL/dz of the padding columns is 0 (they are constants in the unfused path), then dL/dz in the
        weight's dtype, the dtype the unfused output layer's backward receives."""
        grad[:, valid:] = 0
        return grad.to(dtype)

    @staticmethod
    def accumulate_weight_grad(grad_weight: torch.Tensor, grad_z: torch.Tensor, h: torch.Tensor) -> None:
        """dL/dW += dL/dz^T h for one chunk, into the fp32 accumulator (chunk products rounded once each)."""
        if grad_z.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad_z.t(), h)
        else:
            grad_weight += (grad_z.t() @ h).float()


class _FusedOutputLogprobEntropy(torch.autograd.Function):
    """`hidden [n, h]` (this rank's input), `weight [V/tp, h]`, `targets [N]` -> `(logp [N], entropy [N])`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                group: dist.ProcessGroup | None, chunk_size: int, valid: int,
                sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        math, fused = VocabParallelLogprobMath, FusedOutputLogprobMath
        h = fused.gather_sequence(hidden, group) if sequence_parallel else hidden
        h = h.reshape(-1, h.shape[-1])
        start, stop = _vocab_range(weight.shape[0], group)
        # per token: the outputs, and the softmax statistics kept for backward (m, log Z, E_p[z - m])
        logp, entropy, shift, log_z, mean_z = (torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
                                               for _ in range(5))
        for lo in range(0, h.shape[0], chunk_size):
            rows = slice(lo, lo + chunk_size)
            z, shift[rows] = math.shift_by_global_max(fused.chunk_logits(h[rows], weight, valid), group, inplace=True)
            in_shard, local_target = math.target_in_shard(targets[rows], start, stop)
            sums = math.global_sums(z, in_shard, local_target, group)
            logp[rows], entropy[rows], log_z[rows], mean_z[rows] = math.logprob_entropy(*sums)
        ctx.save_for_backward(hidden, weight, targets, shift, log_z, mean_z)
        ctx.group, ctx.chunk_size, ctx.valid, ctx.sequence_parallel = group, chunk_size, valid, sequence_parallel
        ctx.start, ctx.stop = start, stop
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        math, fused = VocabParallelLogprobMath, FusedOutputLogprobMath
        hidden, weight, targets, shift, log_z, mean_z = ctx.saved_tensors
        h = fused.gather_sequence(hidden, ctx.group) if ctx.sequence_parallel else hidden
        h = h.reshape(-1, h.shape[-1])
        grad_h = torch.empty_like(h)  # this shard's part of dL/dh, for every token of the (gathered) input
        want_weight_grad = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight_grad else None
        for lo in range(0, h.shape[0], ctx.chunk_size):
            rows = slice(lo, lo + ctx.chunk_size)
            z = fused.chunk_logits(h[rows], weight, ctx.valid).sub_(shift[rows, None])
            in_shard, local_target = math.target_in_shard(targets[rows], ctx.start, ctx.stop)
            grad_z = math.grad_logits(z, log_z[rows], mean_z[rows], grad_logp[rows], grad_entropy[rows],
                                      in_shard, local_target)
            grad_z = fused.grad_logits_unpadded(grad_z, ctx.valid, weight.dtype)
            grad_h[rows] = grad_z @ weight
            if want_weight_grad:
                fused.accumulate_weight_grad(grad_weight, grad_z, h[rows])
        grad_hidden = fused.reduce_input_grad(grad_h, ctx.group, ctx.sequence_parallel).reshape(hidden.shape)
        grad_weight = grad_weight.to(weight.dtype) if want_weight_grad else None
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_output_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
    chunk_size: int = 4096, valid_vocab: int | None = None, sequence_parallel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden [..., h]` (the output layer's input; with `sequence_parallel`, this rank's slice of dim 0),
    `weight [V/tp, h]` (this rank's output-weight shard, rows `rank*V/tp ...`), `targets [...]` (global token
    ids, long, shaped like the full input's leading dims) -> `(logprobs, entropy)` shaped like `targets`, fp32:
    what `vocab_parallel_logprobs_entropy(hidden @ weight.T, ...)` returns, differentiable w.r.t. `hidden` and
    `weight`. `valid_vocab`: this shard's real vocabulary rows (the rest is padding); default all. Peak extra
    memory: a few `chunk_size x V/tp` fp32 buffers and an fp32 `[V/tp, h]` weight-gradient accumulator."""
    valid = weight.shape[0] if valid_vocab is None else valid_vocab
    logp, entropy = _FusedOutputLogprobEntropy.apply(hidden, weight, targets.reshape(-1), group, chunk_size,
                                                     valid, sequence_parallel)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)
