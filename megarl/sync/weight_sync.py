"""Trainer side of the partitioned weight sync.

Every trainer rank constructs a `PartitionedWeightSync` and calls `push(local_slices, version)`
together (a collective over the trainer ranks). Rank 0 also drives the fleet over HTTP:

    rank 0:  /pause -> /start_weight_update on every replica; broadcast go / no-go to the trainer ranks
    rank 0:  /update_weights (each TP worker's part of the plan), one thread per replica ...
    every trainer rank: send its planned blocks, bucketed, point-to-point to the vLLM workers
    rank 0:  ... /update_weights returns (workers received, agreed, loaded or refused)
             -> /collective_rpc megarl_sync_report (outcome, bytes received / read by loaders)
             -> /finish_weight_update(version), or (None) to close a refused update unlabelled -> /resume
    all:     all-gather bytes sent; rank 0 broadcasts the outcome, a failure is raised on every rank

The plan is built once (shapes never change): trainer ranks all-gather *metadata* of the blocks
they hold, `plan_transfers` assigns each block a vLLM worker needs to one sender.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megarl.rollout.client import RolloutClient, RolloutServerError
from megarl.sync.plan import plan_transfers, vllm_rank_slices
from megarl.sync.slices import HFSlice
from megarl.sync.stream import send_buckets
from megarl.sync.transport import WireEntry, layout_buckets, make_sync_group


class WeightSyncError(RuntimeError):
    """A weight sync failed; raised on every trainer rank. Its message names each failed replica and what it serves
    now: its previous weights (the update was refused before its model was touched), or nothing (its loaders
    failed part-way: it stays paused until a later push loads completely or it is restarted)."""


@dataclass
class SyncStats:
    """Accounting of one push. vLLM workers are keyed by their sync-group rank `T + replica*tp + tp_rank`."""

    version: int
    seconds: float  # wall time of the whole push on this trainer rank (plan on first use, HTTP lifecycle, sends)
    bytes_sent: dict[int, int]  # trainer rank -> bytes it sent
    staging_peak_bytes: dict[int, int] = field(default_factory=dict)  # trainer rank -> most send-bucket bytes at once
    bytes_received: dict[int, int] = field(default_factory=dict)  # vLLM worker -> bytes it received (its report)
    bytes_read_by_loaders: dict[int, int] = field(default_factory=dict)  # vLLM worker -> bytes its loaders read
    bytes_needed: dict[int, int] = field(default_factory=dict)  # vLLM worker -> bytes of the slices it holds
    reports: list[dict[str, Any]] = field(default_factory=list)  # the workers' own reports
    # where the push's seconds went (rank 0's clock unless said): plan_s (first push only), open_s (pause and open
    # every replica), send_s (the slowest trainer rank's sends), close_s (wait for the workers to receive and
    # load, read their reports, label, resume), fleet_paused_s (first /pause to last /resume), worker_receive_s
    # and worker_load_s (the slowest vLLM worker's receive and vLLM reload, from its report)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Effective bandwidth: all bytes sent over the push's wall time, in GB/s."""
        return sum(self.bytes_sent.values()) / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def receive_ratio(self) -> dict[int, float]:
        """Per vLLM worker: bytes received / bytes of its own slices (1.0 = nothing redundant was moved)."""
        return {r: self.bytes_received[r] / need for r, need in self.bytes_needed.items() if r in self.bytes_received}


class _Thread(threading.Thread):
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


class PartitionedWeightSync:
    """The trainer's end of the sync group. Construct it on every trainer rank (a collective: rank 0 asks
    every rollout server to join the group, hosts its TCPStore at `store_host:store_port` and drives the
    fleet with `clients`, one per replica; other ranks pass no clients), then call `push` on every rank.

    `hf_config` is the rollout model's HF config (it decides what each vLLM TP rank holds); `bucket_bytes`
    bounds one point-to-point message; `digests` makes the workers report sha256 digests (tests)."""

    def __init__(self, rank: int, world_size: int, hf_config: dict[str, Any], clients: list[RolloutClient],
                 rollout_tp: int, rollout_replicas: int, store_host: str, store_port: int, bucket_bytes: int,
                 timeout_s: float = 600.0, digests: bool = False) -> None:
        self.rank, self.trainers, self.hf = rank, world_size, hf_config
        self.clients, self.tp, self.replicas = clients, rollout_tp, rollout_replicas
        self.bucket_bytes, self.digests = bucket_bytes, digests
        self.fail_loading_after: int | None = None  # failure injection (tests): the workers' loaders raise after N
        self.sync_world = world_size + rollout_replicas * rollout_tp
        self.entries: list[WireEntry] | None = None
        self.bytes_needed: dict[int, int] = {}
        inits = []
        if rank == 0:
            if len(clients) != rollout_replicas:
                raise ValueError(f"{len(clients)} rollout clients for {rollout_replicas} replicas")
            for client in clients:  # a dead or unguarded-key server fails here, not in the group's rendezvous
                client.weight_version()
            for i, client in enumerate(clients):
                info = {"host": store_host, "port": store_port, "world_size": self.sync_world,
                        "rank_offset": world_size + i * rollout_tp, "timeout_s": timeout_s}
                inits.append(_Thread(lambda c=client, info=info: c.init_weight_transfer(info)))
                inits[-1].start()
        self.store, self.group = make_sync_group(store_host, store_port, rank, self.sync_world, timeout_s)
        for t in inits:
            t.join_or_raise()

    def worker_rank(self, replica: int, tp_rank: int) -> int:
        """Sync-group rank of TP rank `tp_rank` of replica `replica`."""
        return self.trainers + replica * self.tp + tp_rank

    def _plan(self, local: list[tuple[HFSlice, torch.Tensor]]) -> list[WireEntry]:
        """All-gather what every trainer rank holds (metadata only), plan who sends what, lay out buckets."""
        meta = ([b for b, _ in local], {b.name: t.dtype for b, t in local})
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, meta)
        holdings = {r: blocks for r, (blocks, _) in enumerate(gathered)}
        dtypes = {k: v for _, d in gathered for k, v in d.items()}
        needs = {self.worker_rank(rep, r): vllm_rank_slices(self.hf, self.tp, r)
                 for rep in range(self.replicas) for r in range(self.tp)}
        missing = sorted({b.name for blocks in needs.values() for b in blocks} - set(dtypes))
        if missing:
            raise WeightSyncError(f"no trainer rank holds {missing[:5]} ({len(missing)} HF tensors): the trainer's "
                                  "model does not match the rollout model's config")
        self.bytes_needed = {r: sum(b.numel * dtypes[b.name].itemsize for b in blocks) for r, blocks in needs.items()}
        return layout_buckets(plan_transfers(holdings, needs), dtypes, self.bucket_bytes)

    def push(self, local_slices: Iterable[tuple[HFSlice, torch.Tensor]], version: int) -> SyncStats:
        """Push new weights labelled `version` (collective over the trainer ranks; see the module docstring).

        `local_slices` are this rank's `(HFSlice, tensor)` pairs. Raises `WeightSyncError` on every rank if
        the fleet could not take the update (see `WeightSyncError` for what the failed replicas serve)."""
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        local = list(local_slices)
        if self.entries is None:
            self.entries = self._plan(local)
        phases = {"plan_s": lap()}
        self._raise_everywhere(self._open_fleet_update() if self.rank == 0 else None, version)
        phases["open_s"] = lap()
        update_id = uuid.uuid4().hex
        updates = self._start_transfers(version, update_id) if self.rank == 0 else []
        sent = send_buckets(self.group, self.rank, self.entries, local)
        phases["send_s"] = lap()
        reports, failure = self._close_fleet_update(updates, version, update_id) if self.rank == 0 else ([], None)
        phases["close_s"] = lap()
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, (sent.bytes_sent, sent.peak_staging_bytes, phases["send_s"]))
        self._raise_everywhere(failure, version)
        phases["send_s"] = max(g[2] for g in gathered)  # the slowest sender
        # rank 0 pauses the fleet at the start of `open` and resumes it at the end of `close`
        phases["fleet_paused_s"] = clock[4] - clock[1]
        for key in ("receive_seconds", "load_seconds"):  # the workers' own figures: the slowest worker
            phases[f"worker_{key.removesuffix('onds')}"] = max((r.get(key, 0.0) for r in reports), default=0.0)
        return SyncStats(
            version=version, seconds=time.perf_counter() - clock[0],
            bytes_sent={r: g[0] for r, g in enumerate(gathered)},
            staging_peak_bytes={r: g[1] for r, g in enumerate(gathered)},
            bytes_received={r["rank"]: r["bytes_received"] for r in reports},
            bytes_read_by_loaders={r["rank"]: r["bytes_read_by_loaders"] for r in reports},
            bytes_needed=dict(self.bytes_needed), reports=reports, phases=phases,
        )

    def _raise_everywhere(self, failure: str | None, version: int) -> None:
        """Rank 0 tells every trainer rank whether the fleet failed; all of them raise the same error."""
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise WeightSyncError(f"weight sync to version {version} failed: {box[0]}")

    def _open_fleet_update(self) -> str | None:
        """Rank 0: pause every replica and open its update session; on failure undo it and return why."""
        paused: list[RolloutClient] = []
        opened: list[RolloutClient] = []
        try:
            for client in self.clients:
                client.pause()
                paused.append(client)
                client.start_weight_update()
                opened.append(client)
        except Exception as err:  # noqa: BLE001 - returned, then raised on every trainer rank
            for client in opened:
                _best_effort(lambda c=client: c.finish_weight_update(None))  # closes the session, label unchanged
            for client in paused:
                _best_effort(client.resume)
            return f"could not start the update: {type(err).__name__}: {err}"
        return None

    def _start_transfers(self, version: int, update_id: str) -> list[_Thread]:
        """Rank 0: one `/update_weights` call per replica, each in a thread (it returns once its workers
        have received, checked and loaded their blocks), carrying each TP rank's part of the plan."""
        threads = []
        for rep, client in enumerate(self.clients):
            info = [{"version": version, "update_id": update_id, "digests": self.digests,
                     "fail_loading_after": self.fail_loading_after,
                     "entries": [e.to_json() for e in self.entries or [] if e.receiver == self.worker_rank(rep, r)]}
                    for r in range(self.tp)]
            threads.append(_Thread(lambda c=client, info=info: c.update_weights(info)))
            threads[-1].start()
        return threads

    def _close_fleet_update(self, updates: list[_Thread], version: int,
                            update_id: str) -> tuple[list[dict[str, Any]], str | None]:
        """Rank 0: read each replica's worker reports; label a replica whose workers all loaded the update
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
                    raise WeightSyncError(errors)
                reports += replica_reports
            except Exception as err:  # noqa: BLE001 - reported on every trainer rank
                after = ("it may hold a mix of old and new weights, so it is left paused and serves nothing until a "
                         "later push loads completely or it is restarted" if mixed
                         else "it keeps serving its previous weights")
                failures.append(f"replica {rep} ({client.url}): {type(err).__name__}: {err} ({after})")
            finally:
                if not mixed:
                    _best_effort(client.resume)
        return reports, "; ".join(failures) if failures else None

    def close(self) -> None:
        """Drop this rank's handles on the sync group (the store closes with the last handle)."""
        self.group, self.store = None, None
