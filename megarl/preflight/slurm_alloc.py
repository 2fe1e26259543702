"""The GPUs SLURM allocated to the job on each node, from `scontrol show job -d <id>`, whose detail lines read

         Nodes=node[1-4] CPU_IDs=0-31 Mem=64000 GRES=gpu:8(IDX:0-7)
         Nodes=node5 CPU_IDs=0-15 Mem=32000 GRES=gpu:a100:2(IDX:0,2),gpu:v100:1(IDX:5)

(older releases spell the field `GRES_IDX=gpu(IDX:0-7)`). The parser is a pure function of that text."""

from __future__ import annotations

import re
import subprocess

from megarl.parallel.launcher_env import expand_hostlist
from megarl.preflight.identity import id_list

_NODES_LINE = re.compile(r"^\s+Nodes=(\S+)\s(.*)$")
_GPU_IDX = re.compile(r"(?:^|[=,])gpu(?::[^:(,\s]+)*\(IDX:([^)]*)\)")


def parse_job_gpus(text: str) -> dict[str, list[int]]:
    """Node name -> the GPU ids (SLURM's IDX) the job holds there, for every node of the job's detail lines
    (a node with no GPU: []). `IDX:N/A` (no GPU) counts as none."""
    allocation: dict[str, list[int]] = {}
    for line in text.splitlines():
        match = _NODES_LINE.match(line)
        if match is None:
            continue
        nodes, rest = match.groups()
        gres = next((field.split("=", 1)[1] for field in rest.split() if field.startswith(("GRES=", "GRES_IDX="))),
                    "")
        ids = sorted({i for idx in _GPU_IDX.findall(gres) for i in id_list(idx)})
        for node in expand_hostlist(nodes):
            allocation[node] = sorted(set(allocation.get(node, [])) | set(ids))
    return allocation


def job_gpus(job_id: str) -> dict[str, list[int]]:
    """The allocation of job `job_id`, asking scontrol; raises RuntimeError with scontrol's complaint."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-d", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"scontrol show job -d {job_id}: {err}") from None
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise RuntimeError(f"scontrol show job -d {job_id}: {last}")
    allocation = parse_job_gpus(out.stdout)
    if not allocation:
        raise RuntimeError(f"scontrol show job -d {job_id} listed no `Nodes=` detail lines")
    return allocation
