"""The lag schedule: the formula (l mod m) + n from REC appendix B.2, computed independently here."""

import pytest

from megarl.sync.schedule import SyncSchedule


@pytest.mark.parametrize(("m", "n"), [(4, 0), (1, 4), (2, 1), (3, 2), (1, 0)])
def test_lag_formula_after_warmup(m, n):
    s = SyncSchedule(m, n)
    for batch in range(40):
        if m * (batch // m) >= n:  # pipeline filled: data comes from a pushed version
            assert s.expected_lag(batch) == (batch % m) + n
        else:  # still the initial weights
            assert s.generation_version(batch) == 0 and s.expected_lag(batch) == batch


def test_paper_examples():
    assert [SyncSchedule(4, 0).expected_lag(b) for b in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [SyncSchedule(1, 4).expected_lag(b) for b in range(4, 10)] == [4] * 6


@pytest.mark.parametrize(("m", "n"), [(4, 0), (1, 4), (2, 1)])
def test_pushes_are_the_trainer_version_at_that_moment(m, n):
    """Simulate the pipeline: batch j is generated while the trainer is at version j - n; any push
    before it must carry exactly that version, and pushes happen every m batches."""
    s = SyncSchedule(m, n)
    fleet_version, pushes = 0, []
    for j in range(30):
        trainer_version = max(0, j - n)
        v = s.sync_before_batch(j)
        if v is not None:
            assert v == trainer_version
            fleet_version = v
            pushes.append(j)
        assert fleet_version == s.generation_version(j)
    assert all(j % m == 0 for j in pushes)


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        SyncSchedule(0, 1)
    with pytest.raises(ValueError):
        SyncSchedule(2, -1)


@pytest.mark.parametrize(("m", "n", "pushes"), [
    # batch j is preceded by a push of version j - n when j is a multiple of m and j - n > 0 (hand-listed)
    (1, 0, {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, 8: 8, 9: 9}),
    (4, 0, {4: 4, 8: 8}),
    (1, 4, {5: 1, 6: 2, 7: 3, 8: 4, 9: 5}),
    (2, 1, {2: 1, 4: 3, 6: 5, 8: 7}),
    (8, 2, {8: 6}),
    (3, 3, {6: 3, 9: 6}),  # batch 3 would carry version 0: the fleet already holds it, no push
])
def test_which_batches_are_preceded_by_a_push(m, n, pushes):
    s = SyncSchedule(m, n)
    assert {j: s.sync_before_batch(j) for j in range(10) if s.sync_before_batch(j) is not None} == pushes
    # the push before batch j is made at the start of step j - n, when the trainer is at version j - n
    made = {s.push_at_step(k): k for k in range(10) if s.push_at_step(k) is not None}
    assert {j: k for j, k in made.items() if j < 10} == pushes


@pytest.mark.parametrize(("m", "n", "limits"), [
    # how many batches may exist while the fleet holds the initial weights, then after each push
    (1, 0, {None: 1, 1: 2, 2: 3}),
    (4, 0, {None: 4, 4: 8}),
    (1, 4, {None: 5, 5: 6, 6: 7}),
    (2, 1, {None: 2, 2: 4, 4: 6}),
    (8, 2, {None: 8, 8: 16}),
])
def test_generation_window(m, n, limits):
    s = SyncSchedule(m, n)
    assert {before: s.generation_limit(before) for before in limits} == limits
    # the sequential controller's n-ahead count never exceeds the window at the same step
    for k in range(12):
        last_push = max((j for j in range(k + n + 1) if s.sync_before_batch(j) is not None), default=None)
        assert k + 1 <= s.batches_ready_before_step(k) <= s.generation_limit(last_push)
