"""`megarl bench trainer` end to end on a very small model (2 gloo ranks, DP 2, distributed optimizer, one timed step
per precision): it writes its JSON and figure, each precision's held storages are the memory plan's fixed terms
(`megarl.trainer.memory_plan`; measured by the bench from the live policy, not from the formula), bf16 weights are
half of fp32's with the same fp32 gradient buffers, and the ratios are against fp32 from the same run."""

import argparse
import json

import pytest

from megarl.bench import trainer as bench


def test_bench_trainer_writes_both_precisions(tmp_path, capsys):
    out = tmp_path / "bench_trainer.json"
    args = argparse.Namespace(hidden=64, layers=1, vocab=256, seq=16, rows=4, micro=1, world=2,
                              no_distributed_optimizer=False, steps=1, variants=["fp32", "bf16", "bf16+te"], out=out)
    assert bench.run(args) == 0
    printed = capsys.readouterr().out
    assert "No megarl-vs-megatron column" in printed and "bf16+te" in printed and "not run" in printed
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").exists() and report["machine"]["cpus"] >= 1
    fp32, bf16, te = report["rows"]
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert "needs a GPU" in te["skipped"]  # no CUDA here: the TE row says why it did not run
    cfg = bench.TrainerBenchConfig(hidden=64, layers=1, vocab=256, seq=16, rows=4)
    # hand count: per token 2 x (q 64x64 + k, v 64x64 (one KV head of 64) + o 64x64 + MLP 3 x 64x192) + QK^T, PV
    # over 8 causal positions (2 x 2 x 64 x 8) + output 2 x 64 x 256; x 3 (forward + backward) x 64 tokens
    per_token = 2 * (4 * 64 * 64 + 3 * 64 * 192) + 2 * 2 * 64 * 8 + 2 * 64 * 256
    assert bench.step_flops(cfg) == 3 * per_token * 64
    assert fp32["mfu"] is None and fp32["tokens_per_s"] == pytest.approx(64 / fp32["step_s"])
    for row in (fp32, bf16):
        for term, planned in row["planned"].items():
            assert row["held"][term] == pytest.approx(planned, rel=0.02, abs=64), (row["precision"], term)
        assert row["step_s"] > 0 and row["step_peak_bytes"] > 0
        held, step = row["held_bytes"], row["step_peak_bytes"]
        assert max(held, step) < row["peak_bytes"] <= held + step  # held + step peak of the largest rank
    assert bf16["held"]["weights"] * 2 == fp32["held"]["weights"] and bf16["held"]["grads"] == fp32["held"]["grads"]
    assert fp32["held"]["main_params"] == 0 < bf16["held"]["main_params"]
    assert bf16["step_s_vs_fp32"] == pytest.approx(bf16["step_s"] / fp32["step_s"]) and fp32["step_s_vs_fp32"] == 1
