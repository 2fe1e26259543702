"""The rollout fleet and its client on a real vLLM server: token-in/token-out samples carry the
engine's own log-probs and the weight version; a dead server or a server that cannot start is
reported with the URL / the log's tail."""

from __future__ import annotations

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
