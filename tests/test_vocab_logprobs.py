"""Sharded log-probs and entropy equal the dense `torch.log_softmax` results, values and gradients,
at TP = 1, 2, 4 (real gloo processes), fp32 and bf16, with a mask and several chunk sizes."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from tests.dist_utils import run_distributed

V, N = 48, 37  # vocabulary divisible by 1, 2, 4; token count not a multiple of the chunk sizes


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.25).float()
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return logits, targets, mask, w_lp, w_ent


def _dense_reference(dtype):
    logits, targets, mask, w_lp, w_ent = _inputs(dtype)
    x = logits.float().requires_grad_(True)
    logsm = torch.log_softmax(x, dim=-1)
    lp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    ((lp * w_lp + ent * w_ent) * mask).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _sharded(rank, world, chunks):
    """This rank's shard of the logits for both dtypes and every chunk size: (lp, ent, grad of the shard)."""
    v = V // world
    group = dist.new_group(list(range(world)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets, mask, w_lp, w_ent = _inputs(dtype)
        for chunk in chunks:
            shard = logits[:, rank * v:(rank + 1) * v].clone().requires_grad_(True)
            lp, ent = vocab_parallel_logprobs_entropy(shard, targets, group, chunk_size=chunk)
            ((lp * w_lp + ent * w_ent) * mask).sum().backward()
            out[dtype, chunk] = (lp.detach(), ent.detach(), shard.grad.float())
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_dense_log_softmax(world):
    chunks = (5, 4096)  # 5 does not divide the 37 tokens; 4096 is one chunk
    per_rank = run_distributed(_sharded, world, chunks)
    # fp32: only reduction order differs. bf16: the logits are the same bf16 numbers on both sides and the math
    # runs in fp32, so values agree as tightly; the sharded gradient is rounded to bf16 (8 mantissa bits, rel
    # 2^-8 = 0.4%) when written back into the logits' dtype, the reference's is not.
    for dtype, grad_tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ref_lp, ref_ent, ref_grad = _dense_reference(dtype)
        for chunk in chunks:
            outs = [r[dtype, chunk] for r in per_rank]
            for lp, ent, _ in outs:  # every rank returns the full per-token values
                torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
            grad = torch.cat([g for _, _, g in outs], dim=-1)
            torch.testing.assert_close(grad, ref_grad, atol=grad_tol, rtol=grad_tol)


class _LargestAllocation(TorchDispatchMode):
    """Records the bytes of every NEW storage an aten op returns, forward and backward alike (views and
    in-place results share an input's storage and are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [*args, *kwargs.values()]
        inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_chunking_bounds_the_temporaries():
    """bf16 logits, chunks of 5 tokens: autograd keeps only the input logits and per-token vectors, and no op
    allocates more than a `5 x V` fp32 buffer except the gradient itself (`N x V` bf16). A full-size fp32
    copy of the logits (what an unchunked upcast would make) would be twice that."""
    logits, targets, *_ = _inputs(torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _LargestAllocation() as mode:
        lp, ent = vocab_parallel_logprobs_entropy(x, targets, None, chunk_size=5)
        (lp + ent).sum().backward()
    assert max(saved) == N * V  # the bf16 logits themselves; every other saved tensor is per-token
    assert sorted(saved)[:-1] == [N] * (len(saved) - 1)
    grad_bytes, chunk_bytes = N * V * 2, 5 * V * 4
    assert max(mode.sizes) == grad_bytes
    assert sorted(mode.sizes)[-2] <= chunk_bytes  # only one allocation (the gradient) is larger than a chunk
