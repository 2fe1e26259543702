"""`LoaderProbe` (no vLLM): the block a probe records equals what the same cuts take out of a real tensor."""

from __future__ import annotations

import pytest
import torch

from megarl.sync.loader_probe import LoaderProbe, LoaderProbeError, ReadRecorder

SHAPE = (6, 8, 4)
CUTS = {
    "narrow": lambda t: t.narrow(1, 2, 4),
    "narrow twice": lambda t: t.narrow(0, 1, 4).narrow(0, 2, 2),
    "slice": lambda t: t[1:3, :, 2:],
    "int index and ellipsis": lambda t: t[2, ..., 1:3],
    "unsqueeze then narrow": lambda t: t.unsqueeze(0).narrow(2, 4, 4),
    "chunk": lambda t: t.chunk(3, dim=1)[2],
    "unbind": lambda t: t.unbind(0)[5],
    "transpose then narrow": lambda t: t.transpose(0, 2).narrow(2, 3, 2),
    "to and contiguous": lambda t: t[:, 1:2].to(torch.float64).contiguous(),
}


@pytest.mark.parametrize("name", list(CUTS))
def test_recorded_block_holds_exactly_what_the_cut_takes(name):
    real = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
    recorder = ReadRecorder()
    probe = CUTS[name](LoaderProbe.full("w", SHAPE, torch.float32, recorder))
    cut = CUTS[name](real)
    assert tuple(probe.shape) == tuple(cut.shape)
    dest = torch.empty(cut.shape)
    assert dest.copy_(probe) is dest  # a copy consumes the probe: recorded, nothing moved
    [(read_name, full_shape, box)] = recorder.reads
    assert (read_name, full_shape) == ("w", SHAPE)
    block = real[tuple(slice(a, b) for a, b in box)]
    assert torch.equal(block.flatten().sort().values, cut.to(torch.float32).flatten().sort().values)


def test_setitem_records_and_a_cut_alone_records_nothing():
    recorder = ReadRecorder()
    probe = LoaderProbe.full("w", (4, 4), torch.float32, recorder)
    probe.narrow(0, 0, 2)  # cut but never copied: not read
    assert recorder.reads == []
    dest = torch.empty(4, 4)
    dest[2:] = probe[2:]
    assert recorder.reads == [("w", (4, 4), ((2, 4), (0, 4)))]


@pytest.mark.parametrize("use", [lambda p: p * 2, lambda p: p.sum(), lambda p: p.view(16),
                                 lambda p: torch.empty(2, 4).copy_(p[:1])])
def test_anything_but_cuts_and_exact_copies_raises(use):
    probe = LoaderProbe.full("w", (4, 4), torch.float32, ReadRecorder())
    with pytest.raises(LoaderProbeError, match="w"):
        use(probe)


def test_pieces_that_tile_a_block_merge_and_others_raise():
    from megarl.sync.loader_reads import merge_reads

    rows = [("w", (8, 4), ((0, 2), (0, 4))), ("w", (8, 4), ((2, 4), (0, 4))), ("w", (8, 4), ((0, 2), (0, 4)))]
    assert [(s.name, s.box) for s in merge_reads(rows)] == [("w", ((0, 4), (0, 4)))]  # row chunks, one repeated
    with pytest.raises(ValueError, match="not one block"):
        merge_reads([("w", (8, 4), ((0, 2), (0, 4))), ("w", (8, 4), ((4, 6), (0, 4)))])  # a gap
    with pytest.raises(ValueError, match="not one block"):
        merge_reads([("w", (8, 4), ((0, 3), (0, 4))), ("w", (8, 4), ((2, 4), (0, 4)))])  # an overlap
