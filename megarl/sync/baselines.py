"""What vLLM's own weight-transfer backends send each vLLM rank, computed from the HF config, to compare megarl's
partitioned sync with (`megarl bench sync --project`). Nothing here moves bytes.

- `nccl` (vLLM's `NCCLWeightTransferEngine`): the trainer broadcasts every checkpoint tensor whole to every
  vLLM worker, which narrows it in `load_weights`. Every rank receives the whole model.
- `nccl_m2n` (vLLM's `M2N` engine, `vllm/distributed/weight_transfer/m2n_layout.py`): a checkpoint tensor is
  resharded straight into the live parameter of the same name when that parameter's loader is a plain
  column/row-parallel or replicated loader; anything else — fused parameters whose HF names name no vLLM
  parameter (`q/k/v_proj` -> `qkv_proj`, `gate/up_proj` -> `gate_up_proj`, MoE experts -> `w13`/`w2`), the
  vocabulary-parallel embedding and LM head, norms without a loader — falls back to the whole tensor on every
  rank. vLLM also takes the fallback for everything under pipeline parallel or quantization. For the Qwen2 /
  Qwen3 / Qwen3-MoE models of vLLM 0.32 on GPUs this leaves exactly two sharded tensors per layer kind:
  `self_attn.o_proj` (row parallel, split on dim 1) and a dense layer's `mlp.down_proj` (row parallel, dim 1);
  the MoE router `mlp.gate` is resolved as replicated (whole on every rank, as in the fallback). On vLLM's CPU
  build every linear weight is repacked for the CPU GEMM after loading (the live parameter is left empty, with
  no loader), so nothing resolves and every tensor falls back: the whole model to every rank, as `nccl`.
  `tests/test_sync_baselines.py` checks the CPU classification against vLLM's own resolver inside a running
  vLLM TP-2 server, and a `gpu`-marked test checks the GPU one.
"""

from __future__ import annotations

from typing import Any, Literal

from megarl.sync.loader_reads import RankReads
from megarl.sync.plan import vllm_rank_slices

M2NPlacement = Literal["shard", "replicate", "fallback"]


def hf_tensors(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint."""
    return {s.name: s.full_shape for s in vllm_rank_slices(hf, 1, 0)}


def m2n_placement(name: str, hf: dict[str, Any], cpu: bool = False) -> M2NPlacement:
    """How vLLM 0.32's `nccl_m2n` places HF tensor `name` of a Qwen2/Qwen3/Qwen3-MoE model at PP 1, unquantized,
    on GPUs (`cpu=True`: on vLLM's CPU build, where every tensor falls back)."""
    if cpu:
        return "fallback"
    if name.endswith(("self_attn.o_proj.weight", ".mlp.down_proj.weight")):  # plain RowParallelLinear
        return "shard"
    if name.endswith(".mlp.gate.weight"):  # the MoE router: a replicated linear, whole on every rank
        return "replicate"
    return "fallback"


def _dense_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for s in shape:
        n *= s
    return n


def bytes_per_vllm_rank(hf: dict[str, Any], tp: int, itemsize: int, cpu: bool = False,
                        needs: RankReads | None = None) -> dict[str, list[int]]:
    """Bytes each of the `tp` ranks of one vLLM replica (PP 1, on GPUs unless `cpu`) receives per sync, for megarl,
    `nccl` and `nccl_m2n`. megarl's come from `needs` (per TP rank, the blocks its loaders read, e.g. recorded by
    `megarl.sync.loader_reads`) when given, else from the hand-written table."""
    tensors = hf_tensors(hf)
    full = sum(_dense_bytes(shape, itemsize) for shape in tensors.values())
    reads = needs if needs is not None else {r: vllm_rank_slices(hf, tp, r) for r in range(tp)}
    megarl = [sum(s.numel for s in reads[r]) * itemsize for r in range(tp)]
    m2n = 0
    for name, shape in tensors.items():
        whole = _dense_bytes(shape, itemsize)
        m2n += whole // tp if m2n_placement(name, hf, cpu) == "shard" else whole
    return {"megarl": megarl, "nccl": [full] * tp, "nccl_m2n": [m2n] * tp}
