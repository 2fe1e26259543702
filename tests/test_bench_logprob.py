"""`megarl bench logprob` at a tiny size, TP = 1 and 2 (real gloo processes): every method's log-probs and
entropies equal a dense `torch.log_softmax` computed here, each (method, TP) gets one JSON record with
positive peaks, and the measured peaks are consistent with independent bounds: the gathered method holds
at least one full `[tokens, V]` fp32 tensor per rank, the sharded one only its gradient plus a few
`chunk x V/tp` buffers. Timings are not tested."""

import json

import pytest
import torch

from megarl.bench.logprob import METHODS, LogprobBenchConfig, logits_shard, measure, targets_and_weights, to_json

CFG = LogprobBenchConfig(vocab=4096, tokens=160, chunk_tokens=16, repeats=1, seed=3)  # 10 chunks
TPS = [1, 2]


@pytest.fixture(scope="module")
def result():
    return measure(CFG, TPS, fresh_processes=False, progress=False)


def test_methods_match_dense_log_softmax(result):
    logits, (targets, _, _) = logits_shard(CFG, tp=1, rank=0), targets_and_weights(CFG)  # the full vocabulary
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    for method in METHODS:
        for tp in TPS:
            logp, entropy = result.values[method, tp]
            torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5, msg=f"{method} TP={tp} logp")
            torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5, msg=f"{method} TP={tp} H")
    for r in result.records:  # the benchmark's own float64 gradient check ran and passed
        assert r["grad_rel_err"] < 1e-4


def test_json_has_one_record_per_method_and_tp(result):
    doc = json.loads(json.dumps(to_json(result)))
    assert sorted((r["method"], r["tp"]) for r in doc["records"]) == sorted((m, tp) for m in METHODS for tp in TPS)
    for r in doc["records"]:
        assert r["peak_alloc_bytes"] > 0 and len(r["peak_alloc_bytes_per_rank"]) == r["tp"]
        assert r["time_s"] > 0


def test_peaks_against_independent_bounds(result):
    fp32 = 4
    full = CFG.tokens * CFG.vocab * fp32  # one [tokens, V] fp32 tensor
    peak = {(r["method"], r["tp"]): r["peak_alloc_bytes"] for r in result.records}
    for tp in TPS:
        shard = full // tp  # the logits gradient every method must allocate
        chunk = CFG.chunk_tokens * (CFG.vocab // tp) * fp32
        # gathered: log_softmax of the full vocabulary alone is one [tokens, V] fp32 tensor (kept for backward)
        assert peak["gathered", tp] >= full
        # sharded: the shard's gradient plus a few chunk-sized temporaries, never a full-vocab tensor
        assert shard <= peak["sharded", tp] <= shard + 6 * chunk
        assert peak["sharded", tp] < peak["gathered", tp] / (1.5 * tp)
        # megatron's cross entropy + a shard entropy: a few [tokens, V/tp] tensors, none of [tokens, V]
        assert shard <= peak["megatron", tp] <= 4 * shard
    assert peak["sharded", 2] < 0.75 * full
