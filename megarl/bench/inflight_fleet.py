"""`megarl bench inflight-fleet`: in-flight weight updates + partial rollouts against today's queue, measured on the
real vLLM CPU fleet, side by side in one run, on the same long-tailed batches.

The task is `megarl bench longtail`'s: `--prompts` prompts x `--samples` responses a batch; each prompt's responses
run to `--max-tokens` with probability `--long-share` (the tail), else to `--short-tokens`, set per prompt with
vLLM's `ignore_eos` (`longtail.LongTailClient`, `longtail.long_prompts`: a fixed draw per batch). Generation runs
through megarl's own `RolloutWorker` on `--replicas` tiny-MoE vLLM CPU replicas (TP 1, started here), driven by a
trainer loop that follows `megarl train`'s (`megarl.loop.run_loop`) step by step, for `--steps` steps:

    at a push point of `sync (--interval, --offset)`: `worker.before_push(j)`, a REAL push of the weights into the
    fleet (`PartitionedWeightSync.push` from one trainer rank, the same lifecycle and byte moving `megarl train`
    uses: pause, partitioned send, load, label, resume), `worker.pushed(j)`;
    `worker.take(step)`, then the trainer's step, which here is `--train-s` seconds of sleep (the trainer's compute
    is not what is measured; the fleet's cores stay the fleet's).

Two modes, the only difference the switch `sync.inflight` makes in `megarl train`:

  queue     today: `before_push` quiesces (every chunk of the window generated), then the push pauses each replica
            in vLLM's wait mode; batch l is home batch l.
  inflight  `sync.inflight`: the worker's partial mode (`PartialRollouts(P, bound)`, bound `--bound`, by default the
            schedule's m + n - 1) and the push pauses each replica in vLLM's keep mode with its requests held, KV
            `--kv` (`sync.inflight_kv`); batch l is the P finished groups of the lowest (home batch, prompt)
            within the bound, stale ones dropped; a group known to be past the bound while it still generates is
            aborted (`--doomed abort`, `sync.inflight_abort_doomed`) or left to finish (`--doomed finish`).
  inflight_finish  (with `--doomed both`, a third mode in every round) in flight, doomed groups left to finish.

The weights pushed are the checkpoint's own, relabelled with each version (a full push every time: every byte
moves and is loaded; what the weights are does not change the lengths, which are set). Each run starts with a push
of version 0 (as `sync.push_initial`), so the engine's version labels are the run's versions.

Rounds: after one discarded warm-up run of each mode, `--rounds` rounds, each running both modes on the same
batches (round r: batches from r x 1000), in alternating order (queue first in even rounds), so drift in the
machine's load hits both alike. Steady window per run: the steps from `--skip` on (from the end of step skip - 1 to
the end of the last step). Reported per mode: wall per batch (median and spread of the steps' walls; each run's
mean), the replicas' idle share (a replica is idle when it has no request in flight or is paused for a push), the
trainer's wait share (waiting for a batch or for the fleet before a push), pushes and the requests each held,
and the length accounting: responses sampled (the home batches those steps would train without partial rollouts)
against those trained, long responses among them, groups dropped past the bound and their lengths; and per long
response that ran to its end, its wall, the part of it the fleet was paused for pushes, and the rest per token
(`long_call_time`: why a long response takes longer in flight). Prints tables, writes `--out` (JSON).

Arms (`plan_arms`; issue 55): each mode above runs as one or more arms, every arm in every round on the same batches.

  like-for-like control  `--control lag` adds the queue at the schedule whose maximum lag m' + n' - 1 equals the
            in-flight arms' staleness bound B (`lag_schedule`: m' = m, as many pushes per step, n' = B - m + 1): arm
            `queue_lag`, run when B differs from the schedule's own m + n - 1 (else `queue` is that control);
            `--control schedule` (with `lag` by default) keeps `queue` at (m, n).
  KV modes  `--kv recompute keep`: one in-flight arm per mode (`inflight` with the first, `inflight_<kv>` else).
  refill    `--refill groups sequences`: every arm once per `rollout.refill` setting, the `sequences` ones named
            `<arm>+seq`. Each setting gets its own fleet, started as `megarl train` starts it: `--max-num-seqs` from
            `Config.sequence_slots()` and the worker's chunks in flight from `Config.rollout_chunks_in_flight()` of
            the config the bench's task makes (`bench_config`); vLLM cannot change --max-num-seqs live. Both fleets
            run side by side; only one generates at a time.

Per arm besides the figures above: full-run wall (the run's start, after the initial push, to its last step's end)
and wall per trained token (the steady window's wall over the tokens its steps trained; also over the full run), and
the engine's occupancy: vLLM's running and waiting sequences (`vllm:num_requests_running`, `..._waiting`, read from
each replica's /metrics every `--gauge-s`, time-weighted over the steady window) against the static share's
sequence slots. Paired per round: each in-flight arm against its like-for-like queue (and the schedule's queue), each
`+seq` arm against its `groups` arm, in wall per batch, per trained token and full-run wall (`comparisons`); the raw
JSON is rewritten after every round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from megarl.bench.longtail import LONG, SHORT, LongTailClient, long_prompts
from megarl.metrics.timeline import Span

MODES = ("queue", "inflight", "inflight_finish")  # inflight_finish: in flight with doomed groups left to finish
#                                                  (`--doomed both`: side by side with `inflight`, which aborts them)
ROUND_BATCHES = 1000  # round r's batches start at r x ROUND_BATCHES (both modes of a round share them)
KV_MODES = ("recompute", "keep")  # sync.inflight_kv
REFILLS = ("groups", "sequences")  # rollout.refill
CONTROLS = ("schedule", "lag")  # the queue arms: at the schedule (m, n), at the in-flight arms' bound (`lag_schedule`)
SEQ = "+seq"  # the suffix of a `rollout.refill: sequences` arm's name


def lag_schedule(bound: int, interval: int) -> tuple[int, int]:
    """The sync schedule (m', n') of the queue whose maximum lag m' + n' - 1 is `bound` (the like-for-like control
    of an in-flight arm at staleness bound `bound` and sync interval `interval`): m' = `interval`, as many pushes per
    step, n' = bound - interval + 1; where the bound is below interval - 1, (bound + 1, 0)."""
    if bound < 0 or interval < 1:
        raise ValueError(f"no schedule has a maximum lag of {bound} (interval {interval})")
    return (interval, bound - interval + 1) if bound >= interval - 1 else (bound + 1, 0)


@dataclass(frozen=True)
class Arm:
    """One arm of the bench: `mode` (one of MODES) at sync schedule (`interval`, `offset`), with KV mode `kv` (in
    flight) and `rollout.refill` setting `refill`."""

    name: str
    mode: str
    interval: int
    offset: int
    kv: str = "recompute"
    refill: str = "groups"

    @property
    def max_lag(self) -> int:
        """The schedule's maximum lag m + n - 1 (a queue arm's bound; an in-flight arm's is the spec's)."""
        return self.interval + self.offset - 1


@dataclass(frozen=True)
class FleetBenchSpec:
    """One bench run's task and schedule (see the module docstring)."""

    prompts: int = 16
    samples: int = 4
    interval: int = 1
    offset: int = 2
    bound: int | None = None  # None: the schedule's own maximum lag, m + n - 1 (`megarl.schedule.token_lag_bound`)
    steps: int = 12
    skip: int = 2
    train_s: float = 0.5
    long_share: float = 0.1
    long_tokens: int = 120
    short_tokens: int = 8
    kv: str = "recompute"  # the in-flight arm's KV mode (sync.inflight_kv); `kvs` adds arms
    positions: int = 128  # the tiny model's context: the prompt (4 tokens) and the long responses must fit
    doomed: str = "abort"  # in flight, a group known to be past the bound while generating: 'abort' it
    #                        (`sync.inflight_abort_doomed`, the default) or let it 'finish' and drop it then
    #                        (bench files written before 2026-11-29 did the latter); 'both': the `inflight` runs
    #                        abort, and `inflight_finish` runs on the same batches let them finish
    kvs: tuple[str, ...] = ()  # in-flight arms' KV modes (empty: `kv` alone; else the first is `kv`'s)
    refills: tuple[str, ...] = ("groups",)  # rollout.refill settings: every arm runs once per setting
    controls: tuple[str, ...] = CONTROLS  # the queue arms (`plan_arms`)
    lag_intervals: tuple[int, ...] = ()  # the like-for-like queues' sync intervals (empty: `interval` alone)

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.doomed == "both" else MODES[:2]

    def arms(self) -> list[Arm]:
        """The arms of a round, in their order (`plan_arms`)."""
        return plan_arms(self)

    def for_arm(self, arm: Arm) -> FleetBenchSpec:
        """This spec as `arm` runs it: its schedule and KV mode; a queue arm's bound is its own schedule's maximum
        lag, an in-flight arm's this spec's staleness bound."""
        return replace(self, interval=arm.interval, offset=arm.offset, kv=arm.kv,
                       bound=None if arm.mode == "queue" else self.staleness_bound)

    @property
    def staleness_bound(self) -> int:
        from megarl.schedule import SyncSchedule, token_lag_bound

        return token_lag_bound(self.bound, SyncSchedule(self.interval, self.offset))

    @property
    def generated_batches(self) -> int:
        """The batches a run's worker generates (and pushes for): past the measured steps, as in a longer run."""
        return self.steps + self.interval + self.offset

    def set_lengths(self, batch: int) -> list[list[int]]:
        """The response lengths the bench sets for each prompt of `batch` (K each)."""
        return [[self.long_tokens if long else self.short_tokens] * self.samples
                for long in long_prompts(batch, self.prompts, self.long_share)]


def plan_arms(spec: FleetBenchSpec) -> list[Arm]:
    """The arms of a round: per `spec.refills` setting, the queue at (m, n) (`controls` 'schedule') and at the
    in-flight bound's schedule for each of `lag_intervals` M (`lag_schedule(bound, M)`, 'lag': arm `queue_lag` for
    M = m, `queue_lag_m<M>` else, only where it differs from (m, n)), then one in-flight arm per KV mode
    (`inflight`, then `inflight_<kv>`) and, with `--doomed both`, `inflight_finish` (the first KV mode). A
    `sequences` arm's name ends in `SEQ`."""
    kvs = spec.kvs or (spec.kv,)
    m, n = spec.interval, spec.offset
    lags = {lag_schedule(spec.staleness_bound, i): "queue_lag" if i == m else f"queue_lag_m{i}"
            for i in (spec.lag_intervals or (m,))} if "lag" in spec.controls else {}
    arms: list[Arm] = []
    for refill in spec.refills:
        suffix = SEQ if refill == "sequences" else ""
        queues = [("queue", (m, n))] if "schedule" in spec.controls or (m, n) in lags else []
        queues += [(name, at) for at, name in lags.items() if at != (m, n)]
        arms += [Arm(name + suffix, "queue", *at, kvs[0], refill) for name, at in queues]
        arms += [Arm(("inflight" if i == 0 else f"inflight_{kv}") + suffix, "inflight", m, n, kv, refill)
                 for i, kv in enumerate(kvs)]
        if spec.doomed == "both":
            arms.append(Arm("inflight_finish" + suffix, "inflight_finish", m, n, kvs[0], refill))
    return arms


def comparisons(arms: Sequence[Arm], bound: int) -> list[tuple[str, str, str]]:
    """The paired comparisons of `arms` (arm, control, why): each in-flight arm against the queue of the same refill
    whose maximum lag is `bound` (like-for-like), and against the queue at its own schedule where that differs; each
    `sequences` arm against the same arm with `groups`."""
    out = []
    for a in arms:
        if a.mode == "queue":
            continue
        queues = [q for q in arms if q.mode == "queue" and q.refill == a.refill]
        out += [(a.name, q.name, f"like for like: max lag {bound}") for q in queues if q.max_lag == bound]
        out += [(a.name, q.name, f"the same schedule ({a.interval}, {a.offset}), max lag {q.max_lag}")
                for q in queues if q.max_lag != bound and (q.interval, q.offset) == (a.interval, a.offset)]
    by_name = {a.name: a for a in arms}
    out += [(a.name, a.name[:-len(SEQ)], "refill: sequences against groups") for a in arms
            if a.refill == "sequences" and a.name.endswith(SEQ) and a.name[:-len(SEQ)] in by_name]
    return out


def bench_config(spec: FleetBenchSpec, replicas: int, refill: str, model_dir: Path | str) -> Any:
    """The run config of the bench's task (its prompts, samples, replicas, chunks of one prompt, `rollout.refill`):
    whose `sequence_slots()` and `rollout_chunks_in_flight()` start the fleet and drive the worker as `megarl train`
    would."""
    from megarl.config.schema import Config

    return Config(model={"hf_dir": str(model_dir)}, data={"prompts_per_step": spec.prompts},
                  rollout={"replicas": replicas, "samples_per_prompt": spec.samples, "chunk_prompts": 1,
                           "refill": refill})


# ---- bookkeeping (pure) -------------------------------------------------------------------------------------------
def per_token_ms(wall_s: float, tokens: int) -> float | None:
    """Milliseconds of wall per token (None: no tokens)."""
    return 1e3 * wall_s / tokens if tokens else None


def gauge_mean(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """The time-weighted mean over [start, end) of a gauge read at times `samples` (time, value): each reading holds
    until the next (the last until `end`); time before the first reading is left out (None: nothing covered)."""
    ordered = sorted(samples)
    total = covered = 0.0
    for i, (t, v) in enumerate(ordered):
        a, b = max(t, start), min(ordered[i + 1][0] if i + 1 < len(ordered) else end, end)
        if b > a:
            total += v * (b - a)
            covered += b - a
    return total / covered if covered else None


def engine_occupancy(readings: Sequence[Sequence[tuple[float, float, float]]], start: float, end: float,
                     slots: int) -> dict[str, Any]:
    """Per replica, from its gauge readings (time, running, waiting) over [start, end): mean running and waiting
    sequences, the most waiting, and `occupancy` = mean running / `slots`; and their means over the replicas (None
    where no reading covers the window)."""
    per = []
    for r in readings:
        running = gauge_mean([(t, x) for t, x, _ in r], start, end)
        waiting = gauge_mean([(t, w) for t, _, w in r], start, end)
        inside = [w for t, _, w in r if start <= t < end]
        per.append({"running": running, "waiting": waiting, "waiting_max": max(inside) if inside else None,
                    "occupancy": running / slots if running is not None else None})
    known = [p for p in per if p["running"] is not None]
    return {"slots": slots, "replicas": per,
            "running": statistics.fmean(p["running"] for p in known) if known else None,
            "waiting": statistics.fmean(p["waiting"] for p in known) if known else None,
            "waiting_max": max((p["waiting_max"] for p in known if p["waiting_max"] is not None), default=None),
            "occupancy": statistics.fmean(p["occupancy"] for p in known) if known else None}


def covered_s(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end) covered by at least one of `intervals`."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if min(b, end) > max(a, start))
    total, at = 0.0, start
    for a, b in clipped:
        if b > at:
            total += b - max(a, at)
            at = b
    return total


def replica_time(spans: Sequence[Span], start: float, end: float, replicas: int) -> list[dict[str, float]]:
    """Per replica, inside [start, end): `decoding_s` (a request in flight and no push pausing it), `paused_s` (a
    push: every replica is paused for it, with or without requests held), `empty_s` (no request in flight, no push),
    and `idle_share` = 1 - decoding_s / (end - start)."""
    pushes = [(s.start, s.end) for s in spans if s.kind == "push"]
    paused = covered_s(pushes, start, end)
    out = []
    for r in range(replicas):
        generating = [(s.start, s.end) for s in spans if s.kind == "generate" and s.lane == f"replica {r}"]
        either = covered_s(generating + pushes, start, end)
        decoding = either - paused
        out.append({"decoding_s": decoding, "paused_s": paused, "empty_s": (end - start) - either,
                    "idle_share": 1.0 - decoding / (end - start)})
    return out


def trainer_time(spans: Sequence[Span], start: float, end: float) -> dict[str, float]:
    """The trainer's shares of [start, end): waiting (for a batch, or for the fleet before a push), pushing,
    training."""
    window = end - start
    return {f"{kind}_share": covered_s([(s.start, s.end) for s in spans if s.kind == kind
                                        and (kind == "push" or s.lane == "trainer")], start, end) / window
            for kind in ("wait", "push", "train")}


def length_stats(lengths: Sequence[int], long_tokens: int) -> dict[str, Any]:
    """Responses, mean length, long ones (>= `long_tokens`) and their share, and quantiles."""
    if not lengths:
        return {"responses": 0, "mean": None, "long": 0, "long_share": None, "p50": None, "p90": None, "max": None}
    ordered = sorted(lengths)
    return {"responses": len(ordered), "mean": statistics.fmean(ordered),
            "long": sum(n >= long_tokens for n in ordered), "long_share": sum(n >= long_tokens for n in ordered)
            / len(ordered), "p50": ordered[len(ordered) // 2], "p90": ordered[min(len(ordered) - 1,
                                                                                   (9 * len(ordered)) // 10)],
            "max": ordered[-1]}


def length_accounting(sampled: Sequence[int], trained: Sequence[int], dropped: Sequence[int],
                      long_tokens: int) -> dict[str, Any]:
    """The length bias of one run's steady steps: `sampled` (the responses of the home batches those steps train
    without partial rollouts), `trained` (the responses the steps trained), `dropped` (the responses of the groups
    dropped past the bound during those steps); `bias` = trained mean / sampled mean - 1."""
    s, t = length_stats(sampled, long_tokens), length_stats(trained, long_tokens)
    return {"sampled": s, "trained": t, "dropped": length_stats(dropped, long_tokens),
            "bias": t["mean"] / s["mean"] - 1.0 if s["mean"] and t["mean"] is not None else None}


def long_call_time(calls: Sequence[dict[str, Any]], spans: Sequence[Span], start: float, end: float,
                   long_tokens: int) -> list[dict[str, float]]:
    """Per generate call of a long group that ran to its end (`long_tokens` tokens, not aborted) and ended inside
    [start, end): its wall (`wall_s`, sent to answered), the part of it the fleet was paused for pushes
    (`paused_s`: overlap with the push spans), and the rest per token (`decode_ms_per_token`: decoding, prefills and
    the re-prefills after pushes, and any wait of the request for a slot). A call is one group here
    (`chunk_prompts=1`)."""
    pushes = [(p.start, p.end) for p in spans if p.kind == "push"]
    out = []
    for c in calls:
        if not (c["long"] and not c["aborted"] and c["tokens"] == long_tokens and start <= c["end"] < end):
            continue
        wall = c["end"] - c["start"]
        paused = covered_s(pushes, c["start"], c["end"])
        out.append({"wall_s": wall, "paused_s": paused, "decode_ms_per_token": 1e3 * (wall - paused) / long_tokens})
    return out


def step_walls(t0: float, ends: Sequence[float]) -> list[float]:
    """Each step's wall: from the previous step's end (the run's start for step 0) to its own."""
    return [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]


def spread(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {"median": statistics.median(ordered), "p10": ordered[n // 10], "p90": ordered[min(n - 1, 9 * n // 10)],
            "min": ordered[0], "max": ordered[-1], "n": n}


def summarize_run(spec: FleetBenchSpec, mode: str, first: int, t0: float, ends: list[float], spans: list[Span],
                  replicas: int, trained: list[list[int]], dropped: list[tuple[int, int, int, int]],
                  extra: dict[str, Any], calls: Sequence[dict[str, Any]] = (),
                  gauges: Sequence[Sequence[tuple[float, float, float]]] | None = None,
                  slots: int = 0) -> dict[str, Any]:
    """One run's steady figures (steps `spec.skip`..): `trained[k]` the response lengths step k trained,
    `dropped` (step, home batch, prompt, lag) per group dropped, `calls` the clients' generate calls
    (`long_call_time`), `gauges` each replica's readings of vLLM's running and waiting sequences
    (`engine_occupancy`, against `slots`); batches are numbered from `first`. The full run: from `t0` (after the
    initial push) to the last step's end, every step's trained tokens."""
    k0 = spec.skip
    start, end = (ends[k0 - 1] if k0 else t0), ends[-1]
    walls = step_walls(t0, ends)[k0:]
    per_replica = replica_time(spans, start, end, replicas)
    sampled = [n for j in range(k0, spec.steps) for g in spec.set_lengths(first + j) for n in g]
    lost = [n for step, home, prompt, _ in dropped if step >= k0
            for n in spec.set_lengths(first + home)[prompt]]
    tokens, full_tokens = sum(sum(t) for t in trained[k0:]), sum(sum(t) for t in trained)
    return {
        "mode": mode, "first_batch": first, "steps": spec.steps, "steady_steps": [k0, spec.steps],
        "wall_per_batch_s": (end - start) / (spec.steps - k0), "step_walls_s": walls,
        "trained_tokens": tokens, "wall_per_trained_token_ms": per_token_ms(end - start, tokens),
        "full_wall_s": end - t0, "full_trained_tokens": full_tokens,
        "full_wall_per_trained_token_ms": per_token_ms(end - t0, full_tokens),
        "engine": engine_occupancy(gauges, start, end, slots) if gauges is not None and slots else None,
        "replicas": per_replica, "idle_share": statistics.fmean(r["idle_share"] for r in per_replica),
        **trainer_time(spans, start, end),
        "dropped_groups": sum(step >= k0 for step, *_ in dropped), "dropped_total": len(dropped),
        "dropped": [list(d) for d in dropped],
        "lengths": length_accounting(sampled, [n for k in range(k0, spec.steps) for n in trained[k]], lost,
                                     spec.long_tokens),
        "long_calls": long_call_time(calls, spans, start, end, spec.long_tokens),
        **extra,
    }


def arm_of(run: dict[str, Any]) -> str:
    """A run's arm (files written before arms existed: its mode)."""
    return run.get("arm", run["mode"])


def summarize_modes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm (`arm_of`) over its measured runs: wall per batch (the steps' walls pooled: median and spread; the
    runs' means), full-run wall and wall per trained token (each run's; medians), idle and wait shares, the engine's
    occupancy, drops, lengths and the trained-length bias; the paired ratio inflight / queue per round; and the
    paired `comparisons` (`ratios`)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(arm_of(r) for r in runs):
        rs = [r for r in runs if arm_of(r) == name]
        trained = [r["lengths"]["trained"] for r in rs]
        sampled = [r["lengths"]["sampled"] for r in rs]
        trained_mean, sampled_mean = _weighted_mean(trained), _weighted_mean(sampled)
        engines = [r["engine"] for r in rs if r.get("engine") and r["engine"]["running"] is not None]
        out[name] = {
            "arm": {k: rs[0].get(k) for k in ("mode", "interval", "offset", "kv", "refill", "bound")},
            "runs": len(rs),
            **{key: [r[key] for r in rs] for key in ("full_wall_s", "wall_per_trained_token_ms",
                                                      "full_wall_per_trained_token_ms") if key in rs[0]},
            **{f"{key}_median": _median([r.get(key) for r in rs])
               for key in ("wall_per_batch_s", "full_wall_s", "wall_per_trained_token_ms",
                           "full_wall_per_trained_token_ms")},
            "trained_length_bias": trained_mean / sampled_mean - 1.0 if trained_mean and sampled_mean else None,
            "engine": {key: _median([e[key] for e in engines]) for key in ("running", "waiting", "occupancy")}
            | {"waiting_max": max((e["waiting_max"] or 0 for e in engines), default=None),
               "slots": engines[0]["slots"]} if engines else None,
            "step_wall_s": spread([w for r in rs for w in r["step_walls_s"]]),
            "wall_per_batch_s": [r["wall_per_batch_s"] for r in rs],
            "wall_per_batch_s_mean": statistics.fmean(r["wall_per_batch_s"] for r in rs),
            "idle_share": statistics.fmean(r["idle_share"] for r in rs),
            "wait_share": statistics.fmean(r["wait_share"] for r in rs),
            "push_share": statistics.fmean(r["push_share"] for r in rs),
            "dropped_groups": sum(r["dropped_groups"] for r in rs),
            "aborted_groups": sum(_steady_aborted(r) for r in rs),  # of the dropped ones
            "trained_responses": sum(t["responses"] for t in trained),
            "trained_long": sum(t["long"] for t in trained),
            "trained_mean_length": trained_mean,
            "sampled_responses": sum(s["responses"] for s in sampled),
            "sampled_long": sum(s["long"] for s in sampled),
            "sampled_mean_length": sampled_mean,
            "push_s": spread([p["seconds"] for r in rs for p in r["pushes"]]) if any(r["pushes"] for r in rs) else None,
            "held_requests_per_push": statistics.fmean(n for r in rs for n in r["held_per_push"])
            if any(r["held_per_push"] for r in rs) else 0.0,
            "max_token_lag": max(r["max_token_lag"] for r in rs),
            "responses_spanning_versions": sum(r["responses_spanning"] for r in rs),
            "long_calls": _long_call_medians([c for r in rs for c in r.get("long_calls", [])]),
        }
    for mode in MODES[1:]:  # `ratio_*` (inflight / queue), `inflight_finish_ratio_*`
        pairs = [(q, i) for q in runs if arm_of(q) == "queue" for i in runs
                 if arm_of(i) == mode and i["first_batch"] == q["first_batch"]]
        if pairs:
            key = "ratio" if mode == "inflight" else f"{mode}_ratio"
            out[f"{key}_per_round"] = [i["wall_per_batch_s"] / q["wall_per_batch_s"] for q, i in pairs]
            out[f"{key}_median"] = statistics.median(out[f"{key}_per_round"])
            out[f"{key}_of_medians"] = out[mode]["step_wall_s"]["median"] / out["queue"]["step_wall_s"]["median"]
    out["ratios"] = paired_ratios(runs)
    return out


RATIO_KEYS = ("wall_per_batch_s", "wall_per_trained_token_ms", "full_wall_s")  # what `paired_ratios` compares


def paired_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every comparison of the runs' arms (`comparisons`; runs without arm fields: none), per `RATIO_KEYS` figure:
    arm / control per round (the runs on the same batches), their median and range."""
    arms = {arm_of(r): Arm(arm_of(r), r["mode"], r["interval"], r["offset"], r.get("kv", "recompute"),
                           r.get("refill", "groups")) for r in runs if "interval" in r}
    bounds = {r["bound"] for r in runs if r["mode"] != "queue" and "interval" in r}
    if len(bounds) != 1:
        return []
    out = []
    for arm, control, why in comparisons(list(arms.values()), bounds.pop()):
        pairs = [(c, a) for c in runs if arm_of(c) == control for a in runs
                 if arm_of(a) == arm and a["first_batch"] == c["first_batch"]]
        row: dict[str, Any] = {"arm": arm, "control": control, "why": why, "rounds": len(pairs)}
        for key in RATIO_KEYS:
            per = [a[key] / c[key] for c, a in pairs if a.get(key) and c.get(key)]
            row[key] = {"per_round": per, "median": statistics.median(per) if per else None,
                        "min": min(per, default=None), "max": max(per, default=None)}
        out.append(row)
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _long_call_medians(calls: list[dict[str, float]]) -> dict[str, float] | None:
    """The medians of `long_call_time`'s figures over a mode's runs (None: no long group ran to its end)."""
    if not calls:
        return None
    return {"n": len(calls), **{key: statistics.median(c[key] for c in calls)
                                for key in ("wall_s", "paused_s", "decode_ms_per_token")}}


def _steady_aborted(run: dict[str, Any]) -> int:
    """The run's groups dropped in its steady steps that were aborted while generating (files before 2026-11-29:
    none)."""
    aborted = {(home, prompt) for home, prompt, *_ in run.get("aborted", [])}
    return sum(step >= run["steady_steps"][0] and (home, prompt) in aborted for step, home, prompt, _ in run["dropped"])


def _weighted_mean(stats: list[dict[str, Any]]) -> float | None:
    n = sum(s["responses"] for s in stats)
    return sum(s["mean"] * s["responses"] for s in stats if s["responses"]) / n if n else None


def _arms_in(summary: dict[str, Any]) -> list[str]:
    """The arms a summary holds, in its order."""
    return [k for k, v in summary.items() if isinstance(v, dict) and "runs" in v]


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_tables(spec: FleetBenchSpec, summary: dict[str, Any]) -> str:
    arms = _arms_in(summary)
    lines = [
        "| arm | sync (m, n); bound | KV | refill | step wall median (p10-p90) s | wall per batch, runs' means (s) | "
        "full-run wall, runs (s) | wall per trained token, runs (ms) | replica idle | engine: running / slots "
        "(waiting, most waiting) | trainer wait | push (share; median s) | requests held per push | dropped groups "
        "(aborted) | trained responses: long / all (mean length) | sampled: long / all (mean length) | trained-length "
        "bias | max token lag |",
        "|---|---|---|---|---|---|---|---|---:|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for name in arms:
        m = summary[name]
        w, a, e = m["step_wall_s"], m.get("arm") or {}, m.get("engine")
        at = f"({a['interval']}, {a['offset']}); {a['bound']}" if a.get("interval") is not None else "-"
        engine = (f"{_f(e['running'], '.1f')} / {e['slots']} ({_f(e['waiting'], '.1f')}, {_f(e['waiting_max'], '.0f')})"
                  if e else "-")
        lines.append(
            f"| {name} | {at} | {a.get('kv') or '-' if a.get('mode') != 'queue' else '-'} | {a.get('refill') or '-'} | "
            f"{w['median']:.2f} ({w['p10']:.2f}-{w['p90']:.2f}) | "
            f"{', '.join(f'{x:.2f}' for x in m['wall_per_batch_s'])} | "
            f"{', '.join(f'{x:.1f}' for x in m.get('full_wall_s', [])) or '-'} | "
            f"{', '.join(_f(x) for x in m.get('wall_per_trained_token_ms', [])) or '-'} | "
            f"{m['idle_share']:.0%} | {engine} | {m['wait_share']:.0%} | "
            f"{m['push_share']:.0%}; {m['push_s']['median'] if m['push_s'] else 0:.2f} | "
            f"{m['held_requests_per_push']:.1f} | {m['dropped_groups']} ({m['aborted_groups']}) | "
            f"{m['trained_long']} / {m['trained_responses']} ({m['trained_mean_length']:.1f}) | "
            f"{m['sampled_long']} / {m['sampled_responses']} ({m['sampled_mean_length']:.1f}) | "
            f"{_f(m.get('trained_length_bias'), '+.1%')} | {m['max_token_lag']} |")
    timed = [(name, summary[name]["long_calls"]) for name in arms if summary[name].get("long_calls")]
    if timed:
        lines += ["", "| arm | long responses timed (ran to their end) | wall each, median s | of which the fleet "
                  "paused for pushes, median s | the rest per token, median ms |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {name} | {c['n']} | {c['wall_s']:.2f} | {c['paused_s']:.2f} | {c['decode_ms_per_token']:.2f} |"
                  for name, c in timed]
    for mode in MODES[1:]:
        key = "ratio" if mode == "inflight" else f"{mode}_ratio"
        if f"{key}_per_round" in summary:
            per_round = ", ".join(f"{x:.2f}" for x in summary[f"{key}_per_round"])
            lines.append(f"\n{mode} / queue, wall per batch: per round {per_round} (median "
                         f"{summary[f'{key}_median']:.2f}); step walls' medians {summary[f'{key}_of_medians']:.2f}")
    if summary.get("ratios"):
        lines += ["", "| arm / control | why | wall per batch: per round (median) | wall per trained token: per round "
                  "(median) | full-run wall: per round (median) | arm: dropped (aborted), trained-length bias | "
                  "control: dropped (aborted), trained-length bias |", "|---|---|---|---|---|---|---|"]
        for r in summary["ratios"]:
            cells = [f"{', '.join(f'{x:.2f}' for x in r[k]['per_round'])} ({_f(r[k]['median'])})" for k in RATIO_KEYS]
            sides = [f"{summary[n]['dropped_groups']} ({summary[n]['aborted_groups']}), "
                     f"{_f(summary[n].get('trained_length_bias'), '+.1%')}" for n in (r["arm"], r["control"])]
            lines.append(f"| {r['arm']} / {r['control']} | {r['why']} | {' | '.join(cells)} | {' | '.join(sides)} |")
    return "\n".join(lines)


# ---- on the fleet -------------------------------------------------------------------------------------------------
class _CountingClient(LongTailClient):
    """`LongTailClient` that counts the groups (prompts) it is asked to generate, into `sent` (shared, [count]): the
    bench's own count of the groups started, against which the worker's trained + dropped + pooled is checked."""

    def __init__(self, url: str, long_tokens: int, short_tokens: int, sent: list[int], lock: Any,
                 calls: list[dict[str, Any]], clock: Any) -> None:
        super().__init__(url, long_tokens, short_tokens)
        self.sent, self.lock, self.calls, self.clock = sent, lock, calls, clock

    def generate(self, prompt_token_ids: list[list[int]], n: int, max_tokens: int | list[int],
                 **kwargs: Any) -> list[list[Any]]:
        with self.lock:
            self.sent[0] += len(prompt_token_ids)
        start = self.clock()
        out = super().generate(prompt_token_ids, n, max_tokens, **kwargs)
        samples = [s for group in out for s in group]
        with self.lock:  # (timed on the timeline's clock, for `long_call_time`)
            self.calls.append({"start": start, "end": self.clock(), "long": any(p[0] == LONG for p in prompt_token_ids),
                               "tokens": max(len(s.response_ids) for s in samples),
                               "aborted": any(s.finish_reason == "abort" for s in samples)})
        return out


class _Pusher:
    """One trainer rank's weight sync into the fleet (`PartitionedWeightSync`, world of one rank), pushing the
    checkpoint's own tensors under each new version label."""

    def __init__(self, urls: list[str], hf_dir: Path, kv: str) -> None:
        import torch.distributed as dist
        from safetensors.torch import load_file

        from megarl.config.schema import SyncConfig
        from megarl.models.hf_config import read_hf_config
        from megarl.parallel.spawn import free_port
        from megarl.rollout.client import RolloutClient
        from megarl.sync.slices import HFSlice
        from megarl.sync.weight_sync import PartitionedWeightSync

        self.owns_group = not dist.is_initialized()  # (the bench's second fleet's pusher shares the first's group)
        if self.owns_group:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        hf = read_hf_config(hf_dir)
        tensors = load_file(str(hf_dir / "model.safetensors"))
        self.slices = [(HFSlice.whole(name, tuple(t.shape)), t) for name, t in tensors.items()]
        self.sync = PartitionedWeightSync(0, 1, hf, [RolloutClient(u) for u in urls], rollout_tp=1,
                                          rollout_replicas=len(urls), store_host="127.0.0.1", store_port=free_port(),
                                          bucket_bytes=int(SyncConfig().bucket_mb * 2**20), timeout_s=300,
                                          inflight=True, inflight_kv=kv)  # type: ignore[arg-type]

    def push(self, version: int, inflight: bool, kv: str | None = None) -> dict[str, Any]:
        """Push the weights as `version`, pausing in keep mode (`inflight`, the held requests' KV `kv`: recomputed or
        kept; None: as last set) or wait mode: the requests the pause held part-way (0 in wait mode) and the push's
        phases (`SyncStats.phases`, seconds)."""
        fleet = self.sync.fleet
        assert fleet is not None
        fleet.inflight = inflight
        if kv is not None:
            fleet.inflight_kv = kv  # type: ignore[assignment]
        stats = self.sync.push(self.slices, version)
        return {"held": sum(1 for counts in fleet.held.values() for n in counts.values() if n > 0),
                "held_requests": stats.held_requests,
                "seconds": stats.seconds, **{k: v for k, v in stats.phases.items() if k.endswith("_s")}}

    def close(self) -> None:
        import torch.distributed as dist

        self.sync.close()
        if self.owns_group:
            dist.destroy_process_group()


class _Gauges:
    """Reads each replica's vLLM gauges of running and waiting sequences (`vllm:num_requests_running`,
    `vllm:num_requests_waiting`, its /metrics) every `every_s` seconds on `clock`, in a thread, until `stop`."""

    NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

    def __init__(self, urls: list[str], headers: dict[str, str], clock: Any, every_s: float) -> None:
        self.urls, self.headers, self.clock, self.every_s = urls, headers, clock, every_s
        self.readings: list[list[tuple[float, float, float]]] = [[] for _ in urls]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gauges", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from megarl.bench.engine_step import read_metrics

        while not self._stop.is_set():
            for r, url in enumerate(self.urls):
                try:
                    got = read_metrics(url, self.headers, self.NAMES)
                except Exception:  # noqa: BLE001 (a missed reading: the last one holds; the figures say how many)
                    continue
                self.readings[r].append((self.clock(), got[self.NAMES[0]], got[self.NAMES[1]]))
            self._stop.wait(self.every_s)

    def stop(self) -> list[list[tuple[float, float, float]]]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.readings


@dataclass
class BenchFleet:
    """One running fleet of the bench: its replicas' URLs, its pusher, the `rollout.refill` setting it was started
    for, the worker's chunks in flight per replica and the sequence slots (`bench_config`), the /metrics headers."""

    urls: list[str]
    pusher: _Pusher
    refill: str
    chunks_in_flight: int
    slots: int
    headers: dict[str, str]


def run_mode(spec: FleetBenchSpec, mode: str | Arm, first: int, urls: list[str], pusher: _Pusher,
             steps: int | None = None, fleet: BenchFleet | None = None, gauge_s: float = 0.0) -> dict[str, Any]:
    """One run of `mode` (an `Arm`, or a mode at the spec's own schedule) on batches `first`.. (`steps` overrides
    spec.steps: the warm-up); `fleet` (its URLs and pusher are then `urls` and `pusher`): the refill setting's chunks
    in flight and slots, and the gauges read every `gauge_s` (0: not read). Without `fleet`, chunks in flight are
    `rollout.refill: groups`'s."""
    from megarl.config.schema import chunks_in_flight
    from megarl.data.problem import Problem
    from megarl.metrics.timeline import Timeline
    from megarl.rewards.pool import RewardPool
    from megarl.rewards.scoring import BatchScorer
    from megarl.rollout.worker import PartialRollouts, RolloutWorker
    from megarl.schedule import SyncSchedule

    arm = mode if isinstance(mode, Arm) else Arm(mode, mode, spec.interval, spec.offset, spec.kv)
    if fleet is not None and fleet.refill != arm.refill:
        raise ValueError(f"arm {arm.name} (refill {arm.refill}) on the fleet started for refill {fleet.refill}")
    spec = spec.for_arm(arm)
    mode = arm.mode
    spec = spec if steps is None else replace(spec, steps=steps, skip=0)
    in_flight_chunks = fleet.chunks_in_flight if fleet is not None else chunks_in_flight(spec.prompts, len(urls), 1)
    inflight = mode != "queue"
    abort_doomed = mode == "inflight" and spec.doomed != "finish"
    schedule = SyncSchedule(spec.interval, spec.offset)
    end = spec.generated_batches
    bound = spec.staleness_bound

    def problems(j: int) -> list[Problem]:
        return [Problem(prompt=f"{first + j} {i} {int(long)}", answer="")
                for i, long in enumerate(long_prompts(first + j, spec.prompts, spec.long_share))]

    def encode(text: str) -> list[int]:
        j, i, long = (int(x) for x in text.split())
        return [LONG if long else SHORT, 7 + j % 10, 7 + i % 10, 7 + i // 10 % 10]

    pusher.push(0, inflight, spec.kv)  # as sync.push_initial: the engine's labels are this run's versions
    timeline = Timeline()
    scorer = BatchScorer(RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=60), lambda ids: "")
    sent, lock, calls = [0], threading.Lock(), []
    t0 = timeline.now()
    worker = RolloutWorker(
        [_CountingClient(u, spec.long_tokens, spec.short_tokens, sent, lock, calls, timeline.now) for u in urls],
        schedule,
        problems=problems, encode=encode, sampling={"n": spec.samples, "max_tokens": spec.long_tokens},
        seed=lambda j: 1000 * (first + j), score=scorer, timeline=timeline, end=end, chunk_prompts=1,
        chunks_in_flight=in_flight_chunks,
        partial=PartialRollouts(spec.prompts, bound, abort_doomed) if inflight else None)
    gauges = _Gauges(urls, fleet.headers, timeline.now, gauge_s) if fleet is not None and gauge_s > 0 else None
    ends: list[float] = []
    trained: list[list[int]] = []
    dropped: list[tuple[int, int, int, int]] = []
    pushes: list[dict[str, Any]] = []
    keys: set[tuple[int, int]] = set()
    max_lag, spanning, last_before = 0, 0, None
    try:
        for step in range(spec.steps):
            before = schedule.push_at_step(step)  # `megarl.loop.push_point`, against the worker's end
            if before is not None and before < end:
                with timeline.span("trainer", "wait", f"push point {before}"):
                    worker.before_push(before)
                with timeline.span("push", "push", f"v{step}"):
                    pushes.append(pusher.push(step, inflight, spec.kv))
                worker.pushed(before, pushes[-1].pop("held_requests"))  # as `megarl train` passes them
                last_before = before
            batch = worker.take(step)
            metrics = worker.step_metrics()
            if inflight:
                for home, prompt in metrics["partial/groups"]:
                    if (home, prompt) in keys:
                        raise RuntimeError(f"group {(home, prompt)} trained twice")
                    keys.add((home, prompt))
                dropped += [(step, home, prompt, lag) for home, prompt, lag in metrics["partial/dropped"]]
            versions = batch.token_versions or []
            for tv in versions:
                max_lag = max(max_lag, *(step - v for v, _ in tv.runs)) if tv.runs else max_lag
                spanning += len(tv.runs) > 1
            if not versions:
                max_lag = max(max_lag, step - batch.policy_version)
            trained.append([len(r) for r in batch.response_ids])
            with timeline.span("trainer", "train", f"step {step}"):
                time.sleep(spec.train_s)
            ends.append(timeline.now())
        # drain the fleet (outside the measured window) so the next run starts on idle replicas
        if inflight:
            worker.quiesce(0)
            left = worker.pending()
            pooled = len(left.groups)  # type: ignore[union-attr]
        else:
            worker.quiesce(min(schedule.generation_limit(last_before), end))
            pooled = len(worker.pending()) * spec.prompts  # generated ahead, not trained
            keys = {(j, i) for j in range(spec.steps) for i in range(spec.prompts)}
        if lost := worker.lost():  # a replica that stopped answering: the two modes no longer share a fleet
            raise RuntimeError(f"{mode} (batches from {first}): replica(s) lost during the run, the measurement is "
                               f"void: {lost}")
        # every group the clients were asked for is trained (once), dropped, or finished and not taken yet
        accounted = {"started": sent[0], "trained": len(keys), "dropped": len(worker.dropped), "left": pooled}
        if sent[0] != len(keys) + len(worker.dropped) + pooled:
            raise RuntimeError(f"{mode}: groups not accounted for: {accounted}")
    finally:
        readings = gauges.stop() if gauges is not None else None
        worker.close()
    if max_lag > bound:
        raise RuntimeError(f"{mode}: a trained token lagged {max_lag} versions, past the bound {bound}")
    return summarize_run(spec, mode, first, t0, ends, timeline.spans(), len(urls), trained, dropped,
                         {"held_per_push": [p["held"] for p in pushes], "pushes": pushes, "max_token_lag": max_lag,
                          # of `dropped_total`: aborted while generating, and each response's length then
                          "aborted_groups": len(worker.aborted), "aborted": [list(a) for a in worker.aborted],
                          "responses_spanning": spanning, "bound": bound, "groups": accounted,
                          "arm": arm.name, "interval": arm.interval, "offset": arm.offset, "kv": arm.kv,
                          "refill": arm.refill, "chunks_in_flight": in_flight_chunks,
                          "gauge_readings": [len(r) for r in readings] if readings is not None else None},
                         calls, readings, fleet.slots if fleet is not None else 0)


def warmup_arms(arms: Sequence[Arm], spec: FleetBenchSpec) -> list[Arm]:
    """One warm-up arm per (refill, mode, KV mode) of `arms`, at the spec's own schedule (a queue at another
    schedule takes the same paths; its warm-up would only generate more batches past its two steps)."""
    seen = {(a.refill, a.mode, a.kv if a.mode != "queue" else ""): a for a in arms}
    return [replace(a, interval=spec.interval, offset=spec.offset) for a in seen.values()]


def round_order(arms: Sequence[Arm], r: int) -> list[Arm]:
    """Round `r`'s order: the arms as planned in even rounds, reversed in odd ones (drift in the machine's load hits
    them alike)."""
    return list(arms) if r % 2 == 0 else list(arms)[::-1]


def measure(spec: FleetBenchSpec, fleets: dict[str, BenchFleet], rounds: int, gauge_s: float = 0.0,
            after_round: Any = None) -> list[dict[str, Any]]:
    """The warm-up runs (discarded, `warmup_arms`), then `rounds` rounds of every arm (`round_order`), each on its
    refill setting's fleet; `after_round(runs)` after each round."""
    arms = spec.arms()
    runs: list[dict[str, Any]] = []
    for arm in warmup_arms(arms, spec):
        f = fleets[arm.refill]
        run_mode(spec, arm, (rounds + 1) * ROUND_BATCHES, f.urls, f.pusher, steps=2, fleet=f)
    for r in range(rounds):
        for arm in round_order(arms, r):
            f = fleets[arm.refill]
            runs.append(run_mode(spec, arm, r * ROUND_BATCHES, f.urls, f.pusher, fleet=f, gauge_s=gauge_s))
            w, e = spread(runs[-1]["step_walls_s"]), runs[-1]["engine"]
            print(f"round {r} {arm.name}: {runs[-1]['wall_per_batch_s']:.2f} s per batch (step walls median "
                  f"{w['median']:.2f}), {_f(runs[-1]['wall_per_trained_token_ms'])} ms per trained token, full run "
                  f"{runs[-1]['full_wall_s']:.1f} s, replica idle {runs[-1]['idle_share']:.0%}, engine running "
                  f"{_f(e['running'] if e else None, '.1f')} of {f.slots}, dropped {runs[-1]['dropped_groups']} "
                  f"(aborted {runs[-1]['aborted_groups']})", flush=True)
        if after_round is not None:
            after_round(runs)
    return runs


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = FleetBenchSpec()
    p = subparsers.add_parser(
        "inflight-fleet",
        help="in-flight weight updates + partial rollouts vs today's queue, measured on the real fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=2, help="tiny-model vLLM CPU replicas to start (TP 1 each)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts (groups) per batch, P")
    p.add_argument("--samples", type=int, default=d.samples, help="responses per prompt (K)")
    p.add_argument("--interval", type=int, default=d.interval, help="sync.interval (m)")
    p.add_argument("--offset", type=int, default=d.offset, help="sync.offset (n)")
    p.add_argument("--bound", type=int, default=None, help="staleness bound (algorithm.max_token_lag; default m+n-1)")
    p.add_argument("--steps", type=int, default=d.steps, help="trainer steps per run")
    p.add_argument("--skip", type=int, default=d.skip, help="first steps of each run left out of the figures")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each runs every arm on the same batches)")
    p.add_argument("--train-s", type=float, default=d.train_s, help="seconds a trainer step takes (a sleep)")
    p.add_argument("--long-share", type=float, default=d.long_share, help="share of prompts with long responses")
    p.add_argument("--max-tokens", type=int, default=d.long_tokens,
                   help="the long responses' length (prompt 4 tokens + this <= --positions)")
    p.add_argument("--positions", type=int, default=d.positions,
                   help="the tiny model's context (max_position_embeddings; rotary, so the pushed bytes are the same "
                        "at any context): raise it for long responses")
    p.add_argument("--short-tokens", type=int, default=d.short_tokens, help="the other responses' length")
    p.add_argument("--kv", choices=KV_MODES, nargs="+", default=[d.kv],
                   help="sync.inflight_kv of the in-flight arms: one arm per mode given (inflight, inflight_<kv>)")
    p.add_argument("--refill", choices=REFILLS, nargs="+", default=list(d.refills),
                   help="rollout.refill settings: every arm once per setting, on a fleet started for it "
                        "(sequences: --max-num-seqs = Config.sequence_slots(); arms named <arm>+seq)")
    p.add_argument("--control", choices=CONTROLS, nargs="+", default=list(d.controls),
                   help="the queue arms: at the schedule (m, n) ('schedule') and at the schedule whose maximum lag "
                        "is the in-flight bound, (m, bound - m + 1) ('lag': arm queue_lag, where it differs)")
    p.add_argument("--lag-interval", type=int, nargs="+", default=None,
                   help="with --control lag: the like-for-like queues' sync intervals M, each at (M, bound - M + 1) "
                        "(default: --interval alone; arms queue_lag, queue_lag_m<M>)")
    p.add_argument("--gauge-s", type=float, default=0.25,
                   help="seconds between readings of vLLM's running / waiting sequences on each replica (0: none)")
    p.add_argument("--doomed", choices=("abort", "finish", "both"), default=d.doomed,
                   help="in flight, a group known to be past the bound while it generates: abort it "
                        "(sync.inflight_abort_doomed=true) or let it finish and drop it then; both: a third mode, "
                        "inflight_finish, runs in each round on the same batches")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench_inflight_fleet.json"), help="JSON output")
    return p


def run(args: argparse.Namespace) -> int:
    kvs, refills = tuple(dict.fromkeys(args.kv)), tuple(dict.fromkeys(args.refill))
    spec = FleetBenchSpec(prompts=args.prompts, samples=args.samples, interval=args.interval, offset=args.offset,
                          bound=args.bound, steps=args.steps, skip=args.skip, train_s=args.train_s,
                          long_share=args.long_share, long_tokens=args.max_tokens, short_tokens=args.short_tokens,
                          kv=kvs[0], positions=args.positions, doomed=args.doomed, kvs=kvs, refills=refills,
                          controls=tuple(dict.fromkeys(args.control)),
                          lag_intervals=tuple(dict.fromkeys(args.lag_interval or ())))
    if (args.replicas < 1 or spec.prompts < 1 or spec.interval < 1 or spec.offset < 0 or not 0 <= spec.skip
            < spec.steps or args.rounds < 1 or not 0 <= spec.long_share <= 1 or spec.long_tokens + 4 > spec.positions
            or spec.staleness_bound < 0 or args.gauge_s < 0 or any(i < 1 for i in spec.lag_intervals)):
        print("megarl bench inflight-fleet: need --replicas, --prompts, --interval, --lag-interval, --rounds >= 1, "
              "--offset, "
              "--bound, --gauge-s >= 0, 0 <= --skip < --steps, --long-share in [0, 1], "
              f"--max-tokens <= --positions - 4 (= {spec.positions - 4})",
              file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_inflight_fleet_"))
    t0 = time.perf_counter()
    arms = spec.arms()
    print("arms: " + "; ".join(f"{a.name} ({a.mode}, sync ({a.interval}, {a.offset}), " + (
        f"bound {spec.staleness_bound}, KV {a.kv}" if a.mode != "queue" else f"max lag {a.max_lag}")
        + f", refill {a.refill})" for a in arms), flush=True)

    def write(runs: list[dict[str, Any]]) -> dict[str, Any]:
        summary = summarize_modes(runs)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                                 if k != "func"},
                                        "spec": asdict(spec), "arms": [asdict(a) for a in arms],
                                        "summary": summary, "runs": runs}, indent=1) + "\n")
        return summary

    try:
        runs = _on_fleet(spec, args.replicas, args.rounds, work_dir, args.gauge_s, write)
    except BaseException:
        print(f"megarl bench inflight-fleet failed: the replicas' logs are kept in {work_dir}", file=sys.stderr)
        raise
    shutil.rmtree(work_dir, ignore_errors=True)
    summary = write(runs)
    print(f"\nmeasured ({time.perf_counter() - t0:.0f} s): {args.replicas} replicas, {spec.prompts} prompts x "
          f"{spec.samples}, {spec.long_share:.0%} of prompts to {spec.long_tokens} tokens, the rest "
          f"{spec.short_tokens}; sync ({spec.interval}, {spec.offset}), bound {spec.staleness_bound}, trainer step "
          f"{spec.train_s} s, KV {', '.join(kvs)}, refill {', '.join(refills)}, doomed groups: {spec.doomed}; steps "
          f"{spec.skip}..{spec.steps - 1} of each run, {args.rounds} rounds")
    print(format_tables(spec, summary))
    print(f"wrote {args.out}")
    return 0


def _on_fleet(spec: FleetBenchSpec, replicas: int, rounds: int, work_dir: Path, gauge_s: float = 0.0,
              after_round: Any = None) -> list[dict[str, Any]]:
    """Start one fleet per refill setting (side by side, as `megarl train` starts it: `--max-num-seqs` from
    `Config.sequence_slots()`), a pusher for each, and `measure` on them."""
    from contextlib import ExitStack

    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.rollout.fleet import FleetSpec, launch
    from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, new_fleet_secret, read_secret

    model = make_tiny_checkpoint(work_dir / "tiny_moe", kind="moe", positions=spec.positions)
    secret = new_fleet_secret(work_dir)  # one secret for the bench's fleets: the clients send it (SECRET_ENV)
    os.environ[SECRET_ENV] = str(secret)
    with ExitStack() as stack:
        fleets: dict[str, BenchFleet] = {}
        for refill in spec.refills:
            cfg = bench_config(spec, replicas, refill, model)
            log_dir = work_dir / refill
            log_dir.mkdir(parents=True, exist_ok=True)
            print(f"starting {replicas} vLLM CPU replicas of the tiny MoE for rollout.refill={refill} (--max-num-seqs "
                  f"{cfg.sequence_slots() or 'vLLM default'}) ...", flush=True)
            fleet = stack.enter_context(launch(FleetSpec(model_dir=model, tp=1, replicas=replicas, log_dir=log_dir,
                                                         max_num_seqs=cfg.sequence_slots(), secret_file=secret)))
            pusher = _Pusher(fleet.urls, model, spec.kv)
            stack.callback(pusher.close)  # (closed before its fleet stops, the last pusher first)
            fleets[refill] = BenchFleet(fleet.urls, pusher, refill, cfg.rollout_chunks_in_flight(),
                                        cfg.sequence_slots() or
                                        cfg.rollout_chunks_in_flight() * spec.samples,  # groups: the chunks' sequences
                                        bearer_header(read_secret(secret)))
        try:
            return measure(spec, fleets, rounds, gauge_s, after_round)
        except BaseException:  # the replicas' logs (kept in the work directory): their ends
            for log in sorted(work_dir.glob("*/vllm_replica*.log")):
                tail = log.read_text(errors="replace").splitlines()[-80:]
                print(f"---- the last lines of {log.relative_to(work_dir)} ----", *tail, sep="\n", file=sys.stderr)
            raise
