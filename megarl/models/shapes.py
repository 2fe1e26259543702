"""Parameter shapes from a Hugging Face `config.json` alone (no weights read, no model built): the checkpoint's
tensors, megatron-core's local parameters of one trainer rank (as `megarl.models.qwen_provider.build_gpt_model`
builds them), and the HF blocks each trainer rank holds."""

from __future__ import annotations

from typing import Any

from megarl.config.schema import TrainerConfig
from megarl.models.hf_config import head_dim, num_experts, padded_vocab_size
from megarl.models.hf_layout import HFLayout, RankCoords
from megarl.sync.plan import vllm_rank_slices
from megarl.sync.slices import HFSlice


def hf_tensor_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint (no lm_head when the embeddings are tied)."""
    return {s.name: s.full_shape for s in vllm_rank_slices(hf, 1, 0)}


def total_params(hf: dict[str, Any]) -> int:
    return sum(s.numel for s in vllm_rank_slices(hf, 1, 0))


def active_params(hf: dict[str, Any]) -> int:
    """Parameters one token runs through: all but the (experts - top_k) experts it is not routed to."""
    experts = num_experts(hf)
    if not experts:
        return total_params(hf)
    expert_params = sum(s.numel for s in vllm_rank_slices(hf, 1, 0) if ".mlp.experts." in s.name)
    return total_params(hf) - expert_params * (experts - hf["num_experts_per_tok"]) // experts


def megatron_local_shapes(hf: dict[str, Any], tp: int, pp: int, ep: int, pp_rank: int,
                          expert_tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the megatron-core parameters of one rank at pipeline stage `pp_rank` (every rank of a
    stage holds the same shapes; local layer spec names, stage-local layer indices); experts split `expert_tp`
    ways (TE's grouped experts, `linear_fc1.weight{j}`, have the same shapes)."""
    h, d = hf["hidden_size"], head_dim(hf)
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads", heads)
    qwen2 = hf.get("model_type", "").startswith("qwen2")
    experts = num_experts(hf)
    vocab_rows = padded_vocab_size(hf, tp) // tp
    shapes: dict[str, tuple[int, ...]] = {}
    if pp_rank == 0:
        shapes["embedding.word_embeddings.weight"] = (vocab_rows, h)
    qkv_rows = (heads + 2 * groups) * d // tp  # [q; k; v] rows of this rank's query groups
    for i in range(hf["num_hidden_layers"] // pp):
        p = f"decoder.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if qwen2:
            shapes[f"{p}.self_attention.linear_qkv.bias"] = (qkv_rows,)
        else:
            shapes[f"{p}.self_attention.q_layernorm.weight"] = (d,)
            shapes[f"{p}.self_attention.k_layernorm.weight"] = (d,)
        shapes[f"{p}.self_attention.linear_proj.weight"] = (h, heads * d // tp)
        shapes[f"{p}.pre_mlp_layernorm.weight"] = (h,)
        if experts:
            shapes[f"{p}.mlp.router.weight"] = (experts, h)
            inter = hf["moe_intermediate_size"] // expert_tp
            for j in range(experts // ep):
                shapes[f"{p}.mlp.experts.local_experts.{j}.linear_fc1.weight"] = (2 * inter, h)  # [gate; up]
                shapes[f"{p}.mlp.experts.local_experts.{j}.linear_fc2.weight"] = (h, inter)
        else:
            inter = hf["intermediate_size"] // tp
            shapes[f"{p}.mlp.linear_fc1.weight"] = (2 * inter, h)
            shapes[f"{p}.mlp.linear_fc2.weight"] = (h, inter)
    if pp_rank == pp - 1:
        shapes["decoder.final_layernorm.weight"] = (h,)
        if not hf.get("tie_word_embeddings", False) or pp > 1:  # tied at pp 1: the embedding is the output layer
            shapes["output_layer.weight"] = (vocab_rows, h)  # tied at pp > 1: the last stage holds a copy
    return shapes


def pipeline_stage_of(rank: int, t: TrainerConfig) -> int:
    """Megatron's rank order is tp-cp-ep-dp-pp: the pipeline stage is the outermost coordinate."""
    return rank // (t.world_size // t.pp)


def trainer_holdings(hf: dict[str, Any], t: TrainerConfig) -> dict[int, list[HFSlice]]:
    """Trainer rank -> the HF blocks its megatron shards hold (what `PartitionedWeightSync` plans from), from the
    shapes alone: tensor rank = rank mod tp; the experts' own grid (megatron's tp-ep-dp-pp order, with
    trainer.expert_tp as its tp): expert-TP rank = rank mod expert_tp, expert rank = (rank // expert_tp) mod ep
    within the stage."""
    layers = hf["num_hidden_layers"] // t.pp
    out: dict[int, list[HFSlice]] = {}
    for rank in range(t.world_size):
        stage = pipeline_stage_of(rank, t)
        tp_rank, etp_rank, ep_rank = rank % t.tp, rank % t.expert_tp, (rank // t.expert_tp) % t.ep
        layout = HFLayout(hf, RankCoords(tp_rank, t.tp, etp_rank, t.expert_tp, ep_rank, t.ep),
                          {i: stage * layers + i for i in range(layers)})
        shapes = megatron_local_shapes(hf, t.tp, t.pp, t.ep, stage, t.expert_tp)
        out[rank] = [block for name, shape in shapes.items() for _, block in layout.blocks(name, shape)]
    return out
