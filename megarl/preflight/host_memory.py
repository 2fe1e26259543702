"""Does a replica's step have the host memory its pushes will take? On a GPU fleet each vLLM rank of a staged
receiver pins its whole shard in host memory (15.3 GB per rank at Qwen3-30B-A3B, rollout.tp 4), on top of vLLM's
own; the step's memory limit (its cgroup's, as SLURM's --mem sets it, else the node's) must hold the replica's
figure (`megarl.roles.gpu_replica_host_mb`, what `megarl plan` prints), or the step is killed at its first push."""

from __future__ import annotations

from pathlib import Path

MIB = 1 << 20
UNLIMITED = 1 << 60  # a cgroup v1 limit at least this large means "no limit"


def cgroup_limit_bytes(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of the cgroup named in `proc_cgroup` (the text of /proc/self/cgroup): cgroup v2's
    `memory.max` or v1's `memory.limit_in_bytes`; None when unlimited or not readable."""
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        limit = root / path.lstrip("/") / "memory.max" if v2 else root / "memory" / path.lstrip("/") / \
            "memory.limit_in_bytes"
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= UNLIMITED:
            return None
        return int(text)
    return None


def mem_total_bytes(meminfo: str) -> int | None:
    """MemTotal of /proc/meminfo's text, in bytes."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def step_memory_bytes() -> int | None:
    """The host memory this step may use: its cgroup's limit, else the node's total; None if neither is readable."""
    try:
        limit = cgroup_limit_bytes(Path("/proc/self/cgroup").read_text())
    except OSError:
        limit = None
    if limit is not None:
        return limit
    try:
        return mem_total_bytes(Path("/proc/meminfo").read_text())
    except OSError:
        return None


def host_memory_finding(need_mb: int, have_bytes: int | None, replica: int) -> str | None:
    """A finding when replica `replica`'s step has less host memory than its `need_mb` (MB); None if it has enough or
    its memory could not be read."""
    if have_bytes is None or have_bytes >= need_mb * MIB:
        return None
    return (f"rollout replica {replica}'s step may use {have_bytes // MIB} MB of host memory but needs {need_mb} MB "
            "(its vLLM ranks and, with sync.receive=staged, each rank's shard pinned: `megarl plan`): give the step "
            "more memory (--mem), fewer replicas per node, or set sync.receive=streamed")
