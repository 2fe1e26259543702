"""`sbatch slurm/guru_moe.sh` on a real SLURM cluster of three emulated nodes (tests/slurm_cluster.py): the same
script users submit, at CPU scale through its environment variables (the tiny MoE recipe, trainer ranks on node1
and node2, one vLLM replica on node3). A finished run, a rollout step killed mid-run, and the resubmission that
resumes it from its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors import safe_open

from megarl.checkpoint import open_checkpoint
from megarl.config.load import load_config
from megarl.loop import checkpoint_identity
from megarl.metrics.timeline import load_spans
from tests.slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "guru_moe.sh"
JOB_TIMEOUT_S = 600


def _job_env(tmp_path: Path, overrides: str) -> dict[str, str]:
    """The CPU-scale settings: everything else is the script's own."""
    return {
        "MEGARL_HOME": str(REPO),
        "MEGARL": str(Path(sys.executable).parent / "megarl"),  # this venv's megarl, on every emulated node
        "MEGARL_CONFIG": "configs/demo_moe.yaml",
        "MEGARL_OVERRIDES": f"model.hf_dir={tmp_path / 'tiny-moe'} rollout.tp=1 {overrides}",
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


def test_guru_moe_job_trains_across_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    steps = 6
    result = _submit(slurm_cluster, tmp_path, _job_env(tmp_path, f"run.steps={steps}"))
    assert result.returncode == 0, _describe(slurm_cluster, tmp_path, result)

    run_dir, logs = tmp_path / "run", tmp_path / "run" / "logs"
    assert [r["step"] for r in _records(run_dir)] == list(range(steps))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    # every push sent the whole model once (one TP-1 replica), and the fleet received every byte that was sent
    assert summary["sync/pushes"] >= 1
    assert summary["sync/bytes_per_push"] == _model_bytes(tmp_path / "tiny-moe")
    assert summary["sync/bytes_received_total"] == summary["sync/bytes_sent_total"]
    assert summary["sync/bytes_sent_total"] == summary["sync/pushes"] * _model_bytes(tmp_path / "tiny-moe")
    # each role ran where the script placed it
    assert "trainer rank 0/2 on node1 (slurm)" in (logs / "trainer_rank0.log").read_text()
    assert "trainer rank 1/2 on node2 (slurm)" in (logs / "trainer_rank1.log").read_text()
    serve_log = (logs / "serve_replica0.log").read_text()
    assert "rollout replica 0 on node3 serving at http://127.0.0.1:" in serve_log
    # a clean end: the replica was stopped by SIGTERM (not killed), deregistered, and the job's secret is gone
    assert "SIGTERM received, stopping" in serve_log, serve_log
    assert not list((run_dir / "fleet").glob("replica*.json"))
    assert not (run_dir / "private").exists()
    assert "trainer finished" in _job_output(tmp_path, result)


def _wait_for_checkpoint(run_dir: Path, job: object, timeout_s: float) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "meta.json").is_file())
        if done:
            return done[0]
        assert not job.done(), "the job ended before its first checkpoint"  # type: ignore[attr-defined]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint in {run_dir} after {timeout_s}s")


def _step_id(cluster: SlurmCluster, name: str) -> str:
    out = cluster.run("squeue", "--noheader", "--steps", "--format=%i %j").stdout
    ids = [line.split()[0] for line in out.splitlines() if line.split()[1:] == [name]]
    assert len(ids) == 1, out
    return ids[0]


def test_killed_rollout_step_fails_the_job_and_resubmission_resumes(slurm_cluster: SlurmCluster,
                                                                   tmp_path: Path) -> None:
    steps = 16
    env = _job_env(tmp_path, f"run.steps={steps} checkpoint.interval=2")
    run_dir = tmp_path / "run"
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(_submit, slurm_cluster, tmp_path, env)
        _wait_for_checkpoint(run_dir, job, timeout_s=JOB_TIMEOUT_S)
        slurm_cluster.run("scancel", "--signal=KILL", _step_id(slurm_cluster, "megarl-serve-0"))
        result = job.result()

    output = _job_output(tmp_path, result)
    assert result.returncode != 0, _describe(slurm_cluster, tmp_path, result)
    assert "FAILED: rollout replica 0 exited with code" in output, output
    trained = [r["step"] for r in _records(run_dir)]
    assert trained and trained[-1] < steps - 1, f"the run was not interrupted: {trained}"
    # every checkpoint that looks complete is complete (files present, sizes as recorded, identity matching)
    cfg = load_config(str(run_dir / "config.yaml"), [])
    saved = [p for p in (run_dir / "checkpoints").glob("step_*")]
    assert saved and all((p / "meta.json").is_file() for p in saved), saved
    for path in saved:
        open_checkpoint(path, checkpoint_identity(cfg))
    assert not (run_dir / "private").exists()
    latest = max(int(p.name.removeprefix("step_")) for p in saved)
    before = _records(run_dir)[:latest + 1]

    resumed = _submit(slurm_cluster, tmp_path, {**env, "MEGARL_OVERRIDES": env["MEGARL_OVERRIDES"]
                                                + " checkpoint.resume=latest"})
    assert resumed.returncode == 0, _describe(slurm_cluster, tmp_path, resumed)
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(steps))
    # it went on from the newest checkpoint: the steps up to it are the first job's, and it trained only the rest
    assert records[:latest + 1] == before
    trained_now = sorted({int(s.label.removeprefix("step ")) for s in load_spans(run_dir / "timeline.json")
                          if s.kind == "train"})
    assert trained_now == list(range(latest + 1, steps))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
