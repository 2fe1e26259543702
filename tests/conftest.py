"""Shared, expensive fixtures: the tiny checkpoints and ONE vLLM fleet for the whole test session; and the suite's
time budget (`tests/suite_budget.py`, the budgets in `tests/README.md`)."""

from tests.fleet_fixture import (  # noqa: F401 - session fixtures used across test files
    fleet_secret,
    moe_fleet,
    moe_fleet_2x1,
    order_fleet_killers_last,
    revive_killed_fleets,
    session_failpoints,
    tiny_moe_dir,
    tiny_moe_long_dir,
)
from tests.slurm_cluster import slurm_cluster  # noqa: F401 - session fixture: a real 3-node SLURM cluster
from tests.suite_budget import SuiteTimes


def pytest_collection_modifyitems(items) -> None:  # noqa: ANN001 - pytest's hook
    order_fleet_killers_last(items)  # tests that kill a session fleet's replica run last


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook
    config.pluginmanager.register(SuiteTimes(), "megarl_suite_times")
