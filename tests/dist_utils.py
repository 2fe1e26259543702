"""Run a function in N real processes joined by a gloo group (`megarl.parallel.spawn.run_ranks`).

`run_distributed(fn, world_size, *args)` calls `fn(rank, world_size, *args)` in each process after
`torch.distributed` is initialised (`init_dist=False`: fn joins its own groups), and returns the list of
per-rank return values (serialised back, tensors included). A rank that raises or dies fails the call with a
`RankError` naming it, its traceback attached as a note; the other ranks are stopped, nothing hangs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.parallel.spawn import free_port, run_ranks
from megarl.rollout.fleet_auth import SECRET_ENV
from megarl.sync.failpoints import ENGINE_CORE_COMM

__all__ = ["free_port", "run_distributed"]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, init_dist: bool) -> Any:
    import torch.distributed as dist

    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads

    apply_trainer_cpu_threads(0, world_size, 0)  # each rank its share of the cores, as megarl's own ranks

    if init_dist:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        return fn(rank, world_size, *args)
    finally:
        if init_dist and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, init_dist: bool = True) -> list[Any]:
    return run_ranks(_entry, world_size, world_size, free_port(), fn, args, init_dist, role="test")


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter from /proc (R, S, T: stopped, Z: a zombie, dead but not reaped), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_group_members(*pgids: int) -> list[int]:
    """Running (not zombie) members of the process groups `pgids`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) in pgids and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def engine_core(pgid: int) -> int | None:
    """The `VLLM::EngineCore` process in process group `pgid` (a vLLM server's group: the engine core that owns the
    model and the workers; its comm is cut to 15 characters), from /proc; None if there is none running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and comm.startswith(ENGINE_CORE_COMM) and fields[0] != "Z":
            return int(stat.parent.name)
    return None


def fleet_processes(secret_file: Path) -> list[int]:
    """Running (not zombie) processes other than this one started with the fleet's secret file in their
    environment, from /proc."""
    mark = f"{SECRET_ENV}={secret_file}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) == os.getpid() or mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue  # exited while we looked, or not ours
    return found


def log_grows(log: Path, needle: bytes, offset: int | None = None) -> Callable[[], bool]:
    """A condition to poll: whether `needle` (e.g. a vLLM access line, `b"POST /start_weight_update"`) was written to
    `log` after byte `offset` (the log's present end by default). Each call reads only what was appended since the
    last one (keeping enough of it to find a needle cut between two reads)."""
    at, tail = log.stat().st_size if offset is None else offset, b""

    def grown() -> bool:
        nonlocal at, tail
        with log.open("rb") as f:
            f.seek(at)
            new = f.read()
        at += len(new)
        seen, tail = tail + new, (tail + new)[-len(needle):]
        return needle in seen
    return grown
