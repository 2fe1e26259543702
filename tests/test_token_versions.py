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
