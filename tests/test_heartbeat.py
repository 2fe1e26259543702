"""A vLLM worker's heartbeat during a push and trainer rank 0's watch on it (megarl/sync/heartbeat.py): a worker
that is stopped (SIGSTOP) is silent after the bound and not before, one that beats or has finished never is.

Real processes and a real TCPStore, no vLLM: the "worker" is a child process running `Heartbeat` on the store that
trainer rank 0 hosts here, as a worker's receive does; the test stops and continues it with real signals. The wiring
into a push (a silent replica given up and condemned at this bound, not the push's) is tests/test_hung_push.py's;
a whole run with a stopped TP worker is tests/test_fault_matrix_tp.py's cell H."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from megarl.parallel.spawn import free_port
from megarl.sync.heartbeat import DONE, BeatWatch, Heartbeat, beat_key

SILENT_S = 3.0  # the watch's bound (a run's is rollout.health_timeout_s)
SLACK_S = 10.0  # a loaded 2-core machine
PART_S = 1.0  # the finishing worker's part of the push

def _work(port: int, key: str, part_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    with Heartbeat(store, key, every_s=0.2):
        time.sleep(part_s)  # its part of the push
    time.sleep(600)  # done, still alive


def _worker(port: int, key: str, part_s: float) -> multiprocessing.Process:
    """A child process (forked: torch is imported already) beating on `key` for `part_s`."""
    proc = multiprocessing.get_context("fork").Process(target=_work, args=(port, key, part_s), daemon=True)
    proc.start()
    return proc


def _wait(cond, what: str, within_s: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < within_s, f"{what} did not happen within {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_stopped_worker_is_silent_after_the_bound_a_beating_or_finished_one_never() -> None:
    port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    key_of = lambda worker: beat_key(7, worker)  # noqa: E731
    watch = BeatWatch(store, key_of, SILENT_S)
    launched = time.monotonic()
    beating, finishing = _worker(port, key_of(2), 600), _worker(port, key_of(3), PART_S)
    try:
        _wait(lambda: int(store.add(key_of(2), 0)) > 0, "the first beat", SLACK_S)
        # a worker never heard from (stopped before its part began) is silent once the bound has passed
        assert watch.silent(5) is None
        # beating: never silent, over more than a bound
        start = time.monotonic()
        while time.monotonic() - start < 1.5 * SILENT_S:
            assert watch.silent(2) is None and watch.silent(3) is None
            time.sleep(0.1)
        assert int(store.add(key_of(3), 0)) >= DONE, "the finished worker's part is not marked done"
        never = watch.silent(5)
        assert never is not None and "vLLM worker 5" in never and "never began its part" in never, never
        # stopped: silent after the bound, not before (its last beat was 0.2 s before the stop, or a little more on
        # a loaded machine: the bound runs from the last count the watch saw change)
        os.kill(beating.pid, signal.SIGSTOP)
        took = _wait(lambda: watch.silent(2) is not None, "the stopped worker's silence", SILENT_S + SLACK_S)
        assert SILENT_S - 1.0 <= took, f"judged silent {took:.2f} s after the stop, before the {SILENT_S} s bound"
        why = watch.silent(2)
        assert why is not None and "vLLM worker 2 sent no heartbeat for" in why and "after it began" in why, why
        assert "rollout.health_timeout_s=3" in why, why
        # continued: it beats again, so it is no longer silent; the finished one stays quiet and is never silent
        os.kill(beating.pid, signal.SIGCONT)
        _wait(lambda: watch.silent(2) is None, "the continued worker's beat", SLACK_S)
        assert watch.silent(3) is None and time.monotonic() - launched > PART_S + SILENT_S
        print(f"a stopped worker was judged silent {took:.1f} s after SIGSTOP (bound {SILENT_S:g} s)")
    finally:
        for proc in (beating, finishing):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.join()
