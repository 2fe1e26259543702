"""Start and stop the rollout fleet: one vLLM OpenAI-compatible server per replica.

Each server loads the HF checkpoint with tensor parallel `rollout.tp`, exposes the token-in /
token-out route (`/inference/v1/generate`, `--enable-scale-out`), the RL weight-update routes and
`/collective_rpc` (`VLLM_SERVER_DEV_MODE=1`), and uses megarl's partitioned weight-transfer
backend. The CPU-only settings (thread binding per TP rank, KV-cache size) are applied only when
no GPU is present. Logs go to `<log_dir>/vllm_replica<i>.log`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

from megarl.rollout.vllm_plugin import BACKEND_NAME


class FleetError(RuntimeError):
    pass


@dataclass
class FleetSpec:
    model_dir: Path
    tp: int = 1
    replicas: int = 1
    port: int = 0  # first replica's port; 0 picks free ports
    dtype: str = "float32"
    kv_cache_gib: int = 1
    startup_timeout_s: float = 600.0
    log_dir: Path = Path(".")
    extra_args: list[str] = field(default_factory=list)


@dataclass
class Fleet:
    urls: list[str]
    procs: list[subprocess.Popen]
    logs: list[Path]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 30
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _cpu_env(tp: int, kv_cache_gib: int) -> dict[str, str]:
    """vLLM's CPU backend: one OpenMP thread set per TP rank, a small KV cache."""
    import torch

    if torch.cuda.is_available():
        return {}
    cores = os.cpu_count() or 1
    per = max(1, cores // tp)
    binds = "|".join(f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per % cores) for r in range(tp))
    return {"VLLM_CPU_OMP_THREADS_BIND": binds, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def server_command(spec: FleetSpec, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir), "--port", str(port), "--host", "127.0.0.1",
        "--tensor-parallel-size", str(spec.tp), "--dtype", spec.dtype, "--enforce-eager",
        "--enable-scale-out", "--max-model-len", "128", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}),
        "--worker-extension-cls", "megarl.rollout.vllm_engine.MegarlWorkerExtension",
        *spec.extra_args,
    ]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"vLLM server for {url} exited with code {proc.returncode}; last log lines "
                             f"({log}):\n{_tail(log)}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise FleetError(f"vLLM server {url} not healthy after {timeout_s:.0f}s (rollout.startup_timeout_s); "
                     f"last log lines ({log}):\n{_tail(log)}")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def launch(spec: FleetSpec) -> Fleet:
    """Start every replica and wait until all are healthy (stops the ones started on failure)."""
    from megarl.launch import free_port

    spec.log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false",
           **_cpu_env(spec.tp, spec.kv_cache_gib)}
    fleet = Fleet([], [], [])
    try:
        for i in range(spec.replicas):
            port = spec.port + i if spec.port else free_port()
            if not _port_free(port):
                raise FleetError(f"port {port} is already in use (another server?): set rollout.port=0 or free it")
            log = spec.log_dir / f"vllm_replica{i}.log"
            with log.open("w") as f:
                proc = subprocess.Popen(server_command(spec, port), stdout=f, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            fleet.urls.append(f"http://127.0.0.1:{port}")
            fleet.procs.append(proc)
            fleet.logs.append(log)
        for url, proc, log in zip(fleet.urls, fleet.procs, fleet.logs, strict=True):
            _wait_healthy(url, proc, log, spec.startup_timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


@contextmanager
def start_fleet(cfg, log_dir: Path):
    """The fleet of a run config (`megarl.config.schema.Config`), stopped on exit."""
    r = cfg.rollout
    fleet = launch(FleetSpec(model_dir=Path(cfg.model.hf_dir), tp=r.tp, replicas=r.replicas, port=r.port,
                             kv_cache_gib=r.kv_cache_gib, startup_timeout_s=r.startup_timeout_s,
                             log_dir=Path(log_dir)))
    try:
        yield fleet
    finally:
        fleet.stop()
