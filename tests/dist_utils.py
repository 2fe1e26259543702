"""Run a function in N real processes joined by a gloo group (torch.multiprocessing spawn).

`run_distributed(fn, world_size, *args)` calls `fn(rank, world_size, *args)` in each process after
`torch.distributed` is initialised, and returns the list of per-rank return values (pickled back
through a queue). An exception in any rank is re-raised here with its traceback.
"""

from __future__ import annotations

import io
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, queue, fn: Callable, args: tuple, init_dist: bool) -> None:
    import torch.distributed as dist

    try:
        if init_dist:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        # serialised to bytes: tensors sent as-is would live in shared memory that dies with this process
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_dist and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, init_dist: bool = True) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, queue, fn, args, init_dist))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in range(world_size):
        rank, ok, value = queue.get()
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
