"""`megarl bench logprob`: peak memory and time, per tensor-parallel rank, of three ways to get per-token
log-probs of the target tokens and the exact entropy from vocabulary-sharded logits, forward + backward.

    sharded   megarl's `vocab_parallel_logprobs_entropy`: softmax statistics reduced over the TP group,
              chunked over tokens, nothing the size of the full vocabulary on any rank.
    gathered  megatron's `gather_from_tensor_model_parallel_region` (all_gather of the shards into
              `[tokens, V]`; backward keeps this rank's slice), then dense `torch.log_softmax` and
              `-(p * log p).sum(-1)`.
    megatron  megatron-core's `vocab_parallel_cross_entropy` (-log p(y)) plus a separate entropy over the
              shard (`_ShardEntropy`: one extra all_gather, see there).

The logits are the input (no hidden -> logits matmul): every rank gets its `[tokens, V/tp]` shard and the
loss `sum(w_lp * logp + w_ent * entropy)` (random per-token weights) is back-propagated into it.

How it is measured. Each (method, TP) case runs in a fresh group of TP processes (spawned, gloo, megatron's
parallel_state initialised), and each rank reports:
  peak alloc  the highest total of live torch CPU allocations during one forward + backward, counted from
              its start, so the inputs built before (the logits shard, targets, weights, a pristine copy)
              are not counted and everything the method allocates is (gradient included). Read from the
              allocation events of `torch.profiler.profile(profile_memory=True)` (size and time of every
              c10 CPU allocation and free on the measuring thread; buffers gloo allocates inside its own
              threads are not seen, the RSS column covers them).
  peak RSS    cross-check: rise of the process's resident-set high-water mark (VmHWM, reset through
              /proc/self/clear_refs right before) over its RSS at the start, on an unprofiled pass.
  time        one forward + backward, unprofiled, slowest rank; the median over the repeats (the RSS
              pass is the warm-up).
The table gives the maximum over ranks and ratios to `sharded` measured in the same run. The logits are
drawn tile by tile from the seed, so every TP sees the same numbers, and a float64 reference computed
here checks every method's log-probs, entropies and gradients; a method out of tolerance fails the run
before anything is written.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.bench import output_logprob
from megarl.bench.logprob_methods import METHOD_FNS as _METHOD_FNS
from megarl.parallel.spawn import free_port, run_ranks

METHODS = ("sharded", "gathered", "megatron")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# A method fails the run if its values or gradients are further than this from the float64 reference.
# Values: the methods reduce ~1e5 fp32 terms per token (errors ~1e-5); a wrong formula is off by O(1).
# Gradients: relative (Frobenius) error, target and non-target entries separately; bf16 gradients are
# rounded to 8 mantissa bits when written back into the logits' dtype.
VALUE_TOL = 1e-3
GRAD_REL_TOL = {"float32": 1e-4, "bfloat16": 1e-2}
_ROWS = 64  # tokens per generated tile and per reference step
_LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2): a peaked softmax, as language models have


@dataclass(frozen=True)
class LogprobBenchConfig:
    vocab: int = 151_936  # Qwen2.5 / Qwen3 padded vocabulary
    tokens: int = 1024
    dtype: str = "float32"  # of the logits; all methods do the softmax math in fp32
    chunk_tokens: int = 256  # megarl's token chunk (the sharded method's temporaries are chunk x V/tp)
    repeats: int = 3
    seed: int = 0


@dataclass
class BenchResult:
    config: LogprobBenchConfig
    records: list[dict[str, Any]]  # one per (method, tp)
    # rank 0's per-token (logp, entropy) for each (method, tp): every rank returns the full values
    values: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


class BenchCheckError(RuntimeError):
    """A method's log-probs, entropies or gradients disagree with the float64 reference."""


# ---------------------------------------------------------------------------------------------- inputs


def _row_tile(cfg: LogprobBenchConfig, tile: int) -> torch.Tensor:
    """Logits of tokens `[tile*64, tile*64 + 64)` over the whole vocabulary, in cfg's dtype, from their own
    generator: a rank builds its shard tile by tile, never holding a full `[tokens, V]` tensor."""
    rows = min(_ROWS, cfg.tokens - tile * _ROWS)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + tile)
    return (torch.randn(rows, cfg.vocab, generator=g) * _LOGIT_SCALE).to(DTYPES[cfg.dtype])


def logits_shard(cfg: LogprobBenchConfig, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s vocabulary slice `[tokens, V/tp]` of the benchmark logits (tp=1: the full logits)."""
    width = cfg.vocab // tp
    out = torch.empty(cfg.tokens, width, dtype=DTYPES[cfg.dtype])
    for tile in range(math.ceil(cfg.tokens / _ROWS)):
        out[tile * _ROWS:(tile + 1) * _ROWS] = _row_tile(cfg, tile)[:, rank * width:(rank + 1) * width]
    return out


def targets_and_weights(cfg: LogprobBenchConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target token ids `[tokens]` and the loss weights of logp and entropy per token `[tokens]`."""
    g = torch.Generator().manual_seed(cfg.seed + 7)
    targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=g)
    return targets, torch.randn(cfg.tokens, generator=g), torch.randn(cfg.tokens, generator=g)


def reference_stats(cfg: LogprobBenchConfig) -> dict[str, torch.Tensor]:
    """float64, per token, 64 tokens at a time: log Z = logsumexp(z), E_p[z], log p(y) and entropy."""
    targets, _, _ = targets_and_weights(cfg)
    parts: dict[str, list[torch.Tensor]] = {"log_z": [], "mean_z": [], "logp": [], "entropy": []}
    for tile in range(math.ceil(cfg.tokens / _ROWS)):
        z = _row_tile(cfg, tile).double()
        log_z = torch.logsumexp(z, dim=-1)
        mean_z = ((z - log_z[:, None]).exp() * z).sum(-1)
        parts["log_z"].append(log_z)
        parts["mean_z"].append(mean_z)
        parts["logp"].append(z.gather(-1, targets[tile * _ROWS:(tile + 1) * _ROWS, None]).squeeze(-1) - log_z)
        parts["entropy"].append(log_z - mean_z)
    return {k: torch.cat(v) for k, v in parts.items()}


# ----------------------------------------------------------------------------------------- measurement


def _peak_live_bytes(prof: torch.profiler.profile) -> int:
    """Highest running total of the profiler's CPU allocation events (+size on malloc, -size on free)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        live += size
        peak = max(peak, live)
    return peak


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); the RSS in bytes, or None."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _proc_status_kib("VmRSS")
    return None if rss is None else rss * 1024


def _grad_rel_err(grad: torch.Tensor, shard: torch.Tensor, start: int, targets: torch.Tensor,
                  w_lp: torch.Tensor, w_ent: torch.Tensor, ref: dict[str, torch.Tensor]) -> float:
    """Relative Frobenius error of the shard's gradient against float64
    dL/dz_k = w_lp (1[k=y] - p_k) + w_ent p_k (E_p[z] - z_k), the target entries and the others separately
    (the target entries are ~1, the others ~1/V: one norm would hide errors in the entropy term)."""
    sq = {"d_on": 0.0, "r_on": 0.0, "d_off": 0.0, "r_off": 0.0}
    for lo in range(0, shard.shape[0], _ROWS):
        rows = slice(lo, lo + _ROWS)
        z = shard[rows].double()
        p = (z - ref["log_z"][rows, None]).exp()
        g_ref = p * (w_ent[rows, None].double() * (ref["mean_z"][rows, None] - z) - w_lp[rows, None].double())
        local = targets[rows] - start
        tok = ((local >= 0) & (local < shard.shape[1])).nonzero().squeeze(-1)
        g_ref[tok, local[tok]] += w_lp[rows][tok].double()
        diff = grad[rows].double() - g_ref
        sq["d_on"] += diff[tok, local[tok]].square().sum().item()
        sq["r_on"] += g_ref[tok, local[tok]].square().sum().item()
        diff[tok, local[tok]] = 0.0
        g_ref[tok, local[tok]] = 0.0
        sq["d_off"] += diff.square().sum().item()
        sq["r_off"] += g_ref.square().sum().item()
    on = math.sqrt(sq["d_on"] / sq["r_on"]) if sq["r_on"] > 0 else 0.0
    return max(on, math.sqrt(sq["d_off"] / sq["r_off"]))


def _measure_method(method: str, cfg: LogprobBenchConfig, rank: int, group: dist.ProcessGroup,
                    pristine: torch.Tensor, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One rank's numbers for one method: RSS pass (warm-up), profiled pass (peak, checks), timed repeats."""
    fn = _METHOD_FNS[method]
    targets, w_lp, w_ent = targets_and_weights(cfg)

    def forward_backward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = fn(x, targets, group, cfg.chunk_tokens)
        (logp * w_lp + entropy * w_ent).sum().backward()
        return logp.detach(), entropy.detach()

    x = pristine.clone().requires_grad_(True)
    gc.collect()
    rss0 = _reset_peak_rss()
    forward_backward(x)
    hwm = _proc_status_kib("VmHWM")
    peak_rss = None if rss0 is None or hwm is None else hwm * 1024 - rss0
    del x

    x = pristine.clone().requires_grad_(True)  # megatron overwrites fp32 logits: a fresh copy per pass
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, entropy = forward_backward(x)
    peak_alloc = _peak_live_bytes(prof)
    grad_err = _grad_rel_err(x.grad, pristine, rank * pristine.shape[1], targets, w_lp, w_ent, ref)
    del x, prof

    times = []
    for _ in range(cfg.repeats):
        x = pristine.clone().requires_grad_(True)
        dist.barrier(group)
        t0 = time.perf_counter()
        forward_backward(x)
        times.append(time.perf_counter() - t0)
        del x
    return {
        "peak_alloc_bytes": peak_alloc, "peak_rss_bytes": peak_rss, "times_s": times,
        "max_abs_err_logp": (logp.double() - ref["logp"]).abs().max().item(),
        "max_abs_err_entropy": (entropy.double() - ref["entropy"]).abs().max().item(),
        "grad_rel_err": grad_err, "logp": logp, "entropy": entropy,
    }


def _rank_main(rank: int, tp: int, port: int, cfg: LogprobBenchConfig, methods: tuple[str, ...],
               ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Entry of one spawned rank: join the group, build this rank's shard, measure; the results go back."""
    from megatron.core import parallel_state

    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups

    apply_trainer_cpu_threads(0, tp, 0)  # the cores are split between the ranks (more threads only add contention)
    init_trainer_groups(TrainerLayout(tp=tp), rank, tp, "127.0.0.1", port)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        pristine = logits_shard(cfg, tp, rank)
        return {m: _measure_method(m, cfg, rank, group, pristine, ref) for m in methods}
    finally:
        destroy_trainer_groups()


def _spawn_ranks(tp: int, cfg: LogprobBenchConfig, methods: tuple[str, ...],
                 ref: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Run `methods` in a fresh group of `tp` processes; per-rank results, or the first rank's failure as a
    `RankError` ("benchmark rank 1 failed: killed by SIGKILL (sharded, TP=2)"; SIGKILL: out of memory?)."""
    return run_ranks(_rank_main, tp, tp, free_port(), cfg, methods, ref, role="benchmark",
                     hint=f"{'/'.join(methods)}, TP={tp}")


def _check_config(cfg: LogprobBenchConfig, tps: list[int]) -> None:
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype {cfg.dtype}: use one of {', '.join(DTYPES)}")
    for name, value in (("tokens", cfg.tokens), ("chunk-tokens", cfg.chunk_tokens), ("repeats", cfg.repeats)):
        if value < 1:
            raise ValueError(f"--{name} {value}: must be at least 1")
    bad = [tp for tp in tps if tp < 1 or cfg.vocab % tp]
    if bad:
        raise ValueError(f"--tp {' '.join(map(str, bad))}: every TP size must divide --vocab {cfg.vocab}")


def measure(cfg: LogprobBenchConfig, tps: list[int], methods: tuple[str, ...] = METHODS,
            fresh_processes: bool = True, progress: bool = True) -> BenchResult:
    """Measure every (method, tp) and check it against the float64 reference. `fresh_processes=False` runs
    all methods of one TP in one group of processes (faster to start; the profiler peak does not depend on
    it, the RSS column may, since freed heap can be reused). Raises `BenchCheckError` if any method's values
    or gradients are out of tolerance."""
    from tqdm import tqdm

    _check_config(cfg, tps)
    ref = reference_stats(cfg)
    jobs = [(tp, (m,)) for tp in tps for m in methods] if fresh_processes else [(tp, tuple(methods)) for tp in tps]
    records, values = [], {}
    for tp, ms in tqdm(jobs, desc="bench logprob", unit="case", disable=not progress):
        per_rank = _spawn_ranks(tp, cfg, ms, ref)
        for m in ms:
            ranks = [r[m] for r in per_rank]
            values[m, tp] = (ranks[0]["logp"], ranks[0]["entropy"])
            rss = [r["peak_rss_bytes"] for r in ranks]
            records.append({
                "method": m, "tp": tp,
                "peak_alloc_bytes": max(r["peak_alloc_bytes"] for r in ranks),
                "peak_alloc_bytes_per_rank": [r["peak_alloc_bytes"] for r in ranks],
                "peak_rss_bytes": None if None in rss else max(rss),
                # a step takes as long as its slowest rank
                "time_s": statistics.median(max(ts) for ts in zip(*(r["times_s"] for r in ranks), strict=True)),
                "times_s_per_rank": [r["times_s"] for r in ranks],
                "max_abs_err_logp": max(r["max_abs_err_logp"] for r in ranks),
                "max_abs_err_entropy": max(r["max_abs_err_entropy"] for r in ranks),
                "grad_rel_err": max(r["grad_rel_err"] for r in ranks),
            })
    _add_comparisons(records, values)
    failures = [f"{r['method']} TP={r['tp']}: |dlogp| {r['max_abs_err_logp']:.2e}, |dH| "
                f"{r['max_abs_err_entropy']:.2e}, grad rel err {r['grad_rel_err']:.2e}" for r in records
                if max(r["max_abs_err_logp"], r["max_abs_err_entropy"]) > VALUE_TOL
                or not r["grad_rel_err"] <= GRAD_REL_TOL[cfg.dtype]]
    if failures:
        raise BenchCheckError("methods disagree with the float64 reference (tolerance: values "
                              f"{VALUE_TOL:g}, gradients {GRAD_REL_TOL[cfg.dtype]:g}):\n  " + "\n  ".join(failures))
    return BenchResult(cfg, records, values)


def _add_comparisons(records: list[dict[str, Any]], values: dict) -> None:
    """Ratios to `sharded` at the same TP and the largest value difference from it, when it ran."""
    for r in records:
        base = next((b for b in records if b["method"] == "sharded" and b["tp"] == r["tp"]), None)
        if base is None:
            continue
        r["peak_vs_sharded"] = r["peak_alloc_bytes"] / max(base["peak_alloc_bytes"], 1)
        r["time_vs_sharded"] = r["time_s"] / base["time_s"]
        (lp, ent), (lp_s, ent_s) = values[r["method"], r["tp"]], values["sharded", r["tp"]]
        r["max_abs_diff_vs_sharded_logp"] = (lp - lp_s).abs().max().item()
        r["max_abs_diff_vs_sharded_entropy"] = (ent - ent_s).abs().max().item()


# ----------------------------------------------------------------------------------------------- report


def format_table(result: BenchResult) -> str:
    cfg, mib = result.config, 2**20
    full = cfg.tokens * cfg.vocab * 4
    lines = [
        f"vocab {cfg.vocab:,} x {cfg.tokens:,} tokens, {cfg.dtype} logits, chunk {cfg.chunk_tokens} tokens, "
        f"{cfg.repeats} timed repeats; {os.cpu_count()} CPU cores split between the ranks",
        f"per rank (max over ranks), forward + backward; a full [tokens, V] fp32 tensor is {full / mib:,.1f} MiB",
        f"{'TP':>2} {'method':<9} {'peak alloc MiB':>14} {'x sharded':>9} {'peak RSS MiB':>12} {'time ms':>9} "
        f"{'x sharded':>9} {'|dlogp| ref':>11} {'|dH| ref':>9} {'grad err':>9} {'vs sharded':>10}",
    ]
    for r in result.records:
        rss = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / mib:,.1f}"
        diff = max(r.get("max_abs_diff_vs_sharded_logp", 0.0), r.get("max_abs_diff_vs_sharded_entropy", 0.0))
        lines.append(
            f"{r['tp']:>2} {r['method']:<9} {r['peak_alloc_bytes'] / mib:>14,.1f} {r.get('peak_vs_sharded', 0):>9.2f} "
            f"{rss:>12} {r['time_s'] * 1e3:>9,.0f} {r.get('time_vs_sharded', 0):>9.2f} "
            f"{r['max_abs_err_logp']:>11.1e} {r['max_abs_err_entropy']:>9.1e} {r['grad_rel_err']:>9.1e} {diff:>10.1e}")
    lines.append("|dlogp| ref, |dH| ref: max abs error vs float64; grad err: relative, vs float64; "
                 "vs sharded: max abs difference of logp and H from the sharded method")
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict[str, Any]:
    import megatron.core

    cfg = result.config
    return {
        "benchmark": "megarl bench logprob",
        "config": asdict(cfg),
        "full_vocab_fp32_bytes": cfg.tokens * cfg.vocab * 4,
        "logits_shard_bytes": {str(r["tp"]): cfg.tokens * cfg.vocab // r["tp"] * DTYPES[cfg.dtype].itemsize
                               for r in result.records},
        "memory": "peak_alloc_bytes: highest total of live torch CPU allocations during one forward+backward "
                  "(torch.profiler allocation events), over what was allocated before it started (inputs); "
                  "peak_rss_bytes: rise of VmHWM over VmRSS at the start of an unprofiled pass",
        "time": "median over repeats of the slowest rank's forward+backward seconds",
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "megatron_core": getattr(megatron.core, "__version__", "unknown")},
        "records": result.records,
    }


def plot(result: BenchResult, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({r["tp"] for r in result.records})
    methods = [m for m in METHODS if any(r["method"] == m for r in result.records)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, scale, label in ((axes[0], "peak_alloc_bytes", 2**-20, "peak alloc per rank (MiB)"),
                                  (axes[1], "time_s", 1e3, "forward + backward (ms, slowest rank)")):
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = [next((r[key] * scale for r in result.records if r["method"] == m and r["tp"] == tp), 0)
                  for tp in tps]
            ax.bar([j + i * width for j in range(len(tps))], ys, width, label=m)
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(tps))], [f"TP={tp}" for tp in tps])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    cfg = result.config
    fig.suptitle(f"log-prob + entropy, vocab {cfg.vocab:,} x {cfg.tokens:,} tokens, {cfg.dtype}, "
                 f"chunk {cfg.chunk_tokens}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `logprob` sub-command to a `bench` sub-parsers object; `run(args)` executes it."""
    p = subparsers.add_parser(
        "logprob", help="peak memory and time of sharded vs gathered vs megatron log-prob + entropy",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LogprobBenchConfig()
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default: Qwen's 151936)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (rows of the logits)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel sizes")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="dtype of the logits")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens, help="megarl's token chunk size")
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed forward+backward passes")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default docs/figures/bench_logprob.json, with --hidden "
                   "docs/figures/bench_output_logprob.json); from the logits a bar chart goes next to it (.png)")
    output_logprob.add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.hidden or args.merge:  # from the hidden states through the output layer (megarl.bench.output_logprob)
        args.out = args.out or Path("docs/figures/bench_output_logprob.json")
        return output_logprob.run(args)
    args.out = args.out or Path("docs/figures/bench_logprob.json")
    cfg = LogprobBenchConfig(vocab=args.vocab, tokens=args.tokens, dtype=args.dtype,
                             chunk_tokens=args.chunk_tokens, repeats=args.repeats)
    try:
        result = measure(cfg, list(args.tp))
    except (ValueError, BenchCheckError) as err:
        print(f"megarl bench logprob: {err}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(result), indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.bench.logprob")
    register(parser.add_subparsers(dest="bench", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    # run the functions of the importable module, so that spawned ranks can find them by name
    from megarl.bench import logprob

    sys.exit(logprob._main())
