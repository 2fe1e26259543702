"""What each request holds, read where every request is, whichever model runner runs: the replica's API server.

A keep-mode push pause reads the output tokens each request holds from the vLLM workers' model runners
(`MegarlWorkerExtension.megarl_held_requests`, `megarl.sync.held_requests`). vLLM 0.32's V2 model runner, the
default on CUDA, frees the row of a request the scheduler preempted before the pause
(`GPUModelRunner.finish_requests`, `vllm/v1/worker/gpu/model_runner.py:1152-1164`), so such a request (old-version
tokens, waiting in the engine core's queue to be resumed) is absent from the workers' counts. Its tokens are in two
places: the engine core's scheduler (`Request.num_output_tokens`), which no vLLM RPC reads (no `EngineCore` utility
method returns the scheduler's requests, `vllm/v1/engine/core.py:423-1087`), and the API server's output processor,
which every token the engine core made has reached: `AsyncLLM.output_processor` (`vllm/v1/engine/async_llm.py:171`)
keeps one `RequestState` per live request, by vLLM's internal request id (`OutputProcessor.request_states`,
`vllm/v1/engine/output_processor.py:519`, filled by `add_request`, `output_processor.py:640`, the same id the engine
core and the workers use; each child of an n > 1 request has its own), and its detokenizer's token list holds every
output token received (`IncrementalDetokenizer.num_output_tokens`, `vllm/v1/engine/detokenizer.py:39-40`; the
detokenizing subclasses keep prompt + output and subtract the prompt, `detokenizer.py:300-301`). A preempted request
stays there until it finishes. The count does not depend on the model runner, nor on TP (one API server per replica).

`served_held(engine)` reads those counts once the API server has processed everything the engine core sent:

1. one engine-core utility round-trip (`is_scheduler_paused`, `vllm/v1/engine/core.py:955`): the engine core sends
   each step's outputs and utility answers through one queue and socket, in order (`output_queue`: a step's
   outputs `core.py:1606-1609`, utility answers `core.py:1698`, `:1731`), and the client queues each output message
   before it resolves a utility answer that came after it (`process_outputs_socket` in
   `AsyncMPClient._ensure_output_queue_task`, `vllm/v1/engine/core_client.py:1171-1217`): when the answer is in,
   every output the engine core sent before it is in `outputs_queue` (`core_client.py:1131`);
2. then until vLLM's output handler task (`AsyncLLM.output_handler`, `async_llm.py:209`, `:845-909`), the only
   reader of that queue (`get_output_async`, `core_client.py:1227-1233`), waits on the empty queue again: it has
   then processed every message it took, chunks and all (`async_llm.py:858-885`). vLLM's own pause leaves this to
   chance (a 20 ms sleep, "not required for correctness", `async_llm.py:978-984`). The handler's wait is seen on the
   queue itself: `asyncio.Queue.get` parks a future in the queue's `_getters` while the queue is empty (CPython's
   `asyncio/queues.py`), so "empty with a getter waiting" is "every message processed". Bounded by `DRAIN_S`
   (logged, then read as it is).

At a keep-mode pause no step is in flight (`EngineCoreProc.pause_scheduler`, `core.py:2061-2107`: the pause
completes once the engine has no work, its last step's outputs queued before the answer), so these are the tokens
each request had when the old weights stopped: exact, preempted requests included. Unlike the model runners, the API
server no longer holds a request that finished in the engine's last step (it is removed as its final output is
processed, `OutputProcessor._finish_request`, `output_processor.py:855-857`).

`HeldRequestsMiddleware` (loaded into each server with `--middleware megarl.rollout.held_served.HeldRequestsMiddleware`,
`megarl.rollout.fleet.server_command`, innermost: behind the fleet's guard) brings them to the push:

- `GET /megarl/held_requests` answers `{"held": {internal request id: output tokens}}` (tests, debugging);
- a `POST /collective_rpc` of method `megarl_held_requests` (the push's read, `megarl.sync.lifecycle`) is passed to
  vLLM's own route (`vllm/entrypoints/serve/dev/rpc/api_router.py:23-57`, which hands the workers the body's
  string `args`, `:44-49`) with these counts, as JSON, as the call's second positional argument: each worker adds
  every request its runner does not hold (`megarl.sync.held_requests.with_served`), so the push's counts, its
  failpoints (`push.held`, `push.loading`) and its log all see a preempted request on either runner. Where the
  counts cannot be read (logged) the call goes through unchanged: the runner's counts alone, as before.

Other requests pass through untouched. Standard library only, as the other middleware: the API server imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping
from typing import Any

from megarl.rollout.engine_death import ASGIApp, Receive, Scope, Send

ROUTE = "/megarl/held_requests"  # megarl's own route: the API server's counts
RPC_ROUTE = "/collective_rpc"  # vLLM's dev-mode route the push's count goes through
RPC_METHOD = "megarl_held_requests"  # the worker method whose call is given the API server's counts
BARRIER_METHOD = "is_scheduler_paused"  # EngineCore's utility method of the round-trip (reads one field)
DRAIN_S = 5.0  # how long to wait for vLLM's output handler to process what the engine core sent
POLL_S = 0.001

logger = logging.getLogger(__name__)


def served_counts(output_processor: Any) -> dict[str, int]:
    """The output tokens each request vLLM's `output_processor` holds has received: internal request id -> count
    (a request without a detokenizer, a pooling one, is left out). Reads the state as it is (no drain)."""
    counts: dict[str, int] = {}
    for req_id, state in list(output_processor.request_states.items()):
        detokenizer = getattr(state, "detokenizer", None)
        if detokenizer is not None:
            counts[str(req_id)] = int(detokenizer.num_output_tokens())
    return counts


def _handler_idle(engine: Any) -> bool:
    """Whether vLLM's output handler has processed every message in the engine client's queue (module docstring,
    step 2); True where there is no handler running (nothing to process) or no queue to look at."""
    handler = getattr(engine, "output_handler", None)
    queue = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    if handler is None or handler.done() or not isinstance(queue, asyncio.Queue):
        return True
    return queue.empty() and any(not getter.done() for getter in getattr(queue, "_getters", ()))


async def served_held(engine: Any, drain_s: float = DRAIN_S) -> dict[str, int]:
    """The output tokens each request the API server's engine client `engine` (vLLM's `AsyncLLM`) holds, once it has
    processed every output the engine core sent before this call (module docstring); `drain_s` bounds the wait for
    the output handler (past it: logged, read as it is)."""
    await engine.engine_core.call_utility_async(BARRIER_METHOD)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s
    while not _handler_idle(engine):
        if loop.time() > deadline:
            logger.error("megarl: vLLM's output handler did not finish the engine's outputs within %gs; the held "
                         "counts are read as they are", drain_s)
            break
        await asyncio.sleep(POLL_S)
    return served_counts(engine.output_processor)


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class HeldRequestsMiddleware:
    """Pure ASGI middleware: answers `GET /megarl/held_requests` and gives a `/collective_rpc` call of
    `megarl_held_requests` the API server's counts (module docstring). Everything else passes through, and so does
    everything where the app has no engine client (a render-only server)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        path = scope.get("path", "")
        if scope["type"] != "http" or engine is None or path not in (ROUTE, RPC_ROUTE):
            await self.app(scope, receive, send)
            return
        if path == ROUTE:
            if scope.get("method") != "GET":
                await _answer(send, 405, {"error": {"message": f"{ROUTE} takes GET", "code": 405}})
                return
            try:
                held = await served_held(engine)
            except Exception as err:  # noqa: BLE001 - answered, with what failed
                await _answer(send, 500, {"error": {"message": f"{type(err).__name__}: {err}", "code": 500}})
                return
            await _answer(send, 200, {"held": held})
            return
        await self._rpc(scope, receive, send, engine)

    async def _rpc(self, scope: Scope, receive: Receive, send: Send, engine: Any) -> None:
        """Read the body of a `/collective_rpc` call; one of `RPC_METHOD` gets the API server's counts as its second
        positional argument; hand vLLM's route the (possibly rewritten) body."""
        chunks: list[bytes] = []
        early: MutableMapping[str, Any] | None = None  # a disconnect before the whole body came
        while True:
            message = await receive()
            if message["type"] != "http.request":
                early = message
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if early is None:
            body = await self._with_served(body, engine)
        replayed = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return early if early is not None else {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replay, send)

    async def _with_served(self, body: bytes, engine: Any) -> bytes:
        """`body` with the API server's counts as the second of `args` if it calls `RPC_METHOD` (the first, the
        replica's failpoint name, kept or ""), else `body` unchanged; unchanged too where they cannot be read."""
        try:
            call = json.loads(body)
        except ValueError:
            return body  # vLLM's route answers it
        if not isinstance(call, dict) or call.get("method") != RPC_METHOD:
            return body
        try:
            held = await served_held(engine)
        except Exception as err:  # noqa: BLE001 - the runners' counts alone, as without this middleware
            logger.error("megarl: the API server's held counts could not be read (%s: %s); the workers count alone",
                         type(err).__name__, err)
            return body
        args = call.get("args") or []
        call["args"] = [str(args[0]) if args else "", json.dumps(held)]
        return json.dumps(call).encode()
