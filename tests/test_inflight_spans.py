"""The parts of in-flight weight updates (`megarl.rollout.inflight`) that need no fleet: vLLM's weight-version spans to
`TokenVersions`, vLLM's internal request ids back to the client's, the config fields, and vLLM's own prefix-cache
block hashing keyed by the version salt. The real fleet's side is tests/test_inflight_push.py."""

import pytest
from pydantic import ValidationError

from megarl.config.schema import SyncConfig
from megarl.rollout.inflight import (
    engine_request_key,
    group_of_request,
    group_request_id,
    held_counts,
    token_versions_from_spans,
    version_salt,
)
from megarl.token_versions import TokenVersions


def _span(version, start, end):
    return {"version": version, "start": start, "end": end}


def test_spans_become_token_versions():
    spans = [_span("default", 0, 3), _span("4", 3, 10), _span("5", 10, 11)]
    assert token_versions_from_spans(spans, 11) == TokenVersions(((0, 3), (4, 7), (5, 1)))
    assert token_versions_from_spans([_span("7", 0, 5)], 5) == TokenVersions.single(7, 5)
    assert token_versions_from_spans([], 0) == TokenVersions(())


@pytest.mark.parametrize("spans, n, says", [
    ([_span("1", 0, 3), _span("2", 4, 6)], 6, "do not tile"),  # a gap
    ([_span("1", 0, 3)], 5, "cover 3 of the 5"),  # short
    ([_span("2", 0, 3), _span("1", 3, 5)], 5, "versions must increase"),
    ([_span("x", 0, 3)], 3, "not set by megarl"),
])
def test_spans_that_do_not_describe_the_response_are_refused(spans, n, says):
    with pytest.raises(ValueError, match=says):
        token_versions_from_spans(spans, n)


def test_engine_ids_map_back_to_the_clients_request():
    # vLLM 0.32: `generate-tokens-<request_id>` + `-<8 random>`, children of n > 1 prefixed `<index>_`
    assert engine_request_key("generate-tokens-inflight-keep-0-1a2b3c4d") == ("inflight-keep-0", 0)
    assert engine_request_key("3_generate-tokens-megarl-ab12-9f8e7d6c") == ("megarl-ab12", 3)
    assert engine_request_key("cmpl-1234-5678abcd") is None
    assert held_counts({"1_generate-tokens-r-0000aaaa": 7, "chatcmpl-x-12345678": 3}) == {("r", 1): 7}
    assert version_salt(3) != version_salt(4)


def test_a_groups_request_id_names_the_group_through_the_engines_id():
    """The rollout worker names each request for its group (home batch, prompt), so that an engine's counts at a
    pause (`held_counts`, keyed by the client's id recovered from vLLM's internal one) say which groups it held."""
    rid = group_request_id(12, 3)
    assert group_of_request(rid) == (12, 3) and rid != group_request_id(12, 3)  # a new request each time
    assert engine_request_key(f"2_generate-tokens-{rid}-0a1b2c3d") == (rid, 2)
    assert group_of_request("megarl-ab12") is None and group_of_request(f"{rid}x") is None


def test_config_fields():
    assert SyncConfig().inflight is False and SyncConfig().inflight_kv == "recompute"
    assert SyncConfig(inflight=True, inflight_kv="keep").inflight_kv == "keep"
    with pytest.raises(ValidationError, match="inflight_kv"):
        SyncConfig(inflight=True, inflight_kv="drop")


def test_version_salt_keys_vllms_prefix_cache_blocks():
    """vLLM's own block hasher (the keys of its prefix cache) with the salt the client sends: requests for the same
    version share every block hash, requests for different versions share none (the salt enters the first block's
    hash, and every later hash chains on it). Checked here rather than on the CPU fleet, whose block size (128, vLLM's
    CPU default) equals the tiny model's context: no prompt there fills a block, so nothing is ever cached."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prompt = [(7 * i + 3) % 30 + 1 for i in range(64)]

    def hashes(salt):
        request = Request("r", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher)
        return request.block_hashes

    v1, v1_again, v2 = hashes(version_salt(1)), hashes(version_salt(1)), hashes(version_salt(2))
    assert len(v1) == 4 and v1 == v1_again
    assert not set(v1) & set(v2)
    assert not set(v1) & set(hashes(None))
