"""The wire format of a partitioned weight sync, shared by the trainer (sender) and the vLLM worker
(receiver) so the two cannot disagree.

Transfers between one sender and one receiver travel, in plan order, in *buckets*: flat byte
buffers of at most `bucket_bytes` (a block larger than that travels alone). `WireEntry` says where
each block sits in which bucket; any transport (`megarl.sync.transport`) moves bucket `k` of a pair
as one message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.sync.plan import Transfer
from megarl.sync.slices import HFSlice


@dataclass(frozen=True)
class WireEntry:
    """One block inside one bucket, as both sides see it."""

    sender: int
    receiver: int
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int
    block: HFSlice
    dtype: str  # torch dtype name, e.g. "float32"
    # a delta push (`megarl.sync.delta`): "raw" (the block's bytes, a full push), or the block re-encoded against
    # the receiver's base: "dense", "indices", "bitmap", "nothing"; `changed` elements; the base's fingerprint
    encoding: str = "raw"
    changed: int = 0
    base_sum: int | None = None

    def to_json(self) -> dict:
        out = {"sender": self.sender, "bucket": self.bucket, "offset": self.offset, "nbytes": self.nbytes,
               "name": self.block.name, "full_shape": list(self.block.full_shape),
               "box": [list(b) for b in self.block.box], "dtype": self.dtype}
        if self.encoding != "raw":
            out.update(encoding=self.encoding, changed=self.changed, base_sum=self.base_sum)
        return out

    @classmethod
    def from_json(cls, receiver: int, d: dict) -> WireEntry:
        block = HFSlice(d["name"], tuple(d["full_shape"]), tuple(tuple(b) for b in d["box"]))
        return cls(d["sender"], receiver, d["bucket"], d["offset"], d["nbytes"], block, d["dtype"],
                   d.get("encoding", "raw"), d.get("changed", 0), d.get("base_sum"))


def layout_buckets(plan: list[Transfer], dtypes: dict[str, torch.dtype], bucket_bytes: int) -> list[WireEntry]:
    """Assign every transfer its bucket and byte offset (per sender->receiver pair, in plan order)."""
    state: dict[tuple[int, int], tuple[int, int]] = {}  # pair -> (bucket index, bytes used)
    out = []
    for t in plan:
        dtype = dtypes[t.block.name]
        nbytes = t.block.numel * dtype.itemsize
        bucket, used = state.get((t.sender, t.receiver), (0, 0))
        if used and used + nbytes > bucket_bytes:
            bucket, used = bucket + 1, 0
        out.append(WireEntry(t.sender, t.receiver, bucket, used, nbytes, t.block, str(dtype).removeprefix("torch.")))
        state[(t.sender, t.receiver)] = (bucket, used + nbytes)
    return out


def bucket_sizes(entries: list[WireEntry]) -> dict[tuple[int, int, int], int]:
    """(sender, receiver, bucket) -> bytes."""
    sizes: dict[tuple[int, int, int], int] = {}
    for e in entries:
        key = (e.sender, e.receiver, e.bucket)
        sizes[key] = max(sizes.get(key, 0), e.offset + e.nbytes)
    return sizes


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def staged_ahead() -> int | None:
    """How many bucket indices a staged receiver keeps posted ahead (`megarl.sync.stream.take_buckets`): on a GPU
    two, so the device holds a few buckets; on CPU all of them (None), as before `sync.receive` existed: the
    buckets are the host copy anyway, and with every receive posted before any wait, a sender that fails reaches
    every one of its receives at once. (A receive posted on a gloo pair just after its peer closed it was once seen
    to wait for the group's timeout instead of failing: streamed receivers, which post as they go, can meet that.)"""
    return 2 if torch.cuda.is_available() else None


def staged(buf: torch.Tensor) -> torch.Tensor:
    """Where a staged receiver (`sync.receive=staged`) keeps a bucket that has arrived: NCCL receives into device
    memory, so on a GPU the bucket is copied to pinned host memory (vLLM's loaders copy host -> device as they load)
    and the device bucket is freed by the caller dropping it: the device holds a few buckets, the host the shard.
    On CPU the bucket itself (no copy)."""
    if not buf.is_cuda:
        return buf
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf)
    return host


def wait_on_host(work, buf: torch.Tensor) -> None:
    """Wait until the point-to-point operation `work` on `buf` has completed, as seen from the host. gloo's `wait`
    blocks until then; NCCL's only makes the current CUDA stream wait for it, so on a GPU the stream is synchronised
    as well. A sender may then drop or reuse the bucket knowing its bytes have left: that is what bounds its staging
    memory (otherwise the host would pack every bucket ahead of the wire), and a receiver's timings are real."""
    work.wait()
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return buf.view(getattr(torch, dtype)).reshape(shape)
