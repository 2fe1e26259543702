"""Liveness is health, not a pid: a replica whose `/health` has failed for longer than `rollout.health_timeout_s` is
dead, whatever its processes do.

vLLM's `/health` answers from the API server's event loop without an engine round-trip: 200 while the engine
lives, 503 once it is dead; megarl's middleware also answers 503 while the engine core hangs
(`megarl.rollout.engine_probe`); a server that is gone refuses the connection, a hung one (stopped, or its loop
blocked) does not answer within the probe's timeout. Each of those is a failed probe. `Liveness` remembers when the
current run of failed probes began; the replica is dead once that run has lasted the bound. One answered probe ends
the run.

Who uses it: `megarl train`'s watcher (`megarl.rollout.restarts`) and `megarl serve` (`megarl.roles.serve`) kill a dead
replica's whole process group and restart it; `RolloutClient`'s long calls (`megarl.rollout.client`) watch the
replica while they wait and give up on a dead one.
"""

from __future__ import annotations

import threading
import time

import requests

PROBE_EVERY_S = 1.0  # how often a watcher probes (a call in flight probes at most this often, whoever waits on it)
PROBE_TIMEOUT_S = 5.0  # one probe's timeout, at most (and at most half the bound)


class Liveness:
    """The health of the server at `url`, judged against `bound_s`. Thread-safe: concurrent callers of `dead()`
    share one probe per `every_s`."""

    def __init__(self, url: str, bound_s: float, every_s: float = PROBE_EVERY_S) -> None:
        self.url = url.rstrip("/")
        self.bound_s = bound_s
        self.every_s = every_s
        self.probe_timeout_s = min(PROBE_TIMEOUT_S, max(0.5, bound_s / 2))
        self.failing_since: float | None = None  # monotonic time the current run of failed probes began
        self.last_failure = ""  # what the last failed probe saw
        self._last_probe = -float("inf")  # when the last probe was started (`dead` throttles on it)
        self._last_seen = -float("inf")  # when the last probe ended
        self._lock = threading.Lock()

    def probe(self) -> bool:
        """GET `/health` once; whether it answered 200 (and record the outcome)."""
        started = time.monotonic()
        try:
            status = requests.get(f"{self.url}/health", timeout=self.probe_timeout_s).status_code
            why = "" if status == 200 else f"/health answered {status}"
        except requests.RequestException as err:
            why = f"/health did not answer: {type(err).__name__}"
        with self._lock:
            # a failure after a gap in the probes starts a new run: what happened in between is not known
            gap = started - self._last_seen > 2 * self.every_s + self.probe_timeout_s
            if not why:
                self.failing_since = None
            elif self.failing_since is None or gap:
                self.failing_since = started
            if why:
                self.last_failure = why
            self._last_seen = time.monotonic()
        return not why

    def failing_for(self) -> float:
        """Seconds the current run of failed probes has lasted (0 while the last probe answered)."""
        since = self.failing_since
        return 0.0 if since is None else time.monotonic() - since

    def dead(self) -> bool:
        """Probe now unless another caller did within `every_s`; whether the failures have lasted `bound_s`."""
        with self._lock:
            due = time.monotonic() - self._last_probe >= self.every_s
            if due:
                self._last_probe = time.monotonic()
        if due:
            self.probe()
        return self.failing_for() >= self.bound_s

    def why(self) -> str:
        """One line: how long and how `/health` has failed, and the bound."""
        return (f"{self.last_failure or '/health failed'} for {self.failing_for():.1f}s (the bound, "
                f"rollout.health_timeout_s, is {self.bound_s:g}s)")
