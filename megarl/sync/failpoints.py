"""Failpoints: named moments of a push at which a test can hold a process of the run (trainer rank 0, or a vLLM
worker), act (kill a replica), and let it go on, so that a fault lands in a phase too short to hit from outside (a
replica paused but not yet opened, a replica loading what it received, a replica about to report), every time; or
at which a vLLM worker fails or kills its own replica by itself, at full speed, when it holds requests.

Off unless the environment variable `MEGARL_FAILPOINTS` names a directory; then `hold(name)` looks for the file
`<dir>/<name>` (the test arms the point by creating it). If it is there, `hold` writes `<dir>/<name>.reached` (the
holding process's pid) and waits until the file is removed (the test removes it once it has acted), at most
`HOLD_MAX_S`. A point is armed once: the test removes the file, so later passes go straight on. A point armed with
the text `fail` (the file's content) raises `FailpointError` there instead, in the first process to reach it, once
(that process removes the file after writing `<name>.reached`): a failure of the code at that moment, e.g. a vLLM
loader that raises part-way through a push. Disarmed, a point costs one environment lookup. The fleet's servers
inherit the trainer's environment (`megarl.rollout.fleet.server_env`, restarts included), so one directory reaches
the vLLM workers too.

Conditional modes, for points inside a vLLM worker that pass `held` (the requests its model runner holds now: engine
request id -> output tokens), so that a fault lands exactly when the replica is paused for an in-flight push with
requests held, and nobody waits for anything (holding a process of the run lengthens the phase, which a user's run
would not get): armed with `fail-if-held` (`FAIL_IF_HELD`) or `kill-if-held` (`KILL_IF_HELD`), a pass at which no
request holds an output token goes on untouched (it appends what it saw, one JSON line, to `<name>.passed`) and the
point stays armed; the first pass at which one does writes `<name>.reached` (one JSON object: `pid`, `pgid`,
`held`, `time`, written whole before it appears), disarms the point, and then raises `FailpointError`
(`fail-if-held`) or SIGKILLs its own process group (`kill-if-held`: the fleet starts each server as the leader of a
process group and session of its own, `megarl.rollout.fleet`, so that is exactly its replica; a process whose group
does not lead its session refuses, raising instead). Inside an RPC that must not raise (`push.held`) the failure
is logged instead. tests/test_fault_inflight.py arms them.

Armed with `kill-engine` (`KILL_ENGINE`), a point inside a vLLM worker SIGKILLs the worker's engine core (its parent
process) at the first pass, with nobody waiting: what a CUDA error or an out-of-memory kill does to an engine
mid-push, while its API server lives on. It writes `<name>.reached` (`pid`, `engine_core`, `time`) and disarms the
point first, then raises `FailpointError` in the worker; a process whose parent is not an engine core refuses
(raises without killing). tests/test_slurm_failover.py arms it. `kill-engine-if-held` (`KILL_ENGINE_IF_HELD`) does
the same at the first pass with a request's output token held, as the other `-if-held` modes (its record adds
`pgid` and `held`; tests/test_fault_inflight.py's cell E). `stop-engine-if-held` (`STOP_ENGINE_IF_HELD`) SIGSTOPs
the engine core there instead, never continued: an engine that hangs (a wedged kernel or collective) while its
worker and API server live on; the worker returns as if nothing happened, its answer never forwarded (cell W).

Armed with `kill <pid>` (`KILL_PROCESS`, then a process id of this machine), the first process to pass the point
SIGKILLs that process and goes on at once: a replica that crashes at exactly that moment of a push, with nobody
waiting (trainer rank 0's points, whose process cannot signal a replica by itself: the test names the victim, its
API server or its engine core, when it arms the point). It writes `<name>.reached` (`pid`, `victim`, `killed`:
whether the process was still there, `time`) and disarms the point; a victim already gone is recorded, not an
error. tests/test_fault_matrix.py arms it (cells P and R).

The points:
    push.held.replica<i>     each vLLM worker of replica i (`megarl.sync.vllm_receiver`, `megarl_held_requests`): a
                             push's lifecycle asks what the model runner holds while the replica is paused in keep
                             mode (in-flight updates; its update is not open yet); passes `held`
    push.pause.replica<i>    trainer rank 0 (`megarl.sync.lifecycle`): everything of the push before replica i's
                             /pause is done (the earlier replicas are paused); its /pause is not sent yet
    push.paused.replica<i>   trainer rank 0 (`megarl.sync.lifecycle`): replica i answered /pause; its update is not
                             open yet (/start_weight_update)
    push.loading.replica<i>  each vLLM worker of replica i (`megarl.sync.vllm_receiver`): inside the model's
                             `load_weights`, after vLLM's layerwise reload began, before the first received tensor is
                             loaded: in a staged receive every byte has arrived and the TP workers agreed; in a
                             streamed one the first tensor is complete (receiving and loading overlap). The worker's
                             heartbeat thread beats on meanwhile, and its replica's /update_weights is in flight;
                             passes `held`: what the model runner held at this push's pause (`push.held`'s counts;
                             nothing unless the push paused in keep mode)
    push.report.replica<i>   trainer rank 0 (`megarl.sync.lifecycle`): replica i's workers have loaded the update;
                             its report is not read yet
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

ENV = "MEGARL_FAILPOINTS"
HOLD_MAX_S = 600.0  # a test that never releases a point does not hold the run forever
POLL_S = 0.02

T = TypeVar("T")
FAIL = "fail"  # the content of an armed point that raises instead of holding
FAIL_IF_HELD = "fail-if-held"  # raises, once, at the first pass that finds a request with an output token held
KILL_IF_HELD = "kill-if-held"  # SIGKILLs its own process group, once, at the first such pass
KILL_ENGINE = "kill-engine"  # a vLLM worker SIGKILLs its engine core (its parent process), once, at the first pass
KILL_ENGINE_IF_HELD = "kill-engine-if-held"  # the same, at the first pass with a request's output token held
STOP_ENGINE_IF_HELD = "stop-engine-if-held"  # SIGSTOPs the engine core instead (hung, never continued) and goes on
KILL_PROCESS = "kill"  # `kill <pid>`: SIGKILLs process <pid> of this machine, once, at the first pass, and goes on
ENGINE_CORE_COMM = "VLLM::EngineCor"  # the engine core's process name as /proc shows it (cut to 15 characters)
Held = Callable[[], Mapping[str, int]]  # what a worker's model runner holds now: engine request id -> output tokens


class FailpointError(RuntimeError):
    """Raised at a failpoint armed with `FAIL` (an injected failure)."""


def hold(name: str, held: Held | None = None) -> None:
    """Wait at failpoint `name` while a test holds it, or raise `FailpointError` there if it is armed with `FAIL`;
    armed with `FAIL_IF_HELD` or `KILL_IF_HELD`, fail or kill if `held()` has a request with an output token (see
    the module docstring); return at once otherwise."""
    root = os.environ.get(ENV)
    if not root:
        return
    armed = Path(root) / name
    try:
        mode = armed.read_text().strip()
    except FileNotFoundError:
        return
    if mode in (FAIL_IF_HELD, KILL_IF_HELD, KILL_ENGINE_IF_HELD, STOP_ENGINE_IF_HELD):
        _if_held(armed, mode, held)
        return
    if mode.split()[:1] == [KILL_PROCESS]:
        _kill_process(armed, mode)
        return
    if mode == KILL_ENGINE:
        _signal_engine(armed, mode, {}, signal.SIGKILL)
    fail = mode == FAIL
    (Path(root) / f"{name}.reached").write_text(f"{os.getpid()}\n")
    if fail:
        armed.unlink(missing_ok=True)
        raise FailpointError(f"failure injected at failpoint {name} ({ENV}={root})")
    deadline = time.monotonic() + HOLD_MAX_S
    while armed.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _if_held(armed: Path, mode: str, held: Held | None) -> None:
    """Point `armed` (armed with one of the `-if-held` modes): go on if no request holds an output token, else
    record what was held, disarm, and fail, kill, or stop the engine and go on (see the module docstring)."""
    name = armed.name
    if held is None:
        raise FailpointError(f"failpoint {name} is armed {mode!r}, but it knows no held requests: only points inside "
                             "a vLLM worker do (push.held.replica<i>, push.loading.replica<i>)")
    seen = {str(rid): int(tokens) for rid, tokens in held().items()}
    record = json.dumps({"pid": os.getpid(), "pgid": os.getpgrp(), "held": seen, "time": time.time()})
    if not any(tokens >= 1 for tokens in seen.values()):
        with (armed.parent / f"{name}.passed").open("a") as f:
            f.write(record + "\n")
        return
    if mode in (KILL_ENGINE_IF_HELD, STOP_ENGINE_IF_HELD):
        stop = mode == STOP_ENGINE_IF_HELD
        _signal_engine(armed, mode, {"pgid": os.getpgrp(), "held": seen}, signal.SIGSTOP if stop else signal.SIGKILL)
        return
    _record_reached(armed, record)
    if mode == KILL_IF_HELD and os.getsid(0) == os.getpgrp():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    why = "" if mode == FAIL_IF_HELD else (" (asked to kill its process group, which does not lead its own session: "
                                           "not a replica's server group, so it raised instead)")
    raise FailpointError(f"failure injected at failpoint {name} with requests held ({ENV}={armed.parent}){why}")


def _kill_process(armed: Path, mode: str) -> None:
    """Point `armed`, armed with `kill <pid>`: SIGKILL that process, record it, disarm, and go on."""
    words = mode.split()
    if len(words) != 2 or not words[1].isdigit():
        raise FailpointError(f"failpoint {armed.name} is armed {mode!r}: {KILL_PROCESS!r} takes one process id, "
                             f"e.g. '{KILL_PROCESS} 1234'")
    victim = int(words[1])
    try:
        os.kill(victim, signal.SIGKILL)
        killed = True
    except ProcessLookupError:
        killed = False
    _record_reached(armed, json.dumps({"pid": os.getpid(), "victim": victim, "killed": killed, "time": time.time()}))


def _record_reached(armed: Path, record: str) -> None:
    """Write `<name>.reached` (`record`, whole when it appears) and disarm point `armed`."""
    partial = armed.parent / f".{armed.name}.reached.{os.getpid()}"
    partial.write_text(record + "\n")
    os.replace(partial, armed.parent / f"{armed.name}.reached")
    armed.unlink(missing_ok=True)


def _signal_engine(armed: Path, mode: str, extra: dict[str, object], sig: signal.Signals) -> None:
    """Point `armed` (armed with `KILL_ENGINE`, or an `-ENGINE_IF_HELD` mode with a request held), in a vLLM worker:
    send `sig` to its engine core, the worker's parent, and record it (with `extra`). SIGKILL is what a CUDA error
    or an out-of-memory kill does to an engine, at full speed, while its API server lives on: then raise. SIGSTOP is
    an engine that hangs (a wedged kernel or collective): the worker goes on, its answer never forwarded. Refuses
    (raises without signalling) in a process whose parent is not an engine core."""
    parent = os.getppid()
    try:
        comm = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        comm = "?"
    if not comm.startswith(ENGINE_CORE_COMM):
        raise FailpointError(f"failpoint {armed.name} is armed {mode!r}, but this process's parent ({parent}, "
                             f"{comm!r}) is not a vLLM engine core: only points inside a vLLM worker "
                             "(push.held.replica<i>, push.loading.replica<i>) can signal their engine")
    _record_reached(armed, json.dumps({"pid": os.getpid(), "engine_core": parent, "time": time.time(), **extra}))
    os.kill(parent, sig)
    if sig == signal.SIGSTOP:
        return
    raise FailpointError(f"failure injected at failpoint {armed.name}: its engine core (process {parent}) was "
                         f"killed ({ENV}={armed.parent})")


def hold_before_first(name: str, items: Iterable[T], held: Held | None = None) -> Iterator[T]:
    """`items` unchanged, `hold(name, held)` once when the consumer asks for the first one (after the first item
    exists): the point falls inside the consumer's loop, after whatever it did before it began (vLLM's
    `load_weights`, after the layerwise reload was set up). Nothing is held for an empty `items`."""
    for i, item in enumerate(items):
        if i == 0:
            hold(name, held)
        yield item
