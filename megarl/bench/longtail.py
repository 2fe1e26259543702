"""`megarl bench longtail`: long-tailed responses on the real fleet, the static split against the shared queue,
then the same projected at cluster scale.

The task: batches of `--prompts` prompts x `--samples` responses whose lengths are long-tailed: each prompt's
responses run to `--max-tokens` with probability `--long-share` (the tail), else to `--short-tokens`. Lengths are
set, not left to the tiny random model: the first prompt token marks a long prompt and the bench's client asks
vLLM for exactly that many tokens (`ignore_eos`). They are drawn from a fixed seed per batch, so both dispatches
get the same batches. Generation runs through megarl's own `RolloutWorker` on a real vLLM fleet
(`--replicas` tiny-model CPU replicas, started here, or `--fleet-url`), a window of `--window` batches at a time
(one version: a push would follow each window; none is made, the weights never change):

  static  replica r generates share r (ceil(P/R) contiguous prompts) of every batch, one share at a time: the
          split megarl used before the queue;
  queue   `--chunk` prompts a chunk, ceil(ceil(P/R)/chunk) chunks in flight per replica (as `megarl train`:
          `rollout.chunk_prompts`), about the same prompts in flight as a static share.

Per window (after one discarded warm-up window; static and queue alternate window by window, on the same
batches, so drift in the machine's load hits both alike): wall time from the window's opening until its last
chunk is generated, per batch; each replica's idle seconds (the wall less the time it had a chunk in flight) and
its chunks. Then `megarl.bench.dispatch_sim` projects static vs queue at cluster scale (8 replicas, Guru-like
lengths; its assumptions are `megarl.bench.pipeline_sim`'s). Prints tables, writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megarl.rollout.client import RolloutClient, Sample

LONG, SHORT = 5, 6  # first prompt token: this prompt's responses are long / short (ids of the tiny tokenizer)


class LongTailClient(RolloutClient):
    """Generates exactly `long_tokens` per response for prompts starting with `LONG`, `short_tokens` for the rest."""

    def __init__(self, url: str, long_tokens: int, short_tokens: int) -> None:
        super().__init__(url, timeout_s=600)
        self.long_tokens, self.short_tokens = long_tokens, short_tokens

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, max_tokens: int | list[int], **kwargs: Any
    ) -> list[list[Sample]]:
        budgets = [self.long_tokens if p[0] == LONG else self.short_tokens for p in prompt_token_ids]
        return super().generate(prompt_token_ids, n, budgets, ignore_eos=True, **kwargs)


def long_prompts(batch: int, prompts: int, long_share: float, seed: int = 0) -> list[bool]:
    """Which prompts of `batch` have long responses (a fixed draw per batch)."""
    rng = random.Random(f"longtail:{seed}:{batch}")
    return [rng.random() < long_share for _ in range(prompts)]


def measure_window(
    urls: list[str],
    dispatch: str,
    window_index: int,
    prompts: int,
    samples: int,
    window: int,
    chunk: int,
    long_share: float,
    long_tokens: int,
    short_tokens: int,
) -> dict[str, Any]:
    """Window `window_index` (batches [w * window, (w + 1) * window), w >= 1) with `dispatch` ('static' or
    'queue'): wall time, each replica's idle seconds and chunks."""
    from megarl.config.schema import chunks_in_flight
    from megarl.data.problem import Problem
    from megarl.metrics.timeline import Timeline, busy_seconds
    from megarl.rewards.pool import RewardPool
    from megarl.rewards.scoring import BatchScorer
    from megarl.rollout.worker import RolloutWorker
    from megarl.schedule import SyncSchedule

    def problems(j: int) -> list[Problem]:
        return [
            Problem(prompt=f"{j} {i} {int(long)}", answer="")
            for i, long in enumerate(long_prompts(j, prompts, long_share))
        ]

    def encode(text: str) -> list[int]:
        j, i, long = (int(x) for x in text.split())
        return [LONG if long else SHORT, 7 + j % 10, 7 + i % 10, 7 + i // 10 % 10]

    replicas, static = len(urls), dispatch == "static"
    in_flight = 1 if static else chunks_in_flight(prompts, replicas, chunk)
    first, limit = window_index * window, (window_index + 1) * window
    timeline = Timeline()
    scorer = BatchScorer(RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=60), lambda ids: "")
    worker = RolloutWorker(  # resumed at the window's first batch: it waits for `pushed` to open the window
        [LongTailClient(u, long_tokens, short_tokens) for u in urls],
        SyncSchedule(window, 0),
        problems=problems,
        encode=encode,
        sampling={"n": samples, "max_tokens": long_tokens},
        seed=lambda j: 1000 * j,
        score=scorer,
        timeline=timeline,
        end=limit,
        start=first,
        chunk_prompts=chunk,
        chunks_in_flight=in_flight,
        static_split=static,
    )
    try:
        start = timeline.now()
        worker.pushed(first)  # (no weights move: the window opens)
        worker.quiesce(limit)
        end = timeline.now()
        for j in range(first, limit):
            worker.take(j)
    finally:
        worker.close()
    spans = timeline.spans()
    busy = [busy_seconds(spans, "generate", start, end, lane=f"replica {r}") for r in range(replicas)]
    return {
        "window": window_index,
        "wall_s": end - start,
        "wall_per_batch_s": (end - start) / window,
        "idle_s": [end - start - b for b in busy],
        "chunks": list(worker.chunks_taken),
        "long_prompts": sum(sum(long_prompts(j, prompts, long_share)) for j in range(first, limit)),
        "chunk_prompts": -(-prompts // replicas) if static else chunk,
        "in_flight": in_flight,
    }


def measure(urls: list[str], windows: int, **kw: Any) -> list[dict[str, Any]]:
    """One warm-up window (discarded), then windows 1..`windows`, each generated once per dispatch (static, then
    queue, window by window, so drift in the machine's load hits both alike); per dispatch its windows' means."""
    measure_window(urls, "queue", 0, **kw)
    rows: dict[str, list[dict[str, Any]]] = {"static": [], "queue": []}
    for w in range(1, windows + 1):
        for dispatch in rows:
            rows[dispatch].append(measure_window(urls, dispatch, w, **kw))
            print(f"window {w} {dispatch}: {rows[dispatch][-1]['wall_s']:.2f} s", flush=True)
    window = kw["window"]
    return [
        {
            "dispatch": d,
            "chunk_prompts": rs[0]["chunk_prompts"],
            "in_flight": rs[0]["in_flight"],
            "windows": rs,
            "wall_per_batch_s": statistics.fmean(r["wall_per_batch_s"] for r in rs),
            "idle_s_per_batch": statistics.fmean(statistics.fmean(r["idle_s"]) / window for r in rs),
            "idle_fraction": statistics.fmean(statistics.fmean(r["idle_s"]) / r["wall_s"] for r in rs),
        }
        for d, rs in rows.items()
    ]


def format_measured(results: list[dict[str, Any]]) -> str:
    lines = [
        "| dispatch | prompts a chunk x in flight | wall per batch (s) | replica idle (s per batch) | replica idle "
        "(share) | chunks per replica, per window |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        chunks = "; ".join("/".join(map(str, w["chunks"])) for w in r["windows"])
        lines.append(
            f"| {r['dispatch']} | {r['chunk_prompts']} x {r['in_flight']} | {r['wall_per_batch_s']:.2f} | "
            f"{r['idle_s_per_batch']:.2f} | {r['idle_fraction']:.0%} | {chunks} |"
        )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "longtail",
        help="long-tailed responses on the real fleet: static split vs shared queue, and the cluster-scale projection",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=2, help="tiny-model vLLM CPU replicas to start (TP 1 each)")
    p.add_argument(
        "--fleet-url",
        action="append",
        default=None,
        help="reuse a running fleet serving the tiny MoE (repeat per replica) instead of starting one",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (K)")
    p.add_argument("--window", type=int, default=4, help="batches per window (sync.interval, offset 0)")
    p.add_argument("--windows", type=int, default=4, help="measured windows per dispatch (after one warm-up)")
    p.add_argument("--chunk", type=int, default=1, help="prompts per chunk of the queue (rollout.chunk_prompts)")
    p.add_argument("--long-share", type=float, default=0.1, help="share of prompts with long responses")
    p.add_argument("--max-tokens", type=int, default=256, help="the long responses' length (the token limit)")
    p.add_argument("--short-tokens", type=int, default=16, help="the other responses' length")
    p.add_argument("--sim-batches", type=int, default=32, help="batches per row of the cluster-scale projection")
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench_longtail.json"), help="JSON output")
    return p


def run(args: argparse.Namespace) -> int:
    from megarl.bench.dispatch_sim import longtail_projection, projection_markdown

    if args.replicas < 1 or args.prompts < 1 or args.chunk < 1 or not 0 <= args.long_share <= 1:
        print(
            "megarl bench longtail: --replicas, --prompts, --chunk must be >= 1 and --long-share in [0, 1]",
            file=sys.stderr,
        )
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_longtail_"))
    try:
        results = _measure_on_fleet(args, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(
        f"\nmeasured: {len(args.fleet_url or []) or args.replicas} replicas, {args.prompts} prompts x "
        f"{args.samples}, {args.long_share:.0%} of prompts to {args.max_tokens} tokens, the rest "
        f"{args.short_tokens}; windows of {args.window} batches"
    )
    print(format_measured(results))
    t0 = time.perf_counter()
    projection = longtail_projection(args.sim_batches)
    print(
        f"\nprojected (megarl.bench.dispatch_sim, {time.perf_counter() - t0:.0f} s): 8 replicas, 72 prompts x 16, "
        "Guru-like lengths"
    )
    print(projection_markdown(projection))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("func",)},
                "measured": results,
                "projected": projection,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


def _measure_on_fleet(args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.rollout.fleet import FleetSpec, launch
    from megarl.rollout.fleet_auth import SECRET_ENV

    kw = {
        "prompts": args.prompts,
        "samples": args.samples,
        "window": args.window,
        "chunk": args.chunk,
        "long_share": args.long_share,
        "long_tokens": args.max_tokens,
        "short_tokens": args.short_tokens,
    }
    if args.fleet_url:
        return measure(args.fleet_url, args.windows, **kw)
    model = make_tiny_checkpoint(work_dir / "tiny_moe", kind="moe")
    print(f"starting {args.replicas} vLLM CPU replicas of the tiny MoE ...", flush=True)
    with launch(FleetSpec(model_dir=model, tp=1, replicas=args.replicas, log_dir=work_dir)) as fleet:
        os.environ[SECRET_ENV] = str(fleet.secret_file)  # the clients send the fleet's secret
        return measure(fleet.urls, args.windows, **kw)
