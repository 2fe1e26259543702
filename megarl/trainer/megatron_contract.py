"""What megarl touches inside megatron-core 0.16.1 (and what megatron and megarl expect of Transformer Engine 2.9),
as data, with the check that it still holds: `check_megatron_contract()` / `check_te_contract(module)` return the
problems (empty when everything holds). They import megatron (and TE) but start nothing, so a GPU node runs the same
check as the CPU suite (`python -m megarl.trainer.megatron_contract`; exit 1 on a problem).

Each `Entry` names the megarl file that uses a piece of megatron, the piece (a dotted path, resolved by import and
attribute access), what must hold of it (`kind`, `names`), and where in megatron-core 0.16.1's installed source it
was read (`read`, a path under `site-packages/` and lines; `tests/test_megatron_contract.py` checks each citation's
first line is the definition's). Kinds:

- `attribute`: each of `names` is an attribute of the target (class attributes, methods, module names);
- `parameters`: each of `names` is a named parameter of the callable's signature (the keyword arguments megarl
  passes);
- `enum_members`: each of `names` is a member of the enum;
- `fields`: each of `names` is a field of the dataclass (inherited ones included) or a key of the TypedDict;
- `source`: each of `names` occurs in the target's source text: instance attributes set in `__init__`, dictionary
  keys megatron reads (the sharded-state metadata), a call convention megarl follows;
- `members_of`: each of `names` is in the collection the target is.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

Kind = Literal["attribute", "parameters", "enum_members", "fields", "source", "members_of"]

MCORE = "megatron-core 0.16.1"
TE = "Transformer Engine 2.9"


@dataclass(frozen=True)
class Entry:
    """One thing megarl relies on in megatron-core (module docstring)."""

    user: str  # the megarl file that uses it
    target: str  # dotted path: module, then attributes
    kind: Kind
    names: tuple[str, ...]
    read: str  # where it was read: `megatron/core/...py:first-last` (megatron-core 0.16.1)


_OPT = "megarl/trainer/optimizer.py"
_POLICY = "megarl/trainer/policy.py"
_QWEN = "megarl/models/qwen_provider.py"
_COMPAT = "megarl/parallel/cpu_compat.py"
_CKPT = "megarl/checkpoint.py"
_REPLAY = "megarl/trainer/routing_replay.py"
_SPEC_KEYS = "megarl/models/spec_keys.py"
_DO = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"

# every TransformerConfig field megarl sets (qwen_provider.transformer_config_from_hf, te_fusions, local_fusions,
# recompute_fields; policy._configure_schedule; optimizer.wire_training) or reads (policy._fusable_output_layer)
TRANSFORMER_CONFIG_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "hidden_dropout", "attention_dropout", "bias_dropout_fusion", "persist_layer_norm",
    "attention_backend", "bias_activation_fusion", "apply_rope_fusion", "masked_softmax_fusion",
    "gradient_accumulation_fusion", "use_cpu_initialization", "perform_initialization", "params_dtype", "bf16",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "pipeline_dtype", "sequence_parallel",
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type", "moe_grouped_gemm",
    "moe_permute_fusion", "moe_router_dtype", "moe_enable_routing_replay",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "calculate_per_token_loss", "variable_seq_lengths", "no_sync_func", "grad_sync_func",
    "finalize_model_grads_func", "grad_scale_func", "mtp_num_layers", "defer_embedding_wgrad_compute",
)

CONTRACT: tuple[Entry, ...] = (
    # ---- the optimizer (megarl/trainer/optimizer.py) -----------------------------------------------------------
    Entry(_OPT, "megatron.core.optimizer.get_megatron_optimizer", "parameters",
          ("config", "model_chunks", "config_overrides", "use_gloo_process_groups"),
          "megatron/core/optimizer/__init__.py:505-689"),
    Entry(_OPT, "megatron.core.optimizer.OptimizerConfig", "fields",
          ("optimizer", "decoupled_weight_decay", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2",
           "adam_eps", "clip_grad", "bf16", "params_dtype", "use_distributed_optimizer", "main_grads_dtype",
           "main_params_dtype", "use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype"),
          "megatron/core/optimizer/optimizer_config.py:138-426"),
    Entry(_COMPAT, "megatron.core.optimizer.OptimizerConfig.__post_init__", "source",
          ("self.use_precision_aware_optimizer_no_fp8_or_ds_fp8 =",),
          "megatron/core/optimizer/optimizer_config.py:346-426"),
    Entry(_OPT, "megatron.core.optimizer.ParamKey", "fields", ("predicate",),
          "megatron/core/optimizer/optimizer_config.py:64-135"),
    Entry(_OPT, "megatron.core.optimizer.ParamPredicate", "fields", ("name", "fn"),
          "megatron/core/optimizer/optimizer_config.py:12-33"),
    Entry(_OPT, "megatron.core.optimizer_param_scheduler.ParamGroupOverride", "fields", ("wd_mult",),
          "megatron/core/optimizer_param_scheduler.py:17-34"),
    Entry(_OPT, "megatron.core.optimizer.ChainedOptimizer.__init__", "source", ("self.chained_optimizers",),
          "megatron/core/optimizer/optimizer.py:1086-1105"),
    Entry(_OPT, "megatron.core.optimizer.ChainedOptimizer", "attribute",
          ("param_groups", "prepare_grads", "get_grad_norm", "step_with_ready_grads", "scale_loss",
           "sharded_state_dict", "load_state_dict", "_synchronize_steps"),
          "megatron/core/optimizer/optimizer.py:1076-1422"),
    Entry(_OPT, "megatron.core.optimizer.optimizer.MegatronOptimizer", "attribute", ("get_parameters",),
          "megatron/core/optimizer/optimizer.py:99-434"),
    # megarl's init_adam_state calls each optimizer's init_state_fn as megatron does
    Entry(_OPT, "megatron.core.optimizer.optimizer.MegatronOptimizer.__init__", "parameters",
          ("optimizer", "config", "init_state_fn"), "megatron/core/optimizer/optimizer.py:109-123"),
    Entry(_OPT, "megatron.core.optimizer.optimizer.MegatronOptimizer.__init__", "source",
          ("self.init_state_fn = init_state_fn", "self.config = config"),
          "megatron/core/optimizer/optimizer.py:109-123"),
    Entry(_OPT, "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups", "source",
          ("def init_state_fn(opt, config=None):", "optimizer_args = [optimizer, config, grad_scaler, init_state_fn]",
           "FP32Optimizer(optimizer, config, init_state_fn)", 'kwargs["adam_w_mode"] = config.decoupled_weight_decay'),
          "megatron/core/optimizer/__init__.py:267-475"),
    Entry(_OPT, "megatron.core.optimizer.optimizer.FP32Optimizer.sharded_state_dict", "source",
          ("self.init_state_fn(self.optimizer, self.config)",), "megatron/core/optimizer/optimizer.py:1012-1035"),
    # the names megatron binds from its import-time TE try (tests/te_standin.py rebinds them)
    Entry(_OPT, "megatron.core.optimizer", "attribute", ("Adam", "USING_PYTORCH_OPTIMIZER"),
          "megatron/core/optimizer/__init__.py:12-34"),
    Entry(_COMPAT, "megatron.core.optimizer.distrib_optimizer", "attribute",
          ("Adam", "HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER", "USING_APEX_OPTIMIZER"),
          "megatron/core/optimizer/distrib_optimizer.py:21-36"),
    Entry(_OPT, f"{_DO}.sharded_state_dict", "parameters",
          ("model_sharded_state_dict", "is_loading", "metadata"),
          "megatron/core/optimizer/distrib_optimizer.py:1175-1294"),
    Entry(_OPT, f"{_DO}.sharded_state_dict", "source",
          ("'distrib_optim_sharding_type'", "elif sharding_type == 'fully_reshardable':"),
          "megatron/core/optimizer/distrib_optimizer.py:1175-1294"),
    Entry(_OPT, f"{_DO}.checkpoint_fully_reshardable_formats",
          "members_of", ("fully_reshardable",), "megatron/core/optimizer/distrib_optimizer.py:105-109"),
    Entry(_OPT, "megatron.core.optimizer.optimizer.ChainedOptimizer.sharded_state_dict", "source",
          ("'chained_optim_avoid_prefix'", '"distrib_optim_sharding_type"'),
          "megatron/core/optimizer/optimizer.py:1184-1214"),
    # where the step lives: per parameter on torch's AdamW, per group on TE's FusedAdam
    Entry(_OPT, f"{_DO}.state_dict", "source",
          ('s["step"].item()', 'g["step"]'), "megatron/core/optimizer/distrib_optimizer.py:628-688"),
    Entry(_OPT, f"{_DO}.load_state_dict", "source",
          ('s["step"] = step',), "megatron/core/optimizer/distrib_optimizer.py:690-881"),
    Entry(_OPT, "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32", "parameters",
          ("parameters", "max_norm", "total_norm"), "megatron/core/optimizer/clip_grads.py:138-177"),
    # ---- DDP, schedules, finalize (megarl/trainer/optimizer.py, policy.py) --------------------------------------
    Entry(_OPT, "megatron.core.distributed.DistributedDataParallelConfig", "fields",
          ("grad_reduce_in_fp32", "overlap_grad_reduce", "overlap_param_gather", "use_distributed_optimizer",
           "bucket_size", "average_in_collective"),
          "megatron/core/distributed/distributed_data_parallel_config.py:7-161"),
    Entry(_OPT, "megatron.core.distributed.DistributedDataParallel.__init__", "parameters",
          ("config", "ddp_config", "module"), "megatron/core/distributed/distributed_data_parallel.py:41-353"),
    Entry("megarl/bench/trainer.py", "megatron.core.distributed.DistributedDataParallel.__init__", "source",
          ("self.ddp_config = ddp_config", "self.buffers, self.bucket_groups", "self.expert_parallel_buffers"),
          "megatron/core/distributed/distributed_data_parallel.py:41-353"),
    Entry(_POLICY, "megatron.core.distributed.DistributedDataParallel", "attribute",
          ("no_sync", "start_grad_sync", "start_param_sync", "zero_grad_buffer"),
          "megatron/core/distributed/distributed_data_parallel.py:22-611"),
    Entry(_POLICY, "megatron.core.distributed.DistributedDataParallel.start_param_sync", "parameters",
          ("force_sync",), "megatron/core/distributed/distributed_data_parallel.py:463-511"),
    Entry(_OPT, "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__", "source",
          ("param.main_grad = self._get(",), "megatron/core/distributed/param_and_grad_buffer.py:586-892"),
    Entry(_OPT, "megatron.core.distributed.finalize_model_grads", "parameters",
          ("model", "num_tokens", "pg_collection", "force_all_reduce"),
          "megatron/core/distributed/finalize_model_grads.py:396-497"),
    Entry(_OPT, "megatron.core.transformer.module.Float16Module.__init__", "parameters", ("config", "module"),
          "megatron/core/transformer/module.py:424-448"),
    Entry(_POLICY, "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining", "parameters",
          ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
           "forward_only"), "megatron/core/pipeline_parallel/schedules.py:518-700"),
    Entry(_POLICY, "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
          "parameters", ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                         "micro_batch_size", "forward_only"), "megatron/core/pipeline_parallel/schedules.py:1972-2331"),
    Entry(_POLICY, "megatron.core.tensor_parallel.layers.ColumnParallelLinear.__init__", "source",
          ("self.gather_output = gather_output",), "megatron/core/tensor_parallel/layers.py:800-946"),
    Entry("megarl/parallel/groups.py", "megatron.core.parallel_state.initialize_model_parallel", "parameters",
          ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
           "expert_tensor_parallel_size"), "megatron/core/parallel_state.py:548-1354"),
    Entry("megarl/trainer/batching.py", "megatron.core.packed_seq_params.PackedSeqParams", "fields",
          ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv"),
          "megatron/core/packed_seq_params.py:8-23"),
    # ---- dist_checkpointing (megarl/checkpoint.py, megarl/models/hf_export.py) ----------------------------------
    Entry(_CKPT, "megatron.core.dist_checkpointing.save", "parameters",
          ("sharded_state_dict", "checkpoint_dir", "sharded_strategy"),
          "megatron/core/dist_checkpointing/serialization.py:314-439"),
    Entry(_CKPT, "megatron.core.dist_checkpointing.load", "parameters", ("sharded_state_dict", "checkpoint_dir"),
          "megatron/core/dist_checkpointing/serialization.py:61-171"),
    Entry(_CKPT, "megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy.__init__",
          "parameters", ("backend", "version", "thread_count"),
          "megatron/core/dist_checkpointing/strategies/torch.py:597-641"),
    # ---- checkpoints across layer specs (megarl/models/spec_keys.py): the sharded key maps it relies on ----------
    Entry(_SPEC_KEYS, "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec", "source",
          ('"input_layernorm.": "self_attention.linear_qkv.layer_norm_"',
           '"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"'),
          "megatron/core/models/gpt/gpt_layer_specs.py:306-422"),
    Entry(_SPEC_KEYS, "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec", "source",
          ("linear_qkv=backend.column_parallel_layer_norm_linear()",
           "pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp",
           '"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight"'),
          "megatron/core/models/gpt/gpt_layer_specs.py:171-303"),
    Entry(_SPEC_KEYS, "megatron.core.transformer.transformer_layer.TransformerLayer.sharded_state_dict", "source",
          ("sharded_state_dict_keys_map", "apply_prefix_mapping(sharded_state_dict, prefixed_map)"),
          "megatron/core/transformer/transformer_layer.py:837-858"),
    Entry(_SPEC_KEYS, "megatron.core.transformer.moe.experts.TEGroupedMLP.sharded_state_dict", "source",
          ("replace_prefix_for_sharding(sub_sd, f'{name}.', f'{prefix}experts.{name}.')",),
          "megatron/core/transformer/moe/experts.py:768-806"),
    Entry(_SPEC_KEYS, "megatron.core.transformer.moe.experts.SequentialMLP.sharded_state_dict", "source",
          ("expert_sharded_prefix = f'{prefix}experts.'",), "megatron/core/transformer/moe/experts.py:935-976"),
    Entry(_SPEC_KEYS, "megatron.core.dist_checkpointing.serialization.load_sharded_metadata", "parameters",
          ("checkpoint_dir",), "megatron/core/dist_checkpointing/serialization.py:227-267"),
    Entry(_SPEC_KEYS, "megatron.core.dist_checkpointing.dict_utils.nested_values", "parameters", ("x",),
          "megatron/core/dist_checkpointing/dict_utils.py:166-173"),
    Entry(_SPEC_KEYS, "megatron.core.dist_checkpointing.dict_utils.merge", "parameters", ("x1", "x2"),
          "megatron/core/dist_checkpointing/dict_utils.py:220-241"),
    # ---- the model (megarl/models/qwen_provider.py) -----------------------------------------------------------
    Entry(_QWEN, "megatron.core.transformer.TransformerConfig", "fields", TRANSFORMER_CONFIG_FIELDS,
          "megatron/core/transformer/transformer_config.py:33-2002"),
    Entry(_QWEN, "megatron.core.transformer.enums.AttnBackend", "enum_members",
          ("flash", "fused", "unfused", "local", "auto"), "megatron/core/transformer/enums.py:60-67"),
    Entry(_QWEN, "megatron.core.models.common.language_module.language_module.LanguageModule._set_attention_backend",
          "source", ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "AttnBackend.auto"),
          "megatron/core/models/common/language_module/language_module.py:92-126"),
    Entry(_QWEN, "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec",
          "parameters", ("num_experts", "moe_grouped_gemm", "qk_layernorm"),
          "megatron/core/models/gpt/gpt_layer_specs.py:171-303"),
    Entry(_QWEN, "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec", "parameters",
          ("num_experts", "moe_grouped_gemm", "qk_layernorm"), "megatron/core/models/gpt/gpt_layer_specs.py:306-422"),
    Entry(_QWEN, "megatron.core.models.gpt.GPTModel.__init__", "parameters",
          ("config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process", "post_process",
           "share_embeddings_and_output_weights", "position_embedding_type", "rotary_base"),
          "megatron/core/models/gpt/gpt_model.py:88-266"),
    Entry(_QWEN, "megatron.core.tensor_parallel", "attribute",
          ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "set_tensor_model_parallel_attributes"), "megatron/core/tensor_parallel/layers.py:101-1328"),
    # ---- MoE routing replay (megarl/trainer/routing_replay.py) --------------------------------------------------
    Entry(_REPLAY, "megatron.core.transformer.moe.router.TopKRouter.__init__", "source",
          ("self.router_replay = RouterReplay()",), "megatron/core/transformer/moe/router.py:147-207"),
    Entry(_REPLAY, "megatron.core.transformer.moe.router.Router.set_layer_number", "source",
          ("self.layer_number = layer_number",), "megatron/core/transformer/moe/router.py:126-128"),
    Entry(_REPLAY, "megatron.core.transformer.moe.router_replay.RouterReplay", "attribute",
          ("set_target_indices", "set_router_replay_action", "clear_indices", "clear_router_replay_action"),
          "megatron/core/transformer/moe/router_replay.py:18-161"),
    Entry(_REPLAY, "megatron.core.transformer.moe.router_replay.RouterReplayAction", "enum_members",
          ("REPLAY_FORWARD",), "megatron/core/transformer/moe/router_replay.py:8-15"),
    # ---- what megarl/parallel/cpu_compat.py patches -------------------------------------------------------------
    Entry(_COMPAT, "megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward", "source",
          ("te_general_gemm is not None",), "megatron/core/transformer/moe/moe_utils.py:1165-1203"),
    Entry(_COMPAT, "megatron.core.tensor_parallel.random", "attribute",
          ("_get_cuda_rng_state", "_set_cuda_rng_state", "initialize_rng_tracker", "model_parallel_cuda_manual_seed"),
          "megatron/core/tensor_parallel/random.py:41-429"),
    Entry(_COMPAT, "megatron.core.tensor_parallel.random.initialize_rng_tracker", "parameters",
          ("inference_rng_tracker", "force_reset"), "megatron/core/tensor_parallel/random.py:286-343"),
    Entry(_COMPAT, "megatron.core.dist_checkpointing.strategies.filesystem_async", "attribute",
          ("_get_write_results_queue", "FileSystemWriterAsync"),
          "megatron/core/dist_checkpointing/strategies/filesystem_async.py:51-56"),
    Entry(_COMPAT, "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync"
          ".write_preloaded_data_multiproc", "parameters",
          ("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
          "megatron/core/dist_checkpointing/strategies/filesystem_async.py:233-338"),
    Entry(_COMPAT, "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync"
          ".write_preloaded_data", "parameters",
          ("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue", "use_fsync"),
          "megatron/core/dist_checkpointing/strategies/filesystem_async.py:340-418"),
    Entry(_COMPAT, f"{_DO}._set_main_param_and_optimizer_states",
          "parameters", ("model_param", "tensors"), "megatron/core/optimizer/distrib_optimizer.py:911-940"),
    Entry(_COMPAT, f"{_DO}._set_main_param_and_optimizer_states",
          "source", ("self.model_param_group_index_map[model_param]",),
          "megatron/core/optimizer/distrib_optimizer.py:911-940"),
) + tuple(
    # the modules whose `torch` cpu_compat.patch_cuda_factories replaces (its _CUDA_FACTORY_MODULES): each imports one
    Entry(_COMPAT, module, "attribute", ("torch",), f"{module.replace('.', '/')}.py:{line} (import torch)")
    for module, line in (("megatron.core.pipeline_parallel.schedules", 7), ("megatron.core.transformer.utils", 7),
                         ("megatron.core.transformer.moe.moe_utils", 8), ("megatron.core.tensor_parallel.data", 3),
                         ("megatron.core.utils", 30), ("megatron.core.rerun_state_machine", 15),
                         ("megatron.core.optimizer.optimizer", 14), ("megatron.core.optimizer.clip_grads", 7),
                         ("megatron.core.optimizer.grad_scaler", 8), ("megatron.core.optimizer.distrib_optimizer", 14))
)

_MISSING = object()


def resolve(target: str) -> Any:
    """The object a dotted path names: attributes first (a package's name shadows its same-named submodule, as
    `megatron.core.distributed.finalize_model_grads` the function does its module), else the submodule imported.
    Returns `_MISSING` where neither exists."""
    parts = target.split(".")
    try:
        obj: Any = importlib.import_module(parts[0])
    except ImportError:
        return _MISSING
    path = parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if not isinstance(obj, ModuleType):
            return _MISSING
        try:
            obj = importlib.import_module(path)
        except ImportError:
            return _MISSING
    return obj


def _field_names(obj: Any) -> set[str]:
    if is_dataclass(obj):
        return {f.name for f in fields(obj)}
    names: set[str] = set()
    for klass in getattr(obj, "__mro__", (obj,)):
        names |= set(getattr(klass, "__annotations__", {}))
    try:
        names |= set(typing.get_type_hints(obj))
    except Exception:  # noqa: BLE001 - unresolvable annotations: the raw names above are enough
        pass
    return names


def _present(entry: Entry, obj: Any) -> tuple[list[str], str]:
    """The names of `entry` that `obj` lacks, and what kind of thing was looked in."""
    if entry.kind == "attribute":
        return [n for n in entry.names if not hasattr(obj, n)], "attribute"
    if entry.kind == "parameters":
        params = inspect.signature(obj).parameters
        return [n for n in entry.names if n not in params], "parameter"
    if entry.kind == "enum_members":
        return [n for n in entry.names if n not in getattr(obj, "__members__", {})], "enum member"
    if entry.kind == "fields":
        have = _field_names(obj)
        return [n for n in entry.names if n not in have], "field"
    if entry.kind == "source":
        text = inspect.getsource(obj)
        return [n for n in entry.names if n not in text], "text in the source"
    if entry.kind == "members_of":
        return [n for n in entry.names if n not in obj], "member"
    raise ValueError(f"unknown contract kind {entry.kind!r}")


def check_entries(entries: tuple[Entry, ...]) -> list[str]:
    """One line per broken entry name: the megarl user, the dotted path and what is missing, and where it was read."""
    problems: list[str] = []
    for entry in entries:
        obj = resolve(entry.target)
        if obj is _MISSING:
            problems.append(f"{entry.user}: {entry.target} not found ({MCORE}: {entry.read})")
            continue
        try:
            missing, what = _present(entry, obj)
        except (TypeError, ValueError, OSError) as err:
            problems.append(f"{entry.user}: {entry.target}: cannot check {entry.kind} ({err})")
            continue
        problems += [f"{entry.user}: {entry.target}: {what} {name!r} missing ({MCORE}: {entry.read})"
                     for name in missing]
    return problems


def check_megatron_contract() -> list[str]:
    """Every problem with `CONTRACT` in the installed megatron-core: empty when all of it holds."""
    return check_entries(CONTRACT)


# ---- Transformer Engine ----------------------------------------------------------------------------------------
# What megatron-core 0.16.1 and megarl expect of TE's FusedAdam (read at TE v2.9, commit 70f5366,
# transformer_engine/pytorch/optimizers/fused_adam.py): the keyword arguments megatron passes
# (megatron/core/optimizer/__init__.py:349-363), the per-parameter state names (`name_to_dtype_map`, :191-195), the
# step kept per param group (:495-504; megatron reads it there, distrib_optimizer.py:654-682, and megarl gives a
# fresh FusedAdam no per-parameter step), `initialize_state(param, store_param_remainders)` (:401-418).
FUSED_ADAM_KWARGS = ("params", "lr", "weight_decay", "betas", "eps", "adam_w_mode")
FUSED_ADAM_STATE_NAMES = frozenset({"exp_avg", "exp_avg_sq", "master_param"})
# the attention backends' opt-out variables TE reads (transformer_engine/pytorch/attention/dot_product_attention/
# utils.py:399-404 at v2.9) and megatron sets (language_module.py:92-126)
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
TE_ATTENTION_UTILS = Path("attention") / "dot_product_attention" / "utils.py"  # under transformer_engine/pytorch


def check_te_contract(module: ModuleType, attention: bool = True) -> list[str]:
    """Problems with what megatron and megarl expect of Transformer Engine in `module`: real TE's
    `transformer_engine.pytorch.optimizers`, or a stand-in exposing `FusedAdam` (`tests/te_standin.py`). Builds one
    FusedAdam on a two-element parameter (CUDA where available: TE's needs it) and steps it once. `attention`: also
    check that TE's attention backend selection (`pytorch/attention/dot_product_attention/utils.py`, beside the
    optimizers package) reads `TE_ATTENTION_ENV`; only real TE has that file."""
    import torch

    problems: list[str] = []
    adam = getattr(module, "FusedAdam", None)
    if adam is None:
        return [f"{module.__name__}: no FusedAdam ({TE} transformer_engine/pytorch/optimizers/__init__.py:16)"]
    params = inspect.signature(adam).parameters
    problems += [f"FusedAdam: no parameter {n!r} (megatron passes it: {MCORE} megatron/core/optimizer/"
                 f"__init__.py:349-363)" for n in FUSED_ADAM_KWARGS if n not in params]
    init = getattr(adam, "initialize_state", None)
    if init is None or list(inspect.signature(init).parameters)[1:] != ["param", "store_param_remainders"]:
        problems.append("FusedAdam.initialize_state(param, store_param_remainders) not as at TE 2.9 "
                        "(fused_adam.py:401-418; megatron's precision-aware init calls it, __init__.py:399)")
    if problems:
        return problems
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = adam([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)
    names = set(getattr(opt, "name_to_dtype_map", {}))
    if names != FUSED_ADAM_STATE_NAMES:
        problems.append(f"FusedAdam.name_to_dtype_map names {sorted(names)}, not {sorted(FUSED_ADAM_STATE_NAMES)} "
                        "(fused_adam.py:191-195): megarl's per-parameter Adam state would not load")
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    state, group = opt.state[p], opt.param_groups[0]
    if "step" in state or group.get("step") != 1:
        problems.append(f"FusedAdam keeps its step per parameter ({sorted(state)}) or not as the group's count "
                        f"({group.get('step')!r}): megatron reads the group's (distrib_optimizer.py:654-682), "
                        "megarl gives a fresh FusedAdam no per-parameter step (trainer/optimizer.py init_adam_state)")
    if not {"exp_avg", "exp_avg_sq"} <= set(state) - {"step"} <= FUSED_ADAM_STATE_NAMES:  # a step: reported above
        problems.append(f"FusedAdam's per-parameter state is {sorted(state)}, not exp_avg / exp_avg_sq "
                        "(megatron's sharded optimizer state copies those, distrib_optimizer.py:883-940)")
    if attention:
        utils = Path(module.__file__).resolve().parents[1] / TE_ATTENTION_UTILS if module.__file__ else None
        if utils is None or not utils.is_file():
            problems.append(f"TE's attention backend selection not found at {utils} ({TE}: "
                            "transformer_engine/pytorch/attention/dot_product_attention/utils.py)")
        else:
            text = utils.read_text()
            problems += [f"{utils}: {var} is not read (megatron sets it: language_module.py:92-126)"
                         for var in TE_ATTENTION_ENV if f'"{var}"' not in text]
    return problems


def main() -> int:
    """Print every problem of the megatron-core contract (and TE's, where TE imports); 1 if any."""
    problems = check_megatron_contract()
    try:
        te_optimizers = importlib.import_module("transformer_engine.pytorch.optimizers")
    except ImportError:
        print(f"{TE}: not installed, its contract not checked")
    else:
        problems += check_te_contract(te_optimizers)
    for line in problems:
        print(line)
    print(f"{len(CONTRACT)} megatron-core entries checked: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
