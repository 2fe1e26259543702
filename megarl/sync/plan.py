"""The reshard plan: which trainer rank sends which HF block to which vLLM worker.

`plan_transfers` intersects the blocks each vLLM rank needs (`megarl.sync.needs`: recorded from vLLM's own
loaders) with what each trainer rank holds (`megarl.models.hf_layout`) so every needed block is sent exactly
once, split across holders when no single holder has all of it, spreading replicated blocks over holders.
`vllm_rank_slices` is the hand-written table of those needs (vLLM 0.32 layouts for Qwen3 / Qwen3-MoE / Qwen2,
no expert parallel): the fallback `sync.needs=table`, the tests' independent reference, and the count behind
`megarl plan` and `megarl bench sync`, which run without a fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.sync.slices import HFSlice

VLLM_VOCAB_PADDING = 64  # vLLM pads vocabularies to a multiple of 64 before splitting them over TP ranks


# This module also runs inside vLLM worker processes (the receiver checks its update against it), so it
# reads the HF config itself instead of importing the trainer's config / model modules.
def _head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def _num_experts(hf: dict[str, Any]) -> int:
    """Expert count of a MoE config, 0 for dense (transformers 5 spells it `num_local_experts`)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _split_rows(name: str, shape: tuple[int, ...], rank: int, size: int) -> HFSlice:
    n = shape[0] // size
    return HFSlice(name, shape, ((rank * n, (rank + 1) * n), *((0, s) for s in shape[1:])))


def _split_cols(name: str, shape: tuple[int, int], rank: int, size: int) -> HFSlice:
    n = shape[1] // size
    return HFSlice(name, shape, ((0, shape[0]), (rank * n, (rank + 1) * n)))


def _vocab_rows(name: str, vocab: int, hidden: int, rank: int, size: int) -> list[HFSlice]:
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    per = padded // size
    start, stop = rank * per, min((rank + 1) * per, vocab)
    return [HFSlice(name, (vocab, hidden), ((start, stop), (0, hidden)))] if start < stop else []


def vllm_rank_slices(hf: dict[str, Any], tp_size: int, tp_rank: int) -> list[HFSlice]:
    """The HF blocks vLLM tensor-parallel rank `tp_rank` of `tp_size` loads (no expert parallel in vLLM)."""
    h, d = hf["hidden_size"], _head_dim(hf)
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    qwen2 = hf.get("model_type", "").startswith("qwen2")
    out = _vocab_rows("model.embed_tokens.weight", hf["vocab_size"], h, tp_rank, tp_size)
    if not hf.get("tie_word_embeddings", False):
        out += _vocab_rows("lm_head.weight", hf["vocab_size"], h, tp_rank, tp_size)
    out.append(HFSlice.whole("model.norm.weight", (h,)))
    if tp_size <= kv:
        kv_rank, kv_size = tp_rank, tp_size
    else:  # more ranks than KV heads: each KV head is replicated on tp_size / kv ranks
        kv_rank, kv_size = tp_rank // (tp_size // kv), kv
    experts = _num_experts(hf)
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        out += [HFSlice.whole(f"{p}.input_layernorm.weight", (h,)),
                HFSlice.whole(f"{p}.post_attention_layernorm.weight", (h,)),
                _split_rows(f"{a}.q_proj.weight", (heads * d, h), tp_rank, tp_size),
                _split_rows(f"{a}.k_proj.weight", (kv * d, h), kv_rank, kv_size),
                _split_rows(f"{a}.v_proj.weight", (kv * d, h), kv_rank, kv_size),
                _split_cols(f"{a}.o_proj.weight", (h, heads * d), tp_rank, tp_size)]
        if qwen2:
            out += [_split_rows(f"{a}.q_proj.bias", (heads * d,), tp_rank, tp_size),
                    _split_rows(f"{a}.k_proj.bias", (kv * d,), kv_rank, kv_size),
                    _split_rows(f"{a}.v_proj.bias", (kv * d,), kv_rank, kv_size)]
        else:
            out += [HFSlice.whole(f"{a}.q_norm.weight", (d,)), HFSlice.whole(f"{a}.k_norm.weight", (d,))]
        if experts:
            inter = hf["moe_intermediate_size"]
            out.append(HFSlice.whole(f"{p}.mlp.gate.weight", (experts, h)))
            mlps = [f"{p}.mlp.experts.{e}" for e in range(experts)]
        else:
            inter = hf["intermediate_size"]
            mlps = [f"{p}.mlp"]
        for m in mlps:
            out += [_split_rows(f"{m}.gate_proj.weight", (inter, h), tp_rank, tp_size),
                    _split_rows(f"{m}.up_proj.weight", (inter, h), tp_rank, tp_size),
                    _split_cols(f"{m}.down_proj.weight", (h, inter), tp_rank, tp_size)]
    return out


@dataclass(frozen=True)
class Transfer:
    """`sender` (trainer rank) sends `block` to `receiver` (rank in the sync group)."""

    sender: int
    receiver: int
    block: HFSlice


def plan_transfers(holdings: dict[int, list[HFSlice]], needs: dict[int, list[HFSlice]]) -> list[Transfer]:
    """Cover every needed block exactly once from the trainer ranks' holdings.

    A need is cut into the pieces where it meets each holder's blocks; when several holders have
    the same piece (a replicated norm, data-parallel copies), the one that has sent the fewest
    bytes so far sends it. Raises naming the first element nobody holds."""
    by_name: dict[str, list[tuple[int, HFSlice]]] = {}
    for rank, blocks in sorted(holdings.items()):
        for block in blocks:
            by_name.setdefault(block.name, []).append((rank, block))
    load = dict.fromkeys(holdings, 0)
    plan: list[Transfer] = []
    for receiver, blocks in sorted(needs.items()):
        for need in blocks:
            pieces: dict[tuple, list[int]] = {}  # distinct intersected boxes -> holders
            for rank, held in by_name.get(need.name, []):
                piece = need.intersect(held)
                if piece is not None:
                    pieces.setdefault(piece.box, []).append(rank)
            chosen = _disjoint_cover(need, pieces)
            for box, ranks in chosen:
                sender = min(ranks, key=lambda r: (load[r], r))
                block = HFSlice(need.name, need.full_shape, box)
                load[sender] += block.numel
                plan.append(Transfer(sender, receiver, block))
    return plan


def _disjoint_cover(need: HFSlice, pieces: dict[tuple, list[int]]) -> list[tuple[tuple, list[int]]]:
    """Choose non-overlapping pieces covering `need` (trainer shards of one tensor tile it, so pieces
    are either identical or disjoint); raise if some element is not covered."""
    chosen: list[tuple[tuple, list[int]]] = []
    covered = 0
    for box, ranks in sorted(pieces.items()):
        piece = HFSlice(need.name, need.full_shape, box)
        if any(piece.intersect(HFSlice(need.name, need.full_shape, b)) is not None for b, _ in chosen):
            raise ValueError(f"trainer blocks of {need.name} overlap partially ({box}); cannot plan the sync")
        chosen.append((box, ranks))
        covered += piece.numel
    if covered != need.numel:
        raise ValueError(
            f"no trainer rank holds all of {need.name} {need.box} ({covered} of {need.numel} elements found); "
            "the trainer's model does not match the rollout model's config"
        )
    return chosen
