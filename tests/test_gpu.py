"""Checks that need an NVIDIA GPU (marker `gpu`, deselected by default; run with `pytest -m gpu` on a GPU machine).

They cover the CUDA side of code that CI exercises only on CPU:
- the megatron policy built on the GPU (NCCL group, model on `cuda`, collectives on the model's device) gives the
  log-probs, entropy, gradient norm, gradients and AdamW step of `transformers` run on the CPU in fp32;
- the sharded log-prob/entropy function on CUDA tensors at a realistic vocabulary (151,936) equals dense
  `torch.log_softmax` in fp64, for fp32 and bf16 logits, and its peak extra memory stays a few chunks, far
  below one full-vocabulary fp32 tensor;
- the output layer fused with it (`fused_output_logprobs_entropy`) on CUDA, tiled over vocabulary blocks, with the
  eager and the torch.compile'd (Triton) tile kernels, equals dense fp64 at vocabulary 151,936 in bf16, and holds
  no `[tokens, V]` tensor.
One GPU means one NCCL rank (NCCL refuses two ranks on one device), so layouts with several ranks are
covered by the gloo tests on CPU.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy
from megarl.parallel.groups import TrainerLayout
from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from tests.dist_utils import free_port, run_distributed
from tests.test_megatron_vs_hf import _assert_blocks_match, _batch, _hf_reference, _megatron_rank

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.fail("tests marked `gpu` need CUDA: run them on a GPU machine (`pytest -m gpu`)")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_policy_on_gpu_matches_transformers(tmp_path, kind):
    hf_dir = make_tiny_checkpoint(tmp_path / kind, kind=kind)
    ref_lp, ref_ent, ref_norm, clip, ref_grads, _, stepped = _hf_reference(hf_dir, clip_fraction=0.5)
    [(lp, ent, exported, grads, after, metrics, version, _)] = run_distributed(
        _megatron_rank, 1, hf_dir, TrainerLayout(), clip, free_port(), init_dist=False
    )
    assert all(t.device.type == "cuda" for _, t in grads)  # the policy really trained on the GPU
    torch.testing.assert_close(lp.cpu(), ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.cpu(), ref_ent, atol=1e-4, rtol=1e-4)
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert metrics["tokens"] == float(_batch(32)[2].sum())
    assert version == 1
    _assert_blocks_match([[(b, t.cpu()) for b, t in grads]], ref_grads, exact=False, atol=1e-5, rtol=1e-3)
    _assert_blocks_match([[(b, t.cpu()) for b, t in after]], stepped, exact=False, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_policy_on_gpu_trains_as_megatron_mixed_precision(tmp_path, kind):
    """`trainer.precision=bf16` on CUDA (NCCL, world 1, megatron's DDP and distributed optimizer over DP 1): the
    checks of tests/test_trainer_bf16.py (bf16 parameters, log-probs against `transformers` in bf16 on the CPU,
    AdamW from the fp32 main gradients, each bf16 parameter its main value rounded, bf16 parameters offered to the
    push, a state-dict and a `dist_checkpointing` round trip continuing bit for bit). AdamW within a few fp32 ulps:
    torch's multi-tensor AdamW on CUDA against the reference's single operations. Dense and MoE (the 30B recipe's
    precision and model family: expert parameters in their own optimizer of the chain)."""
    from tests.test_trainer_bf16 import _bf16_rank, check_bf16_run

    hf_dir = make_tiny_checkpoint(tmp_path / kind, kind=kind)
    ranks = run_distributed(_bf16_rank, 1, hf_dir, free_port(), tmp_path / "checkpoints", init_dist=False)
    assert all(p.device.type == "cuda" for p in ranks[0]["params"].values())  # it trained on the GPU
    check_bf16_run(ranks, hf_dir, adam_tol=(1e-8, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_logprobs_on_gpu_realistic_vocab(dtype):
    vocab, tokens, chunk = 151_936, 1024, 256
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    w_lp, w_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)

    x = logits.double().requires_grad_(True)  # independent fp64 reference on the CPU
    logsm = torch.log_softmax(x, dim=-1)
    ref_lp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    dev = torch.device("cuda")
    y = logits.to(dev).requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = vocab_parallel_logprobs_entropy(y, targets.to(dev), None, chunk_size=chunk)
    (lp * w_lp.to(dev) + ent * w_ent.to(dev)).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base

    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(lp.double().cpu(), ref_lp.detach(), **tol)
    torch.testing.assert_close(ent.double().cpu(), ref_ent.detach(), **tol)
    grad_tol = {"atol": 1e-6, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 2e-2}
    torch.testing.assert_close(y.grad.double().cpu(), x.grad.to(dtype).double(), **grad_tol)
    # the gradient itself (one logits-sized tensor) plus a few chunk x vocab fp32 temporaries; a dense
    # fp32 log_softmax would add at least two full [tokens, vocab] fp32 tensors (~1.2 GB here)
    grad_bytes = logits.numel() * logits.element_size()
    chunk_fp32 = chunk * vocab * 4
    assert extra <= grad_bytes + 8 * chunk_fp32, (extra, grad_bytes, chunk_fp32)


def _fused_on(dev: torch.device, kernel: str, tokens: int = 2048, vocab: int = 151_936, hidden: int = 256,
              chunk: int = 512, block: int = 16_384) -> dict:
    """The fused path on `dev` in bf16 against a dense fp64 reference on the CPU; its peak extra CUDA memory."""
    g = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(tokens, hidden, generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden, generator=g) * 3 / hidden**0.5).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    w_lp, w_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)

    h64, w64 = hidden_states.double().requires_grad_(True), weight.double().requires_grad_(True)
    logsm = torch.log_softmax(h64 @ w64.t(), dim=-1)
    ref_lp, ref_ent = logsm.gather(-1, targets[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    del logsm

    h = hidden_states.to(dev).requires_grad_(True)
    w = weight.to(dev).requires_grad_(True)
    args = (targets.to(dev), None, chunk)
    if kernel == "compiled":  # compile outside the measurement
        fused_output_logprobs_entropy(h, w, *args, vocab_block=block, kernel=kernel)[0].sum().backward()
        h.grad = w.grad = None
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    lp, ent = fused_output_logprobs_entropy(h, w, *args, vocab_block=block, kernel=kernel)
    (lp * w_lp.to(dev) + ent * w_ent.to(dev)).sum().backward()
    extra = torch.cuda.max_memory_allocated() - base if cuda else None
    return {"lp": (lp.double().cpu(), ref_lp.detach()), "ent": (ent.double().cpu(), ref_ent.detach()),
            "grad_h": (h.grad.double().cpu(), h64.grad), "grad_w": (w.grad.double().cpu(), w64.grad),
            "extra": extra, "shape": (tokens, vocab, hidden, chunk, block)}


def _check_fused(out: dict) -> None:
    for key in ("lp", "ent"):
        got, want = out[key]
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2, msg=key)  # bf16 logits: z rounded to 2^-8
    for key in ("grad_h", "grad_w"):
        got, want = out[key]
        err = float((got - want).norm() / want.norm())
        assert err < 3e-2, f"{key}: relative error {err:.2e}"


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_fused_output_on_gpu_tiled_equals_fp64(kernel):
    out = _fused_on(torch.device("cuda"), kernel)
    _check_fused(out)
    tokens, vocab, hidden, chunk, block = out["shape"]
    # what it may hold: the bf16 weight gradient, one fp32 block accumulator, dL/dh in fp32 and bf16, a few
    # chunk x block fp32 tiles; one [tokens, V] fp32 logits tensor alone would be 1.2 GB here
    allowed = vocab * hidden * 2 + block * hidden * 4 + tokens * hidden * 6 + 8 * chunk * block * 4
    assert out["extra"] <= allowed, (out["extra"], allowed)
    assert out["extra"] < tokens * vocab * 4 / 4
