"""Rollout replicas killed under `sbatch slurm/guru_moe.sh` on the emulated SLURM cluster (the shipped script at CPU
scale, as tests/test_slurm_job.py runs it: two trainer ranks on node1 and node2, two TP-1 replicas sharing node3),
with each role run from its own environment: the trainer ranks (and `megarl prepare`) from `.venv-trainer`
(`make trainer-env`: torch, megatron-core, no vLLM; MEGARL_TRAINER_ENV), the replicas from this venv
(MEGARL_FLEET_ENV). One run of STEPS steps, two jobs:

1. rollout.min_replicas=2, ROLLOUT_RESTARTS=0: replica 0's step is killed after the first checkpoint (step 0's:
   checkpoint.interval=1). The trainer cannot go on without it: the job exits 1 naming replica 0 as the likely cause,
   restarts nothing, stops replica 1 cleanly, and every checkpoint on disk verifies.
2. The resubmission (checkpoint.resume=latest, rollout.min_replicas=1, ROLLOUT_RESTARTS=1) resumes from the newest
   checkpoint. Once it has trained a step, replica 1's engine core (`VLLM::EngineCore`, what a CUDA error or an
   out-of-memory kills) is SIGKILLed alone mid-push, by its own worker inside the model's load_weights (failpoint
   `push.loading.replica1` armed `kill-engine`: a kill from outside, after the log showed the push, once came after
   the push had finished on the replica, under load): the push
   goes on without it within the bound, its API server exits by itself and so does its step (issue 36's fault
   matrix, the SLURM subset); the job restarts the step on the same node with the same resources while the trainer
   goes on at full speed on replica 0, and the trainer lets the new replica in at a push point with a full push;
   then the restarted replica's API server hangs (SIGSTOP, never continued): `megarl serve` finds its /health
   failing past rollout.health_timeout_s (8 s), kills its whole process group and ends the step, which, with no
   restart left, stays down, while the trainer's calls to it give up on it. Nothing of the run is held: the run is
   long enough (STEPS) to outlast the restart at full speed, as a user's would. Each cell's times are printed
   (docs/pipeline.md's fault table). (Job 1 covers a step that SLURM itself kills with
   `scancel --signal=KILL`, exit code 137.) The job still trains every
   remaining step: exit code 0, every step of the run once at the schedule's exact lag, prompts x K samples and
   finite metrics in every step, every push's bytes received in full by each replica it reached, the restarted
   replica reporting the version just pushed, the roles where the script placed them, a clean end.

Each role's environment is checked from the processes themselves (the interpreter each rank and vLLM server runs,
the `environment` each step logged) and `import vllm` fails in the trainer's."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from pathlib import Path

import pytest

from megarl.checkpoint import open_checkpoint
from megarl.config.load import load_config
from megarl.loop import checkpoint_identity
from megarl.metrics.timeline import load_spans
from megarl.sync import failpoints
from tests.dist_utils import engine_core, process_group_members
from tests.slurm_cluster import SlurmCluster
from tests.test_slurm_job import (
    JOB_TIMEOUT_S,
    REPO,
    _describe,
    _expected_lag,
    _job_env,
    _job_output,
    _model_bytes,
    _records,
    _seed_model,
    _step_gpus,
    _step_id,
    _step_placement,
    _submit,
    _wait_for_line,
)

PROMPTS, K = 32, 8  # configs/demo_moe.yaml's data.prompts_per_step and rollout.samples_per_prompt
# the run's steps, enough for the trainer, never held, to outlast replica 1's restart and its hang: resumed at step 1
# or 3; the restarted vLLM server shares the emulated cluster's two cores with the trainer going on at full speed
# (about 0.8 s a step), and registered 50-63 s after the kill, at step 60-67 (the hang judged by step 70). Both slow
# down alike on a loaded machine, so the step of the rejoin moves less than the seconds do: 120 leaves about 40 steps
# of room; configs/demo_moe.yaml's sync.interval and sync.offset
STEPS, M, N = 120, 2, 1
HANG_STEPS = 12  # steps the run must have left when replica 1 rejoins: its hang is judged in 11 s (3-4 steps)
BOUND_S = 8.0  # the job's rollout.health_timeout_s
SLACK_S = 20.0  # a loaded 2-core machine: the server's own shutdown, the job's polls (POLL_S=1)
FLEET_ENV = Path(sys.prefix)  # this venv: vLLM and megarl


@pytest.fixture(scope="session")
def trainer_env() -> Path:
    """The trainer role's venv without vLLM (`make trainer-env`, a no-op when it is up to date)."""
    proc = subprocess.run(["make", "-C", str(REPO), "trainer-env"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    venv = REPO / ".venv-trainer"
    assert (venv / "bin" / "megarl").is_file(), "make trainer-env did not install megarl into .venv-trainer"
    return venv


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


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "meta.json").is_file())


def _server_pid(url: str) -> int:
    """The pid of the vLLM API server listening at `url` (the process `megarl serve` watches)."""
    port = url.rsplit(":", 1)[1]
    found = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server .*--port {port} "],
                           capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def _interpreter(pid: int) -> Path | None:
    """The program a process runs, as it was started (argv[0]: a venv's bin/python, which /proc/PID/exe would
    resolve to the base interpreter); None once it has ended."""
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
    except OSError:
        return None


def _env_of(pid: int) -> Path:
    """The environment (venv) whose python process `pid` runs."""
    program = _interpreter(pid)
    assert program is not None and program.name.startswith("python"), (pid, program)
    return program.parent.parent.resolve()


def _rank_pids(run_dir: Path) -> list[int]:
    """The pids of the job's two trainer ranks (`megarl rank` for the run in `run_dir`)."""
    found = subprocess.run(["pgrep", "-f", f"megarl rank --config {run_dir}/"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()  # the ranks, not the sruns that started them
            if (program := _interpreter(int(p))) is not None and program.name.startswith("python")]
    assert len(pids) == 2, (found.stdout, pids)
    return pids


def _registered(run_dir: Path, replica: int) -> dict | None:
    try:
        return json.loads((run_dir / "fleet" / f"replica{replica}.json").read_text())
    except (OSError, ValueError):
        return None


def _registered_pid(run_dir: Path, replica: int) -> int | None:
    return (_registered(run_dir, replica) or {}).get("pid")


def _logged_envs(logs: Path, name: str) -> set[Path]:
    """The environments a step's log says it ran from (`...; environment PREFIX)` in its start line)."""
    return {Path(p).resolve() for p in re.findall(r"; environment (\S+?)\)?$", (logs / name).read_text(), re.M)}


def _check_role_envs(logs: Path, trainer_env: Path, why: str) -> None:
    """Each trainer rank said it ran from the trainer's venv, each replica (every start) from the fleet's."""
    for rank in (0, 1):
        assert _logged_envs(logs, f"trainer_rank{rank}.log") == {trainer_env.resolve()}, why
    for replica in (0, 1):
        assert _logged_envs(logs, f"serve_replica{replica}.log") == {FLEET_ENV.resolve()}, why


def _check_placement(logs: Path, why: str) -> None:
    """Each role where the script placed it: the pipeline's two stages on two nodes with one GPU each, both
    replicas on node3 with one GPU each, disjoint (a job's first start of each step truncates that step's log)."""
    for rank, node in ((0, "node1"), (1, "node2")):
        log = (logs / f"trainer_rank{rank}.log").read_text()
        assert f"trainer rank {rank}/2 on {node} (slurm, local rank 0, GPUs " in log, f"{log}\n{why}"
        assert len(_step_gpus(log)) == 1, log
    serve_logs = [(logs / f"serve_replica{i}.log").read_text() for i in range(2)]
    for i, log in enumerate(serve_logs):
        assert f"rollout replica {i} on node3 serving at http://127.0.0.1:" in log, f"{log}\n{why}"
    gpus = [_step_gpus(log) for log in serve_logs]
    assert all(len(g) == 1 for g in gpus) and not gpus[0] & gpus[1], gpus
    # and, the node being a CPU one to vLLM, each replica's worker on cores of its own: vLLM's own account of the
    # binding the job's MEGARL_NODE_REPLICAS=2 gave each `megarl serve` (megarl/rollout/cpu_binding.py)
    cores = [re.findall(r"local_rank=0, core ids=\[([\d, ]*)\]", (logs / f"vllm_replica{i}.log").read_text())[:1]
             for i in range(2)]
    owned = [{int(c) for c in found[0].split(",")} for found in cores if found and found[0]]
    assert len(owned) == 2 and not owned[0] & owned[1], cores


def test_killed_replicas_fail_or_rejoin_and_the_resubmission_loses_no_step(slurm_cluster: SlurmCluster,
                                                                            tmp_path: Path, trainer_env: Path,
                                                                            tiny_moe_dir: Path) -> None:
    run_dir, logs = tmp_path / "run", tmp_path / "run" / "logs"
    _seed_model(tmp_path, tiny_moe_dir)
    base = _job_env(tmp_path, f"run.steps={STEPS} checkpoint.interval=1 eval.interval=0 "
                              f"rollout.health_timeout_s={BOUND_S:g}")
    base |= {"MEGARL_TRAINER_ENV": str(trainer_env), "MEGARL_FLEET_ENV": str(FLEET_ENV)}
    # the trainer's environment has no vLLM (the fleet's has): its ranks never import it
    no_vllm = subprocess.run([str(trainer_env / "bin" / "python"), "-c", "import vllm"], capture_output=True,
                             text=True, timeout=120)
    assert no_vllm.returncode == 1 and "No module named 'vllm'" in no_vllm.stderr, no_vllm.stderr
    has_vllm = subprocess.run([str(FLEET_ENV / "bin" / "python"), "-c",
                               "import importlib.util; print(importlib.util.find_spec('vllm') is not None)"],
                              capture_output=True, text=True, timeout=120)
    assert has_vllm.stdout.strip() == "True", has_vllm.stderr
    # and it is the cpu lock's trainer (torch, megatron-core), as `megarl preflight versions` judges a rank's
    versions = subprocess.run([str(trainer_env / "bin" / "megarl"), "preflight", "versions", "--stack", "cpu",
                               "--role", "rank"], capture_output=True, text=True, timeout=120)
    assert versions.returncode == 0 and "versions OK: cpu stack" in versions.stdout, versions.stdout + versions.stderr

    # --- job 1: with rollout.min_replicas=2 the trainer cannot go on without the killed replica, and
    # ROLLOUT_RESTARTS=0 does not restart it: the trainer fails, and the job names the replica as the likely cause
    env = {**base, "MEGARL_OVERRIDES": base["MEGARL_OVERRIDES"] + " rollout.min_replicas=2", "ROLLOUT_RESTARTS": "0"}
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(_submit, slurm_cluster, tmp_path, env)
        _wait_for("a first checkpoint", lambda: _checkpoints(run_dir), job)
        slurm_cluster.run("scancel", "--signal=KILL", _step_id(slurm_cluster, "megarl-serve-0"))
        result = job.result()

    why = _describe(slurm_cluster, tmp_path, result)
    output = _job_output(tmp_path, result)
    assert result.returncode == 1, why
    assert re.search(r"FAILED: the trainer ranks exited with code \d+ ", output), output
    assert re.search(r"rollout replica\(s\) that died before it, the likely cause: replica 0 \(exit code 137; "
                     r"restarted 0 of 0 time\(s\); (down|not restarted); see \S+/serve_replica0\.log", output), output
    assert "restarting it" not in output and "replica 1 (" not in output, output
    trained = [r["step"] for r in _records(run_dir)]
    assert trained and trained[-1] < STEPS - 1, f"the run was not interrupted: {trained}"
    # every checkpoint that looks complete is complete (files present, sizes as recorded, identity matching)
    cfg = load_config(str(run_dir / "config.yaml"), [])
    saved = list((run_dir / "checkpoints").glob("step_*"))
    assert saved and all((p / "meta.json").is_file() for p in saved), saved
    for path in saved:
        open_checkpoint(path, checkpoint_identity(cfg))
    assert not (run_dir / "private").exists()
    # the replica that was not killed was stopped by the job (SIGTERM), not killed
    assert "rollout replica 1: SIGTERM received, stopping" in (logs / "serve_replica1.log").read_text(), why
    _check_placement(logs, why)
    _check_role_envs(logs, trainer_env, why)
    latest = max(int(p.name.removeprefix("step_")) for p in saved)
    before = _records(run_dir)[:latest + 1]
    first_metrics = (run_dir / "metrics.jsonl").stat().st_ino  # the resumed run rewrites the file (a new inode)
    first_outputs = frozenset(tmp_path.glob("job-*.out"))

    # --- job 2, the resubmission: it resumes from the newest checkpoint with rollout.min_replicas=1 and
    # ROLLOUT_RESTARTS=1, and loses replica 1 twice
    points = tmp_path / "failpoints"  # MEGARL_FAILPOINTS reaches the vLLM workers (`megarl.sync.failpoints`)
    points.mkdir()
    env = {**base, "MEGARL_OVERRIDES": base["MEGARL_OVERRIDES"] + " checkpoint.resume=latest",
           "ROLLOUT_RESTARTS": "1", failpoints.ENV: str(points)}

    def resumed_steps() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        try:
            rewritten = path.stat().st_ino != first_metrics
        except OSError:
            return []
        return [r for r in _records_now(run_dir) if r["step"] > latest] if rewritten else []

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(_submit, slurm_cluster, tmp_path, env)
        _wait_for("a first step of the resumed run", resumed_steps, job)
        first_pid = _registered_pid(run_dir, 1)
        first_step = _step_id(slurm_cluster, "megarl-serve-1")
        placement = _step_placement(slurm_cluster, first_step)
        url = _registered(run_dir, 1)["url"]  # type: ignore[index]
        server = _server_pid(url)
        # replica 1's engine core alone (what a CUDA error or an out-of-memory kills), mid-push: its own worker kills
        # it at the next push, inside the model's load_weights (failpoint push.loading.replica1 armed `kill-engine`,
        # at full speed: nobody waits); its API server and its step are left alone
        core = engine_core(server)
        assert core is not None, f"no engine core in replica 1's process group {server}"
        (points / "push.loading.replica1").write_text(failpoints.KILL_ENGINE)
        reached = points / "push.loading.replica1.reached"
        _wait_for("replica 1's engine core killed by its worker at a push", reached.exists, job)
        killed, seen = time.monotonic(), {}
        assert json.loads(reached.read_text())["engine_core"] == core, (reached.read_text(), core)

        def server_gone() -> bool:  # its server exits by itself (megarl/rollout/engine_death.py), and `megarl serve`
            if "gone" not in seen and not process_group_members(server):
                seen["gone"] = time.monotonic() - killed
            return "gone" in seen

        def left_out() -> list[dict]:  # the push in flight went on without it: the trainer noticed
            server_gone()
            lost = [r for r in _records_now(run_dir) if r["fleet/replicas_in_sync"] == 1]
            if lost and "out" not in seen:
                seen["out"] = time.monotonic() - killed
            return lost

        lost = _wait_for("replica 1 out of the sync", left_out, job, timeout_s=BOUND_S + SLACK_S)[0]
        # nothing is held: the trainer goes on at full speed on replica 0 while replica 1's step restarts
        _wait_for("replica 1's server gone", server_gone, job, timeout_s=BOUND_S + SLACK_S - seen["out"])
        print(f"engine core killed mid-push: the push without it took {lost['time/push_s']:.1f}s (step "
              f"{lost['step']}), its record seen after {seen['out']:.1f}s; its server's process group gone after "
              f"{seen['gone']:.1f}s (bound {BOUND_S:g}s)")
        assert lost["time/push_s"] < BOUND_S + SLACK_S, lost  # was the 600 s read timeout
        # each role runs from its environment: the ranks' interpreter is the trainer venv's, vLLM's the fleet's
        ranks = _rank_pids(run_dir)
        assert {_env_of(pid) for pid in ranks} == {trainer_env.resolve()}, ranks
        assert _env_of(_server_pid(_registered(run_dir, 0)["url"])) == FLEET_ENV.resolve()  # type: ignore[index]
        _wait_for("replica 1 registered again", lambda: _registered_pid(run_dir, 1) not in (None, first_pid), job)
        registered = _records_now(run_dir)[-1]["step"]
        print(f"replica 1's restarted step registered {time.monotonic() - killed:.1f}s after the kill, the trainer "
              f"at step {registered} (it went on meanwhile)")
        # the restarted replica is back in the sync, reporting the version just pushed
        rejoined = _wait_for(
            "replica 1 back in the sync",
            lambda: [r for r in _records_now(run_dir)
                     if r["fleet/replicas_in_sync"] == 2 and "1" in r.get("sync/served_versions", {})
                     and any(q["fleet/replicas_in_sync"] == 1 for q in _records_now(run_dir)[:r["step"]])],
            job)[0]
        assert rejoined["step"] < STEPS - HANG_STEPS, f"replica 1 rejoined too late to be hung: {rejoined}"
        restarted_step = _step_id(slurm_cluster, "megarl-serve-1")
        assert restarted_step != first_step and placement[0] == "node3" and "gpu" in placement[2], placement
        assert _step_placement(slurm_cluster, restarted_step) == placement  # node, CPUs, memory, GPUs as before
        # the restarted replica's API server hangs (SIGSTOP, never continued): its /health stops answering, so
        # `megarl serve` kills its process group after rollout.health_timeout_s and the step ends; with no restart
        # left it stays down
        hung = _server_pid(_registered(run_dir, 1)["url"])  # type: ignore[index]
        os.kill(hung, signal.SIGSTOP)  # the trainer goes on meanwhile: its calls to the replica give up on it
        stopped = time.monotonic()
        stays_down = _wait_for_line(tmp_path, job, r"rollout replica 1 exited with code \d+ .*stays down",
                                    timeout_s=BOUND_S + SLACK_S, skip=first_outputs)
        hung_down_s = time.monotonic() - stopped
        assert not process_group_members(hung), "the hung replica's processes outlived its step"
        print(f"server hung: step ended, replica down after {hung_down_s:.1f}s (bound {BOUND_S:g}s), the trainer "
              f"at step {_records_now(run_dir)[-1]['step']}")
        time.sleep(3)  # three of the job's polls (POLL_S=1): no second restart
        steps_now = slurm_cluster.run("squeue", "--noheader", "--steps", "--format=%j").stdout.split()
        assert "megarl-serve-1" not in steps_now and "megarl-serve-0" in steps_now, (steps_now, "(no serve-0: the run "
                                                                                    "ended before the checks)")
        result = job.result()

    why = _describe(slurm_cluster, tmp_path, result)
    assert result.returncode == 0, why
    output = _job_output(tmp_path, result)
    assert "trainer finished" in output, why
    assert output.count("restarting it (restart 1 of 1)") == 1 and output.count("stays down") == 1, why
    assert re.search(r"rollout replica 1 exited with code 1 .*restarting it", output), why  # its vLLM died
    # the first start ended because its server exited by itself (the engine died); the restart because it hung
    serve_log = (logs / "serve_replica1.log").read_text()
    assert re.search(r"rollout replica 1 \(\S+\) died: its vLLM server exited with code [01] ", serve_log), why
    assert re.search(r"rollout replica 1 \(\S+\) is dead: .*; stopping its server", serve_log), why
    assert re.fullmatch(r"megarl job \d+: rollout replica 1 exited with code 1 \(see \S+/serve_replica1\.log and "
                        r"\S+/vllm_replica1\.log\); it stays down \(no restart left: ROLLOUT_RESTARTS=1\); the "
                        r"trainer goes on with the replicas left and fails below rollout\.min_replicas",
                        stays_down), why
    assert "rollout replica 0 exited" not in output, why
    assert re.search(r"replica 1 \(exit codes 1,1; restarted 1 of 1 time\(s\); down;", output), why
    # the replica's logs go on across its two starts, one restart line between them: its step's, its vLLM
    # server's (the first server's lines kept), srun's messages
    assert (logs / "serve_replica1.log").read_text().count("restart 1 of 1 of rollout replica 1") == 1, why
    first_server, *restarts = (logs / "vllm_replica1.log").read_text().split(
        "===== megarl: restart 1 of 1 of rollout replica 1 (")
    assert len(restarts) == 1 and "vLLM" in first_server, why
    assert (logs / "megarl-serve-1.srun").read_text().count("restart 1 of 1") == 1, why
    _check_placement(logs, why)
    _check_role_envs(logs, trainer_env, why)
    # a clean end: replica 0 was stopped by SIGTERM (not killed) and deregistered; the job's secret is gone
    assert "rollout replica 0: SIGTERM received, stopping" in (logs / "serve_replica0.log").read_text(), why
    assert _registered(run_dir, 0) is None, why
    assert not (run_dir / "private").exists(), why

    records = _records(run_dir)
    # it went on from the newest checkpoint: the steps up to it are the first job's, and it trained only the rest
    assert records[:latest + 1] == before, why
    trained_now = sorted({int(s.label.removeprefix("step ")) for s in load_spans(run_dir / "timeline.json")
                          if s.kind == "train"})
    assert trained_now == list(range(latest + 1, STEPS)), trained_now
    # every step of the run trained once, at the schedule's lag, on prompts x K samples, with finite metrics
    assert [r["step"] for r in records] == list(range(STEPS)), why
    assert [r["batch_lag"] for r in records] == [_expected_lag(b, M, N) for b in range(STEPS)], why
    assert all(r["batch/samples"] == PROMPTS * K for r in records), [r["batch/samples"] for r in records]
    for r in records:
        for key in ("loss", "entropy", "reward/mean", "grad_norm"):
            assert math.isfinite(r[key]), (key, r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS, summary
    # the fleet the pushes reached: both (job 1; job 2 until the kill), one (killed), both again (restarted,
    # rejoined), one (stays down)
    in_sync = [r["fleet/replicas_in_sync"] for r in records]
    assert [k for k, _ in groupby(in_sync)] == [2, 1, 2, 1], in_sync
    # after each push every replica in the sync reports that push's version: the rejoined one included
    pushed = [r for r in records if r.get("sync/versions")]
    for r in pushed:
        assert set(r["sync/served_versions"].values()) == {str(r["sync/versions"][-1])}, r
    assert set(rejoined["sync/served_versions"]) == {"0", "1"}, rejoined
    # every push sent the whole model to each replica it reached (TP 1: one worker each; sync.delta is off: every
    # push is full, the rejoining one included), and the fleet received every byte sent, but for what the push at the
    # engine core's kill sent replica 1 before it was found dead (at most one model)
    model = _model_bytes(tmp_path / "tiny-moe")
    killed_push = next(r for r in records if r["step"] == lost["step"])
    for r in pushed:
        reached = model * len(r["sync/served_versions"]) * r["sync/count"]
        assert r["sync/bytes_received"] == reached, r
        extra = r["sync/bytes_sent"] - reached
        assert extra == 0 if r is not killed_push else 0 <= extra <= model * r["sync/count"], r
    assert summary["sync/pushes"] >= 1
    assert summary["sync/bytes_sent_total"] - summary["sync/bytes_received_total"] \
        == killed_push["sync/bytes_sent"] - killed_push["sync/bytes_received"], summary
    slurm_cluster.wait_idle()
