"""A rollout replica killed mid-run under `sbatch slurm/guru_moe.sh` on the emulated SLURM cluster (the shipped
script at CPU scale, as tests/test_slurm_job.py runs it: two trainer ranks on node1 and node2, two TP-1 replicas
sharing node3). Replica 1's vLLM server is SIGKILLed once the run has trained a step; the job script restarts its
step (ROLLOUT_RESTARTS=1; the test holds the trainer still while the new vLLM server starts, so the restart lands
mid-run however loaded the machine is), the trainer lets the new replica in at a push point with a full push, then
the restarted step is killed too and, with no restart left, stays down. The job must still train every step: exit
code 0, the schedule's exact lags, prompts x K samples in every step, finite losses, and the restarted replica
reporting the version just pushed."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import groupby
from pathlib import Path

from tests.slurm_cluster import SlurmCluster
from tests.test_slurm_job import (
    JOB_TIMEOUT_S,
    _describe,
    _expected_lag,
    _job_env,
    _job_output,
    _model_bytes,
    _records,
    _step_id,
    _step_placement,
    _submit,
    _wait_for_line,
)

PROMPTS, K = 32, 8  # configs/demo_moe.yaml's data.prompts_per_step and rollout.samples_per_prompt


def _wait_for(what: str, ready, job: object, timeout_s: float = JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = ready()
        if found:
            return found
        assert not job.done(), f"the job ended before {what}"  # type: ignore[attr-defined]
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def _records_now(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _server_pid(url: str) -> int:
    """The pid of the vLLM API server listening at `url` (the process `megarl serve` watches)."""
    port = url.rsplit(":", 1)[1]
    found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server .*--port {port} "],
                           capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def _is_python(pid: int) -> bool:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name.startswith("python")
    except OSError:  # it ended meanwhile
        return False


@contextmanager
def _trainer_frozen(run_dir: Path) -> Iterator[None]:
    """The job's trainer ranks stopped (SIGSTOP) inside the block, so a restart that takes longer than the rest of
    the run (vLLM starts take 30 s to minutes on a loaded machine) still happens mid-run; SIGCONT after."""
    found = subprocess.run(["pgrep", "-f", f"megarl rank --config {run_dir}/"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split() if _is_python(int(p))]  # the ranks, not the sruns that started them
    assert len(pids) == 2, (found.stdout, pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _registered_pid(run_dir: Path, replica: int) -> int | None:
    try:
        return json.loads((run_dir / "fleet" / f"replica{replica}.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_killed_replica_is_restarted_rejoins_and_no_step_or_sample_is_lost(slurm_cluster: SlurmCluster,
                                                                            tmp_path: Path) -> None:
    steps, m, n = 16, 2, 1  # configs/demo_moe.yaml's sync.interval and sync.offset
    env = {**_job_env(tmp_path, f"run.steps={steps} eval.interval=0"), "ROLLOUT_RESTARTS": "1"}
    run_dir = tmp_path / "run"
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(_submit, slurm_cluster, tmp_path, env)
        _wait_for("a first trained step", lambda: _records_now(run_dir), job)
        first_pid = _registered_pid(run_dir, 1)
        first_step = _step_id(slurm_cluster, "megarl-serve-1")
        placement = _step_placement(slurm_cluster, first_step)
        url = json.loads((run_dir / "fleet" / "replica1.json").read_text())["url"]
        os.kill(_server_pid(url), signal.SIGKILL)  # replica 1's vLLM server, not its step
        # the trainer goes on with replica 0 alone: a push point leaves replica 1 out of the sync
        _wait_for("replica 1 out of the sync",
                  lambda: any(r["fleet/replicas_in_sync"] == 1 for r in _records_now(run_dir)), job)
        with _trainer_frozen(run_dir):  # until the restarted replica has registered (healthy and guarded)
            _wait_for("replica 1 registered again", lambda: _registered_pid(run_dir, 1) not in (None, first_pid), job)
        # the restarted replica is back in the sync, reporting the version just pushed
        rejoined = _wait_for(
            "replica 1 back in the sync",
            lambda: [r for r in _records_now(run_dir)
                     if r["fleet/replicas_in_sync"] == 2 and "1" in r.get("sync/served_versions", {})
                     and any(q["fleet/replicas_in_sync"] == 1 for q in _records_now(run_dir)[:r["step"]])],
            job)[0]
        assert rejoined["step"] < steps - 3, f"replica 1 rejoined too late to be killed again: {rejoined}"
        restarted_step = _step_id(slurm_cluster, "megarl-serve-1")
        assert restarted_step != first_step and placement[0] == "node3" and "gpu" in placement[2], placement
        assert _step_placement(slurm_cluster, restarted_step) == placement  # node, CPUs, memory, GPUs as before
        slurm_cluster.run("scancel", "--signal=KILL", restarted_step)
        stays_down = _wait_for_line(tmp_path, job, r"rollout replica 1 exited with code \d+ .*stays down",
                                    timeout_s=60)
        time.sleep(3)  # three of the job's polls (POLL_S=1): no second restart
        steps_now = slurm_cluster.run("squeue", "--noheader", "--steps", "--format=%j").stdout.split()
        assert "megarl-serve-1" not in steps_now and "megarl-serve-0" in steps_now, steps_now
        result = job.result()

    why = _describe(slurm_cluster, tmp_path, result)
    assert result.returncode == 0, why
    output = _job_output(tmp_path, result)
    assert output.count("restarting it (restart 1 of 1)") == 1 and output.count("stays down") == 1, why
    assert re.search(r"rollout replica 1 exited with code 1 .*restarting it", output), why  # its vLLM died
    assert re.fullmatch(r"megarl job \d+: rollout replica 1 exited with code 137 \(see \S+/serve_replica1\.log and "
                        r"\S+/vllm_replica1\.log\); it stays down \(no restart left: ROLLOUT_RESTARTS=1\); the "
                        r"trainer goes on with the replicas left and fails below rollout\.min_replicas",
                        stays_down), why
    assert "rollout replica 0 exited" not in output, why
    assert re.search(r"replica 1 \(exit codes 1,137; restarted 1 of 1 time\(s\); down;", output), why
    # the replica's logs go on across its two starts, one restart line between them: its step's, its vLLM
    # server's (the first server's lines kept), srun's messages
    logs = run_dir / "logs"
    assert (logs / "serve_replica1.log").read_text().count("restart 1 of 1 of rollout replica 1") == 1, why
    first_server, *restarts = (logs / "vllm_replica1.log").read_text().split(
        "===== megarl: restart 1 of 1 of rollout replica 1 (")
    assert len(restarts) == 1 and "vLLM" in first_server, why
    assert (logs / "megarl-serve-1.srun").read_text().count("restart 1 of 1") == 1, why
    records = _records(run_dir)
    # every step trained once, at the schedule's lag, on prompts x K samples, with a finite loss
    assert [r["step"] for r in records] == list(range(steps)), why
    assert [r["batch_lag"] for r in records] == [_expected_lag(b, m, n) for b in range(steps)], why
    assert all(r["batch/samples"] == PROMPTS * K for r in records), [r["batch/samples"] for r in records]
    assert all(math.isfinite(r["loss"]) for r in records), [r["loss"] for r in records]
    # the fleet the pushes reached: both, one (killed), both again (restarted, rejoined), one (stays down)
    in_sync = [r["fleet/replicas_in_sync"] for r in records]
    assert [k for k, _ in groupby(in_sync)] == [2, 1, 2, 1], in_sync
    # after each push every replica in the sync reports that push's version: the rejoined one included
    pushed = [r for r in records if r.get("sync/versions")]
    for r in pushed:
        assert set(r["sync/served_versions"].values()) == {str(r["sync/versions"][-1])}, r
    assert set(rejoined["sync/served_versions"]) == {"0", "1"}, rejoined
    # the rejoining push sent the whole model to each replica (TP 1: one worker each); pushes with one replica
    # moved one model's bytes (sync.delta is off: every push is full)
    model = _model_bytes(tmp_path / "tiny-moe")
    for r in pushed:
        assert r["sync/bytes_received"] == model * len(r["sync/served_versions"]) * r["sync/count"], r
    slurm_cluster.wait_idle()
