"""What every part of the pipeline was doing, when: spans on named lanes, and the figures drawn from them.

Lanes: `replica <r>` (kind `generate`, one span per batch share), `trainer` (`wait` for data, `train`: the
step's own work, `startup` of the rollout worker, `checkpoint`), `push` (`push`, one span per weight sync; the
fleet is paused for its duration), `reward` (`score`).
Times are seconds since the timeline's start (`time.perf_counter`), recorded by rank 0's threads.

The run's overlap figure is `(generation busy + training busy) / wall`, where generation busy is the time
at least one replica was generating: 1.0 means the two sides took turns with no idle time, 2.0 that
both were busy all the time.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Span:
    lane: str  # "replica 0", "trainer", "push", "reward"
    kind: str  # "generate", "wait", "train", "push", "score"
    start: float  # seconds since the timeline's start
    end: float
    label: str = ""  # e.g. "batch 7", "step 3", "v4"


class Timeline:
    """A thread-safe recorder of spans."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add(self, lane: str, kind: str, start: float, end: float, label: str = "") -> None:
        with self._lock:
            self._spans.append(Span(lane, kind, start, end, label))

    @contextmanager
    def span(self, lane: str, kind: str, label: str = "") -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, kind, start, self.now(), label)

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def save(self, path: Path) -> None:
        tmp = Path(path).with_suffix(".json.tmp")
        tmp.write_text(json.dumps([asdict(s) for s in self.spans()]))
        tmp.replace(path)


def load_spans(path: Path) -> list[Span]:
    return [Span(**s) for s in json.loads(Path(path).read_text())]


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy_seconds(spans: Iterable[Span], kind: str, start: float = 0.0, end: float = float("inf"),
                 lane: str | None = None) -> float:
    """Seconds inside [start, end) covered by at least one span of `kind` (on `lane`, or on any lane)."""
    clipped = ((max(s.start, start), min(s.end, end)) for s in spans
               if s.kind == kind and (lane is None or s.lane == lane))
    return sum(b - a for a, b in _merged((a, b) for a, b in clipped if b > a))


def replica_lanes(spans: Iterable[Span]) -> list[str]:
    return sorted({s.lane for s in spans if s.lane.startswith("replica ")}, key=lambda lane: int(lane.split()[1]))


def window_metrics(spans: list[Span], start: float, end: float, lanes: list[str]) -> dict[str, float]:
    """Per-replica (`lanes`) generating / paused (for a push) / idle seconds inside one window [start, end)."""
    out: dict[str, float] = {}
    paused = busy_seconds(spans, "push", start, end)
    for lane in lanes:
        generating = busy_seconds(spans, "generate", start, end, lane=lane)
        key = lane.replace(" ", "")
        out[f"fleet/{key}/generating_s"] = generating
        out[f"fleet/{key}/paused_s"] = paused
        out[f"fleet/{key}/idle_s"] = max(0.0, (end - start) - generating - paused)
    return out


def step_times(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Where one step's wall time [start, end) went: the trainer's waits, pushes and training, each replica's."""
    within = [s for s in spans if s.end > start and s.start < end]
    seconds = {k: sum(min(s.end, end) - max(s.start, start) for s in within if s.lane == lane and s.kind == kind)
               for k, lane, kind in (("wait_for_data", "trainer", "wait"), ("push", "push", "push"),
                                     ("train", "trainer", "train"), ("eval", "trainer", "eval"))}
    return {"time/step_s": end - start, **{f"time/{k}_s": v for k, v in seconds.items()},
            **window_metrics(within, start, end, replica_lanes(spans))}


def overlap_summary(spans: list[Span], wall_s: float) -> dict[str, Any]:
    """The run's overlap figure and where the time went (fractions of the wall time)."""
    generation = busy_seconds(spans, "generate")
    training = busy_seconds(spans, "train")
    waiting = busy_seconds(spans, "wait")
    pushing = busy_seconds(spans, "push")
    scoring = busy_seconds(spans, "score")
    out: dict[str, Any] = {
        "pipeline/wall_s": wall_s,
        "pipeline/overlap": (generation + training) / wall_s if wall_s > 0 else None,
        "pipeline/generation_busy_s": generation,
        "pipeline/train_busy_s": training,
        "pipeline/trainer_wait_s": waiting,
        "pipeline/push_s": pushing,
        "pipeline/reward_busy_s": scoring,
    }
    for lane in replica_lanes(spans):
        out[f"pipeline/{lane.replace(' ', '')}_busy_fraction"] = (
            busy_seconds(spans, "generate", lane=lane) / wall_s if wall_s > 0 else None)
    return out


def describe(summary: dict[str, Any]) -> str:
    """One line for the CLI: the overlap and where the trainer's and the fleet's time went."""
    wall = summary.get("pipeline/wall_s") or 0.0
    if not wall:
        return "no timeline recorded"

    def pct(key: str) -> str:
        return f"{100 * summary[key] / wall:.0f}%"

    return (f"overlap {summary['pipeline/overlap']:.2f} over {wall:.0f}s: trainer trained "
            f"{pct('pipeline/train_busy_s')}, waited for data {pct('pipeline/trainer_wait_s')}, "
            f"pushed {pct('pipeline/push_s')}; fleet generated {pct('pipeline/generation_busy_s')} of the time")
