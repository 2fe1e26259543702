"""The run plot: mean reward per step and weight-sync traffic per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_run(records: list[dict[str, Any]], out_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_r, ax_s) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_r.plot(steps, [r["reward/mean"] for r in records], marker="o", ms=3, label="reward/mean (training batch)")
    for key in sorted({k for r in records for k in r if k.startswith(("eval/mean@", "eval/pass@"))}):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        ax_r.plot(*zip(*points, strict=True), marker="s", ms=4, lw=1, label=f"{key} (held-out)")
    ax_r.set_ylabel("reward")
    ax_r.legend(fontsize=7)
    ax_r.grid(alpha=0.3)
    ax_s.bar(steps, [r.get("sync/bytes_sent", 0) / 2**20 for r in records], color="tab:orange")
    ax_s.set_ylabel("sync MiB sent")
    ax_s.set_xlabel("step")
    ax_s.grid(alpha=0.3)
    fig.suptitle(out_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def plot_mismatch(records: list[dict[str, Any]], out_path: Path) -> None:
    """The train-inference mismatch per step (`megarl/metrics/mismatch.py`): mean |delta| and the k3 KL (log
    scale; filled markers: lag-0 steps, where the trainer's weights are the behaviour weights and the numbers are
    pure numerics; hollow: lagged steps, staleness and numerics together), and the token ratio's quantiles
    (p01-p99 and p10-p90 bands, the median) with the share of tokens outside [0.5, 2]. Steps without the
    statistics (records written before the monitor existed, or null values) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("mismatch/abs_diff_mean", "mismatch/k3_kl", "mismatch/ratio_outside_0.5_2", "mismatch/ratio_p01",
            "mismatch/ratio_p10", "mismatch/ratio_p50", "mismatch/ratio_p90", "mismatch/ratio_p99")
    rows = [r for r in records if all(r.get(k) is not None for k in keys)]
    steps = [r["step"] for r in rows]
    behaviour = [bool(r.get("mismatch/at_behaviour_weights", r.get("batch_lag") == 0)) for r in rows]
    fig, (ax_m, ax_q) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    if not rows:  # e.g. a run resumed from records written before the monitor existed
        ax_m.text(0.5, 0.5, "no mismatch statistics recorded", ha="center", va="center", transform=ax_m.transAxes)
        fig.savefig(out_path, dpi=100)
        plt.close(fig)
        return
    for key, colour in (("mismatch/abs_diff_mean", "tab:blue"), ("mismatch/k3_kl", "tab:red")):
        values = [r[key] for r in rows]
        ax_m.plot(steps, values, color=colour, lw=1, label=key.removeprefix("mismatch/"))
        for lag0, face in ((True, colour), (False, "none")):
            pts = [(s, v) for s, v, b in zip(steps, values, behaviour, strict=True) if b == lag0 and v > 0]
            if pts:
                ax_m.scatter(*zip(*pts, strict=True), s=18, facecolors=face, edgecolors=colour, zorder=3)
    ax_m.set_yscale("log")
    ax_m.set_ylabel("engine vs trainer")
    ax_m.legend(title="filled: lag 0 (behaviour weights)", fontsize=8, title_fontsize=8)
    ax_m.grid(alpha=0.3)
    q = {k: [r[f"mismatch/ratio_{k}"] for r in rows] for k in ("p01", "p10", "p50", "p90", "p99")}
    ax_q.fill_between(steps, q["p01"], q["p99"], color="tab:blue", alpha=0.15, label="p01-p99")
    ax_q.fill_between(steps, q["p10"], q["p90"], color="tab:blue", alpha=0.3, label="p10-p90")
    ax_q.plot(steps, q["p50"], color="tab:blue", marker="o", ms=3, label="median")
    ax_q.set_yscale("log")  # ratios are multiplicative: 0.5 and 2 equally far from 1
    ax_q.set_ylabel("token ratio pi_trainer / pi_engine")
    ax_q.grid(alpha=0.3)
    ax_o = ax_q.twinx()
    ax_o.plot(steps, [r["mismatch/ratio_outside_0.5_2"] for r in rows], color="tab:orange", lw=1,
              label="outside [0.5, 2]")
    ax_o.set_ylabel("share outside [0.5, 2]", color="tab:orange")
    handles = ax_q.get_legend_handles_labels()[0] + ax_o.get_legend_handles_labels()[0]
    ax_q.legend(handles=handles, fontsize=8)
    ax_q.set_xlabel("step")
    fig.suptitle(f"{out_path.parent.name}: train-inference mismatch")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


_COLOURS = {"generate": "tab:green", "score": "tab:olive", "train": "tab:blue", "wait": "lightgrey",
            "push": "tab:red", "startup": "tab:purple", "checkpoint": "tab:brown", "eval": "tab:cyan"}


def plot_timeline(spans: list, out_path: Path, title: str = "") -> None:
    """One lane per replica, one for rewards, one for the trainer, one for pushes (`megarl.metrics.timeline`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from megarl.metrics.timeline import replica_lanes

    lanes = ["push", "trainer", "reward", *reversed(replica_lanes(spans))]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(lanes) + 1.4))
    for y, lane in enumerate(lanes):
        for kind, colour in _COLOURS.items():
            bars = [(s.start, s.end - s.start) for s in spans if s.lane == lane and s.kind == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(lanes) < 6 else -0.12), ncol=len(_COLOURS), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
