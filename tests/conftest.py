"""Shared, expensive fixtures: the tiny checkpoints and ONE vLLM fleet for the whole test session."""

from pathlib import Path

import pytest

from megarl.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", kind="moe")


@pytest.fixture(scope="session")
def moe_fleet(tiny_moe_dir, tmp_path_factory):
    """A real vLLM server, tensor parallel 2, serving the tiny MoE. Tests that change its weights
    must say so; tests that need the original weights push them (sync.push_initial)."""
    from megarl.rollout.fleet import FleetSpec, launch

    fleet = launch(FleetSpec(model_dir=tiny_moe_dir, tp=2, log_dir=tmp_path_factory.mktemp("fleet_logs")))
    yield fleet
    fleet.stop()
