"""A run's fleet: the servers of `megarl.rollout.fleet`, and for `megarl train`'s own fleet its registry and restarts.

The rollout package's order, bottom to top: `fleet` (processes: start, health, stop) <- `rendezvous` (the registry
of live replicas in `<run_dir>/fleet/`) <- `restarts` (the watcher that restarts a dead replica and registers it
again) <- this module, which puts them together.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.rollout.fleet import FleetHandle, fleet_spec, launch
from megarl.rollout.fleet_auth import SECRET_ENV
from megarl.rollout.rendezvous import clear_fleet
from megarl.rollout.restarts import ReplicaWatcher

if TYPE_CHECKING:
    from megarl.config.schema import Config


@contextmanager
def start_fleet(cfg: Config, log_dir: Path, run_dir: Path | None = None) -> Iterator[FleetHandle]:
    """The fleet of a run config (`megarl.config.schema.Config`), stopped on exit. Inside the block
    `MEGARL_FLEET_SECRET_FILE` names the fleet's secret file, so processes started there (the trainer ranks)
    and `RolloutClient`s made there send it; the previous value is restored on exit.

    With `run_dir` (`megarl train`: the run's directory) the fleet is this run's: earlier registrations there are
    cleared, every replica is registered in `<run_dir>/fleet/` once healthy and guarded, and a replica whose server
    exits, or whose `/health` fails for `rollout.health_timeout_s`, is restarted up to `rollout.restarts` times and
    registered again (`megarl.rollout.restarts`); the registrations are removed when the fleet stops."""
    spec = fleet_spec(cfg, log_dir=Path(log_dir))
    if run_dir is not None:
        clear_fleet(run_dir)  # an earlier run's registrations in the same run directory are not this fleet's
    fleet = launch(spec)
    if run_dir is not None:
        try:
            ReplicaWatcher(fleet, spec, Path(run_dir), cfg.rollout.restarts,
                           health_timeout_s=cfg.rollout.health_timeout_s).start()
        except BaseException:
            fleet.stop()
            raise
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = str(fleet.secret_file)
    try:
        yield fleet
    finally:
        if previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous
        fleet.stop()
