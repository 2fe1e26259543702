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
# $OUT/het.<group>. A component asks for a whole node (both CPUs), so the two components cannot share one.
HET_JOB = """\
#!/bin/bash
#SBATCH --job-name=het
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=2
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1 --cpus-per-task=2
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
