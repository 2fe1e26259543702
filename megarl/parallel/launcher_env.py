"""Where this process sits in the job, read from the environment its launcher gave it.

    torchrun / torch.distributed.run   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    srun (SLURM)                       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST
                                       (or SLURM_JOB_NODELIST): the master is the step's first node

`MEGARL_MASTER_ADDR` / `MEGARL_MASTER_PORT` override the master's address and port under any launcher (for a
cluster whose node names are not the addresses the ranks should use, or emulated nodes that all live on
127.0.0.1). Under SLURM without an explicit port, every rank derives the same one from the job id, so no
rank has to tell the others.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000  # MASTER_PORT under SLURM: base + job id mod span


class LauncherEnvError(RuntimeError):
    """The launcher's environment is incomplete or contradictory; the message names the variable."""


@dataclass(frozen=True)
class ProcessPlace:
    launcher: str  # "torchrun", "slurm", or "local" (spawned by `megarl train` on one machine)
    rank: int  # global rank of this process
    world_size: int
    local_rank: int  # rank on this node (picks the GPU)
    master_addr: str  # where rank 0 hosts the rendezvous
    master_port: int
    # torchrun's agent already serves the rendezvous store at master_addr:master_port (it sets
    # TORCHELASTIC_USE_AGENT_STORE); rank 0 then connects to it instead of hosting its own
    launcher_store: bool = False


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compact host list in order: `node[1-3,7],gpu[08-09]` -> node1 node2 node3 node7 gpu08 gpu09
    (zero padding kept; one bracket group per name, as SLURM writes them)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for number in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{number:0{len(lo)}d}{suffix}")
    return hosts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise LauncherEnvError(f"{name}={env.get(name)!r}: the launcher must set it to an integer") from None


def process_place(env: Mapping[str, str] | None = None) -> ProcessPlace | None:
    """This process's place from torchrun's or srun's variables (torchrun's win when both are set: torchrun
    started inside a SLURM allocation), or None when neither launcher started it."""
    env = os.environ if env is None else env
    addr, port = env.get("MEGARL_MASTER_ADDR"), env.get("MEGARL_MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        place = ProcessPlace("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                             _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                             addr or env.get("MASTER_ADDR") or "",
                             _int(env, "MEGARL_MASTER_PORT" if port else "MASTER_PORT"),
                             launcher_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not port)
    elif "SLURM_PROCID" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if not addr and not nodes:
            raise LauncherEnvError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST are unset: run the ranks with srun, "
                                   "or set MEGARL_MASTER_ADDR")
        place = ProcessPlace("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                             _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                             addr or expand_hostlist(nodes)[0],
                             _int(env, "MEGARL_MASTER_PORT") if port
                             else SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN)
    else:
        return None
    if not place.master_addr:
        raise LauncherEnvError(f"{place.launcher}: no master address (MASTER_ADDR or MEGARL_MASTER_ADDR)")
    if not 0 <= place.rank < place.world_size:
        raise LauncherEnvError(f"{place.launcher}: rank {place.rank} outside a world of {place.world_size}")
    return place
