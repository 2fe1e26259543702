"""The reshard planner against hand-computed boxes (no processes)."""

import pytest
import torch

from megarl.sync.plan import plan_transfers, vllm_rank_slices
from megarl.sync.slices import HFSlice
from megarl.sync.transport import layout_buckets

HF = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 128, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 2,
      "moe_intermediate_size": 64}


def _boxes(tp, rank):
    return {s.name: s.box for s in vllm_rank_slices(HF, tp, rank)}


def test_vllm_rank_boxes_by_hand():
    r1 = _boxes(2, 1)
    assert r1["model.layers.0.self_attn.q_proj.weight"] == ((128, 256), (0, 128))  # heads 2,3 of 4, head_dim 64
    assert r1["model.layers.0.self_attn.k_proj.weight"] == ((64, 128), (0, 128))  # KV head 1 of 2
    assert r1["model.layers.0.self_attn.o_proj.weight"] == ((0, 128), (128, 256))
    assert r1["model.layers.0.mlp.experts.1.down_proj.weight"] == ((0, 128), (32, 64))
    assert r1["model.layers.0.mlp.gate.weight"] == ((0, 2), (0, 128))
    assert "model.embed_tokens.weight" not in r1  # vocab 32 padded to 64: rank 1 holds only padding
    assert _boxes(2, 0)["model.embed_tokens.weight"] == ((0, 32), (0, 128))
    # TP 4 > 2 KV heads: ranks 2 and 3 share KV head 1
    assert _boxes(4, 2)["model.layers.0.self_attn.v_proj.weight"] == ((64, 128), (0, 128))
    assert _boxes(4, 3)["model.layers.0.self_attn.v_proj.weight"] == ((64, 128), (0, 128))


def test_plan_splits_needs_across_holders_and_balances_replicas():
    w = "w"
    holdings = {0: [HFSlice(w, (8, 4), ((0, 4), (0, 4))), HFSlice("norm", (4,), ((0, 4),))],
                1: [HFSlice(w, (8, 4), ((4, 8), (0, 4))), HFSlice("norm", (4,), ((0, 4),))]}
    needs = {2: [HFSlice(w, (8, 4), ((2, 6), (0, 4))), HFSlice("norm", (4,), ((0, 4),))],
             3: [HFSlice("norm", (4,), ((0, 4),))]}
    plan = plan_transfers(holdings, needs)
    got = sorted((t.sender, t.receiver, t.block.name, t.block.box) for t in plan)
    # w is cut where the holders' blocks meet; the replicated norm goes to the least-loaded holder
    assert got == [(0, 2, "norm", ((0, 4),)), (0, 2, "w", ((2, 4), (0, 4))),
                   (1, 2, "w", ((4, 6), (0, 4))), (1, 3, "norm", ((0, 4),))]
    entries = layout_buckets(plan, {"w": torch.float32, "norm": torch.float32}, bucket_bytes=40)
    pair = [(e.bucket, e.offset, e.nbytes) for e in entries if (e.sender, e.receiver) == (0, 2)]
    assert pair == [(0, 0, 32), (1, 0, 16)]  # 32 + 16 bytes exceed the 40-byte bucket: two messages


def test_missing_block_is_named():
    with pytest.raises(ValueError, match=r"no trainer rank holds all of w"):
        plan_transfers({0: [HFSlice("w", (8,), ((0, 4),))]}, {1: [HFSlice("w", (8,), ((0, 8),))]})
