"""The policy being trained: a megatron-core `GPTModel` stage with its optimizer.

`compute_logprobs` and `train_step` take token batches and return per-token log-probs of the
targets and the exact entropy, computed from the vocab-parallel logits shards (the vocabulary is
never gathered). Gradients are *summed* over microbatches and data-parallel ranks, because each
loss value is already a contribution to the global-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.schema import OptimizerConfig
from megarl.models.hf_import import load_hf_weights
from megarl.models.hf_layout import iter_local_hf_slices
from megarl.models.qwen_provider import build_gpt_model
from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from megarl.sync.slices import HFSlice

LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _is_expert(param: torch.nn.Parameter) -> bool:
    """megatron marks expert parameters (not replicated over the data-parallel group) with allreduce=False."""
    return not getattr(param, "allreduce", True)


def _is_tp_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """A parameter replicated on every TP rank (norms, router) counts in the grad norm on TP rank 0 only."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank != 0


def _all_reduce_sum(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """In-place SUM of `grads` over `group`, as one flat message."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(new)


class MegatronPolicy:
    def __init__(self, hf_dir: str | Path, hf: dict[str, Any], optim: OptimizerConfig, logprob_chunk: int = 4096):
        from megatron.core import parallel_state as ps

        self.hf, self.optim_cfg, self.chunk = hf, optim, logprob_chunk
        self.model = build_gpt_model(hf, ps.get_tensor_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_world_size(),
                                     ps.get_expert_model_parallel_world_size())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("MegatronPolicy runs pipeline-parallel size 1 only: set trainer.pp=1")
        load_hf_weights(self.model, hf_dir, hf)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.model_parallel_group = ps.get_model_parallel_group()
        self.expert_model_parallel_group = ps.get_expert_tensor_model_pipeline_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim.lr, betas=optim.betas, eps=optim.eps,
        )
        self.version = 0  # optimizer steps taken

    # ---- forward ---------------------------------------------------------------------------------------------
    def _logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens, targets [B, S]` -> `(logprobs, entropy) [B, S]` through the vocab-parallel shards."""
        b, s = tokens.shape
        device = next(self.model.parameters()).device
        tokens, targets = tokens.to(device), targets.to(device)
        positions = torch.arange(s, device=device)[None].expand(b, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
        logits = self.model(tokens, positions, causal)  # [B, S, V/tp]
        return vocab_parallel_logprobs_entropy(logits, targets, self.tp_group, self.chunk)

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor, micro: int = 64):
        self.model.eval()
        parts = [self._logprobs(tokens[i:i + micro], targets[i:i + micro]) for i in range(0, len(tokens), micro)]
        return torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts]).cpu()

    # ---- training step ---------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward every microbatch, sum gradients over DP, clip, AdamW step; version += 1.
        Returns the global loss, grad norm and the loss function's metrics summed over the global batch."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        totals: dict[str, torch.Tensor] = {}
        for mb in microbatches:
            logprobs, entropy = self._logprobs(mb["tokens"], mb["targets"])
            loss, metrics = loss_fn(logprobs.cpu(), entropy.cpu(), mb)
            loss.backward()
            for k, v in {"loss": loss.detach(), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + v.detach().float()
        self._sum_gradients()
        grad_norm = self._clip_gradients(self.optim_cfg.grad_clip)
        self._set_lr()
        self.optimizer.step()
        self.version += 1
        names = sorted(totals)
        summed = torch.stack([totals[k].reshape(()) for k in names])
        dist.all_reduce(summed, group=self.dp_group)
        return {**dict(zip(names, summed.tolist(), strict=True)), "grad_norm": grad_norm}

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

    def _clip_gradients(self, max_norm: float) -> float:
        """Global L2 norm over all model shards (each element counted once), then scale down to max_norm."""
        dense_sq = torch.zeros(())
        expert_sq = torch.zeros(())
        for p in self.model.parameters():
            if p.grad is None or _is_tp_duplicate(p, self.tp_rank):
                continue
            if _is_expert(p):
                expert_sq += p.grad.float().pow(2).sum().cpu()
            else:
                dense_sq += p.grad.float().pow(2).sum().cpu()
        dist.all_reduce(dense_sq, group=self.model_parallel_group)
        dist.all_reduce(expert_sq, group=self.expert_model_parallel_group)
        norm = float((dense_sq + expert_sq).sqrt())
        if norm > max_norm:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _set_lr(self) -> None:
        warm = self.optim_cfg.warmup_steps
        scale = min(1.0, (self.version + 1) / warm) if warm else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim_cfg.lr * scale

    # ---- weight sync -----------------------------------------------------------------------------------------
    def iter_local_hf_slices(self) -> Iterator[tuple[HFSlice, torch.Tensor]]:
        return iter_local_hf_slices(self.model, self.hf)
