"""Metric sinks besides `metrics.jsonl`: TensorBoard scalars and, when installed and asked for, Weights & Biases.

`metrics.jsonl` stays the source of truth: a sink receives each record after it was written there, logs its
finite numeric values under the same keys at `step`, and a sink that fails is reported once and dropped (the
run goes on; nothing is lost from the JSONL). Configured by `metrics.*` (megarl/config/schema.py).
"""

from __future__ import annotations

import logging
import math
import numbers
import secrets
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class MetricSink(Protocol):
    name: str

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (booleans and lists are left to metrics.jsonl), without `step`."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardSink:
    """Scalars in `log_dir` (read with `tensorboard --logdir`). A resumed run purges the events past its
    checkpoint (`purge_step`), as metrics.jsonl drops the records past it."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError(f"metrics.tensorboard=true needs the `tensorboard` package ({err}): pip install "
                               "tensorboard, or set metrics.tensorboard=false") from None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in `run_dir/wandb` (offline by default: no network needed). The run id is kept in
    `run_dir/wandb_run_id`, so a resumed megarl run continues the same wandb run."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("metrics.wandb=true needs the `wandb` package: pip install wandb, or set "
                               "metrics.wandb=false") from None
        id_file = Path(run_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=project, dir=str(run_dir), mode=mode, id=run_id, resume="allow",
                               name=Path(run_dir).name, config=config)

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_sinks(cfg, resume_at: int | None) -> list[MetricSink]:
    """The sinks `cfg.metrics` asks for (`cfg`: the run's `Config`)."""
    run_dir, m = Path(cfg.run.dir), cfg.metrics
    sinks: list[MetricSink] = []
    try:
        if m.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", purge_step=resume_at))
        if m.wandb:
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            sinks.append(WandbSink(run_dir, m.wandb_project, m.wandb_mode, cfg.model_dump(mode="json")))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
