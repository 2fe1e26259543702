"""The roles of a job that a cluster launcher (`srun`, `torchrun`, nemo-run) starts, each its own command:

    megarl prepare --config RECIPE [overrides]          once, before the others: run directory, resolved config,
                                                        fresh fleet secret; prints the job's topology
    megarl serve --config RUN_DIR/config.yaml --replica I   one vLLM replica, until SIGTERM
    megarl rank  --config RUN_DIR/config.yaml           one trainer rank (place from torchrun's or srun's variables)

`prepare` prints CONFIG=<the resolved config> for the others. `megarl prepare --preflight` validates the same way
but touches no run: it makes `<run.dir>/preflight/` for a job whose steps check their placement instead
(`megarl.preflight`).

They meet in the run directory, which every node must share: the resolved config, the secret
(`<run.dir>/private/fleet_secret`, 0600 in a 0700 directory) and the replicas' registrations
(`megarl.rollout.rendezvous`). Each failure ends its command with exit code 1 and one line on stderr naming the
role, the cause and the log to read.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from megarl.config.load import ConfigError, save_config
from megarl.config.schema import Config
from megarl.rollout.fleet_auth import SECRET_ENV, new_fleet_secret, read_secret

PRIVATE_DIR = "private"  # holds the job's fleet secret; mode 0700
SYNC_PORT_ENV = "MEGARL_SYNC_PORT"  # the weight-sync store's port (default: the trainer's master port + 1)
BIND_ENV = "MEGARL_BIND_ADDR"  # the address a replica listens on (default: this node's address)


def job_secret_file(cfg: Config) -> Path:
    """The fleet secret of the job: `MEGARL_FLEET_SECRET_FILE` if set, else the one `prepare` wrote."""
    return Path(os.environ.get(SECRET_ENV) or Path(cfg.run.dir) / PRIVATE_DIR / "fleet_secret")


def log_dir(cfg: Config) -> Path:
    return Path(cfg.run.dir) / "logs"


def prepare_job(cfg: Config) -> dict[str, str]:
    """After `launch.prepare` made the run directory: a fresh secret for this job and no registrations from an
    earlier one. Returns the topology the job script needs (KEY=VALUE lines on stdout)."""
    from megarl.rollout.rendezvous import clear_fleet

    private = Path(cfg.run.dir) / PRIVATE_DIR
    shutil.rmtree(private, ignore_errors=True)
    private.mkdir(mode=0o700, parents=True)
    new_fleet_secret(private)
    clear_fleet(cfg.run.dir)
    log_dir(cfg).mkdir(exist_ok=True)
    return topology(cfg, Path(cfg.run.dir) / "config.yaml")


def topology(cfg: Config, config_file: Path) -> dict[str, str]:
    """The KEY=VALUE lines `prepare` prints; CONFIG names the resolved config the other steps must read;
    ROLLOUT_HOST_MB the host memory a replica's step needs on GPUs (`gpu_replica_host_mb`; absent where the plan
    cannot say), which the SLURM job compares with each replica step's --mem."""
    lines = {"RUN_DIR": str(Path(cfg.run.dir).resolve()), "TRAINER_WORLD_SIZE": str(cfg.trainer.world_size),
             "ROLLOUT_REPLICAS": str(cfg.rollout.replicas), "ROLLOUT_TP": str(cfg.rollout.tp),
             "ROLLOUT_RESTARTS": str(cfg.rollout.restarts)}
    host_mb = gpu_replica_host_mb(cfg)
    if host_mb is not None:
        lines["ROLLOUT_HOST_MB"] = str(host_mb)
    return lines | {"CONFIG": str(config_file.resolve())}


SERVED_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # rollout.dtype -> megarl.checks' names


def gpu_replica_host_mb(cfg: Config) -> int | None:
    """The least --mem (MB) of one replica's step on a GPU fleet: its vLLM ranks' host memory with the receive mode
    the run uses there (staged: each rank's shard pinned; megarl.checks.replica_host_mb). None when the model's layout
    is not in the sync's hand-written table (the preflight then measures the step instead)."""
    from megarl.checks import push_memory, receive_mode, replica_host_mb
    from megarl.models.hf_config import read_hf_config

    dtype = SERVED_DTYPE[cfg.rollout.dtype]
    try:
        hf = read_hf_config(cfg.model.hf_dir)
        mode, _ = receive_mode(cfg, hf, True, dtype)
        return replica_host_mb(push_memory(hf, cfg, dtype), mode, cfg.sync.delta)
    except (KeyError, ValueError, OSError):
        return None


def prepare_preflight(cfg: Config) -> dict[str, str]:
    """`prepare --preflight`, after the same validation: touches no run (no secret, registrations, config.yaml or
    refusal of a run directory that holds a run); a fresh `<run.dir>/preflight/` (an earlier preflight's reports
    removed) holding the resolved config that the `megarl preflight` steps read. Returns the topology lines."""
    from megarl.preflight.files import preflight_dir

    directory = preflight_dir(cfg.run.dir)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return topology(cfg, save_config(cfg, directory / "config.yaml"))


def _say(line: str) -> None:
    print(f"megarl: {line}", file=sys.stderr, flush=True)


def node_name() -> str:
    """This node's name as the launcher knows it (SLURM's node name, else the host name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def visible_gpus() -> str:
    """The GPUs the launcher gave this process, for its log line: "GPUs 4,5,6,7" (CUDA_VISIBLE_DEVICES, as SLURM
    sets it for each step), or "GPUs: not restricted" when nothing set it."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"GPUs {devices}" if devices else "GPUs: not restricted"


def node_address() -> str:
    """The address this node's replica listens on and announces: `MEGARL_BIND_ADDR`, else what the node's name
    resolves to. A loopback answer in a multi-node job is refused (the trainer could not reach it)."""
    if os.environ.get(BIND_ENV):
        return os.environ[BIND_ENV]
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError as err:
        raise ConfigError(f"this node's name {name!r} does not resolve ({err}): set {BIND_ENV} to the address "
                          "other nodes reach it at") from None
    if address.startswith("127.") and int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1:
        raise ConfigError(f"this node's name {name!r} resolves to the loopback address {address}, which the "
                          f"trainer nodes cannot reach: set {BIND_ENV} to this node's address on the job's network")
    return address


def serve_node_replicas() -> int:
    """How many replicas share the cores this `megarl serve` may use, on CPU nodes (`megarl.rollout.cpu_binding`):
    the job's replicas on this node (`MEGARL_NODE_REPLICAS`, which slurm/megarl_job.sh and launchers/megarl_nemo.py
    set), or 1 when the launcher confined the step to cores of its own. Its replica gets slot `replica mod` that many
    of them."""
    from megarl.rollout.cpu_binding import NODE_REPLICAS_ENV, node_replicas, usable_cpus

    try:
        return node_replicas(os.environ, usable_cpus(), os.cpu_count() or 1)
    except ValueError as err:
        raise ConfigError(f"{err}: set by the launcher (slurm/megarl_job.sh, launchers/megarl_nemo.py), or unset "
                          f"{NODE_REPLICAS_ENV} for one replica per node") from None


class _Stop(Exception):
    """SIGTERM or SIGINT: stop the server and leave."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def serve(cfg: Config, replica: int, host: str | None = None, restart: bool = False) -> int:
    """Run replica `replica` of the fleet until SIGTERM/SIGINT (exit 0) or until its server dies (exit 1): exits, or
    its `/health` fails for `rollout.health_timeout_s` (`megarl.rollout.liveness`), or the trainer condemned it (a
    push's call went unanswered past the push's bound while `/health` answered, `megarl.rollout.rendezvous.condemned`);
    its process group is killed.
    `restart`: the launcher starts it again in the same job: its vLLM log is appended to (after the line the launcher
    wrote there), not started afresh."""
    from megarl.rollout.fleet import FleetError, fleet_spec, launch
    from megarl.rollout.liveness import Liveness
    from megarl.rollout.rendezvous import clear_condemned, incarnation, register_replica, unregister_replica, why_dead

    if not 0 <= replica < cfg.rollout.replicas:
        raise ConfigError(f"--replica {replica}: the config has rollout.replicas={cfg.rollout.replicas} "
                          f"(replicas 0..{cfg.rollout.replicas - 1})")
    secret_file = job_secret_file(cfg)
    secret = read_secret(secret_file)
    spec = fleet_spec(cfg, replicas=1, first_replica=replica, host=host or node_address(), log_dir=log_dir(cfg),
                      secret_file=secret_file, node_replicas=serve_node_replicas())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    fleet, grace_s = None, 30.0
    try:
        fleet = launch(spec, restart=restart)
        register_replica(cfg.run.dir, replica, fleet.urls[0], secret)
        _say(f"rollout replica {replica} on {node_name()} serving at {fleet.urls[0]} ({visible_gpus()}; log "
             f"{fleet.logs[0]}; environment {sys.prefix})")
        liveness, me = Liveness(fleet.urls[0], cfg.rollout.health_timeout_s), incarnation(os.getpid())
        while (code := fleet.procs[0].poll()) is None:
            time.sleep(liveness.every_s)
            # its engine died, it hangs, or the trainer condemned it: the same end as an exit (the finally kills the
            # group, at once: a hung server would not heed SIGTERM)
            if (why := why_dead(cfg.run.dir, replica, secret, me, liveness)) is not None:
                _say(f"rollout replica {replica} ({fleet.urls[0]}) is dead: {why}; stopping its server "
                     f"(log {fleet.logs[0]})")
                clear_condemned(cfg.run.dir, replica, me, secret)
                grace_s = 0.0
                return 1
        _say(f"rollout replica {replica} ({fleet.urls[0]}) died: its vLLM server exited with code {code} "
             f"(log {fleet.logs[0]})")
        return 1
    except _Stop as stop:
        _say(f"rollout replica {replica}: {stop} received, stopping")
        return 0
    except FleetError as err:
        _say(f"rollout replica {replica} failed to start: {str(err).splitlines()[0]} "
             f"(log {log_dir(cfg) / f'vllm_replica{replica}.log'})")
        return 1
    finally:  # a second signal must not cut the clean-up short (the server runs in its own session)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        unregister_replica(cfg.run.dir, replica)
        if fleet is not None:
            fleet.stop(grace_s)


def rank(cfg: Config) -> int:
    """One trainer rank started by torchrun or srun; rank 0 waits for the fleet and writes the summary."""
    from megarl.launch import finish_run
    from megarl.parallel.launcher_env import LauncherEnvError, process_place
    from megarl.rank import error_log, run_rank
    from megarl.rollout.rendezvous import wait_for_fleet

    try:
        place = process_place()
    except LauncherEnvError as err:
        raise ConfigError(str(err)) from None
    if place is None:
        raise ConfigError("megarl rank runs under torchrun or srun (no RANK/WORLD_SIZE or SLURM_PROCID in the "
                          "environment); on one machine, `megarl train` starts every rank itself")
    if place.world_size != cfg.trainer.world_size:
        raise ConfigError(f"{place.launcher} started {place.world_size} ranks but trainer.world_size="
                          f"{cfg.trainer.world_size}: start exactly trainer.world_size ranks")
    sync_port = int(os.environ.get(SYNC_PORT_ENV) or place.master_port + 1)
    _say(f"trainer rank {place.rank}/{place.world_size} on {node_name()} ({place.launcher}, local rank "
         f"{place.local_rank}, {visible_gpus()}): master {place.master_addr}:{place.master_port}, weight-sync store "
         f"port {sync_port}; environment {sys.prefix}")
    secret_file = job_secret_file(cfg)
    os.environ[SECRET_ENV] = str(secret_file)  # the rollout clients send it

    def fleet_urls() -> list[str]:
        _say(f"trainer rank 0: waiting for {cfg.rollout.replicas} rollout replica(s) to register in "
             f"{Path(cfg.run.dir) / 'fleet'}")
        return wait_for_fleet(cfg.run.dir, cfg.rollout.replicas, read_secret(secret_file),
                              cfg.rollout.startup_timeout_s)

    try:
        run_rank(cfg, place, sync_port, fleet_urls)
    except Exception as err:  # one line; the traceback goes to a file
        log = error_log(log_dir(cfg), place.rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        _say(f"trainer rank {place.rank} on {node_name()} failed: {type(err).__name__}: {cause} "
             f"(traceback: {log})")
        return 1
    if place.rank == 0:
        from megarl.metrics.timeline import describe

        summary = finish_run(cfg)
        _say(f"done: reward {summary['reward/first_steps_mean']:.3f} -> {summary['reward/last_steps_mean']:.3f}; "
             f"pipeline: {describe(summary)}; outputs in {cfg.run.dir}")
    return 0
