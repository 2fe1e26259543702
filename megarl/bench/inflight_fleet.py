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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megarl.bench.longtail import LONG, SHORT, LongTailClient, long_prompts
from megarl.metrics.timeline import Span

MODES = ("queue", "inflight", "inflight_finish")  # inflight_finish: in flight with doomed groups left to finish
#                                                  (`--doomed both`: side by side with `inflight`, which aborts them)
ROUND_BATCHES = 1000  # round r's batches start at r x ROUND_BATCHES (both modes of a round share them)


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
    kv: str = "recompute"
    positions: int = 128  # the tiny model's context: the prompt (4 tokens) and the long responses must fit
    doomed: str = "abort"  # in flight, a group known to be past the bound while generating: 'abort' it
    #                        (`sync.inflight_abort_doomed`, the default) or let it 'finish' and drop it then
    #                        (bench files written before 2026-11-29 did the latter); 'both': the `inflight` runs
    #                        abort, and `inflight_finish` runs on the same batches let them finish

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.doomed == "both" else MODES[:2]

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


# ---- bookkeeping (pure) -------------------------------------------------------------------------------------------
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
                  extra: dict[str, Any], calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """One run's steady figures (steps `spec.skip`..): `trained[k]` the response lengths step k trained,
    `dropped` (step, home batch, prompt, lag) per group dropped, `calls` the clients' generate calls
    (`long_call_time`); batches are numbered from `first`."""
    k0 = spec.skip
    start, end = (ends[k0 - 1] if k0 else t0), ends[-1]
    walls = step_walls(t0, ends)[k0:]
    per_replica = replica_time(spans, start, end, replicas)
    sampled = [n for j in range(k0, spec.steps) for g in spec.set_lengths(first + j) for n in g]
    lost = [n for step, home, prompt, _ in dropped if step >= k0
            for n in spec.set_lengths(first + home)[prompt]]
    return {
        "mode": mode, "first_batch": first, "steps": spec.steps, "steady_steps": [k0, spec.steps],
        "wall_per_batch_s": (end - start) / (spec.steps - k0), "step_walls_s": walls,
        "replicas": per_replica, "idle_share": statistics.fmean(r["idle_share"] for r in per_replica),
        **trainer_time(spans, start, end),
        "dropped_groups": sum(step >= k0 for step, *_ in dropped), "dropped_total": len(dropped),
        "dropped": [list(d) for d in dropped],
        "lengths": length_accounting(sampled, [n for k in range(k0, spec.steps) for n in trained[k]], lost,
                                     spec.long_tokens),
        "long_calls": long_call_time(calls, spans, start, end, spec.long_tokens),
        **extra,
    }


def summarize_modes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode over its measured runs: wall per batch (the steps' walls pooled: median and spread; the runs' means),
    idle and wait shares, drops, lengths; and the paired ratio inflight / queue per round."""
    out: dict[str, Any] = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue
        trained = [r["lengths"]["trained"] for r in rs]
        sampled = [r["lengths"]["sampled"] for r in rs]
        out[mode] = {
            "runs": len(rs),
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
            "trained_mean_length": _weighted_mean(trained),
            "sampled_responses": sum(s["responses"] for s in sampled),
            "sampled_long": sum(s["long"] for s in sampled),
            "sampled_mean_length": _weighted_mean(sampled),
            "push_s": spread([p["seconds"] for r in rs for p in r["pushes"]]) if any(r["pushes"] for r in rs) else None,
            "held_requests_per_push": statistics.fmean(n for r in rs for n in r["held_per_push"])
            if any(r["held_per_push"] for r in rs) else 0.0,
            "max_token_lag": max(r["max_token_lag"] for r in rs),
            "responses_spanning_versions": sum(r["responses_spanning"] for r in rs),
            "long_calls": _long_call_medians([c for r in rs for c in r.get("long_calls", [])]),
        }
    for mode in MODES[1:]:  # `ratio_*` (inflight / queue), `inflight_finish_ratio_*`
        pairs = [(q, i) for q in runs if q["mode"] == "queue" for i in runs
                 if i["mode"] == mode and i["first_batch"] == q["first_batch"]]
        if pairs:
            key = "ratio" if mode == "inflight" else f"{mode}_ratio"
            out[f"{key}_per_round"] = [i["wall_per_batch_s"] / q["wall_per_batch_s"] for q, i in pairs]
            out[f"{key}_median"] = statistics.median(out[f"{key}_per_round"])
            out[f"{key}_of_medians"] = out[mode]["step_wall_s"]["median"] / out["queue"]["step_wall_s"]["median"]
    return out


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


def format_tables(spec: FleetBenchSpec, summary: dict[str, Any]) -> str:
    lines = [
        "| mode | step wall median (p10-p90) s | wall per batch, runs' means (s) | replica idle | trainer wait | "
        "push (share; median s) | requests held per push | dropped groups (aborted) | trained responses: long / all "
        "(mean length) | sampled: long / all (mean length) | max token lag |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for mode in MODES:
        if mode not in summary:
            continue
        m = summary[mode]
        w = m["step_wall_s"]
        lines.append(
            f"| {mode} | {w['median']:.2f} ({w['p10']:.2f}-{w['p90']:.2f}) | "
            f"{', '.join(f'{x:.2f}' for x in m['wall_per_batch_s'])} | {m['idle_share']:.0%} | {m['wait_share']:.0%} | "
            f"{m['push_share']:.0%}; {m['push_s']['median'] if m['push_s'] else 0:.2f} | "
            f"{m['held_requests_per_push']:.1f} | {m['dropped_groups']} ({m['aborted_groups']}) | "
            f"{m['trained_long']} / {m['trained_responses']} ({m['trained_mean_length']:.1f}) | "
            f"{m['sampled_long']} / {m['sampled_responses']} ({m['sampled_mean_length']:.1f}) | "
            f"{m['max_token_lag']} |")
    timed = [(mode, summary[mode]["long_calls"]) for mode in MODES if summary.get(mode, {}).get("long_calls")]
    if timed:
        lines += ["", "| mode | long responses timed (ran to their end) | wall each, median s | of which the fleet "
                  "paused for pushes, median s | the rest per token, median ms |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {mode} | {c['n']} | {c['wall_s']:.2f} | {c['paused_s']:.2f} | {c['decode_ms_per_token']:.2f} |"
                  for mode, c in timed]
    for mode in MODES[1:]:
        key = "ratio" if mode == "inflight" else f"{mode}_ratio"
        if f"{key}_per_round" in summary:
            per_round = ", ".join(f"{x:.2f}" for x in summary[f"{key}_per_round"])
            lines.append(f"\n{mode} / queue, wall per batch: per round {per_round} (median "
                         f"{summary[f'{key}_median']:.2f}); step walls' medians {summary[f'{key}_of_medians']:.2f}")
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

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        hf = read_hf_config(hf_dir)
        tensors = load_file(str(hf_dir / "model.safetensors"))
        self.slices = [(HFSlice.whole(name, tuple(t.shape)), t) for name, t in tensors.items()]
        self.sync = PartitionedWeightSync(0, 1, hf, [RolloutClient(u) for u in urls], rollout_tp=1,
                                          rollout_replicas=len(urls), store_host="127.0.0.1", store_port=free_port(),
                                          bucket_bytes=int(SyncConfig().bucket_mb * 2**20), timeout_s=300,
                                          inflight=True, inflight_kv=kv)  # type: ignore[arg-type]

    def push(self, version: int, inflight: bool) -> dict[str, Any]:
        """Push the weights as `version`, pausing in keep mode (`inflight`) or wait mode: the requests the pause held
        part-way (0 in wait mode) and the push's phases (`SyncStats.phases`, seconds)."""
        fleet = self.sync.fleet
        assert fleet is not None
        fleet.inflight = inflight
        stats = self.sync.push(self.slices, version)
        return {"held": sum(1 for counts in fleet.held.values() for n in counts.values() if n > 0),
                "held_requests": stats.held_requests,
                "seconds": stats.seconds, **{k: v for k, v in stats.phases.items() if k.endswith("_s")}}

    def close(self) -> None:
        import torch.distributed as dist

        self.sync.close()
        dist.destroy_process_group()


def run_mode(spec: FleetBenchSpec, mode: str, first: int, urls: list[str], pusher: _Pusher,
             steps: int | None = None) -> dict[str, Any]:
    """One run of `mode` on batches `first`.. (`steps` overrides spec.steps: the warm-up)."""
    from megarl.config.schema import chunks_in_flight
    from megarl.data.problem import Problem
    from megarl.metrics.timeline import Timeline
    from megarl.rewards.pool import RewardPool
    from megarl.rewards.scoring import BatchScorer
    from megarl.rollout.worker import PartialRollouts, RolloutWorker
    from megarl.schedule import SyncSchedule

    spec = spec if steps is None else FleetBenchSpec(**{**asdict(spec), "steps": steps, "skip": 0})
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

    pusher.push(0, inflight)  # as sync.push_initial: the engine's labels are this run's versions
    timeline = Timeline()
    scorer = BatchScorer(RewardPool("megarl.rewards.exact_match:exact_match", workers=1, timeout_s=60), lambda ids: "")
    sent, lock, calls = [0], threading.Lock(), []
    t0 = timeline.now()
    worker = RolloutWorker(
        [_CountingClient(u, spec.long_tokens, spec.short_tokens, sent, lock, calls, timeline.now) for u in urls],
        schedule,
        problems=problems, encode=encode, sampling={"n": spec.samples, "max_tokens": spec.long_tokens},
        seed=lambda j: 1000 * (first + j), score=scorer, timeline=timeline, end=end, chunk_prompts=1,
        chunks_in_flight=chunks_in_flight(spec.prompts, len(urls), 1),
        partial=PartialRollouts(spec.prompts, bound, abort_doomed) if inflight else None)
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
                    pushes.append(pusher.push(step, inflight))
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
        worker.close()
    if max_lag > bound:
        raise RuntimeError(f"{mode}: a trained token lagged {max_lag} versions, past the bound {bound}")
    return summarize_run(spec, mode, first, t0, ends, timeline.spans(), len(urls), trained, dropped,
                         {"held_per_push": [p["held"] for p in pushes], "pushes": pushes, "max_token_lag": max_lag,
                          # of `dropped_total`: aborted while generating, and each response's length then
                          "aborted_groups": len(worker.aborted), "aborted": [list(a) for a in worker.aborted],
                          "responses_spanning": spanning, "bound": bound, "groups": accounted}, calls)


def measure(spec: FleetBenchSpec, urls: list[str], hf_dir: Path, rounds: int) -> list[dict[str, Any]]:
    """The warm-up runs (discarded), then `rounds` rounds of both modes in alternating order."""
    pusher = _Pusher(urls, hf_dir, spec.kv)
    runs = []
    try:
        for mode in spec.modes:
            run_mode(spec, mode, (rounds + 1) * ROUND_BATCHES, urls, pusher, steps=2)
        for r in range(rounds):
            for mode in (spec.modes if r % 2 == 0 else spec.modes[::-1]):
                runs.append(run_mode(spec, mode, r * ROUND_BATCHES, urls, pusher))
                w = spread(runs[-1]["step_walls_s"])
                print(f"round {r} {mode}: {runs[-1]['wall_per_batch_s']:.2f} s per batch (step walls median "
                      f"{w['median']:.2f}), replica idle {runs[-1]['idle_share']:.0%}, dropped "
                      f"{runs[-1]['dropped_groups']}", flush=True)
    finally:
        pusher.close()
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
    p.add_argument("--rounds", type=int, default=2, help="rounds (each runs both modes on the same batches)")
    p.add_argument("--train-s", type=float, default=d.train_s, help="seconds a trainer step takes (a sleep)")
    p.add_argument("--long-share", type=float, default=d.long_share, help="share of prompts with long responses")
    p.add_argument("--max-tokens", type=int, default=d.long_tokens,
                   help="the long responses' length (prompt 4 tokens + this <= --positions)")
    p.add_argument("--positions", type=int, default=d.positions,
                   help="the tiny model's context (max_position_embeddings; rotary, so the pushed bytes are the same "
                        "at any context): raise it for long responses")
    p.add_argument("--short-tokens", type=int, default=d.short_tokens, help="the other responses' length")
    p.add_argument("--kv", choices=("recompute", "keep"), default=d.kv, help="sync.inflight_kv of the in-flight mode")
    p.add_argument("--doomed", choices=("abort", "finish", "both"), default=d.doomed,
                   help="in flight, a group known to be past the bound while it generates: abort it "
                        "(sync.inflight_abort_doomed=true) or let it finish and drop it then; both: a third mode, "
                        "inflight_finish, runs in each round on the same batches")
    p.add_argument("--out", type=Path, default=Path("runs/bench/bench_inflight_fleet.json"), help="JSON output")
    return p


def run(args: argparse.Namespace) -> int:
    spec = FleetBenchSpec(prompts=args.prompts, samples=args.samples, interval=args.interval, offset=args.offset,
                          bound=args.bound, steps=args.steps, skip=args.skip, train_s=args.train_s,
                          long_share=args.long_share, long_tokens=args.max_tokens, short_tokens=args.short_tokens,
                          kv=args.kv, positions=args.positions, doomed=args.doomed)
    if (args.replicas < 1 or spec.prompts < 1 or spec.interval < 1 or spec.offset < 0 or not 0 <= spec.skip
            < spec.steps or args.rounds < 1 or not 0 <= spec.long_share <= 1 or spec.long_tokens + 4 > spec.positions):
        print("megarl bench inflight-fleet: need --replicas, --prompts, --interval, --rounds >= 1, --offset >= 0, "
              "0 <= --skip < --steps, --long-share in [0, 1], "
              f"--max-tokens <= --positions - 4 (= {spec.positions - 4})",
              file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_inflight_fleet_"))
    t0 = time.perf_counter()
    try:
        runs = _on_fleet(spec, args.replicas, args.rounds, work_dir)
    except BaseException:
        print(f"megarl bench inflight-fleet failed: the replicas' logs are kept in {work_dir}", file=sys.stderr)
        raise
    shutil.rmtree(work_dir, ignore_errors=True)
    summary = summarize_modes(runs)
    print(f"\nmeasured ({time.perf_counter() - t0:.0f} s): {args.replicas} replicas, {spec.prompts} prompts x "
          f"{spec.samples}, {spec.long_share:.0%} of prompts to {spec.long_tokens} tokens, the rest "
          f"{spec.short_tokens}; sync ({spec.interval}, {spec.offset}), bound {spec.staleness_bound}, trainer step "
          f"{spec.train_s} s, KV {spec.kv}, doomed groups: {spec.doomed}; steps {spec.skip}..{spec.steps - 1} of "
          f"each run, {args.rounds} rounds")
    print(format_tables(spec, summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                             if k != "func"},
                                    "spec": asdict(spec), "summary": summary, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _on_fleet(spec: FleetBenchSpec, replicas: int, rounds: int, work_dir: Path) -> list[dict[str, Any]]:
    from megarl.models.tiny import make_tiny_checkpoint
    from megarl.rollout.fleet import FleetSpec, launch
    from megarl.rollout.fleet_auth import SECRET_ENV

    model = make_tiny_checkpoint(work_dir / "tiny_moe", kind="moe", positions=spec.positions)
    print(f"starting {replicas} vLLM CPU replicas of the tiny MoE ...", flush=True)
    with launch(FleetSpec(model_dir=model, tp=1, replicas=replicas, log_dir=work_dir)) as fleet:
        os.environ[SECRET_ENV] = str(fleet.secret_file)  # the clients send the fleet's secret
        try:
            return measure(spec, fleet.urls, model, rounds)
        except BaseException:  # the replicas' logs (kept in the work directory): their ends
            for log in sorted(work_dir.glob("vllm_replica*.log")):
                tail = log.read_text(errors="replace").splitlines()[-80:]
                print(f"---- the last lines of {log.name} ----", *tail, sep="\n", file=sys.stderr)
            raise
