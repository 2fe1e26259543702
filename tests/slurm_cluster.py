"""A real SLURM cluster of eight emulated GPU nodes on this machine, as a session fixture (`slurm_cluster`).

Debian's slurm-wlm 22.05 and munge (installed by `make test` / `make test-all`, target `slurm-deps`): in a private
temporary directory the fixture creates a munge key, starts `munged` on its own socket, writes a `slurm.conf` for
`node[1-8]` (all on 127.0.0.1, each slurmd on its own free port), starts `slurmctld` and one `slurmd -N nodeK` per
node, and waits until `sinfo` shows every node idle. Nothing outside the directory is touched and
`os.environ` is left alone: pass `cluster.env` (SLURM_CONF, no inherited SLURM_* variables) to every subprocess.

    def test_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
        result = slurm_cluster.sbatch_wait(script, "--nodes=2", env_extra={"OUT": str(tmp_path)})
        assert result.returncode == 0, slurm_cluster.describe(result)

Where it behaves like a GPU cluster: eight nodes (as many as `slurm/guru_moe.sh` asks for), each with 32 CPUs,
64,000 MB and 8 GPUs, all three consumable (`select/cons_tres`, `CR_Core_Memory`); the GPUs are GRES with device
entries (character devices with NVIDIA's major number, made with mknod: the suite runs as root), so each step gets
its own GPUs in `CUDA_VISIBLE_DEVICES` / `SLURM_STEP_GPUS` and a step that holds a node's GPUs or memory keeps the
next one waiting ("Requested nodes are busy"), exactly as on a GPU node.
Where it does not (docs/cluster.md lists these too): every "node" has the same hostname and network namespace (use
`SLURMD_NODENAME` / `SLURM_JOB_NODELIST` to tell them apart, and distinct ports per role); no driver is behind the
GPU devices and nothing is bound to them (no cgroups: `task/none`, CPUs and memory are bookkeeping, never enforced).
The partition oversubscribes (`OverSubscribe=FORCE:4`): up to four jobs may share a core, so a job can start while
a cancelled one is still completing; steps inside one job still need `srun --overlap` to share that job's CPUs, as
on a real cluster.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megarl.parallel.spawn import free_ports

NODES = tuple(f"node{i}" for i in range(1, 9))  # as many as the largest shipped script asks for (guru_moe.sh: 8)
CPUS_PER_NODE = 32  # bookkeeping (task/none binds nothing): room for 8 trainer ranks or 2 replicas per node
GPUS_PER_NODE = 8  # GRES with one device entry each: SLURM hands every step its own (CUDA_VISIBLE_DEVICES)
MEMORY_MB_PER_NODE = 64000  # a consumable resource, as on clusters that schedule memory
APT_PACKAGES = "slurmctld slurmd slurm-client munge"
_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
_DAEMON_NAMES = ("munged", "slurmctld", "slurmd", "slurmstepd")
_LOG_TAIL_LINES = 40


def _which(name: str) -> str | None:
    """The path of a SLURM/munge program; the daemons live in /usr/sbin, which a non-root PATH may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"  ({exc.strerror})"
    return "\n".join("  " + line for line in text[-lines:]) or "  (empty)"


def _clean_env() -> dict[str, str]:
    """os.environ without SLURM's own job/client variables (pytest may itself run inside a SLURM job)."""
    prefixes = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_")
    return {key: value for key, value in os.environ.items() if not key.startswith(prefixes)}


@dataclass
class SlurmCluster:
    """A running emulated cluster: its directory, daemons, and helpers that run SLURM commands against it."""

    root: Path  # private temp dir: conf, munge key and socket, state, spool, logs, job outputs
    env: dict[str, str]  # environment for subprocesses: SLURM_CONF set, inherited SLURM_* removed
    nodes: tuple[str, ...] = NODES
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # daemon name -> handle

    @property
    def conf_dir(self) -> Path:
        return self.root / "etc"

    @property
    def conf_file(self) -> Path:
        return self.conf_dir / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def jobs_dir(self) -> Path:
        """Default working directory of `sbatch_wait`: jobs without `--output` write `slurm-<jobid>.out` here."""
        return self.root / "jobs"

    # -- running commands -------------------------------------------------------------------------------------

    def run(self, *cmd: str, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command (`squeue`, `scontrol`, ...) against this cluster."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=self.jobs_dir)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\n"
                                 f"stderr: {proc.stderr}\n{self.log_tails()}")
        return proc

    def sbatch_wait(self, script_path: str | os.PathLike[str], *args: str, env_extra: Mapping[str, str] | None = None,
                    timeout_s: float = 60, cwd: str | os.PathLike[str] | None = None,
                    ) -> subprocess.CompletedProcess[str]:
        """`sbatch --wait [args] script`: returns when the job has ended, with the job's exit code as returncode.

        `args` are sbatch options (they override the script's `#SBATCH` lines); `env_extra` is added to the
        submitting environment, which the job inherits (sbatch's default `--export=ALL`). `cwd` (default
        `jobs_dir`) is the job's submit and working directory. On timeout the cluster's jobs are cancelled and an
        AssertionError with the queue and the daemons' log tails is raised.
        """
        env = {**self.env, **(env_extra or {})}
        cmd = ["sbatch", "--wait", *args, str(script_path)]
        try:
            return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                                  cwd=cwd if cwd is not None else self.jobs_dir)
        except subprocess.TimeoutExpired:
            queue = self.run("squeue", "-o", "%i %j %T %r %N", check=False).stdout
            self.run("scancel", "--user", _user_name(), check=False)
            raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout_s}s; jobs cancelled. squeue:\n"
                                 f"{queue}\n{self.log_tails()}") from None

    @staticmethod
    def job_id(result: subprocess.CompletedProcess[str]) -> int:
        """The job id from sbatch's `Submitted batch job N`."""
        match = re.search(r"Submitted batch job (\d+)", result.stdout)
        if match is None:
            raise AssertionError(f"no job id in sbatch output: stdout={result.stdout!r} stderr={result.stderr!r}")
        return int(match.group(1))

    def job_output(self, result: subprocess.CompletedProcess[str], cwd: str | os.PathLike[str] | None = None) -> str:
        """The default output file(s) `slurm-<jobid>*.out` of a job submitted by `sbatch_wait` (empty if none)."""
        match = re.search(r"Submitted batch job (\d+)", result.stdout)
        if match is None:
            return ""
        directory = Path(cwd) if cwd is not None else self.jobs_dir
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')}"
                         for path in sorted(directory.glob(f"slurm-{match.group(1)}*.out")))

    def describe(self, result: subprocess.CompletedProcess[str]) -> str:
        """Everything worth seeing when a job did not do what a test expected: sbatch's output, the job's, logs."""
        return (f"sbatch exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}\n"
                f"job output:\n{self.job_output(result) or '  (none)'}\n{self.log_tails()}")

    # -- state ------------------------------------------------------------------------------------------------

    def node_states(self) -> dict[str, str]:
        """`{node: state}` as sinfo reports it (`idle`, `mixed`, `allocated`, `down*`, ...)."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def jobs(self) -> list[str]:
        """`jobid state` of every job slurmctld still knows about that has not finished."""
        out = self.run("squeue", "--noheader", "--format=%i %T", check=False).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Wait until no job is queued or running and every node is idle; AssertionError with logs otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_daemons()
            jobs, states = self.jobs(), self.node_states()
            if not jobs and sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not idle after {timeout_s}s: jobs={jobs} nodes={states}\n"
                                     f"{self.log_tails()}")
            time.sleep(0.25)

    def check_daemons(self) -> None:
        """AssertionError naming any daemon of this cluster that has exited."""
        dead = {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}
        if dead:
            raise AssertionError(f"SLURM test cluster: daemons exited: {dead}\n{self.log_tails()}")

    def log_tails(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of every daemon log (and of their stderr), for error messages."""
        paths = sorted(self.log_dir.glob("*")) if self.log_dir.is_dir() else []
        return "\n".join(f"== {path.name} (last {lines} lines)\n{_tail(path, lines)}"
                         for path in paths if path.is_file() and path.stat().st_size)

    # -- start and stop ---------------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: Sequence[str]) -> None:
        """Start a daemon in the foreground (we keep the handle), output to log/<name>.stderr."""
        with open(self.log_dir / f"{name}.stderr", "wb") as err:
            self.procs[name] = subprocess.Popen(list(cmd), env=self.env, stdin=subprocess.DEVNULL, stdout=err,
                                                stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)

    def _wait_for(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self.check_daemons()
            if time.monotonic() > deadline:
                raise AssertionError(f"SLURM test cluster: {what} not ready after {timeout_s}s\n{self.log_tails()}")
            time.sleep(0.1)

    def start(self, timeout_s: float = 60) -> None:
        for sub in ("etc", "munge", "state", "spool", "log", "run", "jobs"):
            (self.root / sub).mkdir(exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        (self.root / "munge").chmod(0o755)  # munged refuses a socket directory writable by others
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey") or "mungekey", "--create", f"--keyfile={key}"], check=True,
                       capture_output=True)
        key.chmod(0o600)
        socket_path = self.root / "munge" / "munge.socket.2"
        self._spawn("munged", [_which("munged") or "munged", "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
                               f"--log-file={self.log_dir / 'munged.log'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait_for("munged socket", socket_path.exists, timeout_s)

        self.conf_file.write_text(_slurm_conf(self.root, socket_path, self.nodes))
        _make_gpu_devices(self.root / "dev")
        (self.conf_dir / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={self.root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf_file)])
        self._wait_for("slurmctld (scontrol ping)",
                       lambda: "UP" in self.run("scontrol", "ping", check=False, timeout_s=10).stdout, timeout_s)
        for node in self.nodes:
            self._spawn(f"slurmd.{node}", [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(self.conf_file)])
        self._wait_for("nodes idle (sinfo)",
                       lambda: sorted(self.node_states().items()) == [(node, "idle") for node in sorted(self.nodes)],
                       timeout_s)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons: the slurmds, then slurmctld and munged (SIGTERM, SIGKILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", _user_name(), check=False, timeout_s=10)
            deadline = time.monotonic() + 15
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.25)
        self._terminate([name for name in self.procs if name.startswith("slurmd.")])
        self._terminate([name for name in ("slurmctld",) if name in self.procs])
        self._terminate([name for name in ("munged",) if name in self.procs])

    def _terminate(self, names: Sequence[str], grace_s: float = 10) -> None:
        """SIGTERM the named daemons together, then SIGKILL any still running after `grace_s`; reap them all."""
        running = [self.procs[name] for name in names if self.procs[name].poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def survivors(self) -> list[str]:
        """`pid comm` of processes of this cluster still alive, from /proc: our daemons, and any munged/slurm*
        process whose command line, working directory or environment refers to this cluster's directory."""
        ours = {proc.pid for proc in self.procs.values()}
        marker = str(self.root).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
                if state == "Z":
                    continue
                if not comm.startswith(_DAEMON_NAMES):
                    continue
                if int(entry.name) in ours:
                    found.append(f"{entry.name} {comm}")
                else:
                    cwd = os.readlink(entry / "cwd").encode()
                    if (marker in (entry / "cmdline").read_bytes() or cwd.startswith(marker)
                            or marker in (entry / "environ").read_bytes()):
                        found.append(f"{entry.name} {comm}")
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked, or not ours to read
        return found


def _slurm_conf(root: Path, munge_socket: Path, nodes: Sequence[str]) -> str:
    """slurm.conf for `nodes` emulated on 127.0.0.1, every path under `root`, every port free right now."""
    ctld_port, *node_ports = free_ports(1 + len(nodes))
    user = _user_name()
    host = socket.gethostname().split(".")[0]
    node_lines = "\n".join(
        f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
        f"Gres=gpu:{GPUS_PER_NODE} RealMemory={MEMORY_MB_PER_NODE} State=UNKNOWN"
        for node, port in zip(nodes, node_ports, strict=True))
    return f"""\
# Written by tests/slurm_cluster.py: an emulated {len(nodes)}-node cluster on this machine.
ClusterName=megarl-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# The nodes share this machine: trust the CPU and memory counts below, track processes by parent pid, bind nothing.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Cores, memory and GPUs are consumable, as on a GPU cluster: a step that asks for (or inherits) a whole node's
# memory or GPUs keeps the next step on that node waiting.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
# GPUs with device entries (gres.conf, character devices with NVIDIA's numbers and no driver behind them): each
# step gets its own set in CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS, as on a GPU node.
GresTypes=gpu
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# Prompt scheduling: heterogeneous jobs are started by the backfill scheduler only; sbatch --wait polls every 2 s
# while MinJobAge/2 <= 2 (it backs off otherwise); cancelled steps are killed 2 s after SIGTERM.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MinJobAge=5
KillWait=2
InactiveLimit=0
ReturnToService=2
SlurmdTimeout=60
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _make_gpu_devices(directory: Path) -> None:
    """Character devices with NVIDIA's numbers (major 195, minor = GPU index) for gres.conf's `File=`: slurmd
    then treats them as GPUs and gives each step its own set (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS), as on a GPU
    node. Nothing opens them: there is no driver behind them. mknod needs root (CAP_MKNOD), as `make test` has."""
    directory.mkdir(exist_ok=True)
    for index in range(GPUS_PER_NODE):
        path = directory / f"nvidia{index}"
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, index))
        except PermissionError:
            pytest.fail(f"SLURM test cluster: cannot create the emulated GPU device {path} (mknod needs root or "
                        "CAP_MKNOD): run the suite as root, as `make test` in CI does", pytrace=False)


def _user_name() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def _missing_binaries() -> list[str]:
    return [name for name in _BINARIES if _which(name) is None]


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real SLURM cluster (slurmctld + 3 slurmd + munged) for the whole session; see the module docstring."""
    missing = _missing_binaries()
    if missing:
        pytest.fail(f"SLURM is not installed (missing: {', '.join(missing)}). Run `make test` (its `slurm-deps` step "
                    f"installs it) or `apt-get install -y --no-install-recommends {APT_PACKAGES}`.", pytrace=False)
    root = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))  # short path: unix socket paths are limited to 108 bytes
    root.chmod(0o755)
    env = _clean_env()
    env["SLURM_CONF"] = str(root / "etc" / "slurm.conf")
    env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"
    cluster = SlurmCluster(root=root, env=env)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        deadline = time.monotonic() + 10
        while cluster.survivors() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = cluster.survivors()
        logs = cluster.log_tails() if survivors else ""
        if not survivors:
            shutil.rmtree(root, ignore_errors=True)
    assert not survivors, f"SLURM test cluster processes outlived teardown: {survivors} (kept {root})\n{logs}"
