"""`megarl bench logprob --hidden` at a tiny size, TP 2 (real gloo processes; TP 1 of the fused path is
tests/test_fused_output_logprobs.py's), and `megarl bench padding`.

Output-layer bench: every method's log-probs, entropies and gradient probes equal a float64 dense computation
done here (`hidden @ W^T`, `log_softmax`, autograd), a case above `--measure-up-to` is projected from the
measured ones, and the peaks are consistent with independent bounds: the unfused paths hold at least the
`[tokens, V/tp]` fp32 logits, the fused one less than them. Padding bench: the count-based row computes
`rows x the batch's longest` per step (counted here), the token-budget rows less, within their budget.
Timings are not tested."""

from __future__ import annotations

import argparse

import pytest
import torch

from megarl.bench import output_logprob, padding
from megarl.bench.output_logprob import METHODS, OutputBenchConfig, hidden_targets_weights, weight_shard

CFG = OutputBenchConfig(vocab=8192, hidden=32, tokens=256, chunk_tokens=64, repeats=1, seed=5)
TOKENS = [256, 384, 512]  # 512 projected


VALUES: dict = {}


@pytest.fixture(scope="module")
def records():
    return output_logprob.measure(CFG, [CFG.hidden], TOKENS, [2], measure_up_to=384, progress=False, values=VALUES)


def _reference(tokens: int) -> dict[str, torch.Tensor]:
    cfg = OutputBenchConfig(**{**CFG.__dict__, "tokens": tokens})
    hidden, targets, w_lp, w_ent, probe = hidden_targets_weights(cfg)
    h = hidden.double().requires_grad_(True)
    w = weight_shard(cfg, 1, 0).double().requires_grad_(True)
    logsm = torch.log_softmax(h @ w.t(), dim=-1)
    logp, entropy = logsm.gather(-1, targets[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)
    (logp * w_lp.double() + entropy * w_ent.double()).sum().backward()
    return {
        "logp": logp.detach(),
        "entropy": entropy.detach(),
        "grad_h_probe": h.grad @ probe,
        "grad_w_probe": w.grad @ probe,
    }


def test_methods_match_a_float64_dense_reference(records):
    for n in (256, 384):
        ref = _reference(n)
        for tp in (2,):
            for method in METHODS:
                probes = VALUES[method, tp, n, CFG.hidden]
                for key in ("logp", "entropy"):
                    torch.testing.assert_close(
                        probes[key].double(), ref[key], atol=2e-5, rtol=1e-5, msg=f"{method} TP={tp} {key}"
                    )
                for key in ("grad_h_probe", "grad_w_probe"):
                    err = float((probes[key] - ref[key]).norm() / ref[key].norm())
                    assert err < 1e-5, f"{method} tokens={n} TP={tp} {key}: relative error {err:.2e}"


def test_fused_vocab_blocks_match_the_reference():
    """`--vocab-block 1000` (no divisor of the 4,096-row shards): the tiled fused method still equals float64."""
    cfg = OutputBenchConfig(**{**CFG.__dict__, "vocab_block": 1000})
    values: dict = {}
    output_logprob.measure(cfg, [CFG.hidden], [256], [2], methods=("fused",), progress=False, values=values)
    ref, probes = _reference(256), values["fused", 2, 256, CFG.hidden]
    for key in ("logp", "entropy"):
        torch.testing.assert_close(probes[key].double(), ref[key], atol=2e-5, rtol=1e-5, msg=key)
    for key in ("grad_h_probe", "grad_w_probe"):
        assert float((probes[key] - ref[key]).norm() / ref[key].norm()) < 1e-5, key


def test_records_measured_projected_and_bounded(records):
    assert {(r["method"], r["tp"], r["tokens"]) for r in records} == {(m, 2, n) for m in METHODS for n in TOKENS}
    for r in records:
        assert r["measured"] == (r["tokens"] <= 384)
        assert r["peak_bytes"] >= 0 and r["time_s"] > 0
    for tp in (2,):
        for n in (256, 384):
            peak = {r["method"]: r["peak_bytes"] for r in records if (r["tp"], r["tokens"]) == (tp, n)}
            logits = n * CFG.vocab // tp * 4  # one [tokens, V/tp] fp32 tensor
            assert peak["unfused"] >= logits and peak["megatron"] >= logits
        projected = [r for r in records if not r["measured"] and r["tp"] == tp]
        assert len(projected) == len(METHODS) and all(r["projected_from"] == [256, 384] for r in projected)


def test_padding_bench_counts_by_hand():
    args = argparse.Namespace(
        prompts_per_step=8,
        samples=4,
        dp=2,
        micro_batch_size=4,
        budgets=[4096],
        max_prompt=512,
        max_response=2048,
        packed=False,
        steps=3,
        seed=1,
    )
    rows = padding.measure(args)
    g = torch.Generator().manual_seed(1)
    batches = [padding.guru_like_lengths(8, 4, 512, 2048, g) for _ in range(3)]
    count, budget = rows
    assert count["train/tokens_computed"] == pytest.approx(sum(32 * max(b) for b in batches) / 3)
    assert count["train/tokens_real"] == pytest.approx(sum(sum(b) for b in batches) / 3)
    assert budget["train/tokens_computed"] < count["train/tokens_computed"]
    assert budget["largest_microbatch_tokens"] <= max(4096, max(max(b) for b in batches))
