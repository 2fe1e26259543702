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
