"""`TokenVersions`, the run-length record of each response token's policy version (`megarl/token_versions.py`)."""

import pytest

from megarl.token_versions import TokenVersions


def test_runs_expand_to_one_version_per_token():
    tv = TokenVersions.single(3, 2).extended(3, 1).extended(5, 2)
    assert tv.runs == ((3, 3), (5, 2))
    assert tv.per_token() == [3, 3, 3, 5, 5]
    assert (tv.num_tokens, tv.oldest, tv.newest, tv.spans_versions) == (5, 3, 5, True)
    assert not TokenVersions.single(4, 7).spans_versions
    assert TokenVersions.single(4, 0).runs == () and TokenVersions.single(4, 0).extended(4, 0).runs == ()


@pytest.mark.parametrize("runs", [((1, 0),), ((2, 1), (1, 1)), ((2, 1), (2, 1))])
def test_bad_runs_are_refused(runs):
    with pytest.raises(ValueError, match="TokenVersions"):
        TokenVersions(runs)


def test_the_flat_tensors_every_rank_receives_give_back_the_same_records():
    """`BatchTensors.token_versions` (what a trainer rank rebuilds from the broadcast tensors) equals the records the
    rollout side wrote, an empty response included."""
    import torch

    from megarl.batch import RolloutBatch
    from megarl.trainer.batch_tensors import batch_to_tensors

    records = [TokenVersions(((3, 2), (4, 1))), TokenVersions.single(4, 1), TokenVersions(()),
               TokenVersions(((2, 1), (3, 1), (4, 2)))]
    responses = [[1, 2, 3], [4], [], [5, 6, 7, 8]]
    batch = RolloutBatch(index=0, prompt_ids=[[9]] * 4, response_ids=responses,
                         engine_logprobs=[[-0.1] * len(r) for r in responses], rewards=torch.zeros(2, 2),
                         advantages=torch.zeros(2, 2), policy_version=2, token_versions=records)
    assert batch_to_tensors(batch).token_versions == records
    assert batch_to_tensors(RolloutBatch(**{**batch.__dict__, "token_versions": None})).token_versions is None


def test_lags_are_the_trainer_version_minus_each_runs_version():
    """Every lag the run computes comes from here (`version_lag`, `TokenVersions.lags`): written out by hand."""
    from megarl.token_versions import version_lag

    tv = TokenVersions(((3, 2), (5, 4), (6, 1)))
    assert tv.lags(7) == ((4, 2), (2, 4), (1, 1))
    assert (tv.oldest_lag(7), tv.newest_lag(7)) == (4, 1)
    assert tv.newest_lag(5) == -1  # a version the trainer has not reached
    assert version_lag(9, 4) == 5
