"""A vLLM worker's heartbeat while it takes part in a push, and trainer rank 0's watch on it.

A worker that is stopped or wedged (SIGSTOP, a stuck kernel) makes nothing fail: its API server's `/health` stays
200, and the trainer ranks' sends to it just wait. Under a streamed receive they also starve the healthy replicas,
since the senders go bucket by bucket through every receiver (`megarl.sync.stream.send_buckets`). Waiting for the
push's bound would only condemn every replica at once. So each worker beats for as long as its part of a push runs:

- `Heartbeat` (worker, `megarl.sync.vllm_receiver`): adds 1 to the key `beat_key(push, worker)` in the sync store
  (hosted by trainer rank 0) every `BEAT_S`, from a thread of its own, and adds `DONE` when its part ends,
  whether it loaded the update or refused it.
- `BeatWatch` (trainer rank 0, `megarl.sync.lifecycle.FleetLifecycle.start_updates`): a worker whose count has not
  moved for `silent_s` (`rollout.health_timeout_s`) while its replica's update call is in flight is silent. Its
  replica is failed for the push, and that failure goes into the store key the senders watch, so they move on to
  the other replicas' buckets within a second. It is also condemned, so its launcher kills and restarts it.
  The clock starts at the watch's first look, so a worker that never began its part (stopped before the call
  reached it) is silent after the same bound.

Counts, not timestamps: the hosts' clocks need not agree. A worker that finished (`DONE`) is never silent, however
long its TP peers take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)

BEAT_S = 1.0  # how often a worker beats during a push
DONE = 1 << 40  # added to a worker's count when its part of the push ended (no count of beats reaches it)


def beat_key(push: int, worker: int) -> str:
    """The sync-store key fleet-wide worker `worker` beats on during push number `push` of this trainer."""
    return f"megarl_beat/push{push}/worker{worker}"


class Heartbeat:
    """`with Heartbeat(store, key):` beats on `key` every `every_s` in a daemon thread, then marks it `DONE`. A store
    that stops answering (trainer rank 0 is gone) ends the beating quietly: the push is lost anyway."""

    def __init__(self, store, key: str, every_s: float = BEAT_S) -> None:
        self.store, self.key, self.every_s = store, key, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="megarl-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.store.add(self.key, 1)
            except Exception as err:  # noqa: BLE001 - the trainer's store is gone: nobody watches any more
                logger.warning("heartbeat %s stopped: the sync store does not answer: %s", self.key, err)
                return

    def __enter__(self) -> Heartbeat:
        self.store.add(self.key, 1)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.store.add(self.key, DONE)
        except Exception as fail:  # noqa: BLE001 - as in _beat
            logger.warning("heartbeat %s: could not mark it done: %s", self.key, fail)


class BeatWatch:
    """Which workers of one push have gone silent (see the module docstring). `key_of(worker)`: its beat key;
    `silent_s`: how long a count may stand still. One watch per push; workers may be asked about from several
    threads, each about its own replica's workers."""

    def __init__(self, store, key_of: Callable[[int], str], silent_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.key_of, self.silent_s, self.clock = store, key_of, silent_s, clock
        self.seen: dict[int, tuple[int, float]] = {}  # worker -> (its count, when that count was first seen)

    def silent(self, worker: int) -> str | None:
        """Why `worker` is silent (its count stood still for `silent_s`), or None while it beats or once it is done."""
        count, now = int(self.store.add(self.key_of(worker), 0)), self.clock()
        last = self.seen.get(worker)
        if count >= DONE:
            return None
        if last is None or count != last[0]:
            self.seen[worker] = (count, now)
            return None
        if now - last[1] < self.silent_s:
            return None
        began = "after it began its part" if count else "and it never began its part"
        return (f"vLLM worker {worker} sent no heartbeat for {now - last[1]:.1f} s during the push {began} "
                f"(rollout.health_timeout_s={self.silent_s:g}): it is stopped or wedged")
