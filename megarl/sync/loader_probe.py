"""`LoaderProbe`: a data-less stand-in for an HF checkpoint tensor that records which block a weight loader reads.

vLLM's weight loaders take a full HF tensor and cut their rank's part out of it (`narrow`, slicing,
`unsqueeze`, `chunk`, ...) before copying it into a parameter. A probe has the full HF shape and no
storage; every cut returns a new probe that remembers, in full-HF coordinates, which block of the
original tensor it stands for. When a loader finally consumes a probe (`param.copy_(probe)` or
`param[...] = probe`), that block is recorded as read. Any other use of a probe (arithmetic, a dtype
conversion that needs data, `.item()`) raises `LoaderProbeError` naming the tensor and the operation, so
an unknown loader fails loudly instead of being recorded wrong.

State of a probe: `box`, one `[start, stop)` per HF dimension (the block it stands for), and `dims`, one
entry per dimension of the probe: the HF dimension it walks, or None for a size-1 dimension a loader added.
A dimension a loader indexed away (`probe[3]`, `unbind`) keeps its one-element range in `box`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megarl.sync.slices import Box

# functions that only read metadata: answered by the wrapper itself
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "element_size", "__len__", "is_complex",
             "is_contiguous", "stride", "storage_offset", "nbytes", "itemsize", "is_meta", "device", "dtype",
             "shape", "ndim", "is_cuda", "is_cpu"}


class LoaderProbeError(RuntimeError):
    """A weight loader used a probe in a way that is not a cut or a copy (the read cannot be described as a block)."""


class ReadRecorder:
    """Every non-empty `(name, full shape, box)` a loader consumed, in order (a name may be read in pieces)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, tuple[int, ...], Box]] = []

    def record(self, probe: LoaderProbe) -> None:
        if probe.numel() == 0:  # a padding-only shard copies nothing
            return
        self.reads.append((probe._name, probe._full_shape, tuple((a, b) for a, b in probe._box)))


class LoaderProbe(torch.Tensor):
    """A data-less HF tensor `name` of `full_shape` standing for block `box` (see the module docstring)."""

    _name: str
    _full_shape: tuple[int, ...]
    _box: list[tuple[int, int]]
    _dims: list[int | None]
    _recorder: ReadRecorder

    @staticmethod
    def __new__(cls, name: str, full_shape: tuple[int, ...], dtype: torch.dtype, recorder: ReadRecorder,
                box: list[tuple[int, int]] | None = None, dims: list[int | None] | None = None) -> LoaderProbe:
        box = box if box is not None else [(0, s) for s in full_shape]
        dims = dims if dims is not None else list(range(len(full_shape)))
        shape = [1 if d is None else box[d][1] - box[d][0] for d in dims]
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("meta"))
        t._name, t._full_shape, t._box, t._dims, t._recorder = name, tuple(full_shape), box, dims, recorder
        return t

    @classmethod
    def full(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype, recorder: ReadRecorder) -> LoaderProbe:
        """The probe for the whole HF tensor."""
        return cls(name, tuple(shape), dtype, recorder)

    def __repr__(self) -> str:
        return f"LoaderProbe({self._name}, box={self._box})"

    def _child(self, box: list[tuple[int, int]], dims: list[int | None], dtype: torch.dtype | None = None):
        return LoaderProbe(self._name, self._full_shape, dtype or self.dtype, self._recorder, box, dims)

    # ---- cuts --------------------------------------------------------------------------------------------------
    def _narrow(self, dim: int, start: int, length: int) -> LoaderProbe:
        dim = dim % len(self._dims)
        size = self.shape[dim]
        start = int(start) % size if int(start) < 0 else int(start)
        if not (0 <= start and start + int(length) <= size):
            raise LoaderProbeError(f"{self._name}: narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        hf = self._dims[dim]
        box = list(self._box)
        if hf is not None:
            base = box[hf][0]
            box[hf] = (base + start, base + start + int(length))
        elif (start, int(length)) != (0, 1):
            raise LoaderProbeError(f"{self._name}: narrow of an added dimension to {start}:{start + length}")
        return self._child(box, list(self._dims))

    def _select(self, dim: int, index: int) -> LoaderProbe:
        dim = dim % len(self._dims)
        index = int(index) % self.shape[dim]
        cut = self._narrow(dim, index, 1)
        return cut._child(cut._box, cut._dims[:dim] + cut._dims[dim + 1:])

    def _getitem(self, index: Any) -> LoaderProbe:
        items = list(index) if isinstance(index, tuple) else [index]
        if any(i is Ellipsis for i in items):
            at = items.index(Ellipsis)
            fill = len(self._dims) - (len(items) - 1 - sum(i is None for i in items))
            items = items[:at] + [slice(None)] * fill + items[at + 1:]
        out, dim = self, 0  # `dim`: the dimension of `out` the next item applies to
        for item in items:
            if item is None:
                out = out._unsqueeze(dim)
                dim += 1
            elif isinstance(item, int) or (isinstance(item, torch.Tensor) and item.ndim == 0 and not item.is_meta):
                out = out._select(dim, int(item))
            elif isinstance(item, slice) and item.step in (None, 1):
                start, stop, _ = item.indices(out.shape[dim])
                out = out._narrow(dim, start, max(stop - start, 0))
                dim += 1
            else:
                raise LoaderProbeError(f"{self._name}: index {index!r} is not a plain slice or integer")
        return out

    def _unsqueeze(self, dim: int) -> LoaderProbe:
        dim = dim % (len(self._dims) + 1)
        return self._child(list(self._box), self._dims[:dim] + [None] + self._dims[dim:])

    def _squeeze(self, dim: int | tuple[int, ...] | None = None) -> LoaderProbe:
        n = len(self._dims)
        which = range(n) if dim is None else [d % n for d in (dim if isinstance(dim, tuple) else (dim,))]
        drop = {d for d in which if self.shape[d] == 1}
        return self._child(list(self._box), [h for i, h in enumerate(self._dims) if i not in drop])

    def _split(self, sizes: list[int], dim: int) -> tuple[LoaderProbe, ...]:
        out, start = [], 0
        for size in sizes:
            out.append(self._narrow(dim, start, size))
            start += size
        return tuple(out)

    def _chunk(self, chunks: int, dim: int = 0) -> tuple[LoaderProbe, ...]:
        size = self.shape[dim % len(self._dims)]
        step = -(-size // int(chunks))
        return self._split([min(step, size - s) for s in range(0, size, step)], dim)

    def _unbind(self, dim: int = 0) -> tuple[LoaderProbe, ...]:
        return tuple(self._select(dim, i) for i in range(self.shape[dim % len(self._dims)]))

    def _permute(self, *order: Any) -> LoaderProbe:
        order = tuple(order[0]) if len(order) == 1 and isinstance(order[0], tuple | list) else order
        return self._child(list(self._box), [self._dims[i % len(self._dims)] for i in order])

    def _transpose(self, a: int = 0, b: int = 1) -> LoaderProbe:
        order = list(range(len(self._dims)))
        order[a], order[b] = order[b], order[a]
        return self._permute(*order)

    def _reshape(self, *shape: Any) -> LoaderProbe:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list | torch.Size) else shape
        if tuple(shape) == tuple(self.shape):
            return self
        raise LoaderProbeError(f"{self._name}: view/reshape {tuple(self.shape)} -> {shape} is not a cut")

    def _to(self, *args: Any, **kwargs: Any) -> LoaderProbe:
        """Device moves and dtype casts keep the block (the loader still reads the same HF elements)."""
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        return self._child(list(self._box), list(self._dims), dtype)

    # ---- consumption -------------------------------------------------------------------------------------------
    def _consumed_by(self, dest: torch.Tensor) -> torch.Tensor:
        if dest.numel() != self.numel():
            raise LoaderProbeError(f"{self._name}: a loader copies {tuple(self.shape)} into a destination of shape "
                                   f"{tuple(dest.shape)} (a broadcast is not a block read)")
        self._recorder.record(self)
        return dest


    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args else None
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], LoaderProbe):
            return args[1]._consumed_by(args[0])
        if func is torch.Tensor.__setitem__ and len(args) > 2 and isinstance(args[2], LoaderProbe):
            return args[2]._consumed_by(args[0][args[1]])
        if isinstance(self, LoaderProbe):
            if func in _CUTS:
                return _CUTS[func](self, *args[1:], **kwargs)
            if getattr(func, "__name__", "") in _METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        involved = next((a for a in (*args, *kwargs.values()) if isinstance(a, LoaderProbe)), None)
        if involved is not None:
            raise LoaderProbeError(f"a weight loader applied {getattr(func, '__name__', func)} to {involved._name} "
                                   f"(block {involved._box}); only cuts (narrow, slicing, chunk, ...) and copies "
                                   "can be recorded")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise LoaderProbeError(f"a weight loader applied {func} to a loader probe, which holds no data")


_CUTS: dict[Callable, Callable] = {
    torch.Tensor.narrow: LoaderProbe._narrow, torch.narrow: LoaderProbe._narrow,
    torch.Tensor.select: LoaderProbe._select, torch.select: LoaderProbe._select,
    torch.Tensor.__getitem__: LoaderProbe._getitem,
    torch.Tensor.unsqueeze: LoaderProbe._unsqueeze, torch.unsqueeze: LoaderProbe._unsqueeze,
    torch.Tensor.squeeze: LoaderProbe._squeeze, torch.squeeze: LoaderProbe._squeeze,
    torch.Tensor.chunk: LoaderProbe._chunk, torch.chunk: LoaderProbe._chunk,
    torch.Tensor.unbind: LoaderProbe._unbind, torch.unbind: LoaderProbe._unbind,
    torch.Tensor.permute: LoaderProbe._permute, torch.permute: LoaderProbe._permute,
    torch.Tensor.transpose: LoaderProbe._transpose, torch.transpose: LoaderProbe._transpose,
    torch.Tensor.t: LoaderProbe._transpose, torch.t: LoaderProbe._transpose,
    torch.Tensor.view: LoaderProbe._reshape, torch.Tensor.reshape: LoaderProbe._reshape,
    torch.Tensor.to: LoaderProbe._to,
    torch.Tensor.contiguous: lambda self, *a, **k: self, torch.Tensor.detach: lambda self: self,
    torch.Tensor.clone: lambda self, *a, **k: self,
}
