"""The policy's gradient reduction and optimizer: megatron-core's own, wired as megatron's training loop wires them.

Adapter to megatron-core (tested with 0.16.1; `DistributedDataParallel`, `get_megatron_optimizer`,
`finalize_model_grads`):

- `wrap_model`: the `GPTModel` stage (in `Float16Module` when `trainer.precision` is bf16) inside megatron's
  `DistributedDataParallel`. Its contiguous fp32 gradient buffers (`param.main_grad`, `grad_reduce_in_fp32`)
  accumulate every microbatch's gradient; per bucket they are all-reduced over the data-parallel group (dense
  parameters) or the expert-data-parallel group (experts), reduce-scattered with the distributed optimizer, and
  with `overlap_grad_reduce` a bucket's reduction starts while backward still runs.
- `wire_training`: what megatron's `training.py` sets on the model config so that its schedules drive those
  buffers (`no_sync_func`, `grad_sync_func`, `finalize_model_grads_func`, `grad_scale_func`).
- `build_optimizer`: `get_megatron_optimizer` with Adam in decoupled-weight-decay mode (AdamW; torch's when
  neither Transformer Engine nor Apex is installed), one optimizer for dense and one for expert parameters
  (chained). fp32: Adam steps the fp32 parameters themselves (`FP32Optimizer`), or their data-parallel shards
  (`DistributedOptimizer`). bf16: Adam steps fp32 main copies of the bf16 parameters and copies them back
  rounded (`Float16OptimizerWithFloat16Params`, or the distributed optimizer's fp32 main shards, all-gathered).
- `optimizer_step`: megatron's global gradient norm over every shard, megatron's clipping, megatron's step.

Gradient semantics: every microbatch's loss is already its contribution to the global-batch loss, so the
gradient is the SUM over microbatches and data-parallel ranks. megatron divides by the data-parallel size
unless the model config says `calculate_per_token_loss` (then the buffers are summed: gradient scaling factor 1,
`average_in_collective` off), and with that setting its schedules pass the summed token count to
`finalize_model_grads`, which would divide by it: `_finalize_grad_sums` passes no count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import torch

from megarl.config.schema import OptimizerConfig

Precision = Literal["fp32", "bf16"]
STATE_FORMAT = "megarl-megatron-optimizer-v1"


def params_dtype(precision: Precision) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def wrap_model(model: torch.nn.Module, precision: Precision, distributed_optimizer: bool,
               overlap_grad_reduce: bool, bucket_size: int | None, grad_reduce_in_bf16: bool = False,
               overlap_param_gather: bool = False) -> torch.nn.Module:
    """`model` (a `GPTModel` stage built with `params_dtype(precision)`) inside megatron's
    `DistributedDataParallel`, in `Float16Module` first when bf16 (which keeps the stage's input and, on the last
    stage, its output in the model's dtype when called with `fp32_output=False`). `bucket_size`: parameters
    per gradient bucket (None: megatron's default, max(4e7, 1e6 x DP); only with `overlap_grad_reduce`, else one
    bucket). `grad_reduce_in_bf16` (bf16 only): the gradient buffers and their reduction in bf16 instead of fp32;
    `overlap_param_gather` (distributed optimizer only): the updated parameters all-gathered bucket by bucket in the
    next forward's pre-hooks instead of inside the optimizer step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if grad_reduce_in_bf16 and precision != "bf16":
        raise ValueError("grad_reduce_in_bf16 needs precision='bf16'")
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        # the gradient buffers and their reduction in fp32 (bf16 gradients add into them), unless asked for in bf16
        grad_reduce_in_fp32=not grad_reduce_in_bf16,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
        average_in_collective=False,  # sums (see the module docstring)
    )
    module = Float16Module(model.config, model) if precision == "bf16" else model
    return DistributedDataParallel(model.config, ddp_config, module)


def _finalize_grad_sums(model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                        pg_collection: Any = None, force_all_reduce: bool = False) -> None:
    """megatron's `finalize_model_grads` (data-parallel reduction, the TP sums of the replicated parameters that
    see only this rank's heads or tokens, the tied embedding's sum over its two stages) without the division by
    the global token count its schedules pass along with `calculate_per_token_loss`."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def wire_training(ddp_model: torch.nn.Module, optimizer: Any) -> None:
    """Set on the model config what megatron's `training.py` sets for its schedules: no gradient reduction until
    the last microbatch's backward and, with `overlap_grad_reduce`, each bucket's reduction started as soon as
    its gradients are complete (`no_sync_func`, `grad_sync_func`); the reductions finished after the last
    microbatch (`finalize_model_grads_func`, summing); the loss scaled by the optimizer's loss scale
    (`grad_scale_func`; 1 in fp32 and bf16; on the model's device, where megatron's MoE aux-loss scale
    must be too: a GPU's). Every loss is a contribution to the global loss, so the schedule
    must not average over microbatches (`calculate_per_token_loss`, set before `wrap_model`)."""
    config = ddp_model.config
    assert config.calculate_per_token_loss, "set calculate_per_token_loss before wrap_model (sums, not means)"
    if ddp_model.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp_model.no_sync
        config.grad_sync_func = ddp_model.start_grad_sync
    config.finalize_model_grads_func = _finalize_grad_sums
    device = next(ddp_model.parameters()).device

    def scale_loss(loss: torch.Tensor) -> torch.Tensor:
        # megarl's losses are computed on the CPU (log-probs come back there, `MegatronPolicy._logprobs`), and so is
        # the `[1]` that megatron scales for MoE aux losses; the optimizer's loss scale lives on the model's device
        return optimizer.scale_loss(loss.to(device))

    config.grad_scale_func = scale_loss


def build_optimizer(ddp_model: torch.nn.Module, optim: OptimizerConfig, precision: Precision,
                    distributed_optimizer: bool) -> Any:
    """megatron's optimizer for `ddp_model` (a `ChainedOptimizer` of its dense and expert optimizers). Weight
    decay as megarl has always applied it: decoupled, on matrices only (norm weights and biases, ndim < 2, get
    `wd_mult` 0); `set_hyperparameters` gives each group its rate and decay before a step."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import ParamKey, ParamPredicate, get_megatron_optimizer

    config = MegatronOptimizerConfig(
        optimizer="adam", decoupled_weight_decay=True, lr=optim.lr, min_lr=optim.lr,
        weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
        clip_grad=optim.grad_clip, bf16=precision == "bf16", params_dtype=params_dtype(precision),
        use_distributed_optimizer=distributed_optimizer,
        main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
    )
    no_decay = ParamKey(predicate=ParamPredicate(name="ndim_below_2", fn=lambda p: p.ndim < 2))
    return get_megatron_optimizer(config, [ddp_model], config_overrides={no_decay: {"wd_mult": 0.0}},
                                  use_gloo_process_groups=False)


def set_hyperparameters(optimizer: Any, lr: float, weight_decay: float) -> None:
    """What megatron's `OptimizerParamScheduler` writes into each group before a step: the learning rate and the
    weight decay, times the group's multipliers."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def _chained(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_step(optimizer: Any) -> tuple[float, bool]:
    """After `finalize_model_grads`: the gradients to the fp32 main gradients, megatron's global L2 norm over
    every shard (each element once: TP replicas, the tied embedding's second copy and data-parallel replicas are
    not counted twice), clipped to `clip_grad` by megatron's `clip_grad_by_total_norm_fp32`, then megatron's step
    (with the distributed optimizer, the updated shards are all-gathered). Returns `(norm, stepped)`: a norm that
    is not finite skips the step on every rank alike (weights and optimizer state unchanged), the convention
    megatron applies with a loss scaler; `ChainedOptimizer.step` would step anyway in bf16 and fp32."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    optimizer.prepare_grads()  # no loss scaler in fp32 / bf16: it reports no overflow
    norm = float(optimizer.get_grad_norm())
    if not math.isfinite(norm):
        return norm, False
    for sub in _chained(optimizer):
        params = sub.get_parameters()
        if params and sub.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=norm)
    optimizer.step_with_ready_grads()
    return norm, True


def _main_params(sub: Any) -> list[torch.Tensor]:
    """The fp32 tensors Adam steps in one of the chained optimizers: the parameters themselves (fp32), their
    data-parallel shards (distributed optimizer), or fp32 main copies of bf16 parameters."""
    return [p for group in sub.optimizer.param_groups for p in group["params"]] if sub.optimizer else []


def adam_states(optimizer: Any) -> Iterator[tuple[bool, torch.Tensor, dict[str, Any]]]:
    """`(is_expert, main_param, Adam state)` for every tensor this rank's optimizer steps."""
    for sub in _chained(optimizer):
        if sub.optimizer is None:
            continue
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                yield bool(group.get("is_expert_parallel", False)), param, sub.optimizer.state.get(param, {})


def state_bytes(optimizer: Any) -> dict[str, int]:
    """Bytes of the Adam moments (`exp_avg`, `exp_avg_sq`) this rank holds, for dense and expert parameters."""
    held = {"dense": 0, "expert": 0}
    for expert, _, state in adam_states(optimizer):
        held["expert" if expert else "dense"] += sum(
            t.numel() * t.element_size() for k, t in state.items() if k != "step" and torch.is_tensor(t))
    return held


# How megatron's optimizers describe their state for distributed checkpointing (`MegatronPolicy.sharded_state_dict`):
# the distributed optimizer in `fully_reshardable` form (per parameter, in model space: loads at any TP / PP / EP /
# DP; 0.16.1's default `fully_sharded_model_space` is refused by its own ShardedTensor checks), and chained
# optimizers without a per-optimizer prefix (dense and MoE models chain different numbers of them)
SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def keeps_step_per_param(inner: torch.optim.Optimizer) -> bool:
    """Whether `inner` (a chained optimizer's `.optimizer`) keeps Adam's step count in each parameter's state:
    torch's `Adam` / `AdamW` (`AdamW` subclasses `Adam`), which megatron-core 0.16.1 builds when neither Transformer
    Engine nor Apex imports (`megatron/core/optimizer/__init__.py:31-34`, `:359-360`). Transformer Engine's
    `FusedAdam`, which it builds when TE imports (`:12-16`, `:361-363`), keeps one `step` per param group instead
    (TE 2.9 `transformer_engine/pytorch/optimizers/fused_adam.py:497-504`) and refuses any per-parameter state key but
    `exp_avg`, `exp_avg_sq` and `master_param` (its `name_to_dtype_map`, `:191-195`, read by `state_dict`, `:434-440`),
    as does megatron's distributed optimizer reading it (`distrib_optimizer.py:654-666` reads the group's step)."""
    return isinstance(inner, torch.optim.Adam)


def init_adam_state(optimizer: Any) -> None:
    """Give every parameter without Adam state (a fresh optimizer) the state megatron itself creates before a
    checkpoint load: each chained optimizer's own `init_state_fn(inner_optimizer, config)`, the function
    `get_megatron_optimizer` builds beside the Adam it chose (`megatron/core/optimizer/__init__.py:391-399`: zero
    `exp_avg` / `exp_avg_sq`, or the optimizer's own `initialize_state` with the precision-aware optimizer) and
    calls so in `Float16OptimizerWithFloat16Params.sharded_state_dict` / `FP32Optimizer.sharded_state_dict` when
    loading (`optimizer.py:807-808`, `:1018-1019`). megatron's `DistributedOptimizer.sharded_state_dict` does not
    call it (`distrib_optimizer.py:1246-1268`) but reads every parameter's state, on save and on load
    (`_get_main_param_and_optimizer_states`, `:906-908`, for `get_parameter_state_dp_zero`, `:1061-1070`), so megarl
    calls it for every optimizer, before a save of a fresh optimizer too.

    On torch's Adam / AdamW only (`keeps_step_per_param`), each fresh state also gets `step` 0 as torch's AdamW
    would on its first step: megatron's distributed optimizer on torch asserts one common per-parameter `step`
    (`distrib_optimizer.py:640-643`), and torch's `AdamW.step` reads it. Transformer Engine's `FusedAdam` gets no
    per-parameter `step` (its `state_dict` would raise KeyError 'step'). A no-op once the optimizer has stepped."""
    for sub in _chained(optimizer):
        if sub.optimizer is None or sub.init_state_fn is None:
            continue
        fresh = [p for group in sub.optimizer.param_groups for p in group["params"] if not sub.optimizer.state[p]]
        sub.init_state_fn(sub.optimizer, sub.config)
        if keeps_step_per_param(sub.optimizer):
            for param in fresh:
                sub.optimizer.state[param]["step"] = torch.tensor(0.0)


def unshare_adam_steps(optimizer: Any) -> None:
    """After megatron's `load_state_dict` of a sharded optimizer state on torch's Adam / AdamW: megatron-core
    0.16.1's distributed optimizer then gives every parameter's state the *same* `step` tensor
    (`distrib_optimizer.py:818-825`), which torch's AdamW increments in place once per parameter (the bias
    corrections of the next step go wrong). One tensor each. Transformer Engine's `FusedAdam` keeps its step in
    the param groups (restored from the checkpoint's groups, `distrib_optimizer.py:838-841`): nothing to do."""
    for sub in _chained(optimizer):
        if sub.optimizer is None or not keeps_step_per_param(sub.optimizer):
            continue
        for state in sub.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def optimizer_state(optimizer: Any, setting: dict[str, Any]) -> dict[str, Any]:
    """This rank's optimizer state for a checkpoint: per chained optimizer, torch's Adam state dict (moments and
    step of the tensors this rank steps, group hyper-parameters) and those fp32 main tensors (with the distributed
    optimizer: this rank's shards only). `setting` (precision, distributed optimizer) is recorded and checked on
    load: the tensors only fit the same layout and setting."""
    return {"format": STATE_FORMAT, "setting": dict(setting),
            "optimizers": [{"adam": sub.optimizer.state_dict() if sub.optimizer else None,
                            "main_params": _main_params(sub)} for sub in _chained(optimizer)]}


def check_optimizer_state(optimizer: Any, state: dict[str, Any], setting: dict[str, Any]) -> None:
    """Refuse an optimizer state that does not fit: written by megarl's former optimizer, with another
    `setting`, or for other tensors than this rank steps (another layout)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError("the checkpoint's optimizer state was written by megarl's own AdamW (before the trainer "
                         "used megatron-core's optimizer): it cannot resume here; resume it with the megarl version "
                         "that wrote it, or start fresh (`megarl export` still reads its model)")
    if state["setting"] != setting:
        diff = "; ".join(f"trainer.{k}: checkpoint {state['setting'].get(k)!r}, config {v!r}"
                         for k, v in setting.items() if state["setting"].get(k) != v)
        raise ValueError(f"the checkpoint's optimizer state was written with another setting ({diff}): resume with "
                         "the same trainer.distributed_optimizer and trainer.precision as the run that saved it")
    shapes = [[tuple(p.shape) for p in _main_params(sub)] for sub in _chained(optimizer)]
    if [[tuple(p.shape) for p in s["main_params"]] for s in state["optimizers"]] != shapes:
        raise ValueError("the checkpoint's optimizer state was written for other parameters than this rank steps: "
                         "resume with the trainer layout (world_size, tp, pp, ep) of the run that saved it")


def load_optimizer_state(optimizer: Any, state: dict[str, Any], setting: dict[str, Any]) -> None:
    """Inverse of `optimizer_state`, after the model's own state is loaded: the Adam state and the exact fp32
    main tensors (in bf16 the model's bf16 parameters are those rounded, as after a step)."""
    check_optimizer_state(optimizer, state, setting)
    for sub, s in zip(_chained(optimizer), state["optimizers"], strict=True):
        if sub.optimizer is None:
            continue
        sub.optimizer.load_state_dict(s["adam"])
        with torch.no_grad():
            for param, value in zip(_main_params(sub), s["main_params"], strict=True):
                param.copy_(value)
