"""`megarl plan`: parameters and bytes per trainer rank and per rollout rank, and what one weight sync moves.

Everything is computed from the Hugging Face `config.json` and the run config's layouts: no weights are read
and no model is built, so a 30B plan takes a second on a laptop (with `--needs recorded`, vLLM builds its model
once per layout, without weights, to record what its loaders read: see the rollout rank below).

- total: every tensor of the HF checkpoint (`vllm_rank_slices` at TP 1 lists each one whole);
- trainer rank: the shapes of megatron-core's local parameters at the rank's pipeline stage, the way
  `megarl.models.qwen_provider.build_gpt_model` builds them: the vocabulary padded by `padded_vocab_size`
  and split over tp, layers split evenly over pp (megatron refuses an uneven split without extra options),
  attention and dense MLPs split over tp, experts split over ep with their MLPs split over expert tensor
  parallel (= tp, megatron's default), norms, q/k norms and the router whole on every rank that holds their
  layer. Names follow the local layer spec; the Transformer Engine spec (GPUs) fuses the two norms of a dense
  layer into `linear_qkv` / `linear_fc1` under other names, with the same counts;
- rollout rank: the HF blocks vLLM TP rank r loads: exactly what one sync sends to it (vLLM's own vocabulary
  padding rows are not sent). One sync sends that to every replica. By default from the hand-written table of
  vLLM 0.32's layouts (`vllm_rank_slices`: Qwen2, Qwen3, Qwen3-MoE, no expert parallel); with `--needs recorded`
  from vLLM's own weight loaders (`megarl.sync.loader_reads`, what a run does with `sync.needs=recorded`): that
  needs vLLM installed here, takes seconds to minutes the first time for a layout (one process per vLLM TP rank;
  no weights), and is then read from the file cache (`MEGARL_LOADER_READS_CACHE`, else
  `~/.cache/megarl/loader_reads`). The record also covers `rollout.expert_parallel` and model families the table
  does not list.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from megarl.checks import (
    DTYPE_BYTES,
    GB,
    VLLM_HOST_BYTES_PER_RANK,
    push_budget,
    push_memory,
    receive_mode,
    replica_host_bytes,
    replica_host_mb,
    table_layout,
)
from megarl.config.load import ConfigError
from megarl.config.schema import Config
from megarl.models.hf_config import num_experts, padded_vocab_size, read_hf_config
from megarl.models.shapes import active_params, megatron_local_shapes, pipeline_stage_of, total_params
from megarl.sync.baselines import bytes_per_vllm_rank, hf_tensors
from megarl.sync.loader_reads import RankReads
from megarl.sync.receiver_memory import (
    BUCKETS_IN_FLIGHT_PER_SENDER,
    CUDA_RESERVE_BYTES,
    LAYERS_ASSEMBLED_PER_STAGE,
    MODES,
    NCCL_COMM_BYTES,
    NCCL_PEER_BYTES,
    ReceiverMemory,
)


@dataclass(frozen=True)
class StageSize:
    """What every trainer rank of one pipeline stage holds."""

    stage: int
    layers: range  # global layer indices
    ranks: list[int]
    params: int
    expert_params: int


@dataclass(frozen=True)
class Plan:
    total_params: int
    active_params: int
    trainer_stages: list[StageSize]
    trainer_rank_params: list[int]  # by global trainer rank
    replicas: int
    dtype: str
    needs: RankReads  # per vLLM TP rank, the HF blocks one sync sends it (each replica)
    needs_source: str  # where `needs` came from: "table" or "recorded"
    push_memory: list[ReceiverMemory]  # by vLLM TP rank: its memory during a push

    @property
    def rollout_rank_params(self) -> list[int]:
        """By vLLM TP rank: elements one sync sends to that rank (each replica)."""
        return [sum(s.numel for s in self.needs[k]) for k in sorted(self.needs)]

    @property
    def bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def sync_bytes_per_replica(self) -> int:
        return sum(self.rollout_rank_params) * self.bytes_per_param

    @property
    def sync_bytes_total(self) -> int:
        return self.sync_bytes_per_replica * self.replicas


def make_plan(hf: dict[str, Any], cfg: Config, dtype: str = "bf16", needs: RankReads | None = None) -> Plan:
    """Sizes for the config's trainer and rollout layouts (validate the config first, as `run` does). `needs`: per
    vLLM TP rank, the blocks its loaders read (`recorded_needs`); the hand-written table when None."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype={dtype}: choose one of {', '.join(DTYPE_BYTES)}")
    t, r = cfg.trainer, cfg.rollout
    source = "table" if needs is None else "recorded"
    memory = push_memory(hf, cfg, dtype, needs)
    if needs is None:
        needs = {k: blocks for k, (blocks, _) in enumerate(table_layout(hf, t, r.tp)[1])}
    per_stage = t.world_size // t.pp
    layers_per_stage = hf["num_hidden_layers"] // t.pp
    stages = []
    for s in range(t.pp):
        shapes = megatron_local_shapes(hf, t.tp, t.pp, t.ep, s, t.expert_tp)
        stages.append(StageSize(
            stage=s, layers=range(s * layers_per_stage, (s + 1) * layers_per_stage),
            ranks=list(range(s * per_stage, (s + 1) * per_stage)),
            params=sum(map(math.prod, shapes.values())),
            expert_params=sum(math.prod(v) for k, v in shapes.items() if ".local_experts." in k),
        ))
    return Plan(
        total_params=total_params(hf), active_params=active_params(hf), trainer_stages=stages,
        trainer_rank_params=[stages[pipeline_stage_of(rank, t)].params for rank in range(t.world_size)],
        replicas=r.replicas, dtype=dtype, needs=needs, needs_source=source,
        push_memory=memory,
    )


def recorded_needs(cfg: Config, hf: dict[str, Any]) -> RankReads:
    """What each vLLM TP rank of the config's rollout layout reads, recorded from vLLM's own loaders here (or read
    from the file cache). Tensor names and shapes come from the checkpoint's safetensors headers when
    `model.hf_dir` holds them, else from the config (a recipe's config.json alone)."""
    from megarl.sync.loader_reads import checkpoint_tensors, default_cache_dir, loader_reads

    r = cfg.rollout
    try:
        tensors = checkpoint_tensors(cfg.model.hf_dir)
    except FileNotFoundError:
        tensors = hf_tensors(hf)
    cache = default_cache_dir()
    print(f"megarl plan: vLLM's loader reads for rollout.tp={r.tp}" + (" with expert parallel" if r.expert_parallel
          else "") + f": from the file cache in {cache}, or recorded now (one process per TP rank, no weights; "
          "once per layout)", file=sys.stderr, flush=True)
    try:
        return loader_reads(hf, tensors, r.tp, r.expert_parallel, cache)
    except RuntimeError as err:
        raise ConfigError(f"--needs recorded: {err} (or leave --needs at table)") from err


def _b(params: int) -> str:
    return f"{params:,} ({params / 1e9:.2f} B)" if params >= 10**8 else f"{params:,}"


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 10**7 else f"{nbytes:,} B"


def _nbytes(nbytes: int) -> str:
    return f"{nbytes:,} bytes" + (f" = {nbytes / GB:.2f} GB" if nbytes >= 10**7 else "")


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def format_plan(plan: Plan, cfg: Config, hf: dict[str, Any], link_gbps: float = 50.0) -> str:
    """The report `megarl plan` prints: model totals, a table per pipeline stage, a table per vLLM TP rank."""
    t, r, nb = cfg.trainer, cfg.rollout, plan.bytes_per_param
    experts = num_experts(hf)
    kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    moe = f", {experts} experts top-{hf['num_experts_per_tok']}" if experts else ""
    lines = [
        f"model: {hf.get('model_type', '?')} from {cfg.model.hf_dir}: {hf['num_hidden_layers']} layers, hidden "
        f"{hf['hidden_size']}, {hf['num_attention_heads']} heads / {kv_heads} KV heads{moe}, vocab {hf['vocab_size']}",
        f"total: {_b(plan.total_params)} parameters = {_nbytes(plan.total_params * nb)} in {plan.dtype}",
    ]
    if experts:
        lines.append(f"active per token: {_b(plan.active_params)} parameters")
    lines.append("layout: checked as for a GPU job (megarl check --gpu): OK")
    if experts and t.tp > 1:
        lines.append(f"  trainer.tp={t.tp} with a MoE model needs Transformer Engine: a GPU layout, not one for the "
                     "CPU stack")

    dp = t.world_size // (t.tp * t.pp)
    lines += ["", f"trainer: {t.world_size} ranks = tp {t.tp} x pp {t.pp} x dp {dp}"]
    if experts:
        edp = t.world_size // (t.expert_tp * t.ep * t.pp)
        lines.append(f"  experts: ep {t.ep} x expert-tp {t.expert_tp} x expert-dp {edp} per stage, "
                     f"{experts // t.ep} experts per rank")
    lines.append(f"  vocabulary padded to {padded_vocab_size(hf, t.tp)} rows (a multiple of tp), "
                 f"{padded_vocab_size(hf, t.tp) // t.tp} per rank")
    head = f"  {'stage':>5} {'layers':>7} {'ranks':>9} {'params per rank':>28} {plan.dtype + ' per rank':>14}"
    head += "  of which experts" if experts else ""
    lines += [head, "  " + "-" * (len(head) - 2)]
    for s in plan.trainer_stages:
        row = (f"  {s.stage:>5} {f'{s.layers.start}-{s.layers.stop - 1}':>7} {_ranks(s.ranks):>9} {_b(s.params):>28} "
               f"{_gb(s.params * nb):>14}")
        lines.append(row + (f"  {_b(s.expert_params)}" if experts else ""))
    held = sum(plan.trainer_rank_params)
    lines += [f"  all ranks together: {_b(held)} = {held / plan.total_params:.2f}x the model (replicated norms"
              + (" and router" if experts else "") + ", data-parallel copies, vocabulary padding)",
              "  weights only: gradients and optimizer state come on top"]

    source = ("recorded from vLLM's own loaders (--needs recorded)" if plan.needs_source == "recorded"
              else "from the hand-written table of vLLM 0.32 layouts (--needs recorded: from vLLM's loaders)")
    if r.expert_parallel and plan.needs_source == "table":
        source += "; the table knows tensor-parallel experts only: the bytes per rank are the same with expert parallel"
    ep = ", expert parallel" if r.expert_parallel else ""
    lines += ["", f"rollout: {r.replicas} replica(s) x vLLM tp {r.tp}{ep}; one weight sync sends every vLLM rank "
                  f"exactly the HF blocks its weight loaders read, {source}"]
    head = f"  {'tp rank':>7} {'params':>28} {'bytes one sync sends it':>24}"
    lines += [head, "  " + "-" * (len(head) - 2)]
    for k, n in enumerate(plan.rollout_rank_params):
        lines.append(f"  {k:>7} {_b(n):>28} {n * nb:>24,}")
    per_rep, total, every = plan.sync_bytes_per_replica, plan.sync_bytes_total, cfg.sync.interval
    whole = "norms" + (" and the router" if experts else "") + " whole on every rank"
    if r.tp > kv_heads:
        whole += f", each KV head on {r.tp // kv_heads} ranks"
    lines += [
        f"  one replica: {_nbytes(per_rep)} = {per_rep / (plan.total_params * nb):.4f}x the model ({whole})",
        f"one sync, all {r.replicas} replica(s): {_nbytes(total)}",
        f"sync.interval={every}: " + (f"one sync every {every} optimizer steps, {_gb(total // every)} per step on "
                                      f"average ({_gb(total)} per step with sync.interval=1)"
                                      if every > 1 else f"one sync after every optimizer step, {_gb(total)} per step"),
    ]
    from megarl.trainer.layout_search import format_layout_search
    from megarl.trainer.memory_plan import format_trainer_memory

    return "\n".join(lines + format_trainer_memory(hf, cfg) + format_layout_search(hf, cfg)
                     + _push_memory_lines(plan, cfg, hf)
                     + _backend_comparison(hf, plan, link_gbps, t.world_size) + _delta_lines(plan, cfg, link_gbps,
                                                                                           t.world_size))


def _push_memory_lines(plan: Plan, cfg: Config, hf: dict[str, Any]) -> list[str]:
    """Each vLLM rank's memory during a push, per receive mode, against what vLLM leaves free on its GPU."""
    r, budget = cfg.rollout, push_budget(cfg)
    mode, why = receive_mode(cfg, hf, True, plan.dtype)
    lines = ["", f"push memory per vLLM rank beyond its served weights ({plan.dtype}; megarl.sync.receiver_memory): "
                 f"{BUCKETS_IN_FLIGHT_PER_SENDER} buckets of sync.bucket_mb={cfg.sync.bucket_mb:g} MiB in flight "
                 "per sender, the largest module vLLM's reload materialises, streamed: "
                 f"{LAYERS_ASSEMBLED_PER_STAGE} layers per trainer stage assembling; every mode's device column "
                 f"includes the sync group's NCCL memory (nccl: {NCCL_COMM_BYTES >> 20} MiB + "
                 f"{NCCL_PEER_BYTES >> 20} MiB per trainer rank, made at join; assumed, not measured)",
             f"  free beside vLLM: rollout.gpu_memory_gb={r.gpu_memory_gb:g} x (1 - rollout.gpu_memory_utilization="
             f"{r.gpu_memory_utilization:g}) - {_gb(CUDA_RESERVE_BYTES)} CUDA reserve = {_gb(max(budget, 0))} per GPU"]
    head = (f"  {'tp rank':>7} {'served':>9} {'senders':>7} {'in flight':>9} {'module':>8} {'nccl':>8} "
            f"{'staged dev':>10} "
            f"{'host':>9} {'streamed dev':>12} {'host':>6} {'legacy dev':>10}")
    lines += [head, "  " + "-" * (len(head) - 2)]
    for k, m in enumerate(plan.push_memory):
        lines.append(f"  {k:>7} {_gb(m.served):>9} {m.senders:>7} {_gb(m.in_flight):>9} {_gb(m.largest_module):>8} "
                     f"{_gb(m.group):>8} {_gb(m.device_extra('staged')):>10} {_gb(m.host_extra('staged')):>9} "
                     f"{_gb(m.device_extra('streamed')):>12} {_gb(m.host_extra('streamed')):>6} "
                     f"{_gb(m.legacy_device):>10}")
    worst = {md: max(m.device_extra(md) for m in plan.push_memory) for md in MODES}
    legacy = max(m.legacy_device for m in plan.push_memory)

    def verdict(nbytes: int) -> str:
        return f"{_gb(nbytes)} of {_gb(max(budget, 0))}: " + ("fits" if nbytes <= budget else "does NOT fit")

    lines += [f"  sync.receive={mode} ({'configured' if why == 'configured' else 'chosen by sync.receive=auto'}): "
              f"{verdict(worst[mode])}; " + "; ".join(f"{md}: {verdict(worst[md])}" for md in MODES if md != mode),
              f"  legacy (a second copy of the shard on the device): {verdict(legacy)}"]
    per_replica = {md: replica_host_bytes(plan.push_memory, md, cfg.sync.delta) for md in MODES}
    limit = r.replica_host_memory_gb
    lines += [f"  host memory per replica ({len(plan.push_memory)} vLLM ranks, {_gb(VLLM_HOST_BYTES_PER_RANK)} each "
              "for vLLM assumed" + (", + a delta base each" if cfg.sync.delta else "") + "): "
              + "; ".join(f"{md} {_gb(n)} (SLURM --mem >= {replica_host_mb(plan.push_memory, md, cfg.sync.delta)} "
                          "MB)" for md, n in per_replica.items())
              + (f"; rollout.replica_host_memory_gb={limit:g}" if limit is not None else ""),
              f"  sync.receive used: {mode} ({why})"]
    return lines


def _backend_comparison(hf: dict[str, Any], plan: Plan, link_gbps: float, trainer_ranks: int) -> list[str]:
    """Bytes per vLLM rank per sync for megarl and vLLM's own backends, and the seconds the busiest receiving
    link needs at `link_gbps` (a lower bound for each: it ignores the fixed costs and the senders' links)."""
    per_rank = bytes_per_vllm_rank(hf, len(plan.needs), plan.bytes_per_param, needs=plan.needs)
    lines = ["", f"compared with vLLM's own weight-transfer backends (megarl.sync.baselines), per vLLM rank per sync; "
                 f"seconds = the busiest receiving link's bytes at {link_gbps:g} GB/s (--link-gbps):"]
    notes = {"megarl": "each rank's own slices, sent by the trainer ranks that hold them",
             "nccl": "vLLM `nccl`: every tensor whole to every rank (broadcast from one trainer rank)",
             "nccl_m2n": "vLLM `nccl_m2n`: only o_proj / dense down_proj resharded, fused and expert weights whole"}
    for name, values in per_rank.items():
        most = max(values)
        lines.append(f"  {name:<9} {_gb(most):>10} per rank  {most / (link_gbps * GB):7.3f} s  {notes[name]}")
    each = sum(per_rank["megarl"]) * plan.replicas // trainer_ranks
    lines.append(f"  megarl's senders: the {trainer_ranks} trainer ranks share all {plan.replicas} replicas' bytes, "
                 f"about {_gb(each)} each = {each / (link_gbps * GB):.3f} s on their own links (the plan spreads "
                 "replicated blocks over their holders)")
    return lines


DELTA_FRACTIONS = (0.01, 0.03, 0.1, 0.3)  # changed fractions per sync to project (docs/sync.md: measured vs m)


def _delta_lines(plan: Plan, cfg: Config, link_gbps: float, trainer_ranks: int) -> list[str]:
    """What a delta push (`sync.delta`) would move per vLLM rank at a few changed fractions, and the host memory
    both ends keep for it."""
    from megarl.sync.delta_sizes import bytes_per_element

    most = max(plan.rollout_rank_params)
    full = most * plan.bytes_per_param
    on = "true" if cfg.sync.delta else "false"
    lines = ["", f"sync.delta={on}: bytes per vLLM rank per sync if this fraction of "
                 f"the elements changed since the previous push ({plan.dtype} bits; docs/sync.md measures it against "
                 f"sync.interval); seconds at {link_gbps:g} GB/s:"]
    for f in DELTA_FRACTIONS:
        nbytes = int(most * bytes_per_element(f, plan.bytes_per_param))
        lines.append(f"  {f:>5.0%} changed: {_gb(nbytes):>10} per rank  {nbytes / (link_gbps * GB):7.3f} s  "
                     f"{full / max(nbytes, 1):5.1f}x fewer bytes than the full push ({_gb(full)})")
    each = sum(plan.rollout_rank_params) * plan.bytes_per_param * plan.replicas // trainer_ranks
    lines.append(f"  host memory it keeps: each vLLM rank a copy of its slices ({_gb(full)}), each trainer rank a "
                 f"copy of the blocks it sends (about {_gb(each)})")
    return lines


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `plan` sub-command to the `megarl` CLI's sub-parsers."""
    p = subparsers.add_parser(
        "plan", help="parameters and bytes per trainer / rollout rank and per weight sync (no weights loaded)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML recipe, e.g. configs/qwen3_30b_a3b_guru.yaml")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                   help="bytes per parameter of the weights counted (default bf16)")
    p.add_argument("--link-gbps", type=float, default=50.0,
                   help="bandwidth of one vLLM rank's network link in GB/s for the sync seconds (default 50: one "
                   "400 Gb/s NIC per GPU)")
    p.add_argument("--needs", choices=("table", "recorded"), default="table",
                   help="where the vLLM ranks' blocks come from: the hand-written table (default, instant) or vLLM's "
                   "own loaders, recorded here once per layout (needs vLLM installed; see above)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. rollout.tp=8")
    return p


def run(args: argparse.Namespace) -> int:
    """Print the plan for `args.config`; 2 (with the reason on stderr) for a config that cannot run."""
    try:
        from megarl.launch import prepare

        # as `megarl check --gpu`: the layout is checked for the GPU job it plans (tiny checkpoints are made)
        cfg = prepare(args.config, args.overrides, create_run_dir=False, for_gpu=True, check_files=False)
        hf = read_hf_config(cfg.model.hf_dir)
        needs = recorded_needs(cfg, hf) if args.needs == "recorded" else None
        plan = make_plan(hf, cfg, args.dtype, needs)
    except ConfigError as err:
        print(f"megarl plan: {err}", file=sys.stderr)
        return 2
    print(f"megarl plan --config {args.config}" + "".join(f" {o}" for o in args.overrides))
    print(format_plan(plan, cfg, hf, args.link_gbps))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m megarl.plan_report")
    _args = register(_parser.add_subparsers(dest="command", required=True)).parse_args(sys.argv[1:])
    sys.exit(run(_args))
