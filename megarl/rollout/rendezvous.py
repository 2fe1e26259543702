"""Where the trainer finds a fleet it did not start: one small file per replica in the run directory.

    <run.dir>/fleet/replica<i>.json   {"replica": i, "url": ..., "node": ..., "pid": ..., "job": <secret id>}

`megarl serve` writes its file (atomically) once its server is healthy and guarded, and removes it when it stops;
trainer rank 0 waits until every replica of the config has one. The run directory must be on a filesystem every
node shares, as the checkpoints are. A file counts only if it carries the id of this job's fleet secret (a hash,
never the secret): a re-submitted job makes a fresh secret, so files left by an earlier job are never read as
this job's fleet.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

from megarl.rollout.fleet import FleetError

FLEET_DIR = "fleet"
POLL_S = 1.0


def secret_id(secret: str) -> str:
    """A short, one-way id of the job's secret: tells this job's registrations from an earlier job's."""
    return hashlib.sha256(f"megarl-fleet:{secret}".encode()).hexdigest()[:16]


def fleet_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / FLEET_DIR


def clear_fleet(run_dir: Path | str) -> None:
    """Forget every registration (a new job starts with none)."""
    for path in fleet_dir(run_dir).glob("replica*.json"):
        path.unlink(missing_ok=True)


def register_replica(run_dir: Path | str, replica: int, url: str, secret: str) -> Path:
    """Announce replica `replica` at `url` for the job whose secret is `secret`."""
    directory = fleet_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"replica{replica}.json"
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({"replica": replica, "url": url, "node": socket.gethostname(),
                                   "pid": os.getpid(), "job": secret_id(secret)}))
    os.replace(partial, path)
    return path


def unregister_replica(run_dir: Path | str, replica: int) -> None:
    (fleet_dir(run_dir) / f"replica{replica}.json").unlink(missing_ok=True)


def _registered(path: Path, job: str) -> str | None:
    """The URL in a registration file of this job, or None (absent, unreadable, or another job's)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry.get("url") if entry.get("job") == job else None


def wait_for_fleet(run_dir: Path | str, replicas: int, secret: str, timeout_s: float) -> list[str]:
    """The URLs of replicas 0..replicas-1 of this job, in order, once all have registered; `FleetError` naming
    the missing replicas and their logs if some have not within `timeout_s` (rollout.startup_timeout_s)."""
    job, directory = secret_id(secret), fleet_dir(run_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        urls = [_registered(directory / f"replica{i}.json", job) for i in range(replicas)]
        if all(urls):
            return [url for url in urls if url]
        if time.monotonic() >= deadline:
            missing = [i for i, url in enumerate(urls) if url is None]
            logs = ", ".join(str(Path(run_dir) / "logs" / f"vllm_replica{i}.log") for i in missing)
            raise FleetError(
                f"rollout replica(s) {missing} did not register in {directory} within {timeout_s:.0f}s "
                f"(rollout.startup_timeout_s): start each with `megarl serve --config ... --replica i` against the "
                f"same run directory, on a filesystem this node shares; their logs: {logs}")
        time.sleep(POLL_S)
