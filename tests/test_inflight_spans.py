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


def _generate_reply(tokens: list[int], spans: list[tuple[str, int, int]] | None, n: int = 1,
                    request_id: str = "megarl-b3-p1-0a1b2c3d") -> dict:
    """The JSON body vLLM 0.32's `/inference/v1/generate` sends for one request of `n` choices (each `tokens`), built
    with vLLM's own reply models and serialised as its route does (`JSONResponse(content=response.model_dump())`,
    api_router.py); `spans`: each choice's `weight_versions` (None: a reply without them)."""
    import json

    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProbs,
        GenerateLogProbsContent,
        GenerateTokensChoice,
        GenerateTokensResponse,
    )
    from vllm.outputs import WeightVersionSpan

    choices = [GenerateTokensChoice(
        index=i, finish_reason="length", token_ids=tokens,
        logprobs=GenerateLogProbs(content=[GenerateLogProbsContent(token_id=t, logprob=-0.5) for t in tokens]),
        weight_versions=None if spans is None else [WeightVersionSpan(v, a, b) for v, a, b in spans])
        for i in range(n)]
    return json.loads(json.dumps(GenerateTokensResponse(request_id=request_id, choices=choices).model_dump()))


def test_a_response_without_version_spans_is_refused_under_inflight():
    """With sync.inflight (`require_spans`) a choice without the engine's spans is an error naming the server and the
    request, not the server's newest label (which would under-count its older tokens' lag); with them, the spans are
    its versions; without sync.inflight the client still asks the server's label (`/weight_info`: here nobody listens,
    so that is the error)."""
    from megarl.rollout.client import RolloutClient, RolloutServerError, RolloutServerLost
    from tests.dist_utils import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: the spans, not the server, must say the versions
    client, tokens, rid = RolloutClient(url, timeout_s=5), [6, 7, 8, 9], "megarl-b3-p1-0a1b2c3d"
    bare = _generate_reply(tokens, None)["choices"][0]
    assert bare["weight_versions"] is None and bare["token_ids"] == tokens  # (the reply's own shape)
    with pytest.raises(RolloutServerError, match=rf"^{url}: request {rid}, choice 0: the reply carries no "
                                                 r"weight_versions spans for its 4 tokens") as err:
        client._sample([1, 2], bare, rid, require_spans=True)
    assert not isinstance(err.value, RolloutServerLost) and "\n" not in str(err.value)
    spanned = _generate_reply(tokens, [("4", 0, 1), ("5", 1, 4)])["choices"][0]
    sample = client._sample([1, 2], spanned, rid, require_spans=True)
    assert sample.token_versions == TokenVersions(((4, 1), (5, 3))) and sample.policy_version == 4
    with pytest.raises(RolloutServerLost, match="/weight_info unreachable"):
        client._sample([1, 2], bare, rid)  # outside sync.inflight: today's fallback, the server's label


def test_the_rollout_worker_names_the_replica_and_the_request_of_a_reply_without_spans():
    """Partial rollouts (sync.inflight) end to end on the worker's side: a server that answers every generate request
    with vLLM's reply minus the spans (`_generate_reply`, served over HTTP) fails the run with one line naming the
    replica's index and URL, the batch and the request, not a batch labelled with the server's newest version."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megarl.data.arithmetic import problem_batch
    from megarl.metrics.timeline import Timeline
    from megarl.rewards.pool import RewardPool
    from megarl.rewards.scoring import BatchScorer
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.worker import PartialRollouts, RolloutWorker, RolloutWorkerError
    from megarl.schedule import SyncSchedule, VersionClock

    replies: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            rid = body["request_id"]
            replies[rid] = json.dumps(_generate_reply([6, 7], None, n=body["sampling_params"]["n"],
                                                      request_id=rid)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(replies[rid])))
            self.end_headers()
            self.wfile.write(replies[rid])

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    clock = VersionClock(SyncSchedule(1, 0))
    pool = RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=10)
    worker = RolloutWorker([RolloutClient(url, timeout_s=10)], clock, problems=lambda j: problem_batch(j, 1, 4, seed=0),
                           encode=lambda text: [1, 2, 3], sampling={"n": 2, "max_tokens": 2}, seed=lambda j: 10 * j,
                           score=BatchScorer(pool, lambda ids: "7"), timeline=Timeline(), end=1,
                           partial=PartialRollouts(1, clock.bound))
    try:
        with pytest.raises(RolloutWorkerError) as err:
            worker.take(0)
    finally:
        worker.close()
        server.shutdown()
        server.server_close()
    (rid,) = replies
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"rollout failed: replica 0 ({url}), batch 0: RolloutServerError: {url}: request {rid}, "
                           "choice 0: the reply carries no weight_versions spans for its 2 tokens"), line
