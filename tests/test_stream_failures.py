"""A sync sender that is gone before a receiver starts, over a real gloo sync group (3 processes: trainer ranks 0
and 1 send, rank 2 receives, as a vLLM worker would).

This is how the store-host failure case hung (trainer rank 1 blocked in its send for the group's whole timeout):
trainer rank 0 died while one vLLM worker of the replica had not yet posted its receives. Posting a receive from a
dead peer raises at once under gloo, and the receiver gave up on every receive, including those of the live
sender. The receiver must still take every live sender's buckets, then refuse naming the dead one."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from megarl.sync.slices import HFSlice
from megarl.sync.wire import WireEntry
from tests.dist_utils import free_port, run_distributed

SHAPE = (4, 256)  # one float32 row: 1 KiB, one bucket per row
TIMEOUT_S = 30  # the sync group's timeout: a live sender left without a receiver fails after this, not at once


def _row(sender: int, bucket: int) -> WireEntry:
    row = 2 * sender + bucket  # sender s holds rows [2s, 2s + 2) and sends one per bucket
    block = HFSlice("w", SHAPE, ((row, row + 1), (0, SHAPE[1])))
    return WireEntry(sender, 2, bucket, 0, SHAPE[1] * 4, block, "float32")


def _rank(rank: int, world: int, port: int, gone: Path) -> dict:
    from megarl.sync.stream import SenderFailed, receive_slices, send_buckets
    from megarl.sync.transport import make_sync_group

    weights = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)
    entries = [_row(s, b) for s in (0, 1) for b in (0, 1)]
    store, group = make_sync_group("127.0.0.1", port, rank, world, TIMEOUT_S)
    if rank == 0:  # gone before anything is sent: its connections close with the group's last reference
        del group, store
        gc.collect()
        gone.touch()
        return {}
    if rank == 1:
        held = HFSlice("w", SHAPE, ((2, 4), (0, SHAPE[1])))
        t0 = time.monotonic()
        sent = send_buckets(group, 1, entries, [(held, weights[2:4])])
        return {"sent": sent, "seconds": time.monotonic() - t0}
    while not gone.exists():  # the receiver starts only once sender 0 is gone
        time.sleep(0.05)
    time.sleep(0.5)  # its closed connections reach this process
    t0 = time.monotonic()
    try:
        receive_slices(group, entries)
    except SenderFailed as err:
        return {"error": str(err), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_sender_gone_before_the_receiver_posts_fails_only_its_own_buckets(tmp_path):
    results = run_distributed(_rank, 3, free_port(), tmp_path / "gone", init_dist=False)
    receiver, live = results[2], results[1]
    assert receiver["error"] is not None and receiver["error"].startswith("trainer rank 0 failed to send bucket 0")
    assert "trainer rank 1" not in receiver["error"], receiver["error"]
    # the live sender's buckets were all taken: both its sends completed, well before the group's timeout
    assert live["sent"].failed == {}, live["sent"].failed
    assert live["sent"].bytes_sent == 2 * SHAPE[1] * 4
    assert live["seconds"] < TIMEOUT_S / 2 and receiver["seconds"] < TIMEOUT_S / 2, (live, receiver)
