"""Per-replica sync groups (`megarl.sync.transport`): every join of a replica, a restarted one's rejoin included,
builds its group under a store prefix no earlier join used, so the new workers never meet the keys (addresses) a
dead predecessor left in the trainer's store. Checked on the prefixes before any group is built (a reused prefix
fails here at once, not after gloo's connect and read timeouts), then through real gloo groups in this process:
the trainer's end and each incarnation's worker end join under the prefix the trainer hands out, and a tensor
crosses each new group."""

from __future__ import annotations

import threading

import torch

from megarl.sync.transport import ReplicaGroupsTransport, TorchGroupTransport, replica_group_prefix
from tests.dist_utils import free_port

TIMEOUT_S = 30.0


def test_prefixes_differ_per_replica_and_join():
    prefixes = [replica_group_prefix(r, g) for r in range(4) for g in range(4)]
    assert len(set(prefixes)) == len(prefixes)


def _worker_joins(port: int, prefix: str, out: dict) -> None:
    """A vLLM worker's end (TP rank 0 of a one-worker replica): rank 1 of its replica's group, as
    `PartitionedWeightTransferEngine.init_transfer_engine` builds it from the prefix the trainer sent."""
    try:
        out["transport"] = TorchGroupTransport("127.0.0.1", port, 1, 2, TIMEOUT_S, prefix=prefix)
    except BaseException as err:  # noqa: BLE001 - re-raised by the test
        out["error"] = err


def test_a_rejoining_replica_gets_a_group_under_a_fresh_prefix():
    port = free_port()
    trainer = ReplicaGroupsTransport("127.0.0.1", port, rank=0, trainers=1, tp=1, timeout_s=TIMEOUT_S)
    used: list[str] = []
    try:
        for incarnation in range(3):  # the first join, then two restarts of replica 0
            prefix = trainer.next_prefix(0)
            assert prefix == trainer.next_prefix(0)  # asked twice before a join (the sync, then the join): the same
            assert prefix not in used, f"incarnation {incarnation} of replica 0 reuses the prefix {prefix}"
            assert prefix != trainer.next_prefix(1)
            used.append(prefix)
            worker: dict = {}
            thread = threading.Thread(target=_worker_joins, args=(port, prefix, worker))
            thread.start()
            trainer.join(0)
            thread.join(TIMEOUT_S)
            assert "error" not in worker and "transport" in worker, worker
            sent, got = torch.full((4,), float(incarnation)), torch.zeros(4)
            receive = worker["transport"].group.recv([got], 0, incarnation)
            trainer.groups.groups[0].send([sent], 1, incarnation).wait()
            receive.wait()
            assert torch.equal(got, sent)
            assert trainer.replicas == [0]
            trainer.leave(0)  # the replica died: its group is dropped; a restart rejoins under the next prefix
            worker["transport"].close()
            assert trainer.replicas == []
    finally:
        trainer.close()
