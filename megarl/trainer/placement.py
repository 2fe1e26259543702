"""Microbatches onto the model's device once per step, before megatron's schedule runs them.

Every tensor of every microbatch is copied to the device in one pass, so nothing inside the microbatch loop waits
on the host. On CUDA the copies start from pinned (page-locked) host memory and are non-blocking: the host queues
them all and goes on, and the device reads them by DMA in stream order before the first kernel that uses them (a
copy from pageable memory would be staged through a pinned buffer and block the host). On a CPU the tensors are
already where the model is and are passed as they are. The CUDA part is `_to_cuda`, chosen by the device the
policy's parameters are on.
"""

from __future__ import annotations

import torch


def _to_cuda(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on CUDA `device`: from pinned host memory, without blocking the host."""
    if t.device == device:
        return t
    host = t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()
    return host.to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One tensor on `device` (`_to_cuda` on CUDA; a plain move elsewhere, a no-op when already there)."""
    return _to_cuda(t, device) if device.type == "cuda" else t.to(device)


def microbatches_on_device(microbatches: list[dict[str, torch.Tensor]],
                           device: torch.device) -> list[dict[str, torch.Tensor]]:
    """New microbatch dicts with every tensor on `device` (the caller's dicts are left as they are)."""
    return [{k: to_device(v, device) for k, v in mb.items()} for mb in microbatches]
