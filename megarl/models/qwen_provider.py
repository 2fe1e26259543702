"""From a Hugging Face Qwen3 / Qwen3-MoE / Qwen2 `config.json` to a megatron-core `GPTModel`.

The mapping of every HF field to its `TransformerConfig` counterpart is spelt out below; the layer
spec is megatron's local spec on CPU and Transformer Engine's on GPUs, as `megarl.models.layer_backend` resolves
`trainer.layer_spec` (a GPU without TE is refused there, never silently built on the local spec).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
import torch.nn.functional as F

from megarl.models.hf_config import head_dim, num_experts, padded_vocab_size, read_hf_config  # noqa: F401 - re-exported
from megarl.models.layer_backend import LayerSpec


def rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 nests it in `rope_parameters`; older configs have a top-level `rope_theta`."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def apex_wgrad_fusion_installed() -> bool:
    """Whether Apex's `fused_weight_gradient_mlp_cuda` is importable: megatron-core's own linears (the output
    layer) need it for `gradient_accumulation_fusion`; TE's linears fuse the accumulation themselves."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def te_fusions(apex_wgrad: bool) -> dict[str, Any]:
    """The `TransformerConfig` fast paths the TE layer spec turns on (those verl, NeMo-RL and slime set for the same
    models): the SwiGLU, RoPE and masked-softmax fusions; MoE token permutation fused (`moe_permute_fusion`,
    TE >= 2.1); weight-gradient accumulation straight into megatron DDP's `main_grad` buffers
    (`gradient_accumulation_fusion`) where Apex provides it for the output layer (`apex_wgrad`).

    Attention is left to Transformer Engine (`AttnBackend.auto`, megatron's default): megatron-core 0.16.1 turns
    the backends a config does not name off through TE's opt-out variables (`LanguageModule._set_attention_backend`,
    megatron/core/models/common/language_module/language_module.py:92-126: `flash` sets NVTE_FUSED_ATTN and
    NVTE_UNFUSED_ATTN to 0), and TE 2.9 drops FlashAttention for fp32 and wherever the `flash_attn` package is
    missing (transformer_engine/pytorch/attention/dot_product_attention/utils.py:428-434 and 1093-1096 at v2.9), so
    a forced `flash` can leave no kernel ("No dot product attention backend is available",
    dot_product_attention.py:1369-1374) and on Hopper overrides the cuDNN fused attention TE prefers. fp32 with TE
    is refused before that (`layer_backend.precision_problem`)."""
    from megatron.core.transformer.enums import AttnBackend

    return dict(attention_backend=AttnBackend.auto, bias_activation_fusion=True, apply_rope_fusion=True,
                masked_softmax_fusion=True, gradient_accumulation_fusion=apex_wgrad)


def local_fusions() -> dict[str, Any]:
    """megatron's local spec: no fused kernels (none run on a CPU, and a debugging run on a GPU keeps them off)."""
    return dict(bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                gradient_accumulation_fusion=False)


def recompute_fields(recompute: str, layers: int | None = None) -> dict[str, Any]:
    """`trainer.recompute` (and `trainer.recompute_layers`) -> megatron's activation-recomputation fields
    (megatron-core 0.16.1 names). "full": every transformer layer is its own recompute unit (only each layer's input
    is kept; the layer runs again in backward), or with `layers` only the first `layers` layers of each pipeline
    stage (megatron's "block" method; the others keep their activations); "selective": only the core attention
    reruns (its [b, heads, s, s] scores and softmax are not kept); "none": megatron's defaults (everything kept)."""
    if layers is not None and recompute != "full":
        raise ValueError(f"recompute_layers={layers} needs recompute='full' (got {recompute!r})")
    if recompute == "none":
        return {}
    if recompute == "full" and layers is not None:
        return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=layers)
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    raise ValueError(f"recompute={recompute!r}: use 'none', 'full' or 'selective'")


def transformer_config_from_hf(hf: dict[str, Any], tp: int, pp: int, ep: int,
                               params_dtype: torch.dtype = torch.float32, recompute: str = "none",
                               routing_replay: bool = False, expert_tp: int = 1, moe_aux_loss_coeff: float = 0.0,
                               backend: LayerSpec = "local", recompute_layers: int | None = None):
    """The megatron `TransformerConfig` equivalent to an HF Qwen config (dropout 0, as RL training uses),
    with the activation recomputation of `recompute_fields(recompute)`; `routing_replay` gives every MoE router
    megatron's replay hook (`megarl.trainer.routing_replay`). MoE: experts split `expert_tp` ways (megatron's
    `expert_tensor_parallel_size`, independent of `tp`), router load-balancing loss at `moe_aux_loss_coeff`
    (`trainer.moe_aux_loss_coeff`; the HF config's `router_aux_loss_coef` is a pre-training setting and is not
    read). `backend` (`megarl.models.layer_backend.resolve_layer_spec`): "te" turns on grouped-GEMM experts and the
    fast paths of `te_fusions`, "local" keeps every fusion off (`local_fusions`)."""
    from megatron.core.transformer import TransformerConfig

    qwen2 = hf.get("model_type", "").startswith("qwen2")
    experts = num_experts(hf)
    moe: dict[str, Any] = {}
    if experts:
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError("MoE configs with dense layers (mlp_only_layers / decoder_sparse_step) are not supported")
        if moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff={moe_aux_loss_coeff}: must be >= 0 (trainer.moe_aux_loss_coeff)")
        aux = float(moe_aux_loss_coeff)
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. megatron without pre-softmax takes
            # top-k logits then softmax over them, which equals the renormalised top-k probabilities.
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
            moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
            moe_aux_loss_coeff=aux,
            moe_token_dispatcher_type="allgather" if not torch.cuda.is_available() else "alltoall",
            moe_grouped_gemm=backend == "te",
            moe_permute_fusion=backend == "te",
            moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
        )
    elif routing_replay:
        raise ValueError("trainer.routing_replay needs an MoE model (the config has no experts)")
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        kv_channels=head_dim(hf),
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qwen2,
        qk_layernorm=not qwen2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,  # no dropout in RL training
        persist_layer_norm=False,
        **(te_fusions(apex_wgrad_fusion_installed()) if backend == "te" else local_fusions()),
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,  # megatron's mixed precision: Float16Module, fp32 main parameters
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        pipeline_dtype=params_dtype,  # dtype of the activations sent between pipeline stages
        sequence_parallel=bool(experts) and tp > 1,
        **moe,
        **recompute_fields(recompute, recompute_layers),
    )


def layer_spec(hf: dict[str, Any], config, backend: LayerSpec):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = num_experts(hf) or None
    if backend == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(config.moe_grouped_gemm), qk_layernorm=config.qk_layernorm)
    if config.moe_grouped_gemm:
        raise ValueError("moe_grouped_gemm needs the Transformer Engine layer spec (a GPU with transformer_engine)")
    return specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm)


def build_gpt_model(hf: dict[str, Any], tp: int, pp: int, ep: int, params_dtype: torch.dtype = torch.float32,
                    recompute: str = "none", routing_replay: bool = False, expert_tp: int = 1,
                    moe_aux_loss_coeff: float = 0.0, backend: LayerSpec = "local",
                    recompute_layers: int | None = None):
    """This rank's megatron `GPTModel` stage on `backend`'s layer spec (`megarl.models.layer_backend`); parallel
    groups must already be initialised; weights are uninitialised until `megarl.models.hf_import.load_hf_weights`.
    Tied embeddings (`tie_word_embeddings`) are megatron's `share_embeddings_and_output_weights`: at PP=1 the
    output layer uses the embedding weight itself;
    at PP>1 the last stage holds a copy (`output_layer.weight`, marked `shared`), loaded from the same HF tensor
    and kept equal by summing both copies' gradients over megatron's embedding group (megatron-core's
    `finalize_model_grads`, wired by `megarl.trainer.optimizer`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_hf(hf, tp, pp, ep, params_dtype, recompute, routing_replay, expert_tp,
                                        moe_aux_loss_coeff, backend, recompute_layers)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf, config, backend),
        vocab_size=padded_vocab_size(hf, tp),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf)),
    )
    mark_tensor_parallel_weights(model)
    mark_expert_weights(model)
    if torch.cuda.is_available():
        model.cuda()
    return model


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Set the `tensor_model_parallel` / `partition_dim` attributes that megatron's own weight
    initialisation sets, and that `perform_initialization=False` skips (megatron-core 0.16.1, local spec):
    without them every TP-sharded weight looks like a TP-replicated duplicate to anything that counts
    parameters once per TP group (`param_is_not_tensor_parallel_duplicate`, the global grad norm).
    Column-parallel and vocab-parallel weights are split along dim 0, row-parallel weights along dim 1;
    Transformer Engine linears say which through `parallel_mode` (TE normally marks them itself)."""
    from megatron.core import tensor_parallel as tp_layers

    split_dim = {tp_layers.ColumnParallelLinear: 0, tp_layers.VocabParallelEmbedding: 0,
                 tp_layers.RowParallelLinear: 1}
    te_split_dim = {"column": 0, "row": 1}
    for module in model.modules():
        dim = split_dim.get(type(module), te_split_dim.get(getattr(module, "parallel_mode", None)))
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        tp_layers.set_tensor_model_parallel_attributes(weight, True, dim, 1)


# an expert weight: the local spec's (SequentialMLP) `local_experts.{j}.linear_fc1.weight`, TE's grouped `weight{j}`
EXPERT_PARAM = re.compile(r"(?:.*\.)?mlp\.experts\.(?:local_experts\.\d+\.linear_fc[12]\.weight"
                          r"|linear_fc[12]\.weight\d+)")


def mark_expert_weights(model: torch.nn.Module) -> None:
    """Mark every expert weight as megatron marks them under expert parallel (`allreduce=False`: replicated over
    the expert-data-parallel group, not the data-parallel one), whatever the layout. megatron-core 0.16.1 marks
    them only when ep > 1; at ep 1 with `expert_tp != tp` the two groups differ (an expert shard's peers are the
    ranks of its expert-TP rank, not its attention-DP replicas), and summing its gradient with another shard's
    would be silently wrong. TE's grouped weights (`linear_fc1.weight{j}`, built TP-agnostic when megatron does the
    expert communication itself) also get the tensor-parallel marks (fc1 split along dim 0, fc2 along dim 1), so the
    grad norm counts each rank's experts there (over the expert grid's group), never as a TP peer's duplicate."""
    for name, param in model.named_parameters():
        if EXPERT_PARAM.fullmatch(name) is None:
            continue
        param.allreduce = False
        if not getattr(param, "tensor_model_parallel", False):  # TE may have set it False: set, not assert unset
            param.tensor_model_parallel = True
            param.partition_dim = 0 if ".linear_fc1." in name else 1
            param.partition_stride = 1
