"""`megarl bench savings`: what infrequent weight syncs save, measured: the same short job at several
`sync.interval` values on one fleet.

One fleet is started (or `--fleet-url` reused), one discarded warm-up run, then the job (a config, `--steps`
steps, `sync.push_initial=true` so every run starts from the trainer's weights) once per `--intervals` value.
Per run: pushes, bytes sent (exact), seconds in sync and where they went (the fixed part — pausing and opening
the fleet, waiting for vLLM's reload, labelling and resuming — against the sends, from `SyncStats.phases`),
the time the fleet spent paused, the share of wall time spent syncing, and the reward. The rows are
`megarl compare`'s (`megarl.metrics.compare.compare`) plus the phase totals. Writes `--out` (JSON) and a
bar chart beside it (.png).

`--delta` runs every interval with `sync.delta=true` and adds the delta columns, all measured on the pushes
themselves: the changed fraction per sync (elements whose wire-dtype bits changed since the previous push, over
all elements sent as deltas), bytes per sync of a full push (each vLLM rank's slices) and of the delta pushes,
bytes per trained step both ways, and the seconds of a full push (the run's initial push) and of a delta push.
The plot then shows the changed fraction and bytes per step against the interval. The fraction depends on how
large an optimizer step is next to the weights in the wire dtype, so set the learning rate and `rollout.dtype`
you train with (`optimizer.lr=1e-6 rollout.dtype=bfloat16` for the Guru recipes' settings).
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


def delta_columns(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The delta columns of one run, from its per-step metrics (`megarl.loop._sync_metrics`)."""
    total = lambda key: sum(r.get(f"sync/{key}", 0) for r in records)  # noqa: E731
    steps, pushes, deltas = len(records), total("count"), total("delta_pushes")
    fulls = pushes - deltas
    return {
        "delta_pushes": deltas,
        "changed_fraction": total("delta_changed") / total("delta_elements") if total("delta_elements") else None,
        "bytes_per_sync_full": total("bytes_full") / pushes if pushes else None,
        "bytes_per_sync_delta": total("bytes_sent_delta") / deltas if deltas else None,
        "bytes_per_step_full": total("bytes_full") / steps if steps else None,
        "bytes_per_step_delta": total("bytes_sent") / steps if steps else None,
        "push_s_full": (total("seconds") - total("seconds_delta")) / fulls if fulls else None,
        "push_s_delta": total("seconds_delta") / deltas if deltas else None,
        "delta_count_s": total("delta_count_s") / deltas if deltas else None,
        "delta_store_s": total("delta_store_s") / pushes if pushes else None,
        "sender_base_bytes": max((r.get("sync/sender_base_bytes", 0) for r in records), default=0),
    }


def measure(cfg_path: str | None, overrides: list[str], steps: int, intervals: list[int], work_dir: Path,
            fleet_urls: list[str] | None, delta: bool = False) -> list[dict[str, Any]]:
    """Warm-up, then one run per interval (`delta`: with sync.delta=true); one row per run."""
    from megarl.launch import prepare
    from megarl.rollout.run_fleet import start_fleet

    base = prepare(cfg_path, overrides, create_run_dir=False)
    common = [*overrides, f"run.steps={steps}", "sync.push_initial=true", "run.overwrite=true",
              "checkpoint.interval=0", *(["sync.delta=true"] if delta else [])]
    phases: dict[str, dict[str, float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    with start_fleet(base, log_dir=work_dir) if fleet_urls is None else nullcontext() as fleet:
        urls = fleet_urls or fleet.urls
        print("warm-up run (discarded) ...", flush=True)
        run_job(cfg_path, [*common, "run.steps=2", f"run.dir={work_dir / 'warmup'}"], urls)
        for m in intervals:
            print(f"run sync.interval={m} ...", flush=True)
            run = run_job(cfg_path, [*common, f"sync.interval={m}", f"run.dir={work_dir / f'interval{m}'}"], urls)
            phases[str(run["run_dir"])] = {k: run["summary"].get(f"sync/{k}_total", 0.0) for k in PHASES}
            extra[str(run["run_dir"])] = delta_columns(run["records"]) if delta else {}
    rows = compare([Path(d) for d in phases])  # megarl compare's rows: bytes vs interval 1, push s, share of wall
    for row in rows:
        row.update(phases[row["run"]])
        row.update(extra[row["run"]])
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


def format_delta_table(rows: list[dict[str, Any]]) -> str:
    """The delta columns (`--delta`)."""
    def f(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = ["| sync.interval | delta pushes | changed per sync | bytes/sync full | bytes/sync delta | delta/full | "
             "steady bytes/step full | steady bytes/step delta | run bytes/step full | run bytes/step delta | "
             "full push s | delta push s |", "|" + "---|" * 12]
    for r in rows:
        ratio = (r["bytes_per_sync_delta"] / r["bytes_per_sync_full"]
                 if r.get("bytes_per_sync_delta") is not None and r.get("bytes_per_sync_full") else None)
        lines.append(f"| {r['interval']} | {r['delta_pushes']} | {f(r['changed_fraction'], '.2%')} | "
                     f"{f(r['bytes_per_sync_full'], ',.0f')} | {f(r['bytes_per_sync_delta'], ',.0f')} | "
                     f"{f(ratio, '.3f')} | {f(steady(r, 'full'), ',.0f')} | {f(steady(r, 'delta'), ',.0f')} | "
                     f"{f(r['bytes_per_step_full'], ',.0f')} | {f(r['bytes_per_step_delta'], ',.0f')} | "
                     f"{f(r['push_s_full'], '.2f')} | {f(r['push_s_delta'], '.2f')} |")
    return "\n".join(lines)


def steady(row: dict[str, Any], kind: str) -> float | None:
    """Bytes per trained step once the run is going: one push per `interval` steps, each a `kind` push (the run's
    own bytes per step also count its first, full push, which weighs more the fewer pushes a run makes)."""
    per_sync = row.get(f"bytes_per_sync_{kind}")
    return None if per_sync is None else per_sync / row["interval"]


def plot_delta(rows: list[dict[str, Any]], out_png: Path, title: str) -> None:
    """Changed fraction per sync and bytes per trained step (full vs delta) against the interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r["interval"] for r in rows]
    fig, (ax_f, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    measured = [r for r in rows if r.get("changed_fraction") is not None]
    ax_f.plot([r["interval"] for r in measured], [100 * r["changed_fraction"] for r in measured], "o-",
              color="tab:red", label="measured")
    if measured:  # what the fraction would be if every step changed different elements
        first, m0 = measured[0]["changed_fraction"], measured[0]["interval"]
        ax_f.plot(ms, [min(100.0, 100 * first * m / m0) for m in ms], ":", color="grey",
                  label=f"{m0}-step fraction x m / {m0} (no overlap)")
    ax_f.set_xscale("log", base=2)
    ax_f.set_xlabel("sync.interval m")
    ax_f.set_ylabel("% of elements changed per sync")
    ax_f.legend(fontsize=8)
    with_delta = [r for r in rows if steady(r, "delta") is not None]
    ax_b.plot(ms, [steady(r, "full") / 2**20 for r in rows], "o-", color="tab:orange", label="full pushes")
    ax_b.plot([r["interval"] for r in with_delta], [steady(r, "delta") / 2**20 for r in with_delta], "o-",
              color="tab:green", label="delta pushes")
    ax_b.set_xscale("log", base=2)
    ax_b.set_yscale("log")
    ax_b.set_xlabel("sync.interval m")
    ax_b.set_ylabel("MiB to the fleet per trained step (steady)")
    ax_b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


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
    p.add_argument("--delta", action="store_true",
                   help="run with sync.delta=true and add the delta columns (changed fraction, bytes full vs delta)")
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
                       args.fleet_url, delta=args.delta)
    except ConfigError as err:
        print(f"megarl bench savings: {err}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(format_table(rows))
    if args.delta:
        print(format_delta_table(rows))
        for r in rows:
            if not r["delta_pushes"]:
                print(f"sync.interval={r['interval']}: no delta push in {args.steps} steps (the first push is full): "
                      "give --steps at least twice the interval plus sync.offset to measure it")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "overrides": args.overrides, "steps": args.steps,
                                    "delta": args.delta, "rows": rows}, indent=1) + "\n")
    if args.delta:
        plot_delta(rows, args.out.with_suffix(".png"), f"megarl bench savings --delta ({args.config}, "
                   f"{' '.join(args.overrides) or 'as configured'}, {args.steps} steps each)")
    else:
        plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0
