"""`megarl.sync.failpoints`: a disarmed point costs nothing and never waits; an armed one holds its caller, says so
(`<name>.reached`), and lets it go once the test removes the file; one armed with `fail` raises there, once;
`hold_before_first` holds a consumer as it asks for its first item, and only then. The fault matrix
(tests/test_fault_matrix.py, cells P, R and L) kills replicas at the three points the push has; its in-flight cells
(tests/test_fault_inflight.py) make a replica's load fail at one."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from megarl.sync import failpoints


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
