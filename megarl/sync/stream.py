"""Moving the planned buckets of one sync: the sender streams them, the receiver reassembles its slices.

Both ends run the same `WireEntry` list (`megarl.sync.wire.layout_buckets`), so they agree on every
bucket's bytes without talking about it.

Sender (`send_buckets`): packs one bucket at a time from the rank's own tensors and keeps at most `window`
buckets on the wire (bucket k+1 is packed while bucket k travels); when `window` buckets are in flight it
waits for the oldest before packing the next. Its staging memory is therefore at most `window` buckets, plus
one contiguous copy of the block being packed when that block is not contiguous in the rank's tensor (a
column slice). A block larger than `bucket_bytes` travels alone, so "a bucket" means
`max(bucket_bytes, largest block)`. The peak is counted exactly (`SendResult.peak_staging_bytes`).

Receiver: posts its receives one bucket index at a time, for every sender at once, at most two indices ahead of
the bucket being consumed (`take_buckets`, which also says why this cannot deadlock with the sender's order), so
posting never allocates the shard. The buckets together are exactly this rank's slices. Two ways to take them:
- `receive_slices` (`sync.receive=staged`): every slice, one tensor per HF name, before the caller uses any: a
  name received as one piece is a view into its bucket (no copy); a name received in pieces from several senders
  is copied into a new tensor as each bucket arrives. Each bucket can be moved as it arrives (on a GPU fleet to
  pinned host memory, `megarl.sync.wire.staged`), so the device holds a few buckets while the host holds the shard.
- `SliceStream` (`sync.receive=streamed`): an iterator yielding each HF tensor as soon as all its pieces arrived,
  for a caller that loads them as they come: it holds the buckets posted ahead and what the caller keeps.
A sender that dies (or closes its connections after failing) fails only its own buckets, even when it is gone
before the receiver posts them: the receiver still takes every other sender's, then raises `SenderFailed` naming
the failed senders (senders are the trainer ranks: sync-group rank = trainer rank).

A receiver that dies is not always seen by the sender's transport: gloo does not fail every send to a peer that
died mid-transfer; such a send waits for the group's timeout, 600 s and more (measured: two senders, 64 MiB buckets,
a receiver that had posted all its receives SIGKILLed after its first bucket: a sender then waited on its next bucket
until the timeout in every run; with buckets small enough that every send completes before the kill lands, or with
one sender and one receiver, gloo failed the sends at once).
gloo's own timed wait cannot be used to look around: a timed-out wait closes the pair for good. So a sender given
`gone` (receiver -> why it is gone, or None) waits for each send in a thread of its own and asks `gone` every
`slice_s` while it waits (`wait_watching`): a receiver that is gone is recorded as failed within one slice, and its
later buckets are skipped. The trainer's `gone` is its update call to the receiver's replica having failed
(`megarl.sync.weight_sync`), which itself gives up within `rollout.health_timeout_s` on a replica that died or one
of whose workers stopped sending heartbeats (`megarl.sync.heartbeat`: a stopped worker fails nothing, and the
senders' bucket-major order would otherwise starve every other receiver while they wait on it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megarl.sync.slices import HFSlice
from megarl.sync.wire import WireEntry, device, from_bytes, to_bytes, wait_on_host


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


WAIT_SLICE_S = 1.0  # how often a sender waiting on a send asks whether its receiver is gone (`wait_watching`)


class ReceiverGone(RuntimeError):
    """A send was abandoned: its receiver is gone (`send_buckets`' `gone` said why)."""


def wait_watching(work, buf: torch.Tensor, gone: Callable[[], str | None] | None,
                  slice_s: float = WAIT_SLICE_S) -> None:
    """`wait_on_host(work, buf)`, asking `gone()` every `slice_s` while it waits: once it says why the peer is gone,
    raise `ReceiverGone` and leave the send behind (a thread keeps waiting on it, holding `buf`, until its group
    fails it or is dropped). The wait runs in a thread because gloo's own timed wait closes the pair when it times
    out. `gone=None`: a plain wait."""
    if gone is None:
        wait_on_host(work, buf)
        return
    done, errors = threading.Event(), []

    def waiter() -> None:
        try:
            wait_on_host(work, buf)
        except BaseException as err:  # noqa: BLE001 - raised by the caller below
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=waiter, name="megarl-send-wait", daemon=True).start()
    while not done.wait(slice_s):
        why = gone()
        if why is not None:
            raise ReceiverGone(why)
    if errors:
        raise errors[0]


def raw_bytes(entry: WireEntry, block: torch.Tensor) -> torch.Tensor:
    """A block's bytes as a full push sends them."""
    return to_bytes(block)


def send_buckets(group, rank: int, entries: list[WireEntry], local: list[tuple[HFSlice, torch.Tensor]],
                 window: int = 2, pack: Callable[[WireEntry, torch.Tensor], torch.Tensor] = raw_bytes,
                 gone: Callable[[int], str | None] | None = None, slice_s: float = WAIT_SLICE_S) -> SendResult:
    """Send every bucket `entries` assigns to sender `rank`, at most `window` in flight; returns the accounting.
    A receiver whose send fails (its process died) is recorded in `SendResult.failed` and skipped from then on;
    the other receivers still get all their buckets. `pack(entry, block)` gives an entry's `entry.nbytes` bytes
    from its block of this rank's tensors (a delta push encodes it, `megarl.sync.delta`); a bucket of 0 bytes (a
    delta where nothing changed) is not sent. `gone(receiver)`: why that receiver is gone, or None; asked every
    `slice_s` while a send to it waits and before each bucket to it is packed (see the module docstring): a gone
    receiver is recorded as failed, its send left behind (None: sends wait until they complete or fail)."""
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
            wait_watching(work, buf, None if gone is None else lambda: gone(receiver), slice_s)
        except Exception as err:  # noqa: BLE001 - recorded per receiver, reported by the caller
            failed.setdefault(receiver, f"{type(err).__name__}: {err}")
            return 0
        return buf.numel()

    sent_buckets = 0
    asked: dict[int, float] = {}  # receiver -> when `gone` was last asked about it before packing
    for receiver, bucket in sorted(mine, key=order):
        items = mine[(receiver, bucket)]
        if receiver not in failed and gone is not None and time.monotonic() - asked.get(receiver, -slice_s) >= slice_s:
            asked[receiver] = time.monotonic()  # at most once a slice: `gone` may be a round trip to a store
            if (why := gone(receiver)) is not None:
                failed[receiver] = f"{ReceiverGone.__name__}: {why}"
        if receiver in failed or bucket_nbytes(items) == 0:
            continue
        sent_buckets += 1
        while len(in_flight) >= window:
            work, done, to = in_flight.popleft()
            total += settle(work, done, to)
            live -= done.numel()
            del work, done  # the buffer is freed here, before the next one is allocated (a Work holds its tensor)
        buf = torch.empty(bucket_nbytes(items), dtype=torch.uint8, device=device())
        live += buf.numel()
        peak = max(peak, live)
        for e in items:  # each block at the offset the receiver reads it from
            if e.nbytes:
                buf[e.offset:e.offset + e.nbytes] = pack(e, cut(by_name, e.block))
        try:
            in_flight.append((group.send([buf], receiver, bucket), buf, receiver))
        except Exception as err:  # noqa: BLE001 - as in settle()
            failed.setdefault(receiver, f"{type(err).__name__}: {err}")
            live -= buf.numel()
    while in_flight:
        work, done, to = in_flight.popleft()
        total += settle(work, done, to)
    return SendResult(bytes_sent=total, buckets=sent_buckets, peak_staging_bytes=peak, failed=failed)


def bucket_nbytes(items: list[WireEntry]) -> int:
    """The size of the bucket holding `items` (all of one bucket)."""
    return max(e.offset + e.nbytes for e in items)


def post_bucket(group, entries_of: dict[tuple[int, int], list[WireEntry]], senders: list[int], bucket: int,
                failed: dict[int, str]) -> dict[tuple[int, int], tuple[torch.Tensor, object]]:
    """Post the receive of bucket index `bucket` from every sender that has one: (sender, bucket) -> (buffer, work).

    Posting a receive from a sender that is already gone raises at once (gloo: the pair is closed): that sender
    goes into `failed` (sender -> why) and none of its buckets is posted from then on, but every other sender's
    still are. Giving up at the first failed post would leave the live senders blocked in sends nobody receives
    until the group's timeout (a sender can die before this receiver even starts: its peers need not be there yet)."""
    posted = {}
    for sender in senders:
        items = entries_of.get((sender, bucket))
        if items is None or sender in failed:
            continue
        if bucket_nbytes(items) == 0:  # a delta bucket where nothing changed: not sent
            posted[(sender, bucket)] = (torch.empty(0, dtype=torch.uint8), None)
            continue
        buf = torch.empty(bucket_nbytes(items), dtype=torch.uint8, device=device())
        try:
            posted[(sender, bucket)] = (buf, group.recv([buf], sender, bucket))
        except Exception as err:  # noqa: BLE001 - raised as SenderFailed once the live senders' buckets are taken
            failed[sender] = f"bucket {bucket}: {type(err).__name__}: {err}"
    return posted


def take_buckets(group, entries: list[WireEntry], failed: dict[int, str],
                 ahead: int | None = 2) -> Iterator[tuple[list[WireEntry], torch.Tensor]]:
    """Yield this receiver's buckets as they arrive, each with its entries: bucket index 0 of every sender (in
    sender order), then index 1, ... Receives are posted one bucket index at a time, for every sender at once:
    indices 0 .. ahead-1 before the first wait, index b + ahead once every sender's bucket b has been consumed (the
    consumer asked for the next bucket). So at most `ahead` indices (plus the one being consumed) are allocated;
    `ahead=None` posts every bucket before the first wait.

    A bucket that fails (its sender died or closed its connections) puts its sender in `failed` and is skipped;
    every other sender's buckets are still taken, so no live sender is left blocked on a receive never posted.

    Why this cannot deadlock with `send_buckets`, whatever its `window` and rotation: a sender issues its sends in
    non-decreasing bucket index (bucket-major), and a receiver waiting on index c has posted every sender's buckets
    of index <= c. Suppose every process were blocked, and let b be the smallest index some receiver R waits on,
    for sender S. R posted (S, b), so if S had issued that send it would complete: S has not issued it, so S is
    blocked waiting on an older send of its own, (R2, b2), with b2 <= b (bucket-major). R2 has not finished (it
    has not taken (S, b2)), so it is blocked on some index c >= b (b is the smallest), hence has posted every
    sender's buckets of index <= c, (S, b2) among them: that send completes, a contradiction. Posting `ahead` > 1
    indices only lets the next buckets travel while one is consumed (loaded)."""
    entries_of: dict[tuple[int, int], list[WireEntry]] = {}
    for e in entries:
        entries_of.setdefault((e.sender, e.bucket), []).append(e)
    senders = sorted({s for s, _ in entries_of})
    last = max((b for _, b in entries_of), default=-1)
    ahead = last + 1 if ahead is None else ahead
    posted: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}
    for b in range(min(ahead, last + 1)):
        posted.update(post_bucket(group, entries_of, senders, b, failed))
    for b in range(last + 1):
        for sender in senders:
            if (sender, b) not in posted:
                continue
            buf, work = posted.pop((sender, b))
            try:
                if work is not None:
                    wait_on_host(work, buf)
            except Exception as err:  # noqa: BLE001 - the other senders' buckets are still taken
                failed.setdefault(sender, f"bucket {b}: {type(err).__name__}: {err}")
                continue
            yield entries_of[(sender, b)], buf
            del buf, work
        if b + ahead <= last:
            posted.update(post_bucket(group, entries_of, senders, b + ahead, failed))


class SenderFailed(RuntimeError):
    """Buckets of one or more senders did not arrive (the sender died or closed its connections)."""


def _sender_failed(failed: dict[int, str]) -> SenderFailed:
    """The error naming every failed sender (sender -> why its first failed bucket failed)."""
    return SenderFailed("; ".join(f"trainer rank {sender} failed to send {why}"
                                  for sender, why in sorted(failed.items())))


class Assembler:
    """Turns arriving buckets into one tensor per HF name of this receiver's slices: a name received as one
    (aligned) piece is a view into its bucket (no copy, the bucket stays alive for it); a name received in pieces
    (from several senders) is copied into a new tensor as each piece arrives. `add` returns the names completed by
    a bucket, so a caller can use each tensor as soon as all its pieces are in."""

    def __init__(self, entries: list[WireEntry]) -> None:
        self.wholes = tile(entries)
        self.missing: dict[str, int] = {}
        for e in entries:
            self.missing[e.block.name] = self.missing.get(e.block.name, 0) + 1
        self.pieces = dict(self.missing)
        self.filling: dict[str, torch.Tensor] = {}

    def add(self, items: list[WireEntry], buf: torch.Tensor,
            decode: Callable[[WireEntry, torch.Tensor], torch.Tensor] | None = None,
            ) -> list[tuple[str, HFSlice, torch.Tensor]]:
        """Take one bucket's pieces; returns (name, slice, tensor) of each name this bucket completed. `decode(entry,
        bytes)` turns a delta-encoded piece into its block (`megarl.sync.delta`); raw pieces are viewed as they are."""
        done = []
        for e in items:
            raw = buf[e.offset:e.offset + e.nbytes]
            whole = self.wholes[e.block.name]
            if e.encoding != "raw":
                if decode is None:
                    raise ValueError(f"{e.block.name}: a {e.encoding} delta piece, but this receiver has no base")
                piece = decode(e, raw)
            else:
                piece = from_bytes(raw if _aligned(e) else raw.clone(), e.dtype, e.block.shape)
            if self.pieces[e.block.name] == 1:
                tensor = piece
            else:
                tensor = self.filling.get(e.block.name)
                if tensor is None:
                    tensor = torch.empty(whole.shape, dtype=getattr(torch, e.dtype), device=buf.device)
                    self.filling[e.block.name] = tensor
                tensor[e.block.index_within(whole)] = piece
            self.missing[e.block.name] -= 1
            if self.missing[e.block.name] == 0:
                self.filling.pop(e.block.name, None)
                done.append((e.block.name, whole, tensor))
        return done


def receive_slices(group, entries: list[WireEntry],
                   keep: Callable[[torch.Tensor], torch.Tensor] = lambda buf: buf, ahead: int | None = None,
                   decode: Callable[[WireEntry, torch.Tensor], torch.Tensor] | None = None,
                   ) -> tuple[dict[str, tuple[HFSlice, torch.Tensor]], int]:
    """Receive and assemble all of this receiver's slices (see `Assembler`), buckets taken as `take_buckets` yields
    them (`ahead` bucket indices posted ahead, None: all before the first wait); each arrived bucket goes through
    `keep` first (`megarl.sync.wire.staged`: on a GPU, to pinned host memory, so the device holds a few buckets,
    not the shard). Returns the slices and the bytes received.

    A sender whose bucket fails (it died, or closed its connections after failing: `SenderFailed` names it) does
    not stop the receive: every other sender's buckets are still taken, so no live sender is left blocked on a
    receive that was dropped, and then `SenderFailed` is raised naming each failed sender. Delta-encoded pieces go
    through `decode` (`Assembler.add`); an error there is raised once every bucket has been taken, for the same
    reason."""
    failed: dict[int, str] = {}  # sender -> why its first failed bucket failed
    assembler = Assembler(entries)
    out: dict[str, tuple[HFSlice, torch.Tensor]] = {}
    received = 0
    broken: Exception | None = None  # decoding failed: the rest is taken, unused, then this is raised
    for items, buf in take_buckets(group, entries, failed, ahead):
        received += buf.numel()
        if failed or broken:  # the update is refused anyway: the bucket is taken (its sender is not left waiting)
            continue
        try:
            for name, whole, tensor in assembler.add(items, keep(buf), decode):
                out[name] = (whole, tensor)
        except Exception as err:  # noqa: BLE001 - raised below, once no sender is left waiting
            broken = err
        del buf
    if failed:
        raise _sender_failed(failed)
    if broken is not None:
        raise broken
    return out, received


class SliceStream:
    """This receiver's slices as an iterator, each HF tensor yielded as soon as all its pieces arrived, for a caller
    that loads them as they come (`sync.receive=streamed`): it holds the buckets posted ahead (`take_buckets`) and
    what the caller keeps of the yielded tensors, never the shard.

    A failed sender stops the yielding, not the receiving: every live sender's buckets are still taken, then the
    iteration raises `SenderFailed`. A caller that stops early (its loader raised) calls `close`, which takes the
    remaining buckets unused for the same reason. `received` counts the bytes that arrived, `delivered` the
    slices yielded."""

    def __init__(self, group, entries: list[WireEntry], ahead: int = 2) -> None:
        self.failed: dict[int, str] = {}
        self.assembler = Assembler(entries)
        self.received = 0
        self.delivered: dict[str, HFSlice] = {}
        self._buckets = take_buckets(group, entries, self.failed, ahead)

    def __iter__(self) -> Iterator[tuple[str, HFSlice, torch.Tensor]]:
        for items, buf in self._buckets:
            self.received += buf.numel()
            if self.failed:
                continue
            done = self.assembler.add(items, buf)
            del buf
            for name, whole, tensor in done:
                self.delivered[name] = whole
                yield name, whole, tensor
        if self.failed:
            raise _sender_failed(self.failed)

    def close(self) -> None:
        """Take every bucket not taken yet, unused (no-op once the iteration has ended)."""
        for _, buf in self._buckets:
            self.received += buf.numel()


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
