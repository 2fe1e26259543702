"""Where a process sits, from what real launchers give it: `torchrun` on this machine and `srun` on the
emulated SLURM cluster; SLURM host lists expanded as `scontrol show hostnames` expands them."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.launch import free_port
from megarl.parallel.launcher_env import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    LauncherEnvError,
    expand_hostlist,
    process_place,
)


@pytest.mark.parametrize("hostlist",
                         ["node[1-3,7],gpu[08-10],login", "node1", "a[009-011],c", "rack1-n[2-4]", "x[1],y[2-3]"])
def test_hostlists_expand_like_scontrol(slurm_cluster, hostlist):
    reference = subprocess.run(["scontrol", "show", "hostnames", hostlist], env=slurm_cluster.env,
                               capture_output=True, text=True, check=True).stdout.split()
    assert expand_hostlist(hostlist) == reference


def test_torchrun_places(tmp_path):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
                          "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "tests.print_place"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    places = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                    key=lambda p: p["rank"])
    # torchrun's agent serves the store at the master port itself (rank 0 must not host another there)
    assert places == [{"launcher": "torchrun", "rank": r, "world_size": 2, "local_rank": r,
                       "master_addr": "127.0.0.1", "master_port": port, "launcher_store": True} for r in range(2)]


def test_srun_places_on_two_nodes(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        srun --ntasks=2 bash -c '{sys.executable} -m tests.print_place > {tmp_path}/place_$SLURM_PROCID.json'
        MEGARL_MASTER_ADDR=127.0.0.1 MEGARL_MASTER_PORT=29511 srun --ntasks=2 \\
            bash -c '{sys.executable} -m tests.print_place > {tmp_path}/override_$SLURM_PROCID.json'
        echo "nodes=$SLURM_JOB_NODELIST"
        """))
    result = slurm_cluster.sbatch_wait(script, env_extra={"PYTHONPATH": str(_repo_root())})
    assert result.returncode == 0, slurm_cluster.describe(result)
    job_id = int(slurm_cluster.job_id(result))
    first = slurm_cluster.job_output(result).split("nodes=")[1].split()[0]
    first_node = subprocess.run(["scontrol", "show", "hostnames", first], env=slurm_cluster.env,
                                capture_output=True, text=True, check=True).stdout.split()[0]
    places = [json.loads((tmp_path / f"place_{r}.json").read_text()) for r in range(2)]
    port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN  # every rank derives the same port from the job id
    assert places == [{"launcher": "slurm", "rank": r, "world_size": 2, "local_rank": 0, "master_addr": first_node,
                       "master_port": port, "launcher_store": False} for r in range(2)]
    overridden = [json.loads((tmp_path / f"override_{r}.json").read_text()) for r in range(2)]
    assert {(p["master_addr"], p["master_port"]) for p in overridden} == {("127.0.0.1", 29511)}


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def test_no_launcher_and_bad_environments():
    assert process_place({}) is None
    with pytest.raises(LauncherEnvError, match="SLURM_NTASKS='x'"):
        process_place({"SLURM_PROCID": "0", "SLURM_NTASKS": "x", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1"})
    with pytest.raises(LauncherEnvError, match="rank 2 outside a world of 2"):
        process_place({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(LauncherEnvError, match="MASTER_PORT=None"):
        process_place({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})
    with pytest.raises(LauncherEnvError, match="run the ranks with srun"):
        process_place({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"})
