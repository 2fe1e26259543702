"""A weight-sync group's NCCL set-up and tear-down, done when a worker joins and when a replica leaves.

NCCL builds communicators lazily: a `ProcessGroupNCCL` made without a device makes a two-rank communicator per
(trainer rank, worker) pair at the pair's first send, i.e. inside the first push, where its buffers come out of
memory vLLM may already have given its KV cache, and where a worker that died after joining is noticed only at
the group's timeout. So at join (`connect`):

1. the group is bound to this rank's GPU and connected eagerly (`ProcessGroupNCCL.eager_connect_single_device`,
   what torch's `init_process_group(device_id=...)` / `new_group(device_id=...)` does): one communicator over the
   whole group, made now; torch then routes every point-to-point operation of the group through it instead of
   making per-pair ones;
2. every (trainer rank, worker) pair exchanges one byte (`exchange_pairs`): NCCL sets up a pair's point-to-point
   connection, and allocates its buffers, at the pair's first operation, so after this every connection a push can
   use exists and its memory is taken (`megarl.sync.receiver_memory.nccl_group_bytes` counts it in vLLM's budget).
   Each worker checks it heard from every trainer rank, so a miswired group fails its join, not a push.

A vLLM worker empties torch's caching allocator first (`torch.cuda.empty_cache()`), so NCCL's own allocations find
the memory the allocator held but no longer used.

A replica that leaves has its group aborted (`abort`: `ProcessGroupNCCL.abort()`, which aborts its communicator and
so fails any operation still waiting on it at once), not merely dropped. The groups are built directly on a store
(`megarl.sync.transport.process_group`), not registered with torch's default group, so torch's
`destroy_process_group(group)` / `_abort_process_group(group)` (which look the group up in that registry) do not
apply; the backend's own `abort()` is what they call.

On gloo (CPU) none of this runs: gloo connects every pair when the group is built, fails a dead peer's operations
at once, and its `abort()` leaves the sockets open (a gloo group closes with its last reference, as before). Only
`exchange_pairs` runs on CPU, in the unit tests, over gloo. Everything else here is written for GPUs and has not
run (no GPU machine was lent): docs/sync.md, "On GPUs: the NCCL path".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

HANDSHAKE_TAG = 1 << 30  # above any bucket index (buckets use their index as tag); NCCL ignores tags


def is_nccl(group: Any) -> bool:
    """Whether `group` is a `ProcessGroupNCCL` (False on a torch built without NCCL)."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    return nccl is not None and isinstance(group, nccl)


def exchange_pairs(group: Any, rank: int, trainers: int, world_size: int, device: torch.device) -> int:
    """Every trainer rank (`[0, trainers)`) sends each worker (`[trainers, world_size)`) one byte, its rank + 1 mod
    256; each worker receives from every trainer rank in rank order and checks the byte. Trainer ranks send in
    worker order, so no pair waits on a pair that waits on it. Returns the pairs this rank exchanged."""
    if rank < trainers:
        one = torch.full((1,), (rank + 1) % 256, dtype=torch.uint8, device=device)
        for peer in range(trainers, world_size):
            work = group.send([one], peer, HANDSHAKE_TAG)
            work.wait()
        if one.is_cuda:
            torch.cuda.current_stream(one.device).synchronize()
        return world_size - trainers
    buf = torch.empty(1, dtype=torch.uint8, device=device)
    for peer in range(trainers):
        group.recv([buf], peer, HANDSHAKE_TAG).wait()
        got = int(buf.item())  # on a GPU, .item() waits for the receive
        if got != (peer + 1) % 256:
            raise RuntimeError(f"sync group handshake: rank {rank} expected byte {(peer + 1) % 256} from trainer rank "
                               f"{peer}, got {got} (the group's ranks are miswired)")
    return trainers


def connect(group: Any, rank: int, trainers: int, world_size: int) -> None:
    """At join, on NCCL: bind `group` to this rank's GPU and make its communicator now, then open every (trainer,
    worker) pair (module docstring). Nothing on gloo."""
    if not is_nccl(group):
        return
    device = torch.device("cuda", torch.cuda.current_device())
    group.eager_connect_single_device(device)
    exchange_pairs(group, rank, trainers, world_size, device)


def free_cached_device_memory() -> None:
    """A vLLM worker before it joins an NCCL sync group: hand the caching allocator's unused blocks back to CUDA, so
    NCCL's buffers (allocated by NCCL, outside the allocator) find them. Nothing without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def abort(group: Any) -> None:
    """A replica left (or the sync closes): abort `group`'s NCCL communicator, so whatever still waits on it fails
    now and its buffers are freed. Nothing on gloo (the group closes with its last reference)."""
    if is_nccl(group):
        group.abort()
