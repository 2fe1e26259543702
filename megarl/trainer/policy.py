"""The policy being trained: a megatron-core `GPTModel` stage with its optimizer.

`compute_logprobs` and `train_step` take token batches and return per-token log-probs of the
targets and the exact entropy, computed from the vocab-parallel logits shards (the vocabulary is
never gathered). By default the output layer is fused with that computation
(`megarl.parallel.fused_output_logprobs`): the last stage returns its final hidden states and the log-probs
come from them and the output weight chunk by chunk, so the `[tokens, V/tp]` logits never exist whole.
Forward and backward run through megatron's `get_forward_backward_func()` (no pipelining at PP=1, 1F1B at
PP>1; the last stage's results are broadcast to the other stages).
Gradients are *summed* over microbatches and data-parallel ranks, because each loss value is already
a contribution to the global-batch loss; clipping uses the global norm over all TP/PP/EP shards.
With routing replay, a microbatch's `routed_experts` route each of its tokens to the given experts in every MoE
layer (`megarl.trainer.routing_replay`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.schema import OptimizerConfig
from megarl.models.hf_import import load_hf_weights
from megarl.models.hf_slices import iter_local_hf_slices
from megarl.models.qwen_provider import build_gpt_model, padded_vocab_size
from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy
from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from megarl.sync.slices import HFSlice
from megarl.trainer.optimizer import ShardedAdamW, adamw_param_groups, check_optimizer_state
from megarl.trainer.routing_replay import check_routes, clear_routes, set_microbatch_routes, stage_routers

LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _is_expert(param: torch.nn.Parameter) -> bool:
    """megatron marks expert parameters (not replicated over the data-parallel group) with allreduce=False."""
    return not getattr(param, "allreduce", True)


def _is_tp_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """A parameter replicated on every TP rank (norms, router) counts in the grad norm on TP rank 0 only."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank != 0


def _is_tied_copy(param: torch.nn.Parameter) -> bool:
    """The last stage's copy of a tied embedding (PP>1), which megatron marks `shared`
    (`LanguageModule.setup_embeddings_and_output_layer`): its gradient equals the embedding's after
    `_sum_tied_embedding_gradients`, so the grad norm counts it on the first stage only."""
    return getattr(param, "shared", False)


def _all_reduce_sum(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """In-place SUM of `grads` over `group`, as one flat message."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(new)


def _check_replay_layout(routing_replay: bool, recompute: str, tp: int) -> None:
    """Layouts routing replay is not wired for yet: full recompute reruns the routers in backward (under 1F1B
    after later microbatches replaced their indices), and MoE TP>1 routes sequence-parallel token slices."""
    if routing_replay and recompute == "full":
        raise ValueError("trainer.routing_replay with trainer.recompute='full' is not supported: use 'none' or "
                         "'selective'")
    if routing_replay and tp > 1:
        raise ValueError("trainer.routing_replay with trainer.tp > 1 (sequence-parallel MoE) is not supported yet: "
                         "use expert parallelism (trainer.ep) instead")


def _fusable_output_layer(model) -> bool:
    """Whether the fused output layer + log-prob computes exactly what `model`'s last stage does: a plain
    megatron `ColumnParallelLinear` without bias whose vocab-parallel output is not gathered, no multi-token
    prediction, no deferred embedding weight gradient (megatron-core 0.16.1's GPTModel has no logit soft-capping)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer, config = getattr(model, "output_layer", None), model.config
    return (type(layer) is ColumnParallelLinear and layer.bias is None and not layer.gather_output
            and config.mtp_num_layers is None and not config.defer_embedding_wgrad_compute)


def _return_hidden_states(input_: torch.Tensor, weight: torch.Tensor | None = None,
                          runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """Stands in for the output layer's forward: its input, the final hidden states, instead of the logits."""
    return input_, None


@contextmanager
def _output_layer_returns_hidden_states(model) -> Iterator[None]:
    """Inside, `model` returns the last stage's final hidden states `[b, s, h]` (`[b, s/tp, h]` under sequence
    parallelism: GPTModel transposes the output layer's output as it does the logits) where it returns logits."""
    model.output_layer.forward = _return_hidden_states
    try:
        yield
    finally:
        del model.output_layer.forward  # the instance attribute: the class's forward is back


def _configure_schedule(config, pp: int) -> None:
    """Adapter to megatron's schedules (tested with megatron-core 0.16.1): every loss value is already a
    contribution to the global loss, so the schedule must not divide by the microbatch count (the
    3-tuple loss-function form with `calculate_per_token_loss`); with PP > 1 microbatch shapes may vary
    between steps, so stages exchange them (`variable_seq_lengths`)."""
    config.calculate_per_token_loss = True
    config.variable_seq_lengths = pp > 1


class MegatronPolicy:
    """This rank's `GPTModel` stage, loaded from an HF checkpoint, with AdamW. Every rank of the trainer
    world calls each method together; the ranks of one model replica (its TP and PP peers) pass the same
    data-parallel share of the batch, and results come back on every rank, pipeline stages included."""

    def __init__(self, hf_dir: str | Path, hf: dict[str, Any], optim: OptimizerConfig, logprob_chunk: int = 4096,
                 distributed_optimizer: bool = False, recompute: str = "none", routing_replay: bool = False,
                 fused_logprobs: bool = True, logprob_vocab_block: int | None = None,
                 logprob_kernel: str = "eager", moe_aux_loss_coeff: float = 0.0):
        """`fused_logprobs`: on the last stage, the output projection fused with the log-probs
        (`fused_output_logprobs_entropy`: the same values and gradients without the whole logits) wherever the
        output layer allows it (`_fusable_output_layer`); elsewhere, or when False, the output layer's logits
        through `vocab_parallel_logprobs_entropy`. `logprob_vocab_block`: the fused path's shard rows per tile
        (None: the whole shard); `logprob_kernel`: its tiles' elementwise work, "eager" or "compiled".
        `distributed_optimizer`: shard the AdamW state over data-parallel replicas (`ShardedAdamW`);
        `recompute`: activation recomputation, "none" / "full" / "selective" (`qwen_provider.recompute_fields`);
        `routing_replay`: microbatches that carry `routed_experts [b, s, L, k]` are routed to exactly those
        experts (`megarl.trainer.routing_replay`); `moe_aux_loss_coeff`: the router's load-balancing loss
        (`trainer.moe_aux_loss_coeff`, 0 = none). Expert tensor parallel is the parallel state's."""
        from megatron.core import parallel_state as ps

        self.hf, self.optim_cfg, self.chunk, self.vocab_block = hf, optim, logprob_chunk, logprob_vocab_block
        self.logprob_kernel = logprob_kernel
        _check_replay_layout(routing_replay, recompute, ps.get_tensor_model_parallel_world_size())
        self.model = build_gpt_model(hf, ps.get_tensor_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_world_size(),
                                     ps.get_expert_model_parallel_world_size(), recompute=recompute,
                                     routing_replay=routing_replay,
                                     expert_tp=ps.get_expert_tensor_parallel_world_size(),
                                     moe_aux_loss_coeff=moe_aux_loss_coeff)
        self.routers = stage_routers(self.model) if routing_replay else None  # this stage's MoE routers
        _configure_schedule(self.model.config, ps.get_pipeline_model_parallel_world_size())
        load_hf_weights(self.model, hf_dir, hf)
        self.device = next(self.model.parameters()).device  # collectives run on it (NCCL takes no CPU tensors)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank of this pipeline's last stage
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.fused_logprobs = fused_logprobs and self.is_last_stage and _fusable_output_layer(self.model)
        # tied embeddings at PP>1: the first stage's embedding and the last stage's output layer are one weight
        tied_copies = self.model.share_embeddings_and_output_weights and ps.get_pipeline_model_parallel_world_size() > 1
        self.embedding_group = ps.get_embedding_group() if tied_copies and ps.is_rank_in_embedding_group() else None
        self.model_parallel_group = ps.get_model_parallel_group()
        self.expert_model_parallel_group = ps.get_expert_tensor_model_pipeline_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        tp = ps.get_tensor_model_parallel_world_size()
        shard = padded_vocab_size(hf, tp) // tp
        # real (unpadded) vocabulary columns in this rank's logits shard [tp_rank*shard, (tp_rank+1)*shard)
        self.local_vocab = min(max(hf["vocab_size"] - self.tp_rank * shard, 0), shard)
        self.distributed_optimizer = distributed_optimizer
        if distributed_optimizer:  # ZeRO-1: dense state over the DP group, expert state over the expert-DP group
            self.optimizer = ShardedAdamW(
                list(self.model.parameters()), _is_expert, self.dp_group, self.expert_dp_group,
                lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
            )
        else:
            self.optimizer = torch.optim.AdamW(
                adamw_param_groups(list(self.model.parameters()), optim.weight_decay),
                lr=optim.lr, betas=optim.betas, eps=optim.eps,
            )
        self.version = 0  # optimizer steps taken

    # ---- forward through megatron's schedule -----------------------------------------------------------------
    def _forward_step(self, last_stage_fn: Callable, data_iterator: Iterator[dict[str, torch.Tensor]], model):
        """megatron `forward_step_func`: run this stage on the next microbatch (`tokens [b, s]`, causal mask
        passed explicitly; a packed microbatch's one row gets a block-diagonal causal mask, True = masked);
        on the last stage `last_stage_fn(microbatch, output)` reduces it, `output` the logits `[b, s, V/tp]` or,
        with `fused_logprobs`, the final hidden states (`_output_layer_returns_hidden_states`)."""
        mb = next(data_iterator)
        device = self.device
        self._set_routes(mb)
        packed = "packed_tokens" in mb
        tokens = (mb["packed_tokens"] if packed else mb["tokens"]).to(device)
        b, s = tokens.shape
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
        if packed:  # RoPE depends only on relative positions, so a sequence's offset in the row changes nothing
            positions = mb["packed_positions"].to(device)
            segments = mb["packed_segments"].to(device)
            causal = causal | (segments[:, None, :, None] != segments[:, None, None, :])
        else:
            positions = torch.arange(s, device=device)[None].expand(b, s)
        output = model(tokens, positions, causal)  # hidden [s, b, h] on inner stages, logits/hidden on the last
        return output, partial(last_stage_fn, mb)

    @staticmethod
    def _routes_key(mb: dict[str, torch.Tensor]) -> tuple[str, str]:
        """(routes, tokens) keys of a microbatch: the packed ones when it is packed."""
        return ("packed_routed_experts", "packed_tokens") if "packed_tokens" in mb else ("routed_experts", "tokens")

    def _check_routes(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """Refuse routes the policy cannot replay, on every rank before the schedule starts."""
        for mb in microbatches:
            routes, tokens = self._routes_key(mb)
            if routes not in mb:
                continue
            if self.routers is None:
                raise ValueError("the batch carries routed_experts but the policy was built without routing replay: "
                                 "set trainer.routing_replay=true")
            check_routes(mb[routes], mb[tokens], self.model.config.num_layers, self.model.config.moe_router_topk)

    def _set_routes(self, mb: dict[str, torch.Tensor]) -> None:
        """Routing replay: the microbatch's `routed_experts` (`packed_routed_experts` when packed) go to the routers;
        a microbatch without them is routed by the trainer's own router."""
        if self.routers is not None:
            set_microbatch_routes(self.routers, mb.get(self._routes_key(mb)[0]), self.device)

    def _logprobs(self, output: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's `output` (`_forward_step`) -> `(logprobs, entropy) [b, s]` on the CPU, through the
        vocab-parallel shards. A packed microbatch's row is gathered back to one row per sequence, `[b, S]`
        (`unpack_index`)."""
        targets = mb["packed_targets"] if "packed_targets" in mb else mb["targets"]
        targets = targets.to(output.device)
        if self.fused_logprobs:
            lp, ent = self._fused_logprobs(output, targets)
        else:
            lp, ent = self._unfused_logprobs(output, targets)
        lp, ent = lp.cpu(), ent.cpu()
        if "unpack_index" in mb:
            lp, ent = lp.reshape(-1)[mb["unpack_index"]], ent.reshape(-1)[mb["unpack_index"]]
        return lp, ent

    def _unfused_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits [b, s, V/tp]` (the output layer's) -> `(logprobs, entropy) [b, s]`."""
        if self.local_vocab < logits.shape[-1]:  # padding columns (vocab padded to a multiple of TP) are no tokens
            logits = logits.clone()
            logits[..., self.local_vocab:] = torch.finfo(logits.dtype).min
        return vocab_parallel_logprobs_entropy(logits, targets, self.tp_group, self.chunk)

    def _fused_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden [b, s, h]` (the output layer's input) -> `(logprobs, entropy) [b, s]`, with the weight the output
        layer would use (the embedding's at PP=1 with tied embeddings, as GPTModel passes it)."""
        model = self.model
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)
        if not model.output_layer.sequence_parallel:
            return fused_output_logprobs_entropy(hidden, weight, targets, self.tp_group, self.chunk, self.local_vocab,
                                                 vocab_block=self.vocab_block, kernel=self.logprob_kernel)
        # sequence parallel: hidden [b, s/tp, h] holds this rank's slice of the sequence, dim 0 of [s, b, h]
        lp, ent = fused_output_logprobs_entropy(hidden.transpose(0, 1), weight, targets.t(), self.tp_group,
                                                self.chunk, self.local_vocab, sequence_parallel=True,
                                                vocab_block=self.vocab_block, kernel=self.logprob_kernel)
        return lp.t(), ent.t()

    def _run(self, microbatches: list[dict[str, torch.Tensor]], last_stage_fn: Callable,
             forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """All microbatches through `get_forward_backward_func()` (no pipelining at PP=1, 1F1B otherwise);
        returns `last_stage_fn`'s per-microbatch dicts on the last stage, [] on the others."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, s = microbatches[0]["packed_tokens" if "packed_tokens" in microbatches[0] else "tokens"].shape
        self._check_routes(microbatches)
        try:
            with _output_layer_returns_hidden_states(self.model) if self.fused_logprobs else nullcontext():
                return get_forward_backward_func()(
                    forward_step_func=partial(self._forward_step, last_stage_fn), data_iterator=iter(microbatches),
                    model=self.model, num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                    forward_only=forward_only,
                )
        finally:
            if self.routers is not None:
                clear_routes(self.routers)

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor, micro: int = 64,
                         routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens, targets [B, S]` (long) -> `(logprobs, entropy) [B, S]` fp32 on the CPU, on every rank.
        `routed_experts [B, S, L, k]`: replay these experts (needs `routing_replay`)."""
        self.model.eval()
        rows = {"tokens": tokens, "targets": targets}
        if routed_experts is not None:
            rows["routed_experts"] = routed_experts
        mbs = [{k: v[i:i + micro] for k, v in rows.items()} for i in range(0, len(tokens), micro)]

        def collect(mb, output):
            lp, ent = self._logprobs(output, mb)
            return torch.zeros(()), torch.tensor(1, dtype=torch.int), {"logprobs": lp, "entropy": ent}

        outs = self._run(mbs, collect, forward_only=True)
        result = torch.zeros(2, *tokens.shape, device=self.device)
        if self.is_last_stage:
            result[0] = torch.cat([o["logprobs"] for o in outs])
            result[1] = torch.cat([o["entropy"] for o in outs])
        logprobs, entropy = self._from_last_stage(result).cpu()
        return logprobs, entropy

    # ---- training step ---------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward every microbatch, sum gradients over DP, clip, AdamW step; version += 1.
        `loss_fn(logprobs [b, s], entropy [b, s], microbatch) -> (loss, metrics)` returns the microbatch's
        contribution to the GLOBAL loss. Returns the global loss, the grad norm before clipping and the
        loss function's metrics summed over the global batch (the same dict on every rank)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)

        def loss_on_last_stage(mb, output):
            loss, metrics = loss_fn(*self._logprobs(output, mb), mb)
            reported = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
            return loss, torch.tensor(1, dtype=torch.int), reported

        outs = self._run(microbatches, loss_on_last_stage, forward_only=False)
        self._sum_gradients()
        grad_norm = self._grad_norm()  # the same value on every rank of the trainer
        skipped = not math.isfinite(grad_norm)
        if skipped:  # as megatron-core does: drop the gradients, leave weights and optimizer state as they are
            self.optimizer.zero_grad(set_to_none=False)
        else:
            self._clip_gradients(grad_norm, self.optim_cfg.grad_clip)
            self._set_lr()
            self.optimizer.step()
        self.version += 1  # a skipped step still counts: the lag schedule is in steps
        metrics = self._sum_metrics(outs) if self.is_last_stage else {}
        return {**self._metrics_from_last_stage(metrics), "grad_norm": grad_norm, "train/skipped_step": int(skipped)}

    def _sum_metrics(self, outs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Per-microbatch metric dicts of this rank -> sums over microbatches and data-parallel ranks: a float per
        scalar metric; a metric of several elements (a histogram's counts) is summed elementwise in float64 and
        comes back as a CPU tensor."""
        names = sorted({k for o in outs for k in o})
        vectors = sorted({k for o in outs for k in o if o[k].numel() != 1})
        scalars = [k for k in names if k not in vectors]
        summed = torch.stack([sum(o[k].float().reshape(()) for o in outs if k in o) for k in scalars]).to(self.device)
        dist.all_reduce(summed, group=self.dp_group)
        result: dict[str, Any] = dict(zip(scalars, summed.tolist(), strict=True))
        if vectors:
            parts = [sum(o[k].double().reshape(-1) for o in outs if k in o) for k in vectors]
            flat = torch.cat(parts).to(self.device)
            dist.all_reduce(flat, group=self.dp_group)
            result.update(zip(vectors, flat.cpu().split([p.numel() for p in parts]), strict=True))
        return result

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's `t` on every stage of this pipeline (identity at PP=1)."""
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(t, src=self.pp_last_rank, group=self.pp_group)
        return t

    def _metrics_from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        if dist.get_world_size(self.pp_group) == 1:
            return metrics
        box = [metrics]
        dist.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
        return box[0]

    def _sum_gradients(self) -> None:
        """Complete every gradient by SUMS (never means): over TP for the replicated parameters that see only
        this rank's part of the activations (q/k layernorms act per head; sequence-parallel norms act per
        token slice), then over data-parallel replicas (expert parameters over the expert-DP group)."""
        sp = self.model.config.sequence_parallel
        params = list(self.model.named_parameters())
        tp_partial = [p.grad for n, p in params if p.grad is not None and (
            "q_layernorm" in n or "k_layernorm" in n or (sp and getattr(p, "sequence_parallel", False)))]
        _all_reduce_sum(tp_partial, self.tp_group)
        _all_reduce_sum([p.grad for _, p in params if not _is_expert(p) and p.grad is not None], self.dp_group)
        _all_reduce_sum([p.grad for _, p in params if _is_expert(p) and p.grad is not None], self.expert_dp_group)
        self._sum_tied_embedding_gradients()

    def _sum_tied_embedding_gradients(self) -> None:
        """Tied embeddings at PP>1 (megatron-core's `_allreduce_word_embedding_grads`): the gradient of the one
        HF weight `model.embed_tokens.weight` is the embedding's (first stage) plus the output layer's (last
        stage); both copies get that sum over the embedding group (each TP rank with its vocab shard), so they
        take the same optimizer step and stay equal."""
        if self.embedding_group is None:
            return
        weight = self.model.shared_embedding_or_output_weight()
        _all_reduce_sum([weight.grad], self.embedding_group)

    def _grad_norm(self) -> float:
        """Global L2 norm of the gradients over all model shards (each element counted once, a tied embedding's
        last-stage copy not at all): NaN or inf when any gradient is, on every rank alike."""
        dense_sq = torch.zeros((), device=self.device)
        expert_sq = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            if p.grad is None or _is_tp_duplicate(p, self.tp_rank) or _is_tied_copy(p):
                continue
            if _is_expert(p):
                expert_sq += p.grad.float().pow(2).sum()
            else:
                dense_sq += p.grad.float().pow(2).sum()
        dist.all_reduce(dense_sq, group=self.model_parallel_group)
        dist.all_reduce(expert_sq, group=self.expert_model_parallel_group)
        return float((dense_sq + expert_sq).sqrt())

    def _clip_gradients(self, norm: float, max_norm: float) -> None:
        """Scale the gradients down so that their global norm `norm` becomes `max_norm` (if it is above)."""
        if norm > max_norm:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(max_norm / (norm + 1e-6))

    def _set_lr(self) -> None:
        warm = self.optim_cfg.warmup_steps
        scale = min(1.0, (self.version + 1) / warm) if warm else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_cfg.lr * scale

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's model shard, optimizer state and version (local shapes: resume needs the same layout).
        With the distributed optimizer the optimizer state is this rank's shard only (resume needs the same
        `distributed_optimizer` setting too)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_optimizer_state(state["optimizer"], sharded=self.distributed_optimizer)
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])

    def optimizer_state_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer state tensors this rank holds, for dense and expert parameters."""
        held = {"dense": 0, "expert": 0}
        for param, state in self.optimizer.state.items():
            held["expert" if _is_expert(param) else "dense"] += sum(
                t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return held

    # ---- weight sync -----------------------------------------------------------------------------------------
    def iter_local_hf_slices(self) -> Iterator[tuple[HFSlice, torch.Tensor]]:
        return iter_local_hf_slices(self.model, self.hf)
