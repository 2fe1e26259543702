"""Short real RL runs (megatron trainer on 2 gloo ranks, EP=2; the session's vLLM fleet, TP=2):
the lag of every consumed batch, *measured* as the trainer's version minus the version the engine
reported for the batch's samples, equals (l mod m) + n; metrics are finite; outputs are written."""

import json
import math

import pytest

from megarl.launch import prepare, train
from megarl.sync.schedule import SyncSchedule


def _expected_lag(batch: int, m: int, n: int) -> int:
    """REC appendix B.2, written out: (l mod m) + n once data comes from pushed weights (m*floor(l/m) >= n);
    before that the fleet still serves the initial weights (version 0) and the lag is l."""
    return (batch % m) + n if m * (batch // m) >= n else batch


@pytest.mark.parametrize(
    ("m", "n", "steps", "algorithm", "old_logprobs"),
    [(4, 0, 6, "off_policy_grpo", "engine"), (1, 4, 7, "gspo", "engine"), (2, 1, 5, "rec_gspo_nois", "trainer")],
)
def test_measured_lags_follow_the_schedule(moe_fleet, tiny_moe_dir, tmp_path, m, n, steps, algorithm, old_logprobs):
    cfg = prepare(None, [
        f"model.hf_dir={tiny_moe_dir}", f"run.dir={tmp_path / 'run'}", f"run.steps={steps}",
        "trainer.world_size=2", "trainer.ep=2", "rollout.tp=2", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=2", "data.prompts_per_step=4", f"sync.interval={m}", f"sync.offset={n}",
        "sync.push_initial=true", "optimizer.lr=0.003", f"algorithm.name={algorithm}",
        f"algorithm.old_logprobs={old_logprobs}",
    ])
    summary = train(cfg, fleet_urls=moe_fleet.urls)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    assert [r["batch_lag"] for r in records] == [_expected_lag(b, m, n) for b in range(steps)]
    assert [r["policy_version"] for r in records] == list(range(steps))
    pushes = [j for j in range(steps + n) if SyncSchedule(m, n).sync_before_batch(j) is not None]
    assert summary["sync/pushes"] == len(pushes) + 1  # + the initial push
    for r in records:
        for key in ("loss", "entropy", "clip_frac", "reward/mean", "grad_norm"):
            assert math.isfinite(r[key]), (key, r)
        if r["batch_lag"] == 0:  # same weights on both sides: only kernel numerics differ (fp32)
            assert r["logprob/engine_vs_trainer"] < 1e-4
        else:
            assert r["logprob/engine_vs_trainer"] is None
        if r["sync/count"]:
            assert r["sync/bytes_sent"] == r["sync/bytes_received"] > 0
    if old_logprobs == "trainer":  # behaviour = the trainer's own recompute: the sequence ratio starts at exactly 1
        assert all(abs(r["seq_ratio_mean"] - 1.0) < 1e-6 for r in records)
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "reward_and_sync.png").exists()
