"""How a sync's buckets move: the `Transport` interface both ends use, and its default implementation.

The plan (`megarl.sync.plan`), the wire format (`megarl.sync.wire`) and the fleet lifecycle
(`megarl.sync.lifecycle`) do not depend on how bytes travel. A transport joins the sync group (trainer ranks
`[0, T)`, vLLM workers after them) and moves the planned buckets: `send` on a trainer rank, `receive` on a
vLLM worker, staged (every slice before any is used) or `stream` (each slice as it completes, `sync.receive`). A
second backend (NCCL or NIXL point-to-point, RDMA reads) implements the same methods.

Groups: one torch.distributed process group *per replica* (gloo on CPU, NCCL on GPU), all over one TCPStore hosted
by trainer rank 0, each under its own store prefix (`replica_group_prefix`): the trainer ranks are ranks `[0, T)`
of every group and replica i's TP workers ranks `T + r` of replica i's. A replica that dies breaks only its own
group: the trainer leaves it (`ReplicaGroups.leave`) and the other replicas' pushes go on; a restarted replica
joins a new group under the next generation's prefix (`ReplicaGroups.join`) without the trainer or the other
replicas restarting. Plans and wire entries keep naming a worker by its fleet-wide rank `T + i * tp + r`
(`megarl.sync.weight_sync`); `ReplicaGroups.send` routes such a rank to its replica's group.

`TorchGroupTransport` (a vLLM worker: its replica's group) and `ReplicaGroupsTransport` (a trainer rank: every
replica's), one point-to-point message per bucket with the bucket index as tag, streamed by `megarl.sync.stream`.

On NCCL (`megarl.sync.group_setup`): a group's communicator and every (trainer rank, worker) connection are made
when the group is joined, not at the first push; a replica that leaves has its group aborted; the groups'
operations time out after their own `op_timeout_s` (`megarl.sync.group_timeout`, sized from a push's bytes), while
the join's rendezvous keeps `timeout_s`. On gloo none of that changes anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megarl.parallel.stores import tcp_store
from megarl.sync import group_setup
from megarl.sync.slices import HFSlice
from megarl.sync.stream import SendResult, SliceStream, raw_bytes, receive_slices, send_buckets
from megarl.sync.wire import WireEntry, staged, staged_ahead

Pack = Callable[[WireEntry, torch.Tensor], torch.Tensor]  # (entry, its block) -> the entry's wire bytes
Decode = Callable[[WireEntry, torch.Tensor], torch.Tensor]  # (delta entry, its wire bytes) -> the block
Gone = Callable[[int], str | None]  # (fleet-wide worker rank) -> why it is gone, or None


class Transport(Protocol):
    def send(self, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
             pack: Pack = raw_bytes, gone: Gone | None = None) -> SendResult:
        """Trainer rank: send every bucket `entries` assigns to this rank, cut from its `local` tensors (each
        entry's bytes made by `pack`: raw, or delta-encoded by `megarl.sync.delta`); a send to a receiver that
        `gone` names is given up (`megarl.sync.stream.send_buckets`)."""
        ...

    def receive(self, entries: list[WireEntry],
                decode: Decode | None = None) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
        """vLLM worker: receive this worker's `entries`; its slices (one tensor per HF name, in host memory on a GPU
        fleet) and bytes received. Delta-encoded entries are turned into blocks by `decode`."""
        ...

    def stream(self, entries: list[WireEntry]) -> SliceStream:
        """vLLM worker: this worker's slices yielded as each completes (`megarl.sync.stream.SliceStream`)."""
        ...

    def close(self) -> None:
        """Leave the sync group."""
        ...


SYNC_PREFIX = "megarl_sync"  # the store prefix of a sync group that spans the whole fleet (tests, older trainers)


def replica_group_prefix(replica: int, generation: int) -> str:
    """The store prefix of replica `replica`'s sync group; `generation` counts its (re)joins in this run, so a
    restarted replica's group never meets keys its dead predecessor left in the store."""
    return f"{SYNC_PREFIX}/replica{replica}/gen{generation}"


def make_sync_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0,
                    prefix: str = SYNC_PREFIX, op_timeout_s: float | None = None, trainers: int | None = None):
    """Join a sync group (rank 0 hosts the store; `prefix`: which group). Returns (store, process group).
    Built directly on a TCPStore so it is independent of the trainer's own default process group. `trainers`: how
    many of its ranks are trainer ranks; given, an NCCL group connects every (trainer, worker) pair now
    (`group_setup.connect`)."""
    store = tcp_store(host, port, world_size, is_master=rank == 0, timeout_s=timeout_s)
    group = process_group(dist.PrefixStore(prefix, store), rank, world_size, timeout_s, op_timeout_s)
    if trainers is not None:
        group_setup.connect(group, rank, trainers, world_size)
    return store, group


def process_group(store, rank: int, world_size: int, timeout_s: float, op_timeout_s: float | None = None):
    """A process group over `store` (every member passes the same store, or prefix of it): NCCL when CUDA is
    present, gloo otherwise; each operation times out after `timeout_s`, on NCCL after `op_timeout_s` where given
    (the store's own timeout, which bounds the rendezvous, stays `timeout_s`)."""
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        # as torch's own new_group sets it (default: 10 min)
        options._timeout = timedelta(seconds=timeout_s if op_timeout_s is None else op_timeout_s)
        with _nccl_errors_raise():
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


@contextmanager
def _nccl_errors_raise() -> Iterator[None]:
    """While a sync group is built on NCCL: a timed-out or failed operation aborts that group's communicator and
    raises in the waiting sender (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, read by each ProcessGroupNCCL when it is
    built), instead of torch's default of tearing the whole process down, so a dead replica costs its own group
    only. The trainer's own groups keep the default. (Written for GPUs; not exercised on the CPU machines.)"""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    previous = os.environ.get(key)
    os.environ[key] = "2"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


class TorchGroupTransport:
    """Point-to-point buckets over one torch.distributed process group (see the module docstring): a vLLM worker's
    end (its replica's group, `prefix`), or every member of a fleet-wide group. `window`: send buckets in flight
    per trainer rank (memory: `window` buckets). `op_timeout_s`, `trainers`: as for `make_sync_group`."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0,
                 window: int = 2, prefix: str = SYNC_PREFIX, op_timeout_s: float | None = None,
                 trainers: int | None = None) -> None:
        self.rank, self.window = rank, window
        self.store, self.group = make_sync_group(host, port, rank, world_size, timeout_s, prefix, op_timeout_s,
                                                 trainers)

    def send(self, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
             pack: Pack = raw_bytes, gone: Gone | None = None) -> SendResult:
        return send_buckets(self.group, self.rank, entries, local, window=self.window, pack=pack, gone=gone)

    def receive(self, entries: list[WireEntry],
                decode: Decode | None = None) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
        return receive_slices(self.group, entries, keep=staged, ahead=staged_ahead(), decode=decode)

    def stream(self, entries: list[WireEntry]) -> SliceStream:
        return SliceStream(self.group, entries)

    def close(self) -> None:
        """Leave the group: an NCCL group is aborted (`group_setup.abort`), a gloo one dropped."""
        if self.group is not None:
            group_setup.abort(self.group)
        self.group, self.store = None, None


class ReplicaGroups:
    """A trainer rank's sync groups, one per replica in the sync (see the module docstring). Looks like one group
    to `megarl.sync.stream.send_buckets`: `send` takes a fleet-wide worker rank and routes it to its replica's
    group. A rank of a replica that left raises at once (the sender records that receiver as failed)."""

    def __init__(self, trainers: int, tp: int) -> None:
        self.trainers, self.tp = trainers, tp
        self.groups: dict[int, Any] = {}  # replica -> its process group

    def replica_of(self, worker: int) -> int:
        return (worker - self.trainers) // self.tp

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        replica = self.replica_of(dst)
        group = self.groups.get(replica)
        if group is None:
            raise RuntimeError(f"replica {replica} is not in the sync (it left, or never joined)")
        return group.send(tensors, self.trainers + (dst - self.trainers) % self.tp, tag)


class ReplicaGroupsTransport:
    """A trainer rank's end of the sync: the store (hosted by trainer rank 0) and one group per replica that joined
    (`join`, a collective with that replica's workers) and has not left (`leave`). `window`: send buckets in flight
    per trainer rank; `op_timeout_s`: the NCCL groups' operation timeout (`megarl.sync.group_timeout`; None:
    `timeout_s`)."""

    def __init__(self, host: str, port: int, rank: int, trainers: int, tp: int, timeout_s: float = 600.0,
                 window: int = 2, op_timeout_s: float | None = None) -> None:
        self.host, self.rank, self.trainers, self.tp = host, rank, trainers, tp
        self.timeout_s, self.window, self.op_timeout_s = timeout_s, window, op_timeout_s
        self.store = tcp_store(host, port, trainers + tp, is_master=rank == 0, timeout_s=timeout_s)
        self.groups = ReplicaGroups(trainers, tp)
        self.group = self.groups  # what the sends talk to (tests wrap it to inject failures)
        self.generation: dict[int, int] = {}  # replica -> joins so far (the next join's prefix)

    def next_prefix(self, replica: int) -> str:
        """The prefix of replica `replica`'s next group (the same on every trainer rank: joins are collective)."""
        return replica_group_prefix(replica, self.generation.get(replica, 0))

    def join(self, replica: int, timeout_s: float | None = None) -> None:
        """Build replica `replica`'s group with its workers (blocks until they joined, or `timeout_s`: default the
        transport's; it is also the new group's timeout on gloo, on NCCL `op_timeout_s` is). On NCCL the group's
        communicator and its connections to every worker are made here (`group_setup.connect`)."""
        prefix = self.next_prefix(replica)
        self.generation[replica] = self.generation.get(replica, 0) + 1
        world = self.trainers + self.tp
        group = process_group(dist.PrefixStore(prefix, self.store), self.rank, world,
                              self.timeout_s if timeout_s is None else timeout_s, self.op_timeout_s)
        try:
            group_setup.connect(group, self.rank, self.trainers, world)
        except BaseException:
            group_setup.abort(group)
            raise
        self.groups.groups[replica] = group

    def leave(self, replica: int) -> None:
        """Replica `replica` leaves: its group is aborted on NCCL (whatever waits on it fails now), dropped on gloo
        (its connections close with the last reference)."""
        group = self.groups.groups.pop(replica, None)
        if group is not None:
            group_setup.abort(group)

    @property
    def replicas(self) -> list[int]:
        return sorted(self.groups.groups)

    def send(self, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
             pack: Pack = raw_bytes, gone: Gone | None = None) -> SendResult:
        return send_buckets(self.group, self.rank, entries, local, window=self.window, pack=pack, gone=gone)

    def receive(self, entries: list[WireEntry],
                decode: Decode | None = None) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
        raise TypeError("a trainer rank's transport only sends")

    def stream(self, entries: list[WireEntry]) -> SliceStream:
        raise TypeError("a trainer rank's transport only sends")

    def close(self) -> None:
        """Leave every group (aborted on NCCL, dropped on gloo: each closes its connections with its last reference)
        and drop the store handle."""
        for group in self.groups.groups.values():
            group_setup.abort(group)
        self.groups.groups.clear()
        self.group, self.store = None, None
