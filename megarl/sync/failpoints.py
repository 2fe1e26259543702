"""Failpoints: named moments of a push at which a test can hold trainer rank 0, act (kill a replica), and let it go
on, so that a fault lands in a phase too short to hit from outside (a replica paused but not yet opened, a replica
about to report), every time.

Off unless the environment variable `MEGARL_FAILPOINTS` names a directory; then `hold(name)` looks for the file
`<dir>/<name>` (the test arms the point by creating it). If it is there, `hold` writes `<dir>/<name>.reached` and
waits until the file is removed (the test removes it once it has acted), at most `HOLD_MAX_S`. A point is armed
once: the test removes the file, so later passes go straight on. Disarmed, a point costs one environment lookup.

The points (`megarl.sync.lifecycle`):
    push.paused.replica<i>   replica i answered /pause; its update is not open yet (/start_weight_update)
    push.report.replica<i>   replica i's workers have loaded the update; its report is not read yet
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "MEGARL_FAILPOINTS"
HOLD_MAX_S = 600.0  # a test that never releases a point does not hold the run forever
POLL_S = 0.02


def hold(name: str) -> None:
    """Wait at failpoint `name` while a test holds it (see the module docstring); return at once otherwise."""
    root = os.environ.get(ENV)
    if not root:
        return
    armed = Path(root) / name
    if not armed.exists():
        return
    (Path(root) / f"{name}.reached").write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + HOLD_MAX_S
    while armed.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
