"""Metric sinks (megarl/metrics/sinks.py) read back by independent readers: TensorBoard's own event reader and a
reader of W&B's on-disk record log written here; both must hold exactly what metrics.jsonl holds."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from megarl.config.schema import Config, MetricsConfig, ModelConfig, RunConfig
from megarl.metrics.sinks import open_sinks
from megarl.metrics.writer import MetricsWriter


def _config(run_dir: Path, **metrics) -> Config:
    return Config(run=RunConfig(dir=run_dir), model=ModelConfig(hf_dir=run_dir), metrics=MetricsConfig(**metrics))


def _records(offset: float) -> list[dict]:
    return [{"step": s, "reward/mean": 0.1 * s + offset, "loss": -s - offset, "batch_lag": s % 2,
             "sync/versions": [s], "train/skipped_step": 0, "logprob/engine_vs_trainer": None, "flag": True}
            for s in range(5)]


def _tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_jsonl_scalars_and_a_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    cfg = _config(tmp_path, tensorboard=True)
    writer = MetricsWriter(tmp_path, None, open_sinks(cfg, None))
    for r in _records(0.0):
        writer.write(r)
    writer.close()
    resumed = MetricsWriter(tmp_path, 3, open_sinks(cfg, 3))  # the run resumed from the checkpoint of step 2
    for r in _records(100.0)[3:]:
        resumed.write(r)
    resumed.close()
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    # numbers only (lists, booleans and nulls stay in metrics.jsonl), float32 in the event file
    assert set(scalars) == {"reward/mean", "loss", "batch_lag", "train/skipped_step"}
    for key, by_step in scalars.items():
        assert by_step == pytest.approx({r["step"]: float(r[key]) for r in jsonl}, rel=1e-6), key
    assert scalars["loss"][4] == pytest.approx(-104.0)  # the resumed run's value, not the interrupted run's


def _wandb_history(run_file: str) -> list[dict[str, object]]:
    """The history rows of an offline W&B run, from its record log: a header of 7 bytes, then 32 KiB blocks of
    chunks (crc u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) holding protobuf `Record`s. Read while
    wandb's service may still be writing it: the rows of the records complete in the file so far."""
    from wandb.proto import wandb_internal_pb2 as pb2

    data, pos, block, chunk, rows = Path(run_file).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # the end, or a chunk not all written yet
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_the_jsonl_scalars(tmp_path):
    cfg = _config(tmp_path, tensorboard=False, wandb=True, wandb_mode="offline")
    writer = MetricsWriter(tmp_path, None, open_sinks(cfg, None))
    for r in _records(0.5):
        writer.write(r)
    writer.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    # wandb's own service process writes the record log: under heavy load its last blocks can reach the disk a
    # moment after finish() returned (one whole-suite run read no history at all), so read until complete
    deadline = time.monotonic() + 30
    while len(rows := _wandb_history(runs[0])) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [row["_step"] for row in rows] == list(range(5))
    for row, r in zip(rows, _records(0.5), strict=True):
        mine = {k: v for k, v in row.items() if not k.startswith("_")}
        assert mine == pytest.approx({"reward/mean": r["reward/mean"], "loss": r["loss"],
                                      "batch_lag": r["batch_lag"], "train/skipped_step": 0})
    assert (tmp_path / "wandb_run_id").read_text().strip() in runs[0]


class _Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def log(self, record):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        pass


def test_a_failing_sink_is_dropped_and_the_jsonl_stays_complete(tmp_path, caplog):
    broken = _Broken()
    writer = MetricsWriter(tmp_path, None, [broken])
    for r in _records(0.0):
        writer.write(r)
    writer.close()
    assert broken.calls == 1 and "metrics sink broken failed at step 0" in caplog.text
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
