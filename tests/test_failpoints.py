"""`megarl.sync.failpoints`: a disarmed point costs nothing and never waits; an armed one holds its caller, says so
(`<name>.reached`), and lets it go once the test removes the file; one armed with `fail` raises there, once;
`hold_before_first` holds a consumer as it asks for its first item, and only then; one armed with `fail-if-held` or
`kill-if-held` lets every pass that holds no request with an output token by and fails, or kills its own process
group (only one that leads its session, as a fleet's server does), at the first that does, recording what was held.
The fault matrix (tests/test_fault_matrix.py, cells P, R and L) kills replicas at the points the push has; its
in-flight cells (tests/test_fault_inflight.py) make a replica's load fail, or the replica kill itself, at the first
push that finds requests held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megarl.sync import failpoints
from tests.dist_utils import process_state


def test_disarmed_points_do_not_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.hold("push.paused.replica0")  # no directory: returns
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    failpoints.hold("push.paused.replica0")  # a directory, the point not armed: returns
    assert list(tmp_path.iterdir()) == []


def test_an_armed_point_holds_until_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    (tmp_path / "push.report.replica1").write_text("")
    passed = threading.Event()
    caller = threading.Thread(target=lambda: (failpoints.hold("push.report.replica1"), passed.set()))
    caller.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "push.report.replica1.reached").exists():
        assert time.monotonic() < deadline, "the caller never reached the point"
        time.sleep(0.01)
    time.sleep(0.2)
    assert not passed.is_set(), "an armed point let its caller through"
    failpoints.hold("push.report.replica0")  # another point is not armed
    (tmp_path / "push.report.replica1").unlink()
    assert passed.wait(5), "the caller stayed after the point was released"
    caller.join()


def test_hold_before_first_holds_the_consumer_at_its_first_item_only(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    point = "push.loading.replica1"
    made: list[int] = []

    def items():  # records when each item is made: the point is reached after the first exists
        for i in range(3):
            made.append(i)
            yield i

    (tmp_path / point).write_text("")
    consumed: list[int] = []
    first = threading.Event()
    before = threading.Event()

    def consume() -> None:
        before.set()  # what the consumer does before asking for an item is not held
        for item in failpoints.hold_before_first(point, items()):
            consumed.append(item)
            first.set()

    caller = threading.Thread(target=consume)
    caller.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / f"{point}.reached").exists():
        assert time.monotonic() < deadline, "the consumer never reached the point"
        time.sleep(0.01)
    time.sleep(0.2)
    assert before.is_set() and made == [0] and consumed == [], (made, consumed)  # held between making and handing
    assert int((tmp_path / f"{point}.reached").read_text()) == os.getpid()
    (tmp_path / point).unlink()
    assert first.wait(5), "the consumer stayed after the point was released"
    caller.join(5)
    assert consumed == [0, 1, 2]
    # armed again: an empty iterable never reaches it; disarmed, nothing waits
    (tmp_path / f"{point}.reached").unlink()
    (tmp_path / point).write_text("")
    assert list(failpoints.hold_before_first(point, [])) == []
    assert not (tmp_path / f"{point}.reached").exists()
    (tmp_path / point).unlink()
    assert list(failpoints.hold_before_first(point, iter("ab"))) == ["a", "b"]


def test_a_point_armed_to_fail_raises_once_in_the_first_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    point = "push.loading.replica1"
    (tmp_path / point).write_text(failpoints.FAIL)
    consumed: list[str] = []
    with pytest.raises(failpoints.FailpointError, match=point):
        for item in failpoints.hold_before_first(point, iter("ab")):
            consumed.append(item)
    assert consumed == [] and int((tmp_path / f"{point}.reached").read_text()) == os.getpid()
    assert not (tmp_path / point).exists()  # disarmed by the failure: the next pass goes on
    assert list(failpoints.hold_before_first(point, iter("ab"))) == ["a", "b"]


def test_a_point_armed_to_fail_if_held_waits_for_a_pass_that_holds_an_output_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    point = "push.loading.replica1"
    (tmp_path / point).write_text(failpoints.FAIL_IF_HELD + "\n")
    # passes that hold nothing, or only requests without an output token yet, go by untouched; the point stays armed
    assert list(failpoints.hold_before_first(point, iter("ab"), lambda: {})) == ["a", "b"]
    failpoints.hold(point, lambda: {"megarl-b1-p0-00000000-0-aa": 0})
    assert (tmp_path / point).exists() and not (tmp_path / f"{point}.reached").exists()
    passed = [json.loads(line) for line in (tmp_path / f"{point}.passed").read_text().splitlines()]
    assert [p["held"] for p in passed] == [{}, {"megarl-b1-p0-00000000-0-aa": 0}]
    # the first pass holding a request with a token fails, records what it saw, and disarms the point
    held = {"megarl-b2-p3-0000abcd-0-bb": 5, "megarl-b2-p1-0000abcd-1-cc": 0}
    consumed: list[str] = []
    with pytest.raises(failpoints.FailpointError, match=f"{point} with requests held"):
        for item in failpoints.hold_before_first(point, iter("ab"), lambda: held):
            consumed.append(item)
    record = json.loads((tmp_path / f"{point}.reached").read_text())
    assert consumed == [] and record["held"] == held and record["pid"] == os.getpid()
    assert record["pgid"] == os.getpgrp() and abs(record["time"] - time.time()) < 60
    assert not (tmp_path / point).exists()
    assert list(failpoints.hold_before_first(point, iter("ab"), lambda: held)) == ["a", "b"]  # once
    # a point that knows nothing of held requests refuses such a mode, naming it
    (tmp_path / "push.paused.replica1").write_text(failpoints.FAIL_IF_HELD)
    with pytest.raises(failpoints.FailpointError, match="knows no held requests"):
        failpoints.hold("push.paused.replica1")


_KILLED_CHILD = """
import os, subprocess, sys, time
from megarl.sync import failpoints
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in this process's group
print(grandchild.pid, flush=True)
failpoints.hold("push.held.replica1", lambda: {})  # holds nothing: goes on
try:
    failpoints.hold("push.held.replica1", lambda: {"megarl-b4-p2-00000000-0-aa": 3})
except failpoints.FailpointError as err:
    print("raised:", err, flush=True)
    grandchild.kill()
    sys.exit(3)
time.sleep(30)
sys.exit(0)
"""


def _run_child(tmp_path: Path, **popen: object) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, failpoints.ENV: str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD], env=env, stdout=subprocess.PIPE, text=True,
                             **popen)
    grandchild = int(child.stdout.readline())
    child.wait(60)
    return child, grandchild


def test_a_point_armed_to_kill_if_held_kills_its_own_process_group(tmp_path: Path) -> None:
    point = "push.held.replica1"
    (tmp_path / point).write_text(failpoints.KILL_IF_HELD)
    child, grandchild = _run_child(tmp_path, start_new_session=True)  # as the fleet starts a server
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stdout.read())
    deadline = time.monotonic() + 10
    while _alive(grandchild):  # the whole group went, not only the process at the point
        assert time.monotonic() < deadline, f"process {grandchild} of the killed group survived"
        time.sleep(0.05)
    record = json.loads((tmp_path / f"{point}.reached").read_text())
    assert record["pid"] == record["pgid"] == child.pid and record["held"] == {"megarl-b4-p2-00000000-0-aa": 3}
    assert [json.loads(line)["held"] for line in (tmp_path / f"{point}.passed").read_text().splitlines()] == [{}]
    assert not (tmp_path / point).exists()


def test_kill_if_held_refuses_a_group_that_does_not_lead_its_session(tmp_path: Path) -> None:
    """A process group of its own inside the caller's session (not how the fleet starts a server): it raises."""
    point = "push.held.replica1"
    (tmp_path / point).write_text(failpoints.KILL_IF_HELD)
    child, grandchild = _run_child(tmp_path, process_group=0)
    out = child.stdout.read()
    assert child.returncode == 3 and "does not lead its own session" in out, (child.returncode, out)
    assert not (tmp_path / point).exists()


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


# a stand-in engine core: a process named as vLLM names its engine core, whose child (a "worker") reaches the point
_ENGINE = """
import subprocess, sys
with open("/proc/self/comm", "w") as f:
    f.write(sys.argv[1])
worker = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
print(worker.pid, flush=True)
worker.wait()
"""
_WORKER = """
from megarl.sync import failpoints
try:
    failpoints.hold("push.loading.replica1", lambda: {})  # kill-engine-if-held: holds nothing, goes on
    failpoints.hold("push.loading.replica1", lambda: {"megarl-b4-p2-00000000-0-aa": 3})
except failpoints.FailpointError as err:
    print("worker raised:", err, flush=True)
"""


@pytest.mark.parametrize(("name", "mode"), [("VLLM::EngineCore", failpoints.KILL_ENGINE),
                                            ("VLLM::EngineCore", failpoints.KILL_ENGINE_IF_HELD),
                                            ("python3", failpoints.KILL_ENGINE)])
def test_a_point_armed_to_kill_engine_kills_the_workers_engine_core_or_refuses(tmp_path: Path, name: str,
                                                                              mode: str) -> None:
    point = "push.loading.replica1"
    (tmp_path / point).write_text(mode)
    env = {**os.environ, failpoints.ENV: str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, name, _WORKER], env=env, stdout=subprocess.PIPE,
                              text=True)
    out, _ = engine.communicate(timeout=60)
    worker = int(out.split()[0])
    if name.startswith(failpoints.ENGINE_CORE_COMM):  # killed by its worker, which recorded it and disarmed the point
        assert engine.returncode == -signal.SIGKILL, (engine.returncode, out)
        assert "worker raised: failure injected at failpoint push.loading.replica1: its engine core" in out, out
        record = json.loads((tmp_path / f"{point}.reached").read_text())
        assert record["pid"] == worker and record["engine_core"] == engine.pid, record
        assert not (tmp_path / point).exists()
        if mode == failpoints.KILL_ENGINE_IF_HELD:  # the first pass held nothing and went by; the second fired
            assert record["held"] == {"megarl-b4-p2-00000000-0-aa": 3} and record["pgid"] == os.getpgrp(), record
            assert len((tmp_path / f"{point}.passed").read_text().splitlines()) == 1
        else:  # the first pass fired
            assert "held" not in record and not (tmp_path / f"{point}.passed").exists(), record
    else:  # the parent is no engine core: nothing killed, the point still armed
        assert engine.returncode == 0 and "is not a vLLM engine core" in out, out
        assert (tmp_path / point).exists() and not (tmp_path / f"{point}.reached").exists()


def test_a_point_armed_to_stop_engine_if_held_stops_the_engine_core_and_goes_on(tmp_path: Path) -> None:
    """`stop-engine-if-held`: the stand-in engine core is stopped (hung, never continued) by its worker at the first
    pass with a token held; the worker is not stopped and raises nothing (it answers as if nothing happened)."""
    point = "push.held.replica1"
    (tmp_path / point).write_text(failpoints.STOP_ENGINE_IF_HELD)
    env = {**os.environ, failpoints.ENV: str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    worker_code = _WORKER.replace("push.loading.replica1", point) + "print('worker went on', flush=True)\n"
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, "VLLM::EngineCore", worker_code], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine.stdout.readline())
        assert engine.stdout.readline().strip() == "worker went on"  # its parent stopped: it printed, then ended
        deadline = time.monotonic() + 10
        while process_state(engine.pid) != "T":
            assert time.monotonic() < deadline, f"the engine core is {process_state(engine.pid)!r}, not stopped"
            time.sleep(0.05)
        record = json.loads((tmp_path / f"{point}.reached").read_text())
        assert record["pid"] == worker and record["engine_core"] == engine.pid, record
        assert record["held"] == {"megarl-b4-p2-00000000-0-aa": 3}, record
        assert len((tmp_path / f"{point}.passed").read_text().splitlines()) == 1  # the first pass held nothing
        assert not (tmp_path / point).exists()
    finally:
        engine.kill()  # ends a stopped process too
        engine.wait(30)


def test_a_point_armed_to_kill_a_process_kills_it_once_and_goes_on(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`kill <pid>`: the first pass SIGKILLs the named process (a real one: its exit status says how it ended) and
    returns at once, records it and disarms the point; a later pass goes by; a victim already gone is recorded, and
    an arming without a process id is refused naming the form."""
    monkeypatch.setenv(failpoints.ENV, str(tmp_path))
    point = "push.report.replica1"
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / point).write_text(f"{failpoints.KILL_PROCESS} {victim.pid}")
        started = time.monotonic()
        failpoints.hold(point)
        assert time.monotonic() - started < 1.0, "the passing process waited"
        assert victim.wait(10) == -signal.SIGKILL
        record = json.loads((tmp_path / f"{point}.reached").read_text())
        assert (record["pid"], record["victim"], record["killed"]) == (os.getpid(), victim.pid, True), record
        assert not (tmp_path / point).exists()
        failpoints.hold(point)  # disarmed: goes by
    finally:
        victim.kill()
        victim.wait(10)
    (tmp_path / point).write_text(f"{failpoints.KILL_PROCESS} {victim.pid}")  # reaped: no such process any more
    failpoints.hold(point)
    assert json.loads((tmp_path / f"{point}.reached").read_text())["killed"] is False
    (tmp_path / point).write_text(failpoints.KILL_PROCESS)
    with pytest.raises(failpoints.FailpointError, match="takes one process id, e.g. 'kill 1234'"):
        failpoints.hold(point)
