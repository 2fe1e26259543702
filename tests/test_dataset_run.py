"""A dataset recipe end to end on the real stack with the tiny MoE: Guru-format training rows (the shipped sample
file), MATH-500-format held-out rows, the math-verify reward in the reward processes, evaluation every 2 steps,
and an exact resume that continues the data stream where the checkpoint left it (batch l starts at row l*P of the
seeded epoch stream: epochs wrap after the file's 24 rows). The same runs are tests/test_checkpoint.py's exact
resume of a real lagged RL run (sync (2, 1), RED-Drop's random drops as state): one set of three runs for both."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from megarl.checkpoint import latest_checkpoint, open_checkpoint, step_dir
from megarl.config.load import ConfigError
from megarl.launch import prepare, train
from megarl.metrics.timeline import load_spans
from megarl.rollout.task import PROMPTS_FILE

SAMPLES = "megarl/data/samples"
ROWS, PROMPTS = 24, 8  # rows of the sample file, prompts per batch


def _overrides(model_dir, run_dir, steps, *extra):
    return [f"model.hf_dir={model_dir}", f"run.dir={run_dir}", f"run.steps={steps}", "trainer.world_size=2",
            "trainer.ep=2", "rollout.tp=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
            "data.task=guru", f"data.train_files=[{SAMPLES}/guru_math_sample.parquet]",
            f"data.eval_files=[{SAMPLES}/math500_sample.jsonl]", "data.eval_format=math",
            f"data.prompts_per_step={PROMPTS}", "reward.name=math_verify", "eval.interval=2", "eval.prompts=6",
            "eval.samples=2", "sync.interval=2", "sync.offset=1", "sync.push_initial=true", "optimizer.lr=0.003",
            "algorithm.name=red_drop", "checkpoint.interval=2", *extra]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_guru_sample_trains_evaluates_and_resumes_at_its_data_position(moe_fleet, tiny_moe_dir, tmp_path):
    """Run A goes 5 steps. Run B stops after step 3 (its last checkpoint is after step 2: with sync (2, 1) step 3
    is not a point where the fleet holds no state), then resumes to 5: its steps 3 and 4 equal A's, data position
    and RED-Drop's drops included (tests/test_checkpoint.py's exact resume, checked here on these runs)."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    train(prepare(None, _overrides(tiny_moe_dir, a_dir, 5)), fleet_urls=moe_fleet.urls)
    a = _records(a_dir)
    assert [r["step"] for r in a] == list(range(5))
    # the data stream: batch l starts at row l*P of epoch (l*P) // rows
    assert [(r["data/epoch"], r["data/index"]) for r in a] == [((s * PROMPTS) // ROWS, (s * PROMPTS) % ROWS)
                                                               for s in range(5)]
    for r in a:
        assert 0 <= r["reward/mean"] <= 1 and r["reward/timeouts"] == 0
        assert r["reward/unparsable"] >= 0 and r["reward/gold_unparsable"] == 0  # every sample gold parses
        for key in ("loss", "entropy", "grad_norm"):
            assert math.isfinite(r[key]), (key, r)
        if r["step"] % 2 == 0:  # evaluation on the MATH-500-format held-out rows
            assert r["eval/prompts"] == 6 and 0 <= r["eval/mean@2"] <= r["eval/pass@2"] <= 1
        else:
            assert "eval/mean@2" not in r
    # the exact text of the first prompts, as the engine got it: raw (the tiny tokenizer has no chat template), so
    # a row's message contents joined by a blank line -- read here from the file with pyarrow
    rows = pq.read_table(f"{SAMPLES}/guru_math_sample.parquet").to_pylist()
    raw = {"\n\n".join(m["content"] for m in row["prompt"]) for row in rows}
    blocks = (a_dir / PROMPTS_FILE).read_text().split("--- prompt ")[1:]
    assert len(blocks) == 2 and all(block.split("---\n", 1)[1].strip() in raw for block in blocks), blocks

    # B stops after step 3 (its last checkpoint: after step 2), then resumes to 5 and equals A from step 3 on
    train(prepare(None, _overrides(tiny_moe_dir, b_dir, 4)), fleet_urls=moe_fleet.urls)
    checkpoint = latest_checkpoint(b_dir / "checkpoints")
    assert checkpoint == step_dir(b_dir / "checkpoints", 2)
    loop_state = open_checkpoint(checkpoint, {}).loop_state()
    position = loop_state["data"]
    assert (position["epoch"], position["index"], position["rows"]) == (1, 0, ROWS)  # batch 3 = row 24 = epoch 1
    # the fleet ran one batch ahead: the checkpoint after step 2 holds batch 3, generated and scored
    saved = loop_state["pending"]
    assert list(saved) == [3] and saved[3].advantages is None and saved[3].policy_version == 1
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare(None, _overrides(tiny_moe_dir, b_dir, 5))
    train(prepare(None, _overrides(tiny_moe_dir, b_dir, 5, "checkpoint.resume=latest")), fleet_urls=moe_fleet.urls)
    b = _records(b_dir)
    # the resumed run trained on the saved batch 3 and generated only batch 4 (the fleet holds v1 again by then,
    # so a regenerated batch 3 would have looked the same: the timeline says it was not regenerated)
    resumed = [s.label for s in load_spans(b_dir / "timeline.json") if s.kind == "generate"]
    assert resumed and set(resumed) == {"batch 4"}  # (one span per chunk of the shared queue)
    assert [r["step"] for r in b] == list(range(5))  # B's first step 3 (after its checkpoint) was replaced
    for ra, rb in zip(a[3:], b[3:], strict=True):
        for key in ("data/epoch", "data/index", "reward/mean", "reward/unparsable", "batch_lag"):
            assert rb[key] == ra[key], (ra["step"], key)
        for key in ("loss", "grad_norm", "eval/mean@2"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
        # everything but timings (wall seconds: sync/seconds, eval/seconds, ...; and how far the fleet had got when
        # the trainer took a batch)
        compared = [k for k in ra if not k.startswith(("time/", "fleet/", "pipeline/"))
                    and not k.endswith("/seconds") and not (k.startswith("sync/") and k.endswith("_s"))]
        assert compared and set(compared) <= set(rb)
        for k in compared:
            if isinstance(ra[k], float) and math.isfinite(ra[k]):
                assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-9), (ra["step"], k, ra[k], rb[k])
            else:
                assert rb[k] == ra[k], (ra["step"], k)
    assert b[3]["sync/count"] == 1 and b[3]["sync/bytes_received"] > 0  # the resumed run re-pushed before batch 4
