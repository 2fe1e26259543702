"""Delta pushes' encoding and wire (`megarl.sync.delta`), checked against references written here:

- a block written by `apply` holds, bit for bit, the new tensor (fp32, bf16, fp16; NaN payloads and -0.0 count as
  changes; a column block of a larger tensor, as a receiver's base holds it);
- the bytes on the wire follow the rule stated in docs/sync.md, re-derived here from the counts: int32 positions
  or a bitmap, whichever is smaller, then the values, each part 8-aligned; the whole block when that is not
  smaller; nothing for an unchanged block;
- through real gloo processes (`send_buckets` / `receive_slices`), a receiver holding the base gets exactly those
  bytes and ends with the new tensors; a pair where nothing changed moves no message.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.sync.delta import (
    BlockCount,
    DeltaRefused,
    SenderBase,
    apply,
    delta_layout,
    delta_target,
    encode,
    encoded_nbytes,
    fingerprint,
    takes_delta,
)
from megarl.sync.plan import Transfer
from megarl.sync.slices import HFSlice
from megarl.sync.wire import WireEntry, layout_buckets
from tests.dist_utils import run_distributed


def _wire_size(n: int, changed: int, itemsize: int) -> int:
    """The rule of docs/sync.md, written out independently of the code."""
    if changed == 0:
        return 0
    align = lambda b: -(-b // 8) * 8  # noqa: E731
    indices = align(4 * changed) + changed * itemsize
    bitmap = align(math.ceil(n / 8)) + changed * itemsize
    return align(min(indices, bitmap, n * itemsize))


def _changed(base: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    mask = torch.rand(base.shape, generator=g) < fraction
    new[mask] = new[mask] + torch.randn(int(mask.sum()), generator=g).to(base.dtype)
    return new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.05, 0.3, 1.0])
def test_apply_makes_the_base_the_new_tensor_bit_for_bit(dtype, fraction):
    base = torch.randn(37, 53).to(dtype)
    new = _changed(base, fraction, seed=int(fraction * 1000))
    changed = int((new.view(torch.uint8).view(-1, dtype.itemsize) != base.view(torch.uint8).view(-1, dtype.itemsize))
                  .any(dim=1).sum())
    encoding, nbytes = encoded_nbytes(base.numel(), changed, dtype.itemsize)
    assert nbytes == _wire_size(base.numel(), changed, dtype.itemsize)
    wire = encode(new, base, encoding, nbytes)
    assert wire.numel() == nbytes
    target = base.clone()
    apply(target, wire, encoding, changed)
    assert _same_bits(target, new)


def test_bit_changes_that_compare_equal_are_sent():
    """-0.0 == 0.0 and NaN != NaN as floats; the delta compares bits, so both the sign flip and a NaN payload that
    changed are sent, and an unchanged NaN is not."""
    base = torch.tensor([0.0, float("nan"), 1.0, float("nan"), 2.0])
    new = base.clone()
    new[0] = -0.0
    bits = new.view(torch.int32)
    bits[1] = bits[1] | 1  # another NaN payload
    encoding, nbytes = encoded_nbytes(5, 2, 4)
    wire = encode(new, base, encoding, nbytes)
    target = base.clone()
    apply(target, wire, encoding, 2)
    assert _same_bits(target, new)


def test_a_block_of_a_larger_base_is_written_in_place():
    """A receiver's base holds a whole slice; a delta for one column block of it writes only that block."""
    whole = torch.randn(16, 24)
    keep = whole.clone()
    block = whole[:, 8:16]  # not contiguous
    new = _changed(block.contiguous(), 0.1, seed=3)
    changed = int((new != block).sum())
    encoding, nbytes = encoded_nbytes(block.numel(), changed, 4)
    apply(block, encode(new, block.contiguous(), encoding, nbytes), encoding, changed)
    assert _same_bits(whole[:, 8:16], new)
    assert _same_bits(whole[:, :8], keep[:, :8]) and _same_bits(whole[:, 16:], keep[:, 16:])


def test_fingerprint_sees_one_changed_element_and_ignores_storage():
    t = torch.randn(1000)
    other = t.clone()
    other[500] = torch.nextafter(other[500], torch.tensor(10.0))  # one bit pattern one step away
    assert fingerprint(t) == fingerprint(t.clone()) != fingerprint(other)
    view = torch.randn(8, 8)[:, 2:4]
    assert fingerprint(view) == fingerprint(view.contiguous())
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same elements in another order
    assert fingerprint(swapped) != fingerprint(t)


def test_delta_layout_packs_only_the_delta_receivers_buckets():
    shape = (64, 64)
    blocks = [HFSlice.whole(f"w{i}", shape) for i in range(4)]
    plan = [Transfer(sender=0, receiver=r, block=b) for r in (1, 2) for b in blocks]
    full = layout_buckets(plan, {b.name: torch.float32 for b in blocks}, bucket_bytes=4096 * 4)
    counts = {("w0", blocks[0].box): BlockCount(0, 7), ("w1", blocks[1].box): BlockCount(5, 7),
              ("w2", blocks[2].box): BlockCount(4096, 7), ("w3", blocks[3].box): BlockCount(300, None)}
    out = delta_layout(full, {2}, counts, bucket_bytes=4096 * 4)
    assert [e for e in out if e.receiver == 1] == [e for e in full if e.receiver == 1]  # the full-push receiver
    mine = [e for e in out if e.receiver == 2]
    assert [e.encoding for e in mine] == ["nothing", "indices", "dense", "dense"]  # w3: no base -> dense
    assert [e.nbytes for e in mine] == [0, _wire_size(4096, 5, 4), 4096 * 4, 4096 * 4]
    assert [e.changed for e in mine] == [0, 5, 4096, 300]  # the counts, also for blocks sent whole
    for bucket in {e.bucket for e in mine}:  # every bucket within the limit (a block larger travels alone)
        items = [e for e in mine if e.bucket == bucket]
        assert sum(e.nbytes for e in items) <= 4096 * 4 or len([e for e in items if e.nbytes]) == 1
        assert [e.offset for e in items] == [sum(x.nbytes for x in items[:i]) for i in range(len(items))]


def _wire_roundtrip(rank: int, world: int, port: int, fraction: float) -> dict:
    """Sender (rank 0) and receiver (rank 1) hold the same base; the sender's tensors then change by `fraction`
    (one tensor not at all) and it sends a delta; the receiver decodes it into its base."""
    from datetime import timedelta

    import torch.distributed as dist

    from megarl.sync.stream import holders_by_name, receive_slices, send_buckets

    group = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, world, rank == 0), rank, world,
                                  timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    names = {"a": (300, 40), "b": (1000,), "c": (64, 64)}
    base = {n: torch.randn(s, generator=g) for n, s in names.items()}
    new = {n: _changed(t, fraction if n != "b" else 0.0, seed=i) for i, (n, t) in enumerate(base.items())}
    blocks = {n: HFSlice.whole(n, s) for n, s in names.items()}
    full = layout_buckets([Transfer(0, 1, b) for b in blocks.values()], {n: torch.float32 for n in names}, 8192)
    sender = SenderBase()
    for n, b in blocks.items():
        sender.store(b, base[n])
    counts = {(b.name, b.box): sender.count(b, new[n]) for n, b in blocks.items()}
    entries = delta_layout(full, {1}, counts, bucket_bytes=8192)
    if rank == 0:
        local = [(blocks[n], new[n]) for n in names]
        by_name = holders_by_name(local)

        def pack(e, block):
            return encode(block, sender.base_of(e.block), e.encoding, e.nbytes)

        result = send_buckets(group, 0, entries, local, pack=pack)
        del by_name
        return {"sent": result.bytes_sent, "buckets": result.buckets}
    held = {n: (blocks[n], base[n].clone()) for n in names}

    def decode(e, raw):
        if e.encoding == "dense":
            return raw[:e.block.numel * 4].view(torch.float32).reshape(e.block.shape)
        assert fingerprint(held[e.block.name][1]) == e.base_sum
        apply(held[e.block.name][1], raw, e.encoding, e.changed)
        return held[e.block.name][1]

    got, received = receive_slices(group, entries, decode=decode)
    expect = sum(_wire_size(math.prod(s), int((new[n] != base[n]).sum()), 4) for n, s in names.items())
    return {"received": received, "expect": expect, "equal": all(_same_bits(got[n][1], new[n]) for n in names)}


@pytest.mark.parametrize("fraction", [0.01, 0.6])
def test_a_delta_crosses_real_processes_exactly(fraction):
    from tests.dist_utils import free_port

    sender, receiver = run_distributed(_wire_roundtrip, 2, free_port(), fraction, init_dist=False)
    assert receiver["equal"]
    assert receiver["received"] == sender["sent"] == receiver["expect"] > 0


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ONE_SHAPE = (16, 24)  # 384 elements: bitmap bytes 48, so one changed element goes as int32 positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("position", [0, 7, 8, 63, 64, 200, 383])  # first, a bitmap byte's last/first, last
def test_exactly_one_changed_element_is_counted_sent_and_applied(dtype, position):
    """A block where exactly one element moved by one unit in the last place: the sender counts one change (not
    zero), the wire entry carries it in the size the rule gives for one element, and the receiver's base ends
    with the new bits; every encoding that can carry it (positions, bitmap) round-trips it too."""
    base = torch.randn(ONE_SHAPE, generator=torch.Generator().manual_seed(position)).to(dtype)
    new = base.clone()
    new.view(_INT_OF[dtype.itemsize]).view(-1)[position] += 1  # the next representable value: one bit pattern
    assert int((new.view(_INT_OF[dtype.itemsize]) != base.view(_INT_OF[dtype.itemsize])).sum()) == 1
    block = HFSlice.whole("w", ONE_SHAPE)
    sender = SenderBase()
    sender.store(block, base)
    count = sender.count(block, new)
    assert count.changed == 1 and count.base_sum == fingerprint(base)
    full = layout_buckets([Transfer(0, 1, block)], {"w": dtype}, bucket_bytes=1 << 20)
    (entry,) = delta_layout(full, {1}, {("w", block.box): count}, bucket_bytes=1 << 20)
    n = math.prod(ONE_SHAPE)
    assert entry.encoding == "indices" and entry.changed == 1 and entry.base_sum == fingerprint(base)
    assert entry.nbytes == _wire_size(n, 1, dtype.itemsize) == 8 + (dtype.itemsize + 7) // 8 * 8
    target = base.clone()
    apply(target, encode(new, sender.base_of(block), entry.encoding, entry.nbytes), entry.encoding, entry.changed)
    assert _same_bits(target, new)
    # each sparse encoding on its own, sized by hand: 8 bytes of one int32 position or 48 of bitmap, then the value
    for encoding, head in (("indices", 8), ("bitmap", n // 8)):
        size = head + (dtype.itemsize + 7) // 8 * 8
        wire = encode(new, base, encoding, size)
        target = base.clone()
        apply(target, wire, encoding, 1)
        assert _same_bits(target, new)


@pytest.mark.parametrize("reports, expect", [
    ([{"rank": 0, "version": 3}, {"rank": 1, "version": 3}], True),  # every worker holds the senders' base
    ([{"rank": 0, "version": None}, {"rank": 1, "version": None}], False),  # restarted: its workers hold no base
    ([{"rank": 0, "version": 3}, {"rank": 1, "version": None}], False),  # one worker without a base
    ([{"rank": 0, "version": None}], False),
    ([{"rank": 0, "version": 2}, {"rank": 1, "version": 2}], False),  # an older version
    ([{"rank": 0}], False),  # a worker that does not say
    ([], False),  # no worker answered
])
def test_only_a_replica_holding_the_senders_base_takes_a_delta(reports, expect):
    assert takes_delta(reports, 3) is expect
    assert takes_delta(reports, None) is False  # the senders hold no base: every replica gets a full push


def _receiver_base() -> tuple[dict, HFSlice, torch.Tensor]:
    """A receiver's base: a whole [8, 12] slice "w", its bits, and the column block [:, 4:8] of it."""
    whole = HFSlice.whole("w", (8, 12))
    bits = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    block = HFSlice("w", (8, 12), ((0, 8), (4, 8)))
    return {"w": (whole, bits)}, block, bits


def _delta_entry(block: HFSlice, base_bits: torch.Tensor, new: torch.Tensor) -> tuple[WireEntry, torch.Tensor]:
    changed = int((new != base_bits).sum())
    encoding, nbytes = encoded_nbytes(block.numel, changed, 4)
    entry = WireEntry(0, 1, 0, 0, nbytes, block, "float32", encoding, changed, fingerprint(base_bits))
    return entry, encode(new, base_bits, encoding, nbytes)


def test_the_receiver_writes_a_delta_into_its_base_of_that_version():
    base, block, bits = _receiver_base()
    old = bits[:, 4:8].clone()
    new = old.clone()
    new[3, 2] += 1.0
    entry, wire = _delta_entry(block, old, new)
    view = delta_target(base, 4, entry, delta_base=4)
    apply(view, wire, entry.encoding, entry.changed)
    assert _same_bits(bits[:, 4:8], new) and _same_bits(base["w"][1][:, 4:8], new)


@pytest.mark.parametrize("held_version, has_base", [(3, True), (None, False), (5, True)])
def test_the_receiver_refuses_a_delta_against_another_version(held_version, has_base):
    """A worker holding version 3 (or none) gets a delta computed against version 4 of a block whose bits did not
    change between 3 and 4, so the block's fingerprint matches: only the version check can refuse it."""
    base, block, bits = _receiver_base()
    new = bits[:, 4:8].clone()
    new[0, 0] += 1.0
    entry, _ = _delta_entry(block, bits[:, 4:8].clone(), new)
    with pytest.raises(DeltaRefused, match="a delta against version 4, but this worker holds "
                       + ("no base" if not has_base else f"version {held_version}")):
        delta_target(base if has_base else None, held_version, entry, delta_base=4)
    if has_base:  # a base dict whose version is unknown is no base either
        with pytest.raises(DeltaRefused, match="holds no base"):
            delta_target(base, None, entry, delta_base=4)


def test_the_receiver_refuses_a_delta_for_other_bits_or_a_block_it_lacks():
    base, block, bits = _receiver_base()
    new = bits[:, 4:8].clone()
    new[1, 1] += 1.0
    stale = bits[:, 4:8].clone()
    stale[2, 2] -= 1.0  # the sender's base differs from the receiver's in one element
    entry, _ = _delta_entry(block, stale, new)
    with pytest.raises(DeltaRefused, match="is not the one the delta was computed against"):
        delta_target(base, 4, entry, delta_base=4)
    other, _ = _delta_entry(HFSlice.whole("v", (8, 4)), bits[:, 4:8].clone(), new)
    with pytest.raises(DeltaRefused, match="which this worker's base lacks"):
        delta_target(base, 4, other, delta_base=4)
