"""A pool of reward worker processes with a per-item timeout enforced from outside the reward function.

Each worker is a `spawn`ed process (never fork: the caller holds torch/gloo threads) that imports only the reward
function's module and answers one `(response_text, answer)` pair at a time over its own pipe. The parent keeps
the idle workers in a queue and one thread per worker (a `ThreadPoolExecutor`); the thread holding a worker waits
at most `timeout_s` for the reply. A worker past the timeout is killed (SIGTERM, then SIGKILL) and replaced, and
its item scores 0.0; a function that raises or returns a non-finite / non-number value, or a worker that dies,
raises `RewardError`. A reward function returns a float, or a `(score, flag)` pair whose short `flag` string (e.g.
`"unparsable"`, see `megarl.rewards.registry`) marks the item: the pool lists flagged items per flag, so a caller can
count them as metrics (`ScoredRewards.flags`). Workers keep no state between items, so a reward never depends on
which worker computed it, and concurrent `score()` calls just share the executor's queue.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import math
import multiprocessing
import numbers
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)
_START_TIMEOUT_S = 120.0  # a fresh worker must import the reward module within this time


class RewardError(RuntimeError):
    """A reward function raised or returned a bad value, or a reward worker died."""


@dataclass
class ScoredRewards:
    rewards: list[float]  # one per item, in input order; 0.0 for an item that timed out
    timed_out: list[int]  # indices of items whose reward function passed the timeout
    seconds: float  # wall time of the call
    flags: dict[str, list[int]] = field(default_factory=dict)  # flag -> indices of the items the function flagged


_MAX_FLAG_CHARS = 40


def _check_value(value: Any) -> tuple[float, str | None] | str:
    """A reward function's return value as (score, flag or None), or the reason it is not a valid one."""
    flag = None
    if isinstance(value, tuple) and len(value) == 2:
        value, flag = value
        if not (isinstance(flag, str) and 0 < len(flag) <= _MAX_FLAG_CHARS):
            return f"returned flag {repr(flag)[:100]}, not a string of 1..{_MAX_FLAG_CHARS} characters"
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value), flag
    return f"returned {repr(value)[:100]}, not a finite number (or a (number, flag) pair)"


def _load(function: str) -> Callable[[str, str], float | tuple[float, str]]:
    """Import 'package.module:callable', or raise ValueError naming the string and the expected form."""
    module_name, colon, attr = function.partition(":")
    bad = f"bad reward function {function!r} (expected 'package.module:callable')"
    if not (module_name and colon and attr):
        raise ValueError(bad)
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        raise ValueError(f"{bad}: cannot import it: {exc!r}") from exc
    if not callable(fn):
        raise ValueError(f"{bad}: {attr} is not callable")
    return fn


def _worker_main(function: str, conn: Connection) -> None:
    """Worker process: load the function, say 'ready', then answer (text, answer) pairs until the pipe closes."""
    try:
        fn = _load(function)
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            text, answer = conn.recv()
        except EOFError:
            return
        try:
            value = fn(text, answer)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            conn.send(("error", f"raised {exc!r} at {frame.filename}:{frame.lineno}"))
            continue
        checked = _check_value(value)
        conn.send(("error", checked) if isinstance(checked, str) else ("ok", checked))


class _Worker:
    """One worker process and the parent's end of its pipe; a stopped worker restarts on its next item."""

    def __init__(self, ctx: Any, function: str) -> None:
        self.ctx, self.function = ctx, function
        self._start()

    def _start(self) -> None:
        self.conn, child_conn = self.ctx.Pipe()
        self.process = self.ctx.Process(target=_worker_main, args=(self.function, child_conn), daemon=True)
        self.process.start()
        child_conn.close()  # only the child holds its end now, so the parent sees EOF when the child dies
        self.ready, self.stopped = False, False

    def _receive(self, timeout_s: float, doing: str) -> tuple[str, Any] | None:
        """The worker's next reply, None after `timeout_s`, RewardError if the process died."""
        try:
            return self.conn.recv() if self.conn.poll(timeout_s) else None
        except (EOFError, OSError):
            self.process.join(5.0)
            code = self.process.exitcode
            self.stop()
            raise RewardError(f"reward worker for {self.function} died with exit code {code} {doing}") from None

    def wait_ready(self) -> None:
        reply = self._receive(_START_TIMEOUT_S, "while starting")
        if reply is None or reply[0] != "ready":
            self.stop()
            raise RewardError(f"reward worker for {self.function} did not start: {reply[1] if reply else 'timeout'}")
        self.ready = True

    def call(self, text: str, answer: str, timeout_s: float) -> tuple[float, str | None] | None:
        """(reward, flag) of one item, or None if it passed the timeout (the process is then killed and replaced)."""
        if self.stopped:
            self._start()
        if not self.ready:
            self.wait_ready()
        try:
            self.conn.send((text, answer))
        except OSError:
            pass  # the process is gone: _receive reports its exit code
        doing = f"while scoring response {text[:200]!r}"
        reply = self._receive(timeout_s, doing)
        if reply is None:
            logger.warning("reward function %s passed %.1f s %s: worker restarted", self.function, timeout_s, doing)
            self.stop()
            self._start()
            return None
        if reply[0] == "error":
            raise RewardError(f"reward function {self.function} {reply[1]} {doing}")
        return reply[1]

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        self.conn.close()
        self.stopped = True


class RewardPool:
    """Scores (response_text, answer) pairs in `workers` spawned processes; see the module docstring."""

    def __init__(self, function: str, workers: int = 2, timeout_s: float = 30.0) -> None:
        """`function` is 'package.module:callable' (imported in each worker process, e.g.
        'megarl.rewards.exact_match:exact_match'); called as fn(response_text: str, answer: str) -> float, or
        -> (float, flag) to mark an item (see the module docstring)."""
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        _load(function)  # fail fast, in the caller, on a bad string
        self._timeout_s, self._closed, self._lock = timeout_s, False, threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        ctx = multiprocessing.get_context("spawn")
        for _ in range(workers):  # started together, so they boot in parallel
            self._idle.put(_Worker(ctx, function))
        try:
            for worker in list(self._idle.queue):
                worker.wait_ready()
        except RewardError:
            self.close()
            raise

    def _score_one(self, text: str, answer: str) -> tuple[float, str | None] | None:
        worker = self._idle.get()  # never blocks for long: the executor has exactly one thread per worker
        try:
            return worker.call(text, answer, self._timeout_s)
        finally:
            self._idle.put(worker)

    def score(self, items: list[tuple[str, str]]) -> ScoredRewards:
        """Score (response_text, answer) pairs across the workers in parallel; blocking; thread-safe
        (several threads may call score() at the same time on one pool)."""
        if self._closed:
            raise RuntimeError("RewardPool.score() called after close()")
        start = time.perf_counter()
        futures = [self._executor.submit(self._score_one, text, answer) for text, answer in items]
        try:
            values = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)  # running items finish, so every worker is back in the queue
            raise
        rewards = [0.0 if value is None else value[0] for value in values]
        timed_out = [i for i, value in enumerate(values) if value is None]
        flags: dict[str, list[int]] = {}
        for i, value in enumerate(values):
            if value is not None and value[1] is not None:
                flags.setdefault(value[1], []).append(i)
        return ScoredRewards(rewards, timed_out, time.perf_counter() - start, flags)

    def close(self) -> None:
        """Stop every worker process (idempotent); items still running finish first (at most `timeout_s`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        while not self._idle.empty():
            self._idle.get_nowait().stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
