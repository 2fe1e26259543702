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
    ax_r.plot(steps, [r["reward/mean"] for r in records], marker="o", ms=3)
    ax_r.set_ylabel("reward/mean")
    ax_r.grid(alpha=0.3)
    ax_s.bar(steps, [r.get("sync/bytes_sent", 0) / 2**20 for r in records], color="tab:orange")
    ax_s.set_ylabel("sync MiB sent")
    ax_s.set_xlabel("step")
    ax_s.grid(alpha=0.3)
    fig.suptitle(out_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


_COLOURS = {"generate": "tab:green", "score": "tab:olive", "train": "tab:blue", "wait": "lightgrey",
            "push": "tab:red", "startup": "tab:purple", "checkpoint": "tab:brown"}


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
