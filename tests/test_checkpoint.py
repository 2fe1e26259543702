"""Checkpoints: when they are taken, atomic multi-rank writes, damaged or mismatched checkpoints refused,
and exact resume of a real lagged RL run (its runs are tests/test_dataset_run.py's)."""

import json

import pytest
import torch

from megarl.checkpoint import (
    CheckpointError,
    checkpoint_due,
    latest_checkpoint,
    open_checkpoint,
    save_checkpoint,
    step_dir,
)
from megarl.config.load import ConfigError
from megarl.launch import prepare
from megarl.sync.schedule import SyncSchedule
from tests.dist_utils import run_distributed


def _due_steps(m: int, n: int, interval: int, steps: int = 8) -> list[int]:
    last, due = -1, []
    for k in range(steps):
        if checkpoint_due(SyncSchedule(m, n), k, interval, last):
            due.append(k)
            last = k
    return due


@pytest.mark.parametrize(("m", "n", "interval", "expected"), [
    # after step k the fleet's next batch is j = k + n + 1; it starts with a push iff j % m == 0 and j - n > 0
    (1, 0, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
    (1, 0, 3, [2, 5]),
    (2, 1, 1, [0, 2, 4, 6]),  # j = k + 2 even
    (2, 1, 3, [2, 6]),  # 3 steps since the last save, then the next even k
    (4, 0, 1, [3, 7]),  # j = k + 1 a multiple of 4
    (1, 4, 2, [1, 3, 5, 7]),
    (2, 1, 0, []),  # checkpointing off
])
def test_checkpoints_only_where_the_fleet_holds_no_state(m, n, interval, expected):
    assert _due_steps(m, n, interval) == expected


def _save_ranks(rank, world, root):
    """Rank-parallel saves: a good one, one where rank 1 fails mid-save, then pruning to the last two."""
    meta = {"tp": 1, "world_size": world}
    state = {"w": torch.full((3,), float(rank))}
    save_checkpoint(root, 3, rank, world, state, {"pending": {4: "batch"}} if rank == 0 else None, meta, keep_last=2)
    bad = {"w": lambda: None} if rank == 1 else state  # a lambda cannot be pickled: rank 1's write fails
    with pytest.raises(CheckpointError, match=r"checkpoint of step 5 not written \(rank 1 failed\)"):
        save_checkpoint(root, 5, rank, world, bad, {} if rank == 0 else None, meta, keep_last=2)
    for step in (6, 7):
        save_checkpoint(root, step, rank, world, state, {"step": step} if rank == 0 else None, meta, keep_last=2)
    return rank


def test_atomic_multi_rank_save_and_pruning(tmp_path):
    root = tmp_path / "checkpoints"
    run_distributed(_save_ranks, 2, root)
    # the failed save left only its temporary directory, which nothing reads
    assert not step_dir(root, 5).exists() and (root / ".step_00000005.tmp").is_dir()
    # keep_last=2: step 3 was pruned after step 7 was published
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000006", "step_00000007"]
    assert latest_checkpoint(root) == step_dir(root, 7)
    ckpt = open_checkpoint(step_dir(root, 7), {"tp": 1, "world_size": 2})
    assert ckpt.step == 7
    assert torch.equal(ckpt.rank_state(1)["w"], torch.full((3,), 1.0))
    assert ckpt.loop_state() == {"step": 7}


def test_damaged_or_mismatched_checkpoints_are_refused(tmp_path):
    root = tmp_path / "checkpoints"
    run_distributed(_save_ranks, 2, root)
    with pytest.raises(CheckpointError, match=r"written by a run that differs.*seed: checkpoint None, config 1"):
        open_checkpoint(step_dir(root, 7), {"seed": 1})
    assert open_checkpoint(step_dir(root, 7), {"tp": 2, "world_size": 4}).step == 7  # the layout may differ
    with pytest.raises(CheckpointError, match="no meta.json"):
        open_checkpoint(root / ".step_00000005.tmp", {})
    # earlier formats: drawn advantages (v1), megarl's own AdamW (v2), one torch file per rank (v3)
    meta_file = step_dir(root, 6) / "meta.json"
    for old in ("megarl-checkpoint-v1", "megarl-checkpoint-v2", "megarl-checkpoint-v3"):
        meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format": old}))
        with pytest.raises(CheckpointError, match=rf"format '{old}', expected 'megarl-checkpoint-v4'.*"
                                                  r"cannot resume here.*`megarl export` still reads it"):
            open_checkpoint(step_dir(root, 6), {})
    shard = step_dir(root, 7) / "rank_00001.pt"
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated shard
    with pytest.raises(CheckpointError, match=r"rank_00001\.pt: \d+ bytes, meta\.json recorded \d+: .*damaged"):
        open_checkpoint(step_dir(root, 7), {})


def _overrides(tiny_moe_dir, run_dir, steps, *extra):
    return [f"model.hf_dir={tiny_moe_dir}", f"run.dir={run_dir}", f"run.steps={steps}", "trainer.world_size=2",
            "trainer.ep=2", "rollout.tp=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=2",
            "data.prompts_per_step=4", "sync.interval=2", "sync.offset=1", "sync.push_initial=true",
            "optimizer.lr=0.003", "algorithm.name=red_drop", "checkpoint.interval=2", *extra]


# The exact resume of a real lagged RL run (sync (2, 1), RED-Drop: run A 5 steps; run B 4 steps, then resumed to 5,
# equals A's steps 3 and 4 in every metric but timings; the saved batch 3 not regenerated) is checked on the runs of
# tests/test_dataset_run.py::test_guru_sample_trains_evaluates_and_resumes_at_its_data_position (one set of runs for
# both).


def test_resume_needs_a_complete_checkpoint(tiny_moe_dir, tmp_path):
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        prepare(None, _overrides(tiny_moe_dir, tmp_path / "empty", 4, "checkpoint.resume=latest"))


def test_resume_refuses_an_older_checkpoint_while_newer_ones_exist(tiny_moe_dir, tmp_path):
    """Resuming from step 2 while step 4 of the abandoned run is still there would mix the two runs' checkpoints
    (and `latest` would later pick the abandoned one). Complete checkpoints are made by hand from the identity."""
    from megarl.checkpoint import FORMAT
    from megarl.loop import checkpoint_identity

    run_dir = tmp_path / "run"
    cfg = prepare(None, _overrides(tiny_moe_dir, run_dir, 8), create_run_dir=False)
    for step in (2, 4):
        path = step_dir(run_dir / "checkpoints", step)
        path.mkdir(parents=True)
        for rank in range(2):
            (path / f"rank_{rank:05d}.pt").write_bytes(b"x")
        meta = {**checkpoint_identity(cfg), "format": FORMAT, "step": step, "files": {}}
        (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"step_00000002 is older than step_00000004 .*move those away"):
        prepare(None, _overrides(tiny_moe_dir, run_dir, 8, f"checkpoint.resume={step_dir(run_dir / 'checkpoints', 2)}"))
    # the newest resumes; a different seed is refused (prompts and sampling seeds follow it)
    assert prepare(None, _overrides(tiny_moe_dir, run_dir, 8, "checkpoint.resume=latest")).checkpoint.resume
    with pytest.raises(ConfigError, match=r"differs from this config \(seed: checkpoint 0, config 1\)"):
        prepare(None, _overrides(tiny_moe_dir, run_dir, 8, "checkpoint.resume=latest", "run.seed=1"))
