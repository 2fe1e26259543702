"""The pieces the cluster roles (`megarl prepare / serve / rank`) stand on: stores bound to one address, the
fleet's rendezvous in the run directory, and the roles' refusals of a wrong environment (real processes, real
sockets; the roles running a whole job are in tests/test_slurm_job.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.launch import free_port
from megarl.parallel.stores import StoreAddressError, tcp_store
from megarl.rollout.fleet import FleetError
from megarl.rollout.fleet_auth import SECRET_ENV, new_fleet_secret, read_secret
from megarl.rollout.rendezvous import clear_fleet, register_replica, secret_id, unregister_replica, wait_for_fleet

REPO = Path(__file__).resolve().parents[1]


def _connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_store_listens_on_its_address_only() -> None:
    port = free_port()
    store = tcp_store("127.0.0.2", port, 2, is_master=True, timeout_s=10)  # another loopback address
    client = tcp_store("127.0.0.2", port, 2, is_master=False, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert _connects("127.0.0.2", port)
    assert not _connects("127.0.0.1", port)  # torch's own master would listen on every address


def test_store_port_taken_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StoreAddressError, match=f"cannot listen on 127.0.0.1:{port}.*MEGARL_MASTER_PORT"):
            tcp_store("127.0.0.1", port, 1, is_master=True, timeout_s=5)


def test_fleet_rendezvous_reads_this_jobs_replicas_only(tmp_path: Path) -> None:
    register_replica(tmp_path, 0, "http://10.0.0.5:8000", "old-job-secret")  # left by an earlier job
    with pytest.raises(FleetError, match=r"replica\(s\) \[0, 1\] did not register.*never started: \[0, 1\]"):
        wait_for_fleet(tmp_path, 2, "this-job-secret", timeout_s=0.5)

    def register_later() -> None:
        time.sleep(1.5)
        register_replica(tmp_path, 1, "http://10.0.0.6:8001", "this-job-secret")
        register_replica(tmp_path, 0, "http://10.0.0.5:8000", "this-job-secret")

    thread = threading.Thread(target=register_later)
    thread.start()
    assert wait_for_fleet(tmp_path, 2, "this-job-secret", timeout_s=30) == ["http://10.0.0.5:8000",
                                                                            "http://10.0.0.6:8001"]
    thread.join()
    entry = json.loads((tmp_path / "fleet" / "replica0.json").read_text())
    assert entry["job"] == secret_id("this-job-secret") and "this-job-secret" not in json.dumps(entry)
    unregister_replica(tmp_path, 0)
    assert not (tmp_path / "fleet" / "replica0.json").exists()
    clear_fleet(tmp_path)
    assert not list((tmp_path / "fleet").iterdir())


def test_fleet_timeout_names_the_replicas_that_started_and_those_that_never_did(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run directory as `megarl prepare` leaves it (a fresh secret, logs/) and replicas in every state: the
    timeout's message sends each replica that started to its logs (only those that exist), names those that never
    did (no serve log of this job: an earlier job's does not count), and no path in it is missing."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    for stale in ("serve_replica4.log", "vllm_replica4.log"):  # replica 4 ran in an earlier job
        (logs / stale).write_text("an earlier job\n")
        os.utime(logs / stale, (time.time() - 3600, time.time() - 3600))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = read_secret(new_fleet_secret(private))
    register_replica(tmp_path, 0, "http://10.0.0.5:8000", secret)  # replica 0 is up
    for name in ("serve_replica1.log", "vllm_replica1.log", "serve_replica2.log"):  # 1: vLLM started; 2: not yet
        (logs / name).write_text("megarl: ...\n")
    with pytest.raises(FleetError) as raised:
        wait_for_fleet(tmp_path, 5, secret, timeout_s=0.5)
    message = str(raised.value)
    assert message.splitlines() == [
        f"rollout replica(s) [1, 2, 3, 4] did not register in {tmp_path / 'fleet'} within 0.5s "
        "(rollout.startup_timeout_s); started but not registered: [1, 2]; never started: [3, 4]",
        f"  replica 1 started but did not register: see {logs / 'serve_replica1.log'}, {logs / 'vllm_replica1.log'}",
        f"  replica 2 started but did not register: see {logs / 'serve_replica2.log'}",
        "  replicas 3, 4 never started (no logs/serve_replica<i>.log): under SLURM their steps may be pending; the "
        "job's output names them",
        f"  elsewhere start each with `megarl serve --config ... --replica I` against {tmp_path}, on a filesystem "
        "this node shares"]
    for path in re.findall(rf"{re.escape(str(tmp_path))}[^\s,]*", message):
        assert Path(path).exists() and "replica4" not in path, path

    for replica in (1, 2, 4):
        register_replica(tmp_path, replica, f"http://10.0.0.6:{8000 + replica}", secret)
    with pytest.raises(FleetError) as raised:  # one replica left, which never started
        wait_for_fleet(tmp_path, 5, secret, timeout_s=0.5)
    assert str(raised.value).splitlines()[0].endswith("; never started: [3]")
    assert str(raised.value).splitlines()[1] == (
        "  replica 3 never started (no logs/serve_replica3.log): under SLURM its step may be pending; the job's "
        "output names it")


def _megarl(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**clean, **(env or {})})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    out = _megarl("prepare", "--config", "configs/demo_moe.yaml", f"run.dir={root / 'run'}",
                  f"model.hf_dir={root / 'tiny'}")
    assert out.returncode == 0, out.stderr[-3000:]
    topology = dict(line.split("=", 1) for line in out.stdout.splitlines())
    # a GPU replica's --mem: its 2 vLLM ranks, 8 GB each (assumed) + each its pinned shard, at most the checkpoint
    host_mb, weights = int(topology.pop("ROLLOUT_HOST_MB")), sum(p.stat().st_size for p in (root / "tiny").glob(
        "*.safetensors"))
    assert 16e9 / 2**20 < host_mb <= (16e9 + 2 * weights) / 2**20 + 1, (host_mb, weights)
    assert topology == {"RUN_DIR": str(root / "run"), "TRAINER_WORLD_SIZE": "2", "ROLLOUT_REPLICAS": "1",
                        "ROLLOUT_TP": "2", "ROLLOUT_RESTARTS": "2", "CONFIG": str(root / "run" / "config.yaml")}
    return root / "run"


def test_prepare_makes_a_private_secret_per_job(prepared: Path) -> None:
    private, secret = prepared / "private", prepared / "private" / "fleet_secret"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    first = secret.read_text()
    register_replica(prepared, 0, "http://127.0.0.1:1", first)
    again = _megarl("prepare", "--config", str(prepared / "config.yaml"))  # the next job on this run directory
    assert again.returncode == 0, again.stderr[-3000:]
    assert secret.read_text() != first and first not in again.stdout + again.stderr
    assert not list((prepared / "fleet").glob("replica*.json"))  # the earlier job's fleet is forgotten


def test_roles_refuse_a_wrong_environment(prepared: Path) -> None:
    config = str(prepared / "config.yaml")
    outside = _megarl("rank", "--config", config)
    assert outside.returncode == 2 and "runs under torchrun or srun" in outside.stderr, outside.stderr
    wrong_world = _megarl("rank", "--config", config, env={"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                                           "MASTER_PORT": str(free_port())})
    assert wrong_world.returncode == 2, wrong_world.stderr
    assert "started 3 ranks but trainer.world_size=2" in wrong_world.stderr
    replica = _megarl("serve", "--config", config, "--replica", "1")
    assert replica.returncode == 2 and "rollout.replicas=1 (replicas 0..0)" in replica.stderr, replica.stderr
    no_secret = _megarl("serve", "--config", config, "--replica", "0",
                        env={"MEGARL_FLEET_SECRET_FILE": str(prepared / "nowhere")})
    assert no_secret.returncode == 2 and "cannot read the fleet secret file" in no_secret.stderr, no_secret.stderr
