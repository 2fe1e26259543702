"""`HFSlice`: a rectangular block of one Hugging Face parameter, the unit of the partitioned sync.

Both sides of a weight sync describe what they hold in the coordinates of the full HF tensor: a
trainer rank holds slices cut out of its megatron shards, a vLLM rank needs the slices its weight
loaders read. The reshard planner intersects the two; the transport moves exactly those bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class HFSlice:
    """The block `box` (per dimension, half-open `[start, stop)`) of HF parameter `name`."""

    name: str
    full_shape: tuple[int, ...]
    box: Box

    def __post_init__(self) -> None:
        if len(self.box) != len(self.full_shape):
            raise ValueError(f"{self.name}: box {self.box} has the wrong rank for shape {self.full_shape}")
        for (start, stop), size in zip(self.box, self.full_shape, strict=True):
            if not 0 <= start < stop <= size:
                raise ValueError(f"{self.name}: box {self.box} is empty or outside shape {self.full_shape}")

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> HFSlice:
        return cls(name, tuple(shape), tuple((0, s) for s in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @cached_property
    def numel(self) -> int:  # cached: a plan at 30B scale sums it over millions of blocks
        return math.prod(self.shape)

    def intersect(self, other: HFSlice) -> HFSlice | None:
        """The common block of two slices of the same parameter, or None if they do not overlap."""
        if other.name != self.name:
            return None
        box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(self.box, other.box, strict=True))
        if any(start >= stop for start, stop in box):
            return None
        return HFSlice(self.name, self.full_shape, box)

    def contains(self, other: HFSlice) -> bool:
        return other.name == self.name and all(
            a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(self.box, other.box, strict=True)
        )

    def index_within(self, outer: HFSlice) -> tuple[slice, ...]:
        """Index that cuts this block out of a tensor holding `outer` (which must contain it)."""
        if not outer.contains(self):
            raise ValueError(f"{self} is not inside {outer}")
        return tuple(slice(b0 - a0, b1 - a0) for (a0, _), (b0, b1) in zip(outer.box, self.box, strict=True))
