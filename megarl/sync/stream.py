"""Moving the planned buckets of one sync: the sender streams them, the receiver reassembles its slices.

Both ends run the same `WireEntry` list (`megarl.sync.wire.layout_buckets`), so they agree on every
bucket's bytes without talking about it.

Sender (`send_buckets`): packs one bucket at a time from the rank's own tensors and keeps at most `window`
buckets on the wire (bucket k+1 is packed while bucket k travels); when `window` buckets are in flight it
waits for the oldest before packing the next. Its staging memory is therefore at most `window` buckets, plus
one contiguous copy of the block being packed when that block is not contiguous in the rank's tensor (a
column slice). A block larger than `bucket_bytes` travels alone, so "a bucket" means
`max(bucket_bytes, largest block)`. The peak is counted exactly (`SendResult.peak_staging_bytes`).

Receiver (`receive_slices`): posts one receive per (sender, bucket) of its plan before waiting for any (so no
sender can wait on a receive that is never posted: senders and receivers cannot deadlock whatever the
window); the buckets together are exactly this rank's slices. It then takes the buckets in the order the
senders send them and turns them into one tensor per HF name: a name received as one piece is a view into
its bucket (no copy); a name received in pieces from several senders is copied into a new tensor as each
bucket arrives, and the bucket is dropped. A receiver thus holds its own slices plus the tensors being
filled, never the full model. A sender that dies (or closes its connections after failing) fails only its own
buckets, even when it is gone before the receiver posts them: the receiver still takes every other sender's, then
raises `SenderFailed` naming the failed senders (senders are the trainer ranks: sync-group rank = trainer rank).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from megarl.sync.slices import HFSlice
from megarl.sync.wire import WireEntry, bucket_sizes, device, from_bytes, to_bytes, wait_on_host


@dataclass(frozen=True)
class SendResult:
    bytes_sent: int  # bytes whose send completed
    buckets: int
    peak_staging_bytes: int  # most bucket bytes allocated at once on this rank during the send
    failed: dict[int, str] = field(default_factory=dict)  # receiver -> why its sends failed (its later buckets skipped)


def holders_by_name(local: list[tuple[HFSlice, torch.Tensor]]) -> dict[str, list[tuple[HFSlice, torch.Tensor]]]:
    by_name: dict[str, list[tuple[HFSlice, torch.Tensor]]] = {}
    for block, data in local:
        by_name.setdefault(block.name, []).append((block, data))
    return by_name


def cut(by_name: dict[str, list[tuple[HFSlice, torch.Tensor]]], block: HFSlice) -> torch.Tensor:
    """The part of this rank's tensors that holds `block` (a view)."""
    for held, data in by_name.get(block.name, []):
        if held.contains(block):
            return data[block.index_within(held)]
    raise ValueError(f"the sync plan asks this rank for {block.name} {block.box}, which it does not hold")


def send_buckets(group, rank: int, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
                 window: int = 2) -> SendResult:
    """Send every bucket `entries` assigns to sender `rank`, at most `window` in flight; returns the accounting.
    A receiver whose send fails (its process died) is recorded in `SendResult.failed` and skipped from then on;
    the other receivers still get all their buckets."""
    if window < 1:
        raise ValueError(f"window={window}: at least one bucket must be in flight")
    mine: dict[tuple[int, int], list[WireEntry]] = {}
    for e in entries:
        if e.sender == rank:
            mine.setdefault((e.receiver, e.bucket), []).append(e)
    by_name = holders_by_name(local)
    in_flight: deque[tuple[object, torch.Tensor, int]] = deque()
    live = peak = total = 0
    receivers = sorted({receiver for receiver, _ in mine})
    # bucket 0 to every receiver, then bucket 1, ...; each sender starts at a different receiver, so that with
    # several senders and receivers every receiver's link is busy at once (not all senders on one receiver)
    def order(key: tuple[int, int]) -> tuple[int, int]:
        receiver, bucket = key
        return bucket, (receivers.index(receiver) - rank) % len(receivers)

    failed: dict[int, str] = {}

    def settle(work, buf: torch.Tensor, receiver: int) -> int:
        """Wait for one send; a failure marks its receiver (a dead peer fails only its own pair: gloo keeps the
        other pairs working, so the other receivers still get everything). Returns the bytes sent."""
        try:
            wait_on_host(work, buf)
        except Exception as err:  # noqa: BLE001 - recorded per receiver, reported by the caller
            failed.setdefault(receiver, f"{type(err).__name__}: {err}")
            return 0
        return buf.numel()

    for receiver, bucket in sorted(mine, key=order):
        if receiver in failed:
            continue
        items = mine[(receiver, bucket)]
        while len(in_flight) >= window:
            work, done, to = in_flight.popleft()
            total += settle(work, done, to)
            live -= done.numel()
            del work, done  # the buffer is freed here, before the next one is allocated (a Work holds its tensor)
        buf = torch.empty(max(e.offset + e.nbytes for e in items), dtype=torch.uint8, device=device())
        live += buf.numel()
        peak = max(peak, live)
        for e in items:  # each block at the offset the receiver reads it from
            buf[e.offset:e.offset + e.nbytes] = to_bytes(cut(by_name, e.block))
        try:
            in_flight.append((group.send([buf], receiver, bucket), buf, receiver))
        except Exception as err:  # noqa: BLE001 - as in settle()
            failed.setdefault(receiver, f"{type(err).__name__}: {err}")
            live -= buf.numel()
    while in_flight:
        work, done, to = in_flight.popleft()
        total += settle(work, done, to)
    return SendResult(bytes_sent=total, buckets=len(mine), peak_staging_bytes=peak, failed=failed)


def post_receives(group, entries: list[WireEntry],
                  failed: dict[int, str]) -> dict[tuple[int, int], tuple[torch.Tensor, object]]:
    """Post one receive per (sender, bucket) of this receiver's entries: (sender, bucket) -> (buffer, work).

    Posting a receive from a sender that is already gone raises at once (gloo: the pair is closed): that sender
    goes into `failed` (sender -> why) and its other buckets are not posted, but every other sender's still are.
    Giving up at the first failed post would leave the live senders blocked in sends nobody receives until the
    group's timeout (a sender can die before this receiver even starts: its peers need not be there yet)."""
    posted = {}
    for (sender, _, bucket), nbytes in sorted(bucket_sizes(entries).items()):
        if sender in failed:
            continue
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device())
        try:
            posted[(sender, bucket)] = (buf, group.recv([buf], sender, bucket))
        except Exception as err:  # noqa: BLE001 - raised as SenderFailed once the live senders' buckets are taken
            failed[sender] = f"bucket {bucket}: {type(err).__name__}: {err}"
    return posted


class SenderFailed(RuntimeError):
    """Buckets of one or more senders did not arrive (the sender died or closed its connections)."""


def receive_slices(group, entries: list[WireEntry]) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
    """Receive and assemble this receiver's slices (see `assemble`), copying each bucket's pieces out as soon as
    it arrives and dropping it, buckets taken in the order senders send them (bucket 0 of every sender, then
    bucket 1, ...). Returns the slices and the bytes received.

    A sender whose bucket fails (it died, or closed its connections after failing: `SenderFailed` names it) does
    not stop the receive: every other sender's buckets are still taken, so no live sender is left blocked on a
    receive that was dropped, and then `SenderFailed` is raised naming each failed sender."""
    failed: dict[int, str] = {}  # sender -> why its first failed bucket failed
    posted = post_receives(group, entries, failed)
    received = sum(buf.numel() for buf, _ in posted.values())
    by_bucket: dict[tuple[int, int], list[WireEntry]] = {}
    pieces: dict[str, int] = {}
    for e in entries:
        by_bucket.setdefault((e.sender, e.bucket), []).append(e)
        pieces[e.block.name] = pieces.get(e.block.name, 0) + 1
    wholes = tile(entries)
    out: dict[str, tuple[HFSlice, torch.Tensor]] = {}
    for key in sorted(posted, key=lambda k: (k[1], k[0])):
        buf, work = posted.pop(key)
        try:
            wait_on_host(work, buf)
        except Exception as err:  # noqa: BLE001 - the other senders' buckets are still taken, then this raises
            failed.setdefault(key[0], f"bucket {key[1]}: {type(err).__name__}: {err}")
            continue
        if failed:  # the update is refused anyway: the bucket is taken (its sender is not left waiting), not used
            continue
        for e in by_bucket[key]:
            raw = buf[e.offset:e.offset + e.nbytes]
            whole = wholes[e.block.name]
            if pieces[e.block.name] == 1 and _aligned(e):  # one piece: a view, the bucket stays alive for it
                out[e.block.name] = (whole, from_bytes(raw, e.dtype, e.block.shape))
                continue
            if e.block.name not in out:
                out[e.block.name] = (whole, torch.empty(whole.shape, dtype=getattr(torch, e.dtype), device=device()))
            piece = from_bytes(raw if _aligned(e) else raw.clone(), e.dtype, e.block.shape)
            out[e.block.name][1][e.block.index_within(whole)] = piece
        del buf
    if failed:
        raise SenderFailed("; ".join(f"trainer rank {sender} failed to send {why}"
                                     for sender, why in sorted(failed.items())))
    return out, received


def tile(entries: list[WireEntry]) -> dict[str, HFSlice]:
    """The slice of each HF tensor a receiver gets: the bounding box of its pieces, which must tile it exactly
    (no gap, no overlap)."""
    by_name: dict[str, list[HFSlice]] = {}
    for e in entries:
        by_name.setdefault(e.block.name, []).append(e.block)
    out = {}
    for name, blocks in by_name.items():
        box = tuple((min(b.box[d][0] for b in blocks), max(b.box[d][1] for b in blocks))
                    for d in range(len(blocks[0].box)))
        whole = HFSlice(name, blocks[0].full_shape, box)
        if sum(b.numel for b in blocks) != whole.numel:
            raise ValueError(f"update plan for {name}: pieces {[b.box for b in blocks]} do not tile {box}")
        out[name] = whole
    return out


def _aligned(e: WireEntry) -> bool:
    return e.offset % getattr(torch, e.dtype).itemsize == 0
