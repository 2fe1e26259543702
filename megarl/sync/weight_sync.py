"""Trainer side of the partitioned weight sync.

Every trainer rank constructs a `PartitionedWeightSync` and calls `push(local_slices, version)`
together (a collective over the trainer ranks). Rank 0 also drives the fleet over HTTP
(`megarl.sync.lifecycle`); the bytes move through a `megarl.sync.transport.Transport`:

    rank 0:  /pause -> /start_weight_update on every replica; broadcast go / no-go to the trainer ranks
    rank 0:  /update_weights (each TP worker's part of the plan), one thread per replica ...
    every trainer rank: send its planned blocks, bucketed, point-to-point to the vLLM workers
    rank 0:  ... /update_weights returns (workers received, agreed, loaded or refused)
             -> /collective_rpc megarl_sync_report (outcome, bytes received / read by loaders)
             -> /finish_weight_update(version), or (None) to close a refused update unlabelled -> /resume
    all:     all-gather bytes sent; rank 0 broadcasts the outcome, a failure is raised on every rank

A trainer rank whose send raises closes its sync-group connections at once (the workers waiting for its buckets
refuse the update instead of waiting for the group's timeout) and still takes part in the collectives, so every
rank raises naming it; a collective that fails because a trainer rank died raises saying whether the sync store
(hosted by rank 0) still answers (`docs/sync.md`, "When an update is refused").

The plan is built once (shapes never change): trainer ranks all-gather *metadata* of the blocks
they hold, `plan_transfers` assigns each block a vLLM worker needs to one sender. What each vLLM worker
needs is obtained once, in the constructor (`megarl.sync.needs`): by default recorded by the fleet from vLLM's
own loaders.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from megarl.rollout.client import RolloutClient
from megarl.rollout.inflight import InflightKV
from megarl.schedule import VersionClock
from megarl.sync.delta import BlockCount, SenderBase, block_key, delta_layout, encode, takes_delta
from megarl.sync.group_timeout import push_link_bytes, sync_group_timeout_s
from megarl.sync.heartbeat import BeatWatch, beat_key
from megarl.sync.lifecycle import FleetLifecycle
from megarl.sync.needs import NeedsSource, RolloutNeeds, table_needs
from megarl.sync.plan import plan_transfers
from megarl.sync.slices import HFSlice
from megarl.sync.stream import SendResult, cut, holders_by_name, raw_bytes
from megarl.sync.transport import ReplicaGroupsTransport
from megarl.sync.wire import WireEntry, layout_buckets

logger = logging.getLogger(__name__)

ReceiveMode = Literal["staged", "streamed"]  # sync.receive (megarl.config.schema.SyncConfig)


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
    replicas: list[int] = field(default_factory=list)  # the replicas this push updated (those in the sync)
    lost: dict[int, str] = field(default_factory=dict)  # replicas out of the sync after this push -> why
    served: dict[int, str | None] = field(default_factory=dict)  # replica -> the version label it reports after
    # this push (rank 0 asks each replica in the sync; None: it did not answer)
    # sync.delta: vLLM worker -> (elements changed, elements) of the blocks it took as a delta (absent: full push)
    delta: dict[int, tuple[int, int]] = field(default_factory=dict)
    sender_base_bytes: dict[int, int] = field(default_factory=dict)  # trainer rank -> host bytes of its delta base
    # sync.inflight (rank 0): the groups (home batch, prompt) with a response that held output tokens at this push's
    # pause, so that its tokens come from two versions (`FleetLifecycle.held_groups`)
    held_groups: list[tuple[int, int]] = field(default_factory=list)
    # sync.inflight (rank 0): the request ids of those responses (`FleetLifecycle.held_requests`): the rollout worker
    # bounds each one's oldest token version by them (`RolloutWorker.pushed`)
    held_requests: list[str] = field(default_factory=list)
    # where the push's seconds went (rank 0's clock unless said): needs_s (first push only: obtaining the vLLM
    # ranks' needs, i.e. the fleet's loader-read recording, done once per run in the constructor), plan_s (first
    # push only), open_s (pause and open
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


class PartitionedWeightSync:
    """The trainer's end of the sync group. Construct it on every trainer rank (a collective: rank 0 asks
    every rollout server to join the group, hosts its TCPStore at `store_host:store_port` and drives the
    fleet with `clients`, one per replica; other ranks pass no clients), then call `push` on every rank.

    `hf_config` is the rollout model's HF config (it decides what each vLLM TP rank holds); `bucket_bytes`
    bounds one point-to-point message; `digests` makes the workers report sha256 digests (tests); `receive` is how
    the vLLM workers take each push (`sync.receive`: "staged", all or nothing, or "streamed", loaded as it arrives
    in bounded memory), sent with every update; `delta` (`sync.delta`): send a replica that holds the previous
    version only the elements that changed (`megarl.sync.delta`); `wire_dtype` (`rollout.dtype`): the dtype the
    fleet serves, each block is cast to it before it is sent (None: sent as the trainer holds it);
    `group_timeout` (`sync.timeout_min_gbps`, `sync.timeout_fixed_s`): on NCCL the sync groups' operations time out
    after that many seconds for the busiest link's bytes of a full push (`megarl.sync.group_timeout`; None:
    `timeout_s`, as gloo groups always do); on any transport that bound is also each HTTP call of a push to a
    replica (/update_weights, its RPCs: `FleetLifecycle.call_timeout_s`; None: the clients' own timeout), and a
    replica that does not answer one within it while its /health answers is failed for the push and handed to
    `condemn(replica, why)` (the trainer's `Roster.condemn`: its launcher kills and restarts it); `silent_s`
    (`rollout.health_timeout_s`): a replica one of whose workers sends no heartbeat for that long during its update
    call is failed and condemned the same way at once (`megarl.sync.heartbeat`; None: only the bound);
    `inflight`, `inflight_kv` (`sync.inflight`, `sync.inflight_kv`): the replicas are paused in vLLM's keep mode, so
    requests in flight are held through the push instead of waited for (`megarl.rollout.inflight`); `clock` (rank 0):
    the run's `megarl.schedule.VersionClock`, told as each replica is paused for a push (`FleetLifecycle`)."""

    def __init__(self, rank: int, world_size: int, hf_config: dict[str, Any], clients: list[RolloutClient],
                 rollout_tp: int, rollout_replicas: int, store_host: str, store_port: int, bucket_bytes: int,
                 timeout_s: float = 600.0, digests: bool = False, needs: NeedsSource = "recorded",
                 receive: ReceiveMode = "staged", delta: bool = False, wire_dtype: torch.dtype | None = None,
                 min_replicas: int | None = None, rejoin_timeout_s: float | None = None,
                 group_timeout: tuple[float, float] | None = None,
                 condemn: Callable[[int, str], None] | None = None, silent_s: float | None = None,
                 inflight: bool = False, inflight_kv: InflightKV = "recompute",
                 clock: VersionClock | None = None) -> None:
        self.rank, self.trainers, self.hf = rank, world_size, hf_config
        self.clients, self.tp, self.replicas = clients, rollout_tp, rollout_replicas
        self.bucket_bytes, self.digests, self.receive = bucket_bytes, digests, receive
        if delta and receive != "staged":
            raise ValueError("sync.delta needs sync.receive=staged (a streamed receiver keeps no base to apply a "
                             "delta to)")
        self.base = SenderBase() if delta else None  # sync.delta: the blocks this rank last sent, their version
        self.wire_dtype = wire_dtype  # rollout.dtype: blocks are cast to it before sending (None: as held)
        self.store_host, self.store_port = store_host, store_port
        self.broken: str | None = None  # why this sync group is unusable (a trainer rank failed while sending)
        self.fail_loading_after: int | None = None  # failure injection (tests): the workers' loaders raise after N
        self.sync_world = world_size + rollout_replicas * rollout_tp
        self.timeout_s = timeout_s
        self.silent_s = silent_s  # rollout.health_timeout_s: how long a worker may send no heartbeat during a push
        # sync.rejoin_timeout_s: how long `admit` waits for a restarted replica's workers (None: timeout_s)
        self.rejoin_timeout_s = timeout_s if rejoin_timeout_s is None else rejoin_timeout_s
        # rollout.min_replicas: fewest replicas a push may leave in the sync (None: every replica, any loss fails)
        self.min_replicas = rollout_replicas if min_replicas is None else min_replicas
        self.live: list[int] = list(range(rollout_replicas))  # replicas in the sync, the same on every trainer rank
        self.lost: dict[int, str] = {}  # replicas left out since they stopped answering -> why (every trainer rank)
        self.entries: list[WireEntry] | None = None
        self.bytes_needed: dict[int, int] = {}
        self.pushes = 0  # pushes that reached the byte moving, counted on every trainer rank alike
        self.fleet = FleetLifecycle(clients, rollout_tp, condemn=condemn, inflight=inflight,
                                    inflight_kv=inflight_kv, clock=clock) if rank == 0 else None
        if self.fleet is not None and len(clients) != rollout_replicas:
            raise ValueError(f"{len(clients)} rollout clients for {rollout_replicas} replicas")
        self.needs = self._obtain_needs(needs)
        self._needs_reported = False  # the first push reports what obtaining the needs cost (`needs_s`)
        self.op_timeout_s = None if group_timeout is None else sync_group_timeout_s(self._push_link_bytes(),
                                                                                    *group_timeout)
        if self.fleet is not None:  # the push's bound on each of its HTTP calls (None: the clients' timeout)
            self.fleet.call_timeout_s = self.op_timeout_s
        self.transport = ReplicaGroupsTransport(store_host, store_port, rank, world_size, rollout_tp, timeout_s,
                                                op_timeout_s=self.op_timeout_s)
        groups = {rep: self.transport.next_prefix(rep) for rep in self.live}
        joins = self._join_threads(groups)
        for rep in groups:
            self.transport.join(rep)
        for t in joins.values():
            t.join_or_raise()

    def _push_link_bytes(self) -> int:
        """The busiest link's bytes in a full push (`megarl.sync.group_timeout.push_link_bytes`), from the vLLM ranks'
        needs at the wire dtype's size (fp32 when blocks go as held)."""
        itemsize = (self.wire_dtype or torch.float32).itemsize
        worker = [sum(b.numel for b in self.needs.reads[k]) * itemsize for k in sorted(self.needs.reads)]
        return push_link_bytes(worker, self.replicas, self.trainers)

    def require_min_replicas(self, version: int) -> None:
        """Every trainer rank (they agree on `live`): raise `WeightSyncError` if fewer than `min_replicas` replicas
        are in the sync."""
        if len(self.live) < self.min_replicas:
            lost = "; ".join(why for _, why in sorted(self.lost.items())) or "none lost"
            raise WeightSyncError(f"weight sync to version {version}: {len(self.live)} replica(s) in the sync, fewer "
                                  f"than rollout.min_replicas={self.min_replicas} (lost: {lost}); resume from the last "
                                  "checkpoint once the fleet is back")

    def _join_threads(self, groups: dict[int, str], timeout_s: float | None = None) -> dict[int, Any]:
        """Rank 0: ask the replicas in `groups` (replica -> its group's prefix) to join, their groups with
        `timeout_s` (default `timeout_s`); the threads to join after."""
        if self.fleet is None:
            return {}
        return self.fleet.join(groups, self.store_host, self.store_port, self.trainers, self.replicas,
                               self.timeout_s if timeout_s is None else timeout_s, self.needs, self.op_timeout_s)

    def _leave(self, lost: dict[int, str]) -> None:
        """Every trainer rank, with the same `lost` (replica -> why): those replicas leave the sync (their groups
        are dropped, later pushes skip them)."""
        for rep, why in lost.items():
            if rep in self.live:
                self.live.remove(rep)
                self.lost[rep] = why
                self.transport.leave(rep)
                if self.fleet is not None:
                    self.fleet.leave(rep)

    def admit(self, clients: dict[int, RolloutClient]) -> list[int]:
        """Collective over the trainer ranks: let restarted replicas back into the sync (rank 0 passes their
        clients, replica -> client; the other ranks pass {}). Each joins a new group of its own; the next push sends
        it the whole model (it holds no delta base) and it is in `live` from then on. A replica that fails to join
        (it died again, or its workers did not arrive within `rejoin_timeout_s`) stays out, to be asked again at the
        next push point; the trainer ranks wait at most that long for it. Returns the replicas let in."""
        box: list[Any] = [sorted(clients) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        asked = [rep for rep in box[0] if rep not in self.live]
        if not asked:
            return []
        groups = {rep: self.transport.next_prefix(rep) for rep in asked}
        failed: dict[int, str] = {}
        threads = {}
        if self.fleet is not None:
            for rep in asked:
                try:  # a server that does not answer stays out; the others join
                    clients[rep].weight_version()
                except Exception as err:  # noqa: BLE001 - named in the warning below
                    failed[rep] = f"{type(err).__name__}: {err}"
                    continue
                self.fleet.clients[rep] = clients[rep]
            try:
                threads = self._join_threads({rep: g for rep, g in groups.items() if rep not in failed},
                                             self.rejoin_timeout_s)
            except Exception as err:  # noqa: BLE001 - it died since: it stays out with the others
                failed |= {rep: f"{type(err).__name__}: {err}" for rep in asked if rep not in failed}
        box = [failed]
        dist.broadcast_object_list(box, src=0)
        failed = dict(box[0])
        for rep in asked:
            if rep in failed:
                continue
            try:
                self.transport.join(rep, self.rejoin_timeout_s)
            except Exception as err:  # noqa: BLE001 - the same on every trainer rank: agreed below
                failed[rep] = f"{type(err).__name__}: {err}"
        for rep, thread in threads.items():
            thread.join()
            if thread.error is not None:
                failed.setdefault(rep, f"{type(thread.error).__name__}: {thread.error}")
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, failed)
        failed = {rep: why for g in gathered for rep, why in g.items()}
        for rep in asked:
            if rep in failed:
                self.transport.leave(rep)
                if self.fleet is not None:
                    self.fleet.leave(rep)
                    logger.warning("rollout replica %d could not rejoin the weight sync: %s", rep, failed[rep])
            else:
                self.live.append(rep)
                self.lost.pop(rep, None)
        self.live.sort()
        return [rep for rep in asked if rep not in failed]

    def _obtain_needs(self, source: NeedsSource) -> RolloutNeeds:
        """Rank 0 records (or takes from the table) what every vLLM TP rank needs and hands it to every trainer rank;
        a failure is raised on every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = table_needs(self.hf, self.tp) if source == "table" else self.fleet.record_needs()
            except Exception as err:  # noqa: BLE001 - raised on every trainer rank below
                box[0] = f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise WeightSyncError(f"cannot plan the weight sync: {box[0]}")
        if self.rank == 0:
            logger.info("vLLM ranks' needs (%s, layout %s) obtained in %.2f s", box[0].source, box[0].key,
                        box[0].seconds)
        return box[0]

    def replica_of(self, worker: int) -> int:
        """The replica of the vLLM worker at sync-group rank `worker`."""
        return (worker - self.trainers) // self.tp

    def worker_rank(self, replica: int, tp_rank: int) -> int:
        """Sync-group rank of TP rank `tp_rank` of replica `replica`."""
        return self.trainers + replica * self.tp + tp_rank

    def _plan(self, local: list[tuple[HFSlice, torch.Tensor]]) -> list[WireEntry]:
        """All-gather what every trainer rank holds (metadata only), plan who sends what, lay out buckets."""
        meta = ([b for b, _ in local], {b.name: t.dtype for b, t in local})
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, meta)
        holdings = {r: blocks for r, (blocks, _) in enumerate(gathered)}
        dtypes = {k: self.wire_dtype or v for _, d in gathered for k, v in d.items()}
        needs = {self.worker_rank(rep, r): self.needs.reads[r] for rep in range(self.replicas) for r in range(self.tp)}
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

        if self.broken is not None:  # known on every trainer rank, so every rank raises here
            raise WeightSyncError(f"this sync group is unusable since an earlier push failed ({self.broken}): a later "
                                  "push needs a new PartitionedWeightSync (a new sync group)")
        local = list(local_slices)
        if self.entries is None:
            self.entries = self._plan(local)
        phases = {"plan_s": lap()}
        if not self._needs_reported:  # recorded once per run, before the first push (in the constructor)
            phases["needs_s"] = self.needs.seconds
            self._needs_reported = True
        with self._trainer_ranks_answer(version):
            failure, lost = self.fleet.open(version) if self.fleet else (None, {})
            if self.fleet is not None and lost and len(set(self.live) - set(lost)) < self.min_replicas:
                self.fleet.abort_open(lost)  # the push will not happen: the survivors serve on, unchanged
            self._raise_everywhere(failure, version)
            self.leave_replicas(lost, version)
        phases["open_s"] = lap()
        try:
            stats = self._push_open(local, version, phases, clock, lap)
        except BaseException:
            if self.base is not None:  # what each replica holds is not known: the next push is a full one
                self.base.invalidate()
            raise
        if self.base is not None:
            stats.phases["delta_store_s"] = self._keep_base(local, version)
            stats.sender_base_bytes = self._gather_int(self.base.nbytes)
            stats.seconds = time.perf_counter() - clock[0]
        return stats

    def _push_open(self, local: list[tuple[HFSlice, torch.Tensor]], version: int, phases: dict[str, float],
                   clock: list[float], lap) -> SyncStats:
        """The push once every replica is paused and open: deltas counted, update infos sent, bytes moved, fleet
        closed, outcome raised everywhere."""
        live = set(self.live)
        entries, delta_base = [e for e in self.entries or [] if self.replica_of(e.receiver) in live], None
        receivers = self._delta_receivers()
        if receivers:
            entries, delta_base = self._delta_entries(local, entries, receivers), self.base.version
        phases["delta_count_s"] = lap()
        update_id = uuid.uuid4().hex
        self.pushes += 1  # every trainer rank: this push's keys in the sync store (`_failed_key`, `beat_key`)
        store, push = self.transport.store, self.pushes
        infos = self._update_infos(version, update_id, entries, receivers, delta_base)
        updates = self.fleet.start_updates(
            infos, on_fail=lambda rep, why: store.set(_failed_key(push, rep), why),
            silent=self._silent_watch(store, push)) if self.fleet else {}
        send_error = None
        try:
            sent = self.transport.send(entries, local, self._pack,
                                       gone=lambda worker: _update_failed(store, push, self.replica_of(worker)))
        except Exception as err:  # noqa: BLE001 - this rank still reports it and takes part in the collectives
            sent, send_error = SendResult(bytes_sent=0, buckets=0, peak_staging_bytes=0), f"{type(err).__name__}: {err}"
            logger.error("trainer rank %d failed while sending the weight sync to version %d: %s", self.rank,
                         version, send_error)
        if send_error is not None:  # outside the handler, whose traceback still held the group
            self._leave_sync_group(f"trainer rank {self.rank} failed while sending")
        phases["send_s"] = lap()
        reports, failures, dead = self.fleet.close(updates, version, update_id) if self.fleet else ([], {}, set())
        box: list[Any] = [{rep: failures[rep] for rep in dead}]  # replicas that died during this push
        with self._trainer_ranks_answer(version):
            dist.broadcast_object_list(box, src=0)
        dead_now: dict[int, str] = box[0]
        failure = "; ".join(why for rep, why in sorted(failures.items()) if rep not in dead_now) or None
        phases["close_s"] = lap()
        gathered: list[Any] = [None] * self.trainers
        with self._trainer_ranks_answer(version):
            dist.all_gather_object(gathered, (sent.bytes_sent, sent.peak_staging_bytes, phases["send_s"],
                                              sent.failed, send_error))
        senders = [f"trainer rank {r} failed while sending: {g[4]} (it closed its connections, so the vLLM workers "
                   "waiting for its buckets refused the update)" for r, g in enumerate(gathered) if g[4]]
        unreachable = [f"trainer rank {r} could not send to vLLM worker {w} (replica {self.replica_of(w)}): {why}"
                       for r, g in enumerate(gathered) for w, why in sorted(g[3].items())
                       if self.replica_of(w) not in dead_now]  # a replica that died: said once, by `dead_now`
        if senders and self.broken is None:  # its connections to the workers are gone: the group is unusable
            self._leave_sync_group(senders[0])
        if senders or unreachable:  # a sender failed, or a worker (or its server) died mid-update
            failure = "; ".join([*senders, *([failure] if failure else []), *unreachable])
        with self._trainer_ranks_answer(version):
            self._raise_everywhere(failure, version)
        self.leave_replicas(dead_now, version, known=True)
        phases["send_s"] = max(g[2] for g in gathered)  # the slowest sender
        # rank 0 pauses the fleet at the start of `open` and resumes it at the end of `close`
        phases["fleet_paused_s"] = clock[5] - clock[1]
        for key, phase in (("receive_seconds", "worker_receive_s"), ("load_seconds", "worker_load_s")):
            phases[phase] = max((r.get(key, 0.0) for r in reports), default=0.0)  # the workers' own: the slowest
        return SyncStats(
            version=version, seconds=time.perf_counter() - clock[0], replicas=list(self.live),
            lost=dict(self.lost), served=self.fleet.served() if self.fleet is not None else {},
            held_groups=self.fleet.held_groups() if self.fleet is not None else [],
            held_requests=self.fleet.held_requests() if self.fleet is not None else [],
            bytes_sent={r: g[0] for r, g in enumerate(gathered)},
            staging_peak_bytes={r: g[1] for r, g in enumerate(gathered)},
            bytes_received={r["rank"]: r["bytes_received"] for r in reports},
            bytes_read_by_loaders={r["rank"]: r["bytes_read_by_loaders"] for r in reports},
            bytes_needed={w: n for w, n in self.bytes_needed.items() if self.replica_of(w) in live},
            reports=reports, phases=phases,
            delta={w: (sum(e.changed for e in entries if e.receiver == w),
                       sum(e.block.numel for e in entries if e.receiver == w)) for w in receivers},
        )

    def leave_replicas(self, lost: dict[int, str], version: int, known: bool = False, bound: bool = True) -> None:
        """Collective over the trainer ranks: rank 0's `lost` replicas (replica -> why, each naming its replica
        and URL) leave the sync on every rank (`known`: every rank passes them already); with fewer than
        `min_replicas` left, every rank raises `WeightSyncError` naming them (`version`: the push it is part of;
        `bound=False`: the caller checks later, `require_min_replicas`, e.g. after restarted replicas rejoin)."""
        if not known:
            box: list[Any] = [lost]
            dist.broadcast_object_list(box, src=0)
            lost = box[0]
        if not lost:
            return
        self._leave(lost)
        names = "; ".join(why for _, why in sorted(lost.items()))  # each names its replica and URL
        if bound and len(self.live) < self.min_replicas:
            raise WeightSyncError(f"weight sync to version {version} failed: {names}; {len(self.live)} replica(s) "
                                  f"left, fewer than rollout.min_replicas={self.min_replicas} (resume from the last "
                                  "checkpoint once the fleet is back)")
        if self.rank == 0:
            logger.warning("weight sync to version %d goes on without a replica that stopped answering or was given "
                           "up (%s): %d replica(s) left in the sync; a restarted one rejoins at a later push", version,
                           names, len(self.live))



    def _delta_receivers(self) -> set[int]:
        """The vLLM workers this push sends deltas to (collective): every worker of each replica whose workers all
        report holding the senders' base version (`megarl_delta_base`); a replica that is new, restarted, failed a
        push or does not answer the question gets a full push."""
        if self.base is None:  # sync.delta off, on every rank
            return set()
        box: list[Any] = [set()]
        if self.rank == 0 and self.base.version is not None:
            for rep, client in self.fleet.clients.items():
                try:
                    reports = client.collective_rpc("megarl_delta_base")
                except Exception as err:  # noqa: BLE001 - a full push is always correct
                    logger.warning("replica %d did not say which version its delta base holds (%s): full push",
                                   rep, err)
                    continue
                if takes_delta(reports, self.base.version):
                    box[0] |= {self.worker_rank(rep, r) for r in range(self.tp)}
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _delta_entries(self, local: list[tuple[HFSlice, torch.Tensor]], planned: list[WireEntry],
                       receivers: set[int]) -> list[WireEntry]:
        """Every sender counts the changed elements of the blocks it sends to `receivers` (once per block), the
        counts are all-gathered, and every rank lays out the same delta wire (`megarl.sync.delta.delta_layout`)."""
        by_name = holders_by_name(local)
        mine: dict[Any, BlockCount] = {}
        for e in planned:
            key = block_key(e.block)
            if e.sender == self.rank and e.receiver in receivers and key not in mine:
                mine[key] = self.base.count(e.block, self._wire(cut(by_name, e.block)))
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, mine)
        counts = {k: v for g in gathered for k, v in g.items()}
        return delta_layout(planned, receivers, counts, self.bucket_bytes)

    def _wire(self, block: torch.Tensor) -> torch.Tensor:
        """`block` in the wire dtype (itself when it already is)."""
        return block if self.wire_dtype is None else block.to(self.wire_dtype)

    def _pack(self, entry: WireEntry, block: torch.Tensor) -> torch.Tensor:
        """An entry's wire bytes: raw (in the wire dtype) for a full push's receiver, else encoded against this rank's
        base."""
        block = self._wire(block)
        if entry.encoding == "raw":
            return raw_bytes(entry, block)
        base = self.base.base_of(entry.block) if entry.encoding != "dense" else block
        return encode(block, base, entry.encoding, entry.nbytes)

    def _keep_base(self, local: list[tuple[HFSlice, torch.Tensor]], version: int) -> float:
        """After a push every replica took: keep this rank's copy of every block it sends as the next delta's base
        (the blocks were not changed while the push ran: training waits for it). Returns the seconds it took."""
        start = time.perf_counter()
        by_name = holders_by_name(local)
        mine = {block_key(e.block): e.block for e in self.entries or [] if e.sender == self.rank}
        for block in mine.values():  # once per block, however many replicas it goes to
            self.base.store(block, self._wire(cut(by_name, block)))
        self.base.version = version
        return time.perf_counter() - start

    def _gather_int(self, value: int) -> dict[int, int]:
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, value)
        return dict(enumerate(gathered))

    def _leave_sync_group(self, why: str) -> None:
        """Close this rank's connections in the sync group now: on the rank that failed while sending, the vLLM
        workers waiting for its buckets fail at once instead of at the group's timeout (the group goes with its last
        reference: gloo's abort() and shutdown() leave the sockets open); on the others, since the group lost
        that rank's connections for good. A later push raises `why`."""
        self.transport.close()
        self.broken = why
        gc.collect()

    @contextmanager
    def _trainer_ranks_answer(self, version: int) -> Iterator[None]:
        """Around a collective over the trainer ranks: if it fails (a trainer rank died), raise `WeightSyncError`
        on this rank saying so, and whether the sync store (hosted by trainer rank 0, which also drives the
        fleet) still answers; if it does not, trainer rank 0 is gone and the replicas it paused stay paused."""
        try:
            yield
        except WeightSyncError:
            raise
        except Exception as err:
            store = f"{self.store_host}:{self.store_port}"
            if self.rank != 0 and not _answers(self.store_host, self.store_port):
                where = (f"the sync store at {store} no longer answers: trainer rank 0, which hosted it and drives the "
                         "fleet, is gone (replicas it paused stay paused until a later push resumes them)")
            else:
                where = f"the sync store at {store} (hosted by trainer rank 0) still answers"
            raise WeightSyncError(f"weight sync to version {version} failed on trainer rank {self.rank}: another "
                                  f"trainer rank stopped answering ({type(err).__name__}: {err}); {where}") from err

    def _raise_everywhere(self, failure: str | None, version: int) -> None:
        """Rank 0 tells every trainer rank whether the fleet failed; all of them raise the same error."""
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise WeightSyncError(f"weight sync to version {version} failed: {box[0]}")

    def _update_infos(self, version: int, update_id: str, entries: list[WireEntry], receivers: set[int],
                      delta_base: int | None) -> dict[int, list[dict[str, Any]]]:
        """Per replica in the sync, per TP rank: the update info `/update_weights` hands that worker (its part of
        the plan)."""
        return {rep: [{"version": version, "update_id": update_id, "digests": self.digests, "receive": self.receive,
                  "fail_loading_after": self.fail_loading_after, "keep_base": self.base is not None,
                  "delta_base": delta_base if self.worker_rank(rep, r) in receivers else None,
                  "beat_key": beat_key(self.pushes, self.worker_rank(rep, r)) if self.silent_s is not None else "",
                  "replica": rep,
                  "entries": [e.to_json() for e in entries if e.receiver == self.worker_rank(rep, r)]}
                      for r in range(self.tp)] for rep in self.live}

    def _silent_watch(self, store, push: int) -> Callable[[int], str | None] | None:
        """`FleetLifecycle.start_updates`' `silent`: why a worker of a replica sent no heartbeat for `silent_s` in
        push `push`, or None (None altogether without `silent_s`)."""
        if self.silent_s is None:
            return None
        watch = BeatWatch(store, lambda worker: beat_key(push, worker), self.silent_s)

        def silent(rep: int) -> str | None:
            return next((why for r in range(self.tp) if (why := watch.silent(self.worker_rank(rep, r)))), None)

        return silent

    def close(self) -> None:
        """Leave the sync group (the store closes with the last handle)."""
        self.transport.close()


def _failed_key(push: int, replica: int) -> str:
    """The sync-store key trainer rank 0 sets, during the byte moving of push number `push`, once replica
    `replica`'s update call has failed: its workers take nothing more, so every sender stops waiting on them."""
    return f"megarl_push/{push}/replica{replica}/failed"


def _update_failed(store, push: int, replica: int) -> str | None:
    """Why replica `replica`'s update call in push `push` failed (rank 0 said so in the sync store), or None while
    it has not; a store that no longer answers (trainer rank 0, its host, is gone) counts as failed: the sends
    cannot be reported anyway."""
    key = _failed_key(push, replica)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception as err:  # noqa: BLE001 - the store's host is gone
        return f"the sync store (hosted by trainer rank 0) no longer answers: {type(err).__name__}: {err}"


def _answers(host: str, port: int, timeout_s: float = 5.0) -> bool:
    """Whether something accepts TCP connections at `host:port` (the sync store's address)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
