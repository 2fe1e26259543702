"""The MoE settings of the megatron model (`trainer.moe_aux_loss_coeff`, `trainer.expert_tp`, grouped GEMM) as they
reach megatron-core's `TransformerConfig` and layer spec: plain construction, no process groups.

The reference for each is written out here: the field's value (never the HF config's pre-training
`router_aux_loss_coef`), megatron's field names, and on this CPU machine (no Transformer Engine) the local spec's
`SequentialMLP` experts. The grouped GEMM path itself (`TEGroupedMLP`) needs TE on a GPU: its parameter names are
covered by the name-mapping tests (tests/test_hf_slices.py, tests/test_hf_export.py), its run is not.
"""

from __future__ import annotations

import pytest

from megarl.models.qwen_provider import EXPERT_PARAM, layer_spec, transformer_config_from_hf

# a Qwen3-MoE config.json as the hub ships it: a pre-training aux-loss coefficient of 0.001
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001)


def test_router_aux_loss_is_the_fields_not_the_checkpoints():
    off = transformer_config_from_hf(QWEN3_MOE, 1, 1, 1)
    assert off.moe_aux_loss_coeff == 0.0 and off.moe_router_load_balancing_type == "none"
    on = transformer_config_from_hf(QWEN3_MOE, 1, 1, 1, moe_aux_loss_coeff=0.01)
    assert on.moe_aux_loss_coeff == 0.01 and on.moe_router_load_balancing_type == "aux_loss"
    with pytest.raises(ValueError, match=r"moe_aux_loss_coeff=-0\.1: must be >= 0 \(trainer\.moe_aux_loss_coeff\)"):
        transformer_config_from_hf(QWEN3_MOE, 1, 1, 1, moe_aux_loss_coeff=-0.1)


def test_expert_tensor_parallel_is_independent_of_tp():
    # megatron's own default would be expert_tensor_parallel_size = tensor_model_parallel_size
    config = transformer_config_from_hf(QWEN3_MOE, 2, 1, 4)
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert config.sequence_parallel  # MoE under TP: megatron requires sequence parallel
    config = transformer_config_from_hf(QWEN3_MOE, 1, 1, 2, expert_tp=2)
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (1, 2)
    assert not config.sequence_parallel


def test_no_grouped_gemm_without_transformer_engine():
    """On the local spec the experts are SequentialMLP, one GEMM per expert, with no TE fusion asked for."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = transformer_config_from_hf(QWEN3_MOE, 1, 1, 1)
    assert config.moe_grouped_gemm is False and config.moe_permute_fusion is False
    assert not (config.bias_activation_fusion or config.apply_rope_fusion or config.gradient_accumulation_fusion)
    spec = layer_spec(QWEN3_MOE, config, "local")
    assert spec.submodules.mlp.submodules.experts.module is SequentialMLP
    config.moe_grouped_gemm = True  # as on a GPU with TE, but the TE spec is not available here
    with pytest.raises(ValueError, match="moe_grouped_gemm needs the Transformer Engine layer spec"):
        layer_spec(QWEN3_MOE, config, "local")


@pytest.mark.parametrize(("name", "expert"), [
    ("decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight", True),
    ("decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight", True),
    ("decoder.layers.3.mlp.experts.linear_fc1.weight12", True),  # TEGroupedMLP
    ("decoder.layers.3.mlp.experts.linear_fc2.weight0", True),
    ("decoder.layers.3.mlp.router.weight", False),
    ("decoder.layers.3.mlp.linear_fc1.weight", False),  # a dense MLP
    ("decoder.layers.3.mlp.experts.linear_fc1._extra_state", False),
])
def test_expert_parameters_in_both_spellings(name, expert):
    """The expert weights `mark_expert_weights` marks for the expert-data-parallel reduction."""
    assert (EXPERT_PARAM.fullmatch(name) is not None) == expert
