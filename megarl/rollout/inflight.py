"""In-flight weight updates, the engine side: a push that does not wait for the requests a replica is generating.

With `sync.inflight` the push's lifecycle (`megarl.sync.lifecycle.FleetLifecycle`) pauses each replica with vLLM
0.32's keep mode (`POST /pause?mode=keep&clear_cache=false`): the engine core stops scheduling
(`PauseState.PAUSED_ALL`) and the pause completes once no model step is in flight; every request stays inside the
engine with its tokens, its sampling state and its KV blocks. (`clear_cache=false` matters: although the route's
docstring says keep mode ignores it, vLLM 0.32's engine core runs `_finish_pause(clear_cache)` in every mode, and with
`true` that resets the prefix cache with `reset_running_requests=True`, preempting every held request: the
recompute below, unasked. Found by tests/test_inflight_push.py, whose keep run first matched the new weights.) The
partitioned push then loads the new weights exactly as without in-flight updates (full or delta, staged or
streamed: the worker-side receive runs inside one engine RPC while nothing steps), the replica is labelled with the
new version (`/finish_weight_update`) and resumed; the frozen requests continue where they stood. No request is
aborted, restarted or resampled: the client's HTTP call simply takes longer.

What happens to the KV cache of the tokens generated before the push is `sync.inflight_kv`:

- `recompute` (default; as AReaL and verl): while paused, `POST /reset_prefix_cache?reset_running_requests=true`
  preempts every running request (vLLM frees its blocks and sets its computed tokens to 0, keeping its prompt and
  output tokens) and then empties the prefix cache, which succeeds because no block is held any more. On resume each
  request is prefilled again over prompt + the output so far, under the new weights, and goes on decoding. Every
  token sampled after the push is therefore sampled from exactly the new policy's distribution given the whole
  prefix: the engine's log-prob of each post-push token is the new weights' log-prob, each pre-push one the old
  weights' (tests/test_inflight_push.py checks both against transformers at 1e-5). We chose preemption inside the
  engine over the abort-and-resubmit of AReaL/verl (`/pause?mode=abort`, then prompt + partial output sent again with
  `max_tokens` reduced): the request, its seed's generator and its id stay the engine's own, the client
  concatenates nothing, and vLLM's own version spans (below) keep counting one response.
- `keep` (as PipelineRL and Magistral): nothing is recomputed. Tokens after the push attend to keys and values of
  the earlier tokens computed under the old weights, so their log-probs are neither the old nor the new policy's
  (the mismatch is measured by the same test and reported in docs/pipeline.md). Cheaper: no re-prefill.

Per-token versions, exact. vLLM 0.32 records it itself: the engine core attaches its current weight label to the
outputs of every model step (`EngineCore._attach_weight_version`; the label changes only while generation is paused,
by `/finish_weight_update(weight_version)`), and the output processor opens a new `WeightVersionSpan(version, start,
end)` of output-token indexes whenever the label of a step's new tokens differs from the previous one; the final
reply of `/inference/v1/generate` carries the spans per choice. These are the engine's own token counts at the pause,
not a clock: a step's tokens are labelled with the weights that computed them because the keep-mode pause completes
only once no step is in flight, and the label is set before the resume. `token_versions_from_spans` turns them into
the one record of versions, `megarl.token_versions.TokenVersions`. The lifecycle also reads the counts straight from
the model runner of each replica while it is paused (`MegarlWorkerExtension.megarl_held_requests`: the number of
output tokens each request in flight holds, keyed by vLLM's internal request id, matched back to the client's
request by `engine_request_key`); a response's first span ends exactly there (checked by the test), and the
lifecycle keeps the counts of its last push (`FleetLifecycle.held`) for metrics and the later loop integration.
The spans are the record; the model runner's counts are a cross-check, exact on the CPU backend (checked by the test).
With GPU async scheduling vLLM's model runner may hold a placeholder (-1) for a token still being sampled until its
next step, so there the counts are unverified (the spans are not affected: they count what the engine core output).

Prefix cache. Blocks computed under old weights must never serve a later request. Without in-flight updates the
`wait`-mode pause clears the cache at every push (vLLM's default `clear_cache`); keep mode must not (above), and
`reset_prefix_cache` without preempting is a no-op while requests hold blocks. So: with `recompute` the cache is
emptied at every in-flight push (above); with either setting each request is salted with the version it will run under
(`megarl.schedule.VersionClock.salt`, which moves when the replica is paused for a push, before it resumes;
`RolloutClient.generate(cache_salt=...)`, vLLM's `cache_salt`, hashed into the first block and so into every block of
the request): a request that runs under version v only ever reuses blocks of requests salted for v. vLLM's CPU
backend honours the salt (checked by the test through its prefix-cache hit counter).

Routed experts (`rollout.return_routed_experts`, GPU fleets). Across an in-flight push vLLM 0.32 returns each
forwarded token's routing once, routed by the version `Sample.token_versions` assigns to the token it produced:
with `recompute` the re-prefill routes the held prefix again under the new weights, but vLLM's AuxOutput connector
emits rows only from the request's cursor on, so the prefix rows returned are the old weights' (its first
computation). The routes need no slicing; `megarl.trainer.routing_replay` says which version routed which rows
(`route_segments`), how a response resubmitted as a second request joins its routes (`join_continued_routes`), and
what one trainer forward cannot replay; measured at vLLM's capture point on the CPU fleet by
tests/test_inflight_push.py (`megarl.rollout.routing_probe`), figures in docs/pipeline.md.

When a replica fails with requests held (the fault cells, tests/test_fault_inflight.py). A replica that dies while
it is paused (its server or engine killed) drops its requests: their calls fail as a lost replica's, the rollout
worker gives their chunks back to the queue (`fleet/requeued_groups`) and the push goes on to the others, as for
any replica that dies during a push. A push whose loaders fail part-way on a replica ("mixed": some parameters new,
some old) must not let the requests it holds go on with those weights: `FleetLifecycle` then aborts every request
in its engine (`POST /pause?mode=abort&clear_cache=false` on the paused replica: each generate call answers at once,
200, its choices' `finish_reason` "abort" with the tokens they had), leaves it paused, condemns it (its launcher
restarts it, which repairs it; it rejoins with a full push) and reports it as a replica that died, so the push goes
on to the others while `rollout.min_replicas` are left (without in-flight updates such a push fails the run,
docs/sync.md). The rollout worker treats a chunk with an aborted choice as not generated: it is given back to the
queue and counted like a lost replica's, never pooled, and the replica takes no more chunks; its groups are
generated again from their seeds on the others. A replica that refused an update before touching its model resumes
with its previous weights (its held requests go on under them, each token labelled with the version that made it)
and the push fails the run as without in-flight updates.

In `megarl train`: with `sync.inflight` the rollout worker runs partial rollouts (`megarl.rollout.partial`): it does
not quiesce before a push, so the push lands while requests generate, and batches are formed from finished groups,
each carrying the `TokenVersions` read here to the trainer (`RolloutBatch.token_versions`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from megarl.schedule import version_of_label, version_salt
from megarl.token_versions import TokenVersions

__all__ = ["version_of_label", "version_salt"]  # defined with the version clock; tests name them here

InflightKV = Literal["keep", "recompute"]

# vLLM 0.32's internal id of a request sent to `/inference/v1/generate` with `request_id` R: the serving layer names
# it `generate-tokens-R` (the external id), `InputProcessor.assign_request_id` appends `-` and 8 random characters,
# and with n > 1 `ParentRequest.get_child_info` prefixes each child with its index and `_`.
_ENGINE_ID = re.compile(r"^(?:(?P<index>\d+)_)?generate-tokens-(?P<rid>.+)-[^-]{8}$")
_GROUP_ID = re.compile(r"^megarl-b(?P<batch>\d+)-p(?P<prompt>\d+)-[0-9a-f]{8}$")


def engine_external_id(request_id: str) -> str:
    """vLLM's external id of a request sent to `/inference/v1/generate` with `request_id` (see `_ENGINE_ID`): what
    `/abort_requests` takes to end it."""
    return f"generate-tokens-{request_id}"


def group_request_id(batch: int, prompt: int) -> str:
    """The `request_id` the rollout worker sends prompt `prompt` of (home) batch `batch` with: the group it is, and
    8 random hex digits (a group generated again, e.g. after its replica was lost, is another request). An engine's
    counts at a pause (`held_counts`) and its log name the groups so (`group_of_request`)."""
    return f"megarl-b{batch}-p{prompt}-{uuid.uuid4().hex[:8]}"


def group_of_request(request_id: str) -> tuple[int, int] | None:
    """`(batch, prompt)` of a `group_request_id`; None for another id."""
    match = _GROUP_ID.match(request_id)
    return None if match is None else (int(match["batch"]), int(match["prompt"]))


def token_versions_from_spans(spans: Iterable[Mapping[str, Any]], num_tokens: int) -> TokenVersions:
    """The `TokenVersions` of a response of `num_tokens` tokens from vLLM's `weight_versions` spans
    (`{"version": label, "start": i, "end": j}` over output-token indexes). The spans must tile `[0, num_tokens)` in
    order with increasing versions; anything else raises ValueError naming the spans."""
    spans = list(spans)
    runs: list[tuple[int, int]] = []
    at = 0
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != at or end <= start:
            raise ValueError(f"weight version spans {spans} do not tile the {num_tokens} output tokens")
        runs.append((version_of_label(span["version"]), end - start))
        at = end
    if at != num_tokens:
        raise ValueError(f"weight version spans {spans} cover {at} of the {num_tokens} output tokens")
    try:
        return TokenVersions(tuple(runs))
    except ValueError as err:
        raise ValueError(f"weight version spans {spans}: {err}") from None


def engine_request_key(engine_request_id: str) -> tuple[str, int] | None:
    """`(request_id, choice index)` of vLLM's internal id of a `/inference/v1/generate` request that the client sent
    with `request_id` (see `_ENGINE_ID`); None for an id of another route."""
    match = _ENGINE_ID.match(engine_request_id)
    if match is None:
        return None
    return match["rid"], int(match["index"] or 0)


def held_counts(engine_counts: Mapping[str, int]) -> dict[tuple[str, int], int]:
    """The output tokens each generate request held at a pause, keyed `(request_id, choice index)`, from a worker's
    `megarl_held_requests` (internal id -> output tokens); requests of other routes are left out."""
    held: dict[tuple[str, int], int] = {}
    for engine_id, tokens in engine_counts.items():
        key = engine_request_key(engine_id)
        if key is not None:
            held[key] = int(tokens)
    return held
