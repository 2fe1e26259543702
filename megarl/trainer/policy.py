"""The policy being trained: a megatron-core `GPTModel` stage with its optimizer.

`compute_logprobs` / `microbatch_logprobs` and `train_step` take token batches and return per-token log-probs of the
targets and the exact entropy, computed from the vocab-parallel logits shards (the vocabulary is
never gathered). By default the output layer is fused with that computation
(`megarl.parallel.fused_output_logprobs`): the last stage returns its final hidden states and the log-probs
come from them and the output weight chunk by chunk, so the `[tokens, V/tp]` logits never exist whole.
Forward and backward run through megatron's `get_forward_backward_func()` (no pipelining at PP=1, 1F1B at
PP>1; the last stage's results are broadcast to the other stages), on the model wrapped as megatron trains it:
megatron's `DistributedDataParallel` (fp32 gradient buffers, bucketed reduction overlapping backward), its
optimizer (AdamW on fp32 main parameters, sharded over data parallel with the distributed optimizer) and its
`finalize_model_grads` (`megarl.trainer.optimizer`); in bf16 (`precision`) the stage is bf16 inside megatron's
`Float16Module`. Gradients are *summed* over microbatches and data-parallel ranks, because each loss value is
already a contribution to the global-batch loss; clipping uses megatron's global norm over all TP/PP/EP shards.
With routing replay, a microbatch's `routed_experts` route each of its tokens to the given experts in every MoE
layer (`megarl.trainer.routing_replay`).
"""

from __future__ import annotations

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
from megarl.models.layer_backend import precision_problem, resolve_layer_spec, te_installed
from megarl.models.qwen_provider import build_gpt_model, padded_vocab_size
from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy, resolve_kernel
from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy
from megarl.sync.slices import HFSlice
from megarl.trainer.batching import thd_params
from megarl.trainer.optimizer import (
    SHARDED_METADATA,
    Precision,
    build_optimizer,
    check_optimizer_state,
    init_adam_state,
    load_optimizer_state,
    optimizer_state,
    optimizer_step,
    params_dtype,
    set_hyperparameters,
    state_bytes,
    unshare_adam_steps,
    wire_training,
    wrap_model,
)
from megarl.trainer.placement import microbatches_on_device
from megarl.trainer.routing_replay import check_routes, clear_routes, set_microbatch_routes, stage_routers

LossFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


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


def _attention_mask(segments: torch.Tensor | None, s: int, device: torch.device) -> torch.Tensor | None:
    """The `attention_mask` a microbatch row of `s` positions is run with (True = masked). Unpacked: None, the
    attention being causal (`AttnMaskType.causal` in megatron-core 0.16.1's layer specs): Transformer Engine
    masks causally itself, and megatron's local `FusedScaleMaskSoftmax` builds the causal mask itself when given
    None (or uses its fused upper-triangular kernel). Packed (`segments [1, s]`, -1 on the trailing padding): the
    causal mask cut into blocks, a position attending only to earlier positions of its own sequence."""
    if segments is None:
        return None
    index = torch.arange(s, device=device)
    causal = index[None, :] > index[:, None]  # [s, s]: key after query
    return causal[None, None] | (segments[:, None, :, None] != segments[:, None, None, :])


def attention_inputs(mb: dict[str, torch.Tensor], s: int, device: torch.device, layer_spec: str):
    """(attention mask, `PackedSeqParams`) a microbatch runs with: unpacked, neither (causal); packed on the local
    spec, the block-diagonal mask; packed on Transformer Engine's (`layer_spec` "te"), no mask and THD parameters
    (`batching.thd_params`), which TE's attention and fused RoPE take instead (TE ignores an arbitrary mask)."""
    if "packed_tokens" not in mb:
        return None, None
    if layer_spec == "te":
        return None, thd_params(mb["packed_cu_seqlens"])
    return _attention_mask(mb["packed_segments"], s, device), None


def _configure_schedule(config, pp: int) -> None:
    """Adapter to megatron's schedules and DDP (tested with megatron-core 0.16.1): every loss value is already a
    contribution to the global loss, so neither the schedule may divide by the microbatch count nor DDP by the
    data-parallel size (the 3-tuple loss-function form with `calculate_per_token_loss`: gradient buffers are
    summed; `megarl.trainer.optimizer` drops the token count megatron would then divide by); with PP > 1
    microbatch shapes may vary between steps, so stages exchange them (`variable_seq_lengths`)."""
    config.calculate_per_token_loss = True
    config.variable_seq_lengths = pp > 1


class MegatronPolicy:
    """This rank's `GPTModel` stage, loaded from an HF checkpoint, with megatron's DDP and AdamW. Every rank of
    the trainer world calls each method together; the ranks of one model replica (its TP and PP peers) pass the
    same data-parallel share of the batch, and results come back on every rank, pipeline stages included.
    `model` is the bare `GPTModel` stage (its parameter names are the checkpoint's and the weight sync's);
    `ddp_model` wraps it for training."""

    def __init__(self, hf_dir: str | Path, hf: dict[str, Any], optim: OptimizerConfig, logprob_chunk: int = 4096,
                 distributed_optimizer: bool = False, recompute: str = "none", routing_replay: bool = False,
                 fused_logprobs: bool = True, logprob_vocab_block: int | None = None,
                 logprob_kernel: str = "auto", moe_aux_loss_coeff: float = 0.0, precision: Precision = "fp32",
                 overlap_grad_reduce: bool = True, grad_bucket_size: int | None = None, layer_spec: str = "auto",
                 grad_reduce_in_bf16: bool = False, overlap_param_gather: bool = False,
                 recompute_layers: int | None = None):
        """`fused_logprobs`: on the last stage, the output projection fused with the log-probs
        (`fused_output_logprobs_entropy`: the same values and gradients without the whole logits) wherever the
        output layer allows it (`_fusable_output_layer`); elsewhere, or when False, the output layer's logits
        through `vocab_parallel_logprobs_entropy`. `logprob_vocab_block`: the fused path's shard rows per tile
        (None: the whole shard); `logprob_kernel`: its tiles' elementwise work, "eager" or "compiled" ("auto": by
        the model's device, `fused_output_logprobs.default_kernel`).
        `distributed_optimizer`: megatron's distributed optimizer (gradients reduce-scattered, AdamW state and fp32
        main parameters sharded over data-parallel replicas, updated parameters all-gathered);
        `precision`: "fp32" (the exact reference) or "bf16" (bf16 parameters and compute, fp32 main parameters and
        gradient buffers); `overlap_grad_reduce` / `grad_bucket_size` / `grad_reduce_in_bf16` /
        `overlap_param_gather`: megatron's DDP settings (`megarl.trainer.optimizer.wrap_model`);
        `layer_spec`: `trainer.layer_spec`, resolved by `megarl.models.layer_backend.resolve_layer_spec` from what this
        rank has (a GPU without Transformer Engine is refused unless "local");
        `recompute`: activation recomputation, "none" / "full" / "selective", with `recompute_layers` for "full"
        over the first layers of each stage only (`qwen_provider.recompute_fields`);
        `routing_replay`: microbatches that carry `routed_experts [b, s, L, k]` are routed to exactly those
        experts (`megarl.trainer.routing_replay`); `moe_aux_loss_coeff`: the router's load-balancing loss
        (`trainer.moe_aux_loss_coeff`, 0 = none). Expert tensor parallel is the parallel state's."""
        from megatron.core import parallel_state as ps

        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={precision!r}: use 'fp32' or 'bf16'")
        self.hf, self.optim_cfg, self.chunk, self.vocab_block = hf, optim, logprob_chunk, logprob_vocab_block
        self.logprob_kernel, self.precision = logprob_kernel, precision
        _check_replay_layout(routing_replay, recompute, ps.get_tensor_model_parallel_world_size())
        self.layer_spec = resolve_layer_spec(layer_spec, torch.cuda.is_available(), te_installed())
        if (problem := precision_problem(self.layer_spec, precision)) is not None:
            raise ValueError(problem)
        self.model = build_gpt_model(hf, ps.get_tensor_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_world_size(),
                                     ps.get_expert_model_parallel_world_size(), params_dtype=params_dtype(precision),
                                     recompute=recompute, routing_replay=routing_replay,
                                     expert_tp=ps.get_expert_tensor_parallel_world_size(),
                                     moe_aux_loss_coeff=moe_aux_loss_coeff, backend=self.layer_spec,
                                     recompute_layers=recompute_layers)
        self.routers = stage_routers(self.model) if routing_replay else None  # this stage's MoE routers
        _configure_schedule(self.model.config, ps.get_pipeline_model_parallel_world_size())
        load_hf_weights(self.model, hf_dir, hf)  # rounded to bf16 in bf16, as transformers loads in bf16
        self.ddp_model = wrap_model(self.model, precision, distributed_optimizer, overlap_grad_reduce,
                                    grad_bucket_size, grad_reduce_in_bf16, overlap_param_gather)
        # overlap_param_gather: after a step the updated parameters are gathered by the next forward's pre-hooks;
        # anything else that reads them first (a push, a checkpoint) gathers them (`_gathered_params`)
        self._params_pending = False
        # bf16: the last stage's logits / hidden states stay bf16 (the log-prob paths compute in fp32 themselves)
        self.forward_kwargs = {"fp32_output": False} if precision == "bf16" else {}
        self.distributed_optimizer = distributed_optimizer
        self.optimizer = build_optimizer(self.ddp_model, optim, precision, distributed_optimizer)
        wire_training(self.ddp_model, self.optimizer)
        self.device = next(self.model.parameters()).device  # collectives run on it (NCCL takes no CPU tensors)
        self.logprob_kernel = resolve_kernel(logprob_kernel, self.device)  # "auto": compiled on CUDA, eager on a CPU
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank of this pipeline's last stage
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.fused_logprobs = fused_logprobs and self.is_last_stage and _fusable_output_layer(self.model)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        tp = ps.get_tensor_model_parallel_world_size()
        shard = padded_vocab_size(hf, tp) // tp
        # real (unpadded) vocabulary columns in this rank's logits shard [tp_rank*shard, (tp_rank+1)*shard)
        self.local_vocab = min(max(hf["vocab_size"] - self.tp_rank * shard, 0), shard)
        self.version = 0  # optimizer steps taken
        # entered around megatron's microbatch loop (forward, backward, loss, metrics of every microbatch): a hook
        # for instrumentation, e.g. a dispatch mode that counts host syncs (tests/test_no_host_sync.py)
        self.microbatch_loop_context: Callable[[], Any] = nullcontext

    # ---- forward through megatron's schedule -----------------------------------------------------------------
    def _forward_step(self, last_stage_fn: Callable, data_iterator: Iterator[dict[str, torch.Tensor]], model):
        """megatron `forward_step_func`: run this stage on the next microbatch (already on the device,
        `microbatches_on_device`): `tokens [b, s]` with no mask (the attention is causal: megatron applies its
        causal mask itself, `_attention_mask`); a packed microbatch's one row gets a block-diagonal causal mask
        (True = masked); on the last stage `last_stage_fn(microbatch, output)` reduces it, `output` the logits
        `[b, s, V/tp]` or, with `fused_logprobs`, the final hidden states (`_output_layer_returns_hidden_states`)."""
        mb = next(data_iterator)
        self._set_routes(mb)
        packed = "packed_tokens" in mb
        tokens = mb["packed_tokens"] if packed else mb["tokens"]
        b, s = tokens.shape
        if packed:  # RoPE depends only on relative positions, so a sequence's offset in the row changes nothing
            positions = mb["packed_positions"]
        else:
            positions = torch.arange(s, device=tokens.device)[None].expand(b, s)
        mask, thd = attention_inputs(mb, s, tokens.device, self.layer_spec)
        kwargs = {**self.forward_kwargs, **({"packed_seq_params": thd} if thd is not None else {})}
        output = model(tokens, positions, mask, **kwargs)  # hidden [s, b, h] on inner stages
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

    def _logprobs(self, output: torch.Tensor, mb: dict[str, torch.Tensor],
                  entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's `output` (`_forward_step`) -> `(logprobs, entropy) [b, s]` on the model's device,
        through the vocab-parallel shards. A packed microbatch's row is gathered back to one row per sequence,
        `[b, S]` (`unpack_index`). `entropy_grad` False: the entropy without gradient (no entropy backward)."""
        targets = mb["packed_targets"] if "packed_targets" in mb else mb["targets"]
        if self.fused_logprobs:
            lp, ent = self._fused_logprobs(output, targets, entropy_grad)
        else:
            lp, ent = self._unfused_logprobs(output, targets, entropy_grad)
        if "unpack_index" in mb:
            lp, ent = lp.reshape(-1)[mb["unpack_index"]], ent.reshape(-1)[mb["unpack_index"]]
        return lp, ent

    def _unfused_logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                          entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits [b, s, V/tp]` (the output layer's) -> `(logprobs, entropy) [b, s]`."""
        if self.local_vocab < logits.shape[-1]:  # padding columns (vocab padded to a multiple of TP) are no tokens
            logits = logits.clone()
            logits[..., self.local_vocab:] = torch.finfo(logits.dtype).min
        return vocab_parallel_logprobs_entropy(logits, targets, self.tp_group, self.chunk, entropy_grad=entropy_grad)

    def _fused_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                        entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden [b, s, h]` (the output layer's input) -> `(logprobs, entropy) [b, s]`, with the weight the output
        layer would use (the embedding's at PP=1 with tied embeddings, as GPTModel passes it)."""
        model = self.model
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)
        hidden = hidden.to(weight.dtype)  # bf16 stays bf16 (fp32_output=False): the output layer's own operands
        if not model.output_layer.sequence_parallel:
            return fused_output_logprobs_entropy(hidden, weight, targets, self.tp_group, self.chunk, self.local_vocab,
                                                 vocab_block=self.vocab_block, kernel=self.logprob_kernel,
                                                 entropy_grad=entropy_grad)
        # sequence parallel: hidden [b, s/tp, h] holds this rank's slice of the sequence, dim 0 of [s, b, h]
        lp, ent = fused_output_logprobs_entropy(hidden.transpose(0, 1), weight, targets.t(), self.tp_group,
                                                self.chunk, self.local_vocab, sequence_parallel=True,
                                                vocab_block=self.vocab_block, kernel=self.logprob_kernel,
                                                entropy_grad=entropy_grad)
        return lp.t(), ent.t()

    def _run(self, microbatches: list[dict[str, torch.Tensor]], last_stage_fn: Callable,
             forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """All microbatches through `get_forward_backward_func()` (no pipelining at PP=1, 1F1B otherwise);
        returns `last_stage_fn`'s per-microbatch dicts on the last stage, [] on the others."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        b, s = microbatches[0]["packed_tokens" if "packed_tokens" in microbatches[0] else "tokens"].shape
        self._check_routes(microbatches)
        on_device = microbatches_on_device(microbatches, self.device)  # once per step, before the loop
        try:
            with (_output_layer_returns_hidden_states(self.model) if self.fused_logprobs else nullcontext(),
                  self.microbatch_loop_context()):
                return get_forward_backward_func()(
                    forward_step_func=partial(self._forward_step, last_stage_fn), data_iterator=iter(on_device),
                    model=self.ddp_model, num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                    forward_only=forward_only,
                )
        finally:
            if self.routers is not None:
                clear_routes(self.routers)

    @torch.no_grad()
    def compute_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor, micro: int = 64,
                         routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens, targets [B, S]` (long) -> `(logprobs, entropy) [B, S]` fp32 on the CPU, on every rank, in
        microbatches of `micro` rows. `routed_experts [B, S, L, k]`: replay these experts (needs `routing_replay`)."""
        rows = {"tokens": tokens, "targets": targets}
        if routed_experts is not None:
            rows["routed_experts"] = routed_experts
        mbs = [{k: v[i:i + micro] for k, v in rows.items()} for i in range(0, len(tokens), micro)]
        out = self.microbatch_logprobs(mbs)
        return torch.cat([lp for lp, _ in out]), torch.cat([ent for _, ent in out])

    @torch.no_grad()
    def microbatch_logprobs(self, microbatches: list[dict[str, torch.Tensor]]
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward only, through the same schedule as `train_step`, over microbatches shaped as `train_step` takes
        them (`tokens, targets [b, S]`, packed ones with their packed inputs, `routed_experts` to replay): per
        microbatch `(logprobs, entropy) [b, S]` fp32 on the CPU, on every rank (pipeline stages included)."""
        self.model.eval()

        one = torch.ones((), dtype=torch.int, device=self.device)  # megatron's token count: unused (per-token loss)

        def collect(mb, output):
            lp, ent = self._logprobs(output, mb)
            return torch.zeros((), device=self.device), one, {"logprobs": lp, "entropy": ent}

        outs = self._run(microbatches, collect, forward_only=True)
        sizes = [mb["tokens"].numel() for mb in microbatches]
        result = torch.zeros(2, sum(sizes), device=self.device)
        if self.is_last_stage:
            result[0] = torch.cat([o["logprobs"].reshape(-1) for o in outs])
            result[1] = torch.cat([o["entropy"].reshape(-1) for o in outs])
        logprobs, entropy = self._from_last_stage(result).cpu()
        return [(lp.reshape(mb["tokens"].shape), ent.reshape(mb["tokens"].shape))
                for lp, ent, mb in zip(logprobs.split(sizes), entropy.split(sizes), microbatches, strict=True)]

    # ---- training step ---------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict[str, torch.Tensor]], loss_fn: LossFn,
                   entropy_grad: bool = True) -> dict[str, float]:
        """Forward/backward every microbatch (megatron's DDP sums the gradients over microbatches and DP ranks,
        `finalize_model_grads` completes them), megatron's clip and AdamW step; version += 1.
        `loss_fn(logprobs [b, s], entropy [b, s], microbatch) -> (loss, metrics)` returns the microbatch's
        contribution to the GLOBAL loss. Returns the global loss, the grad norm before clipping and the
        loss function's metrics summed over the global batch (the same dict on every rank). `entropy_grad`
        False: `loss_fn` gets the entropy without gradient (for a loss without an entropy term: no entropy
        backward runs; the log-probs' gradient and every value are the same)."""
        self.model.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

        one = torch.ones((), dtype=torch.int, device=self.device)  # megatron's token count: unused (per-token loss)

        def loss_on_last_stage(mb, output):  # everything stays on the device: metrics are read after the loop
            loss, metrics = loss_fn(*self._logprobs(output, mb, entropy_grad), mb)
            reported = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
            return loss, one, reported

        outs = self._run(microbatches, loss_on_last_stage, forward_only=False)  # ends in finalize_model_grads
        self._set_hyperparameters()
        # the same norm on every rank; not finite: the step is skipped, weights and optimizer state as they were
        grad_norm, stepped = optimizer_step(self.optimizer)
        self._params_pending = self.ddp_model.ddp_config.overlap_param_gather
        skipped = not stepped
        self.version += 1  # a skipped step still counts: the lag schedule is in steps
        metrics = self._sum_metrics(outs) if self.is_last_stage else {}
        return {**self._metrics_from_last_stage(metrics), "grad_norm": grad_norm, "train/skipped_step": int(skipped)}

    def _sum_metrics(self, outs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Per-microbatch metric dicts of this rank (device tensors) -> sums over microbatches and data-parallel
        ranks, summed on the device in float64, all-reduced as one buffer and read to the host once: a float per
        scalar metric; a metric of several elements (a histogram's counts) comes back as a CPU tensor."""
        names = sorted({k for o in outs for k in o})
        parts = [sum(o[k].to(device=self.device, dtype=torch.float64).reshape(-1) for o in outs if k in o)
                 for k in names]
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.dp_group)
        host = flat.cpu()  # the step's one read of its metrics
        result: dict[str, Any] = {}
        for name, part, value in zip(names, parts, host.split([p.numel() for p in parts]), strict=True):
            result[name] = value if part.numel() != 1 else float(value)
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

    def _set_hyperparameters(self) -> None:
        """Linear warmup from 0 (step k of `warmup_steps` at k/warmup of the rate, step 1 first), then constant."""
        warm = self.optim_cfg.warmup_steps
        scale = min(1.0, (self.version + 1) / warm) if warm else 1.0
        set_hyperparameters(self.optimizer, self.optim_cfg.lr * scale, self.optim_cfg.weight_decay)

    def _gathered_params(self) -> None:
        """With `overlap_param_gather`, finish the all-gather of the last step's updated parameters now (collective
        over the data-parallel ranks), for a reader outside the forward pass; otherwise nothing to do."""
        if self._params_pending:
            self.ddp_model.start_param_sync(force_sync=True)
            self._params_pending = False

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def _optimizer_setting(self) -> dict[str, Any]:
        return {"distributed_optimizer": self.distributed_optimizer, "precision": self.precision}

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shard (in the model's dtype), optimizer state (Adam moments and fp32 main
        parameters of what this rank steps: its data-parallel shard with the distributed optimizer) and version.
        Local shapes: resume needs the same layout, `distributed_optimizer` and `precision`."""
        self._gathered_params()
        return {"model": self.model.state_dict(),
                "optimizer": optimizer_state(self.optimizer, self._optimizer_setting()), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_optimizer_state(self.optimizer, state["optimizer"], self._optimizer_setting())  # before any change
        self.model.load_state_dict(state["model"], strict=True)
        load_optimizer_state(self.optimizer, state["optimizer"], self._optimizer_setting())
        self.version = int(state["version"])

    def sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        """The model and optimizer state as megatron's sharded state dict (`megarl.checkpoint` saves and loads it
        with `dist_checkpointing`): the model's tensors with their place in the global tensors, the optimizer's
        fp32 main parameters and Adam moments per parameter in model space, so it loads at any TP / PP / EP / DP.
        `is_loading`: for a fresh policy about to load (its optimizer state is created first)."""
        self._gathered_params()
        init_adam_state(self.optimizer)
        model = self.model.sharded_state_dict()
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata=dict(SHARDED_METADATA))}

    def load_sharded_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Take the tensors `dist_checkpointing.load` filled into `sharded_state_dict(is_loading=True)`."""
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        unshare_adam_steps(self.optimizer)
        self.version = int(version)

    def optimizer_state_bytes(self) -> dict[str, int]:
        """Bytes of the Adam moments this rank holds, for dense and expert parameters."""
        return state_bytes(self.optimizer)

    # ---- weight sync -----------------------------------------------------------------------------------------
    def iter_local_hf_slices(self) -> Iterator[tuple[HFSlice, torch.Tensor]]:
        self._gathered_params()  # every trainer rank pushes together: a collective is safe here
        return iter_local_hf_slices(self.model, self.hf)
