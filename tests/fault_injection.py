"""The fault matrix's injector (tests/test_fault_matrix.py, tests/test_fault_matrix_tp.py; under the SLURM job:
tests/test_slurm_fault_matrix.py): a thread that watches a run's files (metrics.jsonl, the replicas' vLLM logs, the
registrations in <run.dir>/fleet/), injects one failure after another into the run's own fleet and times each cell;
and the /proc look-ups it needs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from megarl.rollout.fleet_auth import SECRET_ENV, bearer_header, read_secret
from tests.dist_utils import engine_core, log_grows, process_group_members


def registration(run_dir: Path, replica: int) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "fleet" / f"replica{replica}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def secret_file_of(pid: int) -> Path:
    env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return Path(next(v for v in env if v.startswith(f"{SECRET_ENV}=".encode())).decode().split("=", 1)[1])


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # exited meanwhile


class FaultInjector(threading.Thread):
    """Injects a test's cells one after another (its `_run`) and times each: `kill` (the signal sent),
    `gone` (the registration removed: the watcher saw the exit or the death), `group` (no process of the replica's
    process group left), `back` (a new incarnation registered). `cells[name]` also records the step under way at
    the kill (`step`), the replica, its registered pid (`pid`: the incarnation), its vLLM server's pid (`server`:
    its process group's leader) and URL (`killed_url`; `url` is the new incarnation's), the process signalled
    (`victim`) and, for A, the new incarnation's checks.

    Nothing of the run is held: the trainer trains on at full speed while a killed replica restarts, as a user's run
    would, and each test's run is long enough to outlast its restarts; a kill at an exact moment of a push is made by
    the process that passes the point (`_kill_at_failpoint`), which goes on at once.

    Written for `megarl train`'s own fleet, where the registered pid is the server's; another launcher overrides
    `_server_of` (and passes `log_dir`, where the vLLM logs are)."""

    def __init__(self, run_dir: Path, failpoints: Path | None = None, log_dir: Path | None = None,
                 deadline_s: float = 1500) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.log_dir = run_dir if log_dir is None else log_dir  # where vllm_replica<i>.log are
        self.failpoints = failpoints  # the run's MEGARL_FAILPOINTS directory, for `_kill_at_failpoint`
        self.metrics = run_dir / "metrics.jsonl"
        self.cells: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.stale: bool | None = None  # whether an earlier run's registration was there once the run trained
        self.deadline = time.monotonic() + deadline_s  # the whole injection's bound (`_until`)

    def _run(self) -> None:
        raise NotImplementedError

    def _server_of(self, entry: dict[str, Any]) -> int:
        """The pid of the vLLM server (its process group's leader) of registration `entry`."""
        return entry["pid"]

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.error = f"{type(err).__name__}: {err}"

    # -- what the thread reads

    def _records(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    def _until(self, condition: Callable[[], Any], what: str, every_s: float = 0.05) -> Any:
        while not (value := condition()):
            assert time.monotonic() < self.deadline, f"{what}: not before the test's deadline"
            time.sleep(every_s)
        return value

    def _tail(self, replica: int, offset: int, needle: bytes) -> None:
        """Wait until replica `replica`'s vLLM log has `needle` (an access line) after byte `offset`."""
        log = self.log_dir / f"vllm_replica{replica}.log"
        self._until(log_grows(log, needle, offset), f"{needle!r} in {log.name}", every_s=0.01)

    def _grows_in_order(self, replica: int, *needles: bytes) -> Callable[[], bool]:
        """A condition to poll: whether replica `replica`'s vLLM log has had `needles` appended in this order since
        now (access lines of one request after another)."""
        log = self.log_dir / f"vllm_replica{replica}.log"
        at = log.stat().st_size

        def grown() -> bool:
            with log.open("rb") as f:
                f.seek(at)
                text, i = f.read(), 0
            for needle in needles:
                i = text.find(needle, i)
                if i < 0:
                    return False
                i += len(needle)
            return True
        return grown

    def _log_end(self, replica: int) -> int:
        return (self.log_dir / f"vllm_replica{replica}.log").stat().st_size

    # -- one cell

    def _kill_at_failpoint(self, name: str, replica: int, point: str,
                           target: Callable[[int], int] | None) -> dict[str, Any]:
        """A kill at an exact moment of a push, with nobody held: arm failpoint `point` with `kill <pid>`
        (`failpoints.KILL_PROCESS`, the victim `target(server)` named now) or, for `target` None, with `kill-engine`
        (a vLLM worker's point: the worker kills its own engine core); the first process to pass it kills at once
        and goes on. The cell records that process (`holder`), whether it was a process of the replica's group
        (`holder_in_replica`), and the kill's time from its record."""
        from megarl.sync import failpoints

        assert self.failpoints is not None, "the run has no failpoint directory"
        entry = registration(self.run_dir, replica)
        assert entry is not None, f"{name}: replica {replica} is not registered"
        server = self._server_of(entry)
        group = process_group_members(server)
        expected = self._core(server) if target is None else target(server)
        armed, reached = self.failpoints / point, self.failpoints / f"{point}.reached"
        reached.unlink(missing_ok=True)
        armed.write_text(failpoints.KILL_ENGINE if target is None else f"{failpoints.KILL_PROCESS} {expected}")
        record = json.loads(self._until(lambda: reached.exists() and reached.read_text().strip(),
                                        f"failpoint {point} passed"))
        victim = record["engine_core"] if target is None else record["victim"]
        assert victim == expected and record.get("killed", True), (name, expected, record)
        cell = self._cell(name, replica, entry, server, victim, time.monotonic() - (time.time() - record["time"]),
                          len(self._records()))
        cell["holder"], cell["holder_in_replica"] = record["pid"], record["pid"] in group
        return cell

    def _kill(self, name: str, replica: int, target: Callable[[int], int], step: int | None = None,
              sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Send `sig` to `target(server)` (server: the replica's vLLM server, its process group's leader)."""
        entry = registration(self.run_dir, replica)
        assert entry is not None, f"{name}: replica {replica} is not registered"
        server = self._server_of(entry)
        victim = target(server)
        os.kill(victim, sig)
        return self._cell(name, replica, entry, server, victim, time.monotonic(),
                          len(self._records()) if step is None else step)

    def _cell(self, name: str, replica: int, entry: dict[str, Any], server: int, victim: int, kill: float,
              step: int) -> dict[str, Any]:
        """Cell `name`'s record of a kill (the class docstring's keys), kept in `cells`; `server` was looked up
        before the kill (a killed server is no longer found by another launcher's `_server_of`)."""
        cell = {"replica": replica, "pid": entry["pid"], "server": server, "killed_url": entry["url"],
                "victim": victim, "kill": kill, "step": step}
        self.cells[name] = cell
        return cell

    def _recover(self, cell: dict[str, Any]) -> None:
        """After a kill: wait until the replica is registered again, the trainer training on meanwhile; the times the
        watcher removed the registration and the replica's process group died are taken as well."""
        replica, pid, server = cell["replica"], cell["pid"], cell["server"]

        def watch() -> bool:
            now = time.monotonic()
            if "gone" not in cell and (registration(self.run_dir, replica) or {}).get("pid") != pid:
                cell["gone"] = now
            if "group" not in cell and not process_group_members(server):
                cell["group"] = now
            entry = registration(self.run_dir, replica)
            if entry is not None and entry["pid"] != pid and "gone" in cell and "group" in cell:
                cell["back"], cell["new_pid"], cell["url"] = now, entry["pid"], entry["url"]
                cell["back_step"] = len(self._records())  # the step under way as it registered
                return True
            return False

        self._until(watch, f"replica {replica} registered again")
        cell["log_at_back"] = self._log_end(replica)
        if "checks" in cell:
            cell["checks"](registration(self.run_dir, replica))

    def _unhealthy(self, cell: dict[str, Any]) -> tuple[int, str] | None:
        """The replica's `/health` answer (status, body) if it is not 200 now ((0, why) if it did not answer); None
        while it passes. For a condition to poll after a hang (`_until`)."""
        try:
            reply = requests.get(f"{cell['killed_url']}/health", timeout=2)
        except requests.RequestException as err:
            return 0, f"{type(err).__name__}: {err}"
        return None if reply.status_code == 200 else (reply.status_code, reply.text)

    def _rejoined(self, replica: int, after: int) -> int:
        """The step whose push took `replica` back (it reports a version), after step `after`."""
        return self._until(lambda: next((r["step"] for r in self._records() if r["step"] > after and str(replica) in
                                         (r.get("sync/served_versions") or {})), None), f"replica {replica} rejoined")

    def _new_incarnation(self, cell: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        def checks(entry: dict[str, Any]) -> None:
            url, secret = entry["url"], read_secret(secret_file_of(entry["pid"]))
            cell["health"] = requests.get(f"{url}/health", timeout=10).status_code
            cell["unguarded"] = requests.get(f"{url}/v1/models", timeout=30).status_code
            cell["guarded"] = requests.get(f"{url}/v1/models", headers=bearer_header(secret), timeout=30).status_code
        return checks

    @staticmethod
    def _core(pid: int) -> int:
        core = engine_core(pid)
        assert core is not None, f"no engine core in process group {pid}"
        return core

    @staticmethod
    def _worker(pid: int) -> int:
        """The last TP worker (`VLLM::Worker_TP<r>`, by its process title) in process group `pid`."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                title = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if int(fields[2]) == pid and fields[0] != "Z" and title.startswith("VLLM::Worker_TP"):
                found.append((title, int(stat.parent.name)))
        assert found, f"no TP worker in process group {pid}"
        return max(found)[1]
