"""How a sync's buckets move: the `Transport` interface both ends use, and its default implementation.

The plan (`megarl.sync.plan`), the wire format (`megarl.sync.wire`) and the fleet lifecycle
(`megarl.sync.lifecycle`) do not depend on how bytes travel. A transport joins the sync group (trainer ranks
`[0, T)`, vLLM workers after them) and moves the planned buckets: `send` on a trainer rank, `receive` on a
vLLM worker, staged (every slice before any is used) or `stream` (each slice as it completes, `sync.receive`). A
second backend (NCCL or NIXL point-to-point, RDMA reads) implements the same methods.

`TorchGroupTransport`, the default: one torch.distributed process group over a TCPStore hosted by trainer
rank 0 (gloo on CPU, NCCL on GPU), one point-to-point message per bucket with the bucket index as tag,
streamed by `megarl.sync.stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from megarl.parallel.stores import tcp_store
from megarl.sync.slices import HFSlice
from megarl.sync.stream import SendResult, SliceStream, raw_bytes, receive_slices, send_buckets
from megarl.sync.wire import WireEntry, staged, staged_ahead

Pack = Callable[[WireEntry, torch.Tensor], torch.Tensor]  # (entry, its block) -> the entry's wire bytes
Decode = Callable[[WireEntry, torch.Tensor], torch.Tensor]  # (delta entry, its wire bytes) -> the block


class Transport(Protocol):
    def send(self, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
             pack: Pack = raw_bytes) -> SendResult:
        """Trainer rank: send every bucket `entries` assigns to this rank, cut from its `local` tensors (each
        entry's bytes made by `pack`: raw, or delta-encoded by `megarl.sync.delta`)."""
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


def make_sync_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0):
    """Join the trainer+fleet sync group (rank 0 hosts the store). Returns (store, process group).
    Built directly on a TCPStore so it is independent of the trainer's own default process group."""
    store = tcp_store(host, port, world_size, is_master=rank == 0, timeout_s=timeout_s)
    return store, process_group(dist.PrefixStore("megarl_sync", store), rank, world_size, timeout_s)


def process_group(store, rank: int, world_size: int, timeout_s: float):
    """A process group over `store` (every member passes the same store, or prefix of it): NCCL when CUDA is
    present, gloo otherwise; each operation times out after `timeout_s`."""
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)  # as torch's own new_group sets it (default: 10 min)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


class TorchGroupTransport:
    """Point-to-point buckets over a torch.distributed process group (see the module docstring). `window`: send
    buckets in flight per trainer rank (memory: `window` buckets)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0,
                 window: int = 2) -> None:
        self.rank, self.window = rank, window
        self.store, self.group = make_sync_group(host, port, rank, world_size, timeout_s)

    def send(self, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
             pack: Pack = raw_bytes) -> SendResult:
        return send_buckets(self.group, self.rank, entries, local, window=self.window, pack=pack)

    def receive(self, entries: list[WireEntry],
                decode: Decode | None = None) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
        return receive_slices(self.group, entries, keep=staged, ahead=staged_ahead(), decode=decode)

    def stream(self, entries: list[WireEntry]) -> SliceStream:
        return SliceStream(self.group, entries)

    def close(self) -> None:
        self.group, self.store = None, None
