"""`ReceivedBlock`: what a vLLM weight loader is handed for a tensor this worker holds only part of.

vLLM's loaders take a *full* HF-shaped tensor and cut their rank's part out of it with `narrow` or
slicing. A `ReceivedBlock` has the full shape but stores only the received block: cutting inside
the block returns a real view of the received data; anything that would need data outside it,
or an operation other than a cut, raises `LoaderReadError` naming the tensor and the operation, so
a mismatch between the reshard plan and vLLM's loaders can never load wrong bytes silently. Every
cut is recorded, so the worker can report how many received bytes its loaders actually read.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from megarl.sync.slices import Box, HFSlice

# Functions that only read metadata (shape, dtype, ndim, ...) pass through to the wrapper itself.
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "element_size", "__len__", "is_complex"}


class LoaderReadError(RuntimeError):
    """A vLLM weight loader wanted data this worker did not receive, or used a block in a way it cannot serve."""


class ReadLog:
    """What vLLM's loaders read from the received data in one update: each distinct `(name, box)` once,
    with its byte count and, when `digests` is set, the sha256 of the bytes the loader was handed."""

    def __init__(self, digests: bool = False) -> None:
        self.digests = digests
        self.nbytes: dict[tuple[str, Box], int] = {}
        self.sha256: dict[tuple[str, Box], str] = {}

    def record(self, name: str, box: Box, data: torch.Tensor) -> None:
        key = (name, tuple(tuple(b) for b in box))
        if key in self.nbytes:
            return
        self.nbytes[key] = data.numel() * data.element_size()
        if self.digests:
            self.sha256[key] = sha256_of(data)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


def sha256_of(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (the same bits give the same digest on both sides)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class ReceivedBlock(torch.Tensor):
    """A tensor of `block.full_shape` whose only data is `block`'s (see the module docstring)."""

    _block: HFSlice
    _data: torch.Tensor
    _reads: ReadLog

    @staticmethod
    def __new__(cls, block: HFSlice, data: torch.Tensor, reads: ReadLog) -> ReceivedBlock:
        t = torch.Tensor._make_wrapper_subclass(cls, block.full_shape, dtype=data.dtype, device=data.device)
        t._block, t._data, t._reads = block, data, reads
        return t

    def __repr__(self) -> str:  # the default would try to read the (absent) full data
        return f"ReceivedBlock({self._block.name}, box={self._block.box})"

    def _serve(self, box: list[tuple[int, int]]) -> torch.Tensor:
        want = HFSlice(self._block.name, self._block.full_shape, tuple(box)) if all(a < b for a, b in box) else None
        if want is None:  # an empty cut (e.g. a padding-only vocabulary shard)
            return self._data.new_empty([b - a for a, b in box])
        if not self._block.contains(want):
            raise LoaderReadError(
                f"vLLM's loader for {self._block.name} reads {want.box} but this worker received {self._block.box}: "
                "the needs the plan was made from (megarl.sync.needs) do not match this vLLM version's loaders"
            )
        served = self._data[want.index_within(self._block)]
        self._reads.record(want.name, want.box, served)
        return served

    def _full_box(self) -> list[tuple[int, int]]:
        return [(0, s) for s in self._block.full_shape]

    def _narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self._block.full_shape)
        box = self._full_box()
        box[dim] = (int(start), int(start) + int(length))
        return self._serve(box)

    def _getitem(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        box = self._full_box()
        for dim, item in enumerate(index):
            if not isinstance(item, slice) or item.step not in (None, 1):
                raise LoaderReadError(f"{self._block.name}: index {index!r} is not a plain slice")
            start, stop, _ = item.indices(self._block.full_shape[dim])
            box[dim] = (start, stop)
        return self._serve(box)

    def _derive(self, full_shape: tuple[int, ...], box: tuple[tuple[int, int], ...], data: torch.Tensor):
        return ReceivedBlock(HFSlice(self._block.name, full_shape, box), data, self._reads)

    def _unsqueeze(self, dim: int) -> ReceivedBlock:
        """A new leading/inner dimension of size 1 (FusedMoE adds a dummy expert dimension)."""
        dim = dim % (len(self._block.full_shape) + 1)
        shape, box = list(self._block.full_shape), list(self._block.box)
        shape.insert(dim, 1)
        box.insert(dim, (0, 1))
        return self._derive(tuple(shape), tuple(box), self._data.unsqueeze(dim))

    def _unbind(self, dim: int = 0) -> tuple:
        dim = dim % len(self._block.full_shape)
        if self._block.box[dim] != (0, self._block.full_shape[dim]):
            raise LoaderReadError(f"vLLM's loader unbinds dim {dim} of {self._block.name}, which is only partly held")
        shape = self._block.full_shape[:dim] + self._block.full_shape[dim + 1:]
        box = self._block.box[:dim] + self._block.box[dim + 1:]
        return tuple(self._derive(shape, box, d) for d in self._data.unbind(dim))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args else None
        if isinstance(self, ReceivedBlock):
            if func in (torch.Tensor.narrow, torch.narrow):
                return self._narrow(*args[1:], **kwargs)
            if func is torch.Tensor.__getitem__:
                return self._getitem(args[1])
            if func in (torch.Tensor.unsqueeze, torch.unsqueeze):
                return self._unsqueeze(*args[1:], **kwargs)
            if func in (torch.Tensor.unbind, torch.unbind):
                return self._unbind(*args[1:], **kwargs)
            if getattr(func, "__name__", "") in _METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            name = getattr(func, "__name__", str(func))
            raise LoaderReadError(f"vLLM's loader applied {name} to a partial block of {self._block.name}")
        # the block is an argument of another tensor's method (e.g. param.copy_(block)): only whole blocks
        args = tuple(_whole(a) for a in args)
        kwargs = {k: _whole(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise LoaderReadError(f"vLLM's loader applied {func} to a partial received block")


def _whole(x: Any) -> Any:
    if isinstance(x, ReceivedBlock):
        if x._block.box != tuple(x._full_box()):
            raise LoaderReadError(f"vLLM's loader used all of {x._block.name} but this worker holds {x._block.box}")
        x._reads.record(x._block.name, x._block.box, x._data)
        return x._data
    return x


def wrap(block: HFSlice, data: torch.Tensor, reads: ReadLog) -> torch.Tensor:
    """A plain tensor when the block is the whole HF tensor (recorded as read whole), else a `ReceivedBlock`."""
    if block.box == tuple((0, s) for s in block.full_shape):
        reads.record(block.name, block.box, data)
        return data
    return ReceivedBlock(block, data, reads)
