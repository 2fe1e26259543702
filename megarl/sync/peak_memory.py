"""How much memory a process used during one piece of work: its level before and its peak during, so that
peak - before is what the work added (a vLLM worker's weight push, a sync benchmark's rank).

On a GPU the CUDA caching allocator's counters (`torch.cuda.memory_allocated` before, `max_memory_allocated` after
`reset_peak_memory_stats`): the device memory a push needs beside the served weights. On CPU the kernel's view of
the process: its resident set before (VmRSS) and its high-water mark (VmHWM) since it was reset by writing 5 to
/proc/self/clear_refs (Linux >= 4.0). glibc is first told to map every buffer above 1 MiB on its own
(`map_large_buffers`), so a freed buffer leaves the resident set and a later allocation cannot hide in memory an
earlier one freed.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM) since the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def map_large_buffers() -> None:
    """Fix glibc's mmap threshold at 1 MiB in this process: every larger buffer is mapped when allocated and unmapped
    when freed. Otherwise glibc keeps freed heap memory resident and raises its threshold after large frees, so
    memory freed earlier hides a later allocation from the resident-set peak, by an amount that depends on the
    process's history (an unbounded sender once measured 0.67x its shard). Set with `mallopt` in the process:
    the `MALLOC_MMAP_THRESHOLD_` variable is read once, at start-up, and ranks forked from a server that started
    earlier (`megarl.parallel.spawn`) never read it. Without glibc, nothing is changed."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it also stops its adjustment)
    except (OSError, AttributeError):
        pass


@dataclass
class PeakMemory:
    """One measurement: `PeakMemory.start(cuda)` before the work, `finish()` after it (see the module docstring)."""

    cuda: bool
    before: int | None
    error: str | None = None

    @classmethod
    def start(cls, cuda: bool) -> PeakMemory:
        """Reset the peak and read the level now; on CPU a kernel that refuses the reset is reported, not raised."""
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            return cls(True, torch.cuda.memory_allocated())
        map_large_buffers()
        try:
            reset_peak_rss()
            return cls(False, rss_bytes())
        except OSError as err:
            return cls(False, None, f"cannot reset the resident-set peak: {err}")

    def finish(self) -> dict[str, int | str | None]:
        """The report: what was measured, the level before, the peak since `start` (None where unmeasured)."""
        if self.cuda:
            peak: int | None = torch.cuda.max_memory_allocated()
        else:
            peak = peak_rss_bytes() if self.before is not None else None
        out: dict[str, int | str | None] = {"memory_measured": "cuda_allocated" if self.cuda else "cpu_rss",
                                            "memory_before_bytes": self.before, "memory_peak_bytes": peak}
        if self.error:
            out["memory_error"] = self.error
        return out
