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
