"""The `megarl` command line: `section.field=value` overrides are taken wherever they stand among the options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import _parse, _parser

ROOT = Path(__file__).parent.parent


def test_overrides_before_between_and_after_options():
    args = _parse(_parser(), ["check", "--config", "c.yaml", "rollout.tp=2", "--gpu", "sync.interval=2"])
    assert args.command == "check" and args.config == "c.yaml" and args.gpu is True
    assert args.overrides == ["rollout.tp=2", "sync.interval=2"]


@pytest.mark.parametrize("stray", ["--bogus", "stray"])
def test_anything_else_is_refused_by_name(stray, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(_parser(), ["check", "--config", "c.yaml", "rollout.tp=2", "--gpu", stray])
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {stray}" in capsys.readouterr().err


def test_plan_takes_an_override_after_an_option():
    """The delegated commands parse the same way: the real command, overrides on both sides of `--dtype`."""
    done = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "plan", "--config", "configs/qwen3_30b_a3b_guru.yaml",
         "model.hf_dir=configs/models/qwen3-30b-a3b", "--dtype", "fp32", "rollout.tp=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "x vLLM tp 8;" in done.stdout and "in fp32" in done.stdout
