"""`megarl.sync.failpoints`: a disarmed point costs nothing and never waits; an armed one holds its caller, says so
(`<name>.reached`), and lets it go once the test removes the file. The fault matrix (tests/test_fault_matrix.py,
cells P and R) kills replicas at the two points the push has."""

from __future__ import annotations

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
