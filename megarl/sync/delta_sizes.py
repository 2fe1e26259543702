"""The sizes of a delta push on the wire: how a changed block is encoded and how many bytes that takes.

Arithmetic only (no torch), so that `megarl plan` can project delta pushes without importing the tensor code that
encodes them (`megarl.sync.delta`, which uses these)."""

from __future__ import annotations

__all__ = ["bytes_per_element", "encoded_nbytes", "pad8"]


def pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def encoded_nbytes(n: int, changed: int, itemsize: int) -> tuple[str, int]:
    """The encoding of a block of `n` elements, `changed` of which changed, and its size on the wire (8-aligned)."""
    if changed == 0:
        return "nothing", 0
    values = changed * itemsize
    options = [("indices", pad8(4 * changed) + values) if n < 2**31 else ("dense", 1 << 62),
               ("bitmap", pad8((n + 7) // 8) + values), ("dense", n * itemsize)]
    enc, size = min(options, key=lambda o: (o[1], o[0] != "dense"))  # a tie goes to dense (no decoding)
    return enc, pad8(size)


def bytes_per_element(fraction: float, itemsize: int) -> float:
    """Wire bytes per element of a large block where `fraction` of the elements changed (`encoded_nbytes` without
    the padding): for projections (`megarl plan`)."""
    if fraction <= 0:
        return 0.0
    return min(fraction * (4 + itemsize), 1 / 8 + fraction * itemsize, float(itemsize))
