"""`megarl compare RUN_DIR ...`: the communication-savings report of runs that differ in their sync schedule.

Each run directory holds `config.yaml` and `summary.json` (written at the end of `megarl train`, of a cluster job's
rank 0, or of a resumed run). The report has one row per run: its `sync.interval` / `sync.offset`, how many pushes it
made and the bytes they moved, the bytes against the run with the most pushes in the set (measured, not projected)
and against the same run at `sync.interval=1` (projected from its own bytes per push), the time spent pushing, the
wall time per step and the rewards. Printed as a Markdown table; `--out FILE.md` also writes it and `FILE.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml


class CompareError(ValueError):
    """A run directory without the files the report needs."""


def load_run(run_dir: Path) -> dict[str, Any]:
    """The figures of one finished run."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError as err:
        raise CompareError(f"{run_dir}: no {Path(err.filename).name}; is it a finished megarl run directory?") from None
    lags = summary.get("batch_lags") or [0]
    wall = summary.get("pipeline/wall_s")
    return {"run": str(run_dir), "interval": cfg["sync"]["interval"], "offset": cfg["sync"]["offset"],
            "steps": summary["steps"], "pushes": summary.get("sync/pushes", 0),
            "bytes_sent": summary.get("sync/bytes_sent_total", 0),
            "bytes_if_interval_1": (summary["sync/bytes_per_push"] or 0) * summary["sync/pushes_if_interval_1"]
            if summary.get("sync/bytes_per_push") is not None else None,
            "push_s": summary.get("sync/seconds_total", 0.0),
            "fleet_paused_s": summary.get("sync/fleet_paused_s_total"),  # first /pause to last /resume, summed
            "sync_share_of_wall": summary.get("sync/seconds_total", 0.0) / wall if wall else None,
            "wall_s_per_step": wall / summary["steps"] if wall and summary["steps"] else None,
            "mean_lag": sum(lags) / len(lags), "reward_first": summary.get("reward/first_steps_mean"),
            "reward_last": summary.get("reward/last_steps_mean")}


def compare(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """One row per run, ordered by sync.interval; `bytes_vs_most` is relative to the run that sent the most."""
    rows = sorted((load_run(Path(d)) for d in run_dirs), key=lambda r: (r["interval"], r["offset"], r["run"]))
    most = max((r["bytes_sent"] for r in rows), default=0)
    for r in rows:
        r["bytes_vs_most"] = r["bytes_sent"] / most if most else None
        r["bytes_vs_interval_1"] = (r["bytes_sent"] / r["bytes_if_interval_1"]) if r["bytes_if_interval_1"] else None
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| run | interval m | offset n | steps | pushes | bytes sent | vs most | vs m=1 | push s | fleet paused s "
            "| sync share of wall | s/step | mean lag | reward first -> last |\n|" + "---|" * 14)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['interval']} | {r['offset']} | {r['steps']} | {r['pushes']} | {r['bytes_sent']:,} "
            f"| {_fmt(r['bytes_vs_most'], '.3f')} | {_fmt(r['bytes_vs_interval_1'], '.3f')} "
            f"| {_fmt(r['push_s'], '.2f')} | {_fmt(r['fleet_paused_s'], '.2f')} "
            f"| {_fmt(r['sync_share_of_wall'], '.1%')} "
            f"| {_fmt(r['wall_s_per_step'], '.2f')} | {r['mean_lag']:.2f} "
            f"| {_fmt(r['reward_first'], '.3f')} -> {_fmt(r['reward_last'], '.3f')} |")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare finished runs' sync traffic, time and rewards (docs/cluster.md)")
    p.add_argument("runs", nargs="+", type=Path, help="run directories (each with config.yaml and summary.json)")
    p.add_argument("--out", type=Path, help="also write the table here (Markdown) and the figures beside it (.json)")


def run(args: argparse.Namespace) -> int:
    try:
        rows = compare(args.runs)
    except CompareError as err:
        print(f"megarl compare: {err}", file=sys.stderr)
        return 2
    table = markdown(rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
        print(f"written: {args.out}, {args.out.with_suffix('.json')}")
    return 0
