"""Every registered algorithm runs in the real job by changing one config key (`algorithm.name`):
the demo recipe, shrunk to 2 steps, with the megatron trainer on 2 gloo ranks (EP=2) and the session's
vLLM fleet (TP=2), a lagged schedule (sync (1, 1): every batch after the first is one version behind, so
importance ratios, clip masks and engine-vs-trainer differences are live). Two steps are what each algorithm's
checks need: step 0 at lag 0 on the pushed checkpoint, step 1 at lag 1 after one update. Pushes of trained
weights mid-run (the same code for every algorithm) are checked by tests/test_end_to_end.py.

All the algorithms' runs share ONE set of trainer ranks (`_every_run`): each rank runs the jobs one after another
exactly as `megarl train` runs one (`megarl.launch`'s rank entry point: its own trainer groups, policy, weight sync
and rollout worker per job), so the ranks' start (imports, forkserver) is paid once instead of per algorithm.
The parent does what `train` does after the ranks, minus the plots (their files are checked by
tests/test_end_to_end.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from megarl.algorithms.registry import ALGORITHMS
from megarl.config.schema import Config
from megarl.launch import prepare, sync_savings
from megarl.metrics import mismatch
from tests.shared_ranks import train_jobs_in_one_set_of_ranks

STEPS = 2
NAMES = sorted(ALGORITHMS)


@pytest.fixture(scope="module")
def runs(moe_fleet, tiny_moe_dir, tmp_path_factory) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Per algorithm: its run's metrics records and its summary's sync counts."""
    root = tmp_path_factory.mktemp("algorithms")
    cfgs: dict[str, Config] = {}
    for name in NAMES:
        cfgs[name] = prepare("configs/demo_moe.yaml", [
            f"algorithm.name={name}",  # the one key that selects the algorithm; the rest shrinks the demo
            f"model.hf_dir={tiny_moe_dir}", f"run.dir={root / name}", f"run.steps={STEPS}",
            "rollout.samples_per_prompt=8", "data.prompts_per_step=8", "sync.interval=1", "sync.offset=1",
            "sync.push_initial=true",
            # single-token answers (the untrained model is right 1 time in ~25, so batch 0 has reward variance for
            # every algorithm); the demo's multi-token answers run in tests/test_end_to_end.py
            "data.answer_digits=false", "data.max_operand=4", "rollout.max_new_tokens=1", "optimizer.lr=0.002",
            "eval.interval=0",
        ])
    train_jobs_in_one_set_of_ranks([cfgs[name] for name in NAMES], 2, moe_fleet.urls, root)
    out = {}
    for name, cfg in cfgs.items():
        records = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
        out[name] = (records, sync_savings(cfg, records))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_trains_in_the_demo_job(runs, name):
    records, summary = runs[name]
    assert [r["policy_version"] for r in records] == list(range(STEPS))
    assert [r["batch_lag"] for r in records] == [0, 1]  # batch 0 from the initial push, then (l mod 1) + 1
    for r in records:
        for key in ("loss", "entropy", "clip_frac", "grad_norm", "reward/mean"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (name, key, r)
    # Batch 0 is the same for every algorithm (pushed checkpoint weights, seeded sampling) and holds correct
    # answers, so some group has reward variance; at lag 0 every ratio is 1 (to fp32 kernel numerics), nothing
    # is clipped, and every algorithm must take a gradient from it. (At lag 1 a clipped algorithm may
    # legitimately mask every informative token.)
    first = records[0]
    assert first["reward/mean"] > 0
    assert first["logprob/engine_vs_trainer"] < 1e-4  # the same weights on both sides
    assert first["grad_norm"] > 0 and first["clip_frac"] == 0.0, (name, first)
    # the train-inference mismatch monitor (megarl/metrics/mismatch.py): every step, finite; at lag 0 it is the
    # numerics gap above; at lag 1 after that step's update it also holds the policy change, far above numerics
    for r in records:
        for key in mismatch.KEYS:
            assert math.isfinite(r[key]), (name, key, r)
        assert r["mismatch/at_behaviour_weights"] == int(r["batch_lag"] == 0)
    assert first["mismatch/abs_diff_mean"] == pytest.approx(first["logprob/engine_vs_trainer"], rel=1e-4, abs=1e-9)
    assert records[1]["mismatch/abs_diff_mean"] > 10 * first["mismatch/abs_diff_mean"], (name, records[1])
    assert records[1]["mismatch/k3_kl"] > first["mismatch/k3_kl"]
    if name == "off_policy_grpo":
        assert all(math.isfinite(r["kl"]) for r in records)
    # the initial push only: the next one (before batch 2) would be for a batch the run never trains on: skipped
    assert summary["sync/pushes"] == 1
