"""The cores the kernel lets a vLLM server's workers run on, read from /proc (megarl/rollout/cpu_binding.py's tests)."""

from __future__ import annotations

from pathlib import Path


def cores_of(spec: str) -> set[int]:
    """The cores named by a list such as "0-1,4" (Cpus_allowed_list) or "0-1|4,6" (VLLM_CPU_OMP_THREADS_BIND)."""
    out: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, todo = [], [pid]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return found


def allowed_cores(pid: int) -> set[int]:
    """The cores the kernel lets process `pid`'s main thread run on (its Cpus_allowed_list)."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Cpus_allowed_list"))
    return cores_of(line.split(":", 1)[1].strip())


def worker_cores(server: int) -> list[set[int]]:
    """The allowed cores of each vLLM worker (`VLLM::Worker...`, by its process title) below vLLM server `server`."""
    found = []
    for pid in descendants(server):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            if title.startswith(b"VLLM::Worker"):
                found.append(allowed_cores(pid))
        except OSError:
            continue
    return found
