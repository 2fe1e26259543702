"""The rollout fleet and its client on a real vLLM server: token-in/token-out samples carry the
engine's own log-probs and the weight version; a dead server or a server that cannot start is
reported with the URL / the log's tail."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megarl.rollout.client import RolloutClient, RolloutServerError
from megarl.rollout.fleet import FleetError, FleetSpec, launch
from tests.dist_utils import free_port

PROMPTS = [[6, 23, 7, 24], [5, 23, 5, 24, 11]]


def test_generate_returns_engine_logprobs_and_version(moe_fleet):
    client = RolloutClient(moe_fleet.base_url)
    groups = client.generate(PROMPTS, n=3, max_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    assert [len(g) for g in groups] == [3, 3]
    version = int(client.weight_version()) if client.weight_version() not in (None, "default") else 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for s in group:
            assert s.prompt_ids == prompt and 1 <= len(s.response_ids) <= 4
            assert len(s.response_logprobs) == len(s.response_ids) and s.policy_version == version
            # the sampled tokens' log-probs are the engine's distribution (temperature 1): scoring the same
            # tokens as a prompt gives the same values, up to prefill-vs-decode kernel differences in fp32
            rescored = client.prompt_logprobs(prompt + s.response_ids)[len(prompt) - 1:]
            torch.testing.assert_close(torch.tensor(s.response_logprobs), torch.tensor(rescored), atol=1e-4, rtol=0)
    # the same seed reproduces the same samples
    again = client.generate(PROMPTS, n=3, max_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in groups]


def test_seeded_prompts_beyond_one_steps_token_budget_are_served(moe_fleet):
    """48 seeded prompts of 120 tokens reach the engine together -- sent while it is paused (`/pause?mode=keep`, as
    a push with in-flight updates pauses it), then resumed: 5,760 prompt tokens for one engine step, more than a
    step's budget on this TP-2 CPU replica (vLLM's default 4,096). Were a prefill split across steps, vLLM 0.32 would
    rewind that request's CPU generator, which raises and kills the engine (`megarl.rollout.fleet._cpu_args`). Each
    prompt's samples are those of the same prompt and seed sent alone."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 25, (120,), generator=g).tolist() for _ in range(48)]
    client = RolloutClient(moe_fleet.base_url, max_parallel=len(prompts))
    client.pause(mode="keep", clear_cache=False)
    try:
        with ThreadPoolExecutor(1) as pool:
            together = pool.submit(client.generate, prompts, n=1, max_tokens=4, seed=100)
            time.sleep(3.0)  # every request is in the engine's queue (48 local HTTP calls, sent at once)
            client.resume()
            together = together.result(timeout=300)
    finally:
        client.resume()
    assert client.healthy()
    alone = [client.generate([p], n=1, max_tokens=4, seed=100 + i)[0] for i, p in enumerate(prompts)]
    assert [grp[0].response_ids for grp in together] == [grp[0].response_ids for grp in alone]


def test_dead_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RolloutServerError, match=rf"{url}/inference/v1/generate unreachable"):
        RolloutClient(url, timeout_s=5).generate([[1, 2]], n=1, max_tokens=1)


def test_server_that_cannot_start_reports_its_log(tmp_path):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(FleetError, match=r"exited with code .*last log lines") as err:
        launch(FleetSpec(model_dir=empty, tp=1, log_dir=tmp_path / "logs", startup_timeout_s=300))
    assert str(empty) in str(err.value)  # the tail shows vLLM's own complaint about the model directory


def test_a_hung_replica_costs_the_label_query_seconds_not_the_request_timeout(moe_fleet, monkeypatch):
    """After a push, `FleetLifecycle.served()` asks each replica its label for the metrics. A replica that accepts
    the connection and never answers (a socket that listens and never replies) is reported as None within the
    short label timeout, not after the client's 600 s request timeout; the live replica's label comes back."""
    import socket
    import time

    from megarl.sync import lifecycle

    monkeypatch.setattr(lifecycle, "LABEL_TIMEOUT_S", 1.0)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
        clients = [RolloutClient(moe_fleet.base_url), RolloutClient(f"http://127.0.0.1:{hung.getsockname()[1]}")]
        assert all(c.timeout_s == 600 for c in clients)
        t0 = time.monotonic()
        labels = lifecycle.FleetLifecycle(clients, tp=1).served()
        elapsed = time.monotonic() - t0
    assert labels == {0: clients[0].weight_version(), 1: None}
    assert labels[0] is not None
    assert elapsed < 10, elapsed


def test_a_keep_mode_pause_moves_the_salt_before_the_resume_and_a_label_not_pushed_fails(moe_fleet, monkeypatch,
                                                                                         tmp_path):
    """The push's lifecycle with in-flight updates (`sync.inflight`, KV kept) on the real replica: held at
    `push.paused.replica0` (its /pause in keep mode has answered, nothing is resumed yet), the run's clock already
    salts requests to it with the pushed version, while the replica is paused and serves its old label. The push is
    then undone (its session closed unlabelled, the replica resumed), so the replica goes on reporting its old label:
    the label check after a push names it, its label and the version the schedule pushed, in one line."""
    import threading
    from pathlib import Path

    from megarl.schedule import SyncSchedule, VersionClock, VersionMismatch, version_of_label, version_salt
    from megarl.sync import failpoints
    from megarl.sync.lifecycle import FleetLifecycle

    client = RolloutClient(moe_fleet.base_url)
    label = client.weight_version()
    version = version_of_label(label) + 1000  # a version this fleet has never served
    clock = VersionClock(SyncSchedule(1, 0))
    point = Path(tmp_path) / "push.paused.replica0"
    point.write_text("")
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    seen: dict = {}

    def at_the_pause() -> None:
        try:
            deadline = time.monotonic() + 120
            while not point.with_name(point.name + ".reached").exists():
                assert time.monotonic() < deadline, "the lifecycle never reached push.paused.replica0"
                time.sleep(0.01)
            seen.update(paused=client.is_paused(), salt=clock.salt(0), served=clock.served(0),
                        label=client.weight_version())
        finally:
            point.unlink(missing_ok=True)

    watcher = threading.Thread(target=at_the_pause)
    watcher.start()
    fleet = FleetLifecycle([client], tp=2, call_timeout_s=60, inflight=True, inflight_kv="keep", clock=clock)
    try:
        failure, lost = fleet.open(version)
        if failure is None:  # (a server whose weight transfer never joined refuses the session: undone by `open`)
            fleet.abort_open(lost)
    finally:
        watcher.join()
        point.unlink(missing_ok=True)
    assert seen == {"paused": True, "salt": version_salt(version, clock.run_key), "served": 0, "label": label}, seen
    assert not client.is_paused() and client.weight_version() == label
    with pytest.raises(VersionMismatch) as err:
        clock.check_served(version, fleet.served(), {0: client.url})
    assert str(err.value).endswith(f"replica 0 ({client.url}) reports weight version {label!r}, not the {version} "
                                   "the schedule pushed") and "\n" not in str(err.value)


def test_tokens_at_vllms_logprob_floor_are_named_by_cause():
    """vLLM's token-in/token-out route (0.32, `_create_tokens_logprobs`) sends -9999.0 both for a NaN or -inf
    log-prob (the entry keeps its `top_logprobs`: with `logprobs=0`, the sampled token's own) and for a sampled
    token missing from the engine's log-probs (no `top_logprobs`); `missing_logprobs` tells them apart."""
    from megarl.rollout.client import MISSING_LOGPROB, missing_logprobs

    ok = {"token_id": 5, "logprob": -1.25, "rank": 2, "top_logprobs": [{"token_id": 5, "logprob": -1.25, "rank": 2}]}
    nan = {"token_id": 7, "logprob": MISSING_LOGPROB, "rank": None,
           "top_logprobs": [{"token_id": 7, "logprob": MISSING_LOGPROB, "rank": None}]}
    absent = {"token_id": 9, "logprob": MISSING_LOGPROB}
    assert missing_logprobs([ok, ok]) == "" and missing_logprobs([]) == ""
    said = missing_logprobs([ok, nan, ok, absent, absent])
    assert said.startswith("3 of 5 sampled tokens") and "1 with a NaN or -inf log-prob (positions [1])" in said
    assert "2 the engine reported no log-prob for (positions [3, 4])" in said
    assert "NaN" not in missing_logprobs([ok, absent])
