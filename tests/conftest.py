"""Shared, expensive fixtures: the tiny checkpoints and ONE vLLM fleet for the whole test session; and the suite's
time budget (`tests/suite_budget.py`, the budgets in `tests/README.md`)."""

from tests.fleet_fixture import fleet_secret, moe_fleet, moe_fleet_2x1, tiny_moe_dir  # noqa: F401 - session fixtures used across test files
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - session fixture: a real 3-node SLURM cluster
from tests.suite_budget import SuiteTimes


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook
    config.pluginmanager.register(SuiteTimes(), "megarl_suite_times")
