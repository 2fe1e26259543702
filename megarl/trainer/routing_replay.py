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
"""

from __future__ import annotations

import torch


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
