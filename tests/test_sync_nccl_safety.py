"""The parts of the NCCL sync's safety that a CPU can run: the sync groups' own timeout against hand numbers, the
join-time pair exchange (`megarl.sync.group_setup.exchange_pairs`) over a real gloo group, and what the NCCL-only
steps do on gloo (nothing: the gloo path stays as it was)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megarl.config.schema import SyncConfig
from megarl.parallel.spawn import free_port
from megarl.parallel.stores import tcp_store
from megarl.sync import group_setup
from megarl.sync.group_timeout import push_link_bytes, sync_group_timeout_s

GB = 10**9


def test_group_timeout_by_hand():
    # 30B recipe: 4 vLLM ranks of 15,285,252,096 bytes each (tests/test_receiver_memory_plan.py), 8 replicas, 32
    # trainer ranks: a trainer's share is 4 x 15.285 GB x 8 / 32 = 15.285 GB, the same as one worker's shard
    shard = 15_285_252_096
    assert push_link_bytes([shard] * 4, 8, 32) == shard
    # 120 s + 15.285 GB at 0.5 GB/s = 120 + 30.570504192 s
    assert sync_group_timeout_s(shard, 0.5, 120.0) == pytest.approx(150.570504192, abs=1e-9)
    # fewer trainer ranks than receiving links' worth: the senders are the busiest links (4 x 10 x 2 / 2 = 40)
    assert push_link_bytes([10, 10, 10, 10], 2, 2) == 40
    assert push_link_bytes([7, 3], 1, 4) == 7  # ceil(10 / 4) = 3 < 7: the largest worker
    assert push_link_bytes([5, 5], 1, 3) == 5  # ceil(10 / 3) = 4
    assert push_link_bytes([9, 9], 1, 4) == 9 and push_link_bytes([9, 9], 3, 4) == 14  # ceil(54 / 4) = 14
    # the fixed part is the floor; 2 GB at 4 GB/s is half a second more
    assert sync_group_timeout_s(0, 0.5, 120.0) == 120.0
    assert sync_group_timeout_s(2 * GB, 4.0, 60.0) == 60.5
    # the defaults are what the field documents, and far below trainer.collective_timeout_s's 1,800 s
    sync = SyncConfig()
    assert (sync.timeout_min_gbps, sync.timeout_fixed_s) == (0.5, 120.0)
    assert sync_group_timeout_s(shard, sync.timeout_min_gbps, sync.timeout_fixed_s) < 1800 / 10
    with pytest.raises(ValueError):
        sync_group_timeout_s(1, 0.0, 1.0)
    with pytest.raises(ValueError):
        push_link_bytes([], 1, 1)


def _gloo_group(port: int, rank: int, world: int):
    store = tcp_store("127.0.0.1", port, world, is_master=rank == 0, timeout_s=30)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("pairs", store), rank, world, timedelta(seconds=30))


def _run_ranks(world: int, body) -> dict[int, object]:
    """`body(group, rank)` on every rank of one gloo group, each rank a thread; their results, or raises the first
    error."""
    port = free_port()
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    stores = {}

    def rank_main(rank: int) -> None:
        try:
            stores[rank], group = _gloo_group(port, rank, world)
            results[rank] = body(group, rank)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_every_trainer_worker_pair_exchanges_one_checked_byte():
    # 3 trainer ranks, 2 workers: each trainer opens 2 pairs, each worker hears from all 3
    trainers, world = 3, 5
    done = _run_ranks(world, lambda g, r: group_setup.exchange_pairs(g, r, trainers, world, torch.device("cpu")))
    assert done == {0: 2, 1: 2, 2: 2, 3: 3, 4: 3}


def test_a_miswired_group_fails_its_handshake():
    # trainer rank 0 sends the byte another rank would send: the worker refuses the join
    def body(group, rank):
        if rank == 0:
            wrong = torch.full((1,), 7, dtype=torch.uint8)
            group.send([wrong], 1, group_setup.HANDSHAKE_TAG).wait()
            return None
        return group_setup.exchange_pairs(group, rank, 1, 2, torch.device("cpu"))

    with pytest.raises(RuntimeError, match=r"rank 1 expected byte 1 from trainer rank 0, got 7"):
        _run_ranks(2, body)


def test_nccl_only_steps_leave_a_gloo_group_as_it_was():
    def body(group, rank):
        assert not group_setup.is_nccl(group)
        group_setup.connect(group, rank, 1, 2)  # nothing on gloo: no message is exchanged ...
        group_setup.abort(group)  # ... and nothing is aborted: the group still carries a message
        buf = torch.full((1,), rank, dtype=torch.int64)
        if rank == 0:
            group.send([buf], 1, 0).wait()
            return 0
        group.recv([buf], 0, 0).wait()
        return int(buf.item())

    assert _run_ranks(2, body) == {0: 0, 1: 0}
    group_setup.free_cached_device_memory()  # no CUDA here: a no-op, not an error
