"""`megarl.parallel.spawn`: real spawned processes return their results in rank order, and a rank that raises
or is killed fails the call at once, as one line naming the rank and the cause, with the other ranks stopped."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from megarl.parallel.spawn import (
    RankError,
    error_log,
    free_port,
    free_ports,
    port_free,
    run_ranks,
    start_method,
)


# the ranks' functions: module level, so the spawned processes can import them
def _square_with_tensor(rank: int, base: int) -> tuple[int, int, torch.Tensor]:
    return rank, base + rank * rank, torch.full((3,), float(rank))


def _sum_of(rank: int, tensors: list[torch.Tensor]) -> float:
    return float(sum(t.sum() for t in tensors)) + rank


def _rank1_raises(rank: int) -> int:
    if rank == 1:
        raise ValueError("bad value in rank one\nsecond line of the message")
    return rank


def _kill_rank0_sleep_rank1(rank: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        while not os.path.exists(os.path.join(pid_dir, "rank1.pid")):  # until rank 1 is asleep too
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _exit_without_reporting(rank: int) -> None:
    os._exit(3)


def _what_the_rank_sees(rank: int) -> tuple[str | None, str, bool, int]:
    import sys

    return os.environ.get("MEGARL_SPAWN_PROBE"), os.getcwd(), "megatron.core" in sys.modules, os.getppid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_come_back_in_rank_order_tensors_included():
    results = run_ranks(_square_with_tensor, 3, 10)
    assert [r[:2] for r in results] == [(0, 10), (1, 11), (2, 14)]
    for rank, (_, _, tensor) in enumerate(results):
        assert torch.equal(tensor, torch.full((3,), float(rank)))  # outlives the process that made it


def test_ranks_start_with_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """Whatever the start method, a rank sees the environment and working directory of the caller at the call,
    also when they changed after an earlier call started the processes' server; on this CPU machine the ranks are
    forked from a server that already imported megatron-core (this test module does not import it)."""
    method = start_method()
    assert method == ("spawn" if torch.cuda.is_available() else "forkserver")
    monkeypatch.setenv("MEGARL_SPAWN_PROBE", "first")
    first = run_ranks(_what_the_rank_sees, 2)
    monkeypatch.setenv("MEGARL_SPAWN_PROBE", "second")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    second = run_ranks(_what_the_rank_sees, 2)
    monkeypatch.delenv("MEGARL_SPAWN_PROBE")
    third = run_ranks(_what_the_rank_sees, 1)
    assert [r[0] for r in first] == ["first"] * 2 and [r[0] for r in second] == ["second"] * 2
    assert third[0][0] is None
    assert [r[1] for r in second] == [str(tmp_path / "here")] * 2
    assert all(r[2] == (method == "forkserver") for r in first + second + third)
    if method == "forkserver":  # all forked by the same server, not by this process
        assert len({r[3] for r in first + second + third}) == 1 and first[0][3] != os.getpid()


def test_many_tensor_arguments_reach_every_rank():
    """300 tensors as arguments (more than the 252 file descriptors a forkserver passes to one process, had they
    gone as shared memory): every rank gets them all."""
    tensors = [torch.full((4,), float(i)) for i in range(300)]
    assert run_ranks(_sum_of, 2, tensors) == [4 * sum(range(300)) + r for r in range(2)]


def test_a_rank_that_raises_is_one_line_with_its_traceback_in_a_file(tmp_path):
    with pytest.raises(RankError) as caught:
        run_ranks(_rank1_raises, 2, role="unit test", log_dir=tmp_path, hint="see the docs")
    err = caught.value
    log = tmp_path / "unit_test_rank1_error.log"
    assert str(err) == f"unit test rank 1 failed: ValueError: bad value in rank one (traceback: {log}; see the docs)"
    assert (err.rank, err.exc_type, err.log) == (1, "ValueError", log)
    assert err.message == "bad value in rank one\nsecond line of the message"
    text = log.read_text()
    assert text == err.traceback_text
    assert "Traceback (most recent call last)" in text and "_rank1_raises" in text and "second line" in text
    assert error_log(tmp_path, 1, "unit test") == log


def test_without_log_dir_the_traceback_is_a_note():
    with pytest.raises(RankError) as caught:
        run_ranks(_rank1_raises, 2)
    assert str(caught.value) == "rank 1 failed: ValueError: bad value in rank one"
    assert caught.value.log is None
    assert "Traceback (most recent call last)" in "\n".join(caught.value.__notes__)


def test_a_killed_rank_fails_at_once_and_the_others_are_stopped(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        run_ranks(_kill_rank0_sleep_rank1, 2, str(tmp_path), role="trainer", log_dir=tmp_path)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # rank 1 sleeps 60 s: nobody waited for it
    log = tmp_path / "trainer_rank0_error.log"
    assert str(caught.value) == f"trainer rank 0 failed: killed by SIGKILL (traceback: {log})"
    assert (caught.value.rank, caught.value.exc_type, caught.value.message) == (0, None, "killed by SIGKILL")
    assert "killed by SIGKILL" in log.read_text()
    sleeper = int((tmp_path / "rank1.pid").read_text())
    assert not _alive(sleeper)


def test_a_rank_leaving_without_a_report_is_a_failure():
    with pytest.raises(RankError) as caught:
        run_ranks(_exit_without_reporting, 1)
    assert str(caught.value) == "rank 0 failed: exited with code 3"


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(port_free(p) for p in ports)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert not port_free(port)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the forkserver, and so its quiet preload, is CPU-only")
def test_ranks_on_cpu_print_no_megatron_import_notes(tmp_path):
    """megatron-core's "Transformer Engine and Apex are not installed" notes, printed at import, buried `megarl
    train`'s progress bar: the forkserver imports megatron, so its filters must be in place before that import.
    A fresh interpreter (a forkserver starts once per parent), one rank that builds megatron's optimizer modules."""
    import subprocess
    import sys

    script = ("from megarl.parallel.spawn import run_ranks\n"
              "from tests.test_spawn import _imports_megatron_optimizer\n"
              "print(run_ranks(_imports_megatron_optimizer, 1))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                          cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    assert "['megatron.core.optimizer.clip_grads']" in done.stdout  # the rank did import it
    assert "Transformer Engine" not in done.stderr, done.stderr


def _imports_megatron_optimizer(rank: int) -> str:
    import megatron.core.optimizer.clip_grads as clip_grads

    return clip_grads.__name__
