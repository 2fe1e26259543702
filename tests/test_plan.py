"""The reshard planner against hand-computed boxes (no processes)."""

import pytest
import torch

from megarl.sync.plan import plan_transfers, vllm_rank_slices
from megarl.sync.slices import HFSlice
from megarl.sync.wire import layout_buckets

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


def test_dense_mlp_and_padded_vocabulary_boxes():
    dense = {k: v for k, v in HF.items() if k not in ("num_local_experts", "moe_intermediate_size")}
    dense |= {"model_type": "qwen3", "intermediate_size": 256, "vocab_size": 100}
    r1 = {s.name: s.box for s in vllm_rank_slices(dense, 2, 1)}
    assert r1["model.layers.0.mlp.gate_proj.weight"] == ((128, 256), (0, 128))
    assert r1["model.layers.0.mlp.down_proj.weight"] == ((0, 128), (128, 256))
    # vocab 100 is padded to 128 and split 64 / 64: rank 1 holds the real rows 64..99
    assert r1["lm_head.weight"] == ((64, 100), (0, 128))
    # at TP 4 each rank gets 32 padded rows: the last holds only 4 real ones
    assert [{s.name: s.box for s in vllm_rank_slices(dense, 4, r)}["model.embed_tokens.weight"][0]
            for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]


def test_plan_over_expert_parallel_holders_is_exact_and_balanced():
    """Two trainer ranks, expert parallel 2: each holds half the experts and a replica of everything else.
    Every vLLM TP rank's need is covered exactly once, experts come from their owner, and the replicated
    tensors are spread evenly over both holders."""
    whole = {s.name: s.full_shape for s in vllm_rank_slices(HF, 1, 0)}

    def held_by(rank: int) -> list[HFSlice]:
        return [HFSlice.whole(n, shape) for n, shape in whole.items()
                if ".experts." not in n or int(n.split(".experts.")[1].split(".")[0]) % 2 == rank]

    needs = {2 + r: vllm_rank_slices(HF, 2, r) for r in range(2)}
    plan = plan_transfers({0: held_by(0), 1: held_by(1)}, needs)
    for receiver, blocks in needs.items():
        for need in blocks:
            pieces = [t.block for t in plan if t.receiver == receiver and t.block.name == need.name]
            assert sum(p.numel for p in pieces) == need.numel and all(need.contains(p) for p in pieces)
    for t in plan:
        if ".experts." in t.block.name:
            assert int(t.block.name.split(".experts.")[1].split(".")[0]) % 2 == t.sender
    sent = [sum(t.block.numel for t in plan if t.sender == s) for s in (0, 1)]
    assert abs(sent[0] - sent[1]) / sum(sent) < 0.1
