"""Checkpoints of an RL run, written atomically by every trainer rank, and exact resume.

    <run.dir>/checkpoints/
        step_00000012/            complete: the state after step 12 (the resumed run starts at step 13)
            model_optim/          megatron-core `dist_checkpointing` (torch_dist): the model and the optimizer
                                  state (fp32 main parameters, Adam moments), every rank writing its own shards
            rank_00000.pt ...     one small file per trainer rank: policy version, RNG states
            loop.pt               rank 0: the loop's own state (batches generated ahead, algorithm state)
            meta.json             written last; lists every file with its size, the layout and the schedule
        .step_00000014.tmp/       being written (or left by a crash): never read, removed by the next save
                                  of the same step (delete left-over ones by hand)

A checkpoint directory only exists under its final name once every rank's file was written, flushed and
checked against its size, so a crash mid-save can leave a `.tmp` directory but never a checkpoint that
looks complete. Resume checks the model, schedule and algorithm recorded in `meta.json` against the config;
the trainer layout (world size, TP, PP, EP, expert TP) may differ: `dist_checkpointing` reshards on load.

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

from megarl.schedule import SyncSchedule

# v2: saved batches carry rewards only (advantages are computed when consumed); v3: the rank files' optimizer
# state is megatron-core's (`megarl.trainer.optimizer.optimizer_state`), no longer megarl's own AdamW / ZeRO-1;
# v4: model and optimizer through megatron-core's `dist_checkpointing` in `model_optim/` (any layout resumes)
FORMAT = "megarl-checkpoint-v4"
SHARDED_DIR = "model_optim"
# meta.json keys of the saving trainer layout: recorded (the exporter rebuilds that layout), never required to match
LAYOUT_KEYS = ("world_size", "tp", "pp", "ep", "expert_tp")


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


def _save_sharded(sharded_state: dict[str, Any], directory: Path) -> None:
    """megatron's `dist_checkpointing.save` in the torch_dist format, synchronously, each rank writing its own
    shards (one file per rank: megarl's ranks each have their own cores' share already)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megarl.parallel.cpu_compat import apply_dist_ckpt_compat

    apply_dist_ckpt_compat()
    directory.mkdir(exist_ok=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(sharded_state, str(directory), strategy)


def save_checkpoint(root: Path, step: int, rank: int, world: int, rank_state: dict[str, Any],
                    loop_state: dict[str, Any] | None, meta: dict[str, Any], keep_last: int,
                    sharded_state: dict[str, Any] | None = None) -> Path:
    """Collective over the trainer world. Every rank writes `rank_state`, then (if given) all ranks save
    `sharded_state` (megatron's sharded state dict: `MegatronPolicy.sharded_state_dict()`) into `model_optim/`;
    rank 0 also writes `loop_state` and `meta` and renames the directory into place once all files are on disk;
    then older checkpoints beyond `keep_last` are deleted. A failure on any rank raises on every rank and
    publishes nothing."""
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
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is None and sharded_state is not None:
        try:  # collective inside; an error raised on one rank is raised on all (megatron checks every rank's plan)
            _save_sharded(sharded_state, tmp / SHARDED_DIR)
        except Exception as err:  # noqa: BLE001
            failure[0] = f"checkpoint of step {step} not written (rank {rank}: {type(err).__name__}: {err})"
        dist.barrier()
    if rank == 0 and failure[0] is None:
        try:
            files = {f"rank_{r:05d}.pt": s for r, s in enumerate(sizes)}
            files.update({str(f.relative_to(tmp)): f.stat().st_size
                          for f in sorted((tmp / SHARDED_DIR).rglob("*")) if f.is_file()})
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
    failures = [None] * world
    dist.all_gather_object(failures, failure[0])
    failure[0] = next((f for f in failures if f), None)
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
        """Trainer rank `rank`'s file; a rank the saving world did not have (a resume at a larger world) reads
        rank 0's (its RNG states: dropout is 0, nothing of the step depends on them)."""
        saved = rank if rank < int(self.meta.get("world_size", rank + 1)) else 0
        return torch.load(self.path / f"rank_{saved:05d}.pt", map_location="cpu", weights_only=False)

    def load_sharded(self, sharded_state: dict[str, Any]) -> dict[str, Any]:
        """Collective: `sharded_state` (`MegatronPolicy.sharded_state_dict(is_loading=True)`, at this run's layout)
        filled from `model_optim/`, resharded from the saving layout, whichever layer spec saved it
        (`megarl.models.spec_keys`: a GPU job's Transformer Engine spec, a CPU job's local spec)."""
        from megarl.models.spec_keys import load_across_specs
        from megarl.parallel.cpu_compat import apply_dist_ckpt_compat

        apply_dist_ckpt_compat()
        return load_across_specs(sharded_state, self.path / SHARDED_DIR)

    def loop_state(self) -> dict[str, Any]:
        return torch.load(self.path / "loop.pt", map_location="cpu", weights_only=False)


# v1 to v3 differ in loop.pt and the optimizer state: their model shards (rank files) export alike; v4 holds the
# model in `model_optim/`
RANK_FILE_FORMATS = ("megarl-checkpoint-v3", "megarl-checkpoint-v2", "megarl-checkpoint-v1")
MODEL_FORMATS = (FORMAT, *RANK_FILE_FORMATS)


def open_checkpoint(path: Path, expected: dict[str, Any], formats: tuple[str, ...] = (FORMAT,)) -> Checkpoint:
    """Read and verify `path`: a complete checkpoint (meta.json present, every listed file present with its
    recorded size) of one of `formats` whose recorded `expected` keys (layout, schedule, model) equal the
    config's (the trainer layout, `LAYOUT_KEYS`, is never compared: resume reshards). Resume reads only the current
    format; the exporter, which reads the model shards, `MODEL_FORMATS`."""
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
            "optimizer state of megarl's own AdamW, not megatron-core's, v3 one torch file per rank instead of "
            "megatron's distributed checkpoint, so it cannot resume here; `megarl export` still reads it); resume it "
            "with that version, or start fresh"
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
    wrong = [f"{k}: checkpoint {meta.get(k)!r}, config {v!r}" for k, v in expected.items()
             if k not in LAYOUT_KEYS and meta.get(k) != v]
    if wrong:
        raise CheckpointError(
            f"{path} was written by a run that differs from this config ({'; '.join(wrong)}): resume with the "
            "settings the run was saved with (model, precision, distributed optimizer, sync schedule, seed, data, "
            "sampling, algorithm; the trainer layout may differ)"
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
