"""Routing replay (R3): the trainer's MoE layers route every token to the experts the rollout engine used.

A batch carries `routed_experts [b, s, L, k]`: for the token at each input position, the top-k experts each of
the model's L MoE layers routed it to (global layer order, the order of HF's `model.layers.*`). With replay on,
each router of this pipeline stage is given its layer's `[s*b, k]` slice (megatron's routers see tokens in
`[s, b]` order) and megatron-core's own replay mode (`megatron/core/transformer/moe/router_replay.py`,
`TransformerConfig.moe_enable_routing_replay`, action `REPLAY_FORWARD`) takes those experts instead of its top-k.
The gate weights are still the trainer's own, recomputed over the given experts (megatron-core 0.16.1
`topk_routing_with_score_function`): with `norm_topk_prob` (Qwen3-MoE; megatron's `moe_router_pre_softmax=False`)
`w_i = softmax(z_I)_i`, the softmax of the router logits `z` over the chosen experts `I` only; without it
`w_i = softmax(z)_i` over all experts, gathered at `I`. Gradients reach the router through those weights.

Indices travel compactly: uint8 when the model has at most 256 experts, int16 otherwise (`compact_indices`).

Responses that span a weight push (`sync.inflight`). Every row is stored once, routed by the version
`Sample.token_versions` assigns to the token it produced (`route_segments` names the segments): row `r` is input
token `r`'s forward, which produced token `r + 1`. vLLM 0.32 returns exactly that across an in-flight push, in both
KV modes, so the trainer replays the rows as they come: its AuxOutput connector emits each position's row once, from
a cursor that a preemption does not move back, so the re-prefill of `sync.inflight_kv=recompute` (prompt + held
output routed again under the new weights) is computed and not returned; the rows before the push are the old
weights' routing, those after it the new weights' (read in `vllm/distributed/aux_output_connector/`; measured at
vLLM's capture point on the CPU fleet by tests/test_inflight_push.py, where the re-prefill rerouted most prefix
(row, layer) pairs; the GPU return path itself is not run here: docs/gpu.md). A response assembled from two requests
(a held request aborted and its prompt + output resubmitted, as verl does) must not concatenate the second
request's re-prefill rows to the first's (verl PRs 6029/6046): `join_continued_routes` keeps each row once.
What one trainer forward cannot replay: with `recompute`, the tokens after the push were sampled over the prefix as
the new weights route it, while the prefix rows replayed are the old weights' (the ones its own tokens came from), so
the config refuses replay with `sync.inflight_kv=recompute` (`megarl.config.schema`); with `keep` the replayed rows
are exactly what the engine computed for every token.
"""

from __future__ import annotations

import numpy as np
import torch

from megarl.token_versions import TokenVersions


def index_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype that holds every expert index: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit int16 routing-replay indices")


def compact_indices(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert indices (any integer dtype) -> `index_dtype(num_experts)`, refusing values outside [0, E)."""
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_experts):
        raise ValueError(f"routed-expert indices must lie in [0, {num_experts}); got [{int(indices.min())}, "
                         f"{int(indices.max())}]")
    return indices.to(index_dtype(num_experts))


def index_bytes(indices: torch.Tensor | None) -> int:
    """Bytes the indices take in the batch (0 when there are none), reported as `replay/index_bytes`."""
    return 0 if indices is None else indices.numel() * indices.element_size()


def check_routes(routed_experts: torch.Tensor, tokens: torch.Tensor, num_layers: int, topk: int) -> None:
    """`routed_experts` must be `[b, s, num_layers, topk]` for `tokens [b, s]`: checked on every rank before the
    schedule starts (an error inside it on one pipeline stage would leave the others waiting)."""
    expected = (*tokens.shape, num_layers, topk)
    if tuple(routed_experts.shape) != expected:
        raise ValueError(f"routed_experts has shape {tuple(routed_experts.shape)}; expected {expected} (tokens "
                         f"{tuple(tokens.shape)}, {num_layers} MoE layers, top-{topk})")


def stage_routers(model: torch.nn.Module) -> list:
    """This stage's megatron `TopKRouter`s (one per MoE layer), in layer order; each must hold a `router_replay`
    (built with `moe_enable_routing_replay`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    missing = [r.layer_number for r in routers if r.router_replay is None]
    if missing:
        raise ValueError(f"MoE layers {missing} have no router replay: build the model with routing replay on "
                         "(trainer.routing_replay=true)")
    return sorted(routers, key=lambda r: r.layer_number)


def set_microbatch_routes(routers: list, routed_experts: torch.Tensor | None, device: torch.device) -> None:
    """Give each router its layer's experts for the coming forward, or (None) let them route by themselves.
    `routed_experts [b, s, L, k]` is the microbatch's; router of global layer n (1-based) gets
    `routed_experts[:, :, n-1]` in megatron's `[s*b, k]` token order."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in routers:
        replay = router.router_replay
        replay.clear_indices()
        if routed_experts is None:
            replay.clear_router_replay_action()
            continue
        b, s, _, k = routed_experts.shape
        per_token = routed_experts[:, :, router.layer_number - 1].transpose(0, 1).reshape(s * b, k)
        replay.set_target_indices(per_token.to(device=device, dtype=torch.long))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(routers: list) -> None:
    """Drop the indices held by every router (megatron keeps a list of them for recompute) and stop replaying."""
    for router in routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()


def route_segments(prompt_len: int, token_versions: TokenVersions) -> tuple[tuple[int, int, int], ...]:
    """Which policy version routed each row of a sample's `routed_experts` (one row per forwarded token: prompt +
    response - 1), as `(version, start_row, end_row)` segments in row order.

    Row `r` is the routing of input token `r`, the forward that produced token `r + 1`; so it belongs to the version
    of the response token it produced (`token_versions`), and the prompt rows before it to the version of the first
    response token (the prefill). With in-flight updates vLLM 0.32 returns exactly these rows, each position's first
    computation: in `sync.inflight_kv=recompute` the re-prefill of a held request's prompt + output under the new
    weights is routed again but not returned (docs/pipeline.md, In-flight weight updates)."""
    if prompt_len < 1:
        raise ValueError(f"a sample's routes need a prompt of at least one token, got {prompt_len}")
    segments, start, end = [], 0, prompt_len - 1
    for version, tokens in token_versions.runs:
        end += tokens
        segments.append((version, start, end))
        start = end
    return tuple(segments)


def join_continued_routes(routes: np.ndarray, continuation: np.ndarray, prompt_len: int, held: int) -> np.ndarray:
    """The routes of one response generated by two requests: the first (`prompt_len` prompt tokens, `held` output
    tokens when it stopped; `routes [prompt_len + held - 1, L, k]`) and a continuation submitted with prompt + those
    `held` tokens as its prompt (`continuation [prompt_len + held + m - 1, L, k]` for its `m` new tokens). The
    continuation's first `prompt_len + held - 1` rows route the prefix again, under its weights; they are dropped,
    the first request's rows kept: `[prompt_len + held + m - 1, L, k]`, each row once, of the version of the token it
    produced. Shapes that do not fit these counts raise ValueError."""
    prefix = prompt_len + held - 1
    if routes.shape[0] != prefix or continuation.shape[0] < prefix or continuation.shape[1:] != routes.shape[1:]:
        raise ValueError(f"routes {routes.shape} and continuation {continuation.shape} do not fit a {prompt_len}-token "
                         f"prompt with {held} held tokens: expected [{prefix}, ...] and [{prefix} + new tokens, ...] "
                         "with the same layers and top-k")
    return np.concatenate([routes, continuation[prefix:]])
