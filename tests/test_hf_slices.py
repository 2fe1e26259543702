"""The trainer's HF blocks (`megarl.models.hf_slices`) are the exact inverse of the importer.

1. Table level, for layouts this 2-core machine cannot run (TP=4, EP=8, TP x EP): megatron's local
   parameter shapes, stated independently below from megatron's sharding rules, are filled from a random
   HF state dict through the table and exported back; every rank's blocks must tile its local tensors
   (only vocabulary padding left over), shards of different ranks must not overlap, and the union over
   ranks must rebuild every HF tensor exactly. (This checks the partition, not the meaning of each
   block: a k/v swap would round-trip; tests/test_megatron_vs_hf.py checks meaning through logits.)
2. Real processes: a megatron MoE model under pipeline parallel 2 (stage-local layer names) is loaded
   from a checkpoint, and the union of `iter_local_hf_slices` over ranks equals the checkpoint bit-exactly.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.hf_layout import HFLayout, RankCoords
from megarl.models.tiny import make_tiny_checkpoint
from megarl.sync.slices import HFSlice
from tests.dist_utils import free_port, run_distributed

# 8 query heads in 4 groups (TP up to 4), 8 experts (EP up to 8), a vocabulary of 30 (padded under TP=4)
HF = dict(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
          head_dim=4, intermediate_size=24, moe_intermediate_size=8, num_experts=8)


def _hf_shapes(moe: bool) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the config above (Qwen3 / Qwen3-MoE checkpoint format)."""
    h, d, v = HF["hidden_size"], HF["head_dim"], HF["vocab_size"]
    q, kv = HF["num_attention_heads"] * d, HF["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(HF["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                   f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
        mlps = [(f"{p}.mlp.experts.{e}", HF["moe_intermediate_size"]) for e in range(HF["num_experts"])] if moe \
            else [(f"{p}.mlp", HF["intermediate_size"])]
        for prefix, inter in mlps:
            shapes |= {f"{prefix}.gate_proj.weight": (inter, h), f"{prefix}.up_proj.weight": (inter, h),
                       f"{prefix}.down_proj.weight": (h, inter)}
        if moe:
            shapes[f"{p}.mlp.gate.weight"] = (HF["num_experts"], h)
    return shapes


def _megatron_local_shapes(moe: bool, tp: int, ep: int) -> dict[str, tuple[int, ...]]:
    """megatron-core's per-rank parameter shapes (local spec): vocabulary padded to a multiple of TP and split
    by rows, QKV / fc1 split by rows and linear_proj / fc2 by columns over TP, experts split over EP (expert
    tensor parallel = TP), norms and the router replicated."""
    h, d = HF["hidden_size"], HF["head_dim"]
    vocab_rows = -(-HF["vocab_size"] // tp)
    shapes = {"embedding.word_embeddings.weight": (vocab_rows, h), "output_layer.weight": (vocab_rows, h),
              "decoder.final_layernorm.weight": (h,)}
    qkv = (HF["num_attention_heads"] + 2 * HF["num_key_value_heads"]) * d
    for i in range(HF["num_hidden_layers"]):
        p = f"decoder.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.pre_mlp_layernorm.weight": (h,),
                   f"{p}.self_attention.linear_qkv.weight": (qkv // tp, h),
                   f"{p}.self_attention.q_layernorm.weight": (d,), f"{p}.self_attention.k_layernorm.weight": (d,),
                   f"{p}.self_attention.linear_proj.weight": (h, HF["num_attention_heads"] * d // tp)}
        if moe:
            shapes[f"{p}.mlp.router.weight"] = (HF["num_experts"], h)
            inter = HF["moe_intermediate_size"] // tp
            for j in range(HF["num_experts"] // ep):
                shapes |= {f"{p}.mlp.experts.local_experts.{j}.linear_fc1.weight": (2 * inter, h),
                           f"{p}.mlp.experts.local_experts.{j}.linear_fc2.weight": (h, inter)}
        else:
            inter = HF["intermediate_size"] // tp
            shapes |= {f"{p}.mlp.linear_fc1.weight": (2 * inter, h), f"{p}.mlp.linear_fc2.weight": (h, inter)}
    return shapes


def _import_then_export(layout: HFLayout, local_shapes, hf_tensors) -> list[tuple[HFSlice, torch.Tensor]]:
    """Fill local tensors through the table (as `load_hf_weights` does), checking that the blocks tile each
    local tensor, then cut them back into HF blocks (as `iter_local_hf_slices` does)."""
    exported = []
    for name, shape in local_shapes.items():
        local = torch.zeros(shape)
        writes = torch.zeros(shape, dtype=torch.int)
        blocks = layout.blocks(name, shape)
        for index, block in blocks:
            assert block.full_shape == hf_tensors[block.name].shape, block
            local[index] = hf_tensors[block.name][tuple(slice(a, b) for a, b in block.box)]
            writes[index] += 1
        assert writes.max() == 1, f"{name}: blocks overlap"
        if not (writes == 1).all():  # only the vocabulary's trailing padding rows may be left over
            assert name.endswith(("word_embeddings.weight", "output_layer.weight")), name
            real = sum(b.shape[0] for _, b in blocks)
            assert (writes[:real] == 1).all() and (writes[real:] == 0).all(), name
        exported += [(block, local[index]) for index, block in blocks]
    return exported


@pytest.mark.parametrize(("moe", "tp", "ep"), [(False, 1, 1), (False, 2, 1), (False, 4, 1), (True, 1, 2),
                                               (True, 1, 8), (True, 2, 2), (True, 4, 2)])
def test_table_blocks_tile_local_and_hf_tensors(moe, tp, ep):
    g = torch.Generator().manual_seed(0)
    hf_tensors = {n: torch.randn(s, generator=g) for n, s in _hf_shapes(moe).items()}
    hf = HF if moe else {k: v for k, v in HF.items() if k != "num_experts"}
    rebuilt = {n: torch.full(t.shape, float("nan")) for n, t in hf_tensors.items()}
    holders = {n: torch.zeros(t.shape, dtype=torch.int) for n, t in hf_tensors.items()}
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            coords = RankCoords(tp_rank, tp, tp_rank, tp, ep_rank, ep)
            layout = HFLayout(hf, coords, {i: i for i in range(HF["num_hidden_layers"])})
            for block, data in _import_then_export(layout, _megatron_local_shapes(moe, tp, ep), hf_tensors):
                index = tuple(slice(a, b) for a, b in block.box)
                rebuilt[block.name][index] = data
                holders[block.name][index] += 1
    for name, tensor in hf_tensors.items():
        assert torch.equal(rebuilt[name], tensor), name  # NaN anywhere = an element no rank holds
        # every element of a tensor has the same number of replicas: shards neither overlap nor leave gaps
        assert (holders[name] == holders[name].flatten()[0]).all(), name


def _export_rank(rank, world, hf_dir, port):
    from megarl.models.hf_import import load_hf_weights
    from megarl.models.hf_slices import iter_local_hf_slices
    from megarl.models.qwen_provider import build_gpt_model, read_hf_config
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups

    init_trainer_groups(TrainerLayout(pp=2), rank, world, "127.0.0.1", port)
    try:
        hf = read_hf_config(hf_dir)
        model = build_gpt_model(hf, tp=1, pp=2, ep=1)
        load_hf_weights(model, hf_dir, hf)
        return [(block, t.clone()) for block, t in iter_local_hf_slices(model, hf)]
    finally:
        destroy_trainer_groups()


def test_union_over_pipeline_stages_rebuilds_moe_checkpoint(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "moe", kind="moe")
    checkpoint = load_file(hf_dir / "model.safetensors")
    per_rank = run_distributed(_export_rank, 2, hf_dir, free_port(), init_dist=False)
    rebuilt = {n: torch.full(t.shape, float("nan")) for n, t in checkpoint.items()}
    for blocks in per_rank:
        assert len({b for b, _ in blocks}) == len(blocks), "a block is exported twice by one rank"
        for block, data in blocks:
            assert data.shape == block.shape
            rebuilt[block.name][tuple(slice(a, b) for a, b in block.box)] = data
    # stage 0 holds layer 0 and the embeddings, stage 1 layer 1 (its stage-local index 0), norm and lm_head
    names = [{b.name for b, _ in blocks} for blocks in per_rank]
    assert "model.embed_tokens.weight" in names[0] and "model.layers.1.mlp.experts.7.down_proj.weight" in names[1]
    assert not any(n.startswith("model.layers.1.") for n in names[0])
    for name, tensor in checkpoint.items():
        assert torch.equal(rebuilt[name], tensor), name
