"""Failpoints: named moments of a push at which a test can hold a process of the run (trainer rank 0, or a vLLM
worker), act (kill a replica), and let it go on, so that a fault lands in a phase too short to hit from outside (a
replica paused but not yet opened, a replica loading what it received, a replica about to report), every time.

Off unless the environment variable `MEGARL_FAILPOINTS` names a directory; then `hold(name)` looks for the file
`<dir>/<name>` (the test arms the point by creating it). If it is there, `hold` writes `<dir>/<name>.reached` (the
holding process's pid) and waits until the file is removed (the test removes it once it has acted), at most
`HOLD_MAX_S`. A point is armed once: the test removes the file, so later passes go straight on. A point armed with
the text `fail` (the file's content) raises `FailpointError` there instead, in the first process to reach it, once
(that process removes the file after writing `<name>.reached`): a failure of the code at that moment, e.g. a vLLM
loader that raises part-way through a push (tests/test_fault_inflight.py). Disarmed, a point costs one environment
lookup. The fleet's servers inherit the trainer's environment (`megarl.rollout.fleet.server_env`, restarts
included), so one directory reaches the vLLM workers too.

The points:
    push.paused.replica<i>   trainer rank 0 (`megarl.sync.lifecycle`): replica i answered /pause; its update is not
                             open yet (/start_weight_update)
    push.loading.replica<i>  each vLLM worker of replica i (`megarl.sync.vllm_receiver`): inside the model's
                             `load_weights`, after vLLM's layerwise reload began, before the first received tensor is
                             loaded: in a staged receive every byte has arrived and the TP workers agreed; in a
                             streamed one the first tensor is complete (receiving and loading overlap). The worker's
                             heartbeat thread beats on meanwhile, and its replica's /update_weights is in flight
    push.report.replica<i>   trainer rank 0 (`megarl.sync.lifecycle`): replica i's workers have loaded the update;
                             its report is not read yet
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

ENV = "MEGARL_FAILPOINTS"
HOLD_MAX_S = 600.0  # a test that never releases a point does not hold the run forever
POLL_S = 0.02

T = TypeVar("T")
FAIL = "fail"  # the content of an armed point that raises instead of holding


class FailpointError(RuntimeError):
    """Raised at a failpoint armed with `FAIL` (an injected failure)."""


def hold(name: str) -> None:
    """Wait at failpoint `name` while a test holds it, or raise `FailpointError` there if it is armed with `FAIL`
    (see the module docstring); return at once otherwise."""
    root = os.environ.get(ENV)
    if not root:
        return
    armed = Path(root) / name
    try:
        fail = armed.read_text().strip() == FAIL
    except FileNotFoundError:
        return
    (Path(root) / f"{name}.reached").write_text(f"{os.getpid()}\n")
    if fail:
        armed.unlink(missing_ok=True)
        raise FailpointError(f"failure injected at failpoint {name} ({ENV}={root})")
    deadline = time.monotonic() + HOLD_MAX_S
    while armed.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def hold_before_first(name: str, items: Iterable[T]) -> Iterator[T]:
    """`items` unchanged, `hold(name)` once when the consumer asks for the first one (after the first item exists):
    the point falls inside the consumer's loop, after whatever it did before it began (vLLM's `load_weights`, after
    the layerwise reload was set up). Nothing is held for an empty `items`."""
    for i, item in enumerate(items):
        if i == 0:
            hold(name)
        yield item
