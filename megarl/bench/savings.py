"""`megarl bench savings`: what infrequent weight syncs save, measured: the same short job at several
`sync.interval` values on one fleet.

One fleet is started (or `--fleet-url` reused), one discarded warm-up run, then the job (a config, `--steps`
steps, `sync.push_initial=true` so every run starts from the trainer's weights) once per `--intervals` value.
Per run: pushes, bytes sent (exact), seconds in sync and where they went (the fixed part — pausing and opening
the fleet, waiting for vLLM's reload, labelling and resuming — against the sends, from `SyncStats.phases`),
the time the fleet spent paused, the share of wall time spent syncing, and the reward. The rows are
`megarl compare`'s (`megarl.metrics.compare.compare`) plus the phase totals. Writes `--out` (JSON) and a
bar chart beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from megarl.bench.pipeline import run_job
from megarl.metrics.compare import compare

PHASES = ("open_s", "send_s", "close_s", "worker_receive_s", "worker_load_s")


def measure(cfg_path: str | None, overrides: list[str], steps: int, intervals: list[int], work_dir: Path,
            fleet_urls: list[str] | None) -> list[dict[str, Any]]:
    """Warm-up, then one run per interval; one row per run."""
    from megarl.launch import prepare
    from megarl.rollout.fleet import start_fleet

    base = prepare(cfg_path, overrides, create_run_dir=False)
    common = [*overrides, f"run.steps={steps}", "sync.push_initial=true", "run.overwrite=true",
              "checkpoint.interval=0"]
    phases: dict[str, dict[str, float]] = {}
    with start_fleet(base, log_dir=work_dir) if fleet_urls is None else nullcontext() as fleet:
        urls = fleet_urls or fleet.urls
        print("warm-up run (discarded) ...", flush=True)
        run_job(cfg_path, [*common, "run.steps=2", f"run.dir={work_dir / 'warmup'}"], urls)
        for m in intervals:
            print(f"run sync.interval={m} ...", flush=True)
            run = run_job(cfg_path, [*common, f"sync.interval={m}", f"run.dir={work_dir / f'interval{m}'}"], urls)
            phases[str(run["run_dir"])] = {k: run["summary"].get(f"sync/{k}_total", 0.0) for k in PHASES}
    rows = compare([Path(d) for d in phases])  # megarl compare's rows: bytes vs interval 1, push s, share of wall
    for row in rows:
        row.update(phases[row["run"]])
        row["fixed_s"] = row["push_s"] - row["send_s"]  # everything in the pushes but the trainer's sends
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| sync.interval | pushes | bytes sent | vs interval 1 | sync s | of which sends | fixed (pause, reload, "
             "resume) | fleet paused s | sync share of wall | s/step | reward first -> last |",
             "|" + "---|" * 11]
    for r in rows:
        vs = f"{r['bytes_vs_interval_1']:.3f}" if r.get("bytes_vs_interval_1") is not None else "-"
        paused = f"{r['fleet_paused_s']:.2f}" if r.get("fleet_paused_s") is not None else "-"
        share = f"{r['sync_share_of_wall']:.1%}" if r.get("sync_share_of_wall") is not None else "-"
        lines.append(f"| {r['interval']} | {r['pushes']} | {r['bytes_sent']:,} | {vs} | {r['push_s']:.2f} | "
                     f"{r['send_s']:.2f} | {r['fixed_s']:.2f} | {paused} | {share} | {r['wall_s_per_step']:.2f} | "
                     f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["interval"]) for r in rows]
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(10, 4))
    ax_b.bar(labels, [r["bytes_sent"] / 2**20 for r in rows], color="tab:orange")
    ax_b.set_xlabel("sync.interval")
    ax_b.set_ylabel("MiB sent to the fleet (whole run)")
    ax_b.set_title("bytes moved")
    ax_s.bar(labels, [r["send_s"] for r in rows], color="tab:blue", label="sends")
    ax_s.bar(labels, [r["fixed_s"] for r in rows], bottom=[r["send_s"] for r in rows], color="tab:grey",
             label="fixed: pause, reload, resume")
    for i, r in enumerate(rows):
        if r.get("sync_share_of_wall") is not None:
            ax_s.annotate(f"{r['sync_share_of_wall']:.0%} of wall", (i, r["push_s"]), ha="center", va="bottom",
                          fontsize=8)
    ax_s.set_xlabel("sync.interval")
    ax_s.set_ylabel("seconds in weight sync (whole run)")
    ax_s.set_title("time in sync")
    ax_s.legend(fontsize=8)
    fig.suptitle(f"megarl bench savings ({rows[0]['steps']} steps each, CPU)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("savings", help="the same short job at several sync.interval values: bytes, seconds "
                              "in sync, fleet pause, share of wall", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo_moe.yaml", help="the job to run (default: the demo)")
    p.add_argument("--steps", type=int, default=16, help="steps per run")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="sync.interval values")
    p.add_argument("--fleet-url", action="append", default=None,
                   help="reuse a running fleet serving the config's model (repeat per replica)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/bench_savings.json"),
                   help="JSON output; a bar chart (.png) goes next to it")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides of the job")
    return p


def run(args: argparse.Namespace) -> int:
    from megarl.config.load import ConfigError

    if any(m < 1 for m in args.intervals):
        print("megarl bench savings: --intervals must be positive", file=sys.stderr)
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="megarl_bench_savings_"))
    try:
        rows = measure(args.config, list(args.overrides), args.steps, sorted(set(args.intervals)), work_dir,
                       args.fleet_url)
    except ConfigError as err:
        print(f"megarl bench savings: {err}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(format_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "overrides": args.overrides, "steps": args.steps,
                                    "rows": rows}, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0
