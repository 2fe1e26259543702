"""Checkpoints of an RL run, written atomically by every trainer rank, and exact resume.

    <run.dir>/checkpoints/
        step_00000012/            complete: the state after step 12 (the resumed run starts at step 13)
            rank_00000.pt ...     one file per trainer rank: its model shard, optimizer state, RNG states
            loop.pt               rank 0: the loop's own state (batches generated ahead, algorithm state)
            meta.json             written last; lists every file with its size, the layout and the schedule
        .step_00000014.tmp/       being written (or left by a crash): never read, removed by the next save
                                  of the same step (delete left-over ones by hand)

A checkpoint directory only exists under its final name once every rank's file was written, flushed and
checked against its size, so a crash mid-save can leave a `.tmp` directory but never a checkpoint that
looks complete. Resume checks the layout and schedule recorded in `meta.json` against the config.

What makes resume exact (`when_fleet_holds_no_state`): with a lagged schedule the fleet's weights are part
of the run's state, and they are an *older* policy than the trainer's. Checkpoints are therefore taken
only after steps where the fleet's next batch starts with a push of the trainer's current weights; then the
checkpoint (trainer state + the batches already generated) is the whole state. With sync.interval = 1 that
is every step; with interval m, every m-th step.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.sync.schedule import SyncSchedule

# v2: saved batches carry rewards only (advantages are computed when consumed); v3: the rank files' optimizer
# state is megatron-core's (`megarl.trainer.optimizer.optimizer_state`), no longer megarl's own AdamW / ZeRO-1
FORMAT = "megarl-checkpoint-v3"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the problem and the fix."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def when_fleet_holds_no_state(schedule: SyncSchedule, step: int) -> bool:
    """True if after finishing `step` the fleet's next batch begins with a push of the trainer's new
    weights, so the fleet's current (lagged) weights are never used again."""
    return schedule.sync_before_batch(schedule.batches_ready_before_step(step)) is not None


def checkpoint_due(schedule: SyncSchedule, step: int, interval: int, last_saved_step: int) -> bool:
    """Save after `step` when checkpointing is on (`interval` > 0), at least `interval` steps have passed since
    the last save (`last_saved_step`, -1 for none) and the fleet holds no state at this step boundary."""
    return interval > 0 and step - last_saved_step >= interval and when_fleet_holds_no_state(schedule, step)


def _write_file(path: Path, obj: Any) -> int:
    """torch.save to `path` through a temporary name, flushed to disk; returns the size in bytes."""
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather_sizes(size: int, rank: int, world: int) -> list[int]:
    sizes = [None] * world if rank == 0 else None
    dist.gather_object(size, sizes, dst=0)
    return sizes or []


def save_checkpoint(root: Path, step: int, rank: int, world: int, rank_state: dict[str, Any],
                    loop_state: dict[str, Any] | None, meta: dict[str, Any], keep_last: int) -> Path:
    """Collective over the trainer world. Every rank writes `rank_state`; rank 0 also writes `loop_state`
    and `meta` and renames the directory into place once all files are on disk; then older checkpoints
    beyond `keep_last` are deleted. A failure on any rank raises on every rank and publishes nothing."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    error = ""
    try:
        size = _write_file(tmp / f"rank_{rank:05d}.pt", rank_state)
    except Exception as err:  # noqa: BLE001 - every rank must learn that the save failed
        size, error = -1, f"rank {rank}: {type(err).__name__}: {err}"
    sizes = _gather_sizes(size, rank, world)
    failure = [None]
    if rank == 0:
        failed = [f"rank {r}" for r, s in enumerate(sizes) if s < 0]
        if failed or error:
            failure[0] = f"checkpoint of step {step} not written ({error or ', '.join(failed)} failed)"
        else:
            try:
                files = {f"rank_{r:05d}.pt": s for r, s in enumerate(sizes)}
                files["loop.pt"] = _write_file(tmp / "loop.pt", loop_state)
                (tmp / "meta.json").write_text(json.dumps({**meta, "format": FORMAT, "step": step, "files": files},
                                                          indent=2))
                _fsync_dir(tmp)
                if final.exists():  # an older save of the same step: replace it
                    shutil.rmtree(final)
                os.replace(tmp, final)
                _fsync_dir(root)
                _prune(root, keep_last)
            except Exception as err:  # noqa: BLE001
                failure[0] = f"checkpoint of step {step} not written (rank 0: {type(err).__name__}: {err})"
    dist.broadcast_object_list(failure, src=0)
    if failure[0]:
        raise CheckpointError(failure[0] + f"; the partial files stay in {tmp} and are never read")
    return final


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file())
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (one whose meta.json was written), or None."""
    complete = sorted(p for p in Path(root).glob("step_*") if (p / "meta.json").is_file())
    return complete[-1] if complete else None


@dataclass
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def rank_state(self, rank: int) -> dict[str, Any]:
        return torch.load(self.path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)

    def loop_state(self) -> dict[str, Any]:
        return torch.load(self.path / "loop.pt", map_location="cpu", weights_only=False)


# v1 and v2 differ in loop.pt and the optimizer state: their model shards export alike
MODEL_FORMATS = (FORMAT, "megarl-checkpoint-v2", "megarl-checkpoint-v1")


def open_checkpoint(path: Path, expected: dict[str, Any], formats: tuple[str, ...] = (FORMAT,)) -> Checkpoint:
    """Read and verify `path`: a complete checkpoint (meta.json present, every listed file present with its
    recorded size) of one of `formats` whose recorded `expected` keys (layout, schedule, model) equal the
    config's. Resume reads only the current format; the exporter, which reads the model shards, `MODEL_FORMATS`."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(
            f"{path} is not a complete megarl checkpoint (no meta.json: it was never finished or is not a "
            "checkpoint); resume from another one, e.g. checkpoint.resume=latest"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file} cannot be read ({err}): the checkpoint is damaged; use another one"
                              ) from None
    if meta.get("format") not in formats:
        raise CheckpointError(
            f"{meta_file}: format {meta.get('format')!r}, expected {' or '.join(map(repr, formats))}: the checkpoint "
            "was written by another megarl version (v1 saved batches with advantages already drawn, v2 the "
            "optimizer state of megarl's own AdamW, not megatron-core's, so it cannot resume here; `megarl export` "
            "still reads it); resume it with that version, or start fresh"
        )
    files: dict[str, int | None] = dict(meta.get("files", {}))
    for rank in range(int(meta.get("world_size", 0))):  # one file per trainer rank, whatever the listing says
        files.setdefault(f"rank_{rank:05d}.pt", None)
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: every trainer rank wrote a file and all of them are needed; copy the whole "
                "step directory, or use another checkpoint"
            )
        if size is not None and file.stat().st_size != size:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, meta.json recorded {size}: the checkpoint is damaged or "
                "still being copied; copy it again, or use another checkpoint"
            )
    wrong = [f"{k}: checkpoint {meta.get(k)!r}, config {v!r}" for k, v in expected.items() if meta.get(k) != v]
    if wrong:
        raise CheckpointError(
            f"{path} was written by a run that differs from this config ({'; '.join(wrong)}): resume with the "
            "settings the run was saved with (trainer layout, model, sync schedule, seed, data, sampling, algorithm)"
        )
    return Checkpoint(path, meta)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
