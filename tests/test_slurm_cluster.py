"""The emulated SLURM cluster itself (tests/slurm_cluster.py): multi-node jobs, exit codes through `sbatch --wait`,
heterogeneous jobs, and cancellation. Real slurmctld/slurmd/munged; every job's exit code is SLURM's own."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster

# Each task writes "SLURM_PROCID SLURM_NODEID SLURMD_NODENAME SLURM_JOB_NODELIST" to $OUT/task.<procid>.
TWO_NODE_JOB = """\
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --job-name=two-nodes
set -euo pipefail
# shellcheck disable=SC2016  # expanded by each task, not here
srun --ntasks=2 --ntasks-per-node=1 bash -c \\
    'echo "$SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $SLURM_JOB_NODELIST" > "$OUT/task.$SLURM_PROCID"'
"""

# One step in each component; each writes its node, the het job's id and both components' node lists to
# $OUT/het.<group>. A component asks for a whole node (all 32 CPUs), so the two components cannot share one.
HET_JOB = """\
#!/bin/bash
#SBATCH --job-name=het
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=32
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=32
set -uo pipefail
# shellcheck disable=SC2016  # expanded by each step, not here
srun --het-group=0 bash -c 'echo "$SLURMD_NODENAME $SLURM_JOB_ID $SLURM_JOB_NODELIST_HET_GROUP_0 \\
    $SLURM_JOB_NODELIST_HET_GROUP_1" > "$OUT/het.0"' &
first=$!
# shellcheck disable=SC2016
srun --het-group=1 bash -c 'echo "$SLURMD_NODENAME $SLURM_JOB_ID $SLURM_JOB_NODELIST_HET_GROUP_0 \\
    $SLURM_JOB_NODELIST_HET_GROUP_1" > "$OUT/het.1"' &
second=$!
status=0
wait "$first" || status=$?
wait "$second" || status=$?
exit "$status"
"""

# A background step that would run for 987 s (a marker to find it in /proc) while the batch script waits for it.
CANCELLED_JOB = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --job-name=megarl-cancel-me
# shellcheck disable=SC2016  # expanded by the step, not here
srun --ntasks=1 bash -c 'touch "$OUT/started"; exec sleep 987' &
wait
"""


# Two steps on one node of a job that holds the node's 8 GPUs, as a job script starts replicas: each writes
# "SLURM_STEP_ID CUDA_VISIBLE_DEVICES SLURM_STEP_GPUS" to $OUT/gpus.<step> and stays up until both have written,
# so both must hold their GPUs at the same time. $STEP_GPUS is each step's GPU option.
GPU_STEPS_JOB = """\
#!/bin/bash
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -uo pipefail
pids=()
for _ in 0 1; do
    # shellcheck disable=SC2016,SC2086  # expanded by the step; $STEP_GPUS is one option or none
    srun --nodes=1 --ntasks=1 --cpus-per-task=1 --mem=1000 --exact $STEP_GPUS bash -c \\
        'echo "$SLURM_STEP_ID $CUDA_VISIBLE_DEVICES $SLURM_STEP_GPUS" > "$OUT/gpus.$SLURM_STEP_ID"
         for _ in $(seq 100); do [ "$(ls "$OUT" | wc -l)" -ge 2 ] && exit 0; sleep 0.1; done; exit 1' &
    pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""


def _script(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_two_node_job_runs_one_task_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = slurm_cluster.sbatch_wait(_script(tmp_path, "two.sh", TWO_NODE_JOB), env_extra={"OUT": str(out)})

    assert result.returncode == 0, slurm_cluster.describe(result)
    records = [path.read_text().split() for path in sorted(out.glob("task.*"))]
    assert len(records) == 2, f"{records}\n{slurm_cluster.describe(result)}"
    procids = {int(procid) for procid, _, _, _ in records}
    nodeids = {int(nodeid) for _, nodeid, _, _ in records}
    names = {name for _, _, name, _ in records}
    nodelists = {nodelist for _, _, _, nodelist in records}
    assert procids == {0, 1} and nodeids == {0, 1}, records
    assert len(names) == 2 and names <= set(slurm_cluster.nodes), records
    assert len(nodelists) == 1, records  # the same allocation seen from both nodes
    expanded = slurm_cluster.run("scontrol", "show", "hostnames", nodelists.pop()).stdout.split()
    assert set(expanded) == names, (expanded, records)


@pytest.mark.parametrize(("body", "expected"), [("srun --ntasks=1 false", 1), ("exit 3", 3)],
                         ids=["failing-step", "script-exit-3"])
def test_failing_job_makes_sbatch_wait_fail(slurm_cluster: SlurmCluster, tmp_path: Path, body: str,
                                            expected: int) -> None:
    script = _script(tmp_path, "fail.sh", f"#!/bin/bash\n#SBATCH --nodes=1\n{body}\n")
    result = slurm_cluster.sbatch_wait(script)
    assert result.returncode == expected, slurm_cluster.describe(result)


def test_heterogeneous_job_runs_a_step_in_each_component(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = slurm_cluster.sbatch_wait(_script(tmp_path, "het.sh", HET_JOB), env_extra={"OUT": str(out)})

    assert result.returncode == 0, slurm_cluster.describe(result)
    steps = {group: (out / f"het.{group}").read_text().split() for group in (0, 1)
             if (out / f"het.{group}").exists()}
    assert sorted(steps) == [0, 1], f"{steps}\n{slurm_cluster.describe(result)}"
    names = {step[0] for step in steps.values()}
    assert len(names) == 2 and names <= set(slurm_cluster.nodes), steps  # one component per node
    leader = slurm_cluster.job_id(result)
    for group, (node, job_id, *group_nodes) in steps.items():
        assert int(job_id) == leader, steps  # both steps belong to the one heterogeneous job
        assert group_nodes == [steps[0][0], steps[1][0]] and node == group_nodes[group], steps


def test_cancelled_job_leaves_the_cluster_healthy(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, "cancel.sh", CANCELLED_JOB)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(slurm_cluster.sbatch_wait, script, env_extra={"OUT": str(out)})
        deadline = time.monotonic() + 30
        while not (out / "started").exists():  # the background step is running
            assert not waiting.done(), slurm_cluster.describe(waiting.result())
            assert time.monotonic() < deadline, f"step did not start\n{slurm_cluster.log_tails()}"
            time.sleep(0.1)
        job_ids = slurm_cluster.run("squeue", "--noheader", "--name=megarl-cancel-me", "--format=%i").stdout.split()
        assert len(job_ids) == 1, job_ids
        assert _processes_with_args("sleep", "987"), "the step's process is not visible in /proc"
        slurm_cluster.run("scancel", job_ids[0])
        result = waiting.result()

    assert result.returncode != 0, slurm_cluster.describe(result)  # a cancelled job is not a success
    slurm_cluster.wait_idle()
    assert not _processes_with_args("sleep", "987"), "the cancelled step's process survived"
    after = slurm_cluster.sbatch_wait(_script(tmp_path, "after.sh", TWO_NODE_JOB), env_extra={"OUT": str(out)})
    assert after.returncode == 0, slurm_cluster.describe(after)
    assert len(list(out.glob("task.*"))) == 2, slurm_cluster.describe(after)


def _processes_with_args(*argv: str) -> list[int]:
    """Pids whose command line is exactly `argv`."""
    wanted = ("\0".join(argv) + "\0").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_each_step_gets_its_own_gpus(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, "gpus.sh", GPU_STEPS_JOB)
    result = slurm_cluster.sbatch_wait(script, env_extra={"OUT": str(out), "STEP_GPUS": "--gpus-per-node=4"})

    assert result.returncode == 0, slurm_cluster.describe(result)
    seen = [path.read_text().split() for path in sorted(out.glob("gpus.*"))]
    assert len(seen) == 2, seen
    devices = [set(visible.split(",")) for _, visible, _ in seen]
    assert all(len(d) == 4 for d in devices) and not devices[0] & devices[1], seen  # 4 each, disjoint
    assert devices[0] | devices[1] == {str(i) for i in range(8)}, seen
    assert all(visible == step_gpus for _, visible, step_gpus in seen), seen  # as SLURM_STEP_GPUS says


def test_a_step_without_its_own_gpu_option_holds_every_gpu(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # the failure the job scripts must avoid: `#SBATCH --gpus-per-node=8` reaches each step (SLURM_GPUS_PER_NODE),
    # so the first step holds all 8 GPUs and the second waits for them: the two never run at the same time
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, "gpus.sh", GPU_STEPS_JOB)
    result = slurm_cluster.sbatch_wait(script, env_extra={"OUT": str(out), "STEP_GPUS": "--gpus=4"}, timeout_s=90)

    assert result.returncode == 1, slurm_cluster.describe(result)  # the first step gave up waiting for the second
    seen = [path.read_text().split() for path in sorted(out.glob("gpus.*"))]
    assert seen and all(len(visible.split(",")) == 8 for _, visible, _ in seen), seen
    assert "Requested nodes are busy" in slurm_cluster.job_output(result), slurm_cluster.describe(result)
