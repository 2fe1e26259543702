"""Process topology of one run on one machine (SLURM launches the same pieces across nodes):

    parent ─┬─ vLLM fleet: `rollout.replicas` servers, each tensor parallel `rollout.tp`
            └─ trainer: `trainer.world_size` processes (torch.distributed), each running `megarl.loop`

The parent validates everything first, owns the fleet's lifetime, and writes the summary and plot
from `metrics.jsonl` when the trainer ranks are done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.checks import check_against_model
from megarl.config.load import ConfigError, load_config, save_config
from megarl.config.schema import Config
from megarl.metrics.plot import plot_mismatch, plot_run, plot_timeline
from megarl.metrics.timeline import load_spans, overlap_summary
from megarl.metrics.writer import summarize, write_json_atomic
from megarl.models.hf_config import read_hf_config
from megarl.parallel.device import cuda_present
from megarl.parallel.launcher_env import ProcessPlace
from megarl.parallel.spawn import RankError, free_port, prestart, run_ranks
from megarl.schedule import SyncSchedule


def prepare(config_path: str | None, overrides: list[str], create_run_dir: bool = True,
            for_gpu: bool | None = None, check_files: bool = True) -> Config:
    """Validate the config and the model layout; make the tiny checkpoint and the run directory.
    `for_gpu`: check the layout for a GPU job (True) or a CPU one (False); None: for this machine.
    `check_files`: also open the dataset files and import the reward (`megarl plan` needs neither)."""
    cfg = load_config(config_path, overrides)
    if cfg.model.tiny is not None:
        from megarl.models.tiny import ensure_tiny_checkpoint

        ensure_tiny_checkpoint(cfg.model.hf_dir, kind=cfg.model.tiny, seed=cfg.run.seed)
    cuda = cuda_present() if for_gpu is None else for_gpu
    check_against_model(cfg, read_hf_config(cfg.model.hf_dir), cuda=cuda)
    if check_files:
        check_data(cfg)
    if cfg.checkpoint.resume is not None:  # fail here, before anything starts, if the checkpoint is unusable
        from megarl.checkpoint import CheckpointError
        from megarl.loop import resume_point

        try:
            resumed = resume_point(cfg)
        except CheckpointError as err:
            raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume}: {err}") from None
        newer = [] if resumed is None else [
            p for p in Path(cfg.run.dir, "checkpoints").glob("step_*") if (p / "meta.json").is_file()
            and int(p.name.removeprefix("step_")) > resumed.step]
        if newer:
            raise ConfigError(
                f"checkpoint.resume: {resumed.path} is older than {', '.join(sorted(p.name for p in newer))} in "
                f"{cfg.run.dir}/checkpoints, which the resumed run would mix with its own saves; move those away "
                "(or resume from the newest with checkpoint.resume=latest)"
            )
        if resumed is not None and resumed.step + 1 >= cfg.run.steps:
            raise ConfigError(
                f"checkpoint.resume: {resumed.path} is after step {resumed.step}, so run.steps={cfg.run.steps} "
                "leaves nothing to do; raise run.steps"
            )
    if create_run_dir:
        run_dir = Path(cfg.run.dir)
        if (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite and cfg.checkpoint.resume is None:
            raise ConfigError(
                f"run.dir={run_dir} already holds a run; choose another run.dir, set run.overwrite=true, or "
                "continue it with checkpoint.resume=latest"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return cfg


def check_data(cfg: Config) -> list[str]:
    """Open every dataset file and check each row's schema, and import the reward function, before anything
    starts (megarl/data/task.py `validate`); one line per file. Raises ConfigError naming the file, row and field."""
    from megarl.data.task import validate

    try:
        return validate(cfg)
    except (ValueError, OSError) as err:  # DataFormatError, RewardConfigError, a missing or unreadable file
        raise ConfigError(f"data/reward: {err}") from None


def _trainer_rank(rank: int, cfg_data: dict[str, Any], fleet_urls: list[str], ports: dict[str, int]) -> None:
    """Entry point of one trainer process spawned here (every address is this machine's loopback)."""
    from megarl.rank import run_rank

    cfg = Config.model_validate(cfg_data)
    place = ProcessPlace("local", rank, cfg.trainer.world_size, rank, "127.0.0.1", ports["master"])
    run_rank(cfg, place, ports["sync"], lambda: fleet_urls)


def sync_savings(cfg: Config, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes this run's schedule moved versus pushing after every step (sync_interval = 1)."""
    batches = cfg.run.steps  # the fleet generated the batches the trainer consumed, and no others
    every_step = sum(SyncSchedule(1, cfg.sync.offset).sync_before_batch(j) is not None for j in range(batches))
    every_step += int(cfg.sync.push_initial)  # that run would make the initial push too
    done = sum(r.get("sync/count", 0) for r in records)
    per_sync = (sum(r.get("sync/bytes_sent", 0) for r in records) / done) if done else None
    return {"sync/pushes": done, "sync/pushes_if_interval_1": every_step, "sync/bytes_per_push": per_sync,
            "sync/bytes_saved_vs_interval_1": None if per_sync is None else per_sync * (every_step - done)}


class TrainerError(RankError):
    """A trainer rank failed. The message is one line: the rank, the cause, and the file with its traceback
    (`megarl.rank.error_log`); the attributes are `RankError`'s."""


def run_trainers(cfg: Config, fleet_urls: list[str], hint: str = "") -> None:
    """Spawn the trainer ranks against a running fleet and wait for them; a rank that raises or dies is
    reported as one `TrainerError` line, "trainer rank <k> failed: <Type>: <message> (traceback:
    <run.dir>/trainer_rank<k>_error.log; <hint>)", and the others are stopped (`megarl.parallel.spawn`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ports = {"master": cfg.trainer.master_port or free_port(), "sync": free_port()}
    try:
        run_ranks(_trainer_rank, cfg.trainer.world_size, cfg.model_dump(mode="json"), fleet_urls, ports,
                  role="trainer", log_dir=Path(cfg.run.dir), hint=hint)
    except RankError as err:
        raise TrainerError.from_rank_error(err) from None


def train(cfg: Config, fleet_urls: list[str] | None = None) -> dict[str, Any]:
    """Run the job and write `summary.json` and `reward_and_sync.png`. The fleet is started (and
    stopped) here unless `fleet_urls` names one that is already serving the same model. A fleet started here is the
    run's: its replicas are registered in `<run.dir>/fleet/` and a dead one is restarted up to `rollout.restarts`
    times and registered again (`megarl.rollout.restarts`), which the trainer watches.

    The fleet is guarded by a secret: a fleet started here sets `MEGARL_FLEET_SECRET_FILE` (`start_fleet`) before
    the trainer ranks are spawned, and they inherit it. With `fleet_urls` the caller sets `MEGARL_FLEET_SECRET_FILE`
    to that fleet's secret file (`FleetHandle.secret_file`) before calling, or the fleet refuses the trainer."""
    from megarl.rollout.run_fleet import start_fleet

    run_dir = Path(cfg.run.dir)
    if fleet_urls is None:
        prestart()  # the trainer's forkserver imports torch and megatron-core while the fleet starts
        with start_fleet(cfg, log_dir=run_dir, run_dir=run_dir) as fleet:
            run_trainers(cfg, fleet.urls, hint=f"fleet logs: {', '.join(str(p) for p in fleet.logs)}")
    else:
        run_trainers(cfg, fleet_urls)
    return finish_run(cfg)


def finish_run(cfg: Config) -> dict[str, Any]:
    """After the last step: `summary.json` (rewards, sync bytes and savings, overlap), `reward_and_sync.png`,
    `mismatch.png` and `timeline.png` in the run directory, from `metrics.jsonl` and `timeline.json`."""
    run_dir = Path(cfg.run.dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = summarize(records) | sync_savings(cfg, records)
    spans = load_spans(run_dir / "timeline.json")  # this launch's steps (a resumed run: since the resume)
    wall = max((s.end for s in spans), default=0.0)
    summary |= {"pipeline/overlap_enabled": cfg.rollout.overlap, **overlap_summary(spans, wall)}
    write_json_atomic(run_dir / "summary.json", summary)
    plot_run(records, run_dir / "reward_and_sync.png")
    plot_mismatch(records, run_dir / "mismatch.png")
    plot_timeline(spans, run_dir / "timeline.png", title=f"{run_dir.name}: overlap {summary['pipeline/overlap']:.2f}"
                  if summary["pipeline/overlap"] is not None else run_dir.name)
    return summary
