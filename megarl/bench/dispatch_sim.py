"""How a batch's prompts reach the replicas, simulated token by token: the static split against the shared queue.

The engine model is `megarl.bench.pipeline_sim`'s (its stated assumptions): a replica runs decode steps over all
the sequences it holds; a step costs `DECODE_STEP_S + DECODE_PER_SEQ_S x running` and advances every running
sequence by one token; admitting work costs its prefill, `PREFILL_S` per static share of
`PROMPTS x SAMPLES / REPLICAS` sequences, pro rata. So a static share costs exactly `pipeline_sim._generate_s`:
`PREFILL_S + DECODE_STEP_S x longest + DECODE_PER_SEQ_S x total tokens`.

Dispatch, for the batches of one window (the fleet holds one version; a push follows the window):
  static  replica r gets prompts i = r mod R of each batch as one share and generates its shares in batch order,
          one at a time (`megarl.rollout.worker` before the queue);
  queue   chunks of `chunk_prompts` consecutive prompts, lowest batch first, in one queue; a replica holds up to
          `in_flight` chunks and takes the next one when one of its chunks is done (`megarl.rollout.worker`).
A chunk (or share) is done when its longest sequence is. The window ends when every replica is done: its wall
time; a replica's idle time is the wall time less the time it held running sequences or prefilled.
Pure Python and deterministic: the lengths are drawn from a fixed seed per batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from megarl.bench import pipeline_sim as cluster


@dataclass(frozen=True)
class EngineCosts:
    """Seconds: a decode step's fixed cost, its extra cost per running sequence, and the prefill of one sequence."""

    step_s: float
    per_seq_s: float
    prefill_per_seq_s: float


CLUSTER_COSTS = EngineCosts(
    cluster.DECODE_STEP_S,
    cluster.DECODE_PER_SEQ_S,
    cluster.PREFILL_S / (cluster.PROMPTS * cluster.SAMPLES / cluster.REPLICAS),
)


@dataclass(frozen=True)
class WindowResult:
    wall_s: float  # until the last replica is done
    busy_s: tuple[float, ...]  # per replica: holding running sequences or prefilling
    chunks: tuple[int, ...]  # per replica: chunks (static: shares) it generated

    @property
    def idle_s(self) -> tuple[float, ...]:
        return tuple(self.wall_s - b for b in self.busy_s)

    @property
    def idle_fraction(self) -> float:
        """Share of the window's replica-seconds spent idle."""
        return sum(self.idle_s) / (self.wall_s * len(self.busy_s)) if self.wall_s > 0 else 0.0


PROMPT_SIGMA = 0.45  # assumption: the share of the log-length spread that belongs to the prompt (its difficulty)


def guru_lengths(
    batch: int, per_prompt: bool = False, prompts: int = cluster.PROMPTS, samples: int = cluster.SAMPLES
) -> list[list[int]]:
    """Response lengths of one batch, per prompt its K samples, capped at `MAX_NEW_TOKENS`. Per sample (default):
    `pipeline_sim`'s Guru-like log-normal, median `RESPONSE_MEDIAN`, sigma `RESPONSE_SIGMA`, every sample drawn
    alike. `per_prompt`: the same overall spread, split between prompts and samples -- prompt i's median is
    log-normal (sigma `PROMPT_SIGMA`) around `RESPONSE_MEDIAN`, its samples log-normal around that (sigma
    sqrt(RESPONSE_SIGMA^2 - PROMPT_SIGMA^2)): a few hard prompts' groups run to the limit, most groups end early."""
    rng = random.Random(f"guru:{batch}:{per_prompt}")
    mu = math.log(cluster.RESPONSE_MEDIAN)
    prompt_sigma = PROMPT_SIGMA if per_prompt else 0.0
    sample_sigma = math.sqrt(cluster.RESPONSE_SIGMA**2 - prompt_sigma**2)
    out = []
    for _ in range(prompts):
        median = rng.normalvariate(mu, prompt_sigma) if per_prompt else mu
        out.append([min(cluster.MAX_NEW_TOKENS, int(rng.lognormvariate(median, sample_sigma))) for _ in range(samples)])
    return out


def _work_lists(
    batches: Sequence[list[list[int]]], replicas: int, mode: str, chunk_prompts: int
) -> list[list[list[int]]]:
    """The chunks to generate, each the flat list of its sequences' lengths: per replica (static) or one queue."""
    if mode == "static":
        return [
            [[n for i, group in enumerate(b) if i % replicas == r for n in group] for b in batches]
            for r in range(replicas)
        ]
    if mode == "queue":
        return [
            [
                [n for group in b[i : i + chunk_prompts] for n in group]
                for b in batches
                for i in range(0, len(b), chunk_prompts)
            ]
        ]
    raise ValueError(f"dispatch mode {mode!r}: use 'static' or 'queue'")


def simulate_window(
    batches: Sequence[list[list[int]]],
    replicas: int,
    mode: str,
    costs: EngineCosts,
    chunk_prompts: int = 1,
    in_flight: int = 1,
    slowdown: Sequence[float] | None = None,
) -> WindowResult:
    """One window's batches (`batches[j][i]`: the K response lengths of prompt i of batch j) on `replicas`
    replicas with `mode` 'static' or 'queue' (`chunk_prompts`, `in_flight` chunks per replica); `slowdown[r]`
    multiplies replica r's costs (a straggler: 1.5 = 50 % slower)."""
    slow = list(slowdown) if slowdown is not None else [1.0] * replicas
    queues = _work_lists(batches, replicas, mode, chunk_prompts)
    slots = 1 if mode == "static" else in_flight

    def source(r: int) -> list[list[int]]:
        return queues[r] if mode == "static" else queues[0]

    clock = [0.0] * replicas
    busy = [0.0] * replicas
    chunks = [0] * replicas
    running: list[list[list[int]]] = [[] for _ in range(replicas)]  # per replica: its chunks' remaining lengths

    def admit(r: int, at_most: int) -> None:
        while len(running[r]) < slots and source(r) and at_most > 0:
            at_most -= 1
            chunk = [n for n in source(r).pop(0) if n > 0]
            prefill = costs.prefill_per_seq_s * len(chunk) * slow[r]
            clock[r] += prefill
            busy[r] += prefill
            chunks[r] += 1
            if chunk:
                running[r].append(chunk)

    for _ in range(slots):  # the worker starts its loops slot by slot: each replica takes one chunk per round
        for r in range(replicas):
            admit(r, 1)
    while True:
        events = []
        for r in range(replicas):
            if running[r]:
                seqs = sum(len(c) for c in running[r])
                steps = min(min(c) for c in running[r])
                events.append((clock[r] + steps * (costs.step_s + costs.per_seq_s * seqs) * slow[r], r, steps))
        if not events:
            break
        t, r, steps = min(events)
        busy[r] += t - clock[r]
        clock[r] = t
        running[r] = [[n - steps for n in c if n > steps] for c in running[r]]
        running[r] = [c for c in running[r] if c]
        admit(r, slots)
    return WindowResult(max(clock), tuple(busy), tuple(chunks))


DISPATCHES = (("static", 0), ("queue", 1), ("queue", 2))  # (mode, chunk_prompts)
STRAGGLER = (1.5,) + (1.0,) * (cluster.REPLICAS - 1)  # one replica 50 % slower (a degraded node, a busier host)
# (name, response lengths per prompt (`guru_lengths(per_prompt=...)`), per-replica slowdown)
SCENARIOS = (
    ("per-sample lengths, equal replicas", False, None),
    ("per-prompt lengths, equal replicas", True, None),
    ("per-prompt lengths, one replica 1.5x slower", True, STRAGGLER),
)


def _in_flight(chunk_prompts: int, prompts: int = cluster.PROMPTS, replicas: int = cluster.REPLICAS) -> int:
    """`megarl.config.schema.chunks_in_flight`."""
    from megarl.config.schema import chunks_in_flight

    return chunks_in_flight(prompts, replicas, chunk_prompts)


def longtail_projection(batches: int = 32, batches_per_window: Sequence[int] = (1, 8)) -> list[dict]:
    """Cluster-scale figures (8 replicas, 72 prompts x 16, Guru-like lengths), per replica scenario, window size
    (1: sync.interval 1; 8: the Guru config's sync (8, 0)) and dispatch, over about `batches` batches: mean wall
    time per batch, replica idle (seconds per batch, share) and chunks per replica and window."""
    rows = []
    for scenario, per_prompt, slowdown in SCENARIOS:
        for per_window in batches_per_window:
            windows = max(1, batches // per_window)
            for mode, chunk in DISPATCHES:
                flight = _in_flight(chunk) if mode == "queue" else 1
                results = [
                    simulate_window(
                        [guru_lengths(w * per_window + b, per_prompt) for b in range(per_window)],
                        cluster.REPLICAS,
                        mode,
                        CLUSTER_COSTS,
                        chunk,
                        flight,
                        slowdown,
                    )
                    for w in range(windows)
                ]
                rows.append(
                    {
                        "scenario": scenario,
                        "batches_per_window": per_window,
                        "dispatch": mode,
                        "chunk_prompts": chunk if mode == "queue" else math.ceil(cluster.PROMPTS / cluster.REPLICAS),
                        "in_flight": flight,
                        "wall_per_batch_s": sum(r.wall_s for r in results) / (windows * per_window),
                        "replica_idle_fraction": sum(r.idle_fraction for r in results) / windows,
                        "replica_idle_s_per_batch": sum(sum(r.idle_s) / len(r.idle_s) for r in results)
                        / (windows * per_window),
                        "chunks_min_max": (min(min(r.chunks) for r in results), max(max(r.chunks) for r in results)),
                    }
                )
    return rows


def projection_markdown(rows: list[dict]) -> str:
    out = [
        "| replicas | batches per window | dispatch | prompts a chunk x in flight | wall per batch (s) | "
        "replica idle (s per batch) | replica idle (share) | chunks per replica (min-max) |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lo, hi = r["chunks_min_max"]
        out.append(
            f"| {r['scenario']} | {r['batches_per_window']} | {r['dispatch']} | {r['chunk_prompts']} x "
            f"{r['in_flight']} | {r['wall_per_batch_s']:.1f} | {r['replica_idle_s_per_batch']:.1f} | "
            f"{r['replica_idle_fraction']:.0%} | {lo}-{hi} |"
        )
    return "\n".join(out)
