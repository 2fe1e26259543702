"""`megarl preflight report --config CFG`: after every check step ended, in the batch script itself (inside or
outside a SLURM step): read the reports, ask SLURM for the job's GPU allocation (when SLURM_JOB_ID is set), print
one table of where each step ran and the GPUs it held, then every problem. Exit 0 with one "preflight OK" line, or
1 with "preflight FAILED: N problem(s)"."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from megarl.config.schema import Config
from megarl.preflight import files
from megarl.preflight.analysis import Expected, Verdict, judge, natural_key
from megarl.preflight.slurm_alloc import job_gpus, parse_job_gpus

DEVICES_ENV = "MEGARL_PREFLIGHT_DEVICES"  # "ids": GPUs without a driver are expected (an emulated cluster)


def read_all(directory: Path, kind: str) -> dict[str, dict[str, Any]]:
    """Every `<kind>_<key>.json` there, by key (expected or not: a rank beyond trainer.world_size shows too)."""
    found = {}
    for path in directory.glob(f"{kind}_*.json"):
        key = path.stem.removeprefix(f"{kind}_")
        if re.fullmatch(r"(rank|replica)\d+", key) and (data := files.read(directory, kind, key)) is not None:
            found[key] = data
    return found


def table(rows: list[tuple[str, str, str, str]]) -> str:
    """The rows under a header, columns padded and separated by ` | `."""
    lines = [("node", "step", "ranks", "GPUs"), *rows]
    widths = [max(len(line[c]) for line in lines) for c in range(4)]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def summary(reports: dict[str, dict[str, Any]]) -> str:
    """The one line that says what was checked."""
    def nodes(role: str) -> str:
        return ",".join(sorted({r["node"] for r in reports.values() if r["role"] == role}, key=natural_key)) or "-"

    ranks = sum(r["role"] == "rank" for r in reports.values())
    replicas = len(reports) - ranks
    gpus = len({(r["node"], g) for r in reports.values() for g in r["gpus"]})
    usable = [r["gpu_check"]["usable"] for r in reports.values() if r["gpus"]]
    how = "usable" if usable and all(usable) else "as SLURM's ids"
    model = max((r["model"] for r in reports.values()), key=lambda m: m["weight_bytes"], default=None)
    probes = sum(p["ok"] is True for r in reports.values() for p in r["probes"])
    weights = f"model {_size(model['weight_bytes'])} in {model['files']} file(s)" if model else "no model"
    return (f"{ranks} trainer rank(s) on {nodes('rank')}, {replicas} replica(s) on {nodes('serve')}, "
            f"{gpus} GPU(s) {how}, {weights}, {probes} probe(s) ok")


def run_report(cfg: Config, env: dict[str, str] | None = None, allocation_file: str | None = None) -> int:
    env = dict(os.environ if env is None else env)
    directory = files.preflight_dir(cfg.run.dir)
    reports, hellos = read_all(directory, "report"), read_all(directory, "hello")
    allocation, notes = None, []
    if allocation_file is not None:
        try:
            allocation = parse_job_gpus(Path(allocation_file).read_text()) or None
            why = "it lists no `Nodes=` detail lines"
        except OSError as err:
            why = err.strerror
        if allocation is None:
            notes.append(f"the job's GPU allocation is unknown ({allocation_file}: {why}): not compared")
    elif env.get("SLURM_JOB_ID"):
        try:
            allocation = job_gpus(env["SLURM_JOB_ID"])
        except RuntimeError as err:
            allocation = {}
            notes.append(f"the job's GPU allocation is unknown ({err}): not compared")
    verdict: Verdict = judge(Expected(cfg.trainer.world_size, cfg.rollout.replicas, cfg.rollout.tp), reports,
                             hellos, None if allocation is None else allocation, env.get(DEVICES_ENV), str(directory))
    print(table(verdict.rows))
    for note in notes + verdict.notes:
        print(f"note: {note}")
    for problem in verdict.problems:
        print(f"PROBLEM: {problem}")
    if verdict.problems:
        print(f"preflight FAILED: {len(verdict.problems)} problem(s)")
        return 1
    print(f"preflight OK: {summary(reports)}")
    return 0
