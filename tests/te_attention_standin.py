"""A STAND-IN for Transformer Engine 2.9's attention-backend choice: which of its three kernels (FlashAttention,
cuDNN fused attention, unfused) may run for a training call, reduced to the filters megarl's calls meet. No machine
here has TE (it needs CUDA), so this reproduces the reading of its source that `megarl.models.qwen_provider.te_fusions`
and `megarl.models.layer_backend.precision_problem` rest on, to hold it in CPU tests. It is not TE and selects no
kernel; where TE's rules depend on more (head sizes, masks, biases, FP8, context parallel, cuDNN's own support
query), megarl's calls are the plain case (causal, no bias, no dropout, head dim 128, no FP8) and those filters pass.

Followed: `transformer_engine/pytorch/attention/dot_product_attention/utils.py`, function `get_attention_backend`,
at tag v2.9 (commit 70f536662ae10a62a54f4ed1ba92e3314c5cfd69 of NVIDIA/TransformerEngine):
- lines 399-404: each backend is on unless its variable (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN) is 0;
- lines 415-427: FlashAttention 2 and cuDNN fused attention need sm80+, FlashAttention 3 exactly sm90;
- lines 428-461: FlashAttention 2 takes bf16/fp16 only, FlashAttention 3 and fused attention bf16/fp16/fp8;
- lines 659-662: the unfused kernel takes no THD (packed) input;
- lines 1093-1097: FlashAttention counts only where the `flash_attn` package (v2 or v3) is installed.
TE then raises "No dot product attention backend is available" where none is left (`dot_product_attention.py`
lines 1369-1374).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

BACKENDS = ("flash", "fused", "unfused")


def available_backends(env: Mapping[str, str], dtype: torch.dtype, qkv_format: str, compute_capability: tuple[int, int],
                       flash_attn_v2: bool = False, flash_attn_v3: bool = False) -> list[str]:
    """The backends TE 2.9 would keep for a training call with these inputs (module docstring), in TE's order."""
    flash2 = flash3 = env.get("NVTE_FLASH_ATTN", "1") != "0"
    fused = env.get("NVTE_FUSED_ATTN", "1") != "0"
    unfused = env.get("NVTE_UNFUSED_ATTN", "1") != "0"
    if compute_capability < (8, 0):
        flash2 = fused = False
    if compute_capability != (9, 0):
        flash3 = False
    if dtype not in (torch.bfloat16, torch.float16):
        flash2 = False
    if dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        flash3 = fused = False
    if qkv_format == "thd":
        unfused = False
    flash = (flash2 and flash_attn_v2) or (flash3 and flash_attn_v3)
    return [name for name, on in zip(BACKENDS, (flash, fused, unfused), strict=True) if on]
