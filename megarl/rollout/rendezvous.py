"""Where the trainer finds a fleet it did not start: one small file per replica in the run directory.

    <run.dir>/fleet/replica<i>.json   {"replica": i, "url": ..., "node": ..., "pid": ..., "job": <secret id>}

`megarl serve` writes its file (atomically) once its server is healthy and guarded, and removes it when it stops;
trainer rank 0 waits until every replica of the config has one. The run directory must be on a filesystem every
node shares, as the checkpoints are. A file counts only if it carries the id of this job's fleet secret (a hash,
never the secret): a re-submitted job makes a fresh secret, so files left by an earlier job are never read as
this job's fleet.

    <run.dir>/fleet/condemned_replica<i>.json   {"replica": i, "incarnation": "<node>:<pid>", "job": ..., "why": ...}

Trainer rank 0 writes a condemnation (`condemn_replica`) for a replica that hangs while its `/health` answers (a
stopped vLLM worker: no call of a push is answered within the push's bound, `megarl.sync.lifecycle`), which no
launcher can see for itself. Both launchers (`megarl train`'s watcher, `megarl serve`) read it every probe
(`condemned`) and treat the replica as one whose `/health` failed: its whole process group is killed and restarted.
A condemnation names the incarnation it is for, so it never ends a later one (the restarted replica registers with
a new pid).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

from megarl.rollout.fleet import FleetError
from megarl.rollout.fleet_auth import SECRET_ENV, SECRET_FILENAME
from megarl.rollout.liveness import Liveness

FLEET_DIR = "fleet"
POLL_S = 1.0


def secret_id(secret: str) -> str:
    """A short, one-way id of the job's secret: tells this job's registrations from an earlier job's."""
    return hashlib.sha256(f"megarl-fleet:{secret}".encode()).hexdigest()[:16]


def fleet_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / FLEET_DIR


def clear_fleet(run_dir: Path | str) -> None:
    """Forget every registration and condemnation (a new job starts with none)."""
    for pattern in ("replica*.json", "condemned_replica*.json"):
        for path in fleet_dir(run_dir).glob(pattern):
            path.unlink(missing_ok=True)


def incarnation(pid: int, node: str | None = None) -> str:
    """The incarnation a replica registered by process `pid` on `node` (default: this host) is known as
    (`registrations`)."""
    return f"{node or socket.gethostname()}:{pid}"


def _write(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(entry))
    os.replace(partial, path)


def condemn_replica(run_dir: Path | str, replica: int, of: str, secret: str, why: str) -> Path:
    """Tell replica `replica`'s launcher that its incarnation `of` (as `registrations` names it) hangs: kill its
    process group and restart it."""
    path = fleet_dir(run_dir) / f"condemned_replica{replica}.json"
    _write(path, {"replica": replica, "incarnation": of, "job": secret_id(secret), "why": why})
    return path


def condemned(run_dir: Path | str, replica: int, secret: str, of: str) -> str | None:
    """Why this job's trainer condemned incarnation `of` of replica `replica`, or None (no condemnation, or one for
    another incarnation or job)."""
    try:
        entry = json.loads((fleet_dir(run_dir) / f"condemned_replica{replica}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("job") != secret_id(secret) or entry.get("incarnation") != of:
        return None
    return str(entry.get("why") or "condemned by the trainer")


def clear_condemned(run_dir: Path | str, replica: int, of: str, secret: str) -> None:
    """Remove replica `replica`'s condemnation if it is for incarnation `of` (its launcher has killed it)."""
    if condemned(run_dir, replica, secret, of) is not None:
        (fleet_dir(run_dir) / f"condemned_replica{replica}.json").unlink(missing_ok=True)


def why_dead(run_dir: Path | str, replica: int, secret: str, of: str, liveness: Liveness | None) -> str | None:
    """Why incarnation `of` of replica `replica`, whose server has not exited, is dead all the same: the trainer
    condemned it (a push's call to it went unanswered, or a worker of it stopped beating, while its `/health`
    answered), or its `/health` has failed for the bound (`liveness`; None: not watched). None while neither. Both
    launchers ask it every poll: `megarl train`'s watcher (`megarl.rollout.restarts`) and `megarl serve`."""
    if (why := condemned(run_dir, replica, secret, of)) is not None:
        return f"condemned by the trainer: {why}"
    if liveness is not None and liveness.dead():
        return liveness.why()
    return None


def register_replica(run_dir: Path | str, replica: int, url: str, secret: str, pid: int | None = None) -> Path:
    """Announce replica `replica` at `url` for the job whose secret is `secret`. `pid`: the process that serves it
    (default: this one); a restarted replica registers again with its new process, which tells the trainer it is a
    new incarnation even at the same URL (`registrations`)."""
    path = fleet_dir(run_dir) / f"replica{replica}.json"
    _write(path, {"replica": replica, "url": url, "node": socket.gethostname(),
                  "pid": os.getpid() if pid is None else pid, "job": secret_id(secret)})
    return path


def unregister_replica(run_dir: Path | str, replica: int) -> None:
    (fleet_dir(run_dir) / f"replica{replica}.json").unlink(missing_ok=True)


def registrations(run_dir: Path | str, secret: str) -> dict[int, tuple[str, str]]:
    """This job's registered replicas now: replica -> (url, incarnation), where the incarnation (node and pid of the
    registering process) changes when a replica is restarted, even at the same URL. Another job's files, partial
    or unreadable ones are skipped."""
    job, found = secret_id(secret), {}
    for path in fleet_dir(run_dir).glob("replica*.json"):
        try:
            entry = json.loads(path.read_text())
            replica = int(entry["replica"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if entry.get("job") == job and entry.get("url"):
            found[replica] = (entry["url"], incarnation(entry.get("pid"), entry.get("node")))
    return found


def job_start(run_dir: Path | str) -> float | None:
    """When this job began: the modification time of its fleet secret (`megarl prepare` writes a fresh one per job,
    RUN_DIR/private/fleet_secret unless MEGARL_FLEET_SECRET_FILE names another); None if there is none."""
    path = os.environ.get(SECRET_ENV) or Path(run_dir) / "private" / SECRET_FILENAME
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def replica_logs(run_dir: Path | str, replica: int, since: float | None = None) -> list[Path]:
    """The logs of replica `replica` that exist (and were written since `since`, this job's start: a log of an
    earlier job in the same run directory says nothing about this one): its step's output
    (logs/serve_replica<i>.log, which the launchers open when the step starts) and its vLLM server's
    (logs/vllm_replica<i>.log)."""
    logs = Path(run_dir) / "logs"
    paths = [logs / f"serve_replica{replica}.log", logs / f"vllm_replica{replica}.log"]
    return [path for path in paths if path.is_file() and (since is None or path.stat().st_mtime >= since)]


def _never_started(replicas: list[int], run_dir: Path | str) -> list[str]:
    """The lines for replicas with no log of this job: their step never ran (pending, or never started)."""
    if not replicas:
        return []
    if len(replicas) == 1:
        first = (f"replica {replicas[0]} never started (no logs/serve_replica{replicas[0]}.log): under SLURM its "
                 "step may be pending; the job's output names it")
    else:
        first = (f"replicas {', '.join(map(str, replicas))} never started (no logs/serve_replica<i>.log): under "
                 "SLURM their steps may be pending; the job's output names them")
    return [first, f"elsewhere start each with `megarl serve --config ... --replica I` against {run_dir}, on a "
            "filesystem this node shares"]


def unregistered_message(run_dir: Path | str, missing: list[int], timeout_s: float,
                         since: float | None = None) -> str:
    """Why the fleet is incomplete: a first line that says it all (it may be all a log line shows), then one
    actionable line per case: each replica that started, with its logs (only those that exist), and those that
    never did."""
    started = {i: logs for i in missing if (logs := replica_logs(run_dir, i, since))}
    never = [i for i in missing if i not in started]
    cases = [f"started but not registered: {list(started)}"] if started else []
    cases += [f"never started: {never}"] if never else []
    lines = [f"rollout replica(s) {missing} did not register in {fleet_dir(run_dir)} within {timeout_s:g}s "
             f"(rollout.startup_timeout_s); {'; '.join(cases)}"]
    lines += [f"  replica {i} started but did not register: see {', '.join(map(str, logs))}"
              for i, logs in started.items()]
    lines += ["  " + line for line in _never_started(never, run_dir)]
    return "\n".join(lines)


def wait_for_fleet(run_dir: Path | str, replicas: int, secret: str, timeout_s: float) -> list[str]:
    """The URLs of replicas 0..replicas-1 of this job, in order, once all have registered; `FleetError` naming
    the missing replicas, which of them started (and their logs) and which never did, if some have not registered
    within `timeout_s` (rollout.startup_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = registrations(run_dir, secret)
        urls = [found[i][0] if i in found else None for i in range(replicas)]
        if all(urls):
            return [url for url in urls if url]
        if time.monotonic() >= deadline:
            missing = [i for i, url in enumerate(urls) if url is None]
            raise FleetError(unregistered_message(run_dir, missing, timeout_s, job_start(run_dir)))
        time.sleep(POLL_S)
