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


def _megatron_local_shapes(moe: bool, tp: int, ep: int, etp: int = 1, grouped: bool = False
                           ) -> dict[str, tuple[int, ...]]:
    """megatron-core's per-rank parameter shapes: vocabulary padded to a multiple of TP and split by rows, QKV / fc1
    split by rows and linear_proj / fc2 by columns over TP, experts split over EP and each expert's fc1 rows / fc2
    columns over expert TP (`etp`), norms and the router replicated. Experts named as the local spec names them
    (`local_experts.{j}.linear_fc1.weight`) or, `grouped`, as TE's grouped GEMM does (`linear_fc1.weight{j}`)."""
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
            inter = HF["moe_intermediate_size"] // etp
            for j in range(HF["num_experts"] // ep):
                fc1, fc2 = ((f"{p}.mlp.experts.linear_fc1.weight{j}", f"{p}.mlp.experts.linear_fc2.weight{j}")
                            if grouped else (f"{p}.mlp.experts.local_experts.{j}.linear_fc1.weight",
                                             f"{p}.mlp.experts.local_experts.{j}.linear_fc2.weight"))
                shapes |= {fc1: (2 * inter, h), fc2: (h, inter)}
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


@pytest.mark.parametrize(("moe", "tp", "ep", "etp", "grouped"), [
    (False, 1, 1, 1, False), (False, 2, 1, 1, False), (False, 4, 1, 1, False), (True, 1, 2, 1, False),
    (True, 1, 8, 1, False), (True, 2, 2, 2, False), (True, 4, 2, 4, False),
    # expert tensor parallel independent of TP, and TE's grouped-GEMM expert names
    (True, 2, 2, 1, False), (True, 1, 2, 2, False), (True, 4, 1, 2, False), (True, 1, 2, 2, True),
    (True, 2, 4, 1, True), (True, 1, 1, 8, True),
])
def test_table_blocks_tile_local_and_hf_tensors(moe, tp, ep, etp, grouped):
    g = torch.Generator().manual_seed(0)
    hf_tensors = {n: torch.randn(s, generator=g) for n, s in _hf_shapes(moe).items()}
    hf = HF if moe else {k: v for k, v in HF.items() if k != "num_experts"}
    rebuilt = {n: torch.full(t.shape, float("nan")) for n, t in hf_tensors.items()}
    holders = {n: torch.zeros(t.shape, dtype=torch.int) for n, t in hf_tensors.items()}
    for tp_rank in range(tp):
        for etp_rank in range(etp):
            for ep_rank in range(ep):
                coords = RankCoords(tp_rank, tp, etp_rank, etp, ep_rank, ep)
                layout = HFLayout(hf, coords, {i: i for i in range(HF["num_hidden_layers"])})
                shapes = _megatron_local_shapes(moe, tp, ep, etp, grouped)
                for block, data in _import_then_export(layout, shapes, hf_tensors):
                    index = tuple(slice(a, b) for a, b in block.box)
                    rebuilt[block.name][index] = data
                    holders[block.name][index] += 1
    for name, tensor in hf_tensors.items():
        assert torch.equal(rebuilt[name], tensor), name  # NaN anywhere = an element no rank holds
        # every element of a tensor has the same number of replicas: shards neither overlap nor leave gaps
        assert (holders[name] == holders[name].flatten()[0]).all(), name


def test_grouped_and_sequential_expert_names_map_to_the_same_hf_blocks():
    """TE's grouped GEMM (`mlp.experts.linear_fc1.weight{j}`) and the local spec (`mlp.experts.local_experts.{j}
    .linear_fc1.weight`) name the same tensor: the table gives both the same blocks, written out here by hand for
    expert-TP rank 1 of 2 and expert rank 1 of 2 (4 local experts: local expert 3 is global expert 7; its 8 columns
    split in halves)."""
    layout = HFLayout(HF, RankCoords(0, 1, 1, 2, 1, 2), {0: 0, 1: 1})
    h, hf_e7 = HF["hidden_size"], "model.layers.1.mlp.experts.7"
    fc1 = [((slice(0, 4),), HFSlice(f"{hf_e7}.gate_proj.weight", (8, h), ((4, 8), (0, h)))),
           ((slice(4, 8),), HFSlice(f"{hf_e7}.up_proj.weight", (8, h), ((4, 8), (0, h))))]
    fc2 = [((slice(None), slice(0, 4)), HFSlice(f"{hf_e7}.down_proj.weight", (h, 8), ((0, h), (4, 8))))]
    for name in ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
                 "decoder.layers.1.mlp.experts.linear_fc1.weight3"):
        assert layout.blocks(name, (8, h)) == fc1, name
    for name in ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight",
                 "decoder.layers.1.mlp.experts.linear_fc2.weight3"):
        assert layout.blocks(name, (h, 4)) == fc2, name
    with pytest.raises(KeyError, match="no HF mapping"):
        layout.blocks("decoder.layers.1.mlp.experts.linear_fc3.weight3", (h, 4))


def test_trainer_holdings_follow_the_expert_grid():
    """`trainer_holdings` at expert_tp != tp, against megatron's expert rank order (tp-ep-dp-pp with expert_tp as
    its tp) worked out by hand for 4 ranks of one stage."""
    from megarl.config.schema import TrainerConfig
    from megarl.models.shapes import trainer_holdings

    def experts_of(blocks, rank):  # global expert -> (gate rows, down columns) this rank holds, layer 0
        out = {}
        for b in blocks[rank]:
            parts = b.name.split(".")
            if b.name.startswith("model.layers.0.mlp.experts.") and parts[-2] in ("gate_proj", "down_proj"):
                out.setdefault(int(parts[5]), {})[parts[-2]] = b.box[0] if parts[-2] == "gate_proj" else b.box[1]
        return out

    # tp 1, expert_tp 2, ep 2: rank 3 = expert-TP rank 1, expert rank 1 -> experts 4..7, second half of columns
    held = trainer_holdings(HF, TrainerConfig(world_size=4, tp=1, ep=2, expert_tp=2))
    assert experts_of(held, 3) == {e: {"gate_proj": (4, 8), "down_proj": (4, 8)} for e in range(4, 8)}
    assert experts_of(held, 0) == {e: {"gate_proj": (0, 4), "down_proj": (0, 4)} for e in range(0, 4)}
    # tp 2, expert_tp 1, ep 4: rank 1 is attention TP rank 1 but expert rank 1 -> experts 2, 3 whole
    held = trainer_holdings(HF, TrainerConfig(world_size=4, tp=2, ep=4, expert_tp=1))
    assert experts_of(held, 1) == {e: {"gate_proj": (0, 8), "down_proj": (0, 8)} for e in (2, 3)}
    q = [b.box[0] for b in held[1] if b.name == "model.layers.0.self_attn.q_proj.weight"]
    assert q == [(16, 24), (24, 32)]  # query groups 2, 3 of 4 (2 heads x 4 dims each): TP rank 1


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
