"""megatron-core on a CPU-only machine: the few places where it assumes CUDA, patched in one place.

Measured with megatron-core 0.16.1 on torch 2.13.0+cpu (see docs/cpu-stack.md of the team notes).
`apply_cpu_compat()` changes nothing device-related when CUDA is available, so GPU runs use megatron as is.
Each workaround below is named after the megatron code it covers. One of them is not about the CPU
but about a missing Transformer Engine (CPU machines, or GPU machines without TE): it applies on both.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


class _CudaDeviceToCpu(TorchFunctionMode):
    """Maps an explicit `device="cuda"` argument to the CPU: the pipeline schedules create
    `total_num_tokens` and `get_default_causal_mask` builds its mask with a hard-coded cuda device.
    `Tensor.cuda()` returns the tensor itself: with tied embeddings at PP>1,
    `LanguageModule.setup_embeddings_and_output_layer` moves the shared weight to CUDA before all-reducing it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def patch_router_without_te() -> None:
    """megatron-core 0.16.1's MoE router gating (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, but the name is only bound when Transformer Engine imports: without TE
    every MoE forward raises NameError (seen on CPU and on an H100 without TE). None selects torch's mm."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def patch_recompute_rng_on_cpu() -> None:
    """Activation recomputation (`tensor_parallel.checkpoint`, megatron-core 0.16.1) saves and restores the
    CPU RNG, the CUDA RNG (`_get_cuda_rng_state` / `_set_cuda_rng_state`, which initialise CUDA) and the
    tracker's states around the recomputed forward. Without CUDA there is no CUDA RNG to save: an empty
    placeholder and a no-op setter leave the CPU RNG and the (no-op) tracker handled as before."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def apply_cpu_compat() -> None:
    """Idempotent; only the Transformer Engine workaround applies when CUDA is present."""
    global _APPLIED
    patch_router_without_te()
    if _APPLIED or torch.cuda.is_available():
        return
    # RoPE and p2p communication ask for the current CUDA device to place tensors.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # Timers and schedules synchronise the device; nothing to wait for on the CPU.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    # Hard-coded `device="cuda"` tensor creation (pipeline schedules, default causal mask).
    _CudaDeviceToCpu().__enter__()
    # Activation recomputation saves and restores a CUDA RNG state.
    patch_recompute_rng_on_cpu()
    _APPLIED = True


def init_rng_tracker() -> None:
    """megatron's CUDA RNG tracker cannot fork CUDA states on the CPU; the inference tracker is a no-op
    stand-in, which is exact for RL training with dropout 0. On GPUs the regular tracker is used."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
