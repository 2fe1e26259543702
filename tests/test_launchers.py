"""launchers/megarl_nemo.py: the nemo-run experiments of a recipe, rendered by the launcher in its own environment
(`.venv-launch`, `make launch-env`; nemo-run cannot live in this venv) and checked against the typed config:
node and task counts, `megarl prepare` before the roles, one serve command per replica, the rank command; the
rendered scripts pass `bash -n` and `shellcheck -S error`; and the sbatch script runs as a real heterogeneous job on
the emulated SLURM cluster (tests/slurm_cluster.py) with a stand-in `megarl` that records where each role ran."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config.load import load_config
from tests.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "megarl_nemo.py"
SHELLCHECK = shutil.which("shellcheck") or "/usr/bin/shellcheck"


@pytest.fixture(scope="session")
def launch_python() -> Path:
    """The launch environment's python (built by `make launch-env`, a no-op when it is up to date)."""
    subprocess.run(["make", "-C", str(ROOT), "launch-env"], check=True, capture_output=True, text=True, timeout=600)
    python = ROOT / ".venv-launch" / "bin" / "python"
    assert python.is_file(), "make launch-env did not create .venv-launch"
    return python


def launcher(python: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo_home"), **(env or {})}
    for name in ("SBATCH_ACCOUNT", "SBATCH_PARTITION", "SBATCH_TIMELIMIT", "GPUS_PER_NODE", "CONTAINER_IMAGE",
                 "CONTAINER_MOUNTS", "MEGARL", "MEGARL_HOME", "TRAINER_TASKS_PER_NODE", "ROLLOUT_REPLICAS_PER_NODE"):
        if name not in (env or {}):
            full_env.pop(name, None)
    return subprocess.run([str(python), str(LAUNCHER), *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=full_env)


def dryrun(python: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = launcher(python, tmp_path, "--dryrun", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!"), proc.stdout[:500]
    return proc.stdout


def assert_shell_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "rendered.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run([SHELLCHECK, "-S", "error", "-s", "bash", str(path)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


def het_components(script: str) -> list[dict[str, str]]:
    """The #SBATCH options of each component of a heterogeneous job."""
    components: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            components.append({})
        elif line.startswith("#SBATCH --"):
            key, _, value = line.removeprefix("#SBATCH --").partition("=")
            components[-1][key] = value
    return components


def step_lines(script: str, role: str) -> list[str]:
    """The lines of the script that start `megarl <role>` (the command follows `env --chdir=...`)."""
    return [line for line in script.splitlines() if re.search(rf"\bmegarl {role}\b", line) and "srun" in line]


def test_launch_env_has_nemo_run_and_no_training_stack(launch_python: Path) -> None:
    probe = ("import importlib.util, nemo_run; "
             "print(nemo_run.__version__, [m for m in ('torch', 'vllm') if importlib.util.find_spec(m)])")
    proc = subprocess.run([str(launch_python), "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    version, stack = proc.stdout.split(maxsplit=1)
    assert version.startswith("0.11.1"), version
    assert stack.strip() == "[]", f"the launch environment must stay light: {stack}"


def test_slurm_dryrun_30b_topology_from_config(launch_python: Path, tmp_path: Path) -> None:
    recipe = "configs/qwen3_30b_a3b_guru.yaml"
    cfg = load_config(ROOT / recipe)
    world, replicas, tp = cfg.trainer.world_size, cfg.rollout.replicas, cfg.rollout.tp
    assert (world, replicas, tp) == (32, 8, 4)  # the recipe this test was written against
    script = dryrun(launch_python, tmp_path, "--config", recipe, "--executor", "slurm", "--account", "acct")

    trainer, rollout = het_components(script)
    assert (trainer["nodes"], trainer["ntasks-per-node"], trainer["gpus-per-node"]) == (str(world // 8), "8", "8")
    per_node = 8 // tp
    assert (rollout["nodes"], rollout["ntasks-per-node"], rollout["gpus-per-node"]) == (
        str(math.ceil(replicas / per_node)), str(per_node), "8")
    assert trainer["account"] == rollout["account"] == "acct" and "exclusive" in trainer

    lines = script.splitlines()
    prepare = [i for i, line in enumerate(lines) if f"megarl prepare --config {recipe}" in line]
    assert len(prepare) == 1
    assert lines[prepare[0]].startswith("srun --het-group=0 --nodes=1 --ntasks=1 ")
    assert lines[prepare[0]].endswith("exit 2; }"), "a failed prepare must end the job before any role starts"
    assert f"env --chdir={ROOT} megarl prepare" in lines[prepare[0]]

    ranks = step_lines(script, "rank")
    assert len(ranks) == 1
    assert ranks[0].startswith("srun --het-group=0 ")
    assert f"--ntasks={world} " in ranks[0] and f"--nodes={world // 8} " in ranks[0]
    assert ranks[0].endswith(f"env --chdir={ROOT} megarl rank --config {cfg.run.dir}/config.yaml & pids[0]=$!")

    serves = step_lines(script, "serve")
    assert len(serves) == replicas
    for i, line in enumerate(serves):
        assert line.startswith("srun --het-group=1 ")
        assert f"--nodes=1 --ntasks=1 --exact --gpus={tp} --nodelist=${{rollout_nodes[{i // per_node}]}} " in line
        assert line.endswith(f"megarl serve --config {cfg.run.dir}/config.yaml --replica {i} & pids[{i + 1}]=$!")
    first_role = min(lines.index(line) for line in ranks + serves)
    assert prepare[0] < first_role
    assert_shell_ok(script, tmp_path)


def test_slurm_dryrun_overrides_container_and_options(launch_python: Path, tmp_path: Path) -> None:
    overrides = ["trainer.world_size=16", "rollout.replicas=3", "run.dir=/shared/runs/guru 7b"]
    script = dryrun(launch_python, tmp_path, "--config", "configs/qwen2.5_7b_guru.yaml", *overrides,
                    "--partition", "batch", "--time", "01:00:00", "--container-image", "nvcr.io/x/megarl:1",
                    "--container-mounts", "/lustre:/lustre,/shared:/shared",
                    env={"MEGARL": "/opt/venv/bin/python -m megarl.cli", "GPUS_PER_NODE": "4"})
    trainer, rollout = het_components(script)
    # 16 ranks / 4 GPUs per node = 4 trainer nodes; 3 replicas x tp 2 with 2 per node = 2 rollout nodes
    assert (trainer["nodes"], trainer["ntasks-per-node"], trainer["gpus-per-node"]) == ("4", "4", "4")
    assert (rollout["nodes"], rollout["ntasks-per-node"]) == ("2", "2")
    assert trainer["partition"] == "batch" and trainer["time"] == "01:00:00" and "account" not in trainer

    megarl = "/opt/venv/bin/python -m megarl.cli"
    prepare = [line for line in script.splitlines() if f"{megarl} prepare" in line]
    assert len(prepare) == 1
    assert "--container-image=nvcr.io/x/megarl:1 --container-mounts=/lustre:/lustre,/shared:/shared" in prepare[0]
    assert ("prepare --config configs/qwen2.5_7b_guru.yaml trainer.world_size=16 rollout.replicas=3 "
            "'run.dir=/shared/runs/guru 7b' ||") in prepare[0]
    config = shlex.quote("/shared/runs/guru 7b/config.yaml")
    ranks = [line for line in script.splitlines() if f"{megarl} rank" in line]
    serves = [line for line in script.splitlines() if f"{megarl} serve" in line]
    assert len(ranks) == 1 and "--ntasks=16" in ranks[0] and f"rank --config {config} &" in ranks[0]
    assert [f"--replica {i} &" in line for i, line in enumerate(serves)] == [True] * 3
    for line in ranks + serves:
        assert "--container-image nvcr.io/x/megarl:1" in line and "/lustre:/lustre,/shared:/shared" in line
    assert "--nodelist=${rollout_nodes[1]}" in serves[2]
    assert_shell_ok(script, tmp_path)


@pytest.mark.parametrize(("args", "message"), [
    (["trainer.world_size=3"], "trainer.world_size=3 is not a multiple of trainer.tp * trainer.pp"),
    (["rollout.tp=16"], "rollout.tp=16 exceeds --gpus-per-node=8"),
    (["--trainer-tasks-per-node", "16"], "16 trainer ranks per node exceed --gpus-per-node=8"),
    (["trainer.bogus=1"], "trainer.bogus: unknown key"),
])
def test_bad_config_is_refused_before_anything_is_built(launch_python: Path, tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    proc = launcher(launch_python, tmp_path, "--config", "configs/qwen2.5_7b_guru.yaml", "--dryrun", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and proc.stdout == ""


def test_local_dryrun(launch_python: Path, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/demo_moe.yaml", ["rollout.replicas=2"])
    script = dryrun(launch_python, tmp_path, "--config", "configs/demo_moe.yaml", "rollout.replicas=2",
                    "--executor", "local", "--gpus-per-node", "8")
    lines = script.splitlines()
    venv = ROOT / ".venv" / "bin"
    prepare = lines.index(f"{venv}/megarl prepare --config configs/demo_moe.yaml rollout.replicas=2 || "
                          '{ echo "megarl prepare failed: nothing was started" >&2; exit 2; }')
    serves = [i for i, line in enumerate(lines) if " serve --config " in line]
    assert [lines[i] for i in serves] == [
        f"CUDA_VISIBLE_DEVICES={2 + 2 * r},{3 + 2 * r} {venv}/megarl serve --config {cfg.run.dir}/config.yaml "
        f"--replica {r} > {cfg.run.dir}/logs/serve_replica{r}.log 2>&1 &" for r in range(2)]
    torchrun = lines.index(f"CUDA_VISIBLE_DEVICES=0,1 {venv}/torchrun --standalone --nproc-per-node=2 --no-python "
                           f"{venv}/megarl rank --config {cfg.run.dir}/config.yaml")
    assert prepare < serves[0] < serves[-1] < torchrun
    assert lines[torchrun + 1:torchrun + 3] == ["status=$?", 'kill -TERM "${serve_pids[@]}" 2>/dev/null']
    assert_shell_ok(script, tmp_path)

    too_many = launcher(launch_python, tmp_path, "--config", "configs/demo_moe.yaml", "rollout.replicas=4",
                        "--executor", "local", "--gpus-per-node", "8", "--dryrun")
    assert too_many.returncode == 2 and "exceed --gpus-per-node=8" in too_many.stderr


FAKE_MEGARL = r"""#!/bin/bash
# Stands in for megarl on the emulated nodes: records each role's start (and a replica's stop) in $LOG.
LOG=__LOG__
role=$1
shift
case $role in
    prepare)
        echo "prepare node=$SLURMD_NODENAME args=$*" >> "$LOG"
        [[ -z ${FAIL_PREPARE:-} ]] || exit 1 ;;
    serve)
        replica=${*: -1}
        echo "serve replica=$replica node=$SLURMD_NODENAME" >> "$LOG"
        trap 'exit 0' TERM
        while :; do sleep 0.2; done ;;
    rank)
        echo "rank procid=$SLURM_PROCID ntasks=$SLURM_NTASKS node=$SLURMD_NODENAME config=$2" >> "$LOG"
        # Only rank 0 waits for the replicas and ends with $RANK_EXIT; the others end at once with 0. (If two ranks
        # failed together, srun --kill-on-bad-exit would SIGTERM the slower one and report 143, not 1, at random.)
        (( SLURM_PROCID == 0 )) || exit 0
        for _ in $(seq 150); do
            (( $(grep -c '^serve' "$LOG") >= __REPLICAS__ )) && exit "${RANK_EXIT:-0}"
            sleep 0.2
        done
        exit 3 ;;
esac
"""


def fake_megarl(tmp_path: Path, replicas: int) -> tuple[Path, Path]:
    log = tmp_path / "roles.log"
    fake = tmp_path / "fake_megarl"
    fake.write_text(FAKE_MEGARL.replace("__LOG__", shlex.quote(str(log))).replace("__REPLICAS__", str(replicas)))
    fake.chmod(0o755)
    return fake, log


DEMO_2X2 = ["--config", "configs/demo_moe.yaml", "rollout.replicas=2", "rollout.tp=1", "--time", "00:05:00",
            "--poll-s", "1"]  # trainer: 2 ranks on one node; fleet: 2 replicas x tp 1 on another (2 GPUs a node)


def check_roles(records: list[str], why: str, ranks_ok: bool = True) -> None:
    """prepare first (on the trainer's first node), then 2 ranks of one step on that node, 2 replicas on another."""
    prepare = re.fullmatch(r"prepare node=(\S+) args=--config configs/demo_moe.yaml rollout.replicas=2 rollout.tp=1",
                           records[0])
    assert prepare, why
    trainer_node = prepare.group(1)
    ranks = sorted(r for r in records if r.startswith("rank"))
    serves = sorted(r for r in records if r.startswith("serve"))
    assert ranks == [f"rank procid={i} ntasks=2 node={trainer_node} config=runs/demo_moe/config.yaml"
                     for i in range(2)], why
    rollout_node = serves[0].rpartition("node=")[2]
    assert rollout_node != trainer_node and serves == [f"serve replica={i} node={rollout_node}" for i in range(2)], why
    assert len(records) == 5, why


def test_nemo_run_submits_the_job_to_slurm(launch_python: Path, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """No dry run: nemo-run itself submits the heterogeneous job (sbatch on this machine, LocalTunnel) to the
    emulated cluster; every role runs where the config puts it and the job ends with code 0."""
    fake, log = fake_megarl(tmp_path, replicas=2)
    env = {"MEGARL": str(fake), "GPUS_PER_NODE": "2", "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    proc = launcher(launch_python, tmp_path, *DEMO_2X2, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    slurm_cluster.wait_idle(timeout_s=120)
    outputs = sorted((tmp_path / "nemo_home" / "experiments").rglob("sbatch_*.out"))
    job_output = "\n".join(p.read_text() for p in outputs)
    records = log.read_text().splitlines() if log.exists() else []
    why = f"launcher: {proc.stderr[-3000:]}\nroles:\n" + "\n".join(records) + f"\njob output:\n{job_output[-4000:]}"
    check_roles(records, why)
    assert "job exited with code 0" in job_output, why


@pytest.mark.parametrize("outcome", ["rank_fails", "prepare_fails"])
def test_sbatch_script_fails_the_job(launch_python: Path, slurm_cluster: SlurmCluster, tmp_path: Path,
                                     outcome: str) -> None:
    """The dry run's sbatch script, run by `sbatch --wait`: a failed rank fails the job (code 1), a failed prepare
    ends it (code 2) before any other role starts."""
    fake, log = fake_megarl(tmp_path, replicas=2)
    script = dryrun(launch_python, tmp_path, *DEMO_2X2, env={"MEGARL": str(fake), "GPUS_PER_NODE": "2"})
    for path in re.findall(r"--chdir (\S+)", script) + [Path(p).parent for p in re.findall(r"--output=(\S+)", script)]:
        Path(path).mkdir(parents=True, exist_ok=True)  # what nemo-run makes before it submits
    (tmp_path / "job.sh").write_text(script)
    env = {"RANK_EXIT": "1"} if outcome == "rank_fails" else {"FAIL_PREPARE": "1"}
    result = slurm_cluster.sbatch_wait(tmp_path / "job.sh", env_extra=env, timeout_s=120)
    records = log.read_text().splitlines()
    output = "\n".join(p.read_text() for p in sorted((tmp_path / "nemo_home").rglob("*.out")))
    why = f"{slurm_cluster.describe(result)}\nroles:\n" + "\n".join(records) + f"\njob files:\n{output[-4000:]}"
    if outcome == "prepare_fails":
        assert records[0].startswith("prepare ") and len(records) == 1 and result.returncode == 2, why
    else:
        check_roles(records, why)
        assert result.returncode == 1, why
    slurm_cluster.wait_idle(timeout_s=30)  # the replicas' steps end with the job


@pytest.mark.slow
def test_local_executor_trains_the_demo(launch_python: Path, tmp_path: Path) -> None:
    """nemo-run's LocalExecutor runs the whole job on this machine: prepare, one vLLM replica, torchrun with two
    trainer ranks (this venv's training stack); the replica is stopped when the ranks end."""
    run_dir = tmp_path / "run"
    proc = launcher(launch_python, tmp_path, "--config", "configs/demo_moe.yaml", "run.steps=2", f"run.dir={run_dir}",
                    "--executor", "local", "--venv", sys.prefix)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUCCEEDED" in proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    assert not [p for p in processes if f"serve --config {run_dir}/config.yaml" in p], "the replica outlived the job"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
