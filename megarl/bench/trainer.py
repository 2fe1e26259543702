"""`megarl bench trainer`: one training step of the real trainer (`MegatronPolicy.train_step`: megatron-core's DDP,
its optimizer, forward + backward + Adam step) per `trainer.precision`, fp32 vs bf16, time and memory per rank, with
bf16 / fp32 ratios from the same run.

The model is a small random dense Qwen3 written here (`--hidden`, `--layers`, `--vocab`: by default 3.7 million
parameters, about a minute on 2 CPU cores, most of it bf16's steps); the ranks are `--world` gloo processes at data
parallel `--world` with megatron's distributed optimizer (`--no-distributed-optimizer`: without), so Adam's state
and the main parameters are sharded as in the recipes. Each rank takes one warm-up step (Adam's state is created
there), then `--steps` timed steps (the slowest rank's time per step; the median is reported) and one profiled step.

Memory, per rank (the largest over ranks):
  held        the storages the trained policy holds between steps, by what reaches them: DDP's fp32 gradient
              buffers, the model's parameters, the optimizer's main parameters (bf16: fp32 copies) and its Adam
              moments; next to it the plan's figure for the same terms (`megarl.trainer.memory_plan`);
  step peak   the highest rise of live torch allocations during one step above what was live at its start
              (activations, logits tiles, temporaries): on CPU from the allocation events of
              `torch.profiler.profile(profile_memory=True)` (torch has no CPU allocator statistics), on a GPU
              `torch.cuda.max_memory_allocated`;
  peak        held + step peak: what the rank needs at its peak;
  max RSS     cross-check: the process's resident-set high-water mark (`resource.getrusage`), which also holds
              torch, megatron and the interpreter (the same for both precisions, and monotonic over the run).

There is no "today's path vs megatron's" comparison: megarl's own optimizer and gradient path are gone, the trainer
trains through megatron-core's DDP and optimizer in both precisions. On a CPU bf16 matrix products are often
slower than fp32 ones (no bf16 units on many CPUs): the time ratio here says nothing about a GPU's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16")
# name -> the `MegatronPolicy` options of one row: each GPU-step change on (a row) against its base row (`bf16`)
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "bf16+compiled-logprob": {"precision": "bf16", "logprob_kernel": "compiled"},  # trainer.logprob_kernel
    "bf16+bf16-grads": {"precision": "bf16", "grad_reduce_in_bf16": True},  # trainer.grad_reduce_in_bf16
    "bf16+unfused-logprob": {"precision": "bf16", "fused_logprobs": False},  # the logits whole, for comparison
    "bf16+te": {"precision": "bf16", "layer_spec": "te"},  # Transformer Engine's spec and fusions (needs TE)
}
# dense bf16 / fp32 peak of the GPUs the recipes name, TFLOP/s (NVIDIA's data sheets; fp32 without TF32): MFU's base
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "fp32": 66.9}, "H200": {"bf16": 989.4, "fp32": 66.9}}


@dataclass(frozen=True)
class TrainerBenchConfig:
    hidden: int = 256
    layers: int = 2
    vocab: int = 4096
    seq: int = 128  # tokens per sequence
    rows: int = 8  # sequences per global batch
    micro: int = 2  # sequences per microbatch
    world: int = 2  # gloo ranks = data parallel
    distributed_optimizer: bool = True
    steps: int = 2
    seed: int = 0

    def hf_config(self) -> dict[str, Any]:
        heads = max(self.hidden // 64, 1)
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
                    num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
                    intermediate_size=3 * self.hidden, max_position_embeddings=max(self.seq, 128),
                    rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)


def write_checkpoint(cfg: TrainerBenchConfig, out: Path) -> Path:
    """A random dense Qwen3 of the config's size, as a Hugging Face checkpoint (config and safetensors)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    Qwen3ForCausalLM(Qwen3Config(**cfg.hf_config())).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def held_bytes(policy) -> dict[str, int]:
    """Bytes of the distinct storages a trained policy holds, by what reaches them first: DDP's gradient buffers,
    then the model's parameters (views into DDP's parameter buffer with the distributed optimizer), then the tensors
    the optimizer steps (the parameters themselves, or views of them, in fp32: already counted), then its state.
    What is counted is what was allocated (storage sizes, megatron's padding included), not the plan's formula:
    `tests/test_memory_plan.py` holds the plan against it."""
    held = {"grads": 0, "weights": 0, "main_params": 0, "optimizer": 0}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    ddp = policy.ddp_model
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        add("grads", buffer.grad_data)
    for p in policy.model.parameters():
        add("weights", p)
    for sub in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        if sub.optimizer is None:
            continue
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                add("main_params", p)
        for state in sub.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    add("optimizer", value)
    return held


def _microbatches(cfg: TrainerBenchConfig, rank: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(3, cfg.vocab, (cfg.rows, cfg.seq), generator=g)
    share = tokens[rank * cfg.rows // cfg.world:(rank + 1) * cfg.rows // cfg.world]
    return [{"tokens": share[i:i + cfg.micro], "targets": torch.roll(share[i:i + cfg.micro], -1, 1)}
            for i in range(0, len(share), cfg.micro)]


def _step_peak(policy, mbs, loss_fn) -> int:
    """One step; the highest rise of live allocations above the start (see the module docstring)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        policy.train_step(mbs, loss_fn, entropy_grad=False)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from megarl.bench.logprob import _peak_live_bytes

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        policy.train_step(mbs, loss_fn, entropy_grad=False)
    return _peak_live_bytes(prof)


def _rank_main(rank: int, port: int, hf_dir: Path, cfg: TrainerBenchConfig,
               variants: tuple[str, ...]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from megarl.config.schema import OptimizerConfig
    from megarl.models.hf_config import read_hf_config
    from megarl.models.layer_backend import TransformerEngineMissing, bench_layer_spec
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.trainer.policy import MegatronPolicy

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world))
    init_trainer_groups(TrainerLayout(), rank, cfg.world, "127.0.0.1", port)
    tokens_per_step = cfg.rows * cfg.seq

    def loss_fn(lp, ent, mb):
        return lp.sum() / tokens_per_step, {}

    out = []
    try:
        hf = read_hf_config(hf_dir)
        mbs = _microbatches(cfg, rank)
        for variant in variants:
            # a variant's own layer spec, else `auto`, or on a GPU without TE `local` (the row's `layer_spec` says)
            options = {"layer_spec": bench_layer_spec(torch.cuda.is_available(), VARIANTS[variant]["precision"]),
                       **VARIANTS[variant]}
            try:
                policy = MegatronPolicy(hf_dir, hf, OptimizerConfig(lr=1e-5),
                                        distributed_optimizer=cfg.distributed_optimizer and cfg.world > 1, **options)
            except TransformerEngineMissing as err:  # `bf16+te` where TE is missing: a row that says so
                out.append({"variant": variant, "precision": options["precision"], "rank": rank, "skipped": str(err)})
                continue
            policy.train_step(mbs, loss_fn, entropy_grad=False)  # warm-up: Adam creates its state here
            held = held_bytes(policy)
            times = []
            for _ in range(cfg.steps):
                dist.barrier()
                start = time.perf_counter()
                policy.train_step(mbs, loss_fn, entropy_grad=False)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            dist.barrier()
            peak = _step_peak(policy, mbs, loss_fn)
            out.append({"variant": variant, "precision": options["precision"], "layer_spec": policy.layer_spec,
                        "rank": rank, "times_s": times, "held": held,
                        "step_peak_bytes": peak,
                        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                        "params": sum(p.numel() for p in policy.model.parameters())})
            del policy
            gc.collect()
    finally:
        destroy_trainer_groups()
    return out


def step_flops(cfg: TrainerBenchConfig) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward): every matrix product's 2 x m x n x k
    over the step's tokens (attention projections, SwiGLU MLP, output layer; not the input embedding's lookup) plus
    causal attention's scores and weighted sum (half of `s x s` per head)."""
    hf = cfg.hf_config()
    h, heads, kv, d = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_token = hf["num_hidden_layers"] * (2 * h * (heads + 2 * kv) * d + 2 * heads * d * h  # q, k, v, o
                                           + 2 * 3 * h * hf["intermediate_size"]  # gate, up, down
                                           + 2 * 2 * heads * d * cfg.seq / 2)  # QK^T and PV, causal
    per_token += 2 * h * hf["vocab_size"]  # output layer
    return 3.0 * per_token * cfg.rows * cfg.seq


def peak_tflops(precision: str) -> float | None:
    """The GPU's dense peak for `precision` (`PEAK_TFLOPS`), None on a CPU or an unlisted GPU (no MFU then)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peaks[precision] for gpu, peaks in PEAK_TFLOPS.items() if gpu in name), None)


def planned_fixed_bytes(hf: dict[str, Any], cfg: TrainerBenchConfig, precision: str,
                        grad_reduce_in_bf16: bool = False) -> dict[str, int]:
    """The plan's weights, gradient buffers, main parameters and Adam moments per rank for the bench's layout."""
    from megarl.config.schema import Config, ModelConfig, RolloutConfig, TrainerConfig
    from megarl.trainer.memory_plan import trainer_memory

    trainer = TrainerConfig(world_size=cfg.world, precision=precision, grad_reduce_in_bf16=grad_reduce_in_bf16,
                            distributed_optimizer=cfg.distributed_optimizer and cfg.world > 1)
    rank = trainer_memory(hf, Config(model=ModelConfig(hf_dir="."), trainer=trainer,
                                     rollout=RolloutConfig(dtype="bfloat16")))[0]
    return {"weights": rank.weights, "grads": rank.grads, "main_params": rank.main_params,
            "optimizer": rank.optimizer}


def measure(cfg: TrainerBenchConfig, variants: tuple[str, ...] = PRECISIONS) -> list[dict[str, Any]]:
    """One row per variant (`VARIANTS`): the slowest rank's step time (median over steps), tokens per second and MFU,
    and the largest rank's memory; a variant this machine cannot build (TE missing) is a row with `skipped`."""
    from megarl.parallel.spawn import free_port, run_ranks

    if cfg.rows % (cfg.world * cfg.micro):
        raise ValueError(f"--rows {cfg.rows} must split into --world {cfg.world} x microbatches of --micro "
                         f"{cfg.micro}")
    with tempfile.TemporaryDirectory(prefix="megarl-bench-trainer-") as tmp:
        hf_dir = write_checkpoint(cfg, Path(tmp) / "model")
        per_rank = run_ranks(_rank_main, cfg.world, free_port(), hf_dir, cfg, variants)
    hf = cfg.hf_config()
    rows, skipped = [], []
    for i, variant in enumerate(variants):
        ranks = [r[i] for r in per_rank]
        precision = ranks[0]["precision"]
        if "skipped" in ranks[0]:
            skipped.append({"variant": variant, "precision": precision, "skipped": ranks[0]["skipped"]})
            continue
        step_times = [max(t) for t in zip(*(r["times_s"] for r in ranks), strict=True)]
        held = max((r["held"] for r in ranks), key=lambda h: sum(h.values()))
        peak = max(sum(r["held"].values()) + r["step_peak_bytes"] for r in ranks)
        step_s = statistics.median(step_times)
        peak_flops = peak_tflops(precision)
        rows.append({"variant": variant, "precision": precision, "layer_spec": ranks[0]["layer_spec"],
                     "params_per_rank": ranks[0]["params"],
                     "step_s": step_s, "step_times_s": step_times,
                     "tokens_per_s": cfg.rows * cfg.seq / step_s,
                     "mfu": step_flops(cfg) / step_s / (peak_flops * 1e12) if peak_flops else None,
                     "held": held, "held_bytes": sum(held.values()),
                     "planned": planned_fixed_bytes(hf, cfg, precision,
                                                    VARIANTS[variant].get("grad_reduce_in_bf16", False)),
                     "step_peak_bytes": max(r["step_peak_bytes"] for r in ranks), "peak_bytes": peak,
                     "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks)})
    base = rows[0]
    for row in rows:
        for key in ("step_s", "held_bytes", "step_peak_bytes", "peak_bytes"):
            row[f"{key}_vs_{base['variant']}"] = row[key] / base[key]
    return rows + skipped


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def format_table(cfg: TrainerBenchConfig, all_rows: list[dict[str, Any]]) -> str:
    rows = [r for r in all_rows if "skipped" not in r]
    base = rows[0]["variant"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"one training step (MegatronPolicy.train_step: megatron DDP + optimizer), dense Qwen3 hidden {cfg.hidden} x "
        f"{cfg.layers} layers, vocab {cfg.vocab}, {rows[0]['params_per_rank']:,} parameters; {cfg.rows} x {cfg.seq} "
        f"tokens per step over DP {cfg.world} (microbatches of {cfg.micro}), distributed optimizer "
        f"{'on' if cfg.distributed_optimizer and cfg.world > 1 else 'off'}; {device}; per rank, MiB",
        f"{'variant':<22} {'spec':<5} {'step s':>7} {'tok/s':>9} {'MFU':>5} {'weights':>8} {'grads':>7} "
        f"{'main':>7} {'Adam':>7} {'held':>7} {'(plan)':>7} {'step pk':>8} {'peak':>7} {'max RSS':>8} {'time x':>7} "
        f"{'peak x':>7}",
    ]
    for r in rows:
        h = r["held"]
        mfu = f"{r['mfu']:.0%}" if r.get("mfu") is not None else "-"
        lines.append(
            f"{r['variant']:<22} {r['layer_spec']:<5} {r['step_s']:>7.3f} {r['tokens_per_s']:>9,.0f} {mfu:>5} "
            f"{_mib(h['weights']):>8} {_mib(h['grads']):>7} "
            f"{_mib(h['main_params']):>7} {_mib(h['optimizer']):>7} {_mib(r['held_bytes']):>7} "
            f"{_mib(sum(r['planned'].values())):>7} {_mib(r['step_peak_bytes']):>8} {_mib(r['peak_bytes']):>7} "
            f"{_mib(r['max_rss_bytes']):>8} {r[f'step_s_vs_{base}']:>7.2f} {r[f'peak_bytes_vs_{base}']:>7.2f}")
    lines += [f"{r['variant']:<22} not run: {r['skipped']}" for r in all_rows if "skipped" in r]
    lines.append(f"time x / peak x: against {base} in this run; MFU: model FLOPs (step_flops) over the GPU's dense "
                 f"peak (PEAK_TFLOPS), '-' on a CPU. held: storages the policy keeps between steps "
                 "(plan: megarl.trainer.memory_plan's same terms); step pk: rise of live allocations during a step; "
                 "peak = held + step pk; max RSS includes torch and megatron themselves. No megarl-vs-megatron "
                 "column: the trainer's only path is megatron-core's.")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "skipped" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(rows)), 3.6))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["step_s"] for r in rows])
    axes[0].set_ylabel("one training step (s, slowest rank)")
    bottom = [0.0] * len(rows)
    for key, label in (("weights", "weights"), ("grads", "grad buffers"), ("main_params", "main params"),
                       ("optimizer", "Adam"), (None, "step peak")):
        ys = [(r["held"][key] if key else r["step_peak_bytes"]) / 2**20 for r in rows]
        axes[1].bar(names, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    axes[1].set_ylabel("per rank at its peak (MiB)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("megarl bench trainer: one step per variant (megatron DDP + distributed optimizer)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("trainer", help="one training step per trainer.precision: time and memory per rank",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainerBenchConfig()
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    p.add_argument("--rows", type=int, default=d.rows, help="sequences per global batch")
    p.add_argument("--micro", type=int, default=d.micro, help="sequences per microbatch")
    p.add_argument("--world", type=int, default=d.world, help="gloo ranks (data parallel)")
    p.add_argument("--no-distributed-optimizer", action="store_true", help="megatron's unsharded optimizer")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps after one warm-up step")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(PRECISIONS),
                   help="rows: a precision, or bf16 with one change on (VARIANTS in megarl/bench/trainer.py); the "
                   "first is the base of the ratios")
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench_trainer.json"),
                   help="JSON output; a bar chart goes next to it (.png)")
    return p


def run(args: argparse.Namespace) -> int:
    cfg = TrainerBenchConfig(hidden=args.hidden, layers=args.layers, vocab=args.vocab, seq=args.seq, rows=args.rows,
                             micro=args.micro, world=args.world,
                             distributed_optimizer=not args.no_distributed_optimizer, steps=args.steps)
    try:
        rows = measure(cfg, tuple(args.variants))
    except ValueError as err:
        print(f"megarl bench trainer: {err}", file=sys.stderr)
        return 2
    print(format_table(cfg, rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    args.out.write_text(json.dumps({"benchmark": "megarl bench trainer", "config": asdict(cfg), "machine": machine,
                                    "rows": rows}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0
