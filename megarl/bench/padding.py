"""`megarl bench padding`: tokens the trainer computes vs real tokens per step, count-based microbatches
(`trainer.micro_batch_size`) vs token-budget microbatches (`trainer.max_tokens_per_microbatch`), on a long-tailed
length distribution. Pure arithmetic over the trainer's own microbatching (`megarl.trainer.batching.microbatch_plan`,
`microbatch_widths`, `plan_padding`): no model runs.

The lengths are Guru-like, drawn from the seed (a model of the shape, not lengths measured from Guru data):
`prompts_per_step` prompts of log-normal length (median 256, sigma 0.7, clipped to [32, max_prompt]) and
`samples` responses each of log-normal length (median 1,536, sigma 0.9), cut at `max_response` (the engine's
max_new_tokens: the long tail piles up there). A sequence is its prompt plus its response.

Per layout it prints, averaged over `--steps` batches: tokens computed per step (summed over DP ranks), real
tokens, the padding share (1 - real / computed), microbatches per rank, and the largest microbatch in tokens (what
sets activation and logits memory). Count-based microbatches pad every row to the global batch's longest
sequence; token-budget ones cut each microbatch to its longest, from the length-sorted batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from megarl.trainer.batching import microbatch_plan, microbatch_widths, plan_padding


def guru_like_lengths(
    prompts: int, samples: int, max_prompt: int, max_response: int, generator: torch.Generator
) -> list[int]:
    """`prompts * samples` sequence lengths: one prompt length per group of `samples`, a response length each."""
    prompt = (torch.randn(prompts, generator=generator) * 0.7 + torch.tensor(256.0).log()).exp()
    prompt = prompt.round().clamp(32, max_prompt).long()
    response = (torch.randn(prompts, samples, generator=generator) * 0.9 + torch.tensor(1536.0).log()).exp()
    response = response.round().clamp(1, max_response).long()
    return (prompt[:, None] + response).reshape(-1).tolist()


def step_figures(
    lengths: list[int], dp: int, micro_batch_size: int, budget: int | None, packed: bool
) -> dict[str, float]:
    """One step's padding figures for a layout, as the trainer computes them (`megarl.trainer.step`)."""
    plan = microbatch_plan(lengths, dp, micro_batch_size, budget, packed)
    if packed or budget is not None:
        widths = microbatch_widths(lengths, plan, packed)
    else:
        widths = [max(lengths)] * len(plan[0])
    stats = plan_padding(lengths, plan, widths, packed)
    stats["largest_microbatch_tokens"] = max(
        w if packed else len(mb) * w for mbs in plan for mb, w in zip(mbs, widths, strict=True)
    )
    return stats


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(args.seed)
    batches = [
        guru_like_lengths(args.prompts_per_step, args.samples, args.max_prompt, args.max_response, g)
        for _ in range(args.steps)
    ]
    layouts: list[tuple[str, int | None, bool]] = [(f"count {args.micro_batch_size}", None, False)]
    layouts += [(f"tokens {b}", b, False) for b in args.budgets]
    if args.packed:
        layouts += [(f"count {args.micro_batch_size} packed", None, True)]
        layouts += [(f"tokens {b} packed", b, True) for b in args.budgets]
    rows = []
    for name, budget, packed in layouts:
        per_step = [step_figures(lengths, args.dp, args.micro_batch_size, budget, packed) for lengths in batches]
        row: dict[str, Any] = {"layout": name, "max_tokens_per_microbatch": budget, "packed": packed}
        for key in per_step[0]:
            row[key] = statistics.mean(s[key] for s in per_step)
        row["largest_microbatch_tokens"] = max(s["largest_microbatch_tokens"] for s in per_step)
        rows.append(row)
    base = rows[0]["train/tokens_computed"]
    for row in rows:
        row["computed_vs_count"] = row["train/tokens_computed"] / base
    return rows


def format_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{args.prompts_per_step} prompts x {args.samples} samples per step over {args.dp} DP ranks, Guru-like "
        f"lengths (prompt <= {args.max_prompt}, response <= {args.max_response}), mean of {args.steps} steps",
        f"{'layout':<22} {'computed/step':>14} {'real/step':>11} {'padding':>8} {'x count':>8} "
        f"{'mb/rank':>8} {'largest mb':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['layout']:<22} {r['train/tokens_computed']:>14,.0f} {r['train/tokens_real']:>11,.0f} "
            f"{r['train/padding_fraction']:>8.1%} {r['computed_vs_count']:>8.2f} "
            f"{r['train/microbatches']:>8.1f} {r['largest_microbatch_tokens']:>11,}"
        )
    lines.append(
        "computed: tokens the model runs (rows x row length), summed over DP ranks; largest mb: tokens of "
        "the largest microbatch on any rank (sets activation and logits memory)"
    )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "padding",
        help="tokens computed vs real per step: count-based vs token-budget microbatches on Guru-like lengths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts-per-step", type=int, default=72, help="(Guru 30B recipe: 72)")
    p.add_argument("--samples", type=int, default=16, help="responses per prompt (Guru recipe: 16)")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks (Guru 30B recipe: 32 / (tp 2 x pp 2))")
    p.add_argument("--micro-batch-size", type=int, default=4, help="count-based microbatch (Guru recipe: 4)")
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[16384, 32768, 65536],
        help="token budgets (trainer.max_tokens_per_microbatch) to compare",
    )
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-response", type=int, default=8192)
    p.add_argument("--packed", action="store_true", help="also the packed layouts (trainer.pack_sequences)")
    p.add_argument("--steps", type=int, default=20, help="batches drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench_padding.json"), help="JSON output")
    return p


def run(args: argparse.Namespace) -> int:
    if (args.prompts_per_step * args.samples) % args.dp:
        print(
            f"megarl bench padding: {args.prompts_per_step} x {args.samples} sequences do not split over "
            f"--dp {args.dp}",
            file=sys.stderr,
        )
        return 2
    rows = measure(args)
    print(format_table(args, rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"}
    args.out.write_text(
        json.dumps({"benchmark": "megarl bench padding", "config": config, "rows": rows}, indent=1) + "\n"
    )
    print(f"wrote {args.out}")
    return 0
