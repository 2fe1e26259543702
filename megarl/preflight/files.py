"""Where the preflight steps meet: `<run.dir>/preflight/`, one `hello_<key>.json` and one `report_<key>.json` per
step, keyed `rank<k>` (a trainer rank) or `replica<i>` (a rollout replica). Files are written whole (temporary
file, then rename), so a reader on another node never sees half of one.

hello_<key>.json (written first; the report repeats all of it):
    role "rank" | "serve", index (rank or replica), key, node (SLURMD_NODENAME, else the host name), pid,
    job_id / step_id (SLURM_JOB_ID / SLURM_STEP_ID), step (srun's --job-name, else megarl-rank / megarl-serve-<i>),
    local_rank, cuda_visible_devices, slurm_gpus (SLURM_STEP_GPUS, else SLURM_JOB_GPUS), gpus (the step's GPUs on
    its node, by SLURM's ids), gpu (a rank's own GPU, SLURM's id; null for a replica), time,
    listens: [{what: "rendezvous store" | "weight-sync store" | "HTTP server", host, port, ok, error}]
report_<key>.json: the hello and
    unseen: keys whose hello it did not see within wait_s; wait_s
    probes: [{what, to (the owner's key), target "host:port" (null: nothing to probe), ok (true, false, or null: not
             probed because the owner could not listen or never said hello), error, seconds}]
    model: {dir, files, weight_bytes, problems}
    gpu_check: {driver, usable (null: no driver, or no GPU), reason, devices: [{index, name, memory_bytes,
                allocated}], problems}
    versions: {stack, lock, packages: {name: {installed, pinned, source}}, problems} (megarl.preflight.versions:
              torch, megatron-core, vLLM, Transformer Engine against the role's lock)
    findings: one line per problem it found itself, each saying what to fix
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megarl.config.schema import Config
from megarl.metrics.writer import write_json_atomic

PREFLIGHT_DIR = "preflight"
POLL_S = 0.2  # how often a waiting step looks for the others' files


def preflight_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / PREFLIGHT_DIR


def step_key(role: str, index: int) -> str:
    """`rank3` for trainer rank 3, `replica0` for rollout replica 0."""
    return f"{'rank' if role == 'rank' else 'replica'}{index}"


def expected_keys(cfg: Config) -> list[str]:
    """Every step the job must run: trainer ranks first, then replicas."""
    return ([step_key("rank", k) for k in range(cfg.trainer.world_size)]
            + [step_key("serve", i) for i in range(cfg.rollout.replicas)])


def write(directory: Path, kind: str, key: str, data: dict[str, Any]) -> Path:
    """Write `<kind>_<key>.json` atomically (kind: hello or report)."""
    path = directory / f"{kind}_{key}.json"
    write_json_atomic(path, data)
    return path


def read(directory: Path, kind: str, key: str) -> dict[str, Any] | None:
    """The step's file, or None if it is absent or unreadable (not written yet)."""
    try:
        return json.loads((directory / f"{kind}_{key}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for(directory: Path, kind: str, keys: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Poll until every key's file exists or `timeout_s` passed; returns those read, by key."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, dict[str, Any]] = {}
    while True:
        for key in keys:
            if key not in found and (data := read(directory, kind, key)) is not None:
                found[key] = data
        if len(found) == len(keys) or time.monotonic() >= deadline:
            return found
        time.sleep(POLL_S)
