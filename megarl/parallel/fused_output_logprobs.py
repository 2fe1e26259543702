"""The output layer fused with the vocab-parallel log-prob and exact entropy: the logits are never whole.

`hidden [N, h]` (the last stage's final hidden states) and this rank's output-weight shard `W [V/tp, h]` (the
output layer's, or the embedding's when they are tied) go in; per-token `log p(target)` and the entropy come
out. The logits are computed one tile at a time: `chunk_size` tokens by `vocab_block` rows of the shard, so no
`[N, V/tp]` tensor exists in forward or backward (peak: a few `chunk_size x vocab_block` fp32 buffers, an fp32
`vocab_block x h` accumulator, and dL/dh).

Forward, per chunk of tokens: each tile `z = h W_b^T` gives its row max and the sums `sum e^(z-m)`,
`sum e^(z-m) (z-m)` relative to it, merged tile by tile (`merge_softmax_sums`, the online softmax), then across
the TP group (one max, then one sum of three per-token numbers, as `vocab_parallel_logprobs_entropy` reduces
them); three per-token vectors are kept. With one block and TP 1 the arithmetic is the unfused path's.
Backward recomputes each tile's logits, vocabulary blocks outside and token chunks inside, so a block's weight
gradient is finished (in fp32) before the next begins:

    dL/dh   = sum over shards and blocks of dL/dz_b W_b   (all-reduced over the TP group, as ColumnParallelLinear's)
    dL/dW_b = sum over chunks of dL/dz_b^T h               (this shard's rows, accumulated in fp32)

The elementwise work of a tile (fp32 upcast, max, exp, sums; in backward the whole `dL/dz`) is two functions,
`FusedOutputLogprobMath.tile_stats` and `.tile_grad`, run as written (`kernel="eager"`: a few passes over the
tile, each through memory) or through `torch.compile` (`kernel="compiled"`: fused kernels, Triton's on a GPU,
C++ on a CPU; the matrix products stay the BLAS's). Same math, same results to fp32 rounding.

The input mapping is ColumnParallelLinear's: without sequence parallelism `hidden` is the same on every TP
rank and its gradient is all-reduced; with it, `hidden` is this rank's slice of dim 0 (the sequence), gathered
in forward (again in backward, instead of being kept) and its gradient reduce-scattered. The process group is
passed explicitly; None means the shard is the whole vocabulary. Rows of the shard at or past `valid` (the
vocabulary padded to a multiple of TP) are no tokens: they are skipped (exp of the unfused path's masked
logits is exactly 0) and get a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.distributed as dist

from megarl.parallel.vocab_logprobs import VocabParallelLogprobMath, _all_reduce, _vocab_range

_NO_LOGIT = torch.finfo(torch.float32).min  # the running max of a token before any column (exp(_NO_LOGIT - m) = 0)
Kernel = Literal["eager", "compiled"]
KERNELS: tuple[str, ...] = get_args(Kernel)


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def vocab_blocks(valid: int, vocab_block: int | None) -> list[tuple[int, int]]:
    """`[lo, hi)` row ranges of the shard's real rows, `vocab_block` rows each (None: one block of all)."""
    step = valid if vocab_block is None else vocab_block
    return [(lo, min(lo + step, valid)) for lo in range(0, valid, max(step, 1))]


class FusedOutputLogprobMath:
    """The steps the fusion adds around `VocabParallelLogprobMath`, each on one tile or one chunk of tokens."""

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
    def tile_stats(z: torch.Tensor, in_tile: torch.Tensor,
                   local_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tile's logits `z = h W_b^T` (the weight's dtype, as the output layer computes them; overwritten) ->
        per token (m, sum e^(z-m), sum e^(z-m) (z-m), z_y): m the row max, z_y the target's logit for tokens whose
        target is a column of the tile (0 for the others). The math in fp32."""
        z = z.float()
        z_y = z.gather(-1, local_target[:, None]).squeeze(-1) * in_tile
        m = z.max(dim=-1).values
        z.sub_(m[:, None])
        e = z.exp()
        sum_e = e.sum(-1)
        return m, sum_e, e.mul_(z).sum(-1), z_y  # e * (z - m) written over e: one more tile buffer, not two

    @staticmethod
    def tile_grad(z: torch.Tensor, shift: torch.Tensor, log_z: torch.Tensor, mean_z: torch.Tensor,
                  grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, in_tile: torch.Tensor,
                  local_target: torch.Tensor) -> torch.Tensor:
        """One tile's recomputed logits (the weight's dtype) -> dL/dz in that dtype (what the unfused output
        layer's backward receives), from the forward's per-token statistics; the math in fp32. `grad_entropy`
        None: the entropy carries no gradient and its term is skipped (`VocabParallelLogprobMath.grad_logits`)."""
        grad = VocabParallelLogprobMath.grad_logits(z.float().sub_(shift[:, None]), log_z, mean_z, grad_logp,
                                                    grad_entropy, in_tile, local_target)
        return grad.to(z.dtype)

    @staticmethod
    def rescale_softmax_sums(m: torch.Tensor, sum_e: torch.Tensor, sum_ez: torch.Tensor,
                             to: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums relative to `m` -> relative to `to >= m`: e^(z-to) = e^(z-m) f with f = e^(m-to), and
        (z - to) = (z - m) + (m - to)."""
        f = (m - to).exp()
        return sum_e * f, (sum_ez + (m - to) * sum_e) * f

    @classmethod
    def merge_softmax_sums(cls, a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Two column sets' (m, sum_e, sum_ez) -> those of their union (the online softmax's step)."""
        m = torch.maximum(a[0], b[0])
        sa, sb = cls.rescale_softmax_sums(*a, m), cls.rescale_softmax_sums(*b, m)
        return m, sa[0] + sb[0], sa[1] + sb[1]

    @staticmethod
    def accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """acc += a @ b: the product in the operands' dtype (as the unfused layer computes it), added in acc's."""
        if a.dtype == acc.dtype:
            acc.addmm_(a, b)
        else:
            acc.add_(a @ b)


_COMPILED: dict[str, Callable] = {}


def default_kernel(device: torch.device) -> Kernel:
    """The tile kernel `kernel="auto"` (`trainer.logprob_kernel`'s default) means on `device`: "compiled" on CUDA
    (Triton's fused kernels: each tile's elementwise work in one pass instead of several through memory), "eager"
    elsewhere (a CPU: no compilation at a rank's first step)."""
    return "compiled" if device.type == "cuda" else "eager"


def resolve_kernel(kernel: Kernel | Literal["auto"], device: torch.device) -> Kernel:
    """`kernel`, with "auto" replaced by `default_kernel(device)`."""
    return default_kernel(device) if kernel == "auto" else kernel


def tile_kernels(kernel: Kernel) -> tuple[Callable, Callable]:
    """(tile_stats, tile_grad) as written ("eager") or through `torch.compile` ("compiled"; compiled once per
    process, with dynamic shapes: the last chunk and the last block of a shard are narrower)."""
    fused = FusedOutputLogprobMath
    if kernel == "eager":
        return fused.tile_stats, fused.tile_grad
    if kernel != "compiled":
        raise ValueError(f"unknown fused log-prob kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if not _COMPILED:
        _COMPILED.update(stats=torch.compile(fused.tile_stats, dynamic=True, fullgraph=True),
                         grad=torch.compile(fused.tile_grad, dynamic=True, fullgraph=True))
    return _COMPILED["stats"], _COMPILED["grad"]


class _FusedOutputLogprobEntropy(torch.autograd.Function):
    """`hidden [n, h]` (this rank's input), `weight [V/tp, h]`, `targets [N]` -> `(logp [N], entropy [N])`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                group: dist.ProcessGroup | None, chunk_size: int, valid: int, sequence_parallel: bool,
                vocab_block: int | None, kernel: Kernel, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        math, fused = VocabParallelLogprobMath, FusedOutputLogprobMath
        tile_stats, _ = tile_kernels(kernel)
        h = fused.gather_sequence(hidden, group) if sequence_parallel else hidden
        h = h.reshape(-1, h.shape[-1])
        start, _ = _vocab_range(weight.shape[0], group)
        blocks = vocab_blocks(valid, vocab_block)
        # per token: the outputs, and the softmax statistics kept for backward (m, log Z, E_p[z - m])
        logp, entropy, shift, log_z, mean_z = (torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
                                               for _ in range(5))
        for lo in range(0, h.shape[0], chunk_size):
            rows = slice(lo, lo + chunk_size)
            n = h[rows].shape[0]
            zero = torch.zeros(n, dtype=torch.float32, device=h.device)
            sums, z_y = (torch.full_like(zero, _NO_LOGIT), zero, zero), zero  # no column yet
            for vlo, vhi in blocks:
                in_tile, local_target = math.target_in_shard(targets[rows], start + vlo, start + vhi)
                *tile_sums, tile_z_y = tile_stats(h[rows] @ weight[vlo:vhi].t(), in_tile, local_target)
                z_y = z_y + tile_z_y
                sums = fused.merge_softmax_sums(sums, tile_sums)
            m = _all_reduce(sums[0].clone(), dist.ReduceOp.MAX, group)
            sum_e, sum_ez = fused.rescale_softmax_sums(*sums, m)
            in_shard, _ = math.target_in_shard(targets[rows], start, start + valid)
            stats = _all_reduce(torch.stack([sum_e, sum_ez, (z_y - m) * in_shard]), dist.ReduceOp.SUM, group)
            # E_p[z - m] = sum_ez / sum_e: logprob_entropy's "mean_z" is relative to the shift, as in the unfused path
            logp[rows], entropy[rows], log_z[rows], mean_z[rows] = math.logprob_entropy(*stats)
            shift[rows] = m
        ctx.save_for_backward(hidden, weight, targets, shift, log_z, mean_z)
        ctx.group, ctx.chunk_size, ctx.valid, ctx.sequence_parallel = group, chunk_size, valid, sequence_parallel
        ctx.start, ctx.blocks, ctx.kernel, ctx.entropy_grad = start, blocks, kernel, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        math, fused = VocabParallelLogprobMath, FusedOutputLogprobMath
        hidden, weight, targets, shift, log_z, mean_z = ctx.saved_tensors
        _, tile_grad = tile_kernels(ctx.kernel)
        h = fused.gather_sequence(hidden, ctx.group) if ctx.sequence_parallel else hidden
        h = h.reshape(-1, h.shape[-1])
        one_block = len(ctx.blocks) <= 1
        # this shard's part of dL/dh for every token of the (gathered) input: summed over blocks in fp32
        grad_h = torch.zeros(h.shape, dtype=h.dtype if one_block else torch.float32, device=h.device)
        want_weight_grad = ctx.needs_input_grad[1]
        grad_weight = torch.zeros_like(weight) if want_weight_grad else None  # padding rows stay 0
        in_place = weight.dtype == torch.float32  # an fp32 weight's gradient is its own fp32 accumulator
        for vlo, vhi in ctx.blocks:
            w_b = weight[vlo:vhi]
            acc = None  # this block's dL/dW, summed over the chunks in fp32
            if want_weight_grad:
                acc = grad_weight[vlo:vhi] if in_place else w_b.new_zeros(w_b.shape, dtype=torch.float32)
            for lo in range(0, h.shape[0], ctx.chunk_size):
                rows = slice(lo, lo + ctx.chunk_size)
                in_tile, local_target = math.target_in_shard(targets[rows], ctx.start + vlo, ctx.start + vhi)
                grad_z = tile_grad(h[rows] @ w_b.t(), shift[rows], log_z[rows], mean_z[rows], grad_logp[rows],
                                   grad_entropy[rows] if ctx.entropy_grad else None, in_tile, local_target)
                fused.accumulate(grad_h[rows], grad_z, w_b)
                if acc is not None:
                    fused.accumulate(acc, grad_z.t(), h[rows])
            if acc is not None and not in_place:
                grad_weight[vlo:vhi] = acc
        grad_h = grad_h.to(h.dtype)
        grad_hidden = fused.reduce_input_grad(grad_h, ctx.group, ctx.sequence_parallel).reshape(hidden.shape)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def fused_output_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
    chunk_size: int = 4096, valid_vocab: int | None = None, sequence_parallel: bool = False,
    vocab_block: int | None = None, kernel: Kernel = "eager", entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden [..., h]` (the output layer's input; with `sequence_parallel`, this rank's slice of dim 0),
    `weight [V/tp, h]` (this rank's output-weight shard, rows `rank*V/tp ...`), `targets [...]` (global token
    ids, long, shaped like the full input's leading dims) -> `(logprobs, entropy)` shaped like `targets`, fp32:
    what `vocab_parallel_logprobs_entropy(hidden @ weight.T, ...)` returns, differentiable w.r.t. `hidden` and
    `weight`. `valid_vocab`: this shard's real vocabulary rows (the rest is padding); default all.
    `vocab_block`: shard rows per tile (None: the whole shard). Peak extra memory: a few `chunk_size x
    vocab_block` fp32 buffers, a `vocab_block x h` fp32 weight-gradient accumulator (none for an fp32 weight,
    whose gradient is accumulated in place), dL/dh (in fp32 when there are several blocks). `kernel`: the
    tiles' elementwise work as written ("eager") or through `torch.compile` ("compiled"). `entropy_grad` False: the
    entropy comes back without gradient (no `grad_fn`; for a loss without an entropy term) and the backward skips
    its term (`tile_grad` without `grad_entropy`); the values, and the log-probs' gradient, are the same."""
    valid = weight.shape[0] if valid_vocab is None else valid_vocab
    if vocab_block is not None and vocab_block < 1:
        raise ValueError(f"vocab_block must be a positive number of rows or None (the whole shard), got {vocab_block}")
    tile_kernels(kernel)  # an unknown kernel fails here, before any work
    logp, entropy = _FusedOutputLogprobEntropy.apply(hidden, weight, targets.reshape(-1), group, chunk_size,
                                                     valid, sequence_parallel, vocab_block, kernel, entropy_grad)
    return logp.reshape(targets.shape), entropy.reshape(targets.shape)
