"""The rollout worker's edges with real servers and real reward processes: a dead replica or a failing reward
function stops the run with an error naming the replica / batch (no hang), the controller's calls refuse a
push point that is not the window's end, and a resume whose saved batches reach the run's end generates nothing."""

import time

import pytest

from megarl.data.arithmetic import problem_batch
from megarl.launch import free_port
from megarl.metrics.timeline import Timeline
from megarl.rewards.pool import RewardPool
from megarl.rewards.scoring import BatchScorer, scored_batch
from megarl.rollout.client import RolloutClient, Sample
from megarl.rollout.worker import RolloutWorker, RolloutWorkerError
from megarl.sync.schedule import SyncSchedule


def _worker(urls, schedule, end, reward="megarl.rewards.exact_match:exact_match", decode=None, asked=None, **kw):
    """`asked`: a list that records every batch index whose problems a replica asks for (it is about to generate
    that batch)."""
    pool = RewardPool(reward, workers=1, timeout_s=10)

    def problems(j):
        if asked is not None:
            asked.append(j)
        return problem_batch(j, 2, 4, seed=0)

    try:
        return RolloutWorker(
            [RolloutClient(u, timeout_s=30) for u in urls], schedule,
            problems=problems, encode=lambda text: [1, 2, 3],
            sampling={"n": 2, "max_tokens": 1}, seed=lambda j: 10 * j,
            score=BatchScorer(pool, decode or (lambda ids: "7")), timeline=Timeline(), end=end, **kw)
    except BaseException:
        pool.close()
        raise


def test_a_dead_replica_is_named_and_nothing_hangs():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    worker = _worker([url], SyncSchedule(1, 0), end=3)
    try:
        lost = rf"replica 0 \({url}\), batch 0: RolloutServerLost.*unreachable.*no rollout replica is left"
        with pytest.raises(RolloutWorkerError, match=lost):
            worker.take(0)
    finally:
        worker.close()


def test_a_lost_replicas_chunks_go_back_on_the_queue():
    """Three replicas, nothing listening at any of them: each loses the chunk it took, and each such chunk goes
    back on the queue (the run stops when the last one is lost). A chunk dropped instead would leave its batch
    incomplete forever: the worker says so at once (tests/test_rollout_queue.py's lost replica, with a live one
    left, would otherwise wait for it to its timeout)."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    worker = _worker(urls, SyncSchedule(1, 0), end=1, chunk_prompts=1)
    try:
        with pytest.raises(RolloutWorkerError, match="no rollout replica is left"):
            worker.take(0)
        assert worker.lost().keys() == {0, 1, 2}
        assert worker.chunks_taken == [0, 0, 0]
        queue = worker._queue  # batch 0 (2 prompts, one chunk each): both untaken again, nothing generated
        assert sorted(i for _, prompts in queue.open[0].todo for i in prompts) == [0, 1]
        assert queue.open[0].missing == 2
    finally:
        worker.close()


def test_a_failing_reward_function_is_named(moe_fleet):
    worker = _worker(moe_fleet.urls, SyncSchedule(1, 0), end=1, reward="tests.reward_fns:scripted",
                     decode=lambda ids: "boom")
    try:
        with pytest.raises(RolloutWorkerError, match=r"scoring batch 0: RewardError.*scripted.*boom in the reward"):
            worker.take(0)
    finally:
        worker.close()


def test_window_and_resume_edges(moe_fleet):
    # (2, 1): the initial weights generate batches 0 and 1; a push point anywhere else is a controller bug
    asked = []
    worker = _worker(moe_fleet.urls, SyncSchedule(2, 1), end=4, asked=asked)
    try:
        with pytest.raises(RuntimeError, match="window ends at batch 2"):
            worker.quiesce(4)
        assert worker.take(0).index == 0 and worker.take(1).index == 1
        worker.quiesce(2)
        assert worker.batches_generated() == 2  # the window's end: nothing generated past it before the push
        # and nothing STARTED past it: a replica that went on would ask for batch 2's problems at once (it has
        # nothing else to wait for); a second is ample for that, and a correct worker asks for nothing more
        time.sleep(1.0)
        assert sorted(asked) == [0, 1], f"batches begun before the push that precedes batch 2: {asked}"
    finally:
        worker.close()
    # a checkpoint after step 3 of a 5-step (2, 2) run saved batch 4, the run's last: nothing is left to make
    saved = scored_batch(4, [[Sample([1], [2], [-0.1], "length", 2)] * 2], [[1.0, 0.0]])
    asked = []
    worker = _worker(moe_fleet.urls, SyncSchedule(2, 2), end=5, start=4, ready={4: saved}, asked=asked)
    try:
        assert worker.take(4) is saved and worker.batches_generated() == 5
        time.sleep(0.5)
        assert asked == [], f"batches begun past the run's end: {asked}"
    finally:
        worker.close()
    with pytest.raises(ValueError, match="no push precedes it"):  # batch 3 of (2, 2) follows no push
        _worker(moe_fleet.urls, SyncSchedule(2, 2), end=9, start=3)
