"""The rollout side of the pipeline: the fleet generates scored batches while the trainer trains.

Dispatch: one shared queue (`megarl.rollout.chunk_queue`). Each batch's prompts are cut into chunks of
`chunk_prompts` whole groups (the K samples of a prompt stay on one replica); every replica runs
`chunks_in_flight` loops, each taking the next chunk (lowest batch first), generating it and taking another,
so a slow replica takes fewer chunks instead of holding the batch. Chunks are taken only from batches the fleet
may generate with the weights it holds (`generation_limit`: up to, not including, the next batch that a push
precedes), so every replica in a window holds the same version and the lags are those of the schedule. A
chunk's groups are stored at their prompts' positions: a batch is recorded in prompt order. When every chunk of
a batch is in, a scoring thread computes its rewards in the reward pool (other processes, with a timeout) and
the batch becomes ready. The controller (trainer rank 0) only

    take(step)      blocks until batch `step` is ready (it is the trainer's only wait for data),
    before_push(j)  at the push point before batch `j`: `quiesce(j)`, unless partial rollouts are on,
    quiesce(j)      blocks until every chunk of every batch before `j` is generated (before a push or
                    a checkpoint: no replica is then generating with the old weights),
    pushed(j, held) after the push before batch `j`: generation may go on up to the next push (`held`: the
                    requests the push found holding tokens, with partial rollouts),
    pending()       the batches generated but not yet consumed (a checkpoint saves them),
    step_metrics()  what the last `take` met: groups requeued, and with partial rollouts carried and dropped,
    evaluate()      the held-out evaluation on the fleet's current weights (`megarl.rollout.evaluation`),
    data_position(j)  where batch j starts in the task's data (recorded in checkpoints),

and calls `batches_generated()` for the metrics and `close()` at the end. With `overlap=False` the same
loops generate only what the sequential controller would have generated before the trainer's current step
(`batches_ready_before_step`), and only while the trainer waits for it: the two sides take turns (the
comparison point of `megarl bench pipeline`).

A lost replica costs no step: when a replica stops answering (connection refused or reset, a timeout, a 5xx:
`RolloutServerLost`), the chunk it was generating goes back to the front of the queue, its other loops end the
same way, it takes no more chunks, and one warning names the replica, the cause and its log; the batch completes
on the others (`live_replicas()` is recorded per step as `fleet/replicas`). With fewer than `min_replicas` left
(rollout.min_replicas) the run stops, naming the cause. At the next push the weight sync leaves it out too
(`megarl.rollout.membership`); a replica the sync found dead is `drop`ped here (the chunks its loops still wait on,
requests held in it by an in-flight push, go back to the queue at once; answers that come later are ignored), and a
restarted one is let back in with `admit` once a push has given it the current weights (the fleet is quiesced then,
so it starts with the next window, holding the same version as the others).

Reproducibility when replicas race: prompt i of batch j is always sampled with the seed `seed(j) + i`, and its
group is stored at position i, so which replica served it and when do not change what is recorded. Given the
same weights on every replica (true inside a window), a run gives the same prompts, the same seeds and the same
sampling RNG per prompt as a one-replica run or a rerun -- the same samples, as far as the engine is
deterministic for a seeded request. What is NOT reproducible: which replica took which chunk, the timings
(timeline, `fleet/*`, `time/*`, `pipeline/batches_generated`), and -- since a request's logits can depend on
which other requests share the engine's batch (vLLM is not batch-invariant by default) -- at worst a last-bit
difference of a log-prob that flips a sampled token on a tie; the same caveat held for the static split.

Partial rollouts (`partial`, on with `sync.inflight`: `megarl.rollout.partial`). A push no longer waits: the loops
keep generating while it lands (each replica pauses in vLLM's keep mode with its requests held), each chunk is scored
as soon as it is in, its groups join a pool, and `take(l)` forms batch l from the P pooled groups of the lowest
(home batch, prompt), after dropping and counting the ones past the staleness bound. The window counts groups
(`megarl.rollout.partial.admission_limit`). Each request is salted with the version its replica will run it under
(vLLM's `cache_salt`, `megarl.schedule.VersionClock.salt`: it moves when a push pauses the replica, before the replica
resumes), and a response without the engine's version spans is an error naming the replica and the request
(`RolloutClient.generate(require_spans=True)`). A group known to be past the bound while it still
generates is aborted in its engine and dropped when its call answers (`PartialRollouts.abort_doomed`;
`megarl.rollout.partial`, "Doomed groups"). Any other chunk with an aborted choice (a replica given up at a push that
failed part-way on it, `megarl.rollout.inflight`) is not generated: it is given back and counted like a lost
replica's, never pooled. A checkpoint (`quiesce`, then `pending`) lets every started group finish, starts
none meanwhile, and saves the pooled groups and the prompts not started (`CarriedGroups`); then the fleet goes on. A
resumed run trains them like any other.

Nothing here touches torch.distributed: the component talks to the fleet over HTTP and to the
controller through these calls, so it can move to its own process behind an RPC (the task's closures --
problems, tokenizer, seeds -- would then be built there from the config).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from megarl.batch import RolloutBatch
from megarl.data.problem import Problem
from megarl.metrics.timeline import Timeline
from megarl.rewards.scoring import BatchScorer
from megarl.rollout.chunk_queue import Chunk, ChunkQueue
from megarl.rollout.client import RolloutClient, RolloutServerLost, Sample
from megarl.rollout.evaluation import Evaluator
from megarl.rollout.inflight import group_request_id
from megarl.rollout.partial import CarriedGroups, GroupPool, ScoredGroup, admission_limit, batch_of_groups
from megarl.schedule import SyncSchedule, VersionClock
from megarl.token_versions import version_lag

logger = logging.getLogger(__name__)


class RolloutWorkerError(RuntimeError):
    """Generation or scoring of a batch failed; raised to the controller at its next blocking call
    (`take`, `quiesce`, `pending`), naming the replica and batch."""


@dataclass(frozen=True)
class PartialRollouts:
    """Partial rollouts (`megarl.rollout.partial`): `batch_groups` groups form a batch; a group whose oldest token
    lags the trainer by more than `bound` versions is dropped and counted. `abort_doomed`: a group still generating
    that is known to be past the bound already is aborted in its engine (`megarl.rollout.partial`, "Doomed groups")
    instead of being generated to its end and dropped then."""

    batch_groups: int
    bound: int
    abort_doomed: bool = True


class RolloutWorker:
    """Generates and scores batches ahead of the trainer (see the module docstring).

    `clock`: the run's `megarl.schedule.VersionClock` (the schedule, the version the fleet holds, each replica's
    prefix-cache salt); a bare `SyncSchedule` gets a clock of its own (bound `partial.bound`, from `start`).
    `problems(j)` gives batch j's problems, `encode` maps a prompt's text to token ids, `sampling`
    holds the per-request sampling arguments of `RolloutClient.generate` (`n`, `max_tokens`, ...) and
    `seed(j)` the base seed of batch j (prompt i is sampled with `seed(j) + i`, whichever replica serves it).
    `score(j, problems, samples)` turns a generated batch into a scored `RolloutBatch` (the worker owns the
    scorer and closes it). Batches `start` to `end - 1` are generated (`ready`: batches already generated, a
    resumed run's saved ones). `chunk_prompts`: prompts per chunk of the shared queue; `chunks_in_flight`: chunks
    each replica generates at once (`rollout.chunk_prompts`). `static_split`: instead, the split used before the
    queue (replica r generates share r of every batch; `megarl bench longtail` compares them). `partial`: partial
    rollouts (see the module docstring; `ready` is then the `CarriedGroups` a checkpoint saved, if any)."""

    def __init__(
        self,
        clients: list[RolloutClient],
        clock: VersionClock | SyncSchedule,
        problems: Callable[[int], list[Problem]],
        encode: Callable[[str], list[int]],
        sampling: dict,
        seed: Callable[[int], int],
        score: BatchScorer,
        timeline: Timeline,
        end: int,
        overlap: bool = True,
        start: int = 0,
        ready: dict[int, RolloutBatch] | CarriedGroups | None = None,
        evaluator: Evaluator | None = None,
        position: Callable[[int], dict] | None = None,
        chunk_prompts: int = 1,
        chunks_in_flight: int = 1,
        static_split: bool = False,
        replica_log: Callable[[int], str] | None = None,
        min_replicas: int = 1,
        partial: PartialRollouts | None = None,
    ) -> None:
        if isinstance(clock, SyncSchedule):
            clock = VersionClock(clock, partial.bound if partial is not None else None, start)
        self.clock, self.schedule = clock, clock.schedule
        schedule = clock.schedule
        self.clients, self.timeline, self.overlap, self.end = clients, timeline, overlap, end
        self._problems, self._encode = problems, encode
        self._sampling, self._seed, self._scorer = sampling, seed, score
        self._evaluator, self._position = evaluator, position
        self._cv = threading.Condition()
        self._partial = partial
        ready = ready or None  # a fresh run's (empty) saved batches
        if partial is not None and (static_split or not overlap):
            raise ValueError("partial rollouts (sync.inflight) need the overlapped pipeline with the shared queue: "
                             "set rollout.overlap=true, or sync.inflight=false")
        if isinstance(ready, CarriedGroups) != (partial is not None and ready is not None):
            raise ValueError("the checkpoint's rollout state was written with sync.inflight="
                             f"{isinstance(ready, CarriedGroups)}: resume with the same sync.inflight")
        carried = ready if isinstance(ready, CarriedGroups) else None
        self._ready: dict[int, RolloutBatch] = {} if carried is not None else dict(ready or {})
        self._pool = GroupPool(carried.groups if carried is not None else None)
        self._start, self._carried = start, len(self._pool)
        self._admitted = 0  # partial: groups started since batch `start` (a requeued one counts once)
        self._consumed = 0  # partial: groups trained since batch `start`
        self._hold = False  # partial: a checkpoint is waiting for the started groups, start no home batch
        self.dropped: list[tuple[int, int, int]] = []  # partial: (home, prompt, lag of its oldest token) per drop
        # partial: of those, the groups aborted while generating (doomed): (home, prompt, lag, each response's length)
        self.aborted: list[tuple[int, int, int, list[int]]] = []
        self._aborted_since_take: list[tuple[int, int, int]] = []  # partial: aborted since the last `take`
        self._next_take = start  # partial: the first batch the trainer has not taken
        # partial, per group generating: (replica, request id); per request id: the latest version its oldest token
        # can have (the version before the first push that found it holding tokens: `pushed`); the groups aborted
        self._requests: dict[tuple[int, int], tuple[int, str]] = {}
        self._oldest_at_most: dict[str, int] = {}
        self._doomed: set[tuple[int, int]] = set()
        self._abort_pool = ThreadPoolExecutor(1, thread_name_prefix="megarl-abort")
        self.requeued = 0  # groups a lost replica was generating, given back to the queue and generated again
        self._last_take: dict[str, Any] = {}
        first = carried.next_home if carried is not None else max([start - 1, *self._ready]) + 1  # next to generate
        self._queue = ChunkQueue(first, chunk_prompts, len(clients) if static_split else None)
        for j, unstarted in (carried.unstarted if carried is not None else {}).items():
            problems_j = problems(j)
            self._queue.reopen(j, problems_j, [encode(p.prompt) for p in problems_j], unstarted)
        self.chunks_taken = [0] * len(clients)  # per replica: chunks it generated (the bench reports them)
        self._static = static_split
        self._lost: dict[int, str] = {}  # replicas that stopped answering -> why
        # chunks a replica's loop took and has not yet stored or given back -> (replica, the loop's incarnation)
        self._generating: dict[Chunk, tuple[int, int]] = {}
        self._min_replicas = min_replicas
        self._chunks_in_flight = chunks_in_flight
        self._incarnation = [0] * len(clients)  # per replica: bumped by `admit`, so the old loops of a slot end
        self._replica_log = replica_log or (lambda r: "its server's log")
        self._scoring = 0  # batches handed to the reward pool, not ready yet
        # the weights the fleet holds: a resumed run stops where the next batch begins with a push (first == end:
        # nothing left to make; partial rollouts resume at any home batch, the push of the resumed run's start first)
        if carried is None and 0 < first < end and schedule.sync_before_batch(first) is None:
            raise ValueError(
                f"cannot start generating at batch {first}: no push precedes it in {schedule}, so the "
                "fleet's weights for it are unknown; resume only from checkpoints megarl wrote"
            )
        self._limit = (start if carried is not None else first) if first > 0 else schedule.generation_limit(None)
        self._demand = 0  # sequential mode: batches below it may be generated
        self._error: BaseException | None = None
        self._closing = False
        self._score_pool = ThreadPoolExecutor(2, thread_name_prefix="megarl-score")
        self._threads: list[threading.Thread] = []
        for slot in range(chunks_in_flight):  # started slot by slot: each replica takes one chunk per round
            for r in range(len(clients)):
                self._start_loop(r, slot)

    # ---- the controller's calls ------------------------------------------------------------------------------
    def take(self, step: int) -> RolloutBatch:
        """Batch `step`, once it is generated and scored (the trainer's wait is recorded on the timeline)."""
        if self._partial is not None:
            return self._form(step)
        with self.timeline.span("trainer", "wait", f"step {step}"), self._cv:
            if not self.overlap:  # the sequential controller generated n batches ahead before each step
                self._raise_demand(self.schedule.batches_ready_before_step(step))
                self._wait(lambda: all(j in self._ready for j in range(step, min(self._demand, self.end))))
            self._wait(lambda: step in self._ready)
            return self._ready.pop(step)

    def _form(self, step: int) -> RolloutBatch:
        """Partial rollouts: batch `step` from the pool (`megarl.rollout.partial`), once `batch_groups` groups within
        the staleness bound of version `step` are in."""
        assert self._partial is not None
        size, bound = self._partial.batch_groups, self._partial.bound
        dropped: list[ScoredGroup] = []

        def formed() -> list[ScoredGroup] | None:
            if stale := self._pool.drop_stale(step, bound):
                dropped.extend(stale)
                self.dropped.extend((g.home, g.prompt, version_lag(step, g.oldest)) for g in stale)
                self._cv.notify_all()  # room in the window
            return self._pool.form(size)

        with self.timeline.span("trainer", "wait", f"step {step}"), self._cv:
            groups: list[ScoredGroup] | None = None

            def ready() -> bool:
                nonlocal groups
                groups = formed()
                return groups is not None

            self._wait(ready)
            assert groups is not None
            self._consumed += len(groups)
            self._next_take = step + 1
            in_flight = self._carried + self._admitted - self._consumed - len(self.dropped) - len(self._pool)
            aborted, self._aborted_since_take = self._aborted_since_take, []
            self._last_take = {"partial/dropped_groups": len(dropped) + len(aborted),
                               "partial/aborted_groups": len(aborted), "partial/aborted_total": len(self.aborted),
                               "partial/dropped_total": len(self.dropped),
                               "partial/carried_groups": sum(g.home < step for g in groups),
                               "partial/in_flight_groups": in_flight,
                               "partial/started_groups": self._carried + self._admitted,
                               "partial/pooled_groups": len(self._pool),  # finished, not taken yet
                               # which groups: (home batch, prompt) trained, and (home, prompt, lag) dropped
                               "partial/groups": [list(g.key) for g in groups],
                               "partial/dropped": [[g.home, g.prompt, version_lag(step, g.oldest)] for g in dropped]
                               + [list(a) for a in aborted]}
            doomed = self._doomed_requests()
            self._cv.notify_all()
        self._abort(doomed)
        if dropped:
            logger.info("batch %d: %d group(s) dropped, their oldest token past the staleness bound of %d versions "
                        "(%d so far)", step, len(dropped), bound, len(self.dropped))
        return batch_of_groups(step, groups)

    def step_metrics(self) -> dict[str, Any]:
        """What the last `take` met: `fleet/requeued_groups` (so far: groups a lost replica was generating, generated
        again by the others) and, with partial rollouts, `partial/*`: the groups dropped past the staleness bound
        (this batch, and so far; this batch's count includes the groups aborted as doomed since the previous take,
        also counted on their own as `partial/aborted_groups`, and so far `partial/aborted_total`), the batch's
        groups carried from an earlier home batch, the groups still generating, finished and waiting, and started
        so far, and which groups the batch holds and which it dropped (`partial/groups`: [home batch, prompt];
        `partial/dropped`: [home batch, prompt, lag], an aborted group's lag counted against the batch it could
        have joined at best)."""
        with self._cv:
            return {"fleet/requeued_groups": self.requeued, **self._last_take}

    def before_push(self, before: int) -> None:
        """At the push point before batch `before`: wait for the fleet's window (`quiesce`), unless partial rollouts
        are on: then the push lands while the groups generate (vLLM's keep mode holds them)."""
        if self._partial is None:
            self.quiesce(before)

    def quiesce(self, before: int) -> None:
        """Block until every chunk of every batch before `before`, the end of the fleet's current window (the next
        push's batch, or the run's end), is generated: then no replica is generating. With partial rollouts (a
        checkpoint): start no new group and block until every started group is in and scored (`before` is not
        used); `pending` (or the next `pushed`) lets the fleet go on."""
        if self._partial is not None:
            with self._cv:
                self._hold = True
                self._wait(self._nothing_in_flight)
            return
        with self._cv:
            if before != min(self._limit, self.end):
                raise RuntimeError(f"quiesce({before}): the fleet's window ends at batch {min(self._limit, self.end)}")
            if not self.overlap:
                self._raise_demand(before)
            self._wait(lambda: self._queue.complete_below() >= before)

    def pushed(self, before: int, held: Iterable[str] = ()) -> None:
        """The push that precedes batch `before` is done: generate up to the next push. `held`: with partial
        rollouts, the ids of the requests that held output tokens at the push's pause (`SyncStats.held_requests`):
        their first token was generated under the weights the fleet held before the push, which bounds their
        oldest token's version (doomed groups are aborted by it)."""
        with self._cv:
            held_before = self.clock.fleet_version  # the version the held requests' first tokens were sampled with
            if self._partial is not None and held_before is not None:
                generating = {rid for _, rid in self._requests.values()}
                for rid in held:
                    if rid in generating:  # the first push that finds it holding tokens gives the tightest bound
                        self._oldest_at_most.setdefault(rid, held_before)
            self._limit = self.schedule.generation_limit(before)
            self.clock.fleet_at(self.schedule.generation_version(before), range(len(self.clients)))
            self._hold = False
            doomed = self._doomed_requests()
            self._cv.notify_all()
        self._abort(doomed)

    def pending(self) -> dict[int, RolloutBatch] | CarriedGroups:
        """After `quiesce`: wait for the scoring of every generated batch; the batches not consumed yet (partial
        rollouts: the groups not taken yet, and the first home batch not started)."""
        with self._cv:
            if self._partial is not None:
                self._wait(self._nothing_in_flight)
                unstarted = {j: sorted(i for _, prompts in batch.todo for i in prompts)
                             for j, batch in self._queue.open.items() if batch.todo}
                self._hold = False  # the snapshot is taken: the fleet goes on (no push need follow a checkpoint)
                self._cv.notify_all()
                return CarriedGroups(self._pool.groups(), self._queue.next_batch, unstarted)
            self._wait(lambda: self._scoring == 0 and not self._queue.open)
            return dict(self._ready)

    def evaluate(self) -> dict[str, float]:
        """The `eval/...` metrics of the fleet's current weights; generation of training batches goes on meanwhile
        (the requests share the servers), so the schedule and the training data are unchanged."""
        if self._evaluator is None:
            raise RuntimeError("evaluate(): this rollout worker was built without an evaluator (eval.interval=0)")
        return self._evaluator(self.live_clients(), on_lost=self._lost_in_evaluation, salt=self.clock.salt)

    def _lost_in_evaluation(self, replica: int, why: str) -> None:
        """A replica stopped answering during an evaluation: it takes no more chunks (its loops find out at their
        next request, and give their chunks back); below `rollout.min_replicas` the run stops, as in generation."""
        with self._cv:
            self._lost.setdefault(replica, why)
            self._cv.notify_all()
            left = len(self.clients) - len(self._lost)
        url = self.clients[replica].url
        logger.warning("rollout replica %d (%s) lost during the evaluation: %s", replica, url, why)
        if (stop := self._why_stop(left)) is not None:
            raise RolloutWorkerError(f"replica {replica} ({url}) lost during the evaluation: {why}; {stop}")

    def _why_stop(self, left: int) -> str | None:
        """Why the run cannot go on with `left` replicas serving (None: it can)."""
        if self._static:
            return "static_split has no failover"
        if left < self._min_replicas:
            return ("no rollout replica is left" if left == 0
                    else f"{left} replica(s) left, fewer than rollout.min_replicas={self._min_replicas}")
        return None

    def data_position(self, batch: int) -> dict | None:
        """Where batch `batch` starts in the task's data (a checkpoint records it; None: the task has none)."""
        return self._position(batch) if self._position is not None else None

    def live_replicas(self) -> int:
        """Replicas still taking chunks (the others stopped answering; the metrics record it per step)."""
        with self._cv:
            return len(self.clients) - len(self._lost)

    def lost(self) -> dict[int, str]:
        """The replicas that stopped answering, and why."""
        with self._cv:
            return dict(self._lost)

    def drop(self, replica: int, why: str) -> None:
        """Replica `replica` is gone (the weight sync found it dead or gave it up): it takes no more chunks, and the
        chunks its loops are generating go back to the queue now (with partial rollouts a push leaves requests held
        in it; a replica that hangs would keep their calls waiting until its `/health` fails for
        rollout.health_timeout_s). Their calls' answers, if any come, are ignored."""
        with self._cv:
            self._lost.setdefault(replica, why)
            taken = [chunk for chunk, (rep, _) in self._generating.items() if rep == replica]
            for chunk in taken:
                self._give_back(chunk)
            self._cv.notify_all()
        if taken:
            logger.warning("rollout replica %d dropped by the weight sync while generating %d chunk(s): they go back "
                           "to the queue (%s)", replica, len(taken), why.splitlines()[0])

    def _give_back(self, chunk: Chunk) -> None:
        """(Condition held.) A chunk a lost replica was generating goes back to the front of the queue, counted in
        `requeued`; its loop no longer holds it."""
        del self._generating[chunk]
        self._forget_requests(chunk)
        if chunk.batch in self._queue.open:  # (another loop cannot have completed it: nobody else held it)
            self._queue.give_back(chunk)
            self.requeued += len(chunk.prompts)
            if self._partial is not None:
                self._admitted -= len(chunk.prompts)

    def admit(self, replica: int, client: RolloutClient) -> None:
        """A restarted replica, which the last push gave the current weights, takes chunks again from now on
        (call it at a push point: the fleet is quiesced, so it starts with the next window like the others)."""
        with self._cv:
            self.clients[replica] = client
            self._lost.pop(replica, None)
            self._incarnation[replica] += 1  # the loops of its previous incarnation end
            for slot in range(self._chunks_in_flight):
                self._start_loop(replica, slot)
            self._cv.notify_all()

    def live_clients(self) -> dict[int, RolloutClient]:
        """The replicas still taking chunks: replica -> its client."""
        with self._cv:
            return {r: c for r, c in enumerate(self.clients) if r not in self._lost}

    def batches_generated(self) -> int:
        """How many batches have been fully generated so far (consumed ones included)."""
        with self._cv:
            return self._queue.complete_below()  # every batch below the lowest open one is complete

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self._score_pool.shutdown(wait=False, cancel_futures=True)
        self._abort_pool.shutdown(wait=False, cancel_futures=True)
        self._scorer.close()

    # ---- inside ----------------------------------------------------------------------------------------------
    def _raise_demand(self, upto: int) -> None:
        self._demand = max(self._demand, upto)
        self._cv.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait on the condition (held) until `ready()`; a failed thread's error is raised here, and so is a prompt
        that nobody will ever generate (`_unaccounted`), instead of waiting for it forever."""
        while True:
            if unaccounted := self._unaccounted():
                raise RolloutWorkerError(
                    f"prompts {unaccounted} (batch -> prompt indices) were taken by a replica and neither generated "
                    "nor put back on the queue: their batches could never complete")
            if self._error is not None:
                raise RolloutWorkerError(f"rollout failed: {self._error}") from self._error
            if ready():
                return
            self._cv.wait(timeout=1.0)

    def _unaccounted(self) -> dict[int, list[int]]:
        """(Condition held.) Per open batch, the prompts whose group is not in, that are not queued and that no
        replica's loop is generating (none, unless a lost replica's chunk was dropped instead of given back)."""
        held: dict[int, set[int]] = {}
        for chunk in self._generating:
            held.setdefault(chunk.batch, set()).update(chunk.prompts)
        out = {}
        for j, batch in self._queue.open.items():
            queued = {i for _, prompts in batch.todo for i in prompts} | held.get(j, set())
            if missing := [i for i, group in enumerate(batch.groups) if group is None and i not in queued]:
                out[j] = missing
        return out

    def _nothing_in_flight(self) -> bool:
        """(Condition held.) No chunk is being generated and none is being scored."""
        return not self._generating and self._scoring == 0

    def _may_open(self, j: int) -> bool:
        """Whether batch `j` may be generated now: inside the fleet's window (and, sequentially, demanded)."""
        return j < min(self._limit, self.end) and (self.overlap or j < self._demand)

    def _next_chunk(self, replica: int) -> Chunk | None:
        """(Condition held.) The next chunk to generate: an untaken one of an open batch, else the first of the
        next batch if the schedule allows it; None if there is none now."""
        if self._partial is not None:
            return self._admit(replica)
        chunk = self._queue.take_open(replica)
        while chunk is None and self._may_open(self._queue.next_batch):
            self._open_next()
            chunk = self._queue.take_open(replica)
        return chunk

    def _open_next(self) -> None:
        problems = self._problems(self._queue.next_batch)
        self._queue.open_batch(problems, [self._encode(p.prompt) for p in problems])

    def _admit(self, replica: int) -> Chunk | None:
        """(Condition held.) Partial rollouts: the next chunk, opening the next home batch if need be, while the
        groups started stay within `admission_limit` of the version the fleet holds; None otherwise."""
        assert self._partial is not None
        fleet = self.clock.fleet_version
        if self._hold or fleet is None:
            return None
        limit = admission_limit(fleet, self._partial.bound, self._partial.batch_groups, self._start, self.end,
                                len(self.dropped), self._carried)
        chunk = self._queue.take_open(replica)
        if chunk is None and self._admitted < limit:
            self._open_next()
            chunk = self._queue.take_open(replica)
        if chunk is not None and self._admitted + len(chunk.prompts) > limit:
            self._queue.give_back(chunk)  # (back where it was: the front of its batch)
            return None
        if chunk is not None:
            self._admitted += len(chunk.prompts)
        return chunk

    def _doomed_requests(self) -> dict[int, list[str]]:
        """(Condition held.) Partial rollouts with `abort_doomed`: the groups generating whose oldest token is
        already too old for the next batch the trainer takes (`_oldest_at_most`, an upper bound on that token's
        version, lags `_next_take` by more than the bound, so the true one does too), not marked yet: marked
        (`_doomed`), and returned as replica -> request ids to abort."""
        if self._partial is None or not self._partial.abort_doomed:
            return {}
        out: dict[int, list[str]] = {}
        for key, (replica, rid) in self._requests.items():
            at_most = self._oldest_at_most.get(rid)
            if at_most is not None and self._next_take - at_most > self._partial.bound and key not in self._doomed:
                self._doomed.add(key)
                out.setdefault(replica, []).append(rid)
        return out

    def _abort(self, doomed: dict[int, list[str]]) -> None:
        """Abort the doomed requests in their engines, in the background (the trainer does not wait for it); each
        generate call then answers with its tokens so far, `finish_reason` "abort", and its group is dropped and
        counted when it comes back (`_replica_loop`). An abort that fails leaves the group to finish: it is then
        dropped at a take, as without `abort_doomed`."""
        for replica, rids in doomed.items():
            client = self.clients[replica]

            def send(client: RolloutClient = client, rids: list[str] = rids, replica: int = replica) -> None:
                try:
                    client.abort_requests(rids, timeout_s=30.0)
                except Exception as err:  # noqa: BLE001 - a failed abort only costs the group's generation
                    logger.warning("replica %d: aborting doomed request(s) %s failed (%s: %s); they finish and are "
                                   "dropped at a take", replica, rids, type(err).__name__, err)

            logger.info("replica %d: aborting %d doomed group(s), their oldest token already past the staleness "
                        "bound: %s", replica, len(rids), rids)
            self._abort_pool.submit(send)

    def _start_loop(self, replica: int, slot: int) -> None:
        thread = threading.Thread(target=self._replica_loop, args=(replica, self._incarnation[replica]), daemon=True,
                                  name=f"megarl-replica{replica}-{slot}")
        self._threads.append(thread)
        thread.start()

    def _replica_loop(self, replica: int, incarnation: int) -> None:
        client = self.clients[replica]

        def gone() -> bool:  # (condition held) this loop's replica is lost, or a newer incarnation took its place
            return replica in self._lost or self._incarnation[replica] != incarnation

        try:
            while True:
                with self._cv:
                    chunk = None
                    while not (self._closing or gone()) and (chunk := self._next_chunk(replica)) is None:
                        self._cv.wait()
                    if chunk is None:  # closing, or this replica is lost
                        return
                    self._generating[chunk] = (replica, incarnation)
                    prompts = [self._queue.open[chunk.batch].prompts[i] for i in chunk.prompts]
                    problems = [self._queue.open[chunk.batch].problems[i] for i in chunk.prompts]
                    base = self._seed(chunk.batch)
                    # partial: the salt of the weights the request will run under, read as it is sent (a push that
                    # has paused the replica moved it already: the request waits in the engine for the resume)
                    salt = {"cache_salt": self.clock.salt(replica), "require_spans": True} \
                        if self._partial is not None else {}
                    rids = [group_request_id(chunk.batch, i) for i in chunk.prompts]  # [faults]
                    if self._partial is not None:
                        for i, rid in zip(chunk.prompts, rids, strict=True):
                            self._requests[chunk.batch, i] = (replica, rid)
                j = chunk.batch
                with self.timeline.span(f"replica {replica}", "generate", f"batch {j}"):
                    try:  # prompt i of batch j is sampled with seed(j) + i, whichever replica serves it
                        out = client.generate(prompts, **self._sampling, seed=[base + i for i in chunk.prompts],
                                              request_ids=rids, **salt)
                    except RolloutServerLost as err:
                        self._lose(replica, chunk, err, client, (replica, incarnation))
                        continue
                    except Exception as err:
                        raise RolloutWorkerError(
                            f"replica {replica} ({client.url}), batch {j}: {type(err).__name__}: {err}"
                        ) from err
                    # [inflight-faults hook] a chunk with an aborted choice was not generated, unless megarl aborted
                    # that group as doomed (`_abort`): the only other requests megarl aborts are those of a replica
                    # it gave up (`FleetLifecycle._give_up_mixed`), so the chunk is lost like one whose replica
                    # stopped answering: it goes back to the queue (counted in `requeued`), never to the pool
                    groups = dict(zip(chunk.prompts, out, strict=True))
                    aborted = {i for i, group in groups.items() if any(s.finish_reason == "abort" for s in group)}
                    with self._cv:
                        given_up = [i for i in aborted if (j, i) not in self._doomed]
                    if given_up:
                        self._lose(replica, chunk, RolloutServerLost(
                            f"{len(given_up)} of the chunk's groups came back aborted (finish_reason 'abort'): the "
                            "replica dropped its requests (a push that failed part-way on it)"), client,
                                   (replica, incarnation))
                        continue
                with self._cv:
                    if self._generating.get(chunk) != (replica, incarnation):  # given back by `drop`: too late
                        continue
                    self.chunks_taken[replica] += 1
                    del self._generating[chunk]
                    self._forget_requests(chunk)
                    batch = self._queue.done(chunk, out)
                    if self._partial is not None:  # every chunk's groups are scored and pooled as they come in
                        for i in sorted(aborted):  # (aborted as doomed: the others went to `_lose` above)
                            self._drop_aborted(j, i, groups[i])
                        kept = [k for k, i in enumerate(chunk.prompts) if i not in aborted]
                        if kept:
                            self._scoring += 1
                            self._score_pool.submit(self._score_groups, j, [chunk.prompts[k] for k in kept],
                                                    [problems[k] for k in kept], [out[k] for k in kept])
                    elif batch is not None:
                        self._scoring += 1
                        self._score_pool.submit(self._score, j, batch.problems, batch.groups)
                    self._cv.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the controller
            self._fail(err)

    def _lose(self, replica: int, chunk: Chunk, err: RolloutServerLost, client: RolloutClient,
              owner: tuple[int, int]) -> None:
        """Replica `replica` stopped answering while generating `chunk` (the loop `owner`, replica and incarnation,
        took it): the chunk goes back to the front of the queue for the others, the replica takes no more, and one
        line says so. The others' loops of this replica end the same way (their chunks go back too). With no replica
        left, the run stops with the cause."""
        url, cause = client.url, f"{type(err).__name__}: {err}"
        with self._cv:
            if self._generating.get(chunk) == owner:  # else `drop` gave it back already
                self._give_back(chunk)
            first = replica not in self._lost and client is self.clients[replica]  # not an older incarnation's loop
            if client is self.clients[replica]:
                self._lost.setdefault(replica, cause)
            self._cv.notify_all()
            left = len(self.clients) - len(self._lost)
            if (stop := self._why_stop(left)) is not None:
                raise RolloutWorkerError(f"replica {replica} ({url}), batch {chunk.batch}: {cause}; {stop}")
        if first:
            logger.warning(
                "rollout replica %d (%s) lost: %s; its unfinished chunks go back to the queue, %d "
                "replica(s) go on (log: %s)",
                replica,
                url,
                cause.splitlines()[0],
                left,
                self._replica_log(replica),
            )

    def _forget_requests(self, chunk: Chunk) -> None:
        """(Condition held.) Partial rollouts: the chunk's requests are over (in, or given back): forget them."""
        for i in chunk.prompts:
            if (entry := self._requests.pop((chunk.batch, i), None)) is not None:
                self._oldest_at_most.pop(entry[1], None)
            self._doomed.discard((chunk.batch, i))

    def _drop_aborted(self, home: int, prompt: int, samples: list[Sample]) -> None:
        """(Condition held.) A group aborted as doomed came back: dropped and counted, with the lag of its oldest
        token (from its samples' own versions: the tokens it had) against the first batch it could have joined."""
        assert self._partial is not None
        versions = [s.token_versions.oldest for s in samples if s.token_versions is not None and s.token_versions.runs]
        oldest = min(versions) if versions else min(s.policy_version for s in samples)
        drop = (home, prompt, version_lag(self._next_take, oldest))
        if drop[2] <= self._partial.bound:  # (never, if the engine's held counts are right: `megarl.rollout.partial`)
            logger.error("home batch %d, prompt %d was aborted as doomed, but its oldest token lags only %d versions "
                         "(bound %d): the engine's held counts at a push overstated it; the group is lost", *drop,
                         self._partial.bound)
        self.dropped.append(drop)
        self._aborted_since_take.append(drop)
        self.aborted.append((*drop, [len(s.response_ids) for s in samples]))

    def _score(self, j: int, problems: list[Problem], samples: list[list[Sample]]) -> None:
        try:
            with self.timeline.span("reward", "score", f"batch {j}"):
                try:
                    batch = self._scorer(j, problems, samples)
                except Exception as err:
                    raise RolloutWorkerError(f"scoring batch {j}: {type(err).__name__}: {err}") from err
            with self._cv:
                self._ready[j] = batch
                self._scoring -= 1
                self._cv.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the controller
            self._fail(err)

    def _score_groups(self, j: int, prompts: list[int], problems: list[Problem], samples: list[list[Sample]]) -> None:
        """Partial rollouts: score groups of home batch `j` (its prompts `prompts`) and pool them."""
        try:
            with self.timeline.span("reward", "score", f"batch {j}"):
                try:
                    scores = self._scorer.group_scores(problems, samples)
                except Exception as err:
                    raise RolloutWorkerError(f"scoring batch {j}: {type(err).__name__}: {err}") from err
            with self._cv:
                for i, group, score in zip(prompts, samples, scores, strict=True):
                    self._pool.add(ScoredGroup(j, i, group, score.rewards[0], score.timeouts, score.flags))
                self._scoring -= 1
                self._cv.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the controller
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = err
            self._cv.notify_all()
