"""Delta pushes (`sync.delta`): send each vLLM rank only the elements whose wire-dtype bits changed since the
version it holds.

Both ends keep a *base*: the wire-dtype bits of the last version a rank loaded. A trainer rank keeps, in host
memory, one copy of every block it sends (`SenderBase`, keyed by block, so a block sent to several replicas is kept
once); a vLLM rank keeps the slices it last loaded (`megarl.sync.vllm_receiver`). A delta push names the version
it was computed against, and each block carries a fingerprint of its base bits; the receiver checks both before it
uses a byte. Which ranks get a delta is decided before any byte moves: only a replica whose every worker reports the
senders' base version (`megarl_delta_base`) gets one; a new, restarted or failed replica gets a full push.

Per block, the sender counts the changed elements `c` of `n` (bit comparison, so -0.0 vs 0.0 and NaN payloads
count as changes) and picks the smallest encoding, every part padded to 8 bytes so the receiver can view it in
place:

    indices: int32 positions (4 c bytes), then the c new values        bitmap: ceil(n / 8) bytes, then the c values
    dense:   the n new values (when a delta would not be smaller)        nothing: c = 0 (0 bytes)

`encoded_nbytes` is the whole rule; the receiver writes exactly the c elements into its base (`apply`), which then
holds, bit for bit, what a full push of the new version would have delivered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from megarl.sync.delta_sizes import encoded_nbytes, pad8
from megarl.sync.slices import Box, HFSlice
from megarl.sync.wire import WireEntry

BlockKey = tuple[str, Box]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FINGERPRINT_CHUNK = 1 << 22  # elements widened to int64 at a time


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width (flat): equal bits, equal integers."""
    return t.contiguous().reshape(-1).view(_BITS[t.element_size()])


def changed_mask(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ."""
    return bits(new) != bits(base.to(new.device))


def fingerprint(t: torch.Tensor) -> int:
    """A cheap fingerprint of `t`'s bits (sum of the elements' bit patterns and of every other one, as int64,
    combined): equal bits give equal fingerprints; a different version of a block gives another one unless its
    changes cancel in both sums. Not a cryptographic hash: it guards against a base that is not the one the delta
    was computed against, not against an adversary."""
    flat = bits(t)
    total = odd = 0
    for start in range(0, flat.numel(), _FINGERPRINT_CHUNK):
        chunk = flat[start:start + _FINGERPRINT_CHUNK].to(torch.int64)
        total += int(chunk.sum())
        odd += int(chunk[(start + 1) % 2::2].sum())  # elements at odd positions of the whole block
    return (total * 1_000_003 + odd) % (1 << 62)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool mask -> bitmap, element i in bit i % 8 of byte i // 8."""
    padded = torch.zeros(pad8(mask.numel()), dtype=torch.uint8, device=mask.device)
    padded[:mask.numel()] = mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    return ((bitmap.unsqueeze(1) >> shifts) & 1).reshape(-1)[:n].bool()


def encode(new: torch.Tensor, base: torch.Tensor, encoding: str, nbytes: int) -> torch.Tensor:
    """The wire bytes of block `new` against `base` in `encoding` (`nbytes` long, as `encoded_nbytes` said)."""
    out = torch.zeros(nbytes, dtype=torch.uint8, device=new.device)
    if encoding == "nothing":
        return out
    flat = new.contiguous().reshape(-1)
    if encoding == "dense":
        raw = flat.view(torch.uint8)
        out[:raw.numel()] = raw
        return out
    mask = changed_mask(new, base)
    values = flat[mask].view(torch.uint8)
    head = (mask.nonzero().reshape(-1).to(torch.int32).view(torch.uint8) if encoding == "indices"
            else _pack_bits(mask))
    start = pad8(head.numel())
    if start + values.numel() > nbytes:
        raise ValueError(f"{encoding} delta of {values.numel() // new.element_size()} elements does not fit the "
                         f"{nbytes} bytes planned: the block changed between counting and sending")
    out[:head.numel()] = head
    out[start:start + values.numel()] = values
    return out


def apply(base: torch.Tensor, raw: torch.Tensor, encoding: str, changed: int) -> None:
    """Write a block's delta (`raw`, its wire bytes) into `base` in place: exactly the `changed` elements."""
    if encoding == "nothing":
        return
    n, size = base.numel(), base.element_size()
    if encoding == "dense":
        base.copy_(raw[:n * size].view(base.dtype).reshape(base.shape))
        return
    if encoding == "indices":
        where = raw[:4 * changed].view(torch.int32).to(torch.int64)
        start = pad8(4 * changed)
    elif encoding == "bitmap":
        where = _unpack_bits(raw[:(n + 7) // 8], n).nonzero().reshape(-1)
        start = pad8((n + 7) // 8)
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}")
    if where.numel() != changed:
        raise ValueError(f"{encoding} delta names {where.numel()} elements, the plan {changed}")
    values = raw[start:start + changed * size].view(base.dtype)
    flat = base.view(-1) if base.is_contiguous() else None
    if flat is not None:
        flat[where] = values
    else:  # a view into a larger tensor (a block of a whole slice): write through its flat positions
        staged = base.contiguous().view(-1)
        staged[where] = values
        base.copy_(staged.view(base.shape))


class DeltaRefused(ValueError):
    """A delta push a vLLM worker cannot apply: its base is not the version, or the bits, the delta was computed
    against (the update is refused before the model is touched)."""


def takes_delta(reports: Iterable[dict[str, Any]], version: int | None) -> bool:
    """Whether a replica whose workers answered `megarl_delta_base` with `reports` gets a delta against the
    senders' base `version`: only if every worker holds exactly that version. A worker with no base (version None:
    the replica is new, was restarted, or failed a push), or with another version, a replica with no reports, or no
    senders' base (`version` None) means a full push."""
    return version is not None and {r.get("version") for r in reports} == {version}


def delta_target(base: dict[str, tuple[HFSlice, torch.Tensor]] | None, base_version: int | None,
                 entry: WireEntry, delta_base: int | None) -> torch.Tensor:
    """The receiver's side (`megarl.sync.vllm_receiver`): the view of its base (`base`: name -> the slice it holds
    and its wire-dtype bits, at `base_version`) that `entry`, a delta computed against version `delta_base`, is
    written into, once the base is checked to be that version and the block the bits the delta was computed
    against (`DeltaRefused` if not)."""
    if base is None or base_version is None or base_version != delta_base:
        raise DeltaRefused(f"a delta against version {delta_base}, but this worker holds "
                           f"{'no base' if base is None or base_version is None else f'version {base_version}'}: "
                           "the trainer sends a full push to a worker that does not report the senders' base version")
    held = base.get(entry.block.name)
    if held is None or not held[0].contains(entry.block):
        raise DeltaRefused(f"a delta for {entry.block.name} {entry.block.box}, which this worker's base lacks")
    view = held[1][entry.block.index_within(held[0])]
    if fingerprint(view) != entry.base_sum:
        raise DeltaRefused(f"the base of {entry.block.name} {entry.block.box} is not the one the delta was "
                           f"computed against (fingerprint {fingerprint(view)}, the sender's {entry.base_sum})")
    return view


def block_key(block: HFSlice) -> BlockKey:
    return block.name, block.box


@dataclass
class BlockCount:
    """What a sender found for one block: `changed` of its elements differ from the base, fingerprinted
    `base_sum` (None: no base for it, the block goes dense)."""

    changed: int
    base_sum: int | None


class SenderBase:
    """A trainer rank's copies (host memory, wire dtype) of every block it sent at `version`, for delta pushes.
    `nbytes` is what it holds."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.blocks: dict[BlockKey, tuple[torch.Tensor, int]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.blocks.values())

    def count(self, block: HFSlice, new: torch.Tensor) -> BlockCount:
        held = self.blocks.get(block_key(block))
        if held is None or held[0].shape != new.shape or held[0].dtype != new.dtype:
            return BlockCount(block.numel, None)
        return BlockCount(int(changed_mask(new, held[0]).sum()), held[1])

    def base_of(self, block: HFSlice) -> torch.Tensor:
        return self.blocks[block_key(block)][0]

    def store(self, block: HFSlice, new: torch.Tensor) -> None:
        """Keep `new` as this block's base (reusing the host buffer it had)."""
        key = block_key(block)
        held = self.blocks.get(key)
        if held is None or held[0].shape != new.shape or held[0].dtype != new.dtype:
            copy = torch.empty(new.shape, dtype=new.dtype, pin_memory=new.is_cuda)
        else:
            copy = held[0]
        copy.copy_(new)
        self.blocks[key] = (copy, fingerprint(copy))

    def invalidate(self) -> None:
        """After a push that did not complete: nothing is known to be held anywhere, the next push is full."""
        self.version = None


def delta_layout(entries: list[WireEntry], receivers: set[int], counts: dict[BlockKey, BlockCount],
                 bucket_bytes: int) -> list[WireEntry]:
    """The wire layout of a push where `receivers` take deltas: their entries re-encoded (`encoded_nbytes` from
    `counts`, the senders' counts by block) and re-packed into buckets of at most `bucket_bytes` per
    sender->receiver pair, in plan order; every other entry as it was. A pair whose blocks all stayed the same has
    one bucket of 0 bytes, which is neither sent nor received."""
    out: list[WireEntry] = []
    state: dict[tuple[int, int], tuple[int, int]] = {}  # pair -> (bucket index, bytes used)
    for e in entries:
        if e.receiver not in receivers:
            out.append(e)
            continue
        itemsize = getattr(torch, e.dtype).itemsize
        count = counts[block_key(e.block)]
        if count.base_sum is None:
            encoding, nbytes = "dense", pad8(e.block.numel * itemsize)
        else:
            encoding, nbytes = encoded_nbytes(e.block.numel, count.changed, itemsize)
        bucket, used = state.get((e.sender, e.receiver), (0, 0))
        if used and used + nbytes > bucket_bytes:
            bucket, used = bucket + 1, 0
        # `changed` is the true count (a block sent dense because a delta would not be smaller still reports how
        # many of its elements changed); a dense block needs no base, so it carries no fingerprint
        out.append(replace(e, bucket=bucket, offset=used, nbytes=nbytes, encoding=encoding, changed=count.changed,
                           base_sum=count.base_sum if encoding != "dense" else None))
        state[(e.sender, e.receiver)] = (bucket, used + nbytes)
    return out
