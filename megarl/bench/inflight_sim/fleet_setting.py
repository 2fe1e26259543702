"""`megarl bench inflight-fleet`'s setting simulated (`megarl.bench.inflight_sim.simulation`), against what that bench
measured (`megarl bench inflight --fleet-check FILE...`): does the simulation predict the measured in-flight / queue
wall per batch, the drops and the length bias?

Each measured run (a `megarl bench inflight-fleet` JSON output: its mode, first batch and spec) is simulated on the
same batches (`FleetBenchSpec.set_lengths`), schedule, bound, group loops (`chunks_in_flight(P, R, 1)` a replica,
group slots) and trainer step (`train_s`: the bench's `--train-s`, or with `train='measured'` the run's own measured
mean train span), over the same steady steps. The assumptions:
  engine    fitted on the *queue* runs only, so that the simulated queue runs decode as many replica-seconds as the
            measured ones (a replica decodes while a request is in flight and no push pauses it); the in-flight
            runs are then predicted, not fitted. Three models (`Engine`): `step`, one constant a decode step whatever
            the replica holds; `tail+latency`, a decode step of `TAIL_STEP_S` (the tail's pace, measured by
            `megarl bench longtail`) plus a fixed latency per request (the call, the scheduling, the prefill), as
            extra decode steps of that request alone (it delays the request, not the others); `per-seq` (with a
            `megarl bench engine-step` file), a decode step of `scale x (a + b x N)` for N sequences running on the
            replica, the ratio b / a measured by that bench on one replica and only `scale` fitted.
  push      each run's own measured mean push seconds over its steady steps (an input: the simulation does not model
            the push's cost); as in the bench, the fleet generates and pushes up to batch `steps + m + n`.
  free      scoring and the KV re-prefill after a push (responses of 8-120 tokens on a tiny model).
`sweep` shows how the drops depend on the decode step's cost (no latency), under both batch orders. `what_if` runs a
file's runs on the `per-seq` engine and again on a flat step (no per-sequence part, the step the tail alone runs at).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.bench.dispatch_sim import EngineCosts
from megarl.bench.inflight_sim.simulation import InflightResult, simulate_inflight
from megarl.schedule import SyncSchedule

TAIL_STEP_S = 0.0045  # a decode step at the tail's pace: `megarl bench longtail`'s static split on the same replicas
#                       (2026-11-28, each on its own core) took 0.82-0.92 s a batch, which the simulation puts at 196
#                       decode steps (its longest share: a 256-token response after 16-token ones): 4.2-4.7 ms a step


KINDS = ("tail+latency", "step", "per-seq")


@dataclass(frozen=True)
class Engine:
    kind: str  # 'step' | 'tail+latency' | 'per-seq' | 'flat' (the what-if: a step that does not grow with N)
    step_s: float
    latency_steps: int = 0  # 'tail+latency': each request's latency, in decode steps of its own
    per_seq_s: float = 0.0  # 'per-seq': a decode step's extra cost per sequence running on the replica

    @property
    def costs(self) -> EngineCosts:
        return EngineCosts(step_s=self.step_s, per_seq_s=self.per_seq_s, prefill_per_seq_s=0.0)

    def describe(self) -> str:
        if self.kind in ("step", "flat"):
            return f"{self.step_s * 1e3:.1f} ms a decode step"
        if self.kind == "per-seq":
            return f"{self.step_s * 1e3:.2f} ms + {self.per_seq_s * 1e3:.3f} ms x N a decode step"
        return (f"{self.step_s * 1e3:.1f} ms a decode step + {self.latency_steps * self.step_s:.2f} s a request "
                f"({self.latency_steps} steps)")


def _spec(measured: dict[str, Any]):  # -> FleetBenchSpec
    """The bench's spec (fields it did not have yet take their defaults; fields this tree does not know are
    ignored: none of them changes the lengths, the schedule or the trainer step)."""
    from dataclasses import fields

    from megarl.bench.inflight_fleet import FleetBenchSpec

    known = {f.name for f in fields(FleetBenchSpec)}
    return FleetBenchSpec(**{k: v for k, v in measured["spec"].items() if k in known})


def base_arms(measured: dict[str, Any]) -> dict[str, Any]:
    """`measured` with only the runs of its spec's own arms (`queue` at the schedule, `inflight` and
    `inflight_finish` with the first KV mode, `rollout.refill: groups`: an arm named as its mode), which the
    simulation replays; the bench's other arms (another schedule, KV mode or refill) are left out."""
    return {**measured, "runs": [r for r in measured["runs"] if r.get("arm", r["mode"]) == r["mode"]]}


def simulate_run(measured: dict[str, Any], run: dict[str, Any], engine: Engine, order: str = "home",
                 doomed: str = "finish", train: str = "set") -> InflightResult:
    """Measured run `run` of the bench result `measured`, simulated (its mode, batches, schedule and push cost). The
    result's response lengths include the engine's latency steps (`trained` below takes them off)."""
    from megarl.config.schema import chunks_in_flight

    spec, replicas = _spec(measured), int(measured["args"]["replicas"])
    first, extra = run["first_batch"], engine.latency_steps
    end = spec.generated_batches  # the bench's worker generates (and pushes) past its last step
    return simulate_inflight(
        SyncSchedule(spec.interval, spec.offset), end, replicas,
        lambda j: [[n + extra for n in g] for g in spec.set_lengths(first + j)], engine.costs,
        train_s(measured, run, train),
        steady_push_s(measured, run), 0.0, chunks_in_flight(spec.prompts, replicas, 1), "groups", spec.staleness_bound,
        quiesce=run["mode"] == "queue", doomed=doomed, order=order)


def train_s(measured: dict[str, Any], run: dict[str, Any], train: str = "set") -> float:
    """The trainer step the simulation takes: the bench's `--train-s` (`set`), or the run's measured mean train span
    over its steady steps (`measured`: the sleep's span on the loaded machine, which overshoots: 2.6-2.8 s for a 2.0 s
    sleep in the long-response runs of 2026-11-29)."""
    if train == "set":
        return _spec(measured).train_s
    if train == "measured":
        return run["train_share"] * run["wall_per_batch_s"]
    raise ValueError(f"trainer step {train!r}: use 'set' or 'measured'")


def steady_push_s(measured: dict[str, Any], run: dict[str, Any]) -> float:
    """The mean of the run's measured pushes in its steady steps (the bench pushes at each step `push_at_step` names
    a batch below its end, `steps + m + n`; the initial push of version 0 is not in the list)."""
    spec = _spec(measured)
    schedule, end = SyncSchedule(spec.interval, spec.offset), spec.generated_batches
    at = [k for k in range(spec.steps) if (b := schedule.push_at_step(k)) is not None and b < end]
    if len(at) != len(run["pushes"]):
        raise ValueError(f"run from batch {run['first_batch']}: {len(run['pushes'])} pushes recorded, the schedule "
                         f"({spec.interval}, {spec.offset}) makes {len(at)} (a bench file of another version?)")
    return statistics.fmean(p["seconds"] for k, p in zip(at, run["pushes"], strict=True) if k >= spec.skip)


def trained(r: InflightResult, engine: Engine, first: int, last: int) -> list[int]:
    return [n - engine.latency_steps for n in r.trained_lengths(first, last)]


def decoding_s(r: InflightResult, first: int, last: int) -> float:
    """Replica-seconds decoding in steps [first, last): neither idle nor paused by a push (the bench's measure)."""
    lo, hi = r.window(first, last)
    paused = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in r.pushes)
    idle = r.replica_idle_fraction(first, last) * (hi - lo) * r.replicas
    return (hi - lo) * r.replicas - idle - paused * r.replicas


def read_engine_step(path: Path) -> float:
    """The ratio per_seq_s / step_s a `megarl bench engine-step` file measured."""
    data = json.loads(Path(path).read_text())
    if "per_seq_over_step" not in data:
        raise ValueError(f"{path}: no per_seq_over_step (not a `megarl bench engine-step --out` file?)")
    return float(data["per_seq_over_step"])


def calibrate(measured: dict[str, Any], kind: str, per_seq_ratio: float | None = None, train: str = "set") -> Engine:
    """The engine whose simulated queue runs decode the measured replica-seconds (the simulated decoding time grows
    with the step's cost and with the latency: bisection). `per-seq` needs `per_seq_ratio` (b / a): a decode step of
    N sequences costs `step_s x (1 + ratio x N)` seconds, `step_s` fitted (the measured a and b scaled alike)."""
    spec = _spec(measured)
    queue = [r for r in measured["runs"] if r["mode"] == "queue"]
    target = sum(x["decoding_s"] for r in queue for x in r["replicas"])

    def decoded(engine: Engine) -> float:
        return sum(decoding_s(simulate_run(measured, r, engine, train=train), spec.skip, spec.steps) for r in queue)

    if kind == "step":
        lo, hi = 1e-4, 0.1
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if decoded(Engine("step", mid)) < target else (lo, mid)
        return Engine("step", (lo + hi) / 2)
    if kind == "tail+latency":
        lo, hi = 0, 1000  # decode steps: the smallest latency that decodes at least the measured seconds
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if decoded(Engine(kind, TAIL_STEP_S, mid)) < target else (lo, mid)
        return Engine(kind, TAIL_STEP_S, lo)
    if kind == "per-seq":
        if per_seq_ratio is None or per_seq_ratio < 0:
            raise ValueError("engine 'per-seq' needs the ratio per_seq_s / step_s >= 0 of a `megarl bench engine-step` "
                             f"file (--engine-step FILE), got {per_seq_ratio}")
        lo, hi = 1e-5, 0.1
        for _ in range(40):
            mid = (lo + hi) / 2
            engine = Engine(kind, mid, per_seq_s=mid * per_seq_ratio)
            lo, hi = (mid, hi) if decoded(engine) < target else (lo, mid)
        step = (lo + hi) / 2
        return Engine(kind, step, per_seq_s=step * per_seq_ratio)
    raise ValueError(f"engine {kind!r}: use one of {', '.join(KINDS)}")


def _figures(measured: dict[str, Any], engine: Engine, order: str, doomed: str,
             train: str = "set") -> dict[tuple[str, int], dict]:
    spec = _spec(measured)
    k0, last = spec.skip, spec.steps
    out = {}
    for run in measured["runs"]:
        r = simulate_run(measured, run, engine, order, doomed, train)
        lo, hi = r.window(k0, last)
        lengths = trained(r, engine, k0, last)
        out[run["mode"], run["first_batch"]] = {
            "wall_per_batch_s": (hi - lo) / (last - k0),
            "dropped": sum(g.fate in ("dropped", "aborted") and g.taken_at is not None and g.taken_at >= k0
                           for g in r.groups),
            "trained_long": sum(n >= spec.long_tokens for n in lengths), "trained_mean": statistics.fmean(lengths),
            "wait_share": max(0.0, sum(s.wait_s for s in r.steps[k0:last]) / (hi - lo)),
            "pooled_mean": statistics.fmean(s.pooled for s in r.steps[k0:last])}  # scored groups at a take
    return out


def compare(measured: dict[str, Any], kind: str, order: str = "home", doomed: str = "finish",
            per_seq_ratio: float | None = None, train: str = "set") -> dict:
    """Each measured run next to its simulation (the engine fitted on the queue runs), and per round the in-flight /
    queue ratio of the wall per batch, measured and simulated."""
    engine = calibrate(measured, kind, per_seq_ratio, train)
    sim = _figures(measured, engine, order, doomed, train)
    rows = []
    for run in measured["runs"]:
        rows.append({"mode": run["mode"], "first_batch": run["first_batch"], "push_s": steady_push_s(measured, run),
                     "measured": {"wall_per_batch_s": run["wall_per_batch_s"], "dropped": run["dropped_groups"],
                                  "trained_long": run["lengths"]["trained"]["long"],
                                  "trained_mean": run["lengths"]["trained"]["mean"], "wait_share": run["wait_share"]},
                     "simulated": sim[run["mode"], run["first_batch"]]})
    by_key = {(x["mode"], x["first_batch"]): x for x in rows}
    sides = ("measured", "simulated")
    ratios = [{"first_batch": b, **{side: by_key["inflight", b][side]["wall_per_batch_s"]
                                    / by_key["queue", b][side]["wall_per_batch_s"] for side in sides}}
              for mode, b in by_key if mode == "inflight" and ("queue", b) in by_key]
    return {"order": order, "doomed": doomed, "train": train, "engine": engine.kind, "step_s": engine.step_s,
            "per_seq_s": engine.per_seq_s, "latency_steps": engine.latency_steps, "engine_text": engine.describe(),
            "rows": rows, "ratios": ratios}


def sweep(measured: dict[str, Any], steps_ms: tuple[float, ...] = (3, 4, 5, 6, 7, 8, 9, 10, 12)) -> list[dict]:
    """The in-flight runs' drops, long responses trained and the in-flight / queue ratios per decode step's cost (no
    latency), under both batch orders."""
    out = []
    for ms in steps_ms:
        engine = Engine("step", ms / 1e3)
        row: dict[str, Any] = {"step_ms": ms}
        for order in ("home", "completion"):
            sim = _figures(measured, engine, order, "finish")
            inflight = [v for (mode, _), v in sim.items() if mode == "inflight"]
            row[order] = {"dropped": sum(v["dropped"] for v in inflight),
                          "trained_long": sum(v["trained_long"] for v in inflight),
                          "ratios": [sim["inflight", b]["wall_per_batch_s"] / sim["queue", b]["wall_per_batch_s"]
                                     for mode, b in sim if mode == "inflight"]}
        out.append(row)
    return out


def what_if(measured: dict[str, Any], per_seq_ratio: float, order: str = "home", train: str = "set") -> dict:
    """The file's runs simulated on the `per-seq` engine fitted on its queue runs, and again on a flat step (GPU-like:
    a step's cost independent of N) of that engine's cost at N = K (one group's sequences: the tail alone on its
    replica), with the same pushes, trainer step and batches: per mode the wall per batch, drops and trained mean
    length, and the in-flight / queue ratio per round."""
    spec = _spec(measured)
    fitted = calibrate(measured, "per-seq", per_seq_ratio, train)
    flat = Engine("flat", fitted.step_s + fitted.per_seq_s * spec.samples)
    out: dict[str, Any] = {"order": order, "train": train, "bound": spec.staleness_bound,
                           "tail_sequences": spec.samples}
    for name, engine in (("per-seq", fitted), ("flat", flat)):
        sim = _figures(measured, engine, order, "finish", train)
        firsts = sorted({b for _, b in sim})
        modes = {mode: {"wall_per_batch_s": [sim[mode, b]["wall_per_batch_s"] for b in firsts],
                        "dropped": sum(sim[mode, b]["dropped"] for b in firsts),
                        "trained_long": sum(sim[mode, b]["trained_long"] for b in firsts),
                        "trained_mean": statistics.fmean(sim[mode, b]["trained_mean"] for b in firsts),
                        "wait_share": statistics.fmean(sim[mode, b]["wait_share"] for b in firsts)}
                 for mode in ("queue", "inflight")}
        out[name] = {"engine": engine.kind, "step_s": engine.step_s, "per_seq_s": engine.per_seq_s,
                     "engine_text": engine.describe(), **modes,
                     "ratios": [sim["inflight", b]["wall_per_batch_s"] / sim["queue", b]["wall_per_batch_s"]
                                for b in firsts]}
    return out


def fleet_check(paths: list[Path], kinds: tuple[str, ...] = ("tail+latency", "step"),
                engine_step: Path | None = None, trains: tuple[str, ...] = ("set",)) -> dict:
    """`compare` per measured file, engine model, batch order and trainer step (`trains`: `train_s`), and `sweep` per
    file; with `engine_step` (a `megarl bench engine-step` file) also the `per-seq` engine and, per file and trainer
    step, `what_if`."""
    ratio = read_engine_step(engine_step) if engine_step is not None else None
    if ratio is not None and "per-seq" not in kinds:
        kinds = (*kinds, "per-seq")
    out: dict[str, Any] = {"files": [], "engine_step": str(engine_step) if engine_step else None,
                           "per_seq_over_step": ratio}
    for path in paths:
        measured = base_arms(json.loads(Path(path).read_text()))
        spec = _spec(measured)
        out["files"].append({
            "file": str(path), "schedule": [spec.interval, spec.offset], "kv": spec.kv,
            "measured_inflight": {"dropped": sum(r["dropped_groups"] for r in measured["runs"]
                                                 if r["mode"] == "inflight"),
                                  "trained_long": sum(r["lengths"]["trained"]["long"] for r in measured["runs"]
                                                      if r["mode"] == "inflight")},
            "compare": [compare(measured, kind, order, per_seq_ratio=ratio, train=train) for train in trains
                        for kind in kinds for order in ("home", "completion")],
            "sweep": sweep(measured),
            **({"what_if": [what_if(measured, ratio, train=train) for train in trains]} if ratio is not None else {})})
    return out


def fleet_check_markdown(result: dict) -> str:
    lines = ["| file (schedule, KV) | engine, fitted on the queue runs | sim order | inflight / queue, per round: "
             "measured / sim | dropped: measured / sim | long trained (in-flight runs): measured / sim | "
             "trained mean length: measured / sim | trainer wait (in flight): measured / sim |",
             "|---|---|---|---|---|---|---|---|"]
    for f in result["files"]:
        for c in f["compare"]:
            inflight = [x for x in c["rows"] if x["mode"] == "inflight"]
            m = [x["measured"] for x in inflight]
            s = [x["simulated"] for x in inflight]
            ratios = ", ".join(f"{x['measured']:.2f} / {x['simulated']:.2f}" for x in c["ratios"])
            lines.append(
                f"| {Path(f['file']).name} ({tuple(f['schedule'])}, {f['kv']}) | {c['engine']}: {c['engine_text']}"
                f"{'' if c.get('train', 'set') == 'set' else '; trainer step as measured'} | "
                f"{c['order']} | {ratios} | {sum(x['dropped'] for x in m)} / {sum(x['dropped'] for x in s)} | "
                f"{sum(x['trained_long'] for x in m)} / {sum(x['trained_long'] for x in s)} | "
                f"{statistics.fmean(x['trained_mean'] for x in m):.1f} / "
                f"{statistics.fmean(x['trained_mean'] for x in s):.1f} | "
                f"{statistics.fmean(x['wait_share'] for x in m):.0%} / "
                f"{statistics.fmean(x['wait_share'] for x in s):.0%} |")
    sweep_ms = [f"{row['step_ms']:g} ms" for row in result["files"][0]["sweep"]]
    lines += ["", "The in-flight runs (both rounds) simulated by the decode step's cost, no latency; each cell: home "
              "order / completion order, as dropped groups; long responses trained:", "",
              "| file | measured | " + " | ".join(sweep_ms) + " |", "|---|---|" + "---|" * len(sweep_ms)]
    for f in result["files"]:
        cells = []
        for row in f["sweep"]:
            h, c = row["home"], row["completion"]
            cells.append(f"{h['dropped']}; {h['trained_long']} / {c['dropped']}; {c['trained_long']}")
        mi = f["measured_inflight"]
        lines.append(f"| {Path(f['file']).name} | {mi['dropped']}; {mi['trained_long']} | " + " | ".join(cells) + " |")
    if any("what_if" in f for f in result["files"]):
        lines += ["", "What if a decode step did not grow with N: each file's runs on the per-seq engine, and on a "
                  "flat step of that engine's cost at N = K (the tail alone), home order:", "",
                  "| file (bound) | engine | queue wall per batch, per round (s) | in-flight wall per batch (s) | "
                  "inflight / queue per round | dropped (in flight) | long trained (in flight) | trained mean length "
                  "(in flight) | trainer wait (in flight) |", "|---|---|---|---|---|---:|---:|---:|---:|"]
        for f in result["files"]:
            for w, name in ((w, name) for w in f.get("what_if", []) for name in ("per-seq", "flat")):
                e = w[name]
                q, i = e["queue"], e["inflight"]
                lines.append(
                    f"| {Path(f['file']).name} ({w['bound']}) | {name}: {e['engine_text']}"
                    f"{'' if w['train'] == 'set' else '; trainer step as measured'} | "
                    f"{', '.join(f'{x:.2f}' for x in q['wall_per_batch_s'])} | "
                    f"{', '.join(f'{x:.2f}' for x in i['wall_per_batch_s'])} | "
                    f"{', '.join(f'{x:.2f}' for x in e['ratios'])} | {i['dropped']} | {i['trained_long']} | "
                    f"{i['trained_mean']:.1f} | {i['wait_share']:.0%} |")
    return "\n".join(lines)
