"""Doomed groups are aborted in their engines (`sync.inflight_abort_doomed`, `megarl.rollout.partial`: "Doomed
groups"), on a real replica: one vLLM server (TP 1) of the tiny MoE at a context of 1,024 positions (the session's
`tiny_moe_long_dir`: the same weights) generates `megarl bench inflight-fleet`'s long-tailed task through megarl's
own `RolloutWorker` in partial mode, driven by that bench's trainer loop (`run_mode`: real in-flight pushes through
`PartitionedWeightSync`, keep mode, KV recomputed) with a trainer step that costs nothing.

The long responses (1,000 tokens) are what makes a group doomed in a user's run: a response far longer than the
trainer's cycle, so it is pushed over while it generates and lags past the bound long before it could finish.
`moe_fleet_2x1`'s 128 positions cannot set that up reliably: a 120-token response lasts only about three of the
trainer's cycles (a push and a take) here, so whether it outlives its bound depended on the machine's pace, and on
CI's it did not (no group aborted). Here one lasts tens of cycles, so the long groups of the first four homes, each
pushed over part-way, are doomed by the second take after that push whatever the machine's pace. Homes 4 to 7 have
no long group, so the run's drain does not wait for one.

The replica is the test's own, TP 1, not the session's TP-2 server (which also serves 1,024 positions): on the TP-2
server the test passed on a quiet machine, but beside one busy process (load average near 30) no group was aborted
in two runs, while this replica aborted all four long groups beside the same process.

Checked against independent references:
- the engine stopped every aborted group early: the task asks for exactly 1,000 or 4 tokens per response (vLLM's
  `ignore_eos`), and some response of the group came back with fewer (the lengths the engine's replies carried);
- the lag recorded for an aborted group, from the versions the engine labelled its tokens with (its spans),
  exceeds the bound: nothing trainable was aborted. (With a trainer step that costs nothing, even a short group that
  a push caught part-way is doomed once the trainer has taken the batch it was due in: sync (1, 1), bound 1);
- the engine's count of requests it finished as aborted on its own (vLLM's `vllm:request_success_total`,
  `finished_reason="abort"`) does not move: a client's abort ends a request in the API server, which the engine's
  counter does not see, and nothing else aborted;
- the bench's own bookkeeping: every group started is trained once, dropped (aborted ones included) or left over;
  no trained token lags past the bound (`run_mode` raises otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from megarl.bench.inflight_fleet import FleetBenchSpec, _Pusher, run_mode
from megarl.rollout.fleet import FleetHandle, FleetSpec, launch
from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from tests.fleet_fixture import ENGINE_BOUND_S, LONG_POSITIONS

POSITIONS = LONG_POSITIONS
# 8 prompts x 2 a batch, an eighth of them to 1,000 tokens, the rest to 4; sync (1, 1), bound 1; batches from 3631
# on have one long prompt in each of their first four batches and none in the next four (`long_prompts`: 1, 1, 1, 1,
# 0, 0, 0, 0): one replica runs 8 groups at once (`chunks_in_flight`), so the long ones never fill its slots
SPEC = FleetBenchSpec(prompts=8, samples=2, interval=1, offset=1, steps=6, skip=0, train_s=0.0, long_share=0.125,
                      long_tokens=1000, short_tokens=4, positions=POSITIONS)
FIRST = 3631


@pytest.fixture(scope="module")
def long_context_replica(tiny_moe_long_dir: Path, fleet_secret: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHandle]:
    spec = FleetSpec(model_dir=tiny_moe_long_dir, tp=1, replicas=1, log_dir=tmp_path_factory.mktemp("long_fleet_logs"),
                     secret_file=fleet_secret, step_timeout_s=ENGINE_BOUND_S)
    with launch(spec) as fleet:
        yield fleet


def _aborted(urls: list[str]) -> float:
    headers = bearer_header(read_secret(os.environ[SECRET_ENV]))
    total = 0.0
    for url in urls:
        text = requests.get(f"{url}/metrics", headers=headers, timeout=30).text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)
    return total


def test_a_group_past_the_bound_is_aborted_while_it_generates(long_context_replica, tiny_moe_long_dir):
    urls = list(long_context_replica.urls)
    pusher = _Pusher(urls, tiny_moe_long_dir, "recompute")
    try:
        before = _aborted(urls)
        run = run_mode(SPEC, "inflight", FIRST, urls, pusher)
        aborted_requests = _aborted(urls) - before
    finally:
        pusher.close()
    print(f"aborted groups (home, prompt, lag, response lengths): {run['aborted']}")
    assert run["aborted_groups"] >= 1, (f"no group was aborted: dropped {run['dropped']}, held per push "
                                        f"{run['held_per_push']}, step walls {run['step_walls_s']}")
    bound = SPEC.staleness_bound
    for home, prompt, lag, lengths in run["aborted"]:  # (a sample that ended before the abort landed is whole)
        asked = SPEC.set_lengths(FIRST + home)[prompt]
        assert len(lengths) == SPEC.samples and all(n <= a for n, a in zip(lengths, asked, strict=True))
        assert min(lengths) < asked[0], (home, prompt, lengths)
        assert lag > bound, (home, prompt, lag)
    assert run["max_token_lag"] <= bound
    assert aborted_requests == 0
