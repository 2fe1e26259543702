"""A replica's API server must not outlive its engine: requests in flight are ended when the engine dies.

vLLM's API server notices a dead engine core at once (a thread waits on the engine process's sentinel, and
`engine_client.errored` becomes true) and its watchdog asks uvicorn to exit within 5 s. But uvicorn first waits for
every request in flight, and vLLM 0.32 leaves a request that awaits an engine RPC waiting forever: the RL routes
(`/pause`, `/start_weight_update`, `/update_weights`, `/init_weight_transfer_engine`, `/collective_rpc`, ...) call the
engine core's utility methods, whose futures (`AsyncMPClient.utility_results`) nothing resolves once the engine is
gone. The server then sits in "Waiting for background tasks to complete." with its pid alive, so a launcher that
watches the pid never restarts it, and the caller waits for its own read timeout.

`EngineDeathMiddleware` (loaded into each server with `--middleware megarl.rollout.engine_death.EngineDeathMiddleware`,
`megarl.rollout.fleet.server_command`) runs every HTTP request beside a watch of the engine: when the engine dies, a
request still in flight is cancelled and answered 503 (unless its response had started), so uvicorn's shutdown finds
nothing to wait for and the server process exits within seconds, with code 1 (the engine died: not a clean stop).
Standard library only, as the other middleware: the API server imports it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

POLL_S = 0.5  # how often the engine's state is read (a property read, no RPC)
EXIT_CODE = 1  # the server's exit code after its engine died (vLLM's own return after the watchdog would be 0)

logger = logging.getLogger(__name__)


def engine_errored(engine: Any) -> bool:
    """Whether vLLM's engine client says its engine is dead or stopped (`AsyncLLM.errored`)."""
    try:
        return bool(engine.errored)
    except Exception:  # noqa: BLE001 - an engine client being torn down: judged at the next poll
        return False


def _died_unexpectedly(engine: Any) -> bool:
    """Whether the engine stopped because an engine process died (vLLM's process manager names it in
    `failed_proc_name`), not because the server was asked to stop. False where that is not known (another vLLM)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return getattr(manager, "failed_proc_name", None) is not None


def _exit_nonzero() -> None:
    """At interpreter exit, after vLLM's own shutdown ran: leave with `EXIT_CODE` (os._exit skips the atexit
    handlers registered before this one; vLLM's shutdown has already stopped what they would)."""
    logging.shutdown()
    os._exit(EXIT_CODE)


class EngineDeathMiddleware:
    """Pure ASGI middleware: an HTTP request in flight when the engine dies (or stops) is cancelled and answered 503
    (`{"error": {"message": ..., "code": 503}}`), and after an engine process died the server exits with code 1.
    One task per server polls the engine's state (`POLL_S`), from the first request on. Other scopes pass through,
    and so does everything where the app has no engine client (a render-only server)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._dead: asyncio.Event | None = None  # set once the engine is dead (made on the server's loop)
        self._watch: asyncio.Task | None = None  # the task that polls the engine's state
        self._in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if scope["type"] != "http" or engine is None:
            await self.app(scope, receive, send)
            return
        dead = self._dead_event(engine)
        if dead.is_set():
            await answer_503(send)
            return
        started = False

        async def tracked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        request = asyncio.ensure_future(self.app(scope, receive, tracked))
        died = asyncio.ensure_future(dead.wait())
        self._in_flight += 1
        try:
            await asyncio.wait({request, died}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn cancelled this request (a shutdown past its grace): pass it on
            request.cancel()
            raise
        finally:
            self._in_flight -= 1
            died.cancel()
        if request.done():
            request.result()  # its exception, if it raised, goes up as it would have without this middleware
            return
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        if not started:
            await answer_503(send)

    def _dead_event(self, engine: Any) -> asyncio.Event:
        """The event set when the engine is dead; the watch task starts with the first request."""
        if self._dead is None:
            self._dead = asyncio.Event()
            self._watch = asyncio.ensure_future(self._watch_engine(engine))
        return self._dead

    async def _watch_engine(self, engine: Any) -> None:
        assert self._dead is not None
        while not engine_errored(engine):
            await asyncio.sleep(POLL_S)
        if _died_unexpectedly(engine):
            logger.error("megarl: an engine process died; ending the %d request(s) in flight with 503, the server "
                         "exits with code %d", self._in_flight, EXIT_CODE)
            atexit.register(_exit_nonzero)
        self._dead.set()


ENGINE_DIED = "the rollout engine died: this server is shutting down"


async def answer_503(send: Send, why: str = ENGINE_DIED) -> None:
    """Answer the request 503, `{"error": {"message": why, "code": 503}}` (also `megarl.rollout.engine_probe`'s)."""
    body = json.dumps({"error": {"message": why, "code": 503}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
