"""Sharded log-probs and entropy equal the dense `torch.log_softmax` results, values and gradients,
at TP = 1, 2, 4 (real gloo processes), fp32 and bf16, with a mask and several chunk sizes."""

import pytest
import torch
import torch.distributed as dist

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


def _sharded(rank, world, dtype, chunks):
    logits, targets, mask, w_lp, w_ent = _inputs(dtype)
    v = V // world
    group = dist.new_group(list(range(world)))
    out = []
    for chunk in chunks:
        shard = logits[:, rank * v:(rank + 1) * v].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs_entropy(shard, targets, group, chunk_size=chunk)
        ((lp * w_lp + ent * w_ent) * mask).sum().backward()
        out.append((lp.detach(), ent.detach(), shard.grad.float()))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_dense_log_softmax(world, dtype, tol):
    ref_lp, ref_ent, ref_grad = _dense_reference(dtype)
    chunks = (5, 4096)
    per_rank = run_distributed(_sharded, world, dtype, chunks)
    for c in range(len(chunks)):
        outs = [r[c] for r in per_rank]
        for lp, ent, _ in outs:  # every rank returns the full per-token values
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        grad = torch.cat([g for _, _, g in outs], dim=-1)
        # bf16 gradients are rounded to bf16 (8 mantissa bits) when written back into the logits' dtype
        torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)


def test_chunking_bounds_the_temporaries():
    """A chunk of 5 tokens never builds an fp32 tensor larger than 5 x V/tp (checked by the peak
    size of the tensors autograd saves: only the input logits, no full-size fp32 copies)."""
    logits, targets, *_ = _inputs(torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs_entropy(x, targets, None, chunk_size=5)
    assert max(saved) == N * V  # the bf16 logits themselves; every other saved tensor is per-token
    assert sorted(saved)[:-1] == [N] * (len(saved) - 1)
