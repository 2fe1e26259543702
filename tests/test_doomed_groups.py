"""Doomed groups are aborted in their engines (`sync.inflight_abort_doomed`, `megarl.rollout.partial`: "Doomed
groups"), on the real fleet: the session's two TP-1 replicas (`moe_fleet_2x1`) generate `megarl bench
inflight-fleet`'s long-tailed task through megarl's own `RolloutWorker` in partial mode, driven by that bench's
trainer loop (`run_mode`: real in-flight pushes through `PartitionedWeightSync`, keep mode, KV recomputed) with a
trainer step that costs nothing, so long groups (120 tokens) are pushed over while they generate and soon lag past
the bound.

Checked against independent references:
- the engine stopped every aborted group early: the task asks for exactly 120 or 4 tokens per response (vLLM's
  `ignore_eos`), and some response of the group came back with fewer (the lengths the engine's replies carried);
- the lag recorded for an aborted group, from the versions the engine labelled its tokens with (its spans),
  exceeds the bound: nothing trainable was aborted. (With a trainer step that costs nothing, even a short group that
  a push caught part-way is doomed once the trainer has taken the batch it was due in: sync (1, 1), bound 1);
- the engines' count of requests they finished as aborted on their own (vLLM's `vllm:request_success_total`,
  `finished_reason="abort"`) does not move: a client's abort ends a request in the API server, which the engine's
  counter does not see, and nothing else aborted;
- the bench's own bookkeeping: every group started is trained once, dropped (aborted ones included) or left over;
  no trained token lags past the bound (`run_mode` raises otherwise).
"""

from __future__ import annotations

import os

import requests

from megarl.bench.inflight_fleet import FleetBenchSpec, _Pusher, run_mode
from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret

# 4 prompts x 2 a batch, a quarter of them to 120 tokens (the tiny model's 128 positions), the rest to 4; sync (1, 1),
# bound 1; batches from 4000 on have long prompts in their first batches (`long_prompts`: 1, 1, 2, 2, 0, 0, 2, 1)
SPEC = FleetBenchSpec(prompts=4, samples=2, interval=1, offset=1, steps=6, skip=0, train_s=0.0, long_share=0.25,
                      long_tokens=120, short_tokens=4)
FIRST = 4000


def _aborted(urls: list[str]) -> float:
    headers = bearer_header(read_secret(os.environ[SECRET_ENV]))
    total = 0.0
    for url in urls:
        text = requests.get(f"{url}/metrics", headers=headers, timeout=30).text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)
    return total


def test_a_group_past_the_bound_is_aborted_while_it_generates(moe_fleet_2x1, tiny_moe_dir):
    urls = list(moe_fleet_2x1.urls)
    pusher = _Pusher(urls, tiny_moe_dir, "recompute")
    try:
        before = _aborted(urls)
        run = run_mode(SPEC, "inflight", FIRST, urls, pusher)
        aborted_requests = _aborted(urls) - before
    finally:
        pusher.close()
    assert run["aborted_groups"] >= 1, f"no group was aborted: {run['dropped']}"
    bound = SPEC.staleness_bound
    for home, prompt, lag, lengths in run["aborted"]:  # (a sample that ended before the abort landed is whole)
        asked = SPEC.set_lengths(FIRST + home)[prompt]
        assert len(lengths) == SPEC.samples and all(n <= a for n, a in zip(lengths, asked, strict=True))
        assert min(lengths) < asked[0], (home, prompt, lengths)
        assert lag > bound, (home, prompt, lag)
    assert run["max_token_lag"] <= bound
    assert aborted_requests == 0
