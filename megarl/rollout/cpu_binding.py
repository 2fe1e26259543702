"""Which CPU cores each vLLM replica's TP workers run on, when the replicas of one node share its cores (CPU fleets).

The rule, for N replicas of tensor parallel TP on the C cores this process may use (`usable_cpus`, its affinity):

* C >= N x TP: replica slot s (0 <= s < N) gets the s-th block of B = C // N consecutive cores, and its rank r the
  r-th run of B // TP consecutive cores of that block (`VLLM_CPU_OMP_THREADS_BIND="a-b|c-d"`, one list per rank).
  No two replicas' workers share a core; the C mod N cores left over, and a block's B mod TP, are pinned to nobody.
* C < N x TP (too few cores to give every rank of every replica one of its own): `VLLM_CPU_OMP_THREADS_BIND=nobind`
  and `OMP_NUM_THREADS=1`: no worker is pinned, and the kernel shares the cores among them, rather than several
  workers pinned to one core while another sits idle.

How vLLM-cpu 0.32 reads it (`vllm/utils/ompmultiprocessing.py`, and /proc on this machine): an explicit list gives
rank r's worker `OMP_NUM_THREADS` = the list's length and OpenMP's binding (`OMP_PROC_BIND`), under which libgomp,
as soon as the worker loads it (its import of torch, right after its spawn), pins the worker's main thread to the
list's *first* core and OpenMP thread i to its i-th; every thread the worker starts later inherits its main thread's
core. So a list "0-1" is not "cores 0 and 1" for the worker's serial work: it is core 0, plus a second OpenMP thread
on core 1. Before this rule every TP-1 replica got "0-1" (all the cores, C // TP of them): every replica's worker on
core 0, and a restarted replica's new worker, pinned there while it still imported torch, starved behind the live
one (3 % of the core for minutes; issue 47). vLLM's reserved cores (`VLLM_CPU_NUM_OF_RESERVED_CPU`, by default TP
per replica on x86, for the engine core and the API server) exist only in its automatic binding (`auto`): with an
explicit list it reserves nothing and pins neither the engine core nor the API server, which run on any core. This
rule reserves none either: on this 2-core machine two TP-1 replicas get one core each ("0" and "1"), and their
engine cores, API servers and the trainer ranks share both cores with them, which vLLM's automatic binding would not
do: each replica, knowing nothing of the other, would take core 0 for its worker and reserve core 1. One replica
gets every core, as before ("0-1" for TP 1, "0|1" for TP 2).

`megarl train`'s fleet divides this machine's cores among all its replicas (N = rollout.replicas). A SLURM job's
replica (`megarl serve`) divides its node's cores among the replicas the job puts on that node (`NODE_REPLICAS_ENV`,
set by slurm/megarl_job.sh and launchers/megarl_nemo.py; slot = replica index mod N, the job's placement), unless SLURM
already confined its step to CPUs of its own (task/affinity or task/cgroup with `--cpus-per-task --exact`: the
step's affinity is then a strict subset of the node's cores), in which case those are the replica's alone (N = 1):
`node_replicas`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

NODE_REPLICAS_ENV = "MEGARL_NODE_REPLICAS"  # how many replicas a job runs on this node (set by the launchers)
NOBIND = "nobind"  # vLLM's VLLM_CPU_OMP_THREADS_BIND value that pins nothing


def rank_cores(cpus: Sequence[int], replicas: int, slot: int, tp: int) -> list[list[int]] | None:
    """The cores of each TP rank of replica `slot` of `replicas` sharing `cpus` (the module's rule); None when there
    are fewer cores than replicas x TP (pin nothing)."""
    if replicas < 1 or tp < 1 or not 0 <= slot < replicas:
        raise ValueError(f"replica slot {slot} of {replicas} replicas, TP {tp}: need 0 <= slot < replicas, TP >= 1")
    cores = sorted(cpus)
    block = len(cores) // replicas
    if block < tp:
        return None
    mine, per = cores[slot * block:(slot + 1) * block], block // tp
    return [mine[r * per:(r + 1) * per] for r in range(tp)]


def _spans(cores: list[int]) -> str:
    """vLLM's list syntax: "0-3,8" for [0, 1, 2, 3, 8]."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def threads_bind(cpus: Sequence[int], replicas: int, slot: int, tp: int) -> dict[str, str]:
    """The environment that binds replica `slot`'s workers by the module's rule: VLLM_CPU_OMP_THREADS_BIND (one list
    per rank, "|"-separated), or `nobind` with OMP_NUM_THREADS=1 when the cores are too few."""
    ranks = rank_cores(cpus, replicas, slot, tp)
    if ranks is None:
        return {"VLLM_CPU_OMP_THREADS_BIND": NOBIND, "OMP_NUM_THREADS": "1"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(_spans(r) for r in ranks)}


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity: a launcher's or SLURM's binding, else every online core)."""
    return sorted(os.sched_getaffinity(0))


def node_replicas(environ: Mapping[str, str], cpus: Sequence[int], online: int) -> int:
    """How many replicas share `cpus` for a `megarl serve` of a SLURM job (see the module's docstring): 1 when the
    step was confined to fewer than the node's `online` cores, else the job's `NODE_REPLICAS_ENV` (1 if unset)."""
    if len(cpus) < online:
        return 1
    value = environ.get(NODE_REPLICAS_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{NODE_REPLICAS_ENV}={value!r}: the number of replicas on this node, 1 or more")
    return int(value)
