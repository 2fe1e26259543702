"""Read a study's results: per-setting statistics over seeds, the verdict of each comparison, the plot and the
markdown report.

The statistic of a run is the mean of a metric over its last `window` steps; a setting's value is the mean of
that over seeds, with the sample standard deviation across seeds as its spread. A comparison of settings a and b
looks at d = mean_a - mean_b against its standard error se = sqrt(sd_a^2 / n_a + sd_b^2 / n_b):

- "greater": agrees if d > 2 se, contradicts if d < -2 se, else inconclusive (the seeds cannot tell);
- "similar": agrees if |d| <= max(2 se, tolerance), else contradicts;
- "not_less": agrees if d >= -max(2 se, tolerance), else contradicts.

Two standard errors with 3 seeds is a rough test, not a significance level: the report says so.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from megarl.repro.studies import Comparison, Study


def window_means(results: dict[str, Any], metric: str) -> dict[str, list[float]]:
    """Per setting, the per-seed mean of `metric` over each run's last `window` steps."""
    w = results["window"]
    out: dict[str, list[float]] = {k: [] for k in results["settings"]}
    for run in results["runs"]:
        values = [r[metric] for r in run["records"][-w:] if metric in r]
        if values:
            out[run["setting"]].append(statistics.fmean(values))
    return out


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def judge(comparison: Comparison, means: dict[str, list[float]]) -> dict[str, Any]:
    """The verdict of one comparison on the per-seed window means (module docstring)."""
    a, b = means.get(comparison.a, []), means.get(comparison.b, [])
    if not a or not b:
        return {"verdict": "not run", "diff": None, "se": None}
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    d, se = ma - mb, math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    band = max(2 * se, comparison.tolerance)
    if comparison.expect == "greater":
        verdict = "agrees" if d > 2 * se else "contradicts" if d < -2 * se else "inconclusive"
    elif comparison.expect == "similar":
        verdict = "agrees" if abs(d) <= band else "contradicts"
    else:
        verdict = "agrees" if d >= -band else "contradicts"
    return {"verdict": verdict, "diff": d, "se": se, "a": ma, "b": mb}


def plot(results: dict[str, Any], study: Study, out_png: Path, smooth: int = 3) -> None:
    """One column per panel (schedule), one row per metric; per line the mean over seeds of the running average
    (window `smooth`, as the REC paper's curves), shaded between the lowest and highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = results["settings"]
    panels = list(dict.fromkeys(s["panel"] for s in settings.values()))
    lines = list(dict.fromkeys(s["line"] for s in settings.values()))
    colours = {line: plt.get_cmap("tab10")(i) for i, line in enumerate(lines)}
    metrics = study.plot_metrics
    # at least 9 inches wide: the title and a four-entry legend must fit under a single panel too
    fig, axes = plt.subplots(len(metrics), len(panels), figsize=(max(9.0, 3.6 * len(panels)), 3.0 * len(metrics)),
                             squeeze=False, sharey="row")
    for key, s in settings.items():
        col = panels.index(s["panel"])
        for row, metric in enumerate(metrics):
            curves = []
            for run in results["runs"]:
                if run["setting"] == key:
                    y = np.array([r.get(metric, np.nan) for r in run["records"]], dtype=float)
                    kernel = np.ones(min(smooth, len(y))) / min(smooth, len(y))
                    curves.append(np.convolve(y, kernel, mode="valid"))
            if not curves:
                continue
            ys = np.vstack(curves)
            x = np.arange(ys.shape[1]) + (results["steps"] - ys.shape[1])  # a running mean ends at its last step
            ax = axes[row][col]
            ax.plot(x, ys.mean(axis=0), color=colours[s["line"]], label=s["line"], lw=1.5)
            ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=colours[s["line"]], alpha=0.15, lw=0)
            ax.set_title(s["panel"], fontsize=9)
            ax.set_ylabel(metric if col == 0 else "")
            ax.set_xlabel("step" if row == len(metrics) - 1 else "")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(f"megarl repro {study.name}: mean over {len(results['seeds'])} seeds (shaded: min-max), "
                 f"running average of {smooth}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(out_png, dpi=90)
    plt.close(fig)


def _made_at(runs: list[dict[str, Any]]) -> str:
    """Which commits the runs were trained at, with their counts: reused runs may come from earlier commits."""
    counts: dict[str, int] = {}
    for run in runs:
        made = run.get("made_at") or {"commit": "unknown", "dirty": False}
        label = f"`{made['commit']}`" + (" (with uncommitted changes)" if made.get("dirty") else "")
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} ({n} run{'s' * (n != 1)})" for label, n in counts.items())


def markdown(results: dict[str, Any], study: Study, png_name: str) -> str:
    """The study's report: the claim, the settings, the measured table, each comparison's verdict, provenance."""
    prov = results["provenance"]
    w, n = results["window"], len(results["seeds"])
    lines = [f"# {study.title}", "", f"Source: {study.source}.", "", f"**The claim.** {study.claim}", "",
             "## Settings", "",
             f"`megarl repro {study.name}`: {len(results['settings'])} settings x {n} seeds (`run.seed` "
             f"{', '.join(map(str, results['seeds']))}), {results['steps']} steps each, on `{results['config']}`"
             + (f" with `{' '.join(results['overrides'])}`" if results["overrides"] else "") + "; every run starts "
             "from the same initial weights (`sync.push_initial=true`) against one vLLM fleet. A setting's value: "
             f"the mean over seeds of each run's mean over its last {w} steps (± the standard deviation across "
             "seeds).", ""]
    metrics = list(dict.fromkeys(["reward/mean", *study.plot_metrics, *(c.metric for c in study.comparisons)]))
    per_metric = {m: window_means(results, m) for m in metrics}
    lines += ["| setting | " + " | ".join(metrics) + " | overrides |", "|---" * (len(metrics) + 2) + "|"]
    for key, s in results["settings"].items():
        cells = []
        for m in metrics:
            vals = per_metric[m][key]
            if vals:
                mean, sd = _mean_sd(vals)
                cells.append(f"{mean:.3f} ± {sd:.3f}")
            else:
                cells.append("-")
        lines.append(f"| {s['panel']}: {s['line']} | " + " | ".join(cells) + f" | `{' '.join(s['overrides'])}` |")
    lines += ["", f"![{study.name}]({png_name})", "", "## What megarl measured against the claim", "",
              "| the paper says | measured (a - b) | verdict |", "|---|---|---|"]
    verdicts = []
    for c in study.comparisons:
        v = judge(c, per_metric[c.metric])
        verdicts.append(v["verdict"])
        measured = "-" if v["diff"] is None else (
            f"{c.metric}: {v['a']:.3f} vs {v['b']:.3f}, d = {v['diff']:+.3f} (2 se = {2 * v['se']:.3f}"
            + (f", tolerance {c.tolerance}" if c.expect != "greater" else "") + ")")
        lines.append(f"| {c.statement} | {measured} | **{v['verdict']}** |")
    counts = {k: verdicts.count(k) for k in ("agrees", "inconclusive", "contradicts", "not run") if k in verdicts}
    lines += ["", "Verdicts: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" (of {len(verdicts)}). "
              f"'agrees' needs the difference beyond two standard errors over {n} seeds (similarity: within two "
              "standard errors or the tolerance); with few seeds this is a rough reading, not a significance test.",
              ""]
    if study.paired:
        from megarl.repro.paired import paired_markdown, paired_summary

        labels = {k: s["line"] for k, s in results["settings"].items()}
        lines += ["## Per seed (same prompts and sampling seeds in both settings)", "",
                  *paired_markdown(paired_summary(results, *study.paired), labels), ""]
    lines += ["## Provenance", "",
              f"- commit `{prov['commit']}`" + (" (with uncommitted changes)" if prov["dirty"] else "")
              + " (this invocation)", "- runs trained at: " + _made_at(results["runs"]),
              f"- machine: {prov['machine']}",
              "- packages: " + ", ".join(f"{k} {v}" for k, v in prov["packages"].items()),
              f"- run on {prov['date']}, {results.get('wall_s', 0) / 60:.1f} min wall for the whole study "
              f"({results.get('trained_runs', len(results['runs']))} of {len(results['runs'])} runs trained by this "
              "invocation, the others reused)",
              f"- the config of every run is `runs/<setting>_seed<seed>/config.yaml`; this study's per-step "
              f"metrics are in `{study.name}.json`", ""]
    return "\n".join(lines)
