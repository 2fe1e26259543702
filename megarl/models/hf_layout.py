"""Where each block of a megatron-core parameter lives in the Hugging Face checkpoint.

One table serves both directions (`megarl.models.hf_import` reads through it, `megarl.models.hf_slices`
exports through it), so import and export are exact inverses by construction:
`HFLayout.blocks(name, local_shape)` lists, for a parameter of THIS rank's model stage, pairs
`(local_index, HFSlice)`: `param[local_index]` holds exactly the HF block `HFSlice`.

Megatron layouts (local layer spec, TP rank r of T, expert-parallel rank e):
- `linear_qkv` rows are grouped per query group `[q (heads/groups heads); k; v]`, TP splits groups;
- `linear_fc1` is `[gate; up]`, each TP shard `[gate_r; up_r]`;
- experts `mlp.experts.local_experts.{j}.linear_fc{1,2}.weight` (local spec, `SequentialMLP`) or
  `mlp.experts.linear_fc{1,2}.weight{j}` (Transformer Engine grouped GEMM, `TEGroupedMLP`: one parameter per
  local expert, same shape) hold global expert `e * local_count + j`, split over expert-TP ranks (`etp_*`, not
  `tp_*`) as dense MLPs are over TP ranks;
- layer indices are stage-local; `layer_number` (1-based) is global;
- embeddings / output layer rows are vocab shards of the padded vocabulary (padding has no HF block);
  with tied embeddings the checkpoint has no `lm_head.weight`: the last stage's `output_layer.weight` (a
  copy of the embedding, PP>1 only) reads `model.embed_tokens.weight`;
- Transformer Engine spec (GPU): input / pre-MLP norms live in `linear_qkv.layer_norm_weight` /
  `linear_fc1.layer_norm_weight` (dense layers), which map to the same HF norms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.models.hf_config import head_dim, num_experts
from megarl.sync.slices import HFSlice

if TYPE_CHECKING:  # the layout is plain data: `megarl check`, `plan` and `prepare` must not import torch for it
    import torch

Index = tuple[slice, ...]


@dataclass(frozen=True)
class RankCoords:
    """This rank's position in the trainer layout (what the mapping needs to know)."""

    tp_rank: int
    tp_size: int
    etp_rank: int  # expert tensor-parallel
    etp_size: int
    ep_rank: int
    ep_size: int

    @classmethod
    def current(cls) -> RankCoords:
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())


def _rows(local: tuple[int, int], hf_rows: tuple[int, int], name: str, shape: tuple[int, ...]) -> tuple[Index, HFSlice]:
    """Rows `local` of the local tensor are rows `hf_rows` of HF tensor `name` (all other dims whole)."""
    rest = tuple((0, s) for s in shape[1:])
    return (slice(*local),), HFSlice(name, shape, (hf_rows, *rest))


def _cols(local: tuple[int, int], hf_cols: tuple[int, int], name: str, shape: tuple[int, int]) -> tuple[Index, HFSlice]:
    return (slice(None), slice(*local)), HFSlice(name, shape, ((0, shape[0]), hf_cols))


def _whole(name: str, shape: tuple[int, ...]) -> list[tuple[Index, HFSlice]]:
    return [((), HFSlice.whole(name, shape))]


class HFLayout:
    """The mapping for one model config and one rank."""

    def __init__(self, hf: dict[str, Any], coords: RankCoords, layer_numbers: dict[int, int]) -> None:
        self.hf, self.c = hf, coords
        self.layer_numbers = layer_numbers  # stage-local index -> global 0-based layer index
        self.h = hf["hidden_size"]
        self.d = head_dim(hf)
        self.heads = hf["num_attention_heads"]
        self.groups = hf.get("num_key_value_heads", self.heads)
        self.experts = num_experts(hf)
        self.tied = bool(hf.get("tie_word_embeddings", False))

    def _vocab(self, hf_name: str, local_rows: int) -> list[tuple[Index, HFSlice]]:
        start = self.c.tp_rank * local_rows
        stop = min(start + local_rows, self.hf["vocab_size"])
        if start >= stop:  # a shard made only of padding rows
            return []
        return [_rows((0, stop - start), (start, stop), hf_name, (self.hf["vocab_size"], self.h))]

    def _qkv(self, prefix: str, bias: bool) -> list[tuple[Index, HFSlice]]:
        per = self.heads // self.groups  # query heads per group
        local_groups = self.groups // self.c.tp_size
        d, tail = self.d, (() if bias else (self.h,))
        out = []
        for j in range(local_groups):
            g = self.c.tp_rank * local_groups + j
            base = j * (per + 2) * d
            kind = "bias" if bias else "weight"
            out.append(_rows((base, base + per * d), (g * per * d, (g + 1) * per * d),
                             f"{prefix}.q_proj.{kind}", (self.heads * d, *tail)))
            out.append(_rows((base + per * d, base + (per + 1) * d), (g * d, (g + 1) * d),
                             f"{prefix}.k_proj.{kind}", (self.groups * d, *tail)))
            out.append(_rows((base + (per + 1) * d, base + (per + 2) * d), (g * d, (g + 1) * d),
                             f"{prefix}.v_proj.{kind}", (self.groups * d, *tail)))
        return out

    def _gated_fc1(self, prefix: str, inter: int, rank: int, size: int) -> list[tuple[Index, HFSlice]]:
        n = inter // size
        rows = (rank * n, (rank + 1) * n)
        return [_rows((0, n), rows, f"{prefix}.gate_proj.weight", (inter, self.h)),
                _rows((n, 2 * n), rows, f"{prefix}.up_proj.weight", (inter, self.h))]

    def _fc2(self, prefix: str, inter: int, rank: int, size: int) -> list[tuple[Index, HFSlice]]:
        n = inter // size
        return [_cols((0, n), (rank * n, (rank + 1) * n), f"{prefix}.down_proj.weight", (self.h, inter))]

    def blocks(self, name: str, local_shape: tuple[int, ...]) -> list[tuple[Index, HFSlice]]:
        """`(local_index, HFSlice)` pairs covering megatron parameter `name` (raises on an unknown name)."""
        c, h = self.c, self.h
        if name == "embedding.word_embeddings.weight":
            return self._vocab("model.embed_tokens.weight", local_shape[0])
        if name == "output_layer.weight":  # tied at PP>1: the last stage's copy of the embedding
            return self._vocab("model.embed_tokens.weight" if self.tied else "lm_head.weight", local_shape[0])
        if name == "decoder.final_layernorm.weight":
            return _whole("model.norm.weight", (h,))
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(f"no HF mapping for megatron parameter {name!r}")
        layer = self.layer_numbers[int(m.group(1))]
        p, rest = f"model.layers.{layer}", m.group(2)
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        simple = {
            "input_layernorm.weight": (f"{p}.input_layernorm.weight", (h,)),
            "pre_mlp_layernorm.weight": (f"{p}.post_attention_layernorm.weight", (h,)),
            # Transformer Engine spec: the norms are fused into the following linear (`layer_norm_weight`)
            "self_attention.linear_qkv.layer_norm_weight": (f"{p}.input_layernorm.weight", (h,)),
            "mlp.linear_fc1.layer_norm_weight": (f"{p}.post_attention_layernorm.weight", (h,)),
            "self_attention.q_layernorm.weight": (f"{attn}.q_norm.weight", (self.d,)),
            "self_attention.k_layernorm.weight": (f"{attn}.k_norm.weight", (self.d,)),
            "mlp.router.weight": (f"{mlp}.gate.weight", (self.experts, h)),
        }
        if rest in simple:
            return _whole(*simple[rest])
        if rest == "self_attention.linear_qkv.weight":
            return self._qkv(attn, bias=False)
        if rest == "self_attention.linear_qkv.bias":
            return self._qkv(attn, bias=True)
        if rest == "self_attention.linear_proj.weight":
            n = self.heads * self.d // c.tp_size
            return [_cols((0, n), (c.tp_rank * n, (c.tp_rank + 1) * n), f"{attn}.o_proj.weight",
                          (h, self.heads * self.d))]
        if rest == "mlp.linear_fc1.weight":
            return self._gated_fc1(mlp, self.hf["intermediate_size"], c.tp_rank, c.tp_size)
        if rest == "mlp.linear_fc2.weight":
            return self._fc2(mlp, self.hf["intermediate_size"], c.tp_rank, c.tp_size)
        e = local_expert(rest)
        if e is not None:
            j, fc = e
            expert = c.ep_rank * (self.experts // c.ep_size) + j
            prefix, inter = f"{mlp}.experts.{expert}", self.hf["moe_intermediate_size"]
            if fc == 1:
                return self._gated_fc1(prefix, inter, c.etp_rank, c.etp_size)
            return self._fc2(prefix, inter, c.etp_rank, c.etp_size)
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")


_SEQUENTIAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")


def local_expert(rest: str) -> tuple[int, int] | None:
    """`(local expert j, 1 or 2 for linear_fc1 / linear_fc2)` of a layer-relative parameter name in either spelling
    (`mlp.experts.local_experts.{j}.linear_fc1.weight` or TE's grouped `mlp.experts.linear_fc1.weight{j}`), None for
    any other parameter."""
    m = _SEQUENTIAL_EXPERT.fullmatch(rest)
    if m is not None:
        return int(m.group(1)), int(m.group(2))
    m = _GROUPED_EXPERT.fullmatch(rest)
    if m is not None:
        return int(m.group(2)), int(m.group(1))
    return None


def layout_for(model: torch.nn.Module, hf: dict[str, Any]) -> HFLayout:
    """The mapping for this rank's model stage (global layer numbers read off the megatron layers)."""
    decoder = model.decoder
    numbers = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}
    return HFLayout(hf, RankCoords.current(), numbers)

