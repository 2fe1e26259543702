"""The weight-sync groups' own operation timeout on NCCL, sized from what one push moves.

On NCCL a dead peer is not noticed by the transport: an operation waiting on it ends only at its group's timeout
(torch's watchdog then aborts that group's communicator, `megarl.sync.transport`). With the trainer's
`trainer.collective_timeout_s` (1,800 s by default, sized for the longest batch generation) a dead replica would hold
a push for half an hour. A sync operation never waits for a generation: it waits at most for its link to carry the
rest of the push it belongs to, and for vLLM's reload of what arrived (streamed). So its timeout is

    timeout = sync.timeout_fixed_s + push_bytes / (sync.timeout_min_gbps x 1e9)

where `push_bytes` is the busiest link's bytes in a full push: the largest of one vLLM worker's shard (what it
receives) and a trainer rank's even share of every replica's shards (what it sends; the planner spreads replicated
blocks over their holders). A delta push moves no more than a full one. The fixed part is also the floor: a push
of a few bytes still gets it. The store rendezvous of a join keeps `trainer.collective_timeout_s` (or
`sync.rejoin_timeout_s`): workers may arrive late, and that wait is not a transfer. On gloo nothing changes (a
dead peer fails most of gloo's operations at once; a send it does not fail is given up by the senders' watch,
`megarl.sync.stream.wait_watching`, docs/sync.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

GB = 10**9


def push_link_bytes(worker_bytes: Iterable[int], replicas: int, trainers: int) -> int:
    """The busiest link's bytes in one full push: the largest vLLM worker's shard, or a trainer rank's share of all
    `replicas` replicas' shards (`worker_bytes`: one replica's TP ranks), whichever is larger."""
    per_worker = list(worker_bytes)
    if not per_worker or replicas < 1 or trainers < 1:
        raise ValueError("a push needs at least one vLLM worker, one replica and one trainer rank")
    return max(max(per_worker), math.ceil(sum(per_worker) * replicas / trainers))


def sync_group_timeout_s(push_bytes: int, min_gbps: float, fixed_s: float) -> float:
    """Seconds one sync-group operation may wait: `fixed_s` plus `push_bytes` at `min_gbps` GB/s."""
    if push_bytes < 0 or min_gbps <= 0 or fixed_s <= 0:
        raise ValueError(f"push_bytes={push_bytes} must be >= 0, min_gbps={min_gbps} and fixed_s={fixed_s} > 0")
    return fixed_s + push_bytes / (min_gbps * GB)
