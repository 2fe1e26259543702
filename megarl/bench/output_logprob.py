"""`megarl bench logprob --hidden H ...` (`--merge` joins earlier runs' JSON files): peak memory and time per
tensor-parallel rank of the output layer plus the per-token log-prob and entropy, forward + backward, from the
last stage's hidden states to the gradients of the hidden states and of the output weight:

    fused     megarl's `fused_output_logprobs_entropy` (on by default in `MegatronPolicy`): the projection and the
              vocab-parallel log-prob + entropy tile by tile (`--chunk-tokens` tokens by `--vocab-block` rows of
              the shard); the backward recomputes a tile's logits, so no `[tokens, V/tp]` tensor exists.
    unfused   the output layer as megatron's `ColumnParallelLinear` computes it (`copy_to_tensor_model_parallel_
              region`, then `hidden @ W^T`: the whole `[tokens, V/tp]` logits), then megarl's
              `vocab_parallel_logprobs_entropy` over them (megarl's path before the fusion).
    megatron  the same logits, then megatron-core's `vocab_parallel_cross_entropy` for -log p(y) and the shard
              entropy of `megarl.bench.logprob` (megatron has none).

Inputs: hidden `[tokens, h]` and the weight shard `[V/tp, h]` drawn from the seed in tiles of 64 vocabulary rows
(every TP sees the same matrix), logits ~ N(0, 3^2); the loss is `sum(w_lp * logp + w_ent * entropy)` with random
per-token weights. Each (method, tokens, TP) runs in a fresh group of TP processes; the inputs are built before
the measurement, so they are not counted. Peak memory is what one forward + backward adds on top of them: on a
GPU `torch.cuda.max_memory_allocated` over `memory_allocated` before; on CPU the rise of the resident-set high-water
mark (VmHWM, reset through /proc/self/clear_refs) over the resident set before, glibc mapping every buffer
above 1 MiB on its own so a freed buffer leaves the resident set (`megarl.sync.peak_memory`). Time: the slowest
rank's forward + backward, the median over `--repeats` passes (the first pass is the memory pass).

Cases too big for the machine are projected, not run: `--measure-up-to N` runs only token counts <= N, and
a case whose estimated memory (`estimated_bytes`, summed over the TP ranks) is above `--max-gb` is skipped; a
skipped case is projected from the measured cases of the same method, TP and hidden size (`_project`: memory
affine in tokens, the fused method's line starting at its largest measured case with the slope of what grows with
tokens; time in proportion to tokens), marked `"measured": false`. Every method's log-probs, entropies and gradient
probes (`dL/dh @ r`, `dL/dW @ r` for a fixed random `r`) must agree with the unfused method's in the same
(tokens, TP, hidden) case, or the run fails before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.parallel.fused_output_logprobs import KERNELS
from megarl.parallel.spawn import free_port, run_ranks

METHODS = ("fused", "unfused", "megatron")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TILE = 64  # vocabulary rows per generated weight tile (divides 151,936 / tp for tp in 1, 2, 4)
_LOGIT_SCALE = 3.0
# agreement with the unfused method: values (fp32 math in every method) and relative gradient-probe error
VALUE_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
GRAD_REL_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@dataclass(frozen=True)
class OutputBenchConfig:
    vocab: int = 151_936
    hidden: int = 2048
    tokens: int = 4096
    dtype: str = "float32"  # of the hidden states and the output weight (the softmax math is fp32 in all methods)
    chunk_tokens: int = 1024  # the fused and unfused methods' token chunk
    vocab_block: int | None = None  # the fused method's rows of the shard per tile (None: the whole shard)
    kernel: str = "eager"  # the fused method's tile kernels: "eager" or "compiled" (torch.compile)
    repeats: int = 1
    seed: int = 0


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- inputs


def weight_shard(cfg: OutputBenchConfig, tp: int, rank: int) -> torch.Tensor:
    """Rows `[rank V/tp, (rank+1) V/tp)` of the output weight `[V, h]`, tile by tile from the seed."""
    width = cfg.vocab // tp
    out = torch.empty(width, cfg.hidden, dtype=DTYPES[cfg.dtype])
    scale = _LOGIT_SCALE / math.sqrt(cfg.hidden)
    for i, row in enumerate(range(rank * width, (rank + 1) * width, _TILE)):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + row // _TILE)
        out[i * _TILE : (i + 1) * _TILE] = torch.randn(_TILE, cfg.hidden, generator=g) * scale
    return out


def hidden_targets_weights(cfg: OutputBenchConfig) -> tuple[torch.Tensor, ...]:
    """hidden `[tokens, h]`, targets `[tokens]`, loss weights of logp and entropy `[tokens]`, probe `r [h]`."""
    g = torch.Generator().manual_seed(cfg.seed + 11)
    hidden = torch.randn(cfg.tokens, cfg.hidden, generator=g).to(DTYPES[cfg.dtype])
    targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=g)
    return (
        hidden,
        targets,
        torch.randn(cfg.tokens, generator=g),
        torch.randn(cfg.tokens, generator=g),
        torch.randn(cfg.hidden, generator=g, dtype=torch.float64),
    )


def estimated_bytes(method: str, cfg: OutputBenchConfig, tp: int) -> int:
    """A rough upper estimate of one rank's peak (to decide what may run here): the logits and their gradient in
    the input dtype, fp32 working copies (megatron: its saved softmax and the shard entropy's), the weight
    gradient; fused: a few `chunk x block` fp32 buffers, the weight gradient and an fp32 block accumulator, dL/dh
    (and its fp32 accumulator when there are several blocks)."""
    width, isz = cfg.vocab // tp, DTYPES[cfg.dtype].itemsize
    weight_grad = width * cfg.hidden * 4
    if method == "fused":
        block = min(cfg.vocab_block or width, width)
        return (4 * min(cfg.chunk_tokens, cfg.tokens) * block * 4 + weight_grad + block * cfg.hidden * 4
                + cfg.tokens * cfg.hidden * 8)
    logits = cfg.tokens * width
    extra = 2 * logits * 4 if method == "megatron" else min(cfg.chunk_tokens, cfg.tokens) * width * 12
    return 2 * logits * isz + extra + 2 * weight_grad


# --------------------------------------------------------------------------------------------- methods


def _logits(hidden: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """ColumnParallelLinear without bias and without gathering its output: identity forward, dL/dh all-reduced
    over the TP group in backward."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return torch.matmul(copy_to_tensor_model_parallel_region(hidden, group=group), weight.t())


def fused(hidden, weight, targets, group, cfg: OutputBenchConfig):
    from megarl.parallel.fused_output_logprobs import fused_output_logprobs_entropy

    return fused_output_logprobs_entropy(hidden, weight, targets, group, cfg.chunk_tokens,
                                         vocab_block=cfg.vocab_block, kernel=cfg.kernel)


def unfused(hidden, weight, targets, group, cfg: OutputBenchConfig):
    from megarl.parallel.vocab_logprobs import vocab_parallel_logprobs_entropy

    return vocab_parallel_logprobs_entropy(_logits(hidden, weight, group), targets, group, cfg.chunk_tokens)


def megatron(hidden, weight, targets, group, cfg: OutputBenchConfig):
    from megarl.bench.logprob_methods import megatron_logprobs_entropy

    return megatron_logprobs_entropy(_logits(hidden, weight, group), targets, group, cfg.chunk_tokens)


_METHOD_FNS = {"fused": fused, "unfused": unfused, "megatron": megatron}


# ----------------------------------------------------------------------------------------- measurement


def _rank_main(rank: int, tp: int, port: int, cfg: OutputBenchConfig, method: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megarl.parallel.cpu_threads import apply_trainer_cpu_threads
    from megarl.parallel.groups import TrainerLayout, destroy_trainer_groups, init_trainer_groups
    from megarl.sync.peak_memory import PeakMemory

    apply_trainer_cpu_threads(0, tp, 0)
    init_trainer_groups(TrainerLayout(tp=tp), rank, tp, "127.0.0.1", port)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        dev = device()
        hidden, targets, w_lp, w_ent, probe = (t.to(dev) for t in hidden_targets_weights(cfg))
        weight = weight_shard(cfg, tp, rank).to(dev).requires_grad_(True)
        fn = _METHOD_FNS[method]
        if method == "fused" and cfg.kernel == "compiled":  # compile outside the measurement, on these shapes
            fn(hidden.clone().requires_grad_(True), weight, targets, group, cfg)[0].sum().backward()
        memory, times = None, []
        for i in range(max(cfg.repeats, 1)):
            h = hidden.clone().requires_grad_(True)
            weight.grad = None
            dist.barrier(group)
            if i == 0:
                memory = PeakMemory.start(dev.type == "cuda")
            t0 = time.perf_counter()
            logp, entropy = fn(h, weight, targets, group, cfg)
            (logp * w_lp + entropy * w_ent).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if i == 0:
                report = memory.finish()
        peak = report["memory_peak_bytes"]
        peak = None if peak is None else peak - report["memory_before_bytes"]
        return {
            "peak_bytes": peak,
            "memory_measured": report["memory_measured"],
            "times_s": times,
            "logp": logp.detach().cpu(),
            "entropy": entropy.detach().cpu(),
            "grad_h_probe": h.grad.double().cpu() @ probe.cpu(),
            "grad_w_probe": weight.grad.double().cpu() @ probe.cpu(),
        }
    finally:
        destroy_trainer_groups()


def _case(method: str, cfg: OutputBenchConfig, tp: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    per_rank = run_ranks(
        _rank_main,
        tp,
        tp,
        free_port(),
        cfg,
        method,
        role="benchmark",
        hint=f"{method}, {cfg.tokens} tokens, hidden {cfg.hidden}, TP={tp}",
    )
    record = {
        "method": method,
        "tp": tp,
        "tokens": cfg.tokens,
        "hidden": cfg.hidden,
        "measured": True,
        "memory_measured": per_rank[0]["memory_measured"],
        "peak_bytes": max(r["peak_bytes"] or 0 for r in per_rank),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "time_s": statistics.median(max(ts) for ts in zip(*(r["times_s"] for r in per_rank), strict=True)),
    }
    probes = {
        "logp": per_rank[0]["logp"],
        "entropy": per_rank[0]["entropy"],
        "grad_h_probe": per_rank[0]["grad_h_probe"],
        "grad_w_probe": torch.cat([r["grad_w_probe"] for r in per_rank]),
    }
    return record, probes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _project(records: list[dict[str, Any]], cfg: OutputBenchConfig) -> None:
    """Fill skipped cases from the measured cases of their (method, tp, hidden). Memory: the unfused methods are
    affine in tokens (their logits and logit gradients grow, the weight gradient does not): a line through the two
    largest measured cases. The fused method's tile buffers stop growing once there are two chunks (the previous
    chunk's temporaries are alive while the next is computed), so its line starts at the largest measured case
    and grows by what does grow with tokens, dL/dh and five fp32 statistics per token (`hidden x itemsize + 20`
    bytes; `hidden x (itemsize + 4) + 20` with several vocabulary blocks, dL/dh then summed in fp32): measure at
    least two chunks. Never below the largest measured case. Time: in proportion to tokens from
    the largest measured case (every method's work is linear in tokens)."""
    for r in records:
        if r["measured"]:
            continue
        pts = sorted(
            (m["tokens"], m["peak_bytes"], m["time_s"])
            for m in records
            if m["measured"] and (m["method"], m["tp"], m["hidden"]) == (r["method"], r["tp"], r["hidden"])
        )
        if len(pts) < 2:
            r["peak_bytes"] = r["time_s"] = None
            r["projected_from"] = [p[0] for p in pts]
            continue
        (n0, p0, _), (n1, p1, t1) = pts[-2], pts[-1]
        if r["method"] == "fused":
            blocks = cfg.vocab_block is not None and cfg.vocab_block < cfg.vocab // r["tp"]
            slope = r["hidden"] * (DTYPES[cfg.dtype].itemsize + (4 if blocks else 0)) + 20
        else:
            slope = (p1 - p0) / (n1 - n0)
        r["peak_bytes"] = int(max(p1, p1 + slope * (r["tokens"] - n1)))
        r["time_s"] = t1 * r["tokens"] / n1
        r["projected_from"] = [n0, n1]


def _add_ratios(records: list[dict[str, Any]]) -> None:
    for r in records:
        base = next(
            (
                b
                for b in records
                if b["method"] == "unfused"
                and (b["tp"], b["tokens"], b["hidden"]) == (r["tp"], r["tokens"], r["hidden"])
            ),
            None,
        )
        if base and base["peak_bytes"] and r["peak_bytes"] is not None:
            r["peak_vs_unfused"] = r["peak_bytes"] / base["peak_bytes"]
            r["time_vs_unfused"] = r["time_s"] / base["time_s"]


def measure(
    base: OutputBenchConfig,
    hiddens: list[int],
    tokens: list[int],
    tps: list[int],
    methods: tuple[str, ...] = METHODS,
    measure_up_to: int | None = None,
    max_gb: float = 8.0,
    progress: bool = True,
    values: dict | None = None,
) -> list[dict[str, Any]]:
    """Every (hidden, tokens, tp, method): measured, or projected when above `measure_up_to` tokens or `max_gb`
    of estimated memory over the TP ranks. Raises RuntimeError if a method disagrees with the unfused one.
    `values`: filled with each measured case's rank-0 log-probs, entropies and gradient probes, by
    (method, tp, tokens, hidden)."""
    records, failures = [], []
    for hidden in hiddens:
        for n in tokens:
            for tp in tps:
                if base.vocab % (tp * _TILE):
                    raise ValueError(
                        f"--tp {tp}: vocab {base.vocab} must split into TP shards of whole {_TILE}-row tiles"
                    )
                cfg = OutputBenchConfig(**{**asdict(base), "hidden": hidden, "tokens": n})
                ref = None  # the unfused method's values and probes in this case, when it ran (it runs first)
                for method in sorted(methods, key=lambda m: m != "unfused"):
                    est = estimated_bytes(method, cfg, tp) * tp
                    if (measure_up_to is not None and n > measure_up_to) or est > max_gb * 2**30:
                        records.append(
                            {
                                "method": method,
                                "tp": tp,
                                "tokens": n,
                                "hidden": hidden,
                                "measured": False,
                                "estimated_bytes": est,
                            }
                        )
                        continue
                    if progress:
                        print(f"  {method} tokens={n} hidden={hidden} TP={tp} ...", file=sys.stderr, flush=True)
                    record, probes = _case(method, cfg, tp)
                    record["estimated_bytes"] = est
                    records.append(record)
                    if values is not None:
                        values[method, tp, n, hidden] = probes
                    if method == "unfused":
                        ref = probes
                    elif ref is not None:
                        errs = {
                            k: (
                                float((probes[k] - ref[k]).abs().max())
                                if k in ("logp", "entropy")
                                else _rel(probes[k], ref[k])
                            )
                            for k in ref
                        }
                        record["vs_unfused"] = errs
                        tol = {"logp": VALUE_TOL, "entropy": VALUE_TOL}
                        bad = {k: v for k, v in errs.items() if v > tol.get(k, GRAD_REL_TOL)[cfg.dtype]}
                        if bad:
                            failures.append(f"{method} tokens={n} hidden={hidden} TP={tp}: {bad}")
    if failures:
        raise RuntimeError("methods disagree with the unfused output layer + log-prob:\n  " + "\n  ".join(failures))
    _project(records, base)
    _add_ratios(records)
    return records


# ----------------------------------------------------------------------------------------------- report


def format_table(cfg: OutputBenchConfig, records: list[dict[str, Any]]) -> str:
    gib = 2**30
    where = f"GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    lines = [
        f"output layer + log-prob + entropy, forward + backward from the hidden states; vocab {cfg.vocab:,}, "
        f"{cfg.dtype}, chunk {cfg.chunk_tokens} tokens, fused vocabulary block "
        f"{cfg.vocab_block or 'the shard'}, {cfg.kernel} kernels; {where}; per rank (max over ranks); "
        "* = projected from the measured cases (memory affine, time proportional in tokens), not run",
        f"{'hidden':>6} {'tokens':>6} {'TP':>2} {'method':<9} {'peak GiB':>9} {'x unfused':>9} {'time s':>8} "
        f"{'x unfused':>9} {'logits GiB':>10}",
    ]
    for r in records:
        star = "" if r["measured"] else "*"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / gib:.2f}{star}"
        t = "-" if r["time_s"] is None else f"{r['time_s']:.2f}{star}"
        logits = r["tokens"] * cfg.vocab // r["tp"] * DTYPES[cfg.dtype].itemsize / gib
        pr, tr = r.get("peak_vs_unfused"), r.get("time_vs_unfused")
        lines.append(
            f"{r['hidden']:>6} {r['tokens']:>6} {r['tp']:>2} {r['method']:<9} {peak:>9} "
            f"{'-' if pr is None else f'{pr:.3f}':>9} {t:>8} {'-' if tr is None else f'{tr:.2f}':>9} "
            f"{logits:>10.2f}"
        )
    lines.append(
        "logits GiB: one [tokens, V/tp] tensor in the input dtype (the unfused paths hold it and its gradient)"
    )
    return "\n".join(lines)


def to_json(cfg: OutputBenchConfig, records: list[dict[str, Any]]) -> dict[str, Any]:
    import megatron.core

    return {
        "benchmark": "megarl bench logprob --hidden (output layer + log-prob)",
        "config": asdict(cfg),
        "memory": "peak_bytes: what one forward+backward adds over the inputs; GPU: max_memory_allocated - "
        "memory_allocated before; CPU: VmHWM (reset via clear_refs) - VmRSS before, buffers > 1 MiB "
        "mmapped. measured=false: projected from the cases in projected_from (memory affine in tokens, time "
        "proportional to tokens)",
        "time": "median over repeats of the slowest rank's forward+backward seconds",
        "machine": {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        },
        "records": records,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the output-layer mode of `megarl bench logprob` (chosen by --hidden or --merge)."""
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="print and save the measured records of earlier `--hidden` runs' JSON files together, projected again",
    )
    p.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=None,
        help="hidden sizes: measure the OUTPUT LAYER + log-prob from the hidden states (fused vs unfused "
        "vs megatron; 2048 = Qwen3-30B-A3B, 3584 = Qwen2.5-7B) instead of the log-prob from the logits",
    )
    p.add_argument(
        "--token-counts", type=int, nargs="+", default=[4096, 16384, 32768], help="with --hidden: tokens per microbatch"
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="with --hidden")
    p.add_argument(
        "--vocab-block",
        type=int,
        default=None,
        help="with --hidden: the fused method's rows of the vocabulary shard per tile (trainer.logprob_vocab_block;"
        " default: the whole shard)",
    )
    p.add_argument(
        "--kernel",
        choices=KERNELS,
        default="eager",
        help="with --hidden: the fused method's tile kernels (trainer.logprob_kernel); 'compiled' compiles them "
        "in an unmeasured first pass",
    )
    p.add_argument(
        "--measure-up-to",
        type=int,
        default=None,
        help="with --hidden: run token counts up to this, project the larger ones",
    )
    p.add_argument(
        "--max-gb",
        type=float,
        default=8.0,
        help="with --hidden: skip (and project) a case whose estimated memory over its ranks is above this many GiB",
    )


def merge(paths: list[Path]) -> tuple[OutputBenchConfig, list[dict[str, Any]]]:
    """The measured records of earlier runs' JSON files (one vocabulary and dtype), projected again together."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    cfg = OutputBenchConfig(**docs[0]["config"])
    records = []
    for doc in docs:
        for r in doc["records"]:
            base = {k: r[k] for k in ("method", "tp", "tokens", "hidden", "measured", "estimated_bytes") if k in r}
            records.append(r if r["measured"] else base)
    for r in records:
        for key in ("peak_vs_unfused", "time_vs_unfused"):
            r.pop(key, None)
    _project(records, cfg)
    _add_ratios(records)
    return cfg, records


def run(args: argparse.Namespace) -> int:
    if args.merge:
        cfg, records = merge(args.merge)
        print(format_table(cfg, records))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({**to_json(cfg, records), "merged_from": [str(p) for p in args.merge]}, indent=1) + "\n"
        )
        print(f"wrote {args.out}")
        return 0
    dtype = args.dtype
    if args.vocab_block is not None and args.vocab_block < 1:
        print(f"megarl bench logprob: --vocab-block must be a positive number of rows, got {args.vocab_block}",
              file=sys.stderr)
        return 2
    cfg = OutputBenchConfig(chunk_tokens=args.chunk_tokens, repeats=args.repeats, dtype=dtype, vocab=args.vocab,
                            vocab_block=args.vocab_block, kernel=args.kernel)
    try:
        records = measure(
            cfg, args.hidden, args.token_counts, list(args.tp), tuple(args.methods), args.measure_up_to, args.max_gb
        )
    except ValueError as err:
        print(f"megarl bench logprob: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"megarl bench logprob: {err}", file=sys.stderr)
        return 1
    print(format_table(cfg, records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(cfg, records), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0
