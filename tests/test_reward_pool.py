"""RewardPool: real spawned worker processes; results checked against direct calls of the reward function."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from megarl.rewards.exact_match import exact_match
from megarl.rewards.pool import RewardError, RewardPool

SCRIPTED = "tests.reward_fns:scripted"
pytestmark = pytest.mark.timeout(120)  # a deadlocked pool fails here instead of stalling the suite


def _children() -> set[int]:
    return {process.pid for process in multiprocessing.active_children()}


def _cases(n: int, prefix: str = "") -> list[tuple[str, str]]:
    """Matches, mismatches and whitespace variants of small sums."""
    shapes = [lambda i: (f"{i}", f"{i}"), lambda i: (f" {i}\n", f"{i}"), lambda i: (f"{i + 1}", f"{i}"),
              lambda i: ("", f"{i}"), lambda i: (f"{i} {i}", f"{i}")]
    return [(prefix + text, answer) for i in range(n) for text, answer in [shapes[i % len(shapes)](i)]]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(SCRIPTED, workers=2, timeout_s=1.5) as shared:
        yield shared


def test_exact_match_through_the_pool_equals_direct_calls():
    items = _cases(50)
    expected = [exact_match(text, answer) for text, answer in items]
    assert 0 < sum(expected) < len(expected)
    with RewardPool("megarl.rewards.exact_match:exact_match", workers=2) as exact_pool:
        scored = exact_pool.score(items)
    assert scored.rewards == expected
    assert scored.timed_out == []
    assert scored.seconds > 0


def test_hanging_item_times_out_and_the_pool_keeps_working(pool):
    before = _children()
    items = _cases(12)
    items[5] = ("hang", "5")
    scored = pool.score(items)
    assert scored.timed_out == [5]
    assert scored.rewards[5] == 0.0
    expected = [exact_match(*item) for item in items]
    assert scored.rewards[:5] == expected[:5] and scored.rewards[6:] == expected[6:]
    after = _children()
    assert len(before - after) == 1 and len(after - before) == 1  # the hung worker was killed and replaced
    again = _cases(20)
    assert pool.score(again + [("hang", "0")]).timed_out == [20]  # a second hang is handled the same way
    assert pool.score(again).rewards == [exact_match(*item) for item in again]


def test_items_run_at_the_same_time_in_several_worker_processes(pool, tmp_path):
    # Each "meet" item waits until the other one is running too: scored one after the other, they would time out.
    scored = pool.score([(f"meet:{tmp_path}", "")] * 2)
    assert scored.timed_out == []
    pids = {int(reward) for reward in scored.rewards}
    assert len(pids) == 2
    assert pids <= _children() and os.getpid() not in pids


def test_workers_are_spawned_without_torch():
    import torch  # noqa: F401 - the caller (trainer/controller) has torch loaded; a forked worker would too

    with RewardPool(SCRIPTED, workers=2) as fresh:
        assert fresh.score([("torch?", "")] * 4).rewards == [0.0] * 4


def test_raising_function_raises_reward_error_and_the_pool_survives(pool):
    items = _cases(6)
    items[2] = ("boom" + "x" * 500, "0")
    with pytest.raises(RewardError) as error:
        pool.score(items)
    message = str(error.value)
    assert SCRIPTED in message and "ValueError" in message and "boom in the reward function" in message
    assert repr(items[2][0][:200]) in message and items[2][0][:201] not in message  # a 200-character excerpt
    assert pool.score(_cases(6)).rewards == [exact_match(*item) for item in _cases(6)]


@pytest.mark.parametrize("response", ["nan", "text"])
def test_non_finite_or_non_number_reward_raises(pool, response):
    with pytest.raises(RewardError, match="not a finite number"):
        pool.score([("1", "1"), (response, "1")])


def test_dead_worker_raises_reward_error_with_its_exit_code(pool):
    with pytest.raises(RewardError, match="exit code 3"):
        pool.score([("1", "1"), ("exit", "1"), ("2", "2")])
    assert pool.score(_cases(4)).rewards == [exact_match(*item) for item in _cases(4)]


@pytest.mark.parametrize("function", ["tests.reward_fns", "no_such_module_xyz:fn", "tests.reward_fns:missing",
                                      "tests.reward_fns:NOT_CALLABLE", ":scripted"])
def test_bad_function_string_raises_value_error(function):
    before = _children()
    with pytest.raises(ValueError, match="module:callable") as error:
        RewardPool(function)
    assert repr(function) in str(error.value)
    assert _children() <= before


def test_close_leaves_no_child_processes():
    before = _children()
    reward_pool = RewardPool(SCRIPTED, workers=3, timeout_s=1.0)
    assert reward_pool.score([("hang", "x"), ("1", "1")]).timed_out == [0]
    workers = _children() - before
    assert len(workers) == 3
    reward_pool.close()
    reward_pool.close()  # idempotent
    assert not _children() & workers
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]  # killed and reaped
    with pytest.raises(RuntimeError, match="close"):
        reward_pool.score([("1", "1")])


def test_concurrent_score_calls_from_two_threads(pool):
    lists = [_cases(30, prefix="slow:"), [(f"slow:{text}", answer) for answer, text in _cases(30)]]
    expected = [[exact_match(text.removeprefix("slow:"), answer) for text, answer in items] for items in lists]
    results: list[list[float] | None] = [None, None]
    barrier = threading.Barrier(2)

    def run(k: int) -> None:
        barrier.wait()
        results[k] = pool.score(lists[k]).rewards

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected


def test_flagged_items_are_listed_per_flag(pool):
    items = [("1", "1"), ("flag:unparsable", "1"), ("2", "3"), ("flag:gold_unparsable", "1"), ("flag:unparsable", "")]
    scored = pool.score(items)
    assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scored.flags == {"unparsable": [1, 4], "gold_unparsable": [3]}
    assert pool.score([("1", "1")]).flags == {}


def test_bad_flag_raises_reward_error(pool):
    with pytest.raises(RewardError, match="returned flag 3, not a string"):
        pool.score([("badflag", "1")])
