"""The fleet side of one weight update, driven over HTTP by trainer rank 0, apart from the byte moving
(`megarl.sync.transport`):

    needs:  /collective_rpc megarl_record_loader_reads on replica 0 (what each TP rank's loaders read), once
    join:   /init_weight_transfer_engine on a replica (its workers join its sync group, get the needs): every
            replica at the start, a restarted one again when the trainer lets it in
    open:   /pause (mode wait; with in-flight updates mode keep, then the engine's counts of the requests held
            (/collective_rpc megarl_held_requests) and, for sync.inflight_kv=recompute, /reset_prefix_cache with the
            running requests preempted: `megarl.rollout.inflight`) -> close a session a dead trainer left open (a
            replica's first open only) ->
            /start_weight_update on every replica (undone on failure; a replica that does not answer is skipped and
            named, `megarl.sync.weight_sync` decides whether the push goes on without it)
    update: /update_weights with each TP worker's part of the plan, one thread per replica; it returns once the
            workers have received, checked and loaded their blocks, or refused them
    close:  /collective_rpc megarl_sync_report -> /finish_weight_update(version), or (None) to close a refused
            update unlabelled -> /resume, except on a replica whose loaders failed part-way (it stays paused; with
            in-flight updates its requests are aborted, /pause?mode=abort, it is condemned and the push goes on
            without it, as without a replica that died)

Every call of a push waits at most `call_timeout_s`, the push's own bound (`sync.timeout_fixed_s` + the busiest
link's bytes / `sync.timeout_min_gbps`, `megarl.sync.group_timeout`), not the client's 600 s read timeout. A call
not answered within it while the replica's `/health` answers (`RolloutServerHung`: a stopped or wedged vLLM worker
leaves the API server healthy) fails the replica for this push as a dead one, and the replica is condemned:
`condemn(replica, why)` (the trainer's `Roster.condemn`) marks it in the run's fleet registry, where its launcher
finds it and kills and restarts it as it would one whose `/health` failed. Nothing more is asked of a condemned
replica in this push. A replica one of whose workers stops beating while its `/update_weights` waits
(`megarl.sync.heartbeat`: silent for `rollout.health_timeout_s`) is given up and condemned the same way then, without
waiting for the bound, so that the senders go on to the other replicas' buckets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from megarl.rollout.client import RolloutClient, RolloutServerError, RolloutServerHung, RolloutServerLost
from megarl.rollout.inflight import InflightKV, group_of_request, held_counts
from megarl.schedule import VersionClock
from megarl.sync import failpoints
from megarl.sync.needs import RolloutNeeds, recorded_by_fleet

logger = logging.getLogger(__name__)

LABEL_TIMEOUT_S = 30.0  # how long `served()` waits for one replica's label (a cheap GET; a live server answers at once)


SILENT_POLL_S = 0.5  # how often `start_updates` asks whether a replica's workers still beat while its call waits


class WorkerSilent(RolloutServerHung):
    """A worker of the replica stopped beating during the push (`megarl.sync.heartbeat`): it is stopped or wedged."""


class UpdateRefused(RuntimeError):
    """A replica's workers reported errors for this update (their messages, joined)."""


class ResultThread(threading.Thread):
    """A thread that keeps its exception for whoever joins it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn: Callable[[], object] = fn
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as err:  # noqa: BLE001 - kept for the joiner
            self.error = err

    def join_or_raise(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def _report_errors(reports: list[dict[str, Any]], update_id: str) -> str:
    """The errors in one replica's worker reports for update `update_id` ('' if every worker loaded it)."""
    errors = []
    for report in reports:
        if report.get("update_id") != update_id:
            errors.append(f"worker {report.get('rank')} has no report for this update (last: {report})")
        elif "error" in report:
            errors.append(report["error"])
    return " || ".join(dict.fromkeys(errors))  # TP peers share one message: keep it once


def _best_effort(fn: Callable[[], object]) -> None:
    """Clean-up call on a server that may be the reason of the failure being reported: its own error is dropped."""
    try:
        fn()
    except RolloutServerError:
        pass


def _still_serving(client: RolloutClient, timeout_s: float | None = None) -> bool:
    """Whether a replica whose update call failed still serves: `/health` answers and so does every worker (vLLM
    shuts the whole engine down when a worker dies, but `/health` may still answer for a moment) within
    `timeout_s` (default the client's)."""
    if not client.healthy():
        return False
    try:
        client.collective_rpc("megarl_sync_report", timeout_s=timeout_s)
    except RolloutServerError:
        return False
    return client.healthy()


class FleetLifecycle:
    """Trainer rank 0's handle on the replicas of one fleet that are in the sync (`clients`: replica -> its client,
    `tp` workers each); `leave` and `join` change who is in. `call_timeout_s`: the push's bound on each of its
    calls (None: the clients' own timeout); `condemn(replica, why)`: tells the replica's launcher to kill and restart
    one that hung (None: it is only left out; see the module docstring). `inflight` (`sync.inflight`): pause in
    vLLM's keep mode, so requests in flight are held through the push, not waited for; `inflight_kv`
    (`sync.inflight_kv`): whether their KV is kept or recomputed under the new weights (`megarl.rollout.inflight`).
    `clock`: the run's `megarl.schedule.VersionClock`, told the moment each replica is paused for a push
    (`VersionClock.pausing`: requests sent to it from then on run under the pushed weights, so their prefix-cache
    salt moves before the replica resumes); None: nobody is told."""

    def __init__(self, clients: list[RolloutClient], tp: int, call_timeout_s: float | None = None,
                 condemn: Callable[[int, str], None] | None = None, inflight: bool = False,
                 inflight_kv: InflightKV = "recompute", clock: VersionClock | None = None) -> None:
        self.clients: dict[int, RolloutClient] = dict(enumerate(clients))
        self.clock = clock
        self.tp = tp
        self.inflight, self.inflight_kv = inflight, inflight_kv
        # with `inflight`: per replica opened by the last `open`, the output tokens each generate request held at its
        # pause, keyed (request_id, choice index) (`megarl.rollout.inflight.held_counts`); empty otherwise
        self.held: dict[int, dict[tuple[str, int], int]] = {}
        self.call_timeout_s = call_timeout_s
        self.condemn = condemn
        self.condemned: dict[int, str] = {}  # replicas condemned since they last joined -> why
        self._stale_closed: set[int] = set()  # replicas whose sessions a dead trainer left open were closed

    def _hung(self, rep: int, err: RolloutServerHung) -> str:
        """Replica `rep` did not answer a call of this push within the bound, or a worker of it stopped beating,
        while its `/health` answered: condemn it (once); the line that says so."""
        bound = "" if isinstance(err, WorkerSilent) else " (the push's bound: sync.timeout_fixed_s + bytes / " \
            "sync.timeout_min_gbps)"
        why = f"replica {rep} ({self.clients[rep].url}) hangs: {err}{bound}, while its /health answers"
        self._condemn(rep, why)
        return why

    def _condemn(self, rep: int, why: str) -> None:
        """Tell replica `rep`'s launcher to kill and restart it (once; `condemn`), and say so."""
        if rep in self.condemned:
            return
        self.condemned[rep] = why
        if self.condemn is None:
            logger.error("%s; no launcher can be told (no fleet registry): it is left out of the sync", why)
            return
        try:
            self.condemn(rep, why)
            logger.error("%s: condemned, its launcher kills and restarts it", why)
        except Exception as fail:  # noqa: BLE001 - the push goes on without it either way
            logger.error("%s; condemning it failed: %s", why, fail)

    def _give_up_mixed(self, rep: int, client: RolloutClient, err: Exception) -> str:
        """With in-flight updates, replica `rep`'s loaders failed part-way while it held requests (they are frozen in
        its engine, `/pause?mode=keep`): abort every request in its engine (`/pause?mode=abort`: each call answers at
        once, its choices' `finish_reason` "abort", and the rollout worker gives their chunks back to the queue, to
        be generated again on the other replicas; the replica stays paused, so not one token is computed with its
        half-loaded weights) and condemn it (its launcher restarts it, which repairs it; it rejoins with a full
        push). The caller reports it as a replica that died: the push goes on without it. Returns why."""
        held = len({rid for rid, _ in self.held.get(rep, {})})
        try:
            client.pause(timeout_s=self.call_timeout_s, mode="abort", clear_cache=False)
            released = f"the {held} request(s) it held at the pause were aborted, to be generated again elsewhere"
        except RolloutServerError as fail:  # (one that stopped answering has dropped them anyway)
            released = f"aborting the {held} request(s) it held failed: {type(fail).__name__}: {fail}"
        why = (f"replica {rep} ({client.url}): {type(err).__name__}: {err} (with in-flight updates a replica whose "
               f"loaders failed part-way is given up like a replica that died: {released}; it stays paused and "
               "serves nothing until it is restarted)")
        self._condemn(rep, why)
        return why

    def record_needs(self) -> RolloutNeeds:
        """What each vLLM TP rank's loaders read, recorded by the first replica in its own environment (see
        `megarl.sync.needs`); the other replicas check at `join` that the record is for their layout."""
        client = self.clients[min(self.clients)]
        return recorded_by_fleet(client.collective_rpc("megarl_record_loader_reads"), self.tp, client.url)

    def join(self, groups: dict[int, str], host: str, port: int, trainers: int, slots: int, timeout_s: float,
             needs: RolloutNeeds, op_timeout_s: float | None = None) -> dict[int, ResultThread]:
        """Ask the workers of each replica in `groups` (replica -> its sync group's store prefix, store at
        `host:port`) to join its group: TP rank r at rank `trainers + r` of it (fleet-wide rank
        `trainers + replica * tp + r` in plans and reports); each worker is handed `needs` (it keeps its own rank's
        blocks) and `op_timeout_s`, its NCCL group's operation timeout (`megarl.sync.group_timeout`). Returns the
        threads to join once this rank has joined too."""
        for rep in groups:  # a dead or unguarded-key server fails here, not in the group's rendezvous
            self.clients[rep].weight_version()
        threads = {}
        for rep, prefix in groups.items():
            info = {"host": host, "port": port, "world_size": trainers + slots * self.tp,
                    "rank_offset": trainers + rep * self.tp, "timeout_s": timeout_s, "needs": needs.to_json(),
                    "group_prefix": prefix, "group_rank_offset": trainers, "group_world_size": trainers + self.tp,
                    "op_timeout_s": op_timeout_s}
            threads[rep] = ResultThread(lambda c=self.clients[rep], info=info: c.init_weight_transfer(info))
            threads[rep].start()
        return threads

    def held_groups(self) -> list[tuple[int, int]]:
        """The groups `(home batch, prompt)` (`megarl.rollout.inflight.group_of_request`) of which some response
        held at least one output token at the last `open`'s pause (the model runners' counts, and the API server's
        for requests a runner no longer holds: `megarl.rollout.held_served`): such a response goes on under the new
        weights, its tokens of two versions, unless it had finished in the engine's last step before the pause, whose
        finished requests the model runner still holds. Requests of other ids are left out. Sorted; empty without
        inflight."""
        return sorted({group for rid in self.held_requests() if (group := group_of_request(rid)) is not None})

    def held_requests(self) -> list[str]:
        """The ids of the generate requests of which some response held at least one output token at the last
        `open`'s pause (the model runners' and the API server's counts, with `held_groups`' caveat: a request that
        finished in the engine's last step is listed too). Whichever it is, a listed request's first token was
        generated before the pause, under the weights the replica held then. Sorted; empty without inflight."""
        return sorted({rid for counts in self.held.values() for (rid, _), tokens in counts.items() if tokens > 0})

    def served(self) -> dict[int, str | None]:
        """The version label each replica reports now (None: it did not answer within `LABEL_TIMEOUT_S`: a metric
        must not hold the push, which has already finished, for the client's whole request timeout)."""
        labels: dict[int, str | None] = {}
        for rep, client in self.clients.items():
            try:
                labels[rep] = client.weight_version(timeout_s=LABEL_TIMEOUT_S)
            except RolloutServerError:
                labels[rep] = None
        return labels

    def leave(self, replica: int) -> None:
        """Forget replica `replica` (it stopped answering): later pushes do not address it."""
        self.clients.pop(replica, None)
        self._stale_closed.discard(replica)
        self.condemned.pop(replica, None)  # a restarted incarnation joins afresh

    def open(self, version: int | None = None) -> tuple[str | None, dict[int, str]]:
        """Pause every replica and open its update session for the push of `version` (told to `clock` as each
        replica's /pause answers; None: nothing is told). A replica that does not answer (`RolloutServerLost`)
        is skipped and returned with why; any other failure undoes the others and is returned:
        (failure or None, {lost replica: why})."""
        paused: list[RolloutClient] = []
        opened: list[RolloutClient] = []
        lost: dict[int, str] = {}
        self.held = {}
        try:
            bound = self.call_timeout_s
            for rep, client in self.clients.items():
                try:
                    failpoints.hold(f"push.pause.replica{rep}")
                    if self.inflight:  # keep the KV here: `_hold` preempts explicitly for inflight_kv=recompute
                        client.pause(timeout_s=bound, mode="keep", clear_cache=False)
                    else:
                        client.pause(timeout_s=bound)
                    paused.append(client)
                    if self.clock is not None and version is not None:  # requests sent from now run after the resume
                        self.clock.pausing(rep, version)
                    failpoints.hold(f"push.paused.replica{rep}")
                    if self.inflight:
                        self._hold(rep, client)
                    if rep not in self._stale_closed:  # only an earlier trainer (one that died mid-update) leaves one
                        client.collective_rpc("megarl_end_stale_update", timeout_s=bound)
                    client.start_weight_update(timeout_s=bound)
                    opened.append(client)
                except RolloutServerLost as err:  # it may have died just now, after answering /pause
                    if isinstance(err, RolloutServerHung):
                        lost[rep] = self._hung(rep, err)
                    elif _still_serving(client, bound):
                        raise
                    else:
                        lost[rep] = f"replica {rep} ({client.url}) does not answer: {type(err).__name__}: {err}"
                    if paused and paused[-1] is client:
                        paused.pop()
        except Exception as err:  # noqa: BLE001 - returned, then raised on every trainer rank
            for client in opened:  # closes the session, label unchanged
                _best_effort(lambda c=client: c.finish_weight_update(None, timeout_s=self.call_timeout_s))
            for client in paused:
                _best_effort(lambda c=client: c.resume(timeout_s=self.call_timeout_s))
            return f"could not start the update: {type(err).__name__}: {err}", lost
        self._stale_closed |= set(self.clients) - set(lost)
        return None, lost

    def _hold(self, rep: int, client: RolloutClient) -> None:
        """Replica `rep` is paused in keep mode: record what each request in flight holds (the engine's own counts,
        TP rank 0's model runner) and, with `inflight_kv=recompute`, preempt them all and empty the prefix cache,
        so that they are prefilled again under the weights they resume with."""
        counts = client.collective_rpc("megarl_held_requests", timeout_s=self.call_timeout_s, args=[str(rep)])
        self.held[rep] = held_counts(counts[0])
        if self.inflight_kv == "recompute" and not client.reset_prefix_cache(True, timeout_s=self.call_timeout_s):
            raise RuntimeError(f"replica {rep} ({client.url}) did not empty its prefix cache after preempting its "
                               "running requests (vLLM refuses while a request waits for a remote KV transfer): "
                               "their KV would not be recomputed; use sync.inflight_kv=keep with such a fleet")

    def abort_open(self, lost: dict[int, str]) -> None:
        """Undo `open` on every replica but the `lost` ones: close the session unlabelled and resume."""
        for rep, client in self.clients.items():
            if rep not in lost:
                _best_effort(lambda c=client: c.finish_weight_update(None, timeout_s=self.call_timeout_s))
                _best_effort(lambda c=client: c.resume(timeout_s=self.call_timeout_s))

    def start_updates(self, infos: dict[int, list[dict[str, Any]]],
                      on_fail: Callable[[int, str], None] | None = None,
                      silent: Callable[[int], str | None] | None = None) -> dict[int, ResultThread]:
        """One `/update_weights` call per replica, each in a thread (it returns once its workers have received,
        checked and loaded their blocks); `infos[i]` holds replica i's update info per TP rank. `on_fail(replica,
        why)` is called from a replica's thread as soon as its call fails (its workers receive nothing more: the
        trainer ranks stop waiting on sends to them, `megarl.sync.weight_sync`), at the latest once the call has waited
        `call_timeout_s` (a replica that hangs, which is also condemned). `silent(replica)`: why a worker of it
        stopped beating (`megarl.sync.heartbeat.BeatWatch`), or None; asked every `SILENT_POLL_S` while its call
        waits: a silent replica's call is given up then, as one that hangs (the call itself is left behind)."""

        def call(rep: int, info: list[dict[str, Any]]) -> None:
            client = self.clients[rep]
            if silent is None:
                client.update_weights(info, timeout_s=self.call_timeout_s)
                return
            waiting = ResultThread(lambda: client.update_weights(info, timeout_s=self.call_timeout_s))
            waiting.start()
            while waiting.is_alive():
                waiting.join(SILENT_POLL_S)
                why = silent(rep) if waiting.is_alive() else None
                if why is not None:
                    raise WorkerSilent(why)
            waiting.join_or_raise()

        def update(rep: int, info: list[dict[str, Any]]) -> None:
            try:
                call(rep, info)
            except BaseException as err:
                if on_fail is not None:
                    try:
                        on_fail(rep, f"replica {rep} ({self.clients[rep].url}): its update call failed: "
                                     f"{type(err).__name__}: {err}")
                    except Exception as fail:  # noqa: BLE001 - the call's own error is the one reported
                        logger.warning("could not tell the trainer ranks that replica %d's update failed: %s", rep,
                                       fail)
                if isinstance(err, RolloutServerHung):  # after on_fail: the senders stop first
                    self._hung(rep, err)
                raise

        threads = {}
        for rep, info in infos.items():
            threads[rep] = ResultThread(lambda rep=rep, info=info: update(rep, info))
            threads[rep].start()
        return threads

    def close(self, updates: dict[int, ResultThread], version: int,
              update_id: str) -> tuple[list[dict[str, Any]], dict[int, str], set[int]]:
        """Read each replica's worker reports; label a replica whose workers all loaded the update
        with `version`, close the session of one that refused it without a new label; resume generation on
        every replica except one whose loaders failed part-way (it may hold mixed weights: it stays paused).
        Returns the reports, what failed per replica (naming what it serves now) and the replicas among those
        whose server, engine or a worker died (they serve nothing until restarted) or, with in-flight updates,
        whose loaders failed part-way (`_give_up_mixed`: their requests are aborted and they are condemned)."""
        reports: list[dict[str, Any]] = []
        failures: dict[int, str] = {}
        dead: set[int] = set()
        bound = self.call_timeout_s
        for rep, thread in updates.items():
            client = self.clients[rep]
            thread.join()
            mixed = False
            try:
                if thread.error is not None:  # the RPC itself failed (vLLM closed the session): old weights serve
                    raise thread.error
                failpoints.hold(f"push.report.replica{rep}")
                replica_reports = client.collective_rpc("megarl_sync_report", timeout_s=bound)
                errors = _report_errors(replica_reports, update_id)
                mixed = any(r.get("model_state") == "mixed" for r in replica_reports)
                client.finish_weight_update(None if errors else version, timeout_s=bound)
                if errors:
                    raise UpdateRefused(errors)
                reports += replica_reports
            except Exception as err:  # noqa: BLE001 - reported on every trainer rank
                if isinstance(err, RolloutServerHung) or rep in self.condemned:
                    why = self.condemned.get(rep) or self._hung(rep, err)  # type: ignore[arg-type]
                    failures[rep] = f"{why} (it serves nothing until its launcher has restarted it)"
                    dead.add(rep)
                    continue  # nothing more is asked of it (a resume would wait the bound again)
                if mixed and self.inflight:  # (megarl.rollout.inflight: "When a replica fails with requests held")
                    failures[rep] = self._give_up_mixed(rep, client, err)
                    dead.add(rep)
                    continue
                if mixed:
                    after = ("it may hold a mix of old and new weights, so it is left paused and serves nothing until "
                             "a later push loads completely or it is restarted")
                elif not isinstance(err, UpdateRefused) and not _still_serving(client, bound):
                    after = ("its server, engine or a worker died (vLLM shuts the whole engine down when a worker "
                             "dies): it serves nothing until it is restarted")
                    dead.add(rep)
                else:
                    after = "it keeps serving its previous weights"
                failures[rep] = f"replica {rep} ({client.url}): {type(err).__name__}: {err} ({after})"
            if not mixed:  # (a dead one refuses at once; one wrongly judged dead serves on)
                _best_effort(lambda c=client: c.resume(timeout_s=bound))
        return reports, failures, dead
