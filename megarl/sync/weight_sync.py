"""Trainer side of the partitioned weight sync.

Every trainer rank constructs a `PartitionedWeightSync` and calls `push(local_slices, version)`
together (a collective over the trainer ranks). Rank 0 also drives the fleet over HTTP:

    rank 0:  pause generation -> start_weight_update -> update_weights(plan per worker) [thread] ...
    every trainer rank: send its planned blocks, bucketed, point-to-point to the vLLM workers
    rank 0:  ... update_weights returns (workers received, checked and loaded) -> finish_weight_update(version)
             -> resume generation -> collect each worker's report (bytes received / read by loaders)

The plan is built once (shapes never change): trainer ranks all-gather *metadata* of the blocks
they hold, `plan_transfers` assigns each block a vLLM worker needs to one sender.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megarl.rollout.client import RolloutClient
from megarl.sync.plan import plan_transfers, vllm_rank_slices
from megarl.sync.slices import HFSlice
from megarl.sync.transport import WireEntry, device, layout_buckets, make_sync_group, to_bytes


class WeightSyncError(RuntimeError):
    pass


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes_sent: dict[int, int]  # trainer rank -> bytes it sent
    bytes_received: dict[int, int] = field(default_factory=dict)  # sync rank of a vLLM worker -> bytes
    bytes_read_by_loaders: dict[int, int] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)  # the workers' own reports

    @property
    def gbps(self) -> float:
        return sum(self.bytes_sent.values()) / self.seconds / 1e9 if self.seconds > 0 else 0.0


class _Thread(threading.Thread):
    """A thread that re-raises its exception on join."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.error = fn, None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in join
            self.error = err

    def join_or_raise(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


class PartitionedWeightSync:
    def __init__(self, rank: int, world_size: int, hf_config: dict[str, Any], clients: list[RolloutClient],
                 rollout_tp: int, rollout_replicas: int, store_host: str, store_port: int, bucket_bytes: int,
                 timeout_s: float = 600.0, digests: bool = False) -> None:
        self.rank, self.trainers, self.hf = rank, world_size, hf_config
        self.clients, self.tp, self.replicas = clients, rollout_tp, rollout_replicas
        self.bucket_bytes, self.digests = bucket_bytes, digests
        self.sync_world = world_size + rollout_replicas * rollout_tp
        self.entries: list[WireEntry] | None = None
        inits = []
        if rank == 0:
            if len(clients) != rollout_replicas:
                raise ValueError(f"{len(clients)} rollout clients for {rollout_replicas} replicas")
            for i, client in enumerate(clients):
                info = {"host": store_host, "port": store_port, "world_size": self.sync_world,
                        "rank_offset": world_size + i * rollout_tp, "timeout_s": timeout_s}
                inits.append(_Thread(lambda c=client, info=info: c.init_weight_transfer(info)))
                inits[-1].start()
        self.store, self.group = make_sync_group(store_host, store_port, rank, self.sync_world, timeout_s)
        for t in inits:
            t.join_or_raise()

    def worker_rank(self, replica: int, tp_rank: int) -> int:
        return self.trainers + replica * self.tp + tp_rank

    def _plan(self, local: list[tuple[HFSlice, torch.Tensor]]) -> list[WireEntry]:
        meta = ([b for b, _ in local], {b.name: t.dtype for b, t in local})
        gathered: list[Any] = [None] * self.trainers
        dist.all_gather_object(gathered, meta)
        holdings = {r: blocks for r, (blocks, _) in enumerate(gathered)}
        dtypes = {k: v for _, d in gathered for k, v in d.items()}
        needs = {self.worker_rank(rep, r): vllm_rank_slices(self.hf, self.tp, r)
                 for rep in range(self.replicas) for r in range(self.tp)}
        return layout_buckets(plan_transfers(holdings, needs), dtypes, self.bucket_bytes)

    def push(self, local_slices: Iterable[tuple[HFSlice, torch.Tensor]], version: int) -> SyncStats:
        """Send this rank's planned blocks; on rank 0 also run the fleet's update lifecycle."""
        t0 = time.perf_counter()
        local = list(local_slices)
        if self.entries is None:
            self.entries = self._plan(local)
        updates = []
        if self.rank == 0:
            for rep, client in enumerate(self.clients):
                client.pause()
                client.start_weight_update()
                info = [{"version": version, "digests": self.digests,
                         "entries": [e.to_json() for e in self.entries if e.receiver == self.worker_rank(rep, r)]}
                        for r in range(self.tp)]
                updates.append(_Thread(lambda c=client, info=info: c.update_weights(info)))
                updates[-1].start()
        sent = self._send(local)
        reports: list[dict[str, Any]] = []
        error: Exception | None = None
        if self.rank == 0:
            try:
                for t in updates:
                    t.join_or_raise()
                for client in self.clients:
                    client.finish_weight_update(version)
                    reports += client.collective_rpc("megarl_sync_report")
            except Exception as err:  # noqa: BLE001 - shared with every trainer rank below, then raised
                error = err
            finally:  # a failed update leaves the old weights in place: let the fleet serve them again
                for client in self.clients:
                    client.resume()
        # every rank learns the outcome, so a failure is raised everywhere instead of deadlocking the others
        all_sent: list[Any] = [None] * self.trainers
        dist.all_gather_object(all_sent, (sent, None if error is None else f"{type(error).__name__}: {error}"))
        failure = all_sent[0][1]
        if failure is not None:
            if error is not None:
                raise error
            raise WeightSyncError(f"weight sync to version {version} failed on trainer rank 0: {failure}")
        all_sent = [s for s, _ in all_sent]
        return SyncStats(
            version=version, seconds=time.perf_counter() - t0, bytes_sent=dict(enumerate(all_sent)),
            bytes_received={r["rank"]: r["bytes_received"] for r in reports},
            bytes_read_by_loaders={r["rank"]: r["bytes_read_by_loaders"] for r in reports}, reports=reports,
        )

    def _send(self, local: list[tuple[HFSlice, torch.Tensor]]) -> int:
        """Build and send every bucket this rank owes; returns the bytes sent."""
        buckets: dict[tuple[int, int], list[tuple[WireEntry, torch.Tensor]]] = {}
        for e in self.entries or []:
            if e.sender == self.rank:
                held, data = next((b, t) for b, t in local if b.contains(e.block))
                buckets.setdefault((e.receiver, e.bucket), []).append((e, data[e.block.index_within(held)]))
        works, total = [], 0
        for (receiver, bucket), items in sorted(buckets.items()):
            buf = torch.empty(max(e.offset + e.nbytes for e, _ in items), dtype=torch.uint8, device=device())
            for e, t in items:  # each block at the offset the receiver reads it from
                buf[e.offset:e.offset + e.nbytes] = to_bytes(t)
            total += buf.numel()
            works.append(self.group.send([buf], receiver, bucket))
        for w in works:
            w.wait()
        return total

    def close(self) -> None:
        self.group, self.store = None, None
