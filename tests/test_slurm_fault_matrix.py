"""The fault matrix's newer cells under `sbatch slurm/guru_moe.sh` on the emulated SLURM cluster (issue 36, "a
representative subset under the SLURM job"): the shipped script at CPU scale as tests/test_slurm_job.py runs it (two
trainer ranks on node1 and node2, two TP-1 replicas sharing node3), where the launcher that restarts a replica is the
job script's step monitor and the liveness that kills a hung one is `megarl serve`'s own.

Marked `slow` (`make test-all`, `pytest -m slow`): five vLLM starts and a run long enough to outlast three
restarts at full speed, more than the default suite's budget allows. The default suite's
tests/test_slurm_failover.py covers a replica step killed by `scancel`, an engine core SIGKILLed mid-push (restart,
full-push rejoin) and an API server hung (SIGSTOP) under the same job; tests/test_fault_matrix.py has cells R and P
under `megarl train`, tests/test_liveness.py a hung engine core's /health on a real replica.

One job of STEPS steps (rollout.health_timeout_s=8, rollout.step_timeout_s=10, ROLLOUT_RESTARTS=2, sync.interval=2
sync.offset=1), and a thread of the test that watches the run's files (tests/fault_injection.py's injector, with the
job's server pids and trainer ranks) and injects one failure after another, each followed by the job's restart of
the replica's step and a full-push rejoin. Nothing of the run is held: the trainer trains on at full speed on the
other replica while a killed one restarts, as a user's job would, and the run is long enough to outlast the three
restarts (STEPS). The two kills at an exact moment of a push are made by trainer rank 0 itself as it passes a
failpoint (`MEGARL_FAILPOINTS` reaches it through sbatch and srun, whose `--export=ALL` default passes the submitting
environment to every step), armed with `kill <pid>` (`failpoints.KILL_PROCESS`): it SIGKILLs the process and goes on.

    R  replica 0's engine core (`VLLM::EngineCore`) SIGKILLed once its workers have loaded a push, before the
       trainer reads their report (failpoint `push.report.replica0`)
    H  replica 1's engine core hung: SIGSTOPped (never continued) as it generates, in a step without a push (a
       chunk of it answered after a push's record, the next step's record not written yet). vLLM's own /health
       stays 200; megarl's engine probe turns it 503 after rollout.step_timeout_s, `megarl serve` judges the replica
       dead rollout.health_timeout_s later, kills its whole process group and exits 1, and the job restarts the
       step. The trainer goes on meanwhile: its chunks on replica 1 wait until its calls give the replica up
       (/health failing rollout.health_timeout_s), and a push that begins meanwhile waits on the stopped engine core
       at its /pause, which does not excuse the silence (megarl/rollout/engine_probe.py). If the stop came after
       the next push's /pause had been answered (the engine RPCs of a push in flight keep /health at 200, and the
       push's own bound would judge the replica instead), the core is continued at once and the next push tried
       (`_stop_between_pushes`). The trainer's own give-up on a failing /health is tests/test_liveness.py's.
    P  replica 1's API server SIGKILLed while it is paused for a push, before its update is opened (failpoint
       `push.paused.replica1`)

Each cell is checked from outside, as in tests/test_fault_matrix.py: noticed within the bound (the push without the
replica: its own time, for H within both bounds; H: /health 503 within rollout.step_timeout_s and the step
monitor's kill within both bounds), the registration removed, the replica's whole process group gone, a new
incarnation registered (new pid), a rejoin at a later push that sends it the whole model (`sync.delta` off: every
push is full, and its bytes are counted as received). For the job: exit code 0, every step once at the schedule's
exact lag, prompts x K samples in every step, finite metrics, after every push each replica in the sync reporting
that push's version (the restarted ones included), both in the sync at the end, the job's restart lines, each
replica's exit codes. Each cell's times are printed (docs/pipeline.md's fault table, the SLURM rows)."""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest

from megarl.sync import failpoints
from tests.dist_utils import engine_core, log_grows, process_group_members
from tests.fault_injection import FaultInjector, registration, signal_quietly
from tests.slurm_cluster import SlurmCluster
from tests.test_slurm_failover import _rank_pids, _server_pid
from tests.test_slurm_job import (
    SCRIPT,
    _describe,
    _expected_lag,
    _job_env,
    _job_output,
    _model_bytes,
    _records,
    _seed_model,
)

pytestmark = pytest.mark.slow

PROMPTS, K = 32, 8  # configs/demo_moe.yaml's data.prompts_per_step and rollout.samples_per_prompt
# the run's steps, enough for the trainer, never held, to outlast three restarts one after another (a vLLM start
# beside the trainer at full speed took 50-55 s under this job, about 60 steps: tests/test_slurm_failover.py), H's
# judgement (18-20 s) and each rejoin; configs/demo_moe.yaml's sync.interval and sync.offset
STEPS, M, N = 360, 2, 1
BOUND_S = 8.0  # the job's rollout.health_timeout_s
STEP_BOUND_S = 10  # the job's rollout.step_timeout_s: the engine probe's bound
SLACK_S = 20.0  # a loaded 2-core machine: the server's own shutdown, the job's polls (POLL_S=1)
RESTARTS = 2  # ROLLOUT_RESTARTS: replica 0 is killed once (R), replica 1 twice (H, P)
JOB_TIMEOUT_S = 1800  # STEPS at full speed and five vLLM starts on a loaded machine
ORDER = ("R", "H", "P")


class _SlurmFaults(FaultInjector):
    """The cells of the module's docstring, in `ORDER`, on the job's fleet: a registration names `megarl serve`'s
    pid (the incarnation), its vLLM server leads a process group of its own; the trainer ranks are the `megarl rank`
    tasks of the job's trainer step. Nothing is held."""

    def _server_of(self, entry: dict[str, Any]) -> int:
        return _server_pid(entry["url"])

    def _last_push(self, replica: int, after: int) -> dict[str, Any] | None:
        """The run's last record, if it is a push's at a step >= `after` that reached `replica`."""
        records = self._records()
        last = records[-1] if records else None
        return last if last is not None and last["step"] >= after and str(replica) in (
            last.get("sync/served_versions") or {}) else None

    def _stop_between_pushes(self, name: str, replica: int, after: int) -> dict[str, Any]:
        """Stop (SIGSTOP, never continued) `replica`'s engine core while it generates in a step without a push: once
        a push at a step >= `after` reached it and one of its chunks answered after that push's record, while the
        next step's record is not written yet (the next push comes after it: one every M=2 steps). A push that
        reached its /pause before the stop would keep /health at 200 with its engine RPCs in flight, and the push's
        own bound would judge the replica, not the engine probe; so if the replica's log has a /pause answered after
        the push's record, the core is continued at once (stopped for milliseconds, far below any bound) and the
        next push is tried. The cell records the tries (`tries`) and the log's end at the stop (`log_at_stop`)."""
        tries = 0
        while True:
            tries += 1
            push = self._until(lambda since=after: self._last_push(replica, since),
                               f"a push at step >= {after} that reached replica {replica}")
            since_push = self._log_end(replica)  # the push's own /pause and /resume are logged before its record
            self._tail(replica, since_push, b"POST /inference/v1/generate")
            if len(self._records()) == push["step"] + 1:
                log_at_stop = self._log_end(replica)
                cell = self._kill(name, replica, self._core, sig=signal.SIGSTOP)
                if not log_grows(self.log_dir / f"vllm_replica{replica}.log", b"POST /pause", since_push)():
                    cell["tries"], cell["log_at_stop"] = tries, log_at_stop
                    return cell
                signal_quietly(cell["victim"], signal.SIGCONT)
            after = push["step"] + 1

    def _run(self) -> None:
        self._until(lambda: len(self._records()) >= 1, "the run's first step", every_s=0.2)

        # R: replica 0's engine core killed once its workers have loaded a push, before its report is read: by trainer
        # rank 0 itself as it passes the point
        r = self._kill_at_failpoint("R", 0, "push.report.replica0", self._core)
        r["ranks"] = _rank_pids(self.run_dir)
        self._recover(r)
        r["rejoined"] = self._rejoined(0, r["step"])

        # H: replica 1's engine core stopped as it generates, in a step without a push; the trainer goes on
        h = self._stop_between_pushes("H", 1, r["rejoined"])

        def step_monitor() -> bool:  # /health turns 503 (the probe), then `megarl serve` ends the replica
            now = time.monotonic()
            if "503" not in h and (self._unhealthy(h) or (0,))[0] == 503:
                h["503"] = now
            if "gone" not in h and (registration(self.run_dir, 1) or {}).get("pid") != h["pid"]:
                h["gone"] = now
            if "group" not in h and not process_group_members(h["server"]):
                h["group"] = now
            return "gone" in h and "group" in h

        give_up_s = STEP_BOUND_S + BOUND_S + 2 * SLACK_S
        try:
            self._until(lambda: step_monitor() or time.monotonic() - h["kill"] > give_up_s,
                        "replica 1's step ended by `megarl serve`", every_s=0.2)
            assert "group" in h, f"replica 1 was not judged dead after {give_up_s:g} s: {h}"
        except BaseException:  # the job goes on to its end, the hung engine core no longer in its way
            if (core := engine_core(h["server"])) is not None:
                signal_quietly(core, signal.SIGKILL)
            raise
        h["dead"] = h["group"]
        self._recover(h)
        h["rejoined"] = self._rejoined(1, h["step"])

        # P: replica 1's API server killed while it is paused for a push, before its update is opened: by trainer
        # rank 0 as it passes the point
        p = self._kill_at_failpoint("P", 1, "push.paused.replica1", lambda pid: pid)
        self._recover(p)
        p["rejoined"] = self._rejoined(1, p["step"])


@pytest.mark.timeout(2100)  # the job's own bound (JOB_TIMEOUT_S) and the checks after it
def test_newer_cells_under_the_slurm_job(slurm_cluster: SlurmCluster, tmp_path: Path, tiny_moe_dir: Path) -> None:
    run_dir, logs, points = tmp_path / "run", tmp_path / "run" / "logs", tmp_path / "failpoints"
    points.mkdir()
    _seed_model(tmp_path, tiny_moe_dir)
    env = _job_env(tmp_path, f"run.steps={STEPS} eval.interval=0 rollout.health_timeout_s={BOUND_S:g} "
                             f"rollout.step_timeout_s={STEP_BOUND_S}")
    env |= {"ROLLOUT_RESTARTS": str(RESTARTS), failpoints.ENV: str(points)}
    faults = _SlurmFaults(run_dir, points, log_dir=logs, deadline_s=JOB_TIMEOUT_S)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(slurm_cluster.sbatch_wait, SCRIPT, "--nodes=3", f"--output={tmp_path}/job-%j.out",
                          env_extra=env, timeout_s=JOB_TIMEOUT_S, cwd=tmp_path)
        faults.start()
        result = job.result()
    wall = time.monotonic() - started
    faults.join(5)
    why = _describe(slurm_cluster, tmp_path, result)
    cells = faults.cells
    if faults.error is not None or "rejoined" not in cells.get(ORDER[-1], {}):
        stacks = "".join(traceback.format_stack(sys._current_frames()[t.ident]) for t in threading.enumerate()
                         if t is faults and t.ident in sys._current_frames())
        pytest.fail(f"{faults.error}; cells {json.dumps(cells, default=str)}; injector {stacks}\n{why}")
    assert result.returncode == 0, why
    output = _job_output(tmp_path, result)
    assert "trainer finished" in output and "stays down" not in output, why

    # the job restarted replica 0 once (R) and replica 1 twice (H, P), each after its step ended with code 1
    # (`megarl serve` exits 1 when its server dies or is judged dead)
    assert re.findall(r"rollout replica (\d) exited with code (\d+) .*restarting it \(restart (\d) of 2\)", output) \
        == [("0", "1", "1"), ("1", "1", "1"), ("1", "1", "2")], why
    assert re.search(r"rollout replica\(s\) that died during the run: replica 0 \(exit code 1; restarted 1 of 2 "
                     r"time\(s\); up again; .*replica 1 \(exit codes 1,1; restarted 2 of 2 time\(s\); up again;",
                     output), why
    # R: the engine core's death ended its server, and `megarl serve` with it; P: the server itself was killed
    serve0, serve1 = (logs / "serve_replica0.log").read_text(), (logs / "serve_replica1.log").read_text()
    assert re.search(r"rollout replica 0 \(\S+\) died: its vLLM server exited with code [01] ", serve0), serve0
    assert re.search(r"rollout replica 1 \(\S+\) died: its vLLM server exited with code -9 ", serve1), serve1
    # H: `megarl serve` judged the hung replica dead from its /health (503: the engine probe), not from an exit
    assert re.search(r"rollout replica 1 \(\S+\) is dead: /health answered 503.*; stopping its server", serve1), serve1
    vllm1 = (logs / "vllm_replica1.log").read_bytes()[cells["H"]["log_at_stop"]:].decode(errors="replace")
    assert "megarl: /health answers 503: the engine core has not answered for" in vllm1, vllm1[-3000:]
    for i, restarts in ((0, 1), (1, 2)):
        text = (logs / f"vllm_replica{i}.log").read_text()
        assert [f"===== megarl: restart {k} of {RESTARTS} of rollout replica {i}" in text
                for k in range(1, RESTARTS + 1)] == [k <= restarts for k in range(1, RESTARTS + 1)], i
    # MEGARL_FAILPOINTS reached trainer rank 0 through sbatch and srun: a rank of the job's trainer step killed there
    assert cells["R"]["holder"] in cells["R"]["ranks"], cells["R"]
    assert not list(points.glob("push.*.replica?")), "a failpoint left armed"
    # a clean end: no registration left, the job's secret gone
    assert not list((run_dir / "fleet").glob("replica*.json")), why
    assert not (run_dir / "private").exists(), why

    records = _records(run_dir)
    by_step = {r["step"]: r for r in records}
    # every step of the run trained once, at the schedule's lag, on prompts x K samples, with finite metrics
    assert [r["step"] for r in records] == list(range(STEPS)), why
    assert [r["batch_lag"] for r in records] == [_expected_lag(b, M, N) for b in range(STEPS)], why
    assert all(r["batch/samples"] == PROMPTS * K for r in records), [r["batch/samples"] for r in records]
    for r in records:
        for key in ("loss", "entropy", "reward/mean", "grad_norm"):
            assert math.isfinite(r[key]), (key, r)
    # the pushes reached both, one (R), both, one (H), both, one (P), both: each rejoin before the next cell
    in_sync = [r["fleet/replicas_in_sync"] for r in records]
    assert [k for k, _ in groupby(in_sync)] == [2, 1, 2, 1, 2, 1, 2], in_sync
    # after each push every replica in the sync reports that push's version, the restarted ones included; at the
    # end both serve the last pushed version
    pushed = [r for r in records if r.get("sync/versions")]
    for r in pushed:
        assert set(r["sync/served_versions"].values()) == {str(r["sync/versions"][-1])}, r
    assert pushed[-1]["sync/served_versions"].keys() == {"0", "1"} and records[-1]["fleet/replicas_in_sync"] == 2
    # every push sent the whole model to each replica it reached and each received all of it (TP 1: one worker
    # each, sync.delta off); R's push also sent replica 0 a model its workers loaded but never reported
    model = _model_bytes(tmp_path / "tiny-moe")
    hit_r = by_step[cells["R"]["step"]]
    for r in pushed:
        reached = model * len(r["sync/served_versions"]) * r["sync/count"]
        extra_sent, extra_received = r["sync/bytes_sent"] - reached, r["sync/bytes_received"] - reached
        if r is hit_r:
            assert 0 <= extra_received <= extra_sent <= model * r["sync/count"], r
        else:
            assert extra_sent == extra_received == 0, r

    h = cells["H"]
    assert "503" in h and h["503"] - h["kill"] < STEP_BOUND_S + SLACK_S, h  # the engine probe's bound
    assert h["dead"] - h["kill"] < STEP_BOUND_S + BOUND_S + SLACK_S, h  # and the step monitor's
    report = []
    what_of = {"R": "engine core SIGKILL, loaded, before reporting", "H": "engine core SIGSTOP (hung), generating",
               "P": "API server SIGKILL, paused before a push"}
    for name in ORDER:
        cell = cells[name]
        i = cell["replica"]
        assert cell["new_pid"] != cell["pid"], cell  # a new incarnation (`megarl serve` of the restarted step)
        assert cell["gone"] - cell["kill"] < STEP_BOUND_S + BOUND_S + SLACK_S, (name, cell)  # its step ended
        assert cell["group"] - cell["kill"] < STEP_BOUND_S + BOUND_S + SLACK_S, (name, cell)  # no process left
        hit = by_step[cell["step"]] if name != "H" else next(
            r for r in records if r["step"] >= cell["step"] and str(i) not in (r.get("sync/served_versions") or
                                                                               {str(i): 0}))
        # (a push that began while H's engine core was stopped waited at its /pause until the replica was given up)
        push_bound = BOUND_S + SLACK_S + (STEP_BOUND_S if name == "H" else 0)
        assert str(i) not in hit["sync/served_versions"] and hit["time/push_s"] < push_bound, (name, hit)
        # the rejoin: a later push that reached it, sending it the whole model, and it reports that push's version
        full = by_step[cell["rejoined"]]
        assert full["sync/served_versions"].keys() == {"0", "1"}, full
        assert full["sync/bytes_received"] == 2 * model * full["sync/count"], full
        affected = [r["step"] for r in records if cell["step"] <= r["step"] < cell["rejoined"]
                    and min(r["fleet/replicas"], r["fleet/replicas_in_sync"]) < 2]
        noticed = (f"/health 503 after {cell['503'] - cell['kill']:.1f} s (bound {STEP_BOUND_S} s), `megarl serve` "
                   f"killed its group after {cell['dead'] - cell['kill']:.1f} s (bounds {STEP_BOUND_S} + {BOUND_S:g} "
                   f"s; stopped at try {cell['tries']}); the push without it (step "
                   f"{hit['step']}) took {hit['time/push_s']:.1f} s"
                   if name == "H" else f"the push without it took {hit['time/push_s']:.1f} s (bound {BOUND_S:g} s)")
        report.append(f"{name} {what_of[name]}: replica {i} at step {cell['step']}; {noticed}; registration removed "
                      f"after {cell['gone'] - cell['kill']:.1f} s, group gone after {cell['group'] - cell['kill']:.1f} "
                      f"s; registered again after {cell['back'] - cell['kill']:.1f} s (step {cell['back_step']}); "
                      f"rejoined with a full push at step {cell['rejoined']}; "
                      f"steps with one replica: {len(affected)} {affected}")
    print("\n".join(report) + f"\njob: {wall:.0f} s for {STEPS} steps")
    slurm_cluster.wait_idle()
