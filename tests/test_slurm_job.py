"""`sbatch slurm/guru_moe.sh` on a real SLURM cluster of emulated GPU nodes (tests/slurm_cluster.py): the same
script users submit, at CPU scale through its environment variables (the tiny MoE recipe, a pipeline of two trainer
ranks on node1 and node2, two vLLM replicas sharing node3 with their own GPUs each, as the shipped scripts place
them). Here: a step SLURM cannot start, named within seconds; a replica step without room for its pinned shards and
a role environment without megarl, each refused before anything starts; the helpers every job test shares. Replicas
killed mid-run (the job fails below rollout.min_replicas; the resubmission resumes, restarts a replica, lets it back
in, and finishes the run), each role from its own environment: tests/test_slurm_failover.py."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open

from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "guru_moe.sh"
JOB_TIMEOUT_S = 600


def _expected_lag(batch: int, m: int, n: int) -> int:
    """REC appendix B.2, written out: (l mod m) + n once data comes from pushed weights (m*floor(l/m) >= n);
    before that the fleet still serves the initial weights (version 0) and the lag is l."""
    return (batch % m) + n if m * (batch // m) >= n else batch


def _seed_model(tmp_path: Path, tiny_moe_dir: Path) -> None:
    """The recipe's tiny MoE (model.tiny=moe, run.seed=0) copied to where `_job_env` points the job: the session's
    (tests/fleet_fixture.py, the same `make_tiny_checkpoint(kind="moe", seed=0)`), so the job's `megarl prepare`
    finds it complete instead of making it (torch and transformers in a fresh process: 10-15 s per job)."""
    shutil.copytree(tiny_moe_dir, tmp_path / "tiny-moe")


def _job_env(tmp_path: Path, overrides: str) -> dict[str, str]:
    """The CPU-scale settings: everything else is the script's own (so both replicas go to node3, the script's
    GPUS_PER_NODE / rollout.tp = 8 replicas per node)."""
    return {
        "MEGARL_HOME": str(REPO),
        "MEGARL": str(Path(sys.executable).parent / "megarl"),  # this venv's megarl, on every emulated node
        "MEGARL_CONFIG": "configs/demo_moe.yaml",
        "MEGARL_OVERRIDES": f"model.hf_dir={tmp_path / 'tiny-moe'} rollout.tp=1 rollout.replicas=2 trainer.pp=2 "
                            f"trainer.ep=1 {overrides}",
        "RUN_DIR": str(tmp_path / "run"),
        "TRAINER_NODES": "2",
        "TRAINER_TASKS_PER_NODE": "1",
        # the emulated nodes' names do not resolve; they all share 127.0.0.1
        "MEGARL_MASTER_ADDR": "127.0.0.1",
        "MEGARL_BIND_ADDR": "127.0.0.1",
        "POLL_S": "1",
        "STOP_GRACE_S": "30",
    }


def _submit(cluster: SlurmCluster, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return cluster.sbatch_wait(SCRIPT, "--nodes=3", f"--output={tmp_path}/job-%j.out", env_extra=env,
                               timeout_s=JOB_TIMEOUT_S, cwd=tmp_path)


def _job_output(tmp_path: Path, result: subprocess.CompletedProcess[str]) -> str:
    return (tmp_path / f"job-{SlurmCluster.job_id(result)}.out").read_text()


def _describe(cluster: SlurmCluster, tmp_path: Path, result: subprocess.CompletedProcess[str]) -> str:
    logs = tmp_path / "run" / "logs"
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                      for p in sorted(logs.glob("*.log"))) if logs.is_dir() else "(no logs)"
    return f"{cluster.describe(result)}\njob output:\n{_job_output(tmp_path, result)}\nrun logs:\n{tails}"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _model_bytes(hf_dir: Path) -> int:
    """Bytes of every tensor of the HF checkpoint: what one full push sends to a TP 1 replica."""
    total = 0
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


def _step_gpus(log: str) -> set[int]:
    """The GPUs SLURM gave a step, from the CUDA_VISIBLE_DEVICES its `megarl serve` / `megarl rank` logged."""
    match = re.search(r"GPUs ([0-9,]+)", log)
    assert match, log
    return {int(g) for g in match.group(1).split(",")}


def _step_id(cluster: SlurmCluster, name: str) -> str:
    out = cluster.run("squeue", "--noheader", "--steps", "--format=%i %j").stdout
    ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]]
    assert len(ids) == 1, out
    return ids[0]


def _wait_for_line(tmp_path: Path, job: object, pattern: str, timeout_s: float,
                   skip: frozenset[Path] = frozenset()) -> str:
    """The first line of the running job's output (tmp_path/job-<id>.out, not an earlier job's in `skip`) that
    matches `pattern`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in set(tmp_path.glob("job-*.out")) - skip:
            for line in path.read_text(errors="replace").splitlines():
                if re.search(pattern, line):
                    return line
        assert not job.done(), f"the job ended before a line matching {pattern!r}"  # type: ignore[attr-defined]
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in the job's output after {timeout_s}s")


def _step_placement(cluster: SlurmCluster, step: str) -> tuple[str, str, str]:
    """Where a running step is and what it holds, as slurmctld says: (NodeList, TRES, TresPerNode)."""
    fields = dict(item.split("=", 1) for item in
                  cluster.run("scontrol", "--oneliner", "show", "step", step).stdout.split() if "=" in item)
    return fields["NodeList"], fields["TRES"], fields.get("TresPerNode", "")


def test_a_step_that_cannot_start_fails_the_job_naming_it(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                          tiny_moe_dir: Path) -> None:
    # two replicas on node3, each asking for all 32 CPUs of the node: the second step can never start beside the
    # first. The job must say so within seconds, naming the step, its node and SLURM's reason, and stop the rest.
    _seed_model(tmp_path, tiny_moe_dir)
    env = {**_job_env(tmp_path, "run.steps=2"), "ROLLOUT_CPUS_PER_REPLICA": "32", "STEP_START_S": "10",
           "STOP_GRACE_S": "10"}
    started = time.monotonic()
    result = _submit(slurm_cluster, tmp_path, env)
    elapsed = time.monotonic() - started

    output = _job_output(tmp_path, result)
    assert result.returncode == 1, _describe(slurm_cluster, tmp_path, result)
    failed = [line for line in output.splitlines() if "FAILED: step" in line]
    assert len(failed) == 1, output
    match = re.search(r"FAILED: step megarl-serve-([01]) on node3 did not start within 10s \(STEP_START_S\): "
                      r"SLURM keeps it pending; steps of this job hold that node: megarl-serve-([01]) \(cpu=32,",
                      failed[0])
    assert match and match[1] != match[2], output  # the pending replica, and the one that holds node3's CPUs
    assert elapsed < 60, f"the job took {elapsed:.0f}s to fail\n{output}"
    slurm_cluster.wait_idle()  # nothing left behind: the pending srun gave up, the running steps were stopped


def test_a_replica_step_without_room_for_its_pinned_shards_is_refused(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                                      tiny_moe_dir: Path) -> None:
    # GPU nodes: a replica's step must hold its vLLM rank's host memory, 8 GB (assumed) + its whole shard pinned by a
    # staged receive (sync.receive=auto, host memory not given: staged); 7,000 MB cannot, and the job says so before
    # any step starts. The need is prepare's ROLLOUT_HOST_MB: ceil((8e9 + the checkpoint's fp32 bytes) / 2**20).
    _seed_model(tmp_path, tiny_moe_dir)
    env = {**_job_env(tmp_path, "run.steps=2"), "ROLLOUT_MEM_PER_REPLICA_MB": "7000"}
    result = _submit(slurm_cluster, tmp_path, env)
    output = _job_output(tmp_path, result)
    assert result.returncode != 0, _describe(slurm_cluster, tmp_path, result)
    need = math.ceil((8 * 10**9 + _model_bytes(tmp_path / "tiny-moe")) / 2**20)
    assert (f"rollout replica 0 on node3 would get --mem=7000M but needs {need}M of host memory" in output), output
    assert not (tmp_path / "run" / "logs" / "serve_replica0.log").exists()  # nothing was started
    slurm_cluster.wait_idle()


def test_a_role_environment_without_megarl_is_refused(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # each role's environment is a venv every node sees (MEGARL_TRAINER_ENV, MEGARL_FLEET_ENV): one without
    # bin/megarl is named, with the fix, before any step starts (prepare included)
    env = {**_job_env(tmp_path, "run.steps=2"), "MEGARL_FLEET_ENV": str(tmp_path / "no-such-venv")}
    result = _submit(slurm_cluster, tmp_path, env)
    output = _job_output(tmp_path, result)
    assert result.returncode == 2, _describe(slurm_cluster, tmp_path, result)
    assert f"MEGARL_FLEET_ENV={tmp_path / 'no-such-venv'} has no bin/megarl on this node: point it at a venv with " \
           "megarl installed" in output, output
    assert "preparing" not in output and not (tmp_path / "run").exists(), output  # nothing was started
    slurm_cluster.wait_idle()
