"""The output layer fused with the vocab-parallel log-prob (`fused_output_logprobs_entropy`) equals, at TP = 1, 2,
4 (real gloo processes), fp32, with and without sequence parallelism, a vocabulary padded to a multiple of TP and
chunk sizes that do and do not divide the tokens:
- the unfused path, `hidden @ W_shard^T` -> `vocab_parallel_logprobs_entropy` (values and gradients, hidden's
  summed over the TP ranks as ColumnParallelLinear's backward sums them), to 1e-6;
- a dense reference, `log_softmax(hidden @ W^T)` on the whole vocabulary, autograd for the gradients of the hidden
  states and of the whole weight, to 1e-6 (values) / 1e-5 relative to the largest gradient.
And it holds far less memory: the peak resident memory of forward + backward at 4096 tokens x 32k vocabulary
(fp32 logits: 512 MB), chunks of 256 tokens, measured in a fresh process per path (VmHWM after resetting it
through /proc/self/clear_refs), is below a fifth of the unfused path's (observed: a tenth), and tiles of 2,048
vocabulary rows halve it again.
bf16 (the GPU's dtype) is checked against the unfused path at bf16's resolution.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy
from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from tests.dist_utils import run_distributed

S, B, H = 20, 2, 8  # sequence divisible by 1, 2, 4 (sequence parallel slices); 40 tokens, not a chunk multiple
V_PADDED, V_REAL = 48, 45  # the last TP rank's shard ends in padding rows at TP 2 and 4
CHUNKS = (7, 4096)  # 7 divides neither the 40 tokens nor a sequence slice; 4096 is one chunk
# (token chunk, vocabulary block): 5 rows divides no shard (48, 24, 12 rows, 45 / 21 / 9 real), None is the shard
TILINGS = [(chunk, None) for chunk in CHUNKS] + [(7, 5), (4096, 5)]


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(V_PADDED, H, generator=g)
    weight[V_REAL:] = 0  # padding rows, as megatron pads the embedding / output layer
    targets = torch.randint(0, V_REAL, (S, B), generator=g)
    mask = (torch.rand(S, B, generator=g) > 0.25).float()
    w_lp, w_ent = torch.randn(S, B, generator=g), torch.randn(S, B, generator=g)
    return hidden, weight, targets, mask, w_lp, w_ent


def _loss(lp, ent, mask, w_lp, w_ent):
    return ((lp * w_lp + ent * w_ent) * mask).sum()


def _dense_reference():
    hidden, weight, targets, mask, w_lp, w_ent = _inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logsm = torch.log_softmax(h @ w[:V_REAL].t(), dim=-1)
    lp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    _loss(lp, ent, mask, w_lp, w_ent).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _rank(rank, world, sequence_parallel):
    """Per chunk size: this rank's fused (lp, ent, grad hidden, grad weight shard) and the unfused ones."""
    v = V_PADDED // world
    valid = min(max(V_REAL - rank * v, 0), v)
    group = dist.new_group(list(range(world)))
    hidden, weight, targets, mask, w_lp, w_ent = _inputs()
    out = {}
    for chunk, block in TILINGS:
        shard = weight[rank * v:(rank + 1) * v].clone().requires_grad_(True)
        s = S // world
        h = (hidden[rank * s:(rank + 1) * s] if sequence_parallel else hidden).clone().requires_grad_(True)
        lp, ent = fused_output_logprobs_entropy(h, shard, targets, group, chunk, valid, sequence_parallel, block)
        _loss(lp, ent, mask, w_lp, w_ent).backward()
        fused = (lp.detach(), ent.detach(), h.grad, shard.grad)

        # unfused: the whole [tokens, V/tp] logits, padding columns masked as MegatronPolicy does
        shard_u, h_u = shard.detach().clone().requires_grad_(True), hidden.clone().requires_grad_(True)
        logits = (h_u @ shard_u.t()).clone()
        logits[..., valid:] = torch.finfo(logits.dtype).min
        lp_u, ent_u = vocab_parallel_logprobs_entropy(logits, targets, group, chunk)
        _loss(lp_u, ent_u, mask, w_lp, w_ent).backward()
        grad_h = h_u.grad.clone()
        dist.all_reduce(grad_h, group=group)  # ColumnParallelLinear's input gradient: summed over the shards
        out[chunk, block] = fused, (lp_u.detach(), ent_u.detach(), grad_h, shard_u.grad)
    return out


@pytest.mark.parametrize(("world", "sequence_parallel"), [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["tp1", "tp2", "tp4", "tp2-sequence-parallel", "tp4-sequence-parallel"])
def test_matches_unfused_and_dense(world, sequence_parallel):
    ref_lp, ref_ent, ref_gh, ref_gw = _dense_reference()
    per_rank = run_distributed(_rank, world, sequence_parallel)
    tol = dict(atol=1e-6, rtol=1e-6)
    for tiling in TILINGS:
        fused = [r[tiling][0] for r in per_rank]
        unfused = [r[tiling][1] for r in per_rank]
        for (lp, ent, _, _), (lp_u, ent_u, _, _) in zip(fused, unfused, strict=True):  # every rank: all tokens
            torch.testing.assert_close(lp, lp_u, **tol)
            torch.testing.assert_close(ent, ent_u, **tol)
            torch.testing.assert_close(lp, ref_lp, **tol)
            torch.testing.assert_close(ent, ref_ent, **tol)
        grad_w = torch.cat([g for *_, g in fused])
        torch.testing.assert_close(grad_w, torch.cat([g for *_, g in unfused]), **tol)
        assert not grad_w[V_REAL:].any()  # padding rows get no gradient
        grad_h = torch.cat([g for _, _, g, _ in fused]) if sequence_parallel else fused[0][2]
        for _, _, g, _ in unfused:
            torch.testing.assert_close(grad_h, g, **tol)
        if not sequence_parallel:  # replicated input: every rank holds the whole (summed) gradient
            for _, _, g, _ in fused:
                torch.testing.assert_close(g, grad_h, atol=0, rtol=0)
        # against the dense reference: gradients to 1e-5 of the largest (sums of 40-token / 48-column products)
        torch.testing.assert_close(grad_h, ref_gh, atol=1e-5 * float(ref_gh.abs().max()), rtol=0)
        torch.testing.assert_close(grad_w, ref_gw, atol=1e-5 * float(ref_gw.abs().max()), rtol=0)


def test_only_what_is_asked_for():
    """No weight gradient is computed for a frozen weight, and the values need no gradient at all."""
    hidden, weight, targets, *_ = _inputs()
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_output_logprobs_entropy(h, weight, targets, None, 7, V_REAL)
    (lp + ent).sum().backward()
    assert h.grad is not None and weight.grad is None
    with torch.no_grad():
        lp2, ent2 = fused_output_logprobs_entropy(hidden, weight, targets, None, 7, V_REAL)
    torch.testing.assert_close(lp2, lp.detach(), atol=0, rtol=0)
    torch.testing.assert_close(ent2, ent.detach(), atol=0, rtol=0)


def test_bf16_close_to_unfused():
    """bf16 hidden states and weight: the same bf16 logits (chunk by chunk), the math in fp32; the gradients are
    rounded to bf16 (rel 2^-8) on both paths, the fused weight gradient summed over chunks in fp32."""
    hidden, weight, targets, mask, w_lp, w_ent = _inputs()
    outs = []
    for block in (None, 5, "unfused"):  # fused (one block, then blocks of 5 rows: fp32 block accumulators), unfused
        h = hidden.bfloat16().requires_grad_(True)
        w = weight.bfloat16().requires_grad_(True)
        if block != "unfused":
            lp, ent = fused_output_logprobs_entropy(h, w, targets, None, 7, V_REAL, vocab_block=block)
        else:
            logits = (h @ w.t()).clone()
            logits[..., V_REAL:] = torch.finfo(logits.dtype).min
            lp, ent = vocab_parallel_logprobs_entropy(logits, targets, None, 7)
        _loss(lp, ent, mask, w_lp, w_ent).backward()
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16
        outs.append((lp.detach(), ent.detach(), h.grad.float(), w.grad.float()))
    *fused, (lp_u, ent_u, gh_u, gw_u) = outs
    for lp, ent, gh, gw in fused:
        torch.testing.assert_close(lp, lp_u, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ent_u, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gh, gh_u, atol=2e-2 * float(gh_u.abs().max()), rtol=0)
        torch.testing.assert_close(gw, gw_u, atol=2e-2 * float(gw_u.abs().max()), rtol=0)


def test_compiled_tiles_equal_eager_and_dense():
    """`kernel="compiled"` (the tile functions through torch.compile: inductor's C++ here, Triton on a GPU) gives
    the dense reference's values and gradients (fp32, as the eager kernel does in test_matches_unfused_and_dense),
    and in bf16 the eager kernel's to bf16's resolution; chunks of 7 tokens and blocks of 5 rows give tiles of four
    shapes (one compilation, dynamic shapes)."""
    ref_lp, ref_ent, ref_gh, ref_gw = _dense_reference()
    hidden, weight, targets, mask, w_lp, w_ent = _inputs()
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in ("compiled", "eager"):
            h, w = (t.to(dtype).clone().requires_grad_(True) for t in (hidden, weight))
            lp, ent = fused_output_logprobs_entropy(h, w, targets, None, 7, V_REAL, vocab_block=5, kernel=kernel)
            _loss(lp, ent, mask, w_lp, w_ent).backward()
            assert h.grad.dtype == w.grad.dtype == dtype
            runs[dtype, kernel] = (lp.detach(), ent.detach(), h.grad.float(), w.grad.float())
    lp, ent, gh, gw = runs[torch.float32, "compiled"]
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gh, ref_gh, atol=1e-5 * float(ref_gh.abs().max()), rtol=0)
    torch.testing.assert_close(gw, ref_gw, atol=1e-5 * float(ref_gw.abs().max()), rtol=0)
    assert not gw[V_REAL:].any()
    compiled, eager = runs[torch.bfloat16, "compiled"], runs[torch.bfloat16, "eager"]
    for got, want in zip(compiled[:2], eager[:2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(compiled[2:], eager[2:], strict=True):  # one bf16 rounding of dL/dz apart at most
        torch.testing.assert_close(got, want, atol=1e-2 * float(want.abs().max()), rtol=0)


def test_unknown_kernel_is_refused():
    hidden, weight, targets, *_ = _inputs()
    with pytest.raises(ValueError, match="unknown fused log-prob kernel 'triton'.*eager, compiled"):
        fused_output_logprobs_entropy(hidden, weight, targets, None, 7, V_REAL, kernel="triton")


# ---------------------------------------------------------------- memory

MEMORY_TOKENS, MEMORY_VOCAB, MEMORY_HIDDEN, MEMORY_CHUNK = 4096, 32768, 64, 256

_MEMORY_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy
    from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy

    torch.set_num_threads(1)
    path, n, v, h, chunk = sys.argv[1], *map(int, sys.argv[2:])

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(n):
        h = hidden[:n].detach().requires_grad_(True)
        if path.startswith("fused"):  # "fused-blocks": vocabulary blocks of 2,048 rows
            block = 2048 if path == "fused-blocks" else None
            lp, ent = fused_output_logprobs_entropy(h, weight, targets[:n], None, chunk, vocab_block=block)
        else:
            lp, ent = vocab_parallel_logprobs_entropy(h @ weight.t(), targets[:n], None, chunk)
        (lp * w_lp[:n] + ent * w_ent[:n]).sum().backward()

    run(8)  # warm up on 8 tokens (1 MiB of logits): one-time allocations are not the path's, and no freed
    # chunk-sized block stays resident to be reused unseen
    weight.grad = None
    before = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    run(n)
    print((kib("VmHWM") - before) * 1024)
""")


def _peak_bytes(path: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, path, str(MEMORY_TOKENS), str(MEMORY_VOCAB),
                          str(MEMORY_HIDDEN), str(MEMORY_CHUNK)], capture_output=True, text=True, check=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[1])
    return int(out.stdout.split()[-1])


def test_peak_memory_far_below_the_unfused_path():
    """4096 tokens x 32k vocabulary, fp32: the unfused path holds the logits (512 MB) and their gradient (512 MB);
    the fused one a few 256-token chunks (32 MB each) and the weight gradient (8 MB)."""
    logits_bytes = MEMORY_TOKENS * MEMORY_VOCAB * 4
    unfused, fused, blocks = _peak_bytes("unfused"), _peak_bytes("fused"), _peak_bytes("fused-blocks")
    print(f"peak above baseline: unfused {unfused / 2**20:.0f} MiB, fused {fused / 2**20:.0f} MiB, "
          f"ratio {fused / unfused:.3f}; vocabulary blocks of 2,048 rows {blocks / 2**20:.0f} MiB")
    assert unfused >= 1.5 * logits_bytes  # the measurement sees the logits and their gradient
    assert fused < 0.2 * unfused  # observed: 0.10 (104 of 1056 MiB)
    # blocks of 2,048 rows: 256 x 2,048 tiles (2 MiB each) instead of 256 x 32,768 (32 MiB); the weight
    # gradient (8 MiB) and dL/dh (1 MiB) stay
    assert blocks < 0.5 * fused


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_no_entropy_backward_without_an_entropy_term():
    """`entropy_grad=False` (the trainer's, whose losses have no entropy term): the same log-probs and entropy, the
    entropy without `grad_fn`, and a gradient of a log-prob-only loss exactly equal to the one with the entropy
    differentiable (where the backward gets a zero entropy gradient), and to the dense reference's; the backward
    runs fewer ops (the entropy term is not computed). Fused (eager and compiled tiles) and unfused paths."""
    hidden, weight, targets, mask, w_lp, _ = _inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logsm = torch.log_softmax(h @ w[:V_REAL].t(), dim=-1)
    (logsm.gather(-1, targets[..., None]).squeeze(-1) * w_lp * mask).sum().backward()
    ref_gh, ref_gw = h.grad, w.grad

    def run(path: str, entropy_grad: bool):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if path == "unfused":
            logits = (h @ w.t()).clone()
            logits[..., V_REAL:] = torch.finfo(logits.dtype).min
            lp, ent = vocab_parallel_logprobs_entropy(logits, targets, None, 7, entropy_grad=entropy_grad)
        else:
            lp, ent = fused_output_logprobs_entropy(h, w, targets, None, 7, V_REAL, vocab_block=5, kernel=path,
                                                    entropy_grad=entropy_grad)
        counter = _OpCount()  # torch.compile refuses to run under a dispatch mode: compiled tiles are not counted
        with counter if path != "compiled" else nullcontext():
            (lp * w_lp * mask).sum().backward()
        return lp.detach(), ent, h.grad, w.grad, counter.ops

    for path in ("eager", "compiled", "unfused"):
        lp, ent, gh, gw, ops = run(path, entropy_grad=True)
        lp0, ent0, gh0, gw0, ops0 = run(path, entropy_grad=False)
        assert ent.grad_fn is not None and ent0.grad_fn is None and not ent0.requires_grad, path
        assert torch.equal(lp0, lp) and torch.equal(ent0, ent.detach()), path
        assert torch.equal(gh0, gh) and torch.equal(gw0, gw), path
        torch.testing.assert_close(gh0, ref_gh, atol=1e-5 * float(ref_gh.abs().max()), rtol=0)
        torch.testing.assert_close(gw0, ref_gw, atol=1e-5 * float(ref_gw.abs().max()), rtol=0)
        if path != "compiled":
            assert ops0 < ops, f"{path}: {ops0} backward ops without the entropy term, {ops} with it"


def test_kernel_default_follows_the_device():
    """`trainer.logprob_kernel` defaults to "auto": compiled tiles on CUDA, eager ones on a CPU, decided by the
    device the rank trains on; an explicit kernel is kept on either."""
    from megarl.config.schema import TrainerConfig
    from megarl.parallel.fused_output_logprobs import default_kernel, resolve_kernel

    assert TrainerConfig().logprob_kernel == "auto"
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (default_kernel(cuda), default_kernel(cpu)) == ("compiled", "eager")
    assert (resolve_kernel("auto", cuda), resolve_kernel("auto", cpu)) == ("compiled", "eager")
    assert resolve_kernel("eager", cuda) == "eager" and resolve_kernel("compiled", cpu) == "compiled"
