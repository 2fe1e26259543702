"""Load a Hugging Face safetensors checkpoint into this rank's megatron-core model stage.

Only the blocks this rank holds are read (`safe_open(...).get_slice(name)[box]`), so no process
ever materialises a full tensor it does not own; padding rows of the vocabulary are zeroed.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megarl.models.hf_layout import layout_for


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF parameter name -> the safetensors file holding it (sharded or single-file checkpoints)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, hf: dict[str, Any]) -> None:
    """Fill every parameter of `model` from the checkpoint; raises naming any tensor that is missing or
    has the wrong shape, and any parameter left partly unfilled."""
    hf_dir = Path(hf_dir)
    files = _weight_files(hf_dir)
    layout = layout_for(model, hf)
    with ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(p, "pt")) for p in set(files.values())}
        for name, param in model.named_parameters():
            filled = 0
            param.zero_()
            for index, block in layout.blocks(name, tuple(param.shape)):
                if block.name not in files:
                    raise KeyError(f"{hf_dir}: tensor {block.name!r} (for {name}) is not in the checkpoint")
                src = handles[files[block.name]].get_slice(block.name)
                if tuple(src.get_shape()) != block.full_shape:
                    raise ValueError(f"{block.name}: checkpoint shape {src.get_shape()} != expected {block.full_shape}")
                data = src[tuple(slice(a, b) for a, b in block.box)]
                param[index].copy_(data.to(param.dtype))
                filled += block.numel
            padding = param.numel() - filled
            if padding and not name.endswith(("word_embeddings.weight", "output_layer.weight")):
                raise RuntimeError(f"{name}: {padding} elements have no HF source")
