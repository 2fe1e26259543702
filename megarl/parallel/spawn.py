"""Start a group of local processes and collect what each returns; free TCP ports for them to meet on.

    results = run_ranks(fn, nprocs, *args)     # fn(rank, *args) in each of nprocs spawned processes

Every group of processes megarl starts on one machine goes through `run_ranks`: the trainer ranks of
`megarl train` (`megarl.launch`), the ranks of `megarl export`, the benchmark's tensor-parallel groups and the
tests' distributed helpers. Each process calls `fn(rank, *args)`; `fn` and `args` must be picklable (`fn` a
module-level function). How the processes start (`start_method`): on a machine with a GPU, spawned (a fresh
interpreter: no CUDA or thread state inherited from the parent); without one, forked from a forkserver that has
imported torch, megatron-core and the ranks' other third-party modules once (`PRELOAD`), because a fresh interpreter
spends seconds of CPU importing them, per rank, per group (measured on the 2-core CI machine: 7-15 s for a group of
two ranks spawned, 0.06 s forked once the server runs). Either way a rank starts with the parent's current
environment variables, working directory and `sys.path`, not those of whoever started the forkserver. A rank's
return value is serialised with `torch.save` into bytes and sent through its own pipe, so tensors come back as
ordinary tensors (not views of shared memory that would die with the process).

The parent never hangs on a dead rank: it waits on the pipes and on the processes' exit sentinels together, so
a rank killed by a signal (the OOM killer's SIGKILL) or leaving through `os._exit` before reporting is a
failure like a rank that raised. On the first failure the other ranks are stopped (SIGTERM, then SIGKILL after
a short grace) and `RankError` is raised: its message is one line naming the rank and the cause, and the
rank's whole traceback is written to a file of `log_dir` (or attached to the exception as a note).
"""

from __future__ import annotations

import io
import os
import random
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Self

# imported once by the forkserver (CPU machines), so its forked ranks start with them loaded: torch, megatron-core and
# the other third-party modules every trainer rank imports (transformers for the tokenizer, megatron's DDP and
# optimizer for training). Third-party only, but for the first entry, which silences megatron's import-time notes
# on CPU (megarl.parallel.forkserver_preload): megarl itself is imported by each rank (1.5 s of CPU).
# Measured per rank of a 2-rank group: its imports of megarl's trainer modules took 3.6 s of CPU with torch and
# megatron-core preloaded, 1.5 s with all of these. Not pyarrow: importing it starts a thread, and the server forks.
PRELOAD = (
    "megarl.parallel.forkserver_preload", "torch", "megatron.core", "transformers", "megatron.core.distributed",
    "megatron.core.optimizer",
)
STOP_GRACE_S = 5.0  # after SIGTERM, how long a rank may take to exit before SIGKILL
EXIT_GRACE_S = 60.0  # after reporting its result, how long a rank may take to exit before it is stopped


# ---- ports ---------------------------------------------------------------------------------------------------------
def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (it has a colon), AF_INET otherwise."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


LISTEN_PORT_FLOOR = 10000  # free_ports picks from [floor, the kernel's first ephemeral port)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now, for servers started later (stores, vLLM) to listen on.

    Taken below the kernel's ephemeral range when it leaves room: a port the kernel hands out as the local end of
    an outgoing connection (every HTTP request, every gloo pair) between our pick and the server's bind would make
    the bind fail, and on a busy machine that happens. The sockets are held open together, so the ports are
    distinct; they are free now, not reserved."""
    low, _ = _ephemeral_range()
    candidates = list(range(LISTEN_PORT_FLOOR, low)) if low - LISTEN_PORT_FLOOR >= 1000 else []
    random.SystemRandom().shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            sock = socket.socket(address_family(host), socket.SOCK_STREAM)
            try:
                sock.bind((host, candidates.pop() if candidates else 0))
            except OSError:  # taken: try the next one
                sock.close()
                continue
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    return free_ports(1, host)[0]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `port` can be bound on `host` right now."""
    with socket.socket(address_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---- failures ------------------------------------------------------------------------------------------------------
def _who(role: str, rank: int) -> str:
    """How messages name a rank: "trainer rank 1"; the default role gives plain "rank 1"."""
    return f"rank {rank}" if role in ("", "rank") else f"{role} rank {rank}"


def error_log(log_dir: Path | str, rank: int, role: str = "rank") -> Path:
    """The file a failed rank's whole traceback goes to: `<log_dir>/<role>_rank<k>_error.log`, spaces in `role`
    replaced by underscores (the default role: `<log_dir>/rank<k>_error.log`)."""
    prefix = "" if role in ("", "rank") else role.replace(" ", "_") + "_"
    return Path(log_dir) / f"{prefix}rank{rank}_error.log"


class RankError(RuntimeError):
    """A rank of `run_ranks` raised or died. `str(err)` is one line, "<role> rank <k> failed: <cause>" (the
    default role: "rank <k> failed: ..."), then, in parentheses, the file holding the traceback and the caller's
    hint: "trainer rank 0 failed: ValueError: bad value (traceback: run/trainer_rank0_error.log; fleet logs: ...)".
    The cause is "<ExceptionType>: <first line of its message>", "killed by SIGKILL" or "exited with code N".

    rank            the rank that failed first
    exc_type        the name of the exception it raised (e.g. "ValueError"); None if it died without reporting
    message         that exception's whole message, or how the process died ("killed by SIGKILL")
    traceback_text  the rank's formatted traceback ("" if it died without reporting)
    log             the file the traceback was written to (None without `log_dir`)
    """

    def __init__(self, line: str, *, rank: int, exc_type: str | None, message: str, traceback_text: str,
                 log: Path | None) -> None:
        super().__init__(line)
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.traceback_text, self.log = traceback_text, log

    @classmethod
    def from_rank_error(cls, err: RankError) -> Self:
        """The same failure as this class (a subclass naming what failed, e.g. `megarl.launch.TrainerError`)."""
        new = cls(str(err), rank=err.rank, exc_type=err.exc_type, message=err.message,
                  traceback_text=err.traceback_text, log=err.log)
        for note in getattr(err, "__notes__", []):
            new.add_note(note)
        return new


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _rank_error(rank: int, report: tuple | None, exitcode: int | None, role: str, log_dir: Path | None,
                hint: str) -> RankError:
    """The error for `rank`: its report (exception type, message, traceback), or how its process ended."""
    if report is not None:
        _, _, exc_type, message, text = report
        first = message.strip().splitlines()[0] if message.strip() else ""
        cause = f"{exc_type}: {first}" if first else exc_type
    else:
        exc_type, text = None, ""
        if exitcode is not None and exitcode < 0:
            message = f"killed by {_signal_name(-exitcode)}"
        else:
            message = f"exited with code {exitcode}"
        cause = message
    log = None
    if log_dir is not None:
        log = error_log(log_dir, rank, role)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text if text else f"{_who(role, rank)} {message} without reporting (no traceback)\n")
    details = ([f"traceback: {log}"] if log is not None else []) + ([hint] if hint else [])
    line = f"{_who(role, rank)} failed: {cause}" + (f" ({'; '.join(details)})" if details else "")
    err = RankError(line, rank=rank, exc_type=exc_type, message=message, traceback_text=text, log=log)
    if log is None and text:
        err.add_note(f"traceback of {_who(role, rank)}:\n{text.rstrip()}")
    return err


# ---- running -------------------------------------------------------------------------------------------------------
def start_method() -> str:
    """'spawn' where a GPU is present (CUDA must not be initialised in a process that forks, and whether some
    import does so is not ours to promise), else 'forkserver' with `PRELOAD` imported in the server."""
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def prestart() -> None:
    """Start the forkserver now (CPU machines; nothing where ranks are spawned), so that its imports (`PRELOAD`,
    seconds of CPU) run while the caller waits for something else, e.g. `megarl train` for its fleet to come up;
    `run_ranks` later finds it running. Safe because a rank takes the parent's environment of `run_ranks` time
    (`_entry`), not the server's."""
    if start_method() != "forkserver":
        return
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()  # returns at once; the server imports PRELOAD in the background


def _entry(rank: int, conn: Connection, call: bytes, env: dict[str, str]) -> None:
    """Inside a started process: take the parent's environment as it was at `run_ranks` (a forkserver's child
    would otherwise inherit the server's), load `(fn, args)` from `call`, run fn(rank, *args) and send
    ("ok", bytes) or ("error", ...) to the parent."""
    os.environ.clear()
    os.environ.update(env)
    import torch

    try:
        fn, args = torch.load(io.BytesIO(call), weights_only=False)
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        report: tuple = ("ok", buffer.getvalue())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - an exception whose str() fails still has a type and a traceback
            message = f"<unprintable {type(exc).__name__}>"
        report = ("error", time.time(), type(exc).__name__, message, traceback.format_exc())
    try:
        conn.send(report)
    finally:
        conn.close()


def _stop(procs: list[Any]) -> None:
    """SIGTERM every live process, SIGKILL the ones still there after `STOP_GRACE_S`, reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, role: str = "rank", log_dir: Path | None = None,
              hint: str = "") -> list[Any]:
    """Call `fn(rank, *args)` in `nprocs` spawned processes, rank = 0 .. nprocs-1, and return their return values
    in rank order. The first rank to raise or die stops the others and raises `RankError` (see the module
    docstring): `role` names the processes in its message ("trainer" -> "trainer rank 1 failed: ..."), the
    traceback goes to `error_log(log_dir, rank, role)` when `log_dir` is given (otherwise it is a note on the
    error), and `hint` ends the message (e.g. where other logs are)."""
    import torch
    import torch.multiprocessing as mp

    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (once per parent)
    env = dict(os.environ)
    # (fn, args) as bytes, as the results come back: tensors among the args are copied, not passed as shared-memory
    # file descriptors (a forkserver takes at most 252 descriptors per process, and many tensors exceed that)
    buffer = io.BytesIO()
    torch.save((fn, args), buffer)
    call = buffer.getvalue()  # one copy, shared by every rank's Process object
    procs, readers = [], []
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_entry, args=(rank, writer, call, env), name=f"{role}-rank{rank}")
            proc.start()
            writer.close()  # the child holds the only writer: its exit is EOF here
            procs.append(proc)
            readers.append(reader)
        results: dict[int, Any] = {}
        while len(results) < nprocs:
            pending = [r for r in range(nprocs) if r not in results]
            wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending])
            failures: list[tuple[float, int, tuple | None]] = []  # (when, rank, report); deaths sort last
            for r in pending:
                exited = procs[r].exitcode is not None  # looked at first: all it sent is in the pipe by now
                if readers[r].poll():
                    try:
                        report = readers[r].recv()
                    except (EOFError, OSError):  # closed without a report: the process died
                        procs[r].join(STOP_GRACE_S)
                        failures.append((float("inf"), r, None))
                        continue
                    if report[0] == "ok":
                        results[r] = torch.load(io.BytesIO(report[1]), weights_only=False)
                    else:
                        failures.append((report[1], r, report))
                elif exited:  # nothing sent, and no EOF either (a child of the rank holds the pipe's writer)
                    failures.append((float("inf"), r, None))
            if failures:
                _, rank, report = min(failures, key=lambda f: (f[0], f[1]))
                _stop(procs)
                raise _rank_error(rank, report, procs[rank].exitcode, role, log_dir, hint)
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in procs:  # every rank reported; a rank that does not exit (a stuck thread) is stopped
            p.join(max(0.0, deadline - time.monotonic()))
        return [results[r] for r in range(nprocs)]
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
