"""`megarl bench longtail`'s setting (its defaults: 2 replicas, 16 prompts x 4, 10 % to 256 tokens), in decode
steps: the bench's static and queue windows (`megarl.bench.dispatch_sim`) next to one run of today's queue and of
in-flight pushes with partial rollouts (`megarl.bench.inflight_sim.simulation`) on the same batches."""

from __future__ import annotations

import statistics

from megarl.bench.dispatch_sim import EngineCosts
from megarl.bench.inflight_sim.simulation import simulate_inflight
from megarl.schedule import SyncSchedule

UNIT_STEP = EngineCosts(step_s=1.0, per_seq_s=0.0, prefill_per_seq_s=0.0)  # seconds = decode steps


def bench_setting(windows: int = 4, window: int = 4, replicas: int = 2, prompts: int = 16, samples: int = 4,
                  long_share: float = 0.1, long_tokens: int = 256, short_tokens: int = 16,
                  costs: EngineCosts = UNIT_STEP, doomed: str = "finish", order: str = "home") -> dict:
    """`megarl bench longtail`'s task (the same batches: `longtail.long_prompts`), windows 1..`windows` of `window`
    batches on `replicas` replicas: static and queue per window as the bench runs them (`dispatch_sim`), and the
    same batches as one run with no trainer cost, pushes of no cost at each window (`sync (window, 0)`): today's
    queue (`quiesce`) and in-flight + partial rollouts (bound window - 1), group loops as the bench's queue
    (ceil(P / R) chunks of one prompt in flight). With `UNIT_STEP` every second is one decode step."""
    from megarl.bench.dispatch_sim import simulate_window
    from megarl.bench.longtail import long_prompts
    from megarl.config.schema import chunks_in_flight

    def batch(j: int) -> list[list[int]]:
        return [[long_tokens if long else short_tokens] * samples for long in long_prompts(j, prompts, long_share)]

    flight = chunks_in_flight(prompts, replicas, 1)
    per_window = {"static": [], "queue": []}
    for w in range(1, windows + 1):
        b = [batch(j) for j in range(w * window, (w + 1) * window)]
        per_window["static"].append(simulate_window(b, replicas, "static", costs).wall_s)
        per_window["queue"].append(simulate_window(b, replicas, "queue", costs, 1, flight).wall_s)
    steps = (windows + 1) * window
    runs = []
    for name, offset, bound, quiesce in (
        (f"today's queue, sync ({window}, 0)", 0, None, True),
        (f"in-flight, sync ({window}, 0), bound {window - 1}", 0, None, False),
        (f"in-flight, sync ({window}, 0), bound {window}", 0, window, False),
        (f"in-flight, sync ({window}, 1), bound {window}", 1, None, False),
    ):
        r = simulate_inflight(SyncSchedule(window, offset), steps, replicas, batch, costs, 0.0, 0.0, 0.0, flight,
                              "groups", bound, quiesce=quiesce, doomed=doomed, order=order)
        lo, hi = r.window(window, steps)
        runs.append({"run": name, "per_batch": (hi - lo) / (steps - window), "dropped": r.dropped,
                     "aborted": r.aborted, "replica_idle": r.replica_idle_fraction(window, steps),
                     "max_lag": max(r.lag_histogram(window, steps)),
                     "trained_mean_length": statistics.fmean(r.trained_lengths(window, steps)),
                     "long_responses_trained": sum(n == long_tokens for n in r.trained_lengths(window, steps))})
    stream = [n for j in range(window, steps) for g in batch(j) for n in g]
    return {
        "stream_mean_length": statistics.fmean(stream),
        "stream_long_responses": sum(n == long_tokens for n in stream),
        "static_per_batch": sum(per_window["static"]) / (windows * window),
        "queue_per_batch": sum(per_window["queue"]) / (windows * window),
        "static_windows": per_window["static"], "queue_windows": per_window["queue"], "runs": runs,
    }
