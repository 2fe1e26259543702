"""Partial rollouts' rules (`megarl.rollout.partial`), worked out by hand: which finished groups form a batch, which
are dropped past the staleness bound, how many groups the fleet may start, and what a formed batch records. The
real-fleet run (pushes landing while groups generate) is tests/test_end_to_end.py's in-flight job."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.rollout.client import Sample
from megarl.rollout.partial import GroupPool, ScoredGroup, admission_limit, batch_of_groups
from megarl.sync.schedule import SyncSchedule
from megarl.token_versions import TokenVersions


def _group(home: int, prompt: int, *runs: tuple[tuple[int, int], ...], rewards=None, **kw) -> ScoredGroup:
    """A group whose k-th sample has per-token versions `runs[k]` (tokens 1, 2, 3, ...)."""
    samples = []
    for k, r in enumerate(runs):
        tv = TokenVersions(r)
        samples.append(Sample([home, prompt], list(range(tv.num_tokens)), [-0.5] * tv.num_tokens, "length",
                              tv.oldest if tv.runs else 0, None, tv, f"req-{home}-{prompt}-{k}"))
    return ScoredGroup(home, prompt, samples, rewards or [float(k) for k in range(len(runs))], **kw)


def test_a_batch_is_the_lowest_finished_groups_and_stale_ones_are_dropped():
    pool = GroupPool()
    # finishing order: (2, 0) first; the batch still prefers (0, 1), of an earlier home batch, and (1, 3)
    pool.add(_group(2, 0, ((3, 4),), ((3, 2),)))
    pool.add(_group(0, 1, ((1, 2), (2, 5)), ((1, 7),)))  # oldest token: version 1
    pool.add(_group(1, 3, ((2, 1), (3, 1)), ((2, 3),)))  # oldest: 2
    pool.add(_group(0, 0, ((0, 6),), ((0, 1), (1, 1))))  # oldest: 0
    assert pool.form(5) is None  # fewer than 5 pooled: nothing is taken
    assert len(pool) == 4
    # trainer version 3, bound 2: a lag of 3 (version 0) is past it, a lag of 2 (version 1) is not
    stale = pool.drop_stale(3, 2)
    assert [g.key for g in stale] == [(0, 0)]
    assert [g.key for g in pool.form(2)] == [(0, 1), (1, 3)]  # (home batch, prompt) order
    assert [g.key for g in pool.groups()] == [(2, 0)]
    assert pool.drop_stale(5, 2) == []  # oldest version 3 at trainer version 5: lag 2, kept
    assert [g.key for g in pool.drop_stale(6, 2)] == [(2, 0)]
    assert len(pool) == 0


def test_a_group_is_pooled_once():
    pool = GroupPool([_group(0, 0, ((0, 1),))])
    with pytest.raises(RuntimeError, match="home batch 0, prompt 0 was generated twice"):
        pool.add(_group(0, 0, ((0, 1),)))
    assert [g.key for g in pool.form(1)] == [(0, 0)]
    with pytest.raises(RuntimeError, match="generated twice"):  # also once it has left the pool
        pool.add(_group(0, 0, ((0, 1),)))


@pytest.mark.parametrize(("m", "n"), [(1, 1), (2, 1), (4, 2), (8, 1), (3, 0)])
def test_with_the_default_bound_the_fleet_starts_what_the_schedule_lets_it_generate(m, n):
    """After the push before batch b (version b - n), the schedule lets the fleet generate up to batch
    `generation_limit(b)`; partial rollouts' admission with the default bound m + n - 1 lets it start exactly
    those batches' groups (and one more group for each one dropped)."""
    schedule, groups = SyncSchedule(m, n), 5
    for b in range(m * 3, m * 8, m):
        if schedule.sync_before_batch(b) is None:
            continue
        version = schedule.generation_version(b)
        assert admission_limit(version, m + n - 1, groups, 0, 10_000, 0, 0) == groups * schedule.generation_limit(b)
        assert admission_limit(version, m + n - 1, groups, 0, 10_000, 3, 0) == groups * schedule.generation_limit(b) + 3


def test_admission_counts_from_a_resumed_batch_and_stops_at_the_runs_end():
    # resumed at batch 6 holding 3 carried groups, version 5, bound 2: a group started now is trained by step
    # 5 + 2 = 7, so batches 6 and 7 (2 x 4 groups), the carried ones filling 3 of them
    assert admission_limit(5, 2, 4, 6, 100, 0, 3) == 8 - 3
    # a 7-batch run: nothing past batch 6, except replacements for dropped groups
    assert admission_limit(5, 2, 4, 6, 7, 0, 3) == 4 - 3
    assert admission_limit(5, 2, 4, 6, 7, 2, 3) == 4 - 3 + 2


def test_a_formed_batch_records_every_tokens_version():
    routes = np.zeros((3, 1, 2), dtype=np.uint8)
    a = _group(4, 1, ((5, 2), (6, 1)), ((6, 3),), rewards=[1.0, 0.0], timeouts=1, flags={"unparsable": 1})
    b = _group(3, 0, ((4, 1), (5, 2)), ((5, 3),), rewards=[0.5, 0.25], flags={"unparsable": 2, "gold_unparsable": 1})
    for g in (a, b):
        for s in g.samples:
            s.routed_experts = routes
    batch = batch_of_groups(7, [a, b])
    assert batch.index == 7 and batch.num_seqs == 4
    assert batch.policy_version == 4  # the oldest token of the batch
    assert [tv.per_token() for tv in batch.token_versions] == [[5, 5, 6], [6, 6, 6], [4, 5, 5], [5, 5, 5]]
    assert torch.equal(batch.rewards, torch.tensor([[1.0, 0.0], [0.5, 0.25]]))
    assert batch.prompt_ids == [[4, 1], [4, 1], [3, 0], [3, 0]]
    assert batch.reward_timeouts == 1 and batch.reward_flags == {"unparsable": 3, "gold_unparsable": 1}
    assert len(batch.routed_experts) == 4 and batch.advantages is None
