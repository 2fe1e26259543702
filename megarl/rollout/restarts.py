"""`megarl train`'s own fleet keeps its replicas up: registrations and bounded restarts.

`ReplicaWatcher.start()` registers every replica of a running fleet in `<run.dir>/fleet/replica<i>.json`
(`megarl.rollout.rendezvous`, with the server's pid, so a restart is a new incarnation) and watches each server in a
thread of its own: its process, its `/health` (`megarl.rollout.liveness`) and its condemnation by the trainer
(`megarl.rollout.rendezvous.condemned`: a push's call to it went unanswered past the push's bound while its
`/health` answered, as a stopped vLLM worker does): a server whose `/health` has failed for
`rollout.health_timeout_s` (its engine died, or it hangs), or that is condemned, is dead as one that exited. When
one dies while the run goes on, its registration is removed, its whole process group is killed, and, if the replica
has restarts left (`rollout.restarts`, per replica), the same server is started again: the same `FleetSpec` and
replica index, a free port unless `rollout.port` pins one, the same secret, its output appended to the same log.
Once the new server is healthy and guarded it is registered, so the trainer lets it in again at its next push. One
line on stderr says what happened each time:

    megarl: rollout replica 0 (http://127.0.0.1:41000) exited with code -9 (log run/vllm_replica0.log); restarted
    as http://127.0.0.1:42000 (restart 1 of 2)
    megarl: rollout replica 0 (http://127.0.0.1:41000) is dead: /health answered 503 for 10.2s (the bound,
    rollout.health_timeout_s, is 10s); its process group was killed (log ...); restarted as ... (restart 1 of 2)

A restart that fails to start counts as one. `stop()` (which `FleetHandle.stop()` calls first) ends the watching and
any restart under way, so that nothing restarts during shutdown, and removes the registrations; the fleet's own
`stop()` then stops the servers, restarted ones included (they replace their replica's entry in `FleetHandle.procs`
and `FleetHandle.urls`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from megarl.rollout.fleet import FleetError, FleetHandle, FleetSpec, server_env, start_server, wait_ready
from megarl.rollout.fleet_auth import read_secret
from megarl.rollout.liveness import Liveness
from megarl.rollout.rendezvous import (
    clear_condemned,
    incarnation,
    register_replica,
    unregister_replica,
    why_dead,
)

POLL_S = 1.0  # how often each server's process and /health are polled
GONE_TIMEOUT_S = 30.0  # how long a dead server's process group (engine core, TP workers) may take to die


class _Stopping(Exception):
    """The fleet is stopping: no restart."""


def _say(line: str) -> None:
    print(f"megarl: {line}", file=sys.stderr, flush=True)


def _last_line(log: Path, limit: int = 300) -> str:
    """The last line a server wrote to `log` (a failed start's cause, as a rule), shortened to `limit`; "" if none."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[-50:]]
    except OSError:
        return ""
    lines = [line for line in lines if line and not line.startswith("===== megarl:")]
    return lines[-1][:limit] if lines else ""


def _group_alive(pgid: int) -> bool:
    """Whether a process other than a zombie is still in process group `pgid` (from /proc where there is one)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_group(proc: subprocess.Popen, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """SIGKILL the process group `proc` leads (a server's engine core and workers outlive its API server) and wait
    until it is gone, so a restart finds its memory and port free."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


class ReplicaWatcher:
    """Registers the replicas of `fleet` (started from `spec`) in `run_dir` and restarts each one that dies, at most
    `restarts` times per replica; a replica whose `/health` fails for `health_timeout_s` is dead (None: only an exit
    is). `start()` once; `stop()` is idempotent."""

    def __init__(self, fleet: FleetHandle, spec: FleetSpec, run_dir: Path, restarts: int,
                 poll_s: float = POLL_S, health_timeout_s: float | None = None) -> None:
        self.fleet, self.spec, self.run_dir, self.restarts, self.poll_s = fleet, spec, Path(run_dir), restarts, poll_s
        self.health_timeout_s = health_timeout_s
        self.secret = read_secret(fleet.secret_file)
        self.env = server_env(spec, fleet.secret_file)
        self.used = [0] * len(fleet.procs)  # restarts made per replica (slot), failed ones included
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a server is started, or registered, only while the fleet is not stopping
        self._threads = [threading.Thread(target=self._watch, args=(slot,), daemon=True,
                                          name=f"megarl-replica{spec.first_replica + slot}-watcher")
                         for slot in range(len(fleet.procs))]

    def replica(self, slot: int) -> int:
        """The replica index of the fleet's `slot`-th server."""
        return self.spec.first_replica + slot

    def start(self) -> ReplicaWatcher:
        """Register every replica (the fleet is healthy and guarded: `launch` returned) and start watching."""
        self.fleet.watcher = self  # from here the fleet's stop() stops this first and removes the registrations
        for slot, (url, proc) in enumerate(zip(self.fleet.urls, self.fleet.procs, strict=True)):
            register_replica(self.run_dir, self.replica(slot), url, self.secret, pid=proc.pid)
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop watching and any restart under way (its server stays in `fleet.procs` for the fleet's `stop()`), and
        remove the registrations."""
        with self._lock:
            self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(0.1, deadline - time.monotonic()))
        for slot in range(len(self.fleet.procs)):
            unregister_replica(self.run_dir, self.replica(slot))

    def _watch(self, slot: int) -> None:
        """The thread of one replica: wait for its server to exit or stay unhealthy for the bound, restart it while
        restarts are left."""
        liveness, of = None, None
        while not self._stopping.wait(self.poll_s):
            proc, url = self.fleet.procs[slot], self.fleet.urls[slot]
            unhealthy = ""
            if proc.poll() is None:
                if self.health_timeout_s is not None and (liveness is None or of is not proc):
                    # a restarted server (maybe at the same URL): a fresh record
                    liveness, of = Liveness(url, self.health_timeout_s, every_s=self.poll_s), proc
                unhealthy = why_dead(self.run_dir, self.replica(slot), self.secret, incarnation(proc.pid), liveness)
                if unhealthy is None:
                    continue
            try:
                if not self._revive(slot, proc, unhealthy):
                    return  # it stays down
            except _Stopping:
                return
            except Exception as err:  # not a failed start (those are counted and said): the watcher itself broke
                _say(f"rollout replica {self.replica(slot)}: its watcher failed ({type(err).__name__}: {err}); it is "
                     "no longer restarted")
                return

    def _revive(self, slot: int, dead: subprocess.Popen, unhealthy: str = "") -> bool:
        """Replace the dead server of `slot` (exited, or `unhealthy`: why its health says it is dead); whether a new
        one serves (False: no restarts left)."""
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            unregister_replica(self.run_dir, self.replica(slot))  # the registration names a live server only
        kill_group(dead)
        clear_condemned(self.run_dir, self.replica(slot), incarnation(dead.pid), self.secret)
        i, url, log = self.replica(slot), self.fleet.urls[slot], self.fleet.logs[slot]
        what = (f"rollout replica {i} ({url}) is dead: {unhealthy}; its process group was killed (log {log})"
                if unhealthy else f"rollout replica {i} ({url}) exited with code {dead.returncode} (log {log})")
        while self.used[slot] < self.restarts:
            self.used[slot] += 1
            k = self.used[slot]
            try:
                new_url = self._restart(slot, k)
            except FleetError as err:
                cause = str(err).splitlines()[0].split("; last log lines")[0]
                last = _last_line(log)
                _say(f"{what}; restart {k} of {self.restarts} failed: {cause}"
                     f"{f', its log ending: {last}' if last else ''} (log {log})")
                what = f"rollout replica {i} (restart {k} failed)"
                continue
            _say(f"{what}; restarted as {new_url} (restart {k} of {self.restarts})")
            return True
        _say(f"{what}; it stays down: no restarts left (rollout.restarts={self.restarts}; raise it to restart a "
             "dead replica more often)")
        return False

    def _restart(self, slot: int, k: int) -> str:
        """Start the server of `slot` again, wait until it is healthy and guarded, register it; its URL."""
        i, log = self.replica(slot), self.fleet.logs[slot]
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            with log.open("a") as f:
                f.write(f"\n===== megarl: restart {k} of {self.restarts} of rollout replica {i} ({when}) =====\n")
            url, proc = start_server(self.spec, i, self.env, log, restart=True)
            self.fleet.urls[slot], self.fleet.procs[slot] = url, proc
        try:
            wait_ready(url, proc, log, self.secret, self.spec.startup_timeout_s, self._stopping)
        except FleetError:
            if self._stopping.is_set():
                raise _Stopping from None  # the fleet's stop() stops the server
            kill_group(proc)
            raise
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            register_replica(self.run_dir, i, url, self.secret, pid=proc.pid)
        return url
