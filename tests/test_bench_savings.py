"""`megarl bench savings` on the shared TP-2 fleet, a short version (4 steps, intervals 1 and 4): the files are
written, the bytes are exact (every push sends the hand-counted slices of both vLLM ranks), fewer pushes move
proportionally fewer bytes, and the seconds add up (sends + fixed part = seconds in sync; the fleet is paused
only inside pushes)."""

from __future__ import annotations

import json
import math
import subprocess

from megarl.cli import main as cli_main
from megarl.models.qwen_provider import read_hf_config
from tests.test_weight_sync import _hand_bytes_per_rank


def test_bench_savings_smoke(moe_fleet, tiny_moe_dir, tmp_path, capsys):
    """Changes the fleet's weights (each run pushes its trainer's initial weights first). `megarl bench savings`
    runs through the CLI's entry point in this process (no interpreter, imports or forkserver of its own to start)."""
    out = tmp_path / "savings.json"
    argv = ["bench", "savings", "--steps", "4", "--intervals", "4", "1", "--fleet-url", moe_fleet.base_url, "--out",
            str(out), f"model.hf_dir={tiny_moe_dir}", "data.prompts_per_step=4", "rollout.samples_per_prompt=2"]
    capsys.readouterr()
    code = cli_main(argv)
    printed = capsys.readouterr()
    proc = subprocess.CompletedProcess(["megarl", *argv], code, printed.out, printed.err)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["interval"] for r in rows] == [1, 4]
    per_push = sum(_hand_bytes_per_rank(read_hf_config(tiny_moe_dir), tp=2))
    for r in rows:
        assert r["steps"] == 4 and r["pushes"] >= 1
        assert r["bytes_sent"] == r["pushes"] * per_push
        assert r["send_s"] > 0 and r["fixed_s"] > 0
        assert math.isclose(r["send_s"] + r["fixed_s"], r["push_s"])
        assert 0 < r["fleet_paused_s"] <= r["push_s"]
        assert 0 < r["sync_share_of_wall"] < 1
    every, fourth = rows
    assert fourth["pushes"] < every["pushes"]
    assert fourth["bytes_sent"] / every["bytes_sent"] == fourth["pushes"] / every["pushes"]
    assert every["bytes_vs_interval_1"] == 1.0 and fourth["bytes_vs_interval_1"] < 1.0
    assert "| 4 | " in proc.stdout and "wrote" in proc.stdout
