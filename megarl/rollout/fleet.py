"""Start and stop the rollout fleet: one vLLM OpenAI-compatible server per replica.

Each server loads the HF checkpoint with tensor parallel `rollout.tp`, exposes the token-in /
token-out route (`/inference/v1/generate`, `--enable-scale-out`), the RL weight-update routes and
`/collective_rpc` (`VLLM_SERVER_DEV_MODE=1`), and uses megarl's partitioned weight-transfer
backend. The device-specific settings are chosen by `on_gpu`: on CPU each replica's own cores for its TP ranks
(`replica_env`, by the rule of `megarl.rollout.cpu_binding`) and the KV-cache size (`server_env`), on GPUs
`--gpu-memory-utilization` (`_gpu_args`). Logs go to
`<log_dir>/vllm_replica<i>.log`.

Every server is guarded (`megarl.rollout.fleet_auth`): all routes but `/health` need the job's secret, read
from the file in `MEGARL_FLEET_SECRET_FILE`. `FleetSpec.secret_file=None` makes a fresh secret in a private
temporary directory (mode 0700, file 0600) that `FleetHandle.stop()` deletes; name a file on a shared
filesystem instead when the trainer runs on other nodes.

This module starts and stops processes only; `megarl.rollout.run_fleet.start_fleet` builds a run's fleet on it (the
registry of `megarl.rollout.rendezvous` and the restarts of `megarl.rollout.restarts`, which import this module, never
the reverse).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import requests

from megarl.parallel.spawn import free_port, port_free
from megarl.rollout.cpu_binding import threads_bind, usable_cpus
from megarl.rollout.engine_death import EngineDeathMiddleware
from megarl.rollout.engine_probe import EngineProbeMiddleware
from megarl.rollout.fleet_auth import SECRET_ENV, FleetAuthMiddleware, bearer_header, new_fleet_secret, read_secret
from megarl.rollout.held_served import HeldRequestsMiddleware
from megarl.sync.vllm_plugin import BACKEND_NAME

if TYPE_CHECKING:
    from megarl.config.schema import Config


class Watcher(Protocol):
    """What a fleet stops before its servers: `megarl.rollout.restarts.ReplicaWatcher`."""

    def stop(self) -> None: ...


class FleetError(RuntimeError):
    """A server could not be started (dead, unhealthy in time, or its port taken)."""


@dataclass
class FleetSpec:
    """What to start: one vLLM server per replica for the HF checkpoint in `model_dir`."""

    model_dir: Path  # HF checkpoint directory (config.json + safetensors)
    tp: int = 1  # tensor-parallel size of every replica
    replicas: int = 1  # number of independent servers
    port: int = 0  # first replica's port (replica i gets port + i); 0 picks free ports
    host: str = "127.0.0.1"  # the address the servers listen on (and clients use): on a cluster, the job's interface
    first_replica: int = 0  # index of the first replica started here (logs: vllm_replica<index>.log)
    # CPU fleets: how many replicas share this machine's cores (`megarl.rollout.cpu_binding`: replica i gets the
    # cores of slot i mod node_replicas); 0: first_replica + replicas (every replica of the fleet runs here)
    node_replicas: int = 0
    dtype: str = "float32"  # vLLM --dtype
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU (ignored with a GPU)
    gpu_memory_utilization: float = 0.9  # vLLM --gpu-memory-utilization, GPU fleets only (vLLM's default)
    gpu: bool | None = None  # whether the servers run on GPUs; None: whether this machine has one
    startup_timeout_s: float = 600.0  # how long to wait for every /health
    log_dir: Path = Path(".")  # where vllm_replica<i>.log go
    # vLLM --max-model-len (fleet_spec: prompt budget + response budget, `Config.max_model_len`); None: the model's
    # max_position_embeddings
    max_model_len: int | None = None
    # vLLM --enforce-eager (no torch.compile, no CUDA graphs); None: eager on CPU, CUDA graphs on GPUs (`eager`)
    enforce_eager: bool | None = None
    # vLLM --max-num-seqs: the sequences a replica runs at once (`Config.sequence_slots`, rollout.refill=sequences);
    # None: vLLM's default
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)  # appended to the server command line
    # return every token's routed experts (MoE, GPU: vLLM's V2 model runner with prefix caching)
    return_routed_experts: bool = False
    expert_parallel: bool = False  # vLLM --enable-expert-parallel: a MoE's experts split over the TP ranks, whole
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: vLLM's bound on one engine step over its TP workers, and the engine probe's
    # bound on the engine core's silence (`megarl.rollout.engine_probe`) (`rollout.step_timeout_s`; None: vLLM's
    # own default, 300)
    step_timeout_s: int | None = None
    # file holding the job's secret (mode 0600, e.g. from `fleet_auth.new_fleet_secret`); None: launch() makes
    # one in a private temporary directory, deleted when the fleet stops
    secret_file: Path | None = None


_LIVE: list[FleetHandle] = []  # handles not stopped yet: stopped at interpreter exit so no server outlives us


@dataclass
class FleetHandle:
    """The running servers of one fleet. `stop()` (or leaving the `with` block) kills each server's
    process group (API server, engine core and TP workers); it is idempotent."""

    urls: list[str]
    procs: list[subprocess.Popen]
    logs: list[Path]
    secret_file: Path  # the servers' secret, which clients send (`RolloutClient(secret_file=...)`)
    own_secret_dir: Path | None = None  # the temporary directory launch() made for the secret, removed by stop()
    # restarts dead replicas (`start_fleet(..., run_dir=...)`): it replaces a replica's entry in urls and procs by its
    # new server's (logs keep their paths: a restart appends), and stop() stops it before the servers
    watcher: Watcher | None = None

    @property
    def base_url(self) -> str:
        """URL of the first replica (the only one with `replicas=1`)."""
        if not self.urls:
            raise FleetError("this fleet has no servers")
        return self.urls[0]

    def __enter__(self) -> FleetHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the watcher first (no restart during shutdown), then SIGTERM every server's process group, SIGKILL
        what is still alive after `grace_s`."""
        if self.watcher is not None:
            self.watcher.stop()
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.time() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
            _signal_group(p, signal.SIGKILL)  # workers the server left behind in its group
        if self.own_secret_dir is not None:
            shutil.rmtree(self.own_secret_dir, ignore_errors=True)
        if self in _LIVE:
            _LIVE.remove(self)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal the process group `proc` leads (it was started with a new session); gone groups are fine."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@atexit.register
def _stop_live_fleets() -> None:
    for handle in list(_LIVE):
        handle.stop(grace_s=10.0)


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


def _stop_fleets_on_sigterm() -> None:
    """A SIGTERM (`kill`, `scancel`, a CI timeout) ends Python without running atexit, leaving the servers
    running. Make it an interrupt, as Ctrl-C is (pytest then stops its session and tears its fixtures down; the
    CLI unwinds), so `with` blocks and `_stop_live_fleets` stop them. Not where the program handles SIGTERM
    itself or off the main thread (where signal handlers cannot be set)."""
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


def on_gpu(spec: FleetSpec) -> bool:
    """Whether `spec`'s servers run on GPUs: `spec.gpu`, else whether this machine has one."""
    if spec.gpu is not None:
        return spec.gpu
    from megarl.parallel.device import cuda_present

    return cuda_present()


def _gpu_args(spec: FleetSpec) -> list[str]:
    """vLLM's flags for GPU fleets only: `--gpu-memory-utilization` (what is left of each GPU is the weight push's;
    `megarl.sync.receiver_memory`). Never on CPU: vLLM's CPU backend reads it as the share of the machine's RAM to
    reserve and refuses to start when that much is not free (`cpu_worker.py`); there VLLM_CPU_KVCACHE_SPACE sizes
    the cache."""
    return ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:g}"] if on_gpu(spec) else []


CPU_STEP_TOKENS = 2048  # vLLM's own default token budget of one engine step for a CPU API server, per TP rank


def _cpu_args(spec: FleetSpec) -> list[str]:
    """vLLM's flags for CPU fleets only: no chunked prefill, and a step's token budget that holds the longest
    sequence whole (`--max-num-batched-tokens`, at least vLLM's CPU default, 2,048 per TP rank). vLLM 0.32's model
    runner rewinds a seeded request's generator after a step that prefilled only part of it (`_bookkeeping_sync`:
    `gen.set_offset(...)`), which a CPU `torch.Generator` refuses ("CPU Generator does not use offset"): the worker
    raises and the engine dies. megarl seeds every request, and a prefill is split whenever a step's new tokens
    exceed the budget -- a batch of long prompts, or with `sync.inflight_kv=recompute` the re-prefill of every held
    request after a push. Whole prefills never take that path. Never on GPUs: CUDA generators keep offsets, and
    chunked prefill is what keeps decode going beside long prefills there."""
    if on_gpu(spec):
        return []
    context = spec.max_model_len
    if context is None:  # vLLM takes the model's own length
        try:
            context = int(json.loads((Path(spec.model_dir) / "config.json").read_text())["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):  # no readable config: vLLM refuses it, naming the problem
            context = None
    budget = max(CPU_STEP_TOKENS * spec.tp, context or 0)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]


def node_replicas(spec: FleetSpec) -> int:
    """How many replicas share this machine's cores: `spec.node_replicas`, else every replica up to this fleet's."""
    return spec.node_replicas or spec.first_replica + spec.replicas


def replica_env(spec: FleetSpec, replica: int) -> dict[str, str]:
    """What replica `replica`'s server adds to `server_env`: on CPU, the cores of its TP ranks, its own share of the
    cores this process may use (`megarl.rollout.cpu_binding`, slot `replica mod node_replicas(spec)`); nothing on
    GPUs."""
    if on_gpu(spec):
        return {}
    n = node_replicas(spec)
    return threads_bind(usable_cpus(), n, replica % n, spec.tp)


def server_env(spec: FleetSpec, secret_file: Path) -> dict[str, str]:
    """The environment of every replica's server: ours, plus vLLM's dev routes (weight updates), the secret's file,
    the CPU backend's KV-cache size (each replica's cores: `replica_env`), the V2 model runner when routed experts are
    returned (vLLM 0.32 captures them there only), and vLLM's bound on one engine step."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false",
           SECRET_ENV: str(secret_file), **({} if on_gpu(spec) else {"VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib)})}
    if spec.return_routed_experts:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if spec.step_timeout_s is not None:  # a worker stopped mid-step ends the engine this soon, a hung engine core
        # fails /health this soon (megarl.rollout.engine_probe)
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(spec.step_timeout_s)
    return env


def eager(spec: FleetSpec) -> bool:
    """Whether `spec`'s servers run eagerly: `spec.enforce_eager`, else on CPU only. On GPUs vLLM captures CUDA
    graphs (torch.compile's pieces and whole decode steps) at start-up; a weight push keeps them valid, since vLLM's
    layerwise reload writes into the captured tensors' storage (see `rollout.enforce_eager`)."""
    return spec.enforce_eager if spec.enforce_eager is not None else not on_gpu(spec)


def server_command(spec: FleetSpec, port: int) -> list[str]:
    """The command line of one replica: vLLM's OpenAI-compatible server with the token-in/token-out
    routes (`--enable-scale-out`), megarl's weight-transfer backend and its worker extension, the fleet's guard
    (`megarl.rollout.fleet_auth`), the middleware that makes the server exit when its engine dies
    (`megarl.rollout.engine_death`), the one that fails `/health` while its engine core hangs
    (`megarl.rollout.engine_probe`) and the one that counts, for a push's pause, the tokens of every request the API
    server holds, preempted ones included (`megarl.rollout.held_served`); eager or with CUDA graphs (`eager`), its
    context the run's longest sequence (`FleetSpec.max_model_len`); the device's own flags (`_gpu_args`,
    `_cpu_args`)."""
    length = ["--max-model-len", str(spec.max_model_len)] if spec.max_model_len else []
    slots = ["--max-num-seqs", str(spec.max_num_seqs)] if spec.max_num_seqs else []
    graphs = ["--enforce-eager"] if eager(spec) else []
    routes = ["--enable-return-routed-experts", "--enable-prefix-caching"] if spec.return_routed_experts else []
    experts = ["--enable-expert-parallel"] if spec.expert_parallel else []
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir), "--port", str(port), "--host", spec.host,
        "--tensor-parallel-size", str(spec.tp), "--dtype", spec.dtype, *graphs,
        "--enable-scale-out", "--seed", "0", *length, *slots, *routes, *experts, *_gpu_args(spec), *_cpu_args(spec),
        "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME}),
        "--worker-extension-cls", "megarl.sync.vllm_receiver.MegarlWorkerExtension",
        # the first is the innermost (vLLM adds each with Starlette's add_middleware, which puts it outside the
        # earlier ones): the held counts' middleware sits behind the fleet's guard
        "--middleware", f"{HeldRequestsMiddleware.__module__}.{HeldRequestsMiddleware.__name__}",
        "--middleware", f"{EngineProbeMiddleware.__module__}.{EngineProbeMiddleware.__name__}",
        "--middleware", f"{FleetAuthMiddleware.__module__}.{FleetAuthMiddleware.__name__}",
        "--middleware", f"{EngineDeathMiddleware.__module__}.{EngineDeathMiddleware.__name__}",
        *spec.extra_args,
    ]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float,
                  stopping: threading.Event | None = None) -> None:
    """Poll `/health` until it answers 200; raise with the log's tail if the server dies or times out (or at once,
    saying so, when `stopping` is set)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if stopping is not None and stopping.is_set():
            raise FleetError(f"vLLM server {url}: the fleet is stopping")
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


def _check_guarded(url: str, secret: str, log: Path) -> None:
    """The server refuses a request without the secret and serves one with it (the guard is loaded and working)."""
    try:
        without = requests.get(f"{url}/v1/models", timeout=30).status_code
        with_secret = requests.get(f"{url}/v1/models", headers=bearer_header(secret), timeout=30).status_code
    except requests.RequestException as err:
        raise FleetError(f"vLLM server {url} did not answer /v1/models: {err}") from None
    if (without, with_secret) != (401, 200):
        raise FleetError(f"vLLM server {url} is not guarded by the job's secret: /v1/models answered {without} "
                         f"without it and {with_secret} with it; last log lines ({log}):\n{_tail(log)}")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address in a URL


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def server_port(spec: FleetSpec, replica: int, check_free: bool = True) -> int:
    """The port replica `replica` listens on: `spec.port + replica` when `spec.port` pins them (refused if taken,
    with `check_free`), else a free one."""
    if not spec.port:
        return free_port(spec.host)
    port = spec.port + replica
    if check_free and not port_free(port, spec.host):
        raise FleetError(f"port {port} on {spec.host} is already in use (another server?): set rollout.port=0 "
                         "or free it")
    return port


def start_server(spec: FleetSpec, replica: int, env: dict[str, str], log: Path,
                 restart: bool = False) -> tuple[str, subprocess.Popen]:
    """Start replica `replica`'s server (not waiting for it) in its own session, its output to `log`, with `env` and
    the replica's own cores (`replica_env`); its URL and process. A `restart` appends to the log (the earlier
    incarnation's lines stay) and does not check a pinned port first: the dead server's connections may hold it in
    TIME_WAIT, which vLLM's own bind (SO_REUSEADDR) accepts."""
    port = server_port(spec, replica, check_free=not restart)
    with log.open("a" if restart else "w") as f:
        proc = subprocess.Popen(server_command(spec, port), stdout=f, stderr=subprocess.STDOUT,
                                env={**env, **replica_env(spec, replica)}, start_new_session=True)
    return f"http://{_url_host(spec.host)}:{port}", proc


def wait_ready(url: str, proc: subprocess.Popen, log: Path, secret: str, timeout_s: float,
               stopping: threading.Event | None = None) -> None:
    """Wait until the server at `url` is healthy and guarded by `secret`; `FleetError` with its log's tail if not
    (dead, unhealthy within `timeout_s`, unguarded) or if `stopping` is set meanwhile."""
    _wait_healthy(url, proc, log, timeout_s, stopping)
    _check_guarded(url, secret, log)


def launch(spec: FleetSpec, restart: bool = False) -> FleetHandle:
    """Start every replica and wait until all are healthy and guarded (stops the ones started on failure).
    `restart`: the replicas ran before in this run (a launcher restarts them): their logs are appended to."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    own_dir = None if spec.secret_file is not None else Path(tempfile.mkdtemp(prefix="megarl_fleet_"))
    secret_file = Path(spec.secret_file).resolve() if own_dir is None else new_fleet_secret(own_dir)
    fleet = FleetHandle([], [], [], secret_file, own_dir)
    _LIVE.append(fleet)
    _stop_fleets_on_sigterm()
    env = server_env(spec, secret_file)
    try:
        secret = read_secret(secret_file)  # fail here, not in every server, if the file is unusable
        for i in range(spec.first_replica, spec.first_replica + spec.replicas):
            log = spec.log_dir / f"vllm_replica{i}.log"
            url, proc = start_server(spec, i, env, log, restart=restart)
            fleet.urls.append(url)
            fleet.procs.append(proc)
            fleet.logs.append(log)
        for url, proc, log in zip(fleet.urls, fleet.procs, fleet.logs, strict=True):
            wait_ready(url, proc, log, secret, spec.startup_timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def fleet_spec(cfg: Config, **where: Any) -> FleetSpec:
    """The `FleetSpec` of a run config's `rollout` section (every replica, unless `where` says otherwise); `where`
    adds what the config does not know: log directory, host, secret file, which replicas start here, GPUs or not.
    Its --max-model-len is the run's longest sequence (`Config.max_model_len`); every replica of the config shares
    this machine's cores (`node_replicas`), unless `where` says how many do."""
    r = cfg.rollout
    spec = FleetSpec(model_dir=Path(cfg.model.hf_dir), tp=r.tp, replicas=r.replicas, port=r.port,
                     kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization,
                     startup_timeout_s=r.startup_timeout_s, dtype=r.dtype, max_model_len=cfg.max_model_len(),
                     enforce_eager=r.enforce_eager,
                     return_routed_experts=r.return_routed_experts, expert_parallel=r.expert_parallel,
                     step_timeout_s=r.step_timeout_s, node_replicas=r.replicas, max_num_seqs=cfg.sequence_slots())
    return replace(spec, **where)
