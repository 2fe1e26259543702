"""`megarl compare`: the communication-savings report, checked against figures worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml


def _run(root: Path, name: str, interval: int, pushes: int, per_push: int, if_1: int, wall: float) -> Path:
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"sync": {"interval": interval, "offset": 0}}))
    (run / "summary.json").write_text(json.dumps({
        "steps": 8, "batch_lags": [j % interval for j in range(8)], "sync/pushes": pushes,
        "sync/bytes_sent_total": pushes * per_push, "sync/bytes_per_push": per_push,
        "sync/pushes_if_interval_1": if_1, "sync/seconds_total": 0.5 * pushes, "pipeline/wall_s": wall,
        "sync/fleet_paused_s_total": 0.4 * pushes,
        "reward/first_steps_mean": 0.1, "reward/last_steps_mean": 0.4}))
    return run


def test_compare_reports_bytes_and_ratios(tmp_path: Path) -> None:
    every = _run(tmp_path, "every", interval=1, pushes=7, per_push=1000, if_1=7, wall=16.0)
    fourth = _run(tmp_path, "fourth", interval=4, pushes=1, per_push=1000, if_1=7, wall=12.0)
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "compare", str(fourth), str(every), "--out",
                          str(tmp_path / "report.md")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "report.json").read_text())
    assert [r["run"] for r in rows] == [str(every), str(fourth)]  # ordered by interval
    assert [r["bytes_sent"] for r in rows] == [7000, 1000]
    assert [r["bytes_vs_most"] for r in rows] == [1.0, 1000 / 7000]
    assert [r["bytes_vs_interval_1"] for r in rows] == [1.0, 1000 / 7000]
    assert [r["wall_s_per_step"] for r in rows] == [2.0, 1.5]
    assert [r["mean_lag"] for r in rows] == [0.0, 1.5]  # lags 0,1,2,3,0,1,2,3
    assert [r["fleet_paused_s"] for r in rows] == [0.4 * 7, 0.4]
    assert [r["sync_share_of_wall"] for r in rows] == [3.5 / 16.0, 0.5 / 12.0]  # push seconds / wall seconds
    assert (f"| {fourth} | 4 | 0 | 8 | 1 | 1,000 | 0.143 | 0.143 | 0.50 | 0.40 | 4.2% | 1.50 | 1.50 | 0.100 -> 0.400 |"
            in out.stdout)
    assert (tmp_path / "report.md").read_text().strip() == out.stdout.split("\nwritten:")[0].strip()


def test_compare_names_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "compare", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and f"{tmp_path}: no config.yaml" in out.stderr, out.stdout + out.stderr
