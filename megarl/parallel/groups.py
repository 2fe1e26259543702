"""Trainer process groups: torch.distributed (gloo on CPU, NCCL on GPU) plus megatron's
tensor/pipeline/expert/data-parallel groups."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.parallel.cpu_compat import apply_cpu_compat, init_rng_tracker
from megarl.parallel.stores import tcp_store


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer world is split. Data parallel = world_size / (tp * pp). The expert layers have their own
    grid over the same ranks (megatron-core's expert rank generator, order tp-ep-dp-pp): each expert's columns
    are split `expert_tp` ways, experts over `ep` ranks, so expert data parallel = world_size / (expert_tp * ep *
    pp); within a pipeline stage, rank r's expert-TP rank is r mod expert_tp and its expert rank
    (r // expert_tp) mod ep."""

    tp: int = 1  # tensor parallel: attention heads, dense MLP columns and the vocabulary are split tp ways
    pp: int = 1  # pipeline parallel: contiguous blocks of layers per stage
    ep: int = 1  # expert parallel: each rank holds num_experts / ep experts
    expert_tp: int = 1  # expert tensor parallel: each expert's MLP columns split expert_tp ways (independent of tp)


def backend() -> str:
    """torch.distributed backend: NCCL on GPUs, gloo on CPU-only machines."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_trainer_groups(layout: TrainerLayout, rank: int, world_size: int, master_addr: str, master_port: int,
                        timeout_s: float = 600.0, local_rank: int | None = None, launcher_store: bool = False) -> None:
    """Join the trainer world (`rank` of `world_size`; rank 0 serves the rendezvous store on
    `master_addr:master_port`, that address only) and build megatron's tensor / pipeline / expert / data-parallel
    groups and RNG tracker; call once per process. `local_rank` (default `rank`) picks this node's GPU;
    `launcher_store`: the launcher (torchrun's agent) serves the store already, so rank 0 only connects.
    On a CPU-only machine this first applies `apply_cpu_compat()`."""
    from megatron.core import parallel_state

    apply_cpu_compat()
    if torch.cuda.is_available():
        torch.cuda.set_device((rank if local_rank is None else local_rank) % torch.cuda.device_count())
    store = tcp_store(master_addr, master_port, world_size, is_master=rank == 0 and not launcher_store,
                      timeout_s=timeout_s)
    dist.init_process_group(backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
    )
    init_rng_tracker()


def destroy_trainer_groups() -> None:
    """Tear down megatron's groups and the trainer world (a no-op if it was never joined)."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def dp_rank_and_size() -> tuple[int, int]:
    """This rank's data-parallel coordinate: how the global rollout batch is split."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
