"""`megarl bench pipeline`: what the overlapped pipeline buys, measured, then simulated and projected.

One fleet is started (or `--fleet-url` reused) and the same short job (a config, `--steps` steps) runs with the
pipeline off (`rollout.overlap=false`: the sequential controller) and on, for each `--offsets` value, after one
discarded warm-up run. For every run it prints wall seconds per step (the steps after the first), the overlap
figure `(generation busy + training busy) / wall` and where the trainer's time went. It then checks the
discrete-event simulation (`megarl.bench.pipeline_sim`) against the measurement: fed with the stage durations
measured in a run, it must reproduce that run's wall time. The off run's durations also give the
contention-free prediction of the on run (what overlap would buy if fleet and trainer did not share cores).
Last, the GPU-cluster projection (Qwen3-30B-A3B, REC B.7 batch; assumptions in `pipeline_sim`).

Writes `--out` (JSON) and a bar chart beside it (.png), and the on/off timelines of one offset.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from megarl.bench.pipeline_sim import StageTimes, projection_table, simulate
from megarl.metrics.timeline import Span, busy_seconds, load_spans, overlap_summary
from megarl.schedule import VersionClock


def stage_times(spans: list[Span]) -> StageTimes:
    """The durations a run measured, as simulator input: each replica's share of each batch (the seconds it was
    generating chunks of that batch; 0 if it took none), each batch's scoring, each step's training (looked up by
    label), and the mean push."""
    generate: dict[tuple[int, int], list[Span]] = {}
    score: dict[int, float] = {}
    train: dict[int, float] = {}
    pushes = []
    for s in spans:
        number = int(s.label.split()[-1]) if s.label.split() and s.label.split()[-1].isdigit() else -1
        if s.kind == "generate":
            generate.setdefault((int(s.lane.split()[1]), number), []).append(s)
        elif s.kind == "score":
            score[number] = s.end - s.start
        elif s.kind == "train":
            train[number] = s.end - s.start
        elif s.kind == "push":
            pushes.append(s.end - s.start)
    return StageTimes(generate=lambda r, j: busy_seconds(generate.get((r, j), []), "generate"),
                      score=lambda j: score[j], train=lambda k: train[k],
                      push=statistics.fmean(pushes) if pushes else 0.0)


def _steady_step_s(records: list[dict[str, Any]]) -> float:
    """Mean wall seconds of the steps after the first (which also waits for the first batch)."""
    later = [r["time/step_s"] for r in records[1:]] or [r["time/step_s"] for r in records]
    return statistics.fmean(later)


def run_job(cfg_path: str | None, overrides: list[str], fleet_urls: list[str]) -> dict[str, Any]:
    """Run the job `cfg_path` + `overrides` against a running fleet; its config, records, spans, summary, run dir."""
    from megarl.launch import prepare, train

    cfg = prepare(cfg_path, overrides)
    summary = train(cfg, fleet_urls=fleet_urls)
    run_dir = Path(cfg.run.dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spans = load_spans(run_dir / "timeline.json")
    return {"cfg": cfg, "records": records, "spans": spans, "summary": summary, "run_dir": run_dir}


def _simulated_wall(run: dict[str, Any], times: StageTimes, overlap: bool) -> float:
    """The simulated wall time of `run`'s job, plus its measured start-up of the rollout worker (tokenizer,
    reward processes), which the simulation does not model: generation cannot start before it ends."""
    cfg = run["cfg"]
    sim = simulate(VersionClock.from_config(cfg).schedule, cfg.run.steps, cfg.rollout.replicas, times,
                   overlap=overlap, push_initial=True)
    return sim.wall + sum(s.end - s.start for s in run["spans"] if s.kind == "startup")


def measure(cfg_path: str | None, overrides: list[str], steps: int, offsets: list[int], work_dir: Path,
            fleet_urls: list[str] | None) -> dict[str, Any]:
    """Run the warm-up, then off/on for every offset; returns the rows of the table (and keeps the runs)."""
    from contextlib import nullcontext

    from megarl.launch import prepare
    from megarl.rollout.run_fleet import start_fleet

    base = prepare(cfg_path, overrides, create_run_dir=False)
    common = [*overrides, f"run.steps={steps}", "sync.push_initial=true", "run.overwrite=true",
              "checkpoint.interval=0"]
    rows, runs = [], {}
    with (start_fleet(base, log_dir=work_dir) if fleet_urls is None else nullcontext()) as fleet:
        urls = fleet_urls or fleet.urls
        print("warm-up run (discarded) ...", flush=True)
        run_job(cfg_path, [*common, "run.steps=2", f"run.dir={work_dir / 'warmup'}"], urls)
        for offset in offsets:
            for overlap in (False, True):
                name = f"offset{offset}_{'on' if overlap else 'off'}"
                print(f"run {name} ...", flush=True)
                runs[name] = run_job(cfg_path, [*common, f"sync.offset={offset}",
                                                 f"rollout.overlap={str(overlap).lower()}",
                                                 f"run.dir={work_dir / name}"], urls)
            off, on = runs[f"offset{offset}_off"], runs[f"offset{offset}_on"]
            for overlap, run in ((False, off), (True, on)):
                wall = run["summary"]["pipeline/wall_s"]
                rows.append({
                    "interval": run["cfg"].sync.interval, "offset": offset, "pipeline_on": overlap, "steps": steps,
                    "wall_s": wall, "wall_per_step_s": wall / steps, "steady_step_s": _steady_step_s(run["records"]),
                    **{k.removeprefix("pipeline/"): v for k, v in overlap_summary(run["spans"], wall).items()},
                    # the simulation fed with this run's own stage durations must give its wall time back
                    "simulated_wall_s": _simulated_wall(run, stage_times(run["spans"]), overlap),
                    # the on run predicted from the off run's (uncontended) stage durations
                    "contention_free_wall_s": _simulated_wall(run, stage_times(off["spans"]), overlap),
                })
    return {"config": cfg_path, "overrides": overrides, "replicas": base.rollout.replicas,
            "interval": base.sync.interval, "rows": rows, "runs": runs}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["sync (m,n) pipeline | s/step  steady s/step | overlap | trainer: train  wait  push | fleet busy | "
             "simulated s/step (err) | contention-free s/step",
             "-" * 140]
    for r in rows:
        wall = r["wall_s"]
        lines.append(
            f"({r['interval']},{r['offset']})      {'on ' if r['pipeline_on'] else 'off'}     | "
            f"{r['wall_per_step_s']:6.2f} "
            f"{r['steady_step_s']:8.2f}      | {r['overlap']:6.2f}  | {r['train_busy_s'] / wall:12.0%} "
            f"{r['trainer_wait_s'] / wall:5.0%} {r['push_s'] / wall:5.0%} | {r['generation_busy_s'] / wall:9.0%}  | "
            f"{r['simulated_wall_s'] / r['steps']:8.2f} ({(r['simulated_wall_s'] - wall) / wall:+.1%})       | "
            f"{r['contention_free_wall_s'] / r['steps']:8.2f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offsets = sorted({r["offset"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for i, (overlap, colour) in enumerate(((False, "tab:grey"), (True, "tab:green"))):
        mine = {r["offset"]: r for r in rows if r["pipeline_on"] == overlap}
        xs = [o + (i - 0.5) * 2 * width for o in offsets]
        ax.bar(xs, [mine[o]["wall_per_step_s"] for o in offsets], 2 * width * 0.9, color=colour,
               label=f"pipeline {'on' if overlap else 'off'} (measured)")
        ax.scatter(xs, [mine[o]["simulated_wall_s"] / mine[o]["steps"] for o in offsets], color="black",
                   marker="_", s=300, zorder=3, label="simulated from measured stages" if i else None)
        if overlap:
            ax.scatter(xs, [mine[o]["contention_free_wall_s"] / mine[o]["steps"] for o in offsets],
                       color="tab:blue", marker="*", s=80, zorder=3, label="on, predicted from off's stages")
    ax.set_xticks(offsets, [f"sync_offset {o}" for o in offsets])
    ax.set_ylabel("wall seconds per step")
    ax.set_title(f"megarl bench pipeline (sync interval {rows[0]['interval']}, {rows[0]['steps']} steps, CPU)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pipeline", help="the same short job with the overlapped pipeline off and on",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo_moe.yaml", help="the job to run (default: the demo)")
    p.add_argument("--steps", type=int, default=8, help="steps per run")
    p.add_argument("--offsets", type=int, nargs="+", default=[0, 1, 2], help="sync.offset values")
    p.add_argument("--interval", type=int, default=None, help="sync.interval (default: the config's)")
    p.add_argument("--fleet-url", action="append", default=None,
                   help="reuse a running fleet serving the config's model (repeat per replica)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench_pipeline.json"),
                   help="JSON output; a bar chart (.png) and two timelines go next to it")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides of the job")
    return p


def run(args: argparse.Namespace) -> int:
    from megarl.config.load import ConfigError

    if args.steps < 2:
        print("megarl bench pipeline: --steps must be at least 2 (the first step is reported apart)", file=sys.stderr)
        return 2
    overrides = list(args.overrides) + ([f"sync.interval={args.interval}"] if args.interval else [])
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_pipeline_"))
    try:
        result = measure(args.config, overrides, args.steps, list(args.offsets), work_dir, args.fleet_url)
    except ConfigError as err:
        print(f"megarl bench pipeline: {err}", file=sys.stderr)
        return 2
    rows = result["rows"]
    print(format_table(rows))
    print("\nGPU-cluster projection (Qwen3-30B-A3B, REC B.7 batch; assumptions in megarl/bench/pipeline_sim.py):")
    table = projection_table()
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shown = 1 if 1 in args.offsets else args.offsets[0]
    for mode in ("off", "on"):  # the timelines of one offset, for the docs
        shutil.copy(result["runs"][f"offset{shown}_{mode}"]["run_dir"] / "timeline.png",
                    args.out.with_name(f"{args.out.stem}_timeline_offset{shown}_{mode}.png"))
    args.out.write_text(json.dumps({"config": args.config, "overrides": overrides, "steps": args.steps,
                                    "rows": rows, "projection_markdown": table}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    shutil.rmtree(work_dir, ignore_errors=True)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')} and the offset-{shown} timelines")
    return 0
