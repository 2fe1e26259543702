"""A discrete-event simulation of megarl's rollout/training pipeline, and a GPU-cluster projection built on it.

The rules (the controller follows them too), for `S = SyncSchedule(m, n)`, K steps and R replicas:
  fleet    batches j < `limit` (`S.generation_limit`) may be generated; sequentially also only j < `demand`. Each
           replica generates its share of batch 0, 1, 2, ... in order, never during a push. Batch j is *generated*
           when all R shares are done and *ready* `score(j)` seconds later (scorings overlap anything).
  trainer  step k: (1) if `S.push_at_step(k)` gives batch j: wait until every share of every batch < j is done,
           push (the fleet is paused), `limit = S.generation_limit(j)`; (2) sequentially: `demand` = batches the
           sequential controller has made before step k, wait until all of them are ready; wait until batch k is
           ready; (3) train. Sequentially `demand` also starts at 0, so the fleet only works while the trainer waits.
The fleet generates batches 0..K-1 only (the run trains on no other), and a push for a batch >= K is skipped.
Spans use the lanes of `megarl.metrics.timeline`, so a simulated run is summarised and drawn like a measured one.
Pure Python; `project_cluster` / `projection_table` turn the stated assumptions below into seconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from megarl.metrics.timeline import Span, busy_seconds
from megarl.schedule import SyncSchedule


@dataclass(frozen=True)
class StageTimes:
    """Seconds: one replica's share of a batch `(replica, batch)`, scoring `(batch)`, training `(step)`, a push."""

    generate: float | Callable[[int, int], float]
    score: float | Callable[[int], float]
    train: float | Callable[[int], float]
    push: float


@dataclass(frozen=True)
class StepRecord:
    start: float
    end: float
    wait_s: float  # time in the step's phases 1-2 that is not push time
    push_s: float
    train_s: float
    generating_s: tuple[float, ...]  # per replica, inside [start, end)
    paused_s: tuple[float, ...]
    idle_s: tuple[float, ...]


@dataclass(frozen=True)
class BatchRecord:
    gen_start: float  # first share started
    gen_end: float  # last share finished
    ready: float
    version: int  # policy version the fleet held while generating it


@dataclass(frozen=True)
class SimResult:
    steps: list[StepRecord]
    batches: list[BatchRecord]
    spans: list[Span]
    wall: float
    replicas: int

    @property
    def wall_per_step(self) -> float:
        return self.wall / len(self.steps)

    def mean_step_s(self, first: int, last: int) -> float:
        """Mean step time over steps [first, last), e.g. the steady state once the pipeline has filled."""
        return (self.steps[last - 1].end - self.steps[first].start) / (last - first)

    def _busy(self, kind: str) -> list[tuple[float, float]]:
        """The spans of one kind, clipped to [0, wall]."""
        return [(s.start, min(s.end, self.wall)) for s in self.spans if s.kind == kind and s.start < self.wall]

    @property
    def overlap(self) -> float:
        """(union over replicas of generating time + training time) / wall: 1.0 = serial, 2.0 = fully overlapped."""
        generating = busy_seconds(self.spans, "generate", 0.0, self.wall)
        return (generating + sum(s.train_s for s in self.steps)) / self.wall

    @property
    def trainer_idle_fraction(self) -> float:
        """Share of the wall time the trainer waits (neither trains nor pushes)."""
        return sum(s.wait_s for s in self.steps) / self.wall

    @property
    def fleet_idle_fraction(self) -> float:
        """Share of replica-seconds spent neither generating nor paused for a push."""
        generating = sum(b - a for a, b in self._busy("generate"))
        paused = sum(b - a for a, b in self._busy("push")) * self.replicas
        return 1.0 - (generating + paused) / (self.wall * self.replicas)


def _seconds(value: float | Callable[..., float], *args: int) -> float:
    return float(value(*args)) if callable(value) else float(value)


class _Fleet:
    """Replica shares computed lazily: share i of a replica starts at max(its share i-1 ended, batch i allowed).

    Valid because permissions only grow, in batch order, and a push starts only after every allowed share ended."""

    def __init__(self, times: StageTimes, replicas: int, horizon: int) -> None:
        self.times, self.horizon = times, horizon
        self.allowed_at: list[float] = []
        self.version: list[int] = []
        self.shares: list[list[tuple[float, float]]] = [[] for _ in range(replicas)]
        self._ready: dict[int, float] = {}

    def allow(self, upto: int, t: float, version: int) -> None:
        for _ in range(len(self.allowed_at), min(upto, self.horizon)):
            self.allowed_at.append(t)
            self.version.append(version)

    def generated(self, batch: int) -> float:
        if batch >= len(self.allowed_at):
            raise RuntimeError(f"deadlock: batch {batch} is waited for but the fleet may not generate it")
        for r, done in enumerate(self.shares):
            while len(done) <= batch:
                i = len(done)
                start = max(done[-1][1] if done else 0.0, self.allowed_at[i])
                done.append((start, start + _seconds(self.times.generate, r, i)))
        return max(done[batch][1] for done in self.shares)

    def ready(self, batch: int) -> float:
        if batch not in self._ready:
            self._ready[batch] = self.generated(batch) + _seconds(self.times.score, batch)
        return self._ready[batch]


def _within(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def simulate(schedule: SyncSchedule, steps: int, replicas: int, times: StageTimes, overlap: bool,
             push_initial: bool = False) -> SimResult:
    """Run K = `steps` trainer steps against R = `replicas` replicas; `overlap=False` is the sequential controller."""
    if steps < 1 or replicas < 1:
        raise ValueError(f"need steps >= 1 and replicas >= 1, got {steps}, {replicas}")
    horizon = steps
    fleet = _Fleet(times, replicas, horizon)
    spans: list[Span] = []
    records: list[tuple[float, float, float, float, float]] = []
    t, version = 0.0, 0
    if push_initial:
        spans.append(Span("push", "push", 0.0, times.push, "v0"))
        t = times.push
    limit, demand = schedule.generation_limit(None), 0 if not overlap else horizon
    fleet.allow(min(limit, demand), t, version)

    def wait_until(until: float, k: int) -> float:
        if until > t:
            spans.append(Span("trainer", "wait", t, until, f"step {k}"))
        return max(t, until)

    for k in range(steps):
        start, push_s = t, 0.0
        j = schedule.push_at_step(k)
        if j is not None and j < steps:  # (1) push the weights that generate batches j, j+1, ...
            if not overlap:
                demand = max(demand, j)
                fleet.allow(min(limit, demand), t, version)
            assert len(fleet.allowed_at) == j and schedule.sync_before_batch(j) == k
            t = wait_until(fleet.generated(j - 1), k)
            spans.append(Span("push", "push", t, t + times.push, f"v{k}"))
            t, push_s, version = t + times.push, times.push, k
            limit = schedule.generation_limit(j)
            fleet.allow(min(limit, demand), t, version)
        if not overlap:  # (2) the sequential controller first makes every batch it runs ahead
            demand = max(demand, schedule.batches_ready_before_step(k))
            fleet.allow(min(limit, demand), t, version)
            t = wait_until(max(fleet.ready(i) for i in range(min(demand, horizon))), k)
        t = wait_until(fleet.ready(k), k)
        train_s = _seconds(times.train, k)
        spans.append(Span("trainer", "train", t, t + train_s, f"step {k}"))
        records.append((start, t + train_s, t - start - push_s, push_s, train_s))
        t += train_s

    fleet.generated(len(fleet.allowed_at) - 1)  # the fleet finishes what it was allowed to start
    batches = []
    for i, version_i in enumerate(fleet.version):
        assert version_i == schedule.generation_version(i), f"batch {i} generated by version {version_i}"
        shares = [done[i] for done in fleet.shares]
        batches.append(BatchRecord(min(a for a, _ in shares), max(b for _, b in shares), fleet.ready(i), version_i))
        spans += [Span(f"replica {r}", "generate", a, b, f"batch {i}") for r, (a, b) in enumerate(shares)]
        spans.append(Span("reward", "score", batches[-1].gen_end, batches[-1].ready, f"batch {i}"))
    pushes = [(s.start, s.end) for s in spans if s.kind == "push"]
    assert all(_within(pushes, s.start, s.end) == 0.0 for s in spans if s.kind == "generate"), "generation in a push"
    steps_out = []
    for lo, hi, wait_s, push_s, train_s in records:
        gen = tuple(_within([(a, b) for a, b in done], lo, hi) for done in fleet.shares)
        paused = _within(pushes, lo, hi)
        idle = tuple(hi - lo - g - paused for g in gen)
        steps_out.append(StepRecord(lo, hi, wait_s, push_s, train_s, gen, (paused,) * replicas, idle))
    return SimResult(steps_out, batches, spans, records[-1][1], replicas)


# ---- GPU projection: Qwen3-30B-A3B at REC appendix B.7's batch (configs/qwen3_30b_a3b_guru.yaml) ----
# Every number below is an ASSUMPTION unless marked "config" or "megarl plan".
PROMPTS, SAMPLES, REPLICAS, TRAINER_GPUS = 72, 16, 8, 32  # config: 72 x 16 per step, 8 vLLM replicas, 32 GPUs
MAX_NEW_TOKENS = 8192  # config: rollout.max_new_tokens (the response budget)
PROMPT_TOKENS = 256  # assumption: a Guru-math prompt with its chat template
RESPONSE_MEDIAN, RESPONSE_SIGMA = 3000, 0.6  # assumption: log-normal lengths, capped: mean ~3.4k, ~5% truncated
DECODE_STEP_S = 0.007  # assumption: a decode step's fixed cost, TP-4 H100 (15.3 GB of weights per GPU / 3.35 TB/s
#                        = 4.6 ms, + TP all-reduces and launch): a lone sequence decodes at ~140 tokens/s
DECODE_PER_SEQ_S = 0.00005  # assumption: extra step time per running sequence (KV reads, expert GEMMs): 144
#                        sequences -> 14.2 ms a step, ~10k tokens/s per replica
PREFILL_S = 1.0  # assumption: prefill of 144 x 256 prompt tokens plus scheduling
SCORE_S = 5.0  # assumption: math-verify on 1,152 responses in a worker pool
ACTIVE_PARAMS, LAYERS, Q_DIM = 3_353_032_704, 48, 32 * 128  # megarl plan: active parameters; model config
H100_BF16_FLOPS, TRAIN_MFU = 989e12, 0.12  # H100 SXM dense bf16 peak; assumption: MFU of padded RL fwd+bwd on a MoE
OPTIMIZER_S = 3.0  # assumption: gradient reduce + distributed Adam step per step
PUSH_BYTES = 15_285_252_096  # megarl plan: bytes one sync sends each vLLM TP-4 rank (trainer ranks send ~as many)
LINK_BYTES_PER_S = 25e9  # assumption: effective per-GPU 400 Gb/s InfiniBand with 64 MiB p2p buckets (half line rate)
PUSH_FIXED_S = 5.0  # assumption: pause, layerwise reload of 48 layers on every worker, HTTP lifecycle, resume
PUSH_S = PUSH_BYTES / LINK_BYTES_PER_S + PUSH_FIXED_S
# old_logprobs=engine (the config's default): no log-prob recompute pass on the trainer.


@cache
def _response_lengths(replica: int, batch: int) -> tuple[int, ...]:
    rng = random.Random(batch * 1000 + replica)  # fixed per (batch, replica): every run sees the same lengths
    n = PROMPTS * SAMPLES // REPLICAS
    return tuple(min(MAX_NEW_TOKENS, int(rng.lognormvariate(math.log(RESPONSE_MEDIAN), RESPONSE_SIGMA)))
                 for _ in range(n))


def _generate_s(replica: int, batch: int) -> float:
    """Decode steps run until the longest response ends; each costs DECODE_STEP_S + DECODE_PER_SEQ_S x running."""
    lengths = _response_lengths(replica, batch)
    return PREFILL_S + DECODE_STEP_S * max(lengths) + DECODE_PER_SEQ_S * sum(lengths)


def train_seconds(response_lengths: Sequence[int], gpus: int = TRAINER_GPUS) -> float:
    """6 x active params per token + causal attention (6 x layers x q_dim x L^2 per sequence, fwd+bwd), each
    response with its prompt, at TRAIN_MFU on `gpus` GPUs, plus the optimizer step."""
    seqs = [PROMPT_TOKENS + n for n in response_lengths]
    flops = sum(6 * ACTIVE_PARAMS * s + 6 * LAYERS * Q_DIM * s * s for s in seqs)
    return flops / (gpus * H100_BF16_FLOPS * TRAIN_MFU) + OPTIMIZER_S


def _train_s(step: int) -> float:
    return train_seconds([n for r in range(REPLICAS) for n in _response_lengths(r, step)])


CLUSTER_TIMES = StageTimes(generate=_generate_s, score=SCORE_S, train=_train_s, push=PUSH_S)
PROJECTED_SCHEDULES = ((1, 0), (1, 1), (1, 2), (8, 0), (8, 1), (8, 2), (4, 0), (4, 1))


def project_cluster(interval: int, offset: int, overlap: bool, steps: int = 64) -> SimResult:
    return simulate(SyncSchedule(interval, offset), steps, REPLICAS, CLUSTER_TIMES, overlap)


def projection_table(steps: int = 64) -> str:
    """The markdown table of `docs/pipeline_projection_draft.md`: `steady` = mean step over steps [K/4, 3K/4)."""
    def steady(r: SimResult) -> float:
        return r.mean_step_s(steps // 4, 3 * steps // 4)

    base = steady(project_cluster(1, 0, False, steps))
    rows = [f"| sync (m, n) | pipeline | s/step ({steps} steps) | steady s/step | overlap figure | trainer idle | "
            "fleet idle | steady speed-up vs (1, 0) off |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for m, n in PROJECTED_SCHEDULES:
        for on in (False, True):
            r = project_cluster(m, n, on, steps)
            rows.append(f"| ({m}, {n}) | {'on' if on else 'off'} | {r.wall_per_step:.1f} | {steady(r):.1f} | "
                        f"{r.overlap:.2f} | {r.trainer_idle_fraction:.0%} | {r.fleet_idle_fraction:.0%} | "
                        f"{base / steady(r):.2f}x |")
    return "\n".join(rows)
