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
                              no_distributed_optimizer=False, steps=1, precisions=["fp32", "bf16"], out=out)
    assert bench.run(args) == 0
    assert "No megarl-vs-megatron column" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").exists() and report["machine"]["cpus"] >= 1
    fp32, bf16 = report["rows"]
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    for row in (fp32, bf16):
        for term, planned in row["planned"].items():
            assert row["held"][term] == pytest.approx(planned, rel=0.02, abs=64), (row["precision"], term)
        assert row["step_s"] > 0 and row["step_peak_bytes"] > 0
        held, step = row["held_bytes"], row["step_peak_bytes"]
        assert max(held, step) < row["peak_bytes"] <= held + step  # held + step peak of the largest rank
    assert bf16["held"]["weights"] * 2 == fp32["held"]["weights"] and bf16["held"]["grads"] == fp32["held"]["grads"]
    assert fp32["held"]["main_params"] == 0 < bf16["held"]["main_params"]
    assert bf16["step_s_vs_fp32"] == pytest.approx(bf16["step_s"] / fp32["step_s"]) and fp32["step_s_vs_fp32"] == 1
