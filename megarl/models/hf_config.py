"""Model facts read from a Hugging Face `config.json`: the file itself and the counts other layers ask for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.config.load import ConfigError


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.hf_dir={hf_dir}: no config.json there; point model.hf_dir at a Hugging Face checkpoint "
            "or set model.tiny=moe|dense to create a tiny one"
        )
    return json.loads(path.read_text())


def num_experts(hf: dict[str, Any]) -> int:
    """Expert count of a MoE config (0 for dense); transformers 5 spells it `num_local_experts`."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def head_dim(hf: dict[str, Any]) -> int:
    """The attention head size (`head_dim`, or hidden size / heads where the config has none)."""
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def padded_vocab_size(hf: dict[str, Any], tp: int) -> int:
    """Megatron shards the vocabulary evenly over TP ranks: pad up to a multiple of tp."""
    return -(-hf["vocab_size"] // tp) * tp
