"""launchers/megarl_nemo.py: the nemo-run experiments of a recipe, rendered by the launcher in its own environment
(`.venv-launch`, `make launch-env`; nemo-run cannot live in this venv; one interpreter of it imports nemo-run once
and runs each call in a child forked from it, tests/launcher_driver.py) and checked against the typed config:
node and task counts, `megarl prepare` before the roles, one serve command per replica, the rank command; the
rendered scripts pass `bash -n` and `shellcheck -S error`; each step's own srun options (every resource stated:
nodes, tasks, CPUs, GPUs, memory); and the sbatch script runs as a real heterogeneous job on the emulated SLURM
cluster (tests/slurm_cluster.py: 8 nodes, 8 GPU devices each) with a stand-in `megarl` that records where each role
ran and with which GPUs, CPUs and memory, the 30B recipe's shape included (two replicas a node, running at once)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarl.config.load import load_config
from tests.slurm_cluster import CPUS_PER_NODE, MEMORY_MB_PER_NODE, SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "megarl_nemo.py"
DRIVER = ROOT / "tests" / "launcher_driver.py"
SHELLCHECK = shutil.which("shellcheck") or "/usr/bin/shellcheck"


@pytest.fixture(scope="session")
def launch_python() -> Path:
    """The launch environment's python (built by `make launch-env`, a no-op when it is up to date)."""
    subprocess.run(["make", "-C", str(ROOT), "launch-env"], check=True, capture_output=True, text=True, timeout=600)
    python = ROOT / ".venv-launch" / "bin" / "python"
    assert python.is_file(), "make launch-env did not create .venv-launch"
    return python


class LaunchDriver:
    """ONE interpreter of the launch environment that runs the launcher for every call (tests/launcher_driver.py:
    nemo-run is imported once, each run is a child forked from it, in its own environment and working directory,
    its output and exit code as a subprocess's would be)."""

    def __init__(self, python: Path) -> None:
        self.proc = subprocess.Popen([str(python), str(DRIVER), str(LAUNCHER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the launcher driver ended (code {self.proc.wait()})"
        done = json.loads(line)
        return subprocess.CompletedProcess([str(LAUNCHER), *argv], done["returncode"], done["stdout"], done["stderr"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def launch_driver(launch_python: Path) -> Iterator[LaunchDriver]:
    driver = LaunchDriver(launch_python)
    yield driver
    driver.close()


def launcher(driver: LaunchDriver, tmp_path: Path, *args: str, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    """`python launchers/megarl_nemo.py ARGS` in the launch environment, from the repository, with NEMORUN_HOME in
    `tmp_path` and this process's environment less the launcher's own variables (but those in `env`)."""
    full_env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo_home"), **(env or {})}
    for name in ("SBATCH_ACCOUNT", "SBATCH_PARTITION", "SBATCH_TIMELIMIT", "GPUS_PER_NODE", "CONTAINER_IMAGE",
                 "CONTAINER_MOUNTS", "MEGARL", "MEGARL_HOME", "TRAINER_TASKS_PER_NODE", "ROLLOUT_REPLICAS_PER_NODE",
                 "MEGARL_TRAINER_ENV", "MEGARL_FLEET_ENV", "TRAINER_CONTAINER_IMAGE", "FLEET_CONTAINER_IMAGE"):
        if name not in (env or {}):
            full_env.pop(name, None)
    return driver.run(list(args), full_env)


def dryrun(driver: LaunchDriver, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = launcher(driver, tmp_path, "--dryrun", *args, env=env)
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


def step_options(line: str) -> list[str]:
    """A role step's own srun options: those after nemo-run's `--wait=60 --kill-on-bad-exit=1`, up to the role's
    `env --chdir=...`."""
    options = line.split(" --kill-on-bad-exit=1 ", 1)[1].split()
    return options[:options.index("env")]


def test_launch_env_has_nemo_run_and_no_training_stack(launch_python: Path) -> None:
    """nemo-run 0.11.1 installed (read from its metadata: that it imports and works, every dry run below shows), and
    neither torch nor vLLM importable."""
    probe = ("import importlib.metadata, importlib.util; print(importlib.metadata.version('nemo_run'), "
             "[m for m in ('torch', 'vllm') if importlib.util.find_spec(m)])")
    proc = subprocess.run([str(launch_python), "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    version, stack = proc.stdout.split(maxsplit=1)
    assert version.startswith("0.11.1"), version
    assert stack.strip() == "[]", f"the launch environment must stay light: {stack}"


def test_slurm_dryrun_30b_topology_from_config(launch_driver: LaunchDriver, tmp_path: Path) -> None:
    recipe = "configs/qwen3_30b_a3b_guru.yaml"
    cfg = load_config(ROOT / recipe)
    world, replicas, tp = cfg.trainer.world_size, cfg.rollout.replicas, cfg.rollout.tp
    assert (world, replicas, tp) == (32, 8, 4)  # the recipe this test was written against
    script = dryrun(launch_driver, tmp_path, "--config", recipe, "--executor", "slurm", "--account", "acct")

    trainer, rollout = het_components(script)
    assert (trainer["nodes"], trainer["ntasks-per-node"], trainer["gpus-per-node"]) == (str(world // 8), "8", "8")
    per_node = 8 // tp
    assert (rollout["nodes"], rollout["ntasks-per-node"], rollout["gpus-per-node"]) == (
        str(math.ceil(replicas / per_node)), str(per_node), "8")
    assert trainer["account"] == rollout["account"] == "acct" and "exclusive" in trainer

    lines = script.splitlines()
    # the steps' shares of each node, computed in the script from the job's allocation (node_cpus, node_mem_mb)
    for share in ("trainer_mem_mb=$(node_mem_mb 0)", 'cpus_per_rank=$(share "$(node_cpus 0)" 8)',
                  f"mem_per_replica_mb=$(( $(node_mem_mb 1) / {per_node} ))",
                  f'cpus_per_replica=$(share "$(node_cpus 1)" {per_node})'):
        assert share in lines, share
    prepare = [i for i, line in enumerate(lines) if f"megarl prepare --config {recipe}" in line]
    assert len(prepare) == 1
    assert lines[prepare[0]].startswith(
        "srun --het-group=0 --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --gpus-per-node=0 "
        "--mem=${trainer_mem_mb}M --exact --job-name=megarl-prepare ")
    assert lines[prepare[0]].endswith("exit 2; }"), "a failed prepare must end the job before any role starts"
    assert f"env --chdir={ROOT} megarl prepare" in lines[prepare[0]]

    ranks = step_lines(script, "rank")
    assert len(ranks) == 1
    assert ranks[0].startswith("srun --het-group=0 ")
    assert step_options(ranks[0]) == [
        f"--nodes={world // 8}", f"--ntasks={world}", "--ntasks-per-node=8", "--cpus-per-task=${cpus_per_rank}",
        "--gpus-per-node=8", "--mem=${trainer_mem_mb}M", "--exact"]
    assert ranks[0].endswith(f"env --chdir={ROOT} megarl rank --config {cfg.run.dir}/config.yaml & pids[0]=$!")

    serves = step_lines(script, "serve")
    assert len(serves) == replicas
    for i, line in enumerate(serves):
        assert line.startswith("srun --het-group=1 ")
        assert step_options(line) == [
            "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=${cpus_per_replica}",
            f"--gpus-per-node={tp}", "--mem=${mem_per_replica_mb}M", "--exact",
            f"--nodelist=${{rollout_nodes[{i // per_node}]}}", f"--export=ALL,MEGARL_NODE_REPLICAS={per_node}",
            f"--output={ROOT}/{cfg.run.dir}/logs/serve_replica{i}.log"], line
        assert line.endswith(f"megarl serve --config {cfg.run.dir}/config.yaml --replica {i} & pids[{i + 1}]=$!")
    first_role = min(lines.index(line) for line in ranks + serves)
    assert prepare[0] < first_role
    assert_shell_ok(script, tmp_path)


def test_slurm_dryrun_overrides_container_and_options(launch_driver: LaunchDriver, tmp_path: Path) -> None:
    overrides = ["trainer.world_size=16", "rollout.replicas=3", "run.dir=/shared/runs/guru 7b"]
    script = dryrun(launch_driver, tmp_path, "--config", "configs/qwen2.5_7b_guru.yaml", *overrides,
                    "--partition", "batch", "--time", "01:00:00", "--container-image", "nvcr.io/x/megarl:1",
                    "--fleet-container-image", "nvcr.io/x/fleet:1",
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
    # each role in its image: the trainer's steps in --container-image's (no --trainer-container-image), the
    # replicas' in --fleet-container-image's
    for line in ranks + serves:
        image = "nvcr.io/x/fleet:1" if line in serves else "nvcr.io/x/megarl:1"
        assert f"--container-image {image} " in line and "/lustre:/lustre,/shared:/shared" in line
    assert "--nodelist=${rollout_nodes[1]}" in serves[2]
    # how many replicas share each one's node (its CPU binding, megarl/rollout/cpu_binding.py): 2, 2, then 1 alone
    assert [step_options(line)[8] for line in serves] == [f"--export=ALL,MEGARL_NODE_REPLICAS={n}" for n in (2, 2, 1)]
    assert [step_options(line)[4] for line in ranks + serves] == ["--gpus-per-node=4"] + ["--gpus-per-node=2"] * 3
    assert [f"'--output=/shared/runs/guru 7b/logs/serve_replica{i}.log' env " in line
            for i, line in enumerate(serves)] == [True] * 3
    assert_shell_ok(script, tmp_path)


@pytest.mark.parametrize(("args", "message"), [
    (["trainer.world_size=3"], "trainer.world_size=3 is not a multiple of trainer.tp * trainer.pp"),
    (["rollout.tp=16"], "rollout.tp=16 exceeds --gpus-per-node=8"),
    (["--trainer-tasks-per-node", "16"], "16 trainer ranks per node exceed --gpus-per-node=8"),
    (["trainer.bogus=1"], "trainer.bogus: unknown key"),
    (["algorithm.name=ppo"], "algorithm.name: 'ppo' is not a registered algorithm"),  # no torch needed for names
    # the local executor: 2 ranks + 4 replicas x tp 2 = 10 GPUs on one machine of 8
    (["--executor", "local", "--gpus-per-node", "8", "--config", "configs/demo_moe.yaml", "rollout.replicas=4"],
     "trainer.world_size=2 + rollout.replicas=4 x rollout.tp=2 GPUs exceed --gpus-per-node=8"),
])
def test_bad_config_is_refused_before_anything_is_built(launch_driver: LaunchDriver, tmp_path: Path, args: list[str],
                                                        message: str) -> None:
    """Refused with code 2 and the fix, before nemo-run is imported (no experiment directory is made)."""
    proc = launcher(launch_driver, tmp_path, "--config", "configs/qwen2.5_7b_guru.yaml", "--dryrun", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "nemo_home").exists(), "nemo-run was reached"


def test_local_dryrun(launch_driver: LaunchDriver, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/demo_moe.yaml", ["rollout.replicas=2"])
    # the replicas from their own environment (--fleet-venv); prepare and the trainer from the default one
    script = dryrun(launch_driver, tmp_path, "--config", "configs/demo_moe.yaml", "rollout.replicas=2",
                    "--executor", "local", "--gpus-per-node", "8", "--fleet-venv", "/opt/fleet")
    lines = script.splitlines()
    venv = ROOT / ".venv" / "bin"
    prepare = lines.index(f"{venv}/megarl prepare --config configs/demo_moe.yaml rollout.replicas=2 || "
                          '{ echo "megarl prepare failed: nothing was started" >&2; exit 2; }')
    serves = [i for i, line in enumerate(lines) if " serve --config " in line]
    assert [lines[i] for i in serves] == [
        f"CUDA_VISIBLE_DEVICES={2 + 2 * r},{3 + 2 * r} /opt/fleet/bin/megarl serve --config {cfg.run.dir}/config.yaml "
        f"--replica {r} > {cfg.run.dir}/logs/serve_replica{r}.log 2>&1 &" for r in range(2)]
    torchrun = lines.index(f"CUDA_VISIBLE_DEVICES=0,1 {venv}/torchrun --standalone --nproc-per-node=2 --no-python "
                           f"{venv}/megarl rank --config {cfg.run.dir}/config.yaml")
    assert prepare < lines.index("export MEGARL_NODE_REPLICAS=2  # the replicas share this machine's cores, a block "
                                 "each (CPU)") < serves[0] < serves[-1] < torchrun
    assert lines[torchrun + 1:torchrun + 3] == ["status=$?", 'kill -TERM "${serve_pids[@]}" 2>/dev/null']
    assert_shell_ok(script, tmp_path)


FAKE_MEGARL = r"""#!/bin/bash
# Stands in for megarl on the emulated nodes: records each role's start in $LOG ($FAKE_LOG where the job's environment
# sets it), one line of KEY=VALUE fields: its node, SLURM step, the GPUs SLURM gave the step (CUDA_VISIBLE_DEVICES),
# a replica's MEGARL_NODE_REPLICAS, the environment it was run from (bin/megarl's venv: the directory above the path
# it was called by) and the step's resources as slurmctld accounts them (scontrol show step: TRES, TresPerNode).
LOG=${FAKE_LOG:-__LOG__}
role=$1
shift
step() {  # step HET_GROUP: the step's own job id is its het group's (SLURM_JOB_ID is the het job's)
    local job_id="SLURM_JOB_ID_HET_GROUP_$1" id resources
    id="${!job_id}.$SLURM_STEP_ID"
    resources=$(scontrol show step "$id" | grep -o 'TRES=[^ ]*\|TresPerNode=[^ ]*' | paste -sd ' ')
    echo "node=$SLURMD_NODENAME step=$id gpus=${CUDA_VISIBLE_DEVICES-unset} env=$(dirname "$(dirname "$0")") $resources"
}
case $role in
    prepare)
        echo "prepare $(step 0) args=$*" >> "$LOG"
        for arg in "$@"; do [[ $arg != run.dir=* ]] || mkdir -p "${arg#run.dir=}/logs"; done
        [[ -z ${FAIL_PREPARE:-} ]] || exit 1 ;;
    serve)
        replica=${*: -1}
        echo "serve replica=$replica node_replicas=${MEGARL_NODE_REPLICAS-unset} $(step 1)" | tee -a "$LOG"
        trap 'exit 0' TERM
        while :; do sleep 0.2; done ;;
    rank)
        echo "rank procid=$SLURM_PROCID ntasks=$SLURM_NTASKS config=$2 $(step 0)" >> "$LOG"
        # Only rank 0 waits for the replicas and ends with $RANK_EXIT; the others end at once with 0. (If two ranks
        # failed together, srun --kill-on-bad-exit would SIGTERM the slower one and report 143, not 1, at random.)
        (( SLURM_PROCID == 0 )) || exit 0
        for _ in $(seq 150); do
            if (( $(grep -c '^serve' "$LOG") >= __REPLICAS__ )); then  # the steps running now: every replica's?
                echo "running steps=$(squeue --noheader --steps --states=RUNNING --format=%i | paste -sd ,)" >> "$LOG"
                exit "${RANK_EXIT:-0}"
            fi
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


def check_serve_logs(run_dir: Path, replicas: int, why: str) -> None:
    """Each replica step's output is RUN_DIR/logs/serve_replica<i>.log (what the trainer's timeout message reads)."""
    for i in range(replicas):
        log = run_dir / "logs" / f"serve_replica{i}.log"
        assert log.is_file() and f"serve replica={i} " in log.read_text(), f"{log}\n{why}"


def parse_record(line: str) -> dict[str, str]:
    """A line of the fake's log: {"role": ..., KEY: VALUE, ...}; `args=` (prepare's) takes the rest of the line."""
    head, _, args = line.partition(" args=")
    role, _, fields = head.partition(" ")
    record = {"role": role, **dict(re.findall(r"(\w+)=(\S*)", fields))}
    return {**record, "args": args} if args else record


def gpu_set(record: dict[str, str]) -> set[int]:
    return {int(d) for d in record["gpus"].split(",")} if record["gpus"] not in ("", "unset") else set()


def check_placement(records: list[dict[str, str]], world: int, ranks_per_node: int, replicas: int,
                    replicas_per_node: int, tp: int, why: str) -> None:
    """The job's steps where and with what the launcher asked: `megarl prepare` first, one task with no GPU; the
    ranks `ranks_per_node` to a trainer node, all in one step that holds exactly their GPUs; `replicas_per_node`
    replicas to a rollout node, each its own step with `tp` GPUs disjoint from its neighbours' and its share of the
    node's CPUs and memory (the emulated node: tests/slurm_cluster.py), told how many replicas share the node
    (MEGARL_NODE_REPLICAS: the CPU binding's blocks); every replica's step running at once."""
    prepare, ranks = records[0], [r for r in records if r["role"] == "rank"]
    serves = sorted((r for r in records if r["role"] == "serve"), key=lambda r: int(r["replica"]))
    assert prepare["role"] == "prepare" and gpu_set(prepare) == set(), why
    assert prepare["TRES"].startswith("cpu=1,") and "gres" not in prepare.get("TresPerNode", ""), why
    assert sorted(int(r["procid"]) for r in ranks) == list(range(world)), why
    trainer_nodes = {r["node"] for r in ranks}
    assert prepare["node"] in trainer_nodes and len(trainer_nodes) == world // ranks_per_node, why
    assert len({r["step"] for r in ranks}) == 1 and all(r["ntasks"] == str(world) for r in ranks), why
    assert {frozenset(gpu_set(r)) for r in ranks} == {frozenset(range(ranks_per_node))}, why
    assert ranks[0]["TresPerNode"] == f"gres:gpu:{ranks_per_node}", why
    assert ranks[0]["TRES"].startswith(f"cpu={CPUS_PER_NODE * len(trainer_nodes)},"), why  # the nodes' CPUs, shared
    assert [int(r["replica"]) for r in serves] == list(range(replicas)), why
    cpus, mem = CPUS_PER_NODE // replicas_per_node, MEMORY_MB_PER_NODE // replicas_per_node
    for node in {r["node"] for r in serves}:
        on_node = [r for r in serves if r["node"] == node]
        assert node not in trainer_nodes and len(on_node) == replicas_per_node, why
        assert [len(gpu_set(r)) for r in on_node] == [tp] * replicas_per_node, why
        assert len(set().union(*map(gpu_set, on_node))) == tp * replicas_per_node, f"GPUs shared on {node}\n{why}"
        for r in on_node:
            assert (r["TRES"], r["TresPerNode"]) == (f"cpu={cpus},mem={mem}M,node=1", f"gres:gpu:{tp}"), why
            assert r["node_replicas"] == str(len(on_node)), why
    running = [r for r in records if r["role"] == "running"]
    assert len(running) == 1 and {r["step"] for r in serves} <= set(running[0]["steps"].split(",")), why
    assert len({r["step"] for r in serves}) == replicas, why


def demo_2x2(run_dir: Path) -> list[str]:
    """trainer: 2 ranks on one node; fleet: 2 replicas x tp 1 on another (2 GPUs a node)."""
    return ["--config", "configs/demo_moe.yaml", "rollout.replicas=2", "rollout.tp=1", f"run.dir={run_dir}",
            "--time", "00:05:00", "--poll-s", "1"]


def check_roles(lines: list[str], run_dir: Path, why: str, envs: tuple[Path, Path] | None = None) -> None:
    """The demo job: prepare first (with the recipe and overrides), then 2 ranks of one step on that node, 2 replicas
    with one GPU each on another node; with `envs` (trainer's, fleet's), prepare and the ranks ran the trainer
    environment's megarl, the replicas the fleet's."""
    records = [parse_record(line) for line in lines]
    if envs is not None:
        assert {r["role"]: r["env"] for r in records if r["role"] != "running"} == {
            "prepare": str(envs[0]), "rank": str(envs[0]), "serve": str(envs[1])}, why
        assert len({r["env"] for r in records if r["role"] == "rank"}) == 1, why
        assert len({r["env"] for r in records if r["role"] == "serve"}) == 1, why
    args = f"--config configs/demo_moe.yaml rollout.replicas=2 rollout.tp=1 run.dir={run_dir}"
    assert records and records[0].get("args") == args, why
    assert {r["config"] for r in records if r["role"] == "rank"} == {f"{run_dir}/config.yaml"}, why
    check_serve_logs(run_dir, 2, why)
    check_placement(records, world=2, ranks_per_node=2, replicas=2, replicas_per_node=2, tp=1, why=why)
    assert len(records) == 6, why


def role_envs(tmp_path: Path, fake: Path) -> tuple[Path, Path]:
    """A trainer and a fleet environment (venv-shaped: bin/megarl, the fake), as MEGARL_TRAINER_ENV and
    MEGARL_FLEET_ENV name them."""
    envs = (tmp_path / "trainer-env", tmp_path / "fleet-env")
    for env in envs:
        (env / "bin").mkdir(parents=True)
        (env / "bin" / "megarl").symlink_to(fake)
    return envs


def submit(driver: LaunchDriver, cluster: SlurmCluster, tmp_path: Path, args: list[str], replicas: int,
           gpus_per_node: int, split_envs: bool = False) -> tuple[list[str], str, tuple[Path, Path] | None]:
    """nemo-run itself submits the job (sbatch on this machine, LocalTunnel) to the emulated cluster, with the fake
    megarl (`split_envs`: each role's from its own environment, MEGARL_TRAINER_ENV and MEGARL_FLEET_ENV); returns
    the roles' records, what to show when a check fails and the environments. The job must end with code 0."""
    fake, log = fake_megarl(tmp_path, replicas)
    env = {"MEGARL": str(fake), "GPUS_PER_NODE": str(gpus_per_node), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    envs = role_envs(tmp_path, fake) if split_envs else None
    if envs is not None:
        env |= {"MEGARL_TRAINER_ENV": str(envs[0]), "MEGARL_FLEET_ENV": str(envs[1])}
    proc = launcher(driver, tmp_path, *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cluster.wait_idle(timeout_s=120)
    outputs = sorted((tmp_path / "nemo_home" / "experiments").rglob("sbatch_*.out"))
    job_output = "\n".join(p.read_text() for p in outputs)
    records = log.read_text().splitlines() if log.exists() else []
    why = f"launcher: {proc.stderr[-3000:]}\nroles:\n" + "\n".join(records) + f"\njob output:\n{job_output[-4000:]}"
    assert "job exited with code 0" in job_output, why
    return records, why, envs


def test_nemo_run_submits_the_job_to_slurm(launch_driver: LaunchDriver, slurm_cluster: SlurmCluster,
                                           tmp_path: Path) -> None:
    """The demo job, two replicas on one node, each role from its own environment: every role runs where the config
    puts it, from its environment, and the job ends with 0."""
    run_dir = tmp_path / "run"
    records, why, envs = submit(launch_driver, slurm_cluster, tmp_path, demo_2x2(run_dir), replicas=2,
                                gpus_per_node=2, split_envs=True)
    check_roles(records, run_dir, why, envs)


def test_nemo_run_places_the_30b_job_on_slurm(launch_driver: LaunchDriver, slurm_cluster: SlurmCluster,
                                              tmp_path: Path) -> None:
    """The shipped 30B recipe's shape on the emulated 8-node cluster (8 GPUs a node): 32 ranks on 4 nodes in one
    step; 8 replicas x tp 4, two to each of the other 4 nodes, all running at once, each with 4 GPUs of its own
    and half of its node's CPUs and memory."""
    recipe, run_dir = "configs/qwen3_30b_a3b_guru.yaml", tmp_path / "run"
    cfg = load_config(ROOT / recipe)
    records, why, _ = submit(launch_driver, slurm_cluster, tmp_path, ["--config", recipe, f"run.dir={run_dir}",
                          "--time", "00:05:00", "--poll-s", "1"], replicas=cfg.rollout.replicas, gpus_per_node=8)
    parsed = [parse_record(line) for line in records]
    assert parsed and parsed[0].get("args") == f"--config {recipe} run.dir={run_dir}", why
    check_placement(parsed, world=cfg.trainer.world_size, ranks_per_node=8, replicas=cfg.rollout.replicas,
                    replicas_per_node=8 // cfg.rollout.tp, tp=cfg.rollout.tp, why=why)
    check_serve_logs(run_dir, cfg.rollout.replicas, why)


def test_sbatch_script_fails_the_job(launch_driver: LaunchDriver, slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The dry run's sbatch script, run by `sbatch --wait` twice (one dry run: nemo-run takes seconds to import): a
    failed rank fails the job (code 1), a failed prepare ends it (code 2) before any other role starts."""
    fake, _ = fake_megarl(tmp_path, replicas=2)
    run_dir = tmp_path / "run"
    script = dryrun(launch_driver, tmp_path, *demo_2x2(run_dir), env={"MEGARL": str(fake), "GPUS_PER_NODE": "2"})
    for path in re.findall(r"--chdir (\S+)", script) + [Path(p).parent for p in re.findall(r"--output=(\S+)", script)]:
        Path(path).mkdir(parents=True, exist_ok=True)  # what nemo-run makes before it submits
    (tmp_path / "job.sh").write_text(script)
    for outcome, env in (("rank_fails", {"RANK_EXIT": "1"}), ("prepare_fails", {"FAIL_PREPARE": "1"})):
        log = tmp_path / f"roles-{outcome}.log"  # each job's records apart (the fake writes to $FAKE_LOG)
        result = slurm_cluster.sbatch_wait(tmp_path / "job.sh", env_extra={**env, "FAKE_LOG": str(log)},
                                           timeout_s=120)
        records = log.read_text().splitlines()
        output = "\n".join(p.read_text() for p in sorted((tmp_path / "nemo_home").rglob("*.out")))
        why = (f"{outcome}: {slurm_cluster.describe(result)}\nroles:\n" + "\n".join(records)
               + f"\njob files:\n{output[-4000:]}")
        if outcome == "prepare_fails":
            assert records[0].startswith("prepare ") and len(records) == 1 and result.returncode == 2, why
        else:
            check_roles(records, run_dir, why)
            assert result.returncode == 1, why
        slurm_cluster.wait_idle(timeout_s=30)  # the replicas' steps end with the job


@pytest.mark.slow
def test_local_executor_trains_the_demo(launch_driver: LaunchDriver, tmp_path: Path) -> None:
    """nemo-run's LocalExecutor runs the whole job on this machine: prepare, one vLLM replica, torchrun with two
    trainer ranks (this venv's training stack); the replica is stopped when the ranks end."""
    run_dir = tmp_path / "run"
    proc = launcher(launch_driver, tmp_path, "--config", "configs/demo_moe.yaml", "run.steps=2", f"run.dir={run_dir}",
                    "--executor", "local", "--venv", sys.prefix)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUCCEEDED" in proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    assert not [p for p in processes if f"serve --config {run_dir}/config.yaml" in p], "the replica outlived the job"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
