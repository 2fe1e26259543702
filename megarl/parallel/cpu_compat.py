"""megatron-core on a CPU-only machine: the few places where it assumes CUDA, patched in one place.

Measured with megatron-core 0.16.1 on torch 2.13.0+cpu (see docs/cpu-stack.md of the team notes).
`apply_cpu_compat()` changes nothing device-related when CUDA is available, so GPU runs use megatron as is.
Each workaround below is named after the megatron code it covers. One of them is not about the CPU
but about a missing Transformer Engine (CPU machines, or GPU machines without TE): it applies on both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_APPLIED = False


class _TorchOnCpu:
    """Stands in for `torch` inside the few megatron modules that create tensors with a hard-coded
    `device="cuda"`: every attribute is torch's own, except the factories, which map a cuda device to the CPU.
    Scoped to those modules on purpose: a global `TorchFunctionMode` did the same but put a Python call in
    front of every torch op of the whole training step (measured: 0-10% of a tiny model's step, one process, A/B)."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "empty_like", "zeros_like")

    def __getattr__(self, name: str) -> object:  # first access only: the result is cached on the instance
        value = getattr(torch, name)
        if name in self._FACTORIES:
            value = _on_cpu(value)
        setattr(self, name, value)
        return value


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(*args: object, **kwargs: object) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return call


# megatron-core 0.16.1 modules that megarl's training path imports and that create tensors with `device="cuda"`:
# the pipeline schedules' `total_num_tokens`, the causal masks, the MoE aux-loss tracker, `broadcast_data`'s
# sizes, a norm helper in `core.utils` (also the local multi-tensor L2 norm the optimizer falls back to without
# TE/Apex), the rerun state machine's validation; megatron's optimizers: the loss scale `1.0`, the overflow and
# found-inf flags, the grad-norm accumulators of `clip_grads`, the grad scaler's state. (Megatron's distributed
# checkpointing needs none of these: `apply_dist_ckpt_compat` below has what it needs.) A module missing here
# fails loudly on the CPU ("Torch not compiled with CUDA enabled"), never silently.
_CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
)


def patch_cuda_factories() -> None:
    """Point each module of `_CUDA_FACTORY_MODULES` at `_TorchOnCpu`, and make `Tensor.cuda()` return the tensor
    itself (with tied embeddings at PP>1, `LanguageModule.setup_embeddings_and_output_layer` moves the shared
    weight to CUDA before all-reducing it; the grad scaler's `load_state_dict` moves its scale)."""
    import importlib

    for name in _CUDA_FACTORY_MODULES:
        importlib.import_module(name).torch = _TorchOnCpu()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def patch_tensor_type_names() -> None:
    """megatron-core 0.16.1's optimizers sort parameters by `param.type()` and accept only CUDA type names
    (`Float16OptimizerWithFloat16Params` and `DistributedOptimizer` put 'torch.cuda.BFloat16Tensor' parameters
    behind fp32 main copies and step 'torch.cuda.FloatTensor' ones directly, anything else is a TypeError;
    `clip_grad_by_total_norm_fp32` asserts 'torch.cuda.FloatTensor' gradients). `Tensor.type()` without arguments
    names a CPU tensor as its CUDA counterpart ('torch.FloatTensor' -> 'torch.cuda.FloatTensor'): the same
    decisions as on a GPU. Conversions (`t.type(dtype)`) are torch's own."""
    tensor_type = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: object = None, non_blocking: bool = False, **kwargs: object) -> object:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]


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
    # Hard-coded `device="cuda"` tensor creation (pipeline schedules, causal masks, optimizers) and `Tensor.cuda()`.
    patch_cuda_factories()
    # The optimizers' parameter sorting by CUDA type names.
    patch_tensor_type_names()
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


# ---- megatron's distributed checkpointing (`megarl.checkpoint`) -------------------------------------------------
def patch_dist_ckpt_writer_in_process() -> None:
    """megatron-core 0.16.1's `torch_dist` writer (`FileSystemWriterAsync`) collects its results through a
    `multiprocessing.Manager` started with the *spawn* context (a fresh interpreter per trainer rank: 6-10 s per
    save on this machine, and a process that inherits nothing of the rank's setup) and writes each bucket in a
    *forked* child of the (multi-threaded) rank. megarl saves synchronously, so both are replaced by the same work
    done in the calling process: an in-process results queue, and the buckets written one after another by
    megatron's own `write_preloaded_data`. Applies on every device (megarl never uses asynchronous saves)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_megarl_in_process", False):
        return

    def write_in_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:  # noqa: ANN001
        results: queue.Queue = queue.Queue()
        count: queue.Queue = queue.Queue()
        written: dict[int, list] | Exception = {}
        for i, bucket in enumerate(write_buckets):
            count.put(i)
            fa.FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, results, count, True)
            index, result = results.get()
            if isinstance(result, Exception):
                written = result
                break
            written[index] = result
        global_results_queue.put(written)

    fa._get_write_results_queue = queue.Queue
    fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_in_process)
    fa._megarl_in_process = True


def patch_distrib_optimizer_step_without_te() -> None:
    """Without Transformer Engine or Apex, megatron-core 0.16.1's distributed optimizer steps torch's AdamW, whose
    state holds a `step` per parameter; loading a `fully_reshardable` optimizer checkpoint then fails with
    KeyError 'step' in `DistributedOptimizer._set_main_param_and_optimizer_states`, which copies every key of the
    live state from the loaded tensors, where 'step' is kept out (megatron restores it from the param groups).
    The replacement copies the loaded keys only. Applied only when megatron found neither TE nor Apex."""
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE or getattr(do, "_megarl_step_patch", False):
        return
    original = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):  # noqa: ANN001, ANN202
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        live = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in live.items():
            if key != "step":
                value.copy_(tensors[key])
        return None

    do.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    do._megarl_step_patch = True


def apply_dist_ckpt_compat() -> None:
    """Idempotent: the two workarounds `megarl.checkpoint` needs around megatron's distributed checkpointing."""
    patch_dist_ckpt_writer_in_process()
    patch_distrib_optimizer_step_without_te()
