"""A `megarl train` that is sent SIGTERM (`kill`, a scheduler's time limit, a CI timeout) while it trains stops
what it started: its vLLM server's whole process group and its trainer ranks are gone, and it says so in one line
(exit 130), instead of dying at once and leaving the server computing (Python runs no cleanup on SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [(int(line.split(None, 1)[0]), line.split(None, 1)[1]) for line in out.strip().splitlines()]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from ps."""
    found, todo = [], [pid]
    while todo:
        kids = [child for child, _ in _children(todo.pop())]
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return "?"


def _alive_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_fleet_and_the_trainer(tiny_moe_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_FLEET_SECRET_FILE"}  # it starts its own fleet
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/repro.yaml", f"model.hf_dir={tiny_moe_dir}",
         f"run.dir={run_dir}", "run.steps=1000", "trainer.world_size=1", "rollout.tp=1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not train 2 steps in 300 s"
            time.sleep(0.5)
        children = _children(proc.pid)
        servers = [pid for pid, args in children if "vllm.entrypoints" in args]
        assert len(servers) == 1, children
        server_group = os.getpgid(servers[0])  # the server leads its own session: workers are in its group
        assert server_group == servers[0]
        # the trainer's side: its rank (spawned, or forked by a forkserver on CPU), the rank's reward workers, ...
        trainer_side = [pid for pid in _descendants(proc.pid) if _alive(pid) and os.getpgid(pid) != server_group]
        assert len(trainer_side) >= 2, children  # at least the rank (and on CPU the server it was forked from)

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 130, err[-3000:]
        assert "megarl: interrupted" in err, err[-3000:]
        deadline = time.monotonic() + 10
        while _alive_group(server_group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive_group(server_group), "the vLLM server (or one of its workers) outlived the run"
        # the forkserver and the reward workers exit when they see their parent gone: a moment later under load
        while [pid for pid in trainer_side if _alive(pid)] and time.monotonic() < deadline + 10:
            time.sleep(0.2)
        left = {pid: _cmdline(pid) for pid in trainer_side if _alive(pid)}
        assert not left, f"a trainer process outlived the run: {left}"
    finally:  # whatever failed: nothing it started may outlive the test (and hold its output pipes open)
        for pid in _descendants(proc.pid):
            try:  # a vLLM server leads its own process group: its workers go with it
                os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
