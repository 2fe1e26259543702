"""Run-directory outputs: `metrics.jsonl` (one record per step), `summary.json`, the plot."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON record per step and flushes it, so a crashed run keeps every finished step.
    `resume_at=k` continues a resumed run: the records of steps before k are kept, later ones (written by
    the interrupted run after its checkpoint) are dropped."""

    def __init__(self, run_dir: Path, resume_at: int | None = None, sinks: list | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.sinks = list(sinks or [])  # megarl.metrics.sinks: TensorBoard, wandb (fed after the JSONL line)
        self.records: list[dict[str, Any]] = []
        if resume_at is not None and self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    kept.append(json.loads(line))
                except ValueError:  # a line cut short by the crash that made the run resume: a later step anyway
                    continue
            self.records = [r for r in kept if r.get("step", resume_at) < resume_at]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.path)
        self._file = self.path.open("a" if resume_at is not None else "w")

    def write(self, record: dict[str, Any]) -> None:
        """Append `record`. Non-finite numbers are written as null (JSON has no NaN) and listed under
        `nonfinite`; in a step the trainer did not skip (`train/skipped_step`) they stop the run."""
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            record = {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for sink in list(self.sinks):
            try:
                sink.log(record)
            except Exception as err:  # the JSONL has the record: report the sink once, drop it, train on
                logger.warning("metrics sink %s failed at step %s and is dropped (metrics.jsonl is complete): %s",
                               sink.name, record.get("step"), err)
                self.sinks.remove(sink)
        if bad and not record.get("train/skipped_step"):
            raise FloatingPointError(
                f"step {record.get('step')}: non-finite metrics {bad}; the run stops here "
                f"(records so far are in {self.path}). Lower optimizer.lr or check the data."
            )

    def close(self) -> None:
        self._file.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:
                logger.warning("metrics sink %s failed to close: %s", sink.name, err)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file then rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def summarize(records: list[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """Reward at the start and end (means over `window` steps), lags, sync traffic totals."""
    if not records:
        return {"steps": 0}
    rewards = [r["reward/mean"] for r in records]
    w = max(1, min(window, len(rewards) // 2 or 1))
    sent = sum(r.get("sync/bytes_sent", 0) for r in records)
    secs = sum(r.get("sync/seconds", 0.0) for r in records)
    return {
        "steps": len(records),
        "reward/first_steps_mean": sum(rewards[:w]) / w,
        "reward/last_steps_mean": sum(rewards[-w:]) / w,
        "reward/window": w,
        "batch_lags": [r["batch_lag"] for r in records],
        "sync/bytes_sent_total": sent,
        "sync/bytes_received_total": sum(r.get("sync/bytes_received", 0) for r in records),
        "sync/seconds_total": secs,
        # where the sync seconds went (megarl.sync.weight_sync.SyncStats.phases), summed over the run
        **{f"{k}_total": sum(r.get(k, 0.0) for r in records)
           for k in sorted({k for r in records for k in r if k.startswith("sync/") and k.endswith("_s")})},
        "sync/GBps": (sent / secs / 1e9) if secs > 0 else None,
    }
