"""Tiny random Qwen3 / Qwen3-MoE / Qwen2 (Qwen2.5) checkpoints, made with transformers' own classes.

They are real HF checkpoints (config.json + safetensors + tokenizer), small enough for CPU tests and
the CPU demo, and shaped to respect the real stack's CPU limits: head_dim 64 (vLLM's CPU attention
kernel refuses 16), KV heads divisible by the tensor-parallel sizes used in tests (2), experts
divisible by the expert-parallel size (2). The same seed gives byte-identical files.
Kinds: "moe" (Qwen3-MoE), "dense" (Qwen3: q/k norms, no biases), "qwen2" (Qwen2 / Qwen2.5: the sizes of
"dense" but hidden 256 = heads x head_dim, as vLLM's Qwen2 requires; q/k/v biases and no q/k norms; its biases
are drawn at random, since transformers initialises them to zero and a zero bias would not exercise its mapping),
"dense-tied" ("dense" with `tie_word_embeddings=True`, as Qwen3-0.6B/1.7B/4B: one embedding matrix is also the
output layer, the checkpoint has no `lm_head.weight`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from megarl.data.tokenizer import BOS, EOS, PAD, save_tokenizer, token_id, vocabulary

TinyKind = Literal["moe", "dense", "qwen2", "dense-tied"]

# Shared by both tiny models; vocab is the tokenizer's 25 tokens padded up to 32.
_COMMON = dict(
    vocab_size=32,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def make_tiny_checkpoint(out_dir: str | Path, kind: TinyKind = "moe", seed: int = 0, positions: int = 128) -> Path:
    """Create (or overwrite) a tiny random checkpoint with its tokenizer in `out_dir`; return the path.
    `positions` is its context (`max_position_embeddings`): rotary positions hold no weights, so the weights are the
    same bytes at any context (benches of long responses take a longer one; the tests' models keep 128)."""
    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    assert len(vocabulary()) <= _COMMON["vocab_size"]
    common = {**_COMMON, "max_position_embeddings": positions}
    ids = dict(pad_token_id=token_id(PAD), bos_token_id=token_id(BOS), eos_token_id=token_id(EOS))
    if kind == "moe":
        config = Qwen3MoeConfig(**common, **_MOE, **ids)
        model_cls = Qwen3MoeForCausalLM
    elif kind == "dense":
        config = Qwen3Config(**common, **ids)
        model_cls = Qwen3ForCausalLM
    elif kind == "dense-tied":
        config = Qwen3Config(**{**common, "tie_word_embeddings": True}, **ids)
        model_cls = Qwen3ForCausalLM
    elif kind == "qwen2":  # hidden = heads x head_dim: vLLM's Qwen2 ignores head_dim and takes hidden / heads
        config = Qwen2Config(**{**common, "hidden_size": common["num_attention_heads"] * common["head_dim"]},
                             **ids)
        model_cls = Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: use 'moe', 'dense', 'qwen2' or 'dense-tied'")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if kind == "qwen2":  # after the model's own initialisation, so the other kinds' bytes are unchanged
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out, model_max_length=positions)
    gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
           "pad_token_id": ids["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def ensure_tiny_checkpoint(out_dir: str | Path, kind: TinyKind = "moe", seed: int = 0) -> Path:
    """Make the checkpoint unless a complete one is already there (config, weights and tokenizer)."""
    out = Path(out_dir)
    needed = ("config.json", "model.safetensors", "tokenizer.json")
    if all((out / name).exists() for name in needed):
        return out
    return make_tiny_checkpoint(out, kind=kind, seed=seed)
