"""`MEGARL_PREFLIGHT=1 sbatch slurm/guru_moe.sh` and `slurm/guru_7b.sh`, unchanged (their own `#SBATCH` headers,
recipes and defaults), on the emulated GPU cluster (tests/slurm_cluster.py: 8 nodes x 8 GPUs with device entries,
memory and CPUs consumable): every step of the real job runs where the job would run it, checks instead of
working, and the job prints one table and exits 0 only when nothing is wrong.

The placement is checked from what each step itself wrote (its node, and the GPUs SLURM handed it in
CUDA_VISIBLE_DEVICES), against the layout the scripts' comments and docs/cluster.md promise, not against the
report's own judgement. What the environment has to say is only what a user says on a cluster: where the run
directory, the model and the data are, and (emulation only) that every node is 127.0.0.1 and has no GPU driver."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from megarl.data.samples import SAMPLES_DIR
from tests.slurm_cluster import GPUS_PER_NODE, SlurmCluster

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 300


def _sparse_checkpoint(directory: Path, config_dir: Path, shape: tuple[int, int]) -> Path:
    """A model directory with the real model's config.json and one safetensors file whose header is real and whose
    data is a hole of the right length (sparse: no disk used): readable, the size checks pass, no weights exist."""
    directory.mkdir(parents=True)
    shutil.copy(config_dir / "config.json", directory / "config.json")
    nbytes = shape[0] * shape[1] * 2
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": list(shape),
                                                        "data_offsets": [0, nbytes]}}).encode()
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return directory


def _submit(cluster: SlurmCluster, tmp_path: Path, script: str, model: Path, overrides: str = "",
            extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], str]:
    env = {
        "MEGARL_PREFLIGHT": "1",
        "MEGARL_HOME": str(REPO),
        "MEGARL": str(Path(sys.executable).parent / "megarl"),
        "RUN_DIR": str(tmp_path / "run"),
        "MEGARL_OVERRIDES": (f"model.hf_dir={model} data.train_files=[{SAMPLES_DIR / 'guru_math_sample.parquet'}] "
                             f"data.eval_files=[{SAMPLES_DIR / 'math500_sample.jsonl'}] "
                             # the emulated nodes have 32 GB each: staged pushes pin each vLLM rank's whole shard
                             # (88.8 GB per 30B replica), which the job rightly refuses there; streamed fits
                             f"sync.receive=streamed {overrides}"),
        # the emulation: every node is 127.0.0.1, and its GPUs are device entries without a driver
        "MEGARL_MASTER_ADDR": "127.0.0.1",
        "MEGARL_BIND_ADDR": "127.0.0.1",
        "MEGARL_PREFLIGHT_DEVICES": "ids",
        **(extra or {}),
    }
    result = cluster.sbatch_wait(REPO / "slurm" / script, env_extra=env, timeout_s=JOB_TIMEOUT_S, cwd=tmp_path)
    outputs = sorted(tmp_path.glob(f"*-{SlurmCluster.job_id(result)}.out"))  # the script's own --output=%x-%j.out
    assert len(outputs) == 1, (outputs, cluster.describe(result))
    return result, outputs[0].read_text()


def _hellos(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {path.stem.removeprefix("hello_"): json.loads(path.read_text())
            for path in (run_dir / "preflight").glob("hello_*.json")}


def _placement(hellos: dict[str, dict[str, Any]]) -> tuple[dict[str, list[int]], dict[str, list[set[int]]],
                                                            dict[str, list[int]]]:
    """From each step's own account: trainer ranks per node, each replica's GPU set per node, and every GPU
    anyone computes on per node (a rank: GPU `local rank` of what it sees; a replica: all it sees)."""
    ranks, replicas, used = defaultdict(list), defaultdict(list), defaultdict(list)
    for key, hello in hellos.items():
        visible = [int(g) for g in hello["cuda_visible_devices"].split(",")]
        if key.startswith("rank"):
            ranks[hello["node"]].append(int(key.removeprefix("rank")))
            used[hello["node"]].append(visible[hello["local_rank"]])
        else:
            replicas[hello["node"]].append(set(visible))
            used[hello["node"]] += visible
    return ranks, replicas, used


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"moe": _sparse_checkpoint(root / "qwen3-30b-a3b", REPO / "configs" / "models" / "qwen3-30b-a3b",
                                      (151936, 2048)),
            "7b": _sparse_checkpoint(root / "qwen2.5-7b", REPO / "configs" / "models" / "qwen2.5-7b", (152064, 3584))}


def test_guru_moe_preflight_at_full_shape(slurm_cluster: SlurmCluster, tmp_path: Path,
                                          models: dict[str, Path]) -> None:
    result, output = _submit(slurm_cluster, tmp_path, "guru_moe.sh", models["moe"])
    assert result.returncode == 0, f"{output}\n{slurm_cluster.describe(result)}"
    assert "preflight OK: 32 trainer rank(s) on node1,node2,node3,node4, 8 replica(s) on node5,node6,node7,node8, " \
           "64 GPU(s) as SLURM's ids" in output, output

    ranks, replicas, used = _placement(_hellos(tmp_path / "run"))
    # 32 trainer ranks, 8 per node on nodes 1-4, in order
    assert {node: sorted(r) for node, r in ranks.items()} == {f"node{n}": list(range(8 * (n - 1), 8 * n))
                                                              for n in range(1, 5)}, dict(ranks)
    # 8 replicas, 2 per node on nodes 5-8, each with 4 GPUs, the two on a node disjoint
    assert sorted(replicas) == [f"node{n}" for n in range(5, 9)], dict(replicas)
    for node, sets in replicas.items():
        assert len(sets) == 2 and all(len(s) == 4 for s in sets) and not sets[0] & sets[1], (node, sets)
    # every GPU of the job used exactly once (8 nodes x 8)
    assert sorted(used) == [f"node{n}" for n in range(1, 9)]
    for node, gpus in used.items():
        assert sorted(gpus) == list(range(GPUS_PER_NODE)), (node, sorted(gpus))
    # the table says the same, one row per step and node
    rows = [line for line in output.splitlines() if line.startswith("node") and " | " in line][1:]
    assert len(rows) == 4 + 8, output


def test_guru_7b_preflight_at_full_shape(slurm_cluster: SlurmCluster, tmp_path: Path,
                                         models: dict[str, Path]) -> None:
    result, output = _submit(slurm_cluster, tmp_path, "guru_7b.sh", models["7b"])
    assert result.returncode == 0, f"{output}\n{slurm_cluster.describe(result)}"

    ranks, replicas, used = _placement(_hellos(tmp_path / "run"))
    assert {node: sorted(r) for node, r in ranks.items()} == {"node1": list(range(8))}  # 8 ranks on node 1
    assert list(replicas) == ["node2"] and len(replicas["node2"]) == 4  # 4 replicas x 2 GPUs on node 2
    assert all(len(s) == 2 for s in replicas["node2"]), replicas
    for node in ("node1", "node2"):
        assert sorted(used[node]) == list(range(GPUS_PER_NODE)), (node, used[node])


def test_preflight_names_every_problem(slurm_cluster: SlurmCluster, tmp_path: Path, models: dict[str, Path]) -> None:
    # two mistakes a user can make without touching the script: three replicas where the node has room for four
    # (two GPUs idle for 24 hours), and a checkpoint whose download was cut short
    broken = tmp_path / "broken-7b"
    shutil.copytree(models["7b"], broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    result, output = _submit(slurm_cluster, tmp_path, "guru_7b.sh", broken, overrides="rollout.replicas=3")

    assert result.returncode == 1, f"{output}\n{slurm_cluster.describe(result)}"
    problems = [line for line in output.splitlines() if line.startswith("PROBLEM: ")]
    assert any("node2" in p and "are used by no step" in p for p in problems), output
    assert any("model.safetensors" in p for p in problems), output
    assert "preflight FAILED: " in output, output
