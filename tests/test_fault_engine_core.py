"""The engine-core cell of the fault matrix, on the real stack: `megarl train` with its own fleet (two TP-1 replicas of
the tiny dense model, rollout.restarts=1, sync.interval=3 sync.offset=1 sync.delta=true), and replica 0's engine core
(`VLLM::EngineCore`, what dies on a CUDA error or an out-of-memory) SIGKILLed alone, its API server left alone, right
after the replica answered `/start_weight_update` of a push (so `/update_weights` is in flight, or about to be).

What must hold (docs/pipeline.md, "When a replica dies"): the API server exits by itself, with code 1
(megarl/rollout/engine_death.py), and the run's watcher restarts it; the push that was in flight ends within
rollout.health_timeout_s plus slack (not the 600 s read timeout); the restarted replica rejoins at a later push point
with a full push and reports the final pushed version as the other does; the run finishes every step with exact lags
and every batch whole (prompts x K samples: none lost, none generated twice). The test prints the time to notice and
to recover. Once the push without replica 0 is over, the trainer ranks are held (SIGSTOP) until the replica is
registered again, so that the rejoin does not hang on how fast a loaded machine restarts vLLM."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megarl.launch import prepare, train
from tests.test_end_to_end import _expected_lag

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 10.0  # rollout.health_timeout_s of this run
SLACK_S = 20.0  # a loaded 2-core machine: the server's own shutdown, the push's other steps
M, N, STEPS, PROMPTS, K = 3, 1, 30, 16, 8


def _engine_core(pgid: int) -> int | None:
    """The `VLLM::EngineCore` process in process group `pgid` (its comm is cut to 15 characters), from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and comm.startswith("VLLM::EngineCor") and fields[0] != "Z":
            return int(stat.parent.name)
    return None


def _registration(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "fleet" / "replica0.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class _Killer(threading.Thread):
    """Waits until the run has trained `after` steps, then for replica 0 to answer its next `/start_weight_update`
    (read from its vLLM log, uvicorn's access lines), SIGKILLs its engine core at once, and times the watcher: the
    registration removed (the server's exit seen) and a new incarnation registered (the trainer held meanwhile,
    once the push without replica 0 is over)."""

    def __init__(self, run_dir: Path, after: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.after = run_dir, after
        self.times: dict[str, float] = {}
        self.error: str | None = None
        self.killed_pid: int | None = None

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # noqa: BLE001 - reported by the test
            self.error = f"{type(err).__name__}: {err}"

    def _run(self) -> None:
        log, metrics = self.run_dir / "vllm_replica0.log", self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 900
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= self.after):
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.2)
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            seen = b""
            while b"POST /start_weight_update" not in seen:
                assert time.monotonic() < deadline, "no push reached replica 0"
                seen = seen[-200:] + f.read()
                time.sleep(0.01)
        pid = (_registration(self.run_dir) or {})["pid"]
        core = _engine_core(pid)
        assert core is not None, f"no engine core in replica 0's process group {pid}"
        os.kill(core, signal.SIGKILL)
        self.killed_pid, self.times["kill"] = pid, time.monotonic()
        while (_registration(self.run_dir) or {}).get("pid") == pid:
            assert time.monotonic() < deadline, "replica 0's registration stayed"
            time.sleep(0.05)
        self.times["gone"] = time.monotonic()
        # once a push went on without replica 0, the trainer is held (SIGSTOP) until the replica is registered again,
        # so that its rejoin does not depend on how fast this machine restarts vLLM (minutes on a loaded 2-core one)
        while not any(_without_replica0(line) for line in metrics.read_text().splitlines()):
            assert time.monotonic() < deadline, "no push went on without replica 0"
            time.sleep(0.05)
        held = _trainer_processes()
        for p in held:
            os.kill(p, signal.SIGSTOP)
        self.times["held"] = time.monotonic()
        try:
            while (entry := _registration(self.run_dir)) is None or entry["pid"] == pid:
                assert time.monotonic() < deadline, "replica 0 was not registered again"
                time.sleep(0.2)
            self.times["back"] = time.monotonic()
        finally:
            for p in held:
                os.kill(p, signal.SIGCONT)


def _without_replica0(line: str) -> bool:
    served = json.loads(line).get("sync/served_versions")
    return bool(served) and "0" not in served


def _trainer_processes() -> list[int]:
    """The trainer ranks and their helpers: this process's descendants in its own process group (the fleet's
    servers lead process groups of their own, and this process runs the watcher that restarts them)."""
    parent, group = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)], group[int(stat.parent.name)] = int(fields[1]), int(fields[2])
    me, mine = os.getpid(), os.getpgid(0)

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == me:
                return True
        return False

    return [pid for pid in parent if pid != me and group[pid] == mine and descends(pid)]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two vLLM starts and a restart: minutes each on a loaded 2-core machine
def test_engine_core_killed_mid_push_costs_seconds_and_the_replica_rejoins(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    cfg = prepare(str(ROOT / "configs" / "repro.yaml"), [
        f"model.hf_dir={tmp_path / 'dense'}", "model.tiny=dense", f"run.dir={run_dir}", f"run.steps={STEPS}",
        "rollout.replicas=2", "rollout.tp=1", "rollout.restarts=1", f"rollout.health_timeout_s={BOUND_S}",
        "rollout.startup_timeout_s=300", f"sync.interval={M}", f"sync.offset={N}", "sync.delta=true",
        "sync.push_initial=true", f"data.prompts_per_step={PROMPTS}", f"rollout.samples_per_prompt={K}"])
    killer = _Killer(run_dir, after=1)
    killer.start()
    started = time.monotonic()
    train(cfg)
    wall = time.monotonic() - started
    killer.join(5)
    err = capfd.readouterr().err
    assert killer.error is None and "back" in killer.times, (killer.error, killer.times, err[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # the run: every step, exact lags, every batch whole
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["batch_lag"] for r in records] == [_expected_lag(b, M, N) for b in range(STEPS)]
    assert [r["batch/samples"] for r in records] == [PROMPTS * K] * STEPS

    # the server exited by itself (code 1: its engine died), the watcher saw it within the bound and restarted it
    t = killer.times
    notice_s, gone_s, back_s = None, t["gone"] - t["kill"], t["back"] - t["kill"]
    assert "rollout replica 0 (" in err and ") exited with code 1 (log " in err, err[-3000:]
    assert "restarted as http" in err and "(restart 1 of 1)" in err, err[-3000:]
    assert gone_s < BOUND_S + SLACK_S

    # the push the kill hit: the first step after the kill whose push left replica 0 out
    out = [r for r in records if r.get("sync/served_versions") and "0" not in r["sync/served_versions"]]
    assert out, "no push went on without replica 0"
    hit = out[0]
    notice_s = hit["time/push_s"]  # the whole push, kill included: an upper bound on the time to notice
    assert notice_s < BOUND_S + SLACK_S, hit
    assert 1 in {r["fleet/replicas_in_sync"] for r in records}  # it was out ...
    back = [r for r in records if r["step"] > hit["step"] and r.get("sync/served_versions", {}).keys() == {"0", "1"}]
    assert back, "replica 0 never rejoined the sync"
    rejoined = back[0]
    # ... and in at the end: both replicas in the sync and taking chunks, both serving the last pushed version
    last = records[-1]
    assert (last["fleet/replicas"], last["fleet/replicas_in_sync"]) == (2, 2)
    final = [r for r in records if r["sync/versions"]][-1]
    version = str(final["sync/versions"][-1])
    assert final["sync/served_versions"] == {"0": version, "1": version}
    print(f"engine core of replica 0 killed at step {hit['step']}'s push: the push took {notice_s:.1f} s (bound "
          f"{BOUND_S:g} s), the server's exit was seen after {gone_s:.1f} s, the replica was registered again after "
          f"{back_s:.1f} s (the trainer held for the last {t['back'] - t['held']:.1f} s of it) and rejoined at step "
          f"{rejoined['step']}'s push; {len(out)} push(es) without it; run {wall:.0f} s for {STEPS} steps")
