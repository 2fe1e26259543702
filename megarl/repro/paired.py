"""Two settings of a study side by side, seed by seed (`Study.paired`): the `inflight` study's table.

Seed s of both settings draws the same prompts and sampling seeds, so per seed the two runs differ only in the
setting. Per run (each a list of per-step records, `megarl.repro.runner.KEPT`):

- reward: the mean of `reward/mean` over the run's last `window` steps (the study's reading);
- dropped: groups dropped past the staleness bound, summed over the run (`partial/dropped_groups`; 0 without
  partial rollouts);
- carried: trained groups that came from an earlier home batch, summed over the run (`partial/carried_groups`);
- spanning: the share of the trained responses whose tokens come from two or more versions, the mean over steps of
  `token_lag/spanning_share` (every step trains the same number of responses); 0 when no batch carries per-token
  versions (then each batch is one version);
- lag max / lag mean: the largest per-token lag of the run (`token_lag/max`) and the mean over steps of
  `token_lag/mean`; without per-token versions every token of a batch has the batch's lag (`batch_lag`).

The paired difference per seed is reward(a) - reward(b); the summary gives its mean and standard deviation over
seeds next to the unpaired verdict of the study's comparison (`megarl.repro.report.judge`).
"""

from __future__ import annotations

import statistics
from typing import Any


def run_figures(records: list[dict[str, Any]], window: int) -> dict[str, float]:
    """One run's columns (module docstring)."""
    tail = records[-window:]
    has_versions = any("token_lag/max" in r for r in records)
    if has_versions:
        lag_max = max(r["token_lag/max"] for r in records if "token_lag/max" in r)
        lag_mean = statistics.fmean(r["token_lag/mean"] for r in records if "token_lag/mean" in r)
        spanning = statistics.fmean(r["token_lag/spanning_share"] for r in records if "token_lag/spanning_share" in r)
    else:
        lag_max = max(r["batch_lag"] for r in records)
        lag_mean = statistics.fmean(r["batch_lag"] for r in records)
        spanning = 0.0
    return {"reward": statistics.fmean(r["reward/mean"] for r in tail),
            "dropped": sum(r.get("partial/dropped_groups", 0) for r in records),
            "carried": sum(r.get("partial/carried_groups", 0) for r in records),
            "spanning": spanning, "lag_max": lag_max, "lag_mean": lag_mean}


def paired_summary(results: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    """Per seed run by both `a` and `b`: each run's figures and the reward difference a - b; then the mean and
    standard deviation of the differences over those seeds."""
    by_run = {(r["setting"], r["seed"]): run_figures(r["records"], results["window"]) for r in results["runs"]}
    seeds = [s for s in results["seeds"] if (a, s) in by_run and (b, s) in by_run]
    rows = [{"seed": s, a: by_run[(a, s)], b: by_run[(b, s)], "diff": by_run[(a, s)]["reward"] -
             by_run[(b, s)]["reward"]} for s in seeds]
    diffs = [row["diff"] for row in rows]
    return {"a": a, "b": b, "window": results["window"], "rows": rows,
            "diff_mean": statistics.fmean(diffs) if diffs else None,
            "diff_sd": statistics.stdev(diffs) if len(diffs) > 1 else None}


def paired_markdown(summary: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The per-seed table (module docstring), one row per (seed, setting), and a line with the paired difference."""
    a, b = summary["a"], summary["b"]
    lines = [f"| seed | setting | reward (last {summary['window']} steps) | {a} - {b} | dropped groups | carried "
             "groups | spanning share | token lag max | token lag mean |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["rows"]:
        for key in (a, b):
            f = row[key]
            diff = f"{row['diff']:+.3f}" if key == a else ""
            lines.append(f"| {row['seed']} | {labels.get(key, key)} | {f['reward']:.3f} | {diff} | {f['dropped']} | "
                         f"{f['carried']} | {f['spanning']:.3f} | {f['lag_max']} | {f['lag_mean']:.2f} |")
    if summary["diff_mean"] is not None:
        sd = f" ± {summary['diff_sd']:.3f} (standard deviation over seeds)" if summary["diff_sd"] is not None else ""
        lines += ["", f"Paired difference {a} - {b}, reward over the last {summary['window']} steps: "
                  f"{summary['diff_mean']:+.3f}{sd}, over {len(summary['rows'])} seeds."]
    return lines
