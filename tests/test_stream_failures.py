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

import pytest
import torch

from megarl.sync.slices import HFSlice
from megarl.sync.wire import WireEntry
from tests.dist_utils import free_port, process_state, run_distributed

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



# ---- a receiver that dies after posting its receives: gloo does not fail the sends to it that follow -----------------
BIG = 1 << 24  # float32 elements of one bucket: 64 MiB (the hang needs buckets that take a while on the wire)
BUCKETS = 4  # per (sender, receiver) pair
DEAD_TIMEOUT_S = 60  # the group's timeout: without `gone`, the senders' waits on the dead receiver end only here


def _dead_receiver_rank(rank: int, port: int, tmp: Path, watch: bool) -> None:
    """Trainer ranks 0 and 1 send `BUCKETS` buckets to each of vLLM workers 2 and 3, which post every receive first
    (a staged CPU receiver); worker 3 SIGKILLs itself once it holds its first bucket (an OOM kill mid-transfer).
    `watch`: the senders' `gone` says worker 3 is gone once its pid is (as trainer rank 0's failed update call says
    it of a replica). Each survivor saves what it saw to `tmp/rank<r>.pt`."""
    import os
    import signal

    from megarl.sync.stream import receive_slices, send_buckets, take_buckets
    from megarl.sync.transport import make_sync_group

    shape = (2 * BUCKETS, BIG)  # tensor w<r>, worker r's: one row per (sender, bucket)
    entries = [WireEntry(s, r, b, 0, BIG * 4, HFSlice(f"w{r}", shape, ((s * BUCKETS + b, s * BUCKETS + b + 1),
                                                                       (0, BIG))), "float32")
               for s in (0, 1) for r in (2, 3) for b in range(BUCKETS)]
    store, group = make_sync_group("127.0.0.1", port, rank, 4, DEAD_TIMEOUT_S)
    pid_file, t0 = tmp / "dead.pid", time.monotonic()
    if rank == 3:
        for _ in take_buckets(group, [e for e in entries if e.receiver == 3], {}, ahead=None):
            written = tmp / "dead.pid.partial"  # whole when it appears: a reader never sees it half written
            written.write_text(str(os.getpid()))
            os.replace(written, pid_file)
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        got, received = receive_slices(group, [e for e in entries if e.receiver == 2])
        torch.save({"received": received, "seconds": time.monotonic() - t0}, tmp / "rank2.pt")
        return

    def gone(receiver: int) -> str | None:
        if receiver != 3 or not pid_file.exists():
            return None
        return "worker 3 died" if process_state(int(pid_file.read_text())) in (None, "Z") else None

    mine = [(e.block, torch.full((1, BIG), float(e.bucket))) for e in entries if e.sender == rank]
    sent = send_buckets(group, rank, entries, mine, gone=gone if watch else None, slice_s=0.2)
    torch.save({"failed": sent.failed, "bytes_sent": sent.bytes_sent, "seconds": time.monotonic() - t0},
               tmp / f"rank{rank}.pt")
    del group, store  # its connections close (an abandoned send's thread is left waiting on its own buffer)
    gc.collect()


def _send_to_a_receiver_that_dies(tmp: Path, watch: bool) -> dict[int, dict]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    tmp.mkdir()
    port = free_port()
    procs = [ctx.Process(target=_dead_receiver_rank, args=(r, port, tmp, watch)) for r in range(4)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + DEAD_TIMEOUT_S + 120
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    seen = {r: torch.load(tmp / f"rank{r}.pt") for r in range(3) if (tmp / f"rank{r}.pt").exists()}
    for r in seen:
        seen[r]["exitcode"] = procs[r].exitcode
    return seen


def test_a_receiver_that_dies_mid_transfer_is_given_up_within_a_slice(tmp_path):
    """The staged-receive OOM case of issue 36 at the transport: a vLLM worker that posted its receives dies after
    its first bucket. gloo does not fail the sends to it that follow (see `test_..._unless_watched`); with `gone`
    watching it, both trainer ranks record worker 3 as failed within seconds and still deliver every bucket of
    worker 2."""
    seen = _send_to_a_receiver_that_dies(tmp_path / "watched", watch=True)
    assert set(seen) == {0, 1, 2}, seen
    for rank in (0, 1):
        assert set(seen[rank]["failed"]) == {3}, seen[rank]  # ReceiverGone, or gloo's own error when it has one
        assert seen[rank]["seconds"] < DEAD_TIMEOUT_S / 2, seen[rank]  # 5-13 s of sending on a loaded 2-core box
        assert seen[rank]["exitcode"] == 0, seen[rank]  # a send left behind does not crash the process at its exit
    assert seen[2]["received"] == 2 * BUCKETS * BIG * 4, seen[2]  # the live worker got every bucket
    print(f"receiver died mid-transfer, watched: senders done in {[round(seen[r]['seconds'], 1) for r in (0, 1)]} s: "
          f"{[seen[r]['failed'][3][-60:] for r in (0, 1)]}")


@pytest.mark.slow
def test_a_receiver_that_dies_mid_transfer_holds_the_senders_until_the_timeout_unless_watched(tmp_path):
    """Without `gone` the same death holds a sender until the group's timeout (what the issue saw for minutes)."""
    seen = _send_to_a_receiver_that_dies(tmp_path / "unwatched", watch=False)
    waited = [seen[r]["seconds"] for r in (0, 1) if r in seen]
    assert max(waited, default=float("inf")) > DEAD_TIMEOUT_S - 5, seen
    print(f"receiver died mid-transfer, unwatched: senders done in {[round(w, 1) for w in waited]} s")
