"""A replica whose engine core hangs fails `/health`: liveness covers the engine core, not only the API server.

vLLM's `/health` answers from the API server's event loop without an engine round-trip, so an engine core that
hangs (stopped, or inside a CUDA call that never returns) leaves it 200 forever while every generate call waits for
its client's read timeout. (A hung TP worker is bounded by vLLM itself, `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`; a hung
API server fails `/health`; on GPUs a TP-1 replica's worker is its engine core, which nothing else bounds.)

`EngineProbeMiddleware` (loaded into each server with `--middleware megarl.rollout.engine_probe.EngineProbeMiddleware`,
`megarl.rollout.fleet.server_command`) keeps one engine-core round-trip going: a utility RPC
(`is_scheduler_paused`, a field read), sent again `EVERY_S` after each answer. The engine core answers utility RPCs
between its steps, so the probe costs nothing to generation and a live engine answers within one step. When the
engine core has left a probe unanswered for longer than the bound on one engine step
(`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, which the fleet sets to `rollout.step_timeout_s`; vLLM's default 300 s where
unset), `/health` answers 503 with the reason, and `megarl.rollout.liveness` judges the replica dead
`rollout.health_timeout_s` later: the launchers kill and restart it as any dead replica. The engine core answering
again turns `/health` back to 200.

The engine-RPC window is not counted: while a request to one of `PUSH_ROUTES` is in flight in this server the
engine core is legitimately inside a long RPC (a weight push's collective RPCs: opening the transfer group, receiving
and loading, the report), so a probe's clock restarts when the last of them ends. A push has its own bounds there
(the trainer's timeouts, the workers' heartbeat, `megarl.sync.heartbeat`), which condemn a replica that hangs in it.
A request's window also ends when its caller leaves (the trainer gave up on the call at the push's bound and closed
its connection): vLLM's handler goes on waiting for an engine core that hangs, and without this its replica would
pass `/health` for ever where no launcher acts on the trainer's condemnation (a fleet the caller keeps), its held
and later requests waiting for their clients' read timeout.
`/pause`, `/resume` and `/reset_prefix_cache` are not in that window: a pause (megarl's, mode "wait") lets the engine
core go on stepping until the running requests are done, answering utility RPCs between steps, so an engine core
that hangs while a push pauses it is judged by this bound, not by the push's (seen under SLURM: a hung engine core
that a push began to pause stayed "healthy" until the push's own 120 s bound). Standard library only, as the other
middleware: the API server imports it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import MutableMapping
from typing import Any

from megarl.rollout.engine_death import ASGIApp, Receive, Scope, Send, answer_503, engine_errored

EVERY_S = 1.0  # the pause between one probe's answer and the next probe
PROBE_METHOD = "is_scheduler_paused"  # EngineCore's utility method the probe calls: reads one field
DEFAULT_BOUND_S = 300.0  # vLLM's default VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
# routes whose handlers wait on a long engine-core RPC, one that occupies the engine core (vLLM's RL routes of
# megarl's push, the dev-mode RPC route, sleep and wake-up): while one is in flight, the engine core's silence is not
# counted. Not /pause, /resume, /reset_prefix_cache: the engine core answers probes meanwhile (the module docstring)
PUSH_ROUTES = frozenset({
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/collective_rpc", "/sleep", "/wake_up",
})

logger = logging.getLogger(__name__)


async def _caller_left(receive: Receive, body_read: asyncio.Event) -> None:
    """Return once the caller of a request has left (the server's `http.disconnect`), watching only after the app
    has read the whole body (so that no body message is taken from it). A caller that gives up on a push's call (the
    push's own bound) closes its connection: the request's push window ends there, although its handler may wait on
    a hung engine core forever."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


def bound_s() -> float:
    """How long the engine core may leave a probe unanswered: the bound on one engine step
    (`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, `rollout.step_timeout_s`), since it answers between steps."""
    return float(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", DEFAULT_BOUND_S))


class EngineProbeMiddleware:
    """Pure ASGI middleware: `/health` answers 503 (`{"error": {"message": ..., "code": 503}}`) while the engine core
    has left a probe unanswered for longer than `bound_s()` outside the push window. One task per server probes,
    from the first request on; other requests pass through, and everything does where the app has no engine client
    (a render-only server) or the engine is not vLLM's multiprocess client (no probe, so never judged)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bound_s = bound_s()
        self._asked: float | None = None  # when the probe in flight was sent, or the push window last ended after it
        self._pushes = 0  # requests to PUSH_ROUTES in flight
        self._probing: asyncio.Task | None = None
        self._failing = False  # whether /health last answered 503 for silence (logged once per run)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if scope["type"] != "http" or engine is None:
            await self.app(scope, receive, send)
            return
        if self._probing is None:
            self._probing = asyncio.ensure_future(self._probe(engine))
        path = scope.get("path", "")
        if path == "/health" and self._silent(engine):
            await answer_503(send, self.why())
            return
        if path not in PUSH_ROUTES:
            await self.app(scope, receive, send)
            return
        await self._in_push_window(scope, receive, send)

    async def _in_push_window(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run a request to a push route with the probe's clock stopped until it is answered or its caller left."""
        self._pushes += 1
        ended = False

        def end_window() -> None:  # once per request: when its caller left, or when it was answered
            nonlocal ended
            if not ended:
                ended = True
                self._pushes -= 1
                if self._asked is not None:  # the probe in flight waited on the push: its clock starts now
                    self._asked = time.monotonic()

        body_read = asyncio.Event()

        async def app_receive() -> MutableMapping[str, Any]:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        watcher = asyncio.ensure_future(_caller_left(receive, body_read))
        watcher.add_done_callback(lambda w: w.cancelled() or w.exception() or end_window())
        try:
            await self.app(scope, app_receive, send)
        finally:
            watcher.cancel()
            end_window()

    def silent_for(self) -> float:
        """Seconds the engine core has left the probe in flight unanswered, outside the push window (0 inside it)."""
        return 0.0 if self._pushes or self._asked is None else time.monotonic() - self._asked

    def why(self) -> str:
        return (f"the engine core has not answered for {self.silent_for():.1f}s (the bound on one engine step, "
                f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS = rollout.step_timeout_s, is {self.bound_s:g}s): it is hung")

    def _silent(self, engine: Any) -> bool:
        """Whether the engine core is judged hung now (a dead engine is `engine_death`'s); logs each change."""
        probing = self._probing is not None and not self._probing.done()
        silent = probing and not engine_errored(engine) and self.silent_for() > self.bound_s
        if silent != self._failing:
            self._failing = silent
            if silent:
                logger.error("megarl: /health answers 503: %s", self.why())
            else:  # error level too, as engine_death's: a warning of this logger did not reach the server's log
                logger.error("megarl: the engine core answers again (or a push route runs); /health passes through")
        return silent

    async def _probe(self, engine: Any) -> None:
        """Keep one utility RPC to the engine core going until the engine stops, `EVERY_S` between an answer and
        the next probe."""
        try:
            call = engine.engine_core.call_utility_async
        except AttributeError:
            logger.warning("megarl: this engine client has no engine core to probe; a hung engine core is not seen")
            return
        while not engine_errored(engine):
            self._asked = time.monotonic()
            probe = asyncio.ensure_future(call(PROBE_METHOD))
            while not probe.done():  # a dead engine never answers: look at it while waiting
                await asyncio.wait({probe}, timeout=EVERY_S)
                if engine_errored(engine):
                    probe.cancel()
                    return
            if probe.exception() is not None:
                logger.warning("megarl: the engine probe failed (%s); not probing", probe.exception())
                return
            self._asked = None
            await asyncio.sleep(EVERY_S)
