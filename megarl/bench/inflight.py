"""`megarl bench inflight`: in-flight weight updates with partial rollouts, projected (no fleet, pure simulation).

`megarl.bench.inflight_sim` simulates a push that does not wait for the tail: every replica pauses for the push
(requests stay in the engine), generates on with the new version, unfinished groups join a later batch; a batch
is formed from complete groups -- by default megarl's rule (`megarl.rollout.partial`): the finished groups of the
lowest (home batch, prompt); `--order completion`: the first to finish (AReaL's, megarl's first) -- and a group whose
oldest token would be trained past the staleness bound (default m + n - 1) is dropped and counted (by default
generated to its end and then dropped, as megarl with `sync.inflight_abort_doomed=false`; `--doomed abort`: aborted
as soon as it is doomed, megarl's default since 2026-11-29). Same engine model
and constants as `megarl bench pipeline`'s and `megarl bench longtail`'s projections (`megarl.bench.pipeline_sim`,
`megarl.bench.dispatch_sim`).

Prints, per length model (per-sample, per-prompt):
  the 30B projection (Qwen3-30B-A3B, 8 replicas x TP 4 + 32 trainer GPUs, 72 x 16 responses up to 8,192 tokens):
  steady seconds per step against the sequential controller, today's best pipelined schedule and a colocated
  synchronous baseline on the same 64 GPUs; trainer and replica idle, engine occupancy, the per-token lag
  distribution, dropped groups and the length bias; today's queue on the same engine model as the control;
then `megarl bench longtail`'s setting (2 replicas, 16 x 4, 10 % of prompts to 256 tokens) in decode steps.
Writes `--out` (JSON).

`--fleet-check FILE...` runs instead the simulation against measured `megarl bench inflight-fleet` results
(`megarl.bench.inflight_sim.fleet_setting`: each measured run simulated in its setting, the engine fitted on the
queue runs) and writes `--out` (default runs/bench/inflight_sim_vs_fleet.json); `--engine-step FILE` (a `megarl
bench engine-step` result) adds a third engine, whose decode step grows with the sequences running, and the what-if
of a step that does not.
The assumptions are named in the JSON and in docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inflight",
        help="in-flight weight updates + partial rollouts, projected: vs sequential, today's queue, colocated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=64, help="trainer steps per simulated run (steady: [K/4, 3K/4))")
    p.add_argument("--lengths", nargs="+", choices=("per-sample", "per-prompt"), default=["per-sample", "per-prompt"],
                   help="response-length models (dispatch_sim.guru_lengths)")
    p.add_argument("--bench-windows", type=int, default=16, help="windows of the longtail bench's setting")
    p.add_argument("--order", choices=("home", "completion"), default="home",
                   help="which finished groups form a batch: those of the lowest (home batch, prompt) (home, the "
                        "default: what megarl.rollout.partial implements) or the first to finish (completion)")
    p.add_argument("--doomed", choices=("finish", "abort"), default="finish",
                   help="a group still generating that can only be trained past the bound: generated to its end and "
                        "dropped at the next take (finish, the default here, which keeps the published projection's "
                        "figures: sync.inflight_abort_doomed=false) or aborted at once (abort: megarl's default "
                        "since 2026-11-29, sync.inflight_abort_doomed=true)")
    p.add_argument("--fleet-check", type=Path, nargs="+", default=None, metavar="FILE",
                   help="instead: the simulation against these measured `megarl bench inflight-fleet` JSON files")
    p.add_argument("--engine-step", type=Path, default=None, metavar="FILE",
                   help="with --fleet-check: a `megarl bench engine-step` JSON file; adds the per-seq engine (a decode "
                        "step of scale x (a + b x N), b / a from the file, scale fitted on the queue runs) and the "
                        "what-if of a flat step")
    p.add_argument("--fleet-train", nargs="+", choices=("set", "measured"), default=["set"],
                   help="with --fleet-check: the trainer step each run is simulated with: the bench's --train-s (set) "
                        "and/or the run's measured mean train span over its steady steps (measured)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default runs/bench/bench_inflight.json; with --fleet-check "
                        "runs/bench/inflight_sim_vs_fleet.json)")
    return p


def run(args: argparse.Namespace) -> int:
    from megarl.bench.inflight_sim import bench_markdown, bench_setting, inflight_projection, projection_markdown

    if args.fleet_check:
        return _fleet_check(args)
    if args.steps < 8 or args.bench_windows < 1:
        print("megarl bench inflight: --steps must be >= 8 and --bench-windows >= 1", file=sys.stderr)
        return 2
    args.out = args.out or Path("runs/bench/bench_inflight.json")
    t0 = time.perf_counter()
    projection = inflight_projection(args.steps, tuple(args.lengths), args.doomed, args.order)
    print(f"30B projection (batch order {args.order}, doomed groups: {args.doomed}; {args.steps} steps a run, steady "
          f"steps {projection['steady_steps']}, "
          f"{time.perf_counter() - t0:.0f} s):")
    print(projection_markdown(projection))
    bench = bench_setting(windows=args.bench_windows, doomed=args.doomed, order=args.order)
    print("\nmegarl bench longtail's setting (2 replicas, 16 prompts x 4, 10% to 256 tokens, else 16; one decode step "
          f"a second, no per-sequence cost; no trainer or push cost; windows 1..{args.bench_windows} of 4 batches):")
    print(bench_markdown(bench))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                             if k != "func"},
                                    "projection": projection, "bench_setting": bench}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _fleet_check(args: argparse.Namespace) -> int:
    from megarl.bench.inflight_sim.fleet_setting import fleet_check, fleet_check_markdown

    if missing := [str(p) for p in args.fleet_check if not p.is_file()]:
        print(f"megarl bench inflight --fleet-check: no such file: {', '.join(missing)} (the JSON files "
              "`megarl bench inflight-fleet --out` wrote)", file=sys.stderr)
        return 2
    out = args.out or Path("runs/bench/inflight_sim_vs_fleet.json")
    if args.engine_step is not None and not args.engine_step.is_file():
        print(f"megarl bench inflight --engine-step: no such file: {args.engine_step} (the JSON file "
              "`megarl bench engine-step --out` wrote)", file=sys.stderr)
        return 2
    result = fleet_check(args.fleet_check, engine_step=args.engine_step, trains=tuple(args.fleet_train))
    print("the simulation in megarl bench inflight-fleet's setting, against its measured runs (batch order home: "
          "megarl's rule; completion: the first rule):")
    print(fleet_check_markdown(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: [str(x) for x in v] if isinstance(v, list) else str(v) if isinstance(
        v, Path) else v for k, v in vars(args).items() if k != "func"}, **result}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
