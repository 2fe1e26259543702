"""`megarl train`'s own fleet (`start_fleet(..., run_dir=...)`) registers its replicas in `<run.dir>/fleet/` and
restarts one whose server dies, at most `rollout.restarts` times (megarl/rollout/restarts.py). Real vLLM servers
(TP-1 replicas of the tiny MoE, ~30 s per start on 2 cores) killed with SIGKILL, and checked from outside: the
registration file as written on disk, HTTP requests to the URL it names, and /proc (which processes carry the
fleet's secret file in their environment: every server process, engine core and workers included)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from megarl.config.load import load_config
from megarl.config.schema import Config
from megarl.rollout.fleet_auth import bearer_header, read_secret
from megarl.rollout.rendezvous import register_replica, registrations
from megarl.rollout.run_fleet import start_fleet
from tests.dist_utils import fleet_processes, process_group_members

ROOT = Path(__file__).resolve().parent.parent
STAGGER_S = 3.0  # replica 1 is killed this long after replica 0's failing restart began (see the test)


def _config(model_dir: Path, run_dir: Path, restarts: int, replicas: int = 1) -> Config:
    return load_config(ROOT / "configs" / "repro.yaml", [
        f"model.hf_dir={model_dir}", f"run.dir={run_dir}", f"rollout.replicas={replicas}", "rollout.tp=1",
        f"rollout.restarts={restarts}", "rollout.startup_timeout_s=300"])


def _registration(run_dir: Path, replica: int = 0) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "fleet" / f"replica{replica}.json").read_text())
    except FileNotFoundError:
        return None


class _Stderr:
    """What the test's process wrote to stderr so far (the watcher's threads print there)."""

    def __init__(self, capfd: pytest.CaptureFixture[str]) -> None:
        self.capfd, self.text = capfd, ""

    def read(self) -> str:
        self.text += self.capfd.readouterr().err
        return self.text


def _wait(condition: Callable[[], bool], timeout_s: float, what: str, stderr: _Stderr) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f}s; stderr:\n{stderr.read()[-3000:]}"
        time.sleep(0.2)


def _model(tiny_moe_dir: Path, tmp_path: Path) -> Path:
    """This test's own copy of the checkpoint (one test breaks it)."""
    return Path(shutil.copytree(tiny_moe_dir, tmp_path / "model"))


def test_dead_replicas_are_restarted_a_failed_restart_counts_and_stopping_stops_a_restart(
        tiny_moe_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One fleet of two replicas, rollout.restarts=2 (one fleet start for every case): replica 0 killed is restarted
    (restart 1 of 2); then every start fails (a broken config.json), and replica 0 killed again spends its last
    restart on a failed start and stays down, nothing restarting it after; replica 1, killed while replica 0's failed
    restart is under way (the two failed starts overlap), has a failed restart 1, and leaving the block while its
    restart 2 is under way stops that restart."""
    run_dir, stderr, model = tmp_path / "run", _Stderr(capfd), _model(tiny_moe_dir, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the broken checkpoint must not send vLLM to the network
    # registrations an earlier run left in the same run directory: not this fleet's
    register_replica(run_dir, 0, "http://127.0.0.1:9", "an earlier run's secret", pid=1)
    register_replica(run_dir, 3, "http://127.0.0.1:9", "an earlier run's secret", pid=1)
    cfg = _config(model, run_dir, restarts=2, replicas=2)
    with start_fleet(cfg, log_dir=tmp_path / "logs", run_dir=run_dir) as fleet:
        secret_file, secret, (log, log1) = fleet.secret_file, read_secret(fleet.secret_file), fleet.logs
        (first, other), (first_url, other_url) = fleet.procs, fleet.urls
        entry = _registration(run_dir)
        assert entry is not None and (entry["url"], entry["pid"]) == (first_url, first.pid)
        host = socket.gethostname()
        assert registrations(run_dir, secret) == {0: (first_url, f"{host}:{first.pid}"),
                                                  1: (other_url, f"{host}:{other.pid}")}
        assert not (run_dir / "fleet" / "replica3.json").exists(), "an earlier run's registration survived"
        assert {first.pid, other.pid} <= set(fleet_processes(secret_file))

        # replica 0 killed: restarted (restart 1 of 2), registered again, healthy and guarded
        os.killpg(first.pid, signal.SIGKILL)
        _wait(lambda: (_registration(run_dir) or {}).get("pid", first.pid) != first.pid, 400,
              "a new incarnation registered", stderr)
        entry, second, url = _registration(run_dir), fleet.procs[0], fleet.urls[0]
        assert entry is not None and entry["pid"] == second.pid != first.pid and entry["url"] == url
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        assert requests.get(f"{url}/v1/models", timeout=30).status_code == 401  # guarded
        assert requests.get(f"{url}/v1/models", headers=bearer_header(secret), timeout=30).status_code == 200
        assert not process_group_members(first.pid), "the dead incarnation's engine core or workers outlived it"
        assert (f"megarl: rollout replica 0 ({first_url}) exited with code -9 (log {log}); restarted as {url} "
                "(restart 1 of 2)") in stderr.read()
        assert "===== megarl: restart 1 of 2 of rollout replica 0" in log.read_text()  # the log goes on
        entry1 = _registration(run_dir, 1)  # replica 1 untouched
        assert entry1 is not None and (entry1["url"], entry1["pid"]) == (other_url, other.pid)

        (model / "config.json").write_text("{ not json")  # every start from here fails
        # replica 0 killed again: its restart 2 of 2 fails (counted), and with none left it stays down. Replica 1 is
        # killed while that failed start is under way (both failed starts at once, not one after the other: each is
        # a vLLM import, ~15 s), STAGGER_S after it began, so that replica 0's stays-down line comes about
        # STAGGER_S before replica 1's first failed restart and its three idle polls are over by then
        os.killpg(second.pid, signal.SIGKILL)
        _wait(lambda: "===== megarl: restart 2 of 2 of rollout replica 0" in log.read_text(), 300,
              "replica 0's restart 2 begun", stderr)
        time.sleep(STAGGER_S)
        # replica 1 untouched meanwhile: replica 0 died twice and was restarted twice
        assert other.poll() is None and _registration(run_dir, 1) is not None
        entry1 = _registration(run_dir, 1)
        assert entry1 is not None and (entry1["url"], entry1["pid"]) == (other_url, other.pid)
        # replica 1 killed: restart 1 of 2 fails; restart 2 is under way (its server takes seconds to fail):
        # leaving the block stops it
        os.killpg(other.pid, signal.SIGKILL)

        _wait(lambda: "stays down" in stderr.read(), 300, "the stays-down line", stderr)
        down_at = time.monotonic()
        assert (f"megarl: rollout replica 0 ({url}) exited with code -9 (log {log}); restart 2 of 2 failed: "
                "vLLM server") in stderr.read()
        line = stderr.read().split("restart 2 of 2 failed")[1].splitlines()[0]
        assert ", its log ending: OSError: " in line and "is not a valid JSON file" in line, line
        assert line.endswith(f"(log {log})"), line
        assert ("megarl: rollout replica 0 (restart 2 failed); it stays down: no restarts left (rollout.restarts=2"
                in stderr.read())
        assert _registration(run_dir) is None
        failed = fleet.procs[0]  # the failed restart's server

        _wait(lambda: "restart 1 of 2 failed" in stderr.read(), 300, "replica 1's failed restart's line", stderr)
        time.sleep(max(0.0, 3 - (time.monotonic() - down_at)))  # three polls since replica 0 stayed down
        # nothing restarts replica 0
        assert fleet.procs[0] is failed and not any(process_group_members(p.pid) for p in (first, second, failed))
        assert stderr.read().count("megarl: rollout replica 0") == 3  # restarted, failed, stays down
        assert log.read_text().count("===== megarl: restart") == 2
        assert _registration(run_dir, 1) is None
        assert (f"megarl: rollout replica 1 ({other_url}) exited with code -9 (log {log1}); restart 1 of 2 failed: "
                "vLLM server") in stderr.read()
        line = stderr.read().split("restart 1 of 2 failed")[1].splitlines()[0]
        assert ", its log ending: OSError: " in line and "is not a valid JSON file" in line, line
        assert line.endswith(f"(log {log1})"), line
    assert not fleet_processes(secret_file), "a server outlived the fleet"
    assert not process_group_members(fleet.procs[1].pid) and not process_group_members(other.pid)
    # nothing more said of replica 1: no restart 2 of it ended, it was not said to stay down
    assert "rollout replica 1 (restart 1 failed)" not in stderr.read()
    assert stderr.read().count("stays down") == 1 and stderr.read().count("restart 2 of 2") == 1  # replica 0's
    assert not list((run_dir / "fleet").glob("replica*.json"))
    assert log1.read_text().count("===== megarl: restart") in (1, 2)  # restart 2 had begun, or had not
