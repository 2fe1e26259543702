"""The trainer side of the weight sync: every block this rank holds, in full Hugging Face coordinates.

A TP rank's `linear_qkv` shard yields one q, one k and one v block per local query group; `linear_fc1`
yields a gate and an up block; each local expert yields its gate/up/down blocks under its GLOBAL expert
id; embeddings and the output layer drop the vocabulary padding. With tied embeddings at PP>1 the last
stage's output layer is a copy of the first stage's embedding: only the embedding is yielded, so
`model.embed_tokens.weight` is sent and exported once (and there is no `lm_head.weight`). The blocks come
from the same table the importer reads through (`megarl.models.hf_layout`), so the union over all ranks
rebuilds every HF tensor exactly (tests/test_hf_slices.py, tests/test_megatron_vs_hf.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megarl.models.hf_layout import layout_for
from megarl.sync.slices import HFSlice


def iter_local_hf_slices(model: torch.nn.Module, hf: dict[str, Any]) -> Iterator[tuple[HFSlice, torch.Tensor]]:
    """`(HFSlice, tensor)` for every block of every parameter of this rank's model stage; `tensor` has shape
    `HFSlice.shape` and is a detached VIEW of the live parameter (no copy: column blocks of TP-split
    row-parallel weights are non-contiguous, the transport packs them). Replicated parameters (norms,
    router) are yielded by every rank that holds them; the sync planner picks one sender."""
    layout = layout_for(model, hf)
    tied = bool(hf.get("tie_word_embeddings", False))
    for name, param in model.named_parameters():
        if tied and name == "output_layer.weight":  # the first stage's embedding holds the same values
            continue
        for index, block in layout.blocks(name, tuple(param.shape)):
            yield block, param.detach()[index]
