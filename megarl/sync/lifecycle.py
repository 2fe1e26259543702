"""The fleet side of one weight update, driven over HTTP by trainer rank 0, apart from the byte moving
(`megarl.sync.transport`):

    needs:  /collective_rpc megarl_record_loader_reads on replica 0 (what each TP rank's loaders read), once
    join:   /init_weight_transfer_engine on every replica (its workers join the sync group, get the needs)
    open:   /pause -> close a session a dead trainer left open (first open only) -> /start_weight_update on every
            replica (undone on failure)
    update: /update_weights with each TP worker's part of the plan, one thread per replica; it returns once the
            workers have received, checked and loaded their blocks, or refused them
    close:  /collective_rpc megarl_sync_report -> /finish_weight_update(version), or (None) to close a refused
            update unlabelled -> /resume, except on a replica whose loaders failed part-way (it stays paused)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from megarl.rollout.client import RolloutClient, RolloutServerError
from megarl.sync.needs import RolloutNeeds, recorded_by_fleet


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


def _still_serving(client: RolloutClient) -> bool:
    """Whether a replica whose update call failed still serves: `/health` answers and so does every worker (vLLM
    shuts the whole engine down when a worker dies, but `/health` may still answer for a moment)."""
    if not client.healthy():
        return False
    try:
        client.collective_rpc("megarl_sync_report")
    except RolloutServerError:
        return False
    return client.healthy()


class FleetLifecycle:
    """Trainer rank 0's handle on the replicas of one fleet (`clients`, one per replica, `tp` workers each)."""

    def __init__(self, clients: list[RolloutClient], tp: int) -> None:
        self.clients, self.tp = clients, tp
        self._stale_closed = False  # sessions a dead trainer left open are closed at this lifecycle's first open

    def record_needs(self) -> RolloutNeeds:
        """What each vLLM TP rank's loaders read, recorded by replica 0 in its own environment (see
        `megarl.sync.needs`); the other replicas check at `join` that the record is for their layout."""
        client = self.clients[0]
        return recorded_by_fleet(client.collective_rpc("megarl_record_loader_reads"), self.tp, client.url)

    def join(self, host: str, port: int, world_size: int, first_worker_rank: int,
             timeout_s: float, needs: RolloutNeeds) -> list[ResultThread]:
        """Ask every replica's workers to join the sync group (store at `host:port`); replica i's TP rank r is
        rank `first_worker_rank + i * tp + r`; each worker is handed `needs` (it keeps its own rank's blocks).
        Returns the threads to join once this rank has joined too."""
        for client in self.clients:  # a dead or unguarded-key server fails here, not in the group's rendezvous
            client.weight_version()
        threads = []
        for i, client in enumerate(self.clients):
            info = {"host": host, "port": port, "world_size": world_size,
                    "rank_offset": first_worker_rank + i * self.tp, "timeout_s": timeout_s, "needs": needs.to_json()}
            threads.append(ResultThread(lambda c=client, info=info: c.init_weight_transfer(info)))
            threads[-1].start()
        return threads

    def open(self) -> str | None:
        """Pause every replica and open its update session; on failure undo it and return why."""
        paused: list[RolloutClient] = []
        opened: list[RolloutClient] = []
        try:
            for client in self.clients:
                client.pause()
                paused.append(client)
                if not self._stale_closed:  # only an earlier trainer (one that died mid-update) can leave one open
                    client.collective_rpc("megarl_end_stale_update")
                client.start_weight_update()
                opened.append(client)
        except Exception as err:  # noqa: BLE001 - returned, then raised on every trainer rank
            for client in opened:
                _best_effort(lambda c=client: c.finish_weight_update(None))  # closes the session, label unchanged
            for client in paused:
                _best_effort(client.resume)
            return f"could not start the update: {type(err).__name__}: {err}"
        self._stale_closed = True
        return None

    def start_updates(self, infos: list[list[dict[str, Any]]]) -> list[ResultThread]:
        """One `/update_weights` call per replica, each in a thread (it returns once its workers have received,
        checked and loaded their blocks); `infos[i]` holds replica i's update info per TP rank."""
        threads = []
        for client, info in zip(self.clients, infos, strict=True):
            threads.append(ResultThread(lambda c=client, info=info: c.update_weights(info)))
            threads[-1].start()
        return threads

    def close(self, updates: list[ResultThread], version: int,
              update_id: str) -> tuple[list[dict[str, Any]], str | None]:
        """Read each replica's worker reports; label a replica whose workers all loaded the update
        with `version`, close the session of one that refused it without a new label; resume generation on
        every replica except one whose loaders failed part-way (it may hold mixed weights: it stays paused).
        Returns the reports and what failed, naming what each failed replica serves now (None if nothing did)."""
        reports: list[dict[str, Any]] = []
        failures = []
        for rep, (client, thread) in enumerate(zip(self.clients, updates, strict=True)):
            thread.join()
            mixed = False
            try:
                if thread.error is not None:  # the RPC itself failed (vLLM closed the session): old weights serve
                    raise thread.error
                replica_reports = client.collective_rpc("megarl_sync_report")
                errors = _report_errors(replica_reports, update_id)
                mixed = any(r.get("model_state") == "mixed" for r in replica_reports)
                client.finish_weight_update(None if errors else version)
                if errors:
                    raise UpdateRefused(errors)
                reports += replica_reports
            except Exception as err:  # noqa: BLE001 - reported on every trainer rank
                if mixed:
                    after = ("it may hold a mix of old and new weights, so it is left paused and serves nothing until "
                             "a later push loads completely or it is restarted")
                elif not isinstance(err, UpdateRefused) and not _still_serving(client):
                    after = ("its server, engine or a worker died (vLLM shuts the whole engine down when a worker "
                             "dies): it serves nothing until it is restarted")
                else:
                    after = "it keeps serving its previous weights"
                failures.append(f"replica {rep} ({client.url}): {type(err).__name__}: {err} ({after})")
            finally:
                if not mixed:
                    _best_effort(client.resume)
        return reports, "; ".join(failures) if failures else None
